"""``zeppelin verify``: run the engine on emulated nodes and check it against the dense reference.

Starts one gloo process per GPU of the emulated cluster (``--nodes 2 --gpus-per-node 2``), plans
one batch, and runs every case on random data in one process group:

* ``zeppelin``: the Zeppelin plan with every ring flat, routing on (proxies) and off (direct
  sends);
* ``zeppelin-2d``: the same plan with every inter-node document run with the 2-D scheme (heads
  split inside each node, one ring per rail across nodes; ``planner/heads.py``), when the batch
  has one and the heads split over a node's GPUs (the planner chooses per document between the
  two; here both run on the same batch and the same token layout);
* ``te-ring-cp``: TransformerEngine-style static ring CP over the same batch (every round).

Each case feeds the engine the way the Megatron layer does: Q, K, V start in the plan's linear
layout, move to the attention layout (``comm.remap``), run through ``ZeppelinAttention``, and the
output moves back; the loss is ``sum(out * dout)`` for a random ``dout``. It reports the largest
relative error (max-abs error over max-abs value) of the output and of dQ, dK, dV against
``testing.reference`` in float64, and the bytes per link class counted from the sends the
exchanger made over the whole forward and backward against the plan's prediction
(``schedule.engine_link_bytes``). Exit status 0 when every error is within
``testing.tolerances`` and every byte count matches, 1 otherwise.

Examples::

    zeppelin verify
    zeppelin verify --nodes 2 --gpus-per-node 2 --dist prolong --tokens 8192 --seed 3 --json v.json
    python -m megatron_zeppelin.commands.verify --lengths lengths.txt --dtype float32

Shapes: ``_tnd`` tensors are (t tokens, n heads, d head dim), ``_tf`` are (t tokens, features).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("float64", "float32")


@dataclass(frozen=True)
class EngineSpec:
    """Attention shape and numerics of a verification run."""

    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    dtype: str = "float64"
    kernel: str = "auto"
    seed: int = 0
    timeout_s: float = 60.0


@dataclass(frozen=True)
class Case:
    """One plan run with routing on or off."""

    name: str
    plan: Any  # planner.plan.Plan (kept untyped so this module imports without torch)
    routing: bool
    dtype: str | None = None
    """Overrides ``EngineSpec.dtype`` for this case."""
    checks: dict[str, Any] = field(default_factory=dict)
    """Extra checks the worker runs (``bad_input``: the engine's ValueErrors)."""

    def spec(self, spec: EngineSpec) -> EngineSpec:
        return dataclasses.replace(spec, dtype=self.dtype) if self.dtype else spec


# --- worker: runs on every rank ----------------------------------------------------------------
def run_case(rank: int, case: Case, spec: EngineSpec, groups: Any) -> dict[str, Any]:
    """Run one case on this rank; return its results in packed-row order plus its byte counts."""
    import torch

    from megatron_zeppelin.attention.engine import ZeppelinAttention
    from megatron_zeppelin.comm import DistExchanger, LinkCounters
    from megatron_zeppelin.comm.remap import attention_to_linear, linear_to_attention
    from megatron_zeppelin.testing.reference import attention_rows, linear_rows, random_qkv

    spec = case.spec(spec)
    plan, dtype = case.plan, getattr(torch, spec.dtype)
    q_tnd, k_tnd, v_tnd = random_qkv(plan.num_tokens, num_heads=spec.num_heads,
                                     num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                     dtype=dtype, seed=spec.seed)  # fmt: skip
    dout_tnd = _dout(plan.num_tokens, spec).to(dtype)
    rows_lin, rows_att = linear_rows(plan, rank), attention_rows(plan, rank)
    counters = LinkCounters(plan.topology)
    exchanger = DistExchanger(groups, plan=plan, routing=case.routing, counters=counters,
                              timeout_s=spec.timeout_s)  # fmt: skip
    engine = ZeppelinAttention(plan, rank, exchanger, kernel=spec.kernel)

    # As in the Megatron layer: linear layout -> attention layout -> engine -> linear layout.
    inputs = [x[rows_lin].clone().requires_grad_(True) for x in (q_tnd, k_tnd, v_tnd)]
    moved = [linear_to_attention(x, plan, rank, None) for x in inputs]
    remap_exact = all(torch.equal(m, x[rows_att]) for m, x in zip(moved, (q_tnd, k_tnd, v_tnd)))
    # The round trip is the identity, forward and backward.
    x = inputs[0].detach().requires_grad_(True)
    back = attention_to_linear(linear_to_attention(x, plan, rank, None), plan, rank, None)
    (grad,) = torch.autograd.grad(back, x, dout_tnd[rows_lin])
    remap_exact &= torch.equal(back, x) and torch.equal(grad, dout_tnd[rows_lin])
    out_tnd = attention_to_linear(engine(*moved), plan, rank, None)
    (out_tnd * dout_tnd[rows_lin]).sum().backward()
    result = {
        "rows": rows_lin,
        "out": out_tnd.detach(),
        "dq": inputs[0].grad,
        "dk": inputs[1].grad,
        "dv": inputs[2].grad,
        "bytes": counters.all_reduce(),
        "remap_exact": bool(remap_exact),
    }
    if case.checks.get("bad_input"):
        result["bad_input"] = _bad_input_messages(engine, moved, plan, rank, exchanger)
    return result


def _dout(num_tokens: int, spec: EngineSpec):
    """The upstream gradient of the output (float64, packed rows), the same on every rank."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed + 7919)
    shape = (num_tokens, spec.num_heads, spec.head_dim)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _bad_input_messages(engine, qkv, plan, rank: int, exchanger) -> dict[str, str | None]:
    """The engine's error for each kind of bad input (``None`` when it accepted it)."""
    import torch

    from megatron_zeppelin.attention.engine import ZeppelinAttention

    q, k, v = (x.detach() for x in qkv)
    wrong_world = _plan_on(plan, plan.topology.with_nodes(plan.topology.num_nodes + 1))
    attempts = {
        "token_count": lambda: engine(q[1:], k[1:], v[1:]),
        "dtype": lambda: engine(q, k.to(torch.float16), v),
        "head_count": lambda: engine(q[:, :1], k, v),
        "kv_heads": lambda: engine(q, k[:, :1].expand(-1, 3, -1).contiguous(), v),
        "world_size": lambda: ZeppelinAttention(wrong_world, rank, exchanger),
    }
    out: dict[str, str | None] = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _plan_on(plan, topology):
    """``plan``'s documents placed the same way on a larger cluster (its extra ranks idle)."""
    from megatron_zeppelin.planner.plan import Plan

    linear = list(plan.linear) + [()] * (topology.world_size - plan.world_size)
    return Plan(topology=topology, sequences=plan.sequences, linear=linear, name=plan.name)


def worker(rank: int, world_size: int, cases: list[Case], spec: EngineSpec) -> list[dict]:
    """Entry point of each gloo process (``testing.dist.run_distributed``)."""
    from megatron_zeppelin.comm import ZeppelinGroups

    groups = ZeppelinGroups.create(cases[0].plan.topology)
    results = []
    for case in cases:
        start = time.perf_counter()
        results.append(run_case(rank, case, spec, groups))
        results[-1]["seconds"] = time.perf_counter() - start
    return results


# --- parent: plans, reference, report ----------------------------------------------------------
def predicted_bytes(plan, spec: EngineSpec, *, routing: bool) -> dict[str, int]:
    """Bytes per link class one forward and backward of the engine sends for ``plan``
    (``schedule.engine_link_bytes``): K and V around the flat rings in the forward, again in
    the backward, and dK, dV behind them; for 2-D documents the head all-to-alls and the rings
    across nodes too (gradients in float32 for half-precision inputs, as the engine sends)."""
    from megatron_zeppelin.comm.counters import comparable
    from megatron_zeppelin.planner.schedule import engine_link_bytes

    return comparable(engine_link_bytes(plan, _shape(spec), routing=routing))


def _shape(spec: EngineSpec):
    """The ``heads.AttentionShape`` of a verification run."""
    import torch

    from megatron_zeppelin.planner.heads import AttentionShape

    dtype = getattr(torch, spec.dtype)
    grad_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return AttentionShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, dtype.itemsize,
                          grad_dtype.itemsize)  # fmt: skip


