"""``zeppelin verify``: run the engine on emulated nodes and check it against the dense reference.

Starts one gloo process per GPU of the emulated cluster (``--nodes 2 --gpus-per-node 2``), plans
one batch, and runs every case on random data in one process group:

* ``zeppelin``: the Zeppelin plan with every ring flat, routing on (proxies) and off (direct
  sends);
* ``zeppelin-2d``: the same plan with every inter-node document run with the 2-D scheme (heads
  split inside each node, one ring per rail across nodes; ``planner/plan/heads.py``), when the batch
  has one and the heads split over a node's GPUs (the planner chooses per document between the
  two; here both run on the same batch and the same token layout);
* ``te-ring-cp``: TransformerEngine-style static ring CP over the same batch (every round).

Each case feeds the engine the way the Megatron layer does: Q, K, V start in the plan's linear
layout, move to the attention layout (``comm.remap``), run through ``ZeppelinAttention``, and the
output moves back; the loss is ``sum(out * dout)`` for a random ``dout``. It reports:

* the largest relative error (max-abs error over max-abs value) of the output and of dQ, dK, dV
  against ``testing.reference`` in float64 (on the inputs rounded to ``--dtype``), and against
  the same batch on one GPU in the same dtype (every document local on one rank, same kernel);
  tolerances come from the dtype (``testing.tolerances``);
* the bytes per link class counted from the sends the exchanger made over the whole forward and
  backward against the plan's prediction (``schedule.engine_link_bytes``);
* ``posting_order_consistent``: every rank's point-to-point batches (communicator, peer,
  direction, bytes) are recorded as they are posted, with NCCL's discipline (staged, one
  communicator order), and replayed under NCCL's matching rules (``comm.posting``);
* with ``--step-timing`` (on by default with ``--device cuda``): per tier the compute, the
  communication and the exposed communication of each rank (``attention.step_timing``: CUDA
  events on GPUs, the host clock on CPU, where gloo's waits block the host).

Exit status 0 when every error is within tolerance, every byte count matches and every posting
order is consistent, 1 otherwise. ``--device cuda`` runs one process per GPU over NCCL (the
Zeppelin groups; the harness's own group stays gloo); it needs as many GPUs as emulated ranks.

Examples::

    zeppelin verify
    zeppelin verify --nodes 2 --gpus-per-node 2 --dist prolong --tokens 8192 --seed 3 --json v.json
    python -m megatron_zeppelin.commands.verify --lengths lengths.txt --dtype float32

Shapes: ``_tnd`` tensors are (t tokens, n heads, d head dim), ``_tf`` are (t tokens, features).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import torch

from megatron_zeppelin.comm.posting import check_posting_order
from megatron_zeppelin.commands.profile import check_kernel, check_positive
from megatron_zeppelin.commands.verify_run import (
    Case,
    EngineSpec,
    predicted_bytes,
    reference,
    single_gpu,
    worker,
)
from megatron_zeppelin.devices import require_gpus
from megatron_zeppelin.fileio import atomic_write_text, format_bytes
from megatron_zeppelin.launch.ranks import DistributedRunError, run_distributed, whole_run_timeout
from megatron_zeppelin.planner.baselines.baselines import build_baseline
from megatron_zeppelin.planner.baselines.distributions import read_lengths_file, sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.place.schemes import every_two_d
from megatron_zeppelin.planner.plan.heads import head_groups
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.testing.tolerances import relative_error, tolerance
from megatron_zeppelin.topology.model import Topology

__all__ = ["Case", "EngineSpec", "build_cases", "compare", "main", "verify", "worker"]

DTYPES = ("float64", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")


# --- parent: plans, reference, report ----------------------------------------------------------
def _gathered(results: list[list[dict]], index: int, name: str, like):  # noqa: ANN001, ANN202
    """Case ``index``'s ``name`` of every rank, in packed-row order, in float64."""
    got = torch.zeros(like.shape, dtype=torch.float64)
    for per_rank in results:
        got[per_rank[index]["rows"]] = per_rank[index][name].to(torch.float64)
    return got


def _timing(results: list[list[dict]], index: int) -> dict[str, Any] | None:
    """Per-tier step timings of every rank and, per tier, the largest over ranks."""
    per_rank = [r[index]["step_timing"] for r in results]
    if any(t is None for t in per_rank):
        return None
    worst: dict[str, dict[str, float]] = {}
    for timing in per_rank:
        for tier, figures in timing.items():
            into = worst.setdefault(tier, dict.fromkeys(figures, 0.0))
            for key, value in figures.items():
                into[key] = max(into[key], value)
    return {"per_rank": per_rank, "max_over_ranks": worst}


