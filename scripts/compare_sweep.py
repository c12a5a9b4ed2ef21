"""Sweep the planner comparison over models, clusters, GPU counts and length distributions.

Every configuration draws ``--steps`` batches (seeds 0, 1, ...) of ``fill * GPUs * capacity``
tokens with documents cut at ``--max-length``, plans them with Zeppelin and every baseline, and
simulates the step with the default (datasheet) cost model. Prints a markdown table of mean step
time, Zeppelin's speedup over ``te-ring-cp`` and ``megatron-dynamic-cp``, every builder's
efficiency (lower bound / step time), and the average speedups. TE ring CP, the all-gather CP
and hybrid DP run at their best static CP size for each batch (the fastest of every size that
holds it, ``commands/compare_static.py``); "TE CP" is TE's, and "vs TE rule"
the speedup over TE at its default rule (the smallest group holding each batch's longest
document).

    python scripts/compare_sweep.py                 # the sweep in docs/BENCHMARKS.md
    python scripts/compare_sweep.py --quick         # a few configurations, for a smoke test
    python scripts/compare_sweep.py --json out.json
    python scripts/compare_sweep.py --ablation      # also Zeppelin without routing / remap / 2-D

The ablation plans every batch four times more with Zeppelin: ``PlannerOptions(routing=False)``
(cross-node ring edges leave through the sender's own NIC), ``remap=False`` (linear modules on
the attention layout), ``two_d=False`` (every ring flat: no document splits its heads inside
nodes) and both ``two_d=False`` and ``routing=False``, and reports their mean step times next to
the full method, and for every batch with a document across nodes its efficiency with and
without the 2-D scheme.

``--stress`` runs Zeppelin alone on the stress shapes of ``distributions.STRESS_DISTRIBUTIONS``
(lengths it was not tuned on) at 16, 128 and 1024 GPUs (``--stress-gpus``) and fills 0.5 and
0.95 (``--stress-fills``), cluster zeppelin-C, LLaMA-7B, 32768 tokens per GPU, documents cut at
half the batch and at 1M tokens; it reports efficiency, planner time and how many documents
span nodes (those are where a ring meets its per-rank K/V floor).

    python scripts/compare_sweep.py --stress --steps 2 --json stress.json

``--calibration FILE`` (a ``zeppelin profile`` file) replaces the default cost model's figures
with the file's measured ones in every configuration, for planning and simulation alike; the
figures the file does not measure (one GPU: the links) stay the cluster's datasheet figures.
A file measures one model's kernels, so only the configurations of that model run (the others
are named on stderr); its compute figures apply whatever GPU the cluster preset names.

    python scripts/compare_sweep.py --steps 3 --fill 0.7 \\
        --calibration configs/calibration/h100-bf16-llama-7b.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from megatron_zeppelin.commands.compare_static import best_static
from megatron_zeppelin.commands.simulate import compare_batches, summarize
from megatron_zeppelin.planner.baselines.distributions import STRESS_DISTRIBUTIONS, sample_lengths
from megatron_zeppelin.planner.cost.calibration import (
    Calibration,
    apply_calibration,
    load_calibration,
    model_differences,
)
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.planner.simulate.simulator import simulate
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import get_topology

DISTS = ("wikipedia", "prolong", "wlbllm", "magi_realworld")
CLUSTERS = ("zeppelin-A", "zeppelin-B", "zeppelin-C")


def configurations(quick: bool) -> list[dict]:
    """(model, cluster, GPUs, distribution, capacity) points, as in the paper's evaluation:
    every cluster and distribution at 32 GPUs with LLaMA-7B, GPU scaling 16 -> 128 with
    LLaMA-3B on cluster A, and the three model sizes on cluster C."""
    if quick:
        return [
            dict(model="llama-7b", cluster="zeppelin-A", gpus=16, dist="prolong", capacity=16384),
            dict(model="llama-3b", cluster="zeppelin-C", gpus=32, dist="wikipedia", capacity=16384),
        ]
    points = []
    for cluster in CLUSTERS:
        for dist in DISTS:
            points.append(
                dict(model="llama-7b", cluster=cluster, gpus=32, dist=dist, capacity=16384)
            )
    for gpus in (16, 64, 128):
        for dist in ("wikipedia", "prolong"):
            points.append(
                dict(model="llama-3b", cluster="zeppelin-A", gpus=gpus, dist=dist, capacity=16384)
            )
    for model, capacity in (("llama-3b", 32768), ("llama-13b", 16384)):
        for dist in ("wikipedia", "prolong"):
            points.append(
                dict(model=model, cluster="zeppelin-C", gpus=64, dist=dist, capacity=capacity)
            )
    return points


Measured = tuple[str, Calibration]
"""A calibration file's path and contents (``--calibration``)."""