@functools.lru_cache(maxsize=8)
def reference(lengths: tuple[int, ...], spec: EngineSpec) -> dict[str, Any]:
    """The float64 dense reference of a batch (documents in packed order) on the inputs the
    workers drew, rounded to ``spec.dtype`` as theirs were: output and input gradients."""
    import torch

    from megatron_zeppelin.testing.reference import random_qkv, reference_attention

    dtype = getattr(torch, spec.dtype)
    num_tokens = sum(lengths)
    qkv = random_qkv(num_tokens, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                     head_dim=spec.head_dim, dtype=dtype, seed=spec.seed)  # fmt: skip
    qkv = [x.to(torch.float64).requires_grad_(True) for x in qkv]
    out = reference_attention(*qkv, lengths)
    (out * _dout(num_tokens, spec).to(dtype).to(torch.float64)).sum().backward()
    return {"out": out.detach(), "dq": qkv[0].grad, "dk": qkv[1].grad, "dv": qkv[2].grad}


def compare(cases: list[Case], results: list[list[dict]], spec: EngineSpec) -> list[dict]:
    """Per case: errors against the float64 reference and measured vs predicted bytes."""
    import torch

    from megatron_zeppelin.testing.tolerances import relative_error, tolerance

    report = []
    for index, case in enumerate(cases):
        plan, case_spec = case.plan, case.spec(spec)
        ref = reference(tuple(plan.lengths), case_spec)
        errors = {}
        for name in ("out", "dq", "dk", "dv"):
            got = torch.zeros_like(ref[name])
            for per_rank in results:
                got[per_rank[index]["rows"]] = per_rank[index][name].to(torch.float64)
            errors[name] = relative_error(got, ref[name])
        measured = results[0][index]["bytes"]
        predicted = predicted_bytes(plan, case_spec, routing=case.routing)
        tol = tolerance(getattr(torch, case_spec.dtype))
        entry = {
            "case": case.name,
            "routing": case.routing,
            "dtype": case_spec.dtype,
            "seconds": max(r[index]["seconds"] for r in results),
            "tiers": plan.tier_counts(),
            "two_d_documents": sum(seq.is_two_d for seq in plan.sequences),
            "errors": errors,
            "tolerance": tol,
            "measured_bytes": measured,
            "predicted_bytes": predicted,
            "bytes_match": measured == predicted,
            "remap_exact": all(r[index]["remap_exact"] for r in results),
        }
        entry["ok"] = bool(
            entry["bytes_match"] and entry["remap_exact"] and max(errors.values()) <= tol
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
    import dataclasses

    from megatron_zeppelin.planner.baselines import build_baseline
    from megatron_zeppelin.planner.heads import head_groups
    from megatron_zeppelin.planner.partition import PlannerOptions, plan_batch
    from megatron_zeppelin.planner.schemes import every_two_d

    flat = dataclasses.replace(options or PlannerOptions(), two_d=False)
    plan = plan_batch(lengths, topology=topology, cost_model=cost_model, capacity=capacity,
                      options=flat)  # fmt: skip
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
    from megatron_zeppelin.testing.dist import run_distributed

    world = cases[0].plan.world_size
    if any(c.plan.world_size != world for c in cases):
        raise ValueError("every case must plan for the same number of ranks")
    results = run_distributed(worker, world, timeout_s=spec.timeout_s, args=(cases, spec))
    return compare(cases, results, spec)


# --- the command -------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    batch = parser.add_argument_group("batch")
    batch.add_argument("--lengths", metavar="FILE", help="document lengths, one per line")
    batch.add_argument("--dist", metavar="NAME", default=None,
                       help=f"draw lengths from a distribution ({DEFAULT_DIST})")  # fmt: skip
    batch.add_argument("--tokens", type=int, default=2048, help="tokens in the batch (--dist)")
    batch.add_argument("--seed", type=int, default=0, help="seed of the batch and of the data")
    batch.add_argument("--max-length", type=int, default=None, help="cut longer documents")
    cluster = parser.add_argument_group("emulated cluster (one gloo process per GPU)")
    cluster.add_argument("--nodes", type=int, default=2)
    cluster.add_argument("--gpus-per-node", type=int, default=2)
    cluster.add_argument("--nics-per-node", type=int, default=None, help="default: one per GPU")
    cluster.add_argument("--capacity", type=int, default=None,
                         help="tokens per GPU; default: the even share times 1.25")  # fmt: skip
    planner = parser.add_argument_group("planner")
    planner.add_argument("--model", default="llama-7b", help="cost-model preset")
    planner.add_argument(
        "--thresholds", default=DEFAULT_THRESHOLDS, metavar="INTRA,INTER",
        help="tier thresholds in tokens, or auto (default: small, so a small batch uses every "
        f"tier: {DEFAULT_THRESHOLDS})",
    )  # fmt: skip
    planner.add_argument(
        "--linear-layout", choices=("even", "node", "attention", "auto"), default="even",
        help="linear layout to plan (default even: every remapping path moves tokens)",
    )  # fmt: skip
    engine = parser.add_argument_group("engine")
    engine.add_argument("--heads", type=int, default=EngineSpec.num_heads)
    engine.add_argument("--kv-heads", type=int, default=EngineSpec.num_kv_heads)
    engine.add_argument("--head-dim", type=int, default=EngineSpec.head_dim)
    engine.add_argument("--dtype", choices=DTYPES, default=EngineSpec.dtype)
    engine.add_argument("--kernel", default=EngineSpec.kernel, help="attention kernel")
    engine.add_argument("--timeout", type=float, default=EngineSpec.timeout_s,
                        help="seconds before a stuck process group fails the run")  # fmt: skip
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")


DEFAULT_DIST = "wikipedia"
DEFAULT_THRESHOLDS = "64,512"


def _inputs(args: argparse.Namespace):
    """Lengths, topology, cost model, capacity and planner options from the flags."""
    from megatron_zeppelin.planner.costmodel import CostModel
    from megatron_zeppelin.planner.distributions import read_lengths_file, sample_lengths
    from megatron_zeppelin.planner.models import get_model
    from megatron_zeppelin.planner.partition import PlannerOptions
    from megatron_zeppelin.topology.model import Topology

    if args.lengths is not None and args.dist is not None:
        raise ValueError("give the batch with one of --lengths FILE or --dist NAME, not both")
    if args.lengths is not None:
        lengths = read_lengths_file(args.lengths)
    else:
        lengths = sample_lengths(args.dist or DEFAULT_DIST, num_tokens=args.tokens,
                                 seed=args.seed, max_length=args.max_length)  # fmt: skip
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
            raise ValueError(f"--thresholds takes INTRA,INTER tokens or auto, got "
                             f"{args.thresholds!r}") from None  # fmt: skip
        if len(thresholds) != 2:
            raise ValueError(
                f"--thresholds takes two numbers, INTRA,INTER; got {args.thresholds!r}"
            )
    options = PlannerOptions(thresholds=thresholds, linear_layout=args.linear_layout)
    return lengths, topology, cost_model, capacity, options


def format_report(report: list[dict]) -> list[str]:
    lines = [f"{'case':<22} {'routing':<7} {'out':>9} {'dQ':>9} {'dK':>9} {'dV':>9}  "
             f"{'nvlink bytes':>23}  {'nic bytes':>23}  ok"]  # fmt: skip
    for e in report:
        err = e["errors"]
        m, p = e["measured_bytes"], e["predicted_bytes"]
        lines.append(
            f"{e['case']:<22} {'on' if e['routing'] else 'off':<7} "
            + " ".join(f"{err[k]:9.1e}" for k in ("out", "dq", "dk", "dv"))
            + f"  {m['nvlink']:>11}/{p['nvlink']:<11}  {m['nic']:>11}/{p['nic']:<11}  "
            + ("yes" if e["ok"] else "NO")
        )
        nics = sorted(k for k in set(m) | set(p) if k.startswith("nic:"))
        if nics:
            lines.append("    per NIC (measured/predicted): " + ", ".join(
                f"{k[4:]} {m.get(k, 0)}/{p.get(k, 0)}" for k in nics))  # fmt: skip
    return lines


def run(args: argparse.Namespace) -> int:
    from megatron_zeppelin.commands.profile import check_kernel, check_positive

    # Everything the workers would trip over is refused here, before a process starts.
    check_kernel(args.kernel, emulated=True)
    check_positive(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                   timeout=args.timeout)  # fmt: skip
    lengths, topology, cost_model, capacity, options = _inputs(args)
    spec = EngineSpec(num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                      dtype=args.dtype, kernel=args.kernel, seed=args.seed,
                      timeout_s=args.timeout)  # fmt: skip
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"--heads {spec.num_heads} must be a multiple of --kv-heads "
                         f"{spec.num_kv_heads}")  # fmt: skip
    cases = build_cases(lengths, topology=topology, cost_model=cost_model, capacity=capacity,
                        options=options, heads=(spec.num_heads, spec.num_kv_heads))  # fmt: skip
    print(f"{len(lengths)} documents, {sum(lengths)} tokens (longest {max(lengths)}) on "
          f"{topology.num_nodes} x {topology.gpus_per_node} gloo processes, {spec.dtype}, "
          f"capacity {capacity}; zeppelin tiers {cases[0].plan.tier_counts()}")  # fmt: skip
    if not any(c.name == "zeppelin-2d" for c in cases):
        print(f"no zeppelin-2d case: no inter-node document, or {spec.num_heads} query heads "
              f"and {spec.num_kv_heads} K/V heads do not split over {topology.gpus_per_node} "
              "GPUs per node")  # fmt: skip
    start = time.monotonic()
    report = verify(cases, spec)
    print("\n".join(format_report(report)))
    ok = all(e["ok"] for e in report)
    verdict = "all checks passed" if ok else "CHECKS FAILED"
    print(f"{verdict} in {time.monotonic() - start:.1f} s (relative error = max|got - ref| / "
          f"max|ref|, tolerance {report[0]['tolerance']:.0e})")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lengths": lengths, "topology": topology.to_dict(), "capacity": capacity,
                       "spec": dataclasses.asdict(spec), "cases": report,
                       "ok": ok}, f, indent=1)  # fmt: skip
        print(f"report written to {args.json}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_zeppelin.commands.verify``: the same as ``zeppelin verify``."""
    parser = argparse.ArgumentParser(prog="zeppelin verify", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    # Run through the imported module, not ``__main__``: the worker processes unpickle the
    # worker function and the cases by their module's name.
    from megatron_zeppelin.commands import verify as this_module

    try:
        return this_module.run(args)
    except ValueError as exc:
        print(f"zeppelin verify: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