def compare(cases: list[Case], results: list[list[dict]], spec: EngineSpec) -> list[dict]:
    """Per case: errors against the float64 reference and against one GPU in the same dtype,
    measured vs predicted bytes, the posting-order check and the step timings."""
    report = []
    for index, case in enumerate(cases):
        plan, case_spec = case.plan, case.spec(spec)
        dtype = getattr(torch, case_spec.dtype)
        ref = reference(tuple(plan.lengths), case_spec)
        one = single_gpu(tuple(plan.lengths), case_spec)
        errors, vs_one = {}, {}
        for name in ("out", "dq", "dk", "dv"):
            got = _gathered(results, index, name, ref[name])
            errors[name] = relative_error(got, ref[name])
            vs_one[name] = relative_error(got, one[name])
        measured = results[0][index]["bytes"]
        predicted = predicted_bytes(plan, case_spec, routing=case.routing)
        consistent, posting_note = check_posting_order([r[index]["posting"] for r in results])
        tol, tol_one = tolerance(dtype), tolerance(dtype, against="same-dtype")
        entry = {
            "case": case.name,
            "routing": case.routing,
            "dtype": case_spec.dtype,
            "seconds": max(r[index]["seconds"] for r in results),
            "tiers": plan.tier_counts(),
            "two_d_documents": sum(seq.is_two_d for seq in plan.sequences),
            "errors": errors,
            "tolerance": tol,
            "errors_vs_single_gpu": vs_one,
            "tolerance_vs_single_gpu": tol_one,
            "measured_bytes": measured,
            "predicted_bytes": predicted,
            "bytes_match": measured == predicted,
            "remap_exact": all(r[index]["remap_exact"] for r in results),
            "posting_order_consistent": consistent,
            "posting_order": posting_note,
            "step_timing": _timing(results, index),
        }
        entry["ok"] = bool(
            entry["bytes_match"]
            and entry["remap_exact"]
            and consistent
            and max(errors.values()) <= tol
            and max(vs_one.values()) <= tol_one
        )
        if "bad_input" in results[0][index]:
            entry["bad_input"] = results[0][index]["bad_input"]
        report.append(entry)
    return report


def build_cases(
    lengths: list[int], *, topology, cost_model, capacity: int, options=None, heads=None
) -> list[Case]:
    """Zeppelin's plan with flat rings, routing on and off; the same plan with its inter-node
    documents on the 2-D scheme (``heads``: the run's ``(query heads, K/V heads)``; none when
    they do not split over a node's GPUs); every round of the TE-style ring baseline."""

    flat = dataclasses.replace(options or PlannerOptions(), two_d=False)
    plan = plan_batch(
        lengths, topology=topology, cost_model=cost_model, capacity=capacity, options=flat
    )
    cases = [Case("zeppelin", plan, True), Case("zeppelin", plan, False)]
    try:
        if heads is not None:
            head_groups(*heads, topology.gpus_per_node)
        two_d = every_two_d(plan)
    except ValueError:
        two_d = plan
    if two_d.sequences != plan.sequences:
        cases.append(Case("zeppelin-2d", two_d, True))
    rounds = build_baseline("te-ring-cp", lengths, topology=topology, capacity=capacity)
    for i, baseline in enumerate(rounds):
        name = "te-ring-cp" if len(rounds) == 1 else f"te-ring-cp round {i + 1}/{len(rounds)}"
        cases.append(Case(name, baseline, False))
    return cases


def verify(cases: list[Case], spec: EngineSpec) -> list[dict]:
    """Run ``cases`` on one gloo process per rank and compare them (see the module docstring)."""
    world = cases[0].plan.world_size
    if any(c.plan.world_size != world for c in cases):
        raise ValueError("every case must plan for the same number of ranks")
    results = run_distributed(
        worker,
        world,
        timeout_s=whole_run_timeout(spec.timeout_s),
        comm_timeout_s=spec.timeout_s,
        args=(cases, spec),
    )
    return compare(cases, results, spec)