def measures_model(calibration: Calibration, model: str) -> bool:
    """Whether ``calibration`` was measured for ``model``'s layer shapes (or for none): what
    ``apply_calibration`` would accept."""
    return not model_differences(calibration, get_model(model))


def cost_model(model: str, topology: Topology, measured: Measured | None = None) -> CostModel:
    """The default cost model of ``model`` on ``topology``, with ``measured``'s figures."""
    cost = CostModel.default(get_model(model), topology)
    if measured is None:
        return cost
    path, calibration = measured
    return apply_calibration(cost, calibration, source=path)


def selected_configurations(quick: bool, measured: Measured | None) -> list[dict]:
    """``configurations(quick)``, only those of the calibration's model when one is given."""
    points = configurations(quick)
    if measured is None:
        return points
    path, calibration = measured
    kept = [p for p in points if measures_model(calibration, p["model"])]
    left = sorted({p["model"] for p in points} - {p["model"] for p in kept})
    if left:
        print(
            f"{path} measures another model's kernels: {', '.join(left)} skipped",
            file=sys.stderr,
        )
    if not kept:
        raise ValueError(f"--calibration {path} measures no model of the sweep")
    return kept


def run_point(
    point: dict,
    *,
    steps: int,
    fill: float,
    max_length: int,
    ablation: bool = False,
    measured: Measured | None = None,
) -> dict:
    topology = get_topology(point["cluster"], num_nodes=point["gpus"] // 8)
    cost = cost_model(point["model"], topology, measured)
    tokens = int(fill * topology.world_size * point["capacity"])
    batches = [
        sample_lengths(point["dist"], num_tokens=tokens, seed=s, max_length=max_length)
        for s in range(steps)
    ]
    common = dict(topology=topology, cost_model=cost, capacity=point["capacity"])
    results = compare_batches(batches, **common)

    def price(name: str, size: int) -> list:
        return compare_batches(batches, builders=(name,), cp_sizes={name: size}, **common)[name]

    results, choices = best_static(
        batches, results, price, topology=topology, capacity=point["capacity"]
    )
    rows = {r["builder"]: r for r in summarize(results, choices)}
    longest = max(max(b) for b in batches)
    record = {**point, "tokens": tokens, "longest": longest, "rows": rows}
    record["sources"] = dict(cost.sources)
    if ablation:
        for label, options, remap in (
            ("no_routing", PlannerOptions(routing=False), True),
            ("no_remap", PlannerOptions(remap=False), False),
            ("no_2d", PlannerOptions(two_d=False), True),
            ("no_2d_no_routing", PlannerOptions(two_d=False, routing=False), True),
        ):
            runs = compare_batches(
                batches,
                topology=topology,
                cost_model=cost,
                capacity=point["capacity"],
                builders=("zeppelin",),
                options=options,
                remap=remap,
            )["zeppelin"]
            ok = [r for r in runs if not isinstance(r, str)]
            record[label] = (
                sum(r.step_time_s for r in ok) / len(ok) if len(ok) == len(runs) else None
            )
            if label == "no_2d":
                record["spanning"] = spanning_batches(
                    batches,
                    results["zeppelin"],
                    runs,
                    topology=topology,
                    cost=cost,
                    capacity=point["capacity"],
                )
    return record


def spanning_batches(batches, with_2d, without_2d, *, topology, cost, capacity) -> list[dict]:  # noqa: ANN001
    """Per batch whose Zeppelin plan has a document across nodes: how many, how many of them
    run 2-D, and the efficiency with the scheme and without it."""
    rows = []
    for seed, (lengths, on, off) in enumerate(zip(batches, with_2d, without_2d)):
        if isinstance(on, str) or isinstance(off, str):
            continue
        plan = plan_batch(lengths, topology=topology, cost_model=cost, capacity=capacity)
        inter = plan.tier_counts()["inter"]
        if inter:
            rows.append(
                {
                    "seed": seed,
                    "inter": inter,
                    "two_d": plan.meta["two_d_documents"],
                    "longest": max(lengths),
                    "efficiency": on.efficiency,
                    "efficiency_no_2d": off.efficiency,
                }
            )
    return rows


def _fmt(x, spec: str) -> str:
    return format(x, spec) if x is not None else "-"


def markdown(records: list[dict]) -> str:
    lines = [
        "| model | cluster | GPUs | data | cap/GPU | tokens | longest | Zeppelin ms "
        "| TE ring ms | TE CP | Mcore ms | best other | vs TE | vs TE rule | vs Mcore | vs best "
        "| eff Z | eff TE | eff Mcore |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        rows = rec["rows"]
        z, te, mc = rows["zeppelin"], rows["te-ring-cp"], rows["megatron-dynamic-cp"]
        others = [r for name, r in rows.items() if name != "zeppelin" and "error" not in r]
        best = min(others, key=lambda r: r["step_time_s"])
        if "error" in z:
            lines.append(
                f"| {rec['model']} | {rec['cluster']} | {rec['gpus']} | {rec['dist']} "
                f"| zeppelin failed: {z['error']} |"
            )
            continue
        lines.append(
            f"| {rec['model']} | {rec['cluster']} | {rec['gpus']} | {rec['dist']} "
            f"| {rec['capacity']} | {rec['tokens']} | {rec['longest']} "
            f"| {z['step_time_s'] * 1e3:.0f} | {_fmt(te.get('step_time_s', None) and te['step_time_s'] * 1e3, '.0f')} "  # noqa: E501
            f"| {te.get('cp_size') or '-'} "
            f"| {_fmt(mc.get('step_time_s', None) and mc['step_time_s'] * 1e3, '.0f')} "
            f"| {best['builder']} "
            f"| {_fmt(z['speedup_vs_te'], '.2f')} | {_fmt(z.get('speedup_vs_te_rule'), '.2f')} "
            f"| {_fmt(z['speedup_vs_megatron'], '.2f')} "
            f"| {best['step_time_s'] / z['step_time_s']:.2f} "
            f"| {z['efficiency']:.3f} | {_fmt(te.get('efficiency'), '.3f')} "
            f"| {_fmt(mc.get('efficiency'), '.3f')} |"
        )
    return "\n".join(lines)


def ablation_markdown(records: list[dict]) -> str:
    """Zeppelin's mean step time with routing, remapping or the 2-D scheme switched off, and TE
    ring CP's, as speedups over TE ring CP (the paper's ablation)."""
    lines = [
        "| model | cluster | GPUs | data | Zeppelin ms | no routing ms | no remap ms | no 2-D ms "
        "| no 2-D, no routing ms | vs TE | vs TE, no routing | vs TE, no remap | vs TE, no 2-D "
        "| vs TE, no 2-D, no routing |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        z, te = rec["rows"]["zeppelin"], rec["rows"]["te-ring-cp"]
        if "error" in z or "error" in te:
            continue
        full, te_s = z["step_time_s"], te["step_time_s"]
        off = [rec.get(k) for k in ("no_routing", "no_remap", "no_2d", "no_2d_no_routing")]
        lines.append(
            f"| {rec['model']} | {rec['cluster']} | {rec['gpus']} | {rec['dist']} "
            f"| {full * 1e3:.0f} | "
            + " | ".join(_fmt(t and t * 1e3, ".0f") for t in off)
            + f" | {te_s / full:.2f} | "
            + " | ".join(_fmt(t and te_s / t, ".2f") for t in off)
            + " |"
        )
    return "\n".join(lines)


def spanning_markdown(records: list[dict]) -> str:
    """Every batch with a document across nodes: efficiency with and without the 2-D scheme."""
    lines = [
        "| model | cluster | GPUs | data | seed | longest | docs across nodes | of them 2-D "
        "| eff, 2-D on | eff, 2-D off |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in records:
        for row in rec.get("spanning", []):
            lines.append(
                f"| {rec['model']} | {rec['cluster']} | {rec['gpus']} | {rec['dist']} "
                f"| {row['seed']} | {row['longest']} | {row['inter']} | {row['two_d']} "
                f"| {row['efficiency']:.3f} | {row['efficiency_no_2d']:.3f} |"
            )
    return "\n".join(lines)


def averages(records: list[dict]) -> dict[str, float]:
    """Arithmetic and geometric means of Zeppelin's speedups, and its mean efficiency."""
    out = {}
    ok = [r["rows"]["zeppelin"] for r in records if "error" not in r["rows"]["zeppelin"]]
    for key in ("speedup_vs_te", "speedup_vs_te_rule", "speedup_vs_megatron"):
        values = [z[key] for z in ok if z.get(key)]
        if values:
            out[f"mean {key}"] = sum(values) / len(values)
            out[f"geomean {key}"] = math.exp(sum(math.log(v) for v in values) / len(values))
            out[f"max {key}"] = max(values)
    out["mean zeppelin efficiency"] = sum(z["efficiency"] for z in ok) / max(1, len(ok))
    out["min zeppelin efficiency"] = min((z["efficiency"] for z in ok), default=float("nan"))
    return out


STRESS_CAPACITY = 32_768
STRESS_MAX_LENGTH = 1 << 20


def run_stress_point(
    dist: str, gpus: int, fill: float, *, steps: int, measured: Measured | None = None
) -> dict:
    """Zeppelin alone on one stress shape (module docstring)."""
    topology = get_topology("zeppelin-C", num_nodes=gpus // 8)
    cost = cost_model("llama-7b", topology, measured)
    tokens = int(fill * gpus * STRESS_CAPACITY)
    max_length = min(STRESS_MAX_LENGTH, tokens // 2)
    steps_s, bounds, planner_s, docs, spanning, longest = [], [], [], [], [], 0
    for seed in range(steps):
        lengths = sample_lengths(dist, num_tokens=tokens, seed=seed, max_length=max_length)
        start = time.process_time()
        plan = plan_batch(lengths, topology=topology, cost_model=cost, capacity=STRESS_CAPACITY)
        planner_s.append(time.process_time() - start)
        result = simulate(plan, cost)
        steps_s.append(result.step_time_s)
        bounds.append(result.lower_bound_s)
        docs.append(len(lengths))
        spanning.append(plan.meta["tier_counts"]["inter"])
        longest = max(longest, max(lengths))
    step, bound = sum(steps_s) / steps, sum(bounds) / steps
    return {
        "dist": dist,
        "gpus": gpus,
        "fill": fill,
        "tokens": tokens,
        "documents": docs,
        "longest": longest,
        "step_time_s": step,
        "lower_bound_s": bound,
        "efficiency": bound / step,
        "per_batch": [b / s for b, s in zip(bounds, steps_s)],
        "planner_ms": [1e3 * t for t in planner_s],
        "spanning_nodes": spanning,
    }


def stress_markdown(records: list[dict]) -> str:
    lines = [
        "| data | GPUs | fill | tokens | docs | longest | eff Z | per batch | spanning nodes "
        "| planner ms |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for rec in records:
        lines.append(
            f"| {rec['dist']} | {rec['gpus']} | {rec['fill']} | {rec['tokens']} "
            f"| {round(sum(rec['documents']) / len(rec['documents']))} | {rec['longest']} "
            f"| {rec['efficiency']:.3f} | {' '.join(f'{e:.3f}' for e in rec['per_batch'])} "
            f"| {max(rec['spanning_nodes'])} | {max(rec['planner_ms']):.0f} |"
        )
    return "\n".join(lines)


def _stress(args: argparse.Namespace) -> int:
    records = []
    start = time.monotonic()
    for dist in STRESS_DISTRIBUTIONS:
        for gpus in args.stress_gpus:
            for fill in args.stress_fills:
                records.append(
                    run_stress_point(dist, gpus, fill, steps=args.steps, measured=args.measured)
                )
                print(
                    f"done {dist} {gpus} GPUs fill {fill} after {time.monotonic() - start:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
    print(stress_markdown(records))
    effs = [r["efficiency"] for r in records]
    print(f"\n- min efficiency {min(effs):.3f}, mean {sum(effs) / len(effs):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="batches (seeds) per configuration")
    parser.add_argument("--fill", type=float, default=0.9, help="batch tokens / total capacity")
    parser.add_argument("--max-length", type=int, default=131072, help="cut longer documents")
    parser.add_argument("--quick", action="store_true", help="two configurations only")
    parser.add_argument("--json", metavar="OUT", help="write every row")
    parser.add_argument(
        "--ablation", action="store_true", help="also routing off, remap off, 2-D off"
    )
    parser.add_argument("--stress", action="store_true", help="Zeppelin on the stress shapes")
    parser.add_argument("--stress-gpus", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--stress-fills", type=float, nargs="+", default=[0.5, 0.95])
    parser.add_argument(
        "--calibration", metavar="FILE", help="measured figures (zeppelin profile) to plan with"
    )
    args = parser.parse_args(argv)
    args.measured = None
    if args.calibration:
        try:
            args.measured = (args.calibration, load_calibration(args.calibration))
        except ValueError as exc:
            parser.error(str(exc))
    if args.stress:
        if args.measured and not measures_model(args.measured[1], "llama-7b"):
            parser.error(f"--calibration {args.calibration} was not measured for llama-7b")
        return _stress(args)
    try:
        points = selected_configurations(args.quick, args.measured)
    except ValueError as exc:
        parser.error(str(exc))
    records = []
    start = time.monotonic()
    for point in points:
        records.append(
            run_point(
                point,
                steps=args.steps,
                fill=args.fill,
                max_length=args.max_length,
                ablation=args.ablation,
                measured=args.measured,
            )
        )
        print(f"done {point} after {time.monotonic() - start:.0f} s", file=sys.stderr)
    print(markdown(records))
    print()
    for key, value in averages(records).items():
        print(f"- {key}: {value:.3f}")
    if args.ablation:
        print()
        print(ablation_markdown(records))
        print()
        print(spanning_markdown(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