# --- the command -------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    batch = parser.add_argument_group("batch")
    batch.add_argument("--lengths", metavar="FILE", help="document lengths, one per line")
    batch.add_argument(
        "--dist",
        metavar="NAME",
        default=None,
        help=f"draw lengths from a distribution ({DEFAULT_DIST})",
    )
    batch.add_argument("--tokens", type=int, default=2048, help="tokens in the batch (--dist)")
    batch.add_argument("--seed", type=int, default=0, help="seed of the batch and of the data")
    batch.add_argument("--max-length", type=int, default=None, help="cut longer documents")
    cluster = parser.add_argument_group("emulated cluster (one gloo process per GPU)")
    cluster.add_argument("--nodes", type=int, default=2)
    cluster.add_argument("--gpus-per-node", type=int, default=2)
    cluster.add_argument("--nics-per-node", type=int, default=None, help="default: one per GPU")
    cluster.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="tokens per GPU; default: the even share times 1.25",
    )
    planner = parser.add_argument_group("planner")
    planner.add_argument("--model", default="llama-7b", help="cost-model preset")
    planner.add_argument(
        "--thresholds",
        default=DEFAULT_THRESHOLDS,
        metavar="INTRA,INTER",
        help="tier thresholds in tokens, or auto (default: small, so a small batch uses every "
        f"tier: {DEFAULT_THRESHOLDS})",
    )
    planner.add_argument(
        "--linear-layout",
        choices=("even", "node", "attention", "auto"),
        default="even",
        help="linear layout to plan (default even: every remapping path moves tokens)",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument("--heads", type=int, default=EngineSpec.num_heads)
    engine.add_argument("--kv-heads", type=int, default=EngineSpec.num_kv_heads)
    engine.add_argument("--head-dim", type=int, default=EngineSpec.head_dim)
    engine.add_argument(
        "--dtype",
        choices=DTYPES,
        default=EngineSpec.dtype,
        help="dtype of Q, K, V (tolerances follow from it)",
    )
    engine.add_argument("--kernel", default=EngineSpec.kernel, help="attention kernel")
    engine.add_argument(
        "--device",
        choices=DEVICES,
        default=EngineSpec.device,
        help="cpu: gloo processes; cuda: one GPU per rank over NCCL",
    )
    engine.add_argument(
        "--step-timing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="report compute, communication and exposed communication per tier (default: on "
        "with --device cuda, where CUDA events time them)",
    )
    engine.add_argument(
        "--timeout",
        type=float,
        default=EngineSpec.timeout_s,
        help="seconds a transfer may wait for a peer before the run fails, "
        "naming the rank that stalled",
    )
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")


def _check_devices(device: str, world_size: int) -> None:
    """``--device cuda`` needs one GPU per emulated rank (NCCL refuses two ranks on one GPU)."""
    if device == "cuda":
        require_gpus(world_size, fix="use --device cpu or fewer --nodes/--gpus-per-node")


DEFAULT_DIST = "wikipedia"
DEFAULT_THRESHOLDS = "64,512"


def _inputs(args: argparse.Namespace):
    """Lengths, topology, cost model, capacity and planner options from the flags."""
    if args.lengths is not None and args.dist is not None:
        raise ValueError("give the batch with one of --lengths FILE or --dist NAME, not both")
    if args.lengths is not None:
        lengths = read_lengths_file(args.lengths)
    else:
        lengths = sample_lengths(
            args.dist or DEFAULT_DIST,
            num_tokens=args.tokens,
            seed=args.seed,
            max_length=args.max_length,
        )
    nics = args.nics_per_node if args.nics_per_node is not None else args.gpus_per_node
    topology = Topology(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node, nics_per_node=nics)
    cost_model = CostModel.default(get_model(args.model), topology)
    capacity = args.capacity
    if capacity is None:
        capacity = -(-sum(lengths) * 5 // (4 * topology.world_size))
    if capacity < 1:
        raise ValueError(f"--capacity must be a positive number of tokens, got {capacity}")
    thresholds: Any = "auto"
    if args.thresholds != "auto":
        try:
            thresholds = tuple(int(t) for t in args.thresholds.split(","))
        except ValueError:
            raise ValueError(
                f"--thresholds takes INTRA,INTER tokens or auto, got {args.thresholds!r}"
            ) from None
        if len(thresholds) != 2:
            raise ValueError(
                f"--thresholds takes two numbers, INTRA,INTER; got {args.thresholds!r}"
            )
    options = PlannerOptions(thresholds=thresholds, linear_layout=args.linear_layout)
    return lengths, topology, cost_model, capacity, options


REFERENCE_COPIES = 4
"""Score matrices the dense reference holds at once for its backward (scores, mask, softmax,
gradient), each ``heads x L x L`` float64."""


def _check_reference_fits(lengths: list[int], spec: EngineSpec) -> None:
    """Refuse a batch whose dense float64 reference would not fit in this machine's memory."""

    longest = max(lengths)
    need = REFERENCE_COPIES * spec.num_heads * longest * longest * 8
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return  # cannot tell: let the run try
    if need > have // 2:
        raise ValueError(
            f"the dense reference of a {longest}-token document needs about {format_bytes(need)} "
            f"({spec.num_heads} heads x L^2 float64 scores) but this machine has "
            f"{format_bytes(have)}: verify on shorter documents (--max-length) or fewer --heads"
        )


def format_report(report: list[dict]) -> list[str]:
    lines = [
        f"{'case':<22} {'routing':<7} {'out':>9} {'dQ':>9} {'dK':>9} {'dV':>9} "
        f"{'vs 1 GPU':>9}  {'nvlink bytes':>23}  {'nic bytes':>23}  order  ok"
    ]
    for e in report:
        err = e["errors"]
        m, p = e["measured_bytes"], e["predicted_bytes"]
        lines.append(
            f"{e['case']:<22} {'on' if e['routing'] else 'off':<7} "
            + " ".join(f"{err[k]:9.1e}" for k in ("out", "dq", "dk", "dv"))
            + f" {max(e['errors_vs_single_gpu'].values()):9.1e}"
            + f"  {m['nvlink']:>11}/{p['nvlink']:<11}  {m['nic']:>11}/{p['nic']:<11}  "
            + ("yes  " if e["posting_order_consistent"] else "NO   ")
            + ("yes" if e["ok"] else "NO")
        )
        nics = sorted(k for k in set(m) | set(p) if k.startswith("nic:"))
        if nics:
            lines.append(
                "    per NIC (measured/predicted): "
                + ", ".join(f"{k[4:]} {m.get(k, 0)}/{p.get(k, 0)}" for k in nics)
            )
        if not e["posting_order_consistent"]:
            lines.append(f"    posting order: {e['posting_order']}")
        if e["step_timing"] is not None:
            for tier, t in sorted(e["step_timing"]["max_over_ranks"].items()):
                lines.append(
                    f"    {tier:<6} compute {t['compute_ms']:8.2f} ms  communication "
                    f"{t['comm_ms']:8.2f} ms  exposed {t['exposed_ms']:8.2f} ms (max over ranks)"
                )
    return lines


def run(args: argparse.Namespace) -> int:
    # Everything the workers would trip over is refused here, before a process starts.
    check_kernel(args.kernel, emulated=args.device == "cpu")
    check_positive(
        heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, timeout=args.timeout
    )
    lengths, topology, cost_model, capacity, options = _inputs(args)
    step_timing = args.device == "cuda" if args.step_timing is None else args.step_timing
    spec = EngineSpec(
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        kernel=args.kernel,
        seed=args.seed,
        timeout_s=args.timeout,
        device=args.device,
        step_timing=step_timing,
    )
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"--heads {spec.num_heads} must be a multiple of --kv-heads {spec.num_kv_heads}"
        )
    _check_devices(args.device, topology.world_size)
    _check_reference_fits(lengths, spec)
    cases = build_cases(
        lengths,
        topology=topology,
        cost_model=cost_model,
        capacity=capacity,
        options=options,
        heads=(spec.num_heads, spec.num_kv_heads),
    )
    kind = "gloo processes" if args.device == "cpu" else "GPUs over NCCL"
    print(
        f"{len(lengths)} documents, {sum(lengths)} tokens (longest {max(lengths)}) on "
        f"{topology.num_nodes} x {topology.gpus_per_node} {kind}, {spec.dtype}, "
        f"capacity {capacity}; zeppelin tiers {cases[0].plan.tier_counts()}"
    )
    if not any(c.name == "zeppelin-2d" for c in cases):
        print(
            f"no zeppelin-2d case: no inter-node document, or {spec.num_heads} query heads "
            f"and {spec.num_kv_heads} K/V heads do not split over {topology.gpus_per_node} "
            "GPUs per node"
        )
    start = time.monotonic()
    try:
        report = verify(cases, spec)
    except DistributedRunError as exc:  # a rank died, stalled or failed: one line, story in a log
        print(
            f"zeppelin verify: error: {exc.summary} (every rank's traceback: "
            f"{exc.write_log('zeppelin-verify')})",
            file=sys.stderr,
        )
        return 1
    print("\n".join(format_report(report)))
    ok = all(e["ok"] for e in report)
    verdict = "all checks passed" if ok else "CHECKS FAILED"
    print(
        f"{verdict} in {time.monotonic() - start:.1f} s (relative error = max|got - ref| / "
        f"max|ref| against float64, tolerance {report[0]['tolerance']:.0e}; against one GPU "
        f"in {spec.dtype}, tolerance {report[0]['tolerance_vs_single_gpu']:.0e}; order: "
        "posting order consistent under NCCL's rules)"
    )
    if args.json:
        document = {
            "lengths": lengths,
            "topology": topology.to_dict(),
            "capacity": capacity,
            "spec": dataclasses.asdict(spec),
            "cases": report,
            "ok": ok,
        }
        atomic_write_text(args.json, json.dumps(document, indent=1))
        print(f"report written to {args.json}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_zeppelin.commands.verify``: the same as ``zeppelin verify``."""
    parser = argparse.ArgumentParser(prog="zeppelin verify", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    # lazy: run through the imported module, not ``__main__``: the worker processes unpickle
    # the worker function and the cases by their module's name.
    from megatron_zeppelin.commands import verify as this_module

    try:
        return this_module.run(args)
    except ValueError as exc:
        print(f"zeppelin verify: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
