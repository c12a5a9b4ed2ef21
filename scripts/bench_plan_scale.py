"""Planning at scale: full micro-batches of 256-1024 GPUs, each plan's CPU seconds against the
step it plans.

A planner that plans every micro-batch ahead of training keeps up only where a plan takes less
than the step it plans (a planner process per node and micro-batches shared out among them,
``megatron/plans/shared_plans.py``, has ``nodes`` times that). Per batch: the CPU seconds of
``plan_batch`` (``time.process_time``, one process; the plan's own validation included), the
step the simulator predicts for the plan (``simulate``), their ratio, and the plan's efficiency
(lower bound over the simulated step), with the default options and with ``--no-pool``
(``PlannerOptions(pool=False)``).

The shapes (``SHAPES``): a power law at 75% of capacity (zeppelin-B, LLaMA-3B), a bimodal
SFT-like mix at 95% and a lognormal at 50% (dgx-h100, LLaMA-7B), all on 1024 GPUs with 16384
tokens each, and a power law at 95% on 512 GPUs (LLaMA-13B, 32768 tokens each); ``--stress``
adds the stress grid at 1024 GPUs (``distributions.STRESS_DISTRIBUTIONS``, fills 0.5 and 0.95,
zeppelin-C, LLaMA-7B, 32768 tokens per GPU, as ``compare_sweep.py --stress``), ``--embedded``
the embedded histograms at 256 and 1024 GPUs (fills 0.5 and 0.95, zeppelin-C, LLaMA-7B, 16384
tokens per GPU). Documents are cut at half the batch and at 1M tokens, as the sweep cuts them.

    python scripts/bench_plan_scale.py                      # the four shapes, seed 0
    python scripts/bench_plan_scale.py --stress --embedded  # and both grids
    python scripts/bench_plan_scale.py --stress --no-pool --json out.json
    python scripts/bench_plan_scale.py --no-shapes --fixed  # samples of one length

``--fixed``: micro-batches of samples packed to one length (``FIXED``: 4096, 8192 and 16384
tokens on 1024 GPUs of 16384, dgx-h100, LLaMA-7B, filling the GPUs or three quarters of them),
every micro-batch the same lengths: the first plan's CPU seconds, and the next micro-batch's,
handed the plan kept for the same lengths (``megatron/plans/reuse.py``).

``scripts/plan_digests.py`` compares the plans of these batches (and others) between two
versions of the planner.
The process first plans one batch untimed (the first plan of a process pays one-time costs),
and builds the planner's compiled loops where numba is installed (``partition.warm``; its
first line says which run: ``ZEPPELIN_PLANNER_JIT=0`` keeps numpy).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass
from functools import partial

from megatron_zeppelin.megatron.plans.reuse import RecentPlans
from megatron_zeppelin.planner.baselines.distributions import (
    DISTRIBUTIONS,
    STRESS_DISTRIBUTIONS,
    sample_lengths,
)
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch, warm
from megatron_zeppelin.planner.simulate.simulator import simulate
from megatron_zeppelin.topology.presets import get_topology


@dataclass(frozen=True)
class Shape:
    """One micro-batch shape: ``fill`` of the cluster's ``capacity x GPUs`` tokens."""

    dist: str
    gpus: int
    fill: float
    cluster: str
    model: str
    capacity: int

    @property
    def tokens(self) -> int:
        return int(self.fill * self.gpus * self.capacity)

    @property
    def name(self) -> str:
        return f"{self.dist} {self.gpus} GPUs {self.fill:.0%} {self.cluster} {self.model}"


SHAPES = (
    Shape("power-law", 1024, 0.75, "zeppelin-B", "llama-3b", 16384),
    Shape("sft-bimodal", 1024, 0.95, "dgx-h100", "llama-7b", 16384),
    Shape("lognormal", 1024, 0.5, "dgx-h100", "llama-7b", 16384),
    Shape("power-law", 512, 0.95, "dgx-h100", "llama-13b", 32768),
)
STRESS = tuple(
    Shape(dist, 1024, fill, "zeppelin-C", "llama-7b", 32768)
    for dist in STRESS_DISTRIBUTIONS
    for fill in (0.5, 0.95)
)
EMBEDDED = tuple(
    Shape(dist, gpus, fill, "zeppelin-C", "llama-7b", 16384)
    for dist in DISTRIBUTIONS
    for gpus in (256, 1024)
    for fill in (0.5, 0.95)
)


FIXED = tuple(
    (Shape(f"fixed {length}", 1024, fill, "dgx-h100", "llama-7b", 16384), length)
    for length in (4096, 8192, 16384)
    for fill in (1.0, 0.75)
)


def plan_once(shape: Shape, lengths: list[int], options: PlannerOptions) -> dict:
    """One plan of ``lengths``: its CPU seconds, the simulated step and efficiency."""
    topology = get_topology(shape.cluster, num_nodes=shape.gpus // 8)
    cost = CostModel.default(get_model(shape.model), topology)
    gc.collect()  # every plan from the same collector state
    start = time.process_time()
    plan = plan_batch(
        lengths, topology=topology, cost_model=cost, capacity=shape.capacity, options=options
    )
    seconds = time.process_time() - start
    result = simulate(plan, cost)
    return {
        "plan_s": seconds,
        "step_s": result.step_time_s,
        "efficiency": result.efficiency,
        "near_least_load": any(c.get("near_least_load") for c in plan.meta["candidates"]),
    }


def measure(shape: Shape, seeds: int, pool_off: bool) -> list[dict]:
    """Every seed's batch of ``shape``, planned by default (and with ``pool=False``)."""
    rows = []
    for seed in range(seeds):
        lengths = sample_lengths(
            shape.dist,
            num_tokens=shape.tokens,
            seed=seed,
            max_length=min(shape.tokens // 2, 1 << 20),
        )
        row = {
            "shape": asdict(shape),
            "seed": seed,
            "documents": len(lengths),
            "tokens": shape.tokens,
            "default": plan_once(shape, lengths, PlannerOptions()),
        }
        if pool_off:
            row["no_pool"] = plan_once(shape, lengths, PlannerOptions(pool=False))
        rows.append(row)
    return rows


def print_rows(shape: Shape, rows: list[dict]) -> None:
    """One line per shape: medians over its seeds (the worst ratio too)."""
    default = [r["default"] for r in rows]
    plan_s = statistics.median(d["plan_s"] for d in default)
    step_s = statistics.median(d["step_s"] for d in default)
    worst = max(d["plan_s"] / d["step_s"] for d in default)
    efficiency = statistics.median(d["efficiency"] for d in default)
    line = (
        f"| {shape.dist} | {shape.gpus} | {shape.fill:.2f} | {shape.cluster} | {shape.model} "
        f"| {round(statistics.mean(r['documents'] for r in rows))} | {shape.tokens / 1e6:.1f}M "
        f"| {plan_s:.2f} | {step_s:.3f} | {plan_s / step_s:.2f} | {worst:.2f} | {efficiency:.3f} |"
    )
    if "no_pool" in rows[0]:
        off = [r["no_pool"] for r in rows]
        line += (
            f" {statistics.median(d['plan_s'] for d in off):.2f} "
            f"| {statistics.median(d['efficiency'] for d in off):.3f} |"
        )
    print(line, flush=True)


def print_fixed() -> None:
    """``--fixed``'s table: one micro-batch of each ``FIXED`` shape planned, then the same
    lengths again through the plans kept (``RecentPlans``)."""
    print("| sample tokens | fill | docs | first plan s | step s | plan / step | again s |")
    print("|---|---|---|---|---|---|---|")
    for shape, length in FIXED:
        lengths = [length] * (shape.tokens // length)
        topology = get_topology(shape.cluster, num_nodes=shape.gpus // 8)
        cost = CostModel.default(get_model(shape.model), topology)
        kept = RecentPlans()
        make = partial(plan_batch, topology=topology, cost_model=cost, capacity=shape.capacity)
        seconds = []
        for _ in range(2):  # the first micro-batch, then the next one with the same lengths
            gc.collect()
            start = time.process_time()
            plan = kept.plan(list(lengths), make)
            seconds.append(time.process_time() - start)
        assert kept.hits == 1, "the repeat was planned again"
        step = simulate(plan, cost).step_time_s
        print(
            f"| {length} | {shape.fill:.2f} | {len(lengths)} | {seconds[0]:.2f} | {step:.3f} "
            f"| {seconds[0] / step:.2f} | {seconds[1]:.4f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1, help="batches per shape (default 1)")
    parser.add_argument("--stress", action="store_true", help="the stress grid at 1024 GPUs")
    parser.add_argument("--embedded", action="store_true", help="the embedded histograms")
    parser.add_argument("--no-shapes", action="store_true", help="leave out SHAPES")
    parser.add_argument("--no-pool", action="store_true", help="also plan with pool=False")
    parser.add_argument("--only", type=int, nargs="+", help="only these rows (0: the first)")
    parser.add_argument("--fixed", action="store_true", help="samples of one length (FIXED)")
    parser.add_argument("--json", help="write every batch's figures here")
    args = parser.parse_args()
    shapes = (
        (() if args.no_shapes else SHAPES)
        + (STRESS if args.stress else ())
        + (EMBEDDED if args.embedded else ())
    )
    if args.only:
        wrong = [i for i in args.only if not 0 <= i < len(shapes)]
        if wrong:
            parser.error(f"--only {wrong}: the rows chosen are 0 to {len(shapes) - 1}")
        shapes = tuple(shapes[i] for i in args.only)
    how = "compiled (numba)" if warm() else "numpy (numba not installed)"
    print(f"the planner's inner loops: {how}")
    plan_once(SHAPES[2], sample_lengths("lognormal", num_tokens=1 << 20, seed=0), PlannerOptions())
    if shapes:
        print_table(shapes, args)
    if args.fixed:
        print()
        print_fixed()


def print_table(shapes: tuple[Shape, ...], args: argparse.Namespace) -> None:
    """The table of ``shapes``, and their figures in ``--json``'s file where asked."""
    header = (
        "| distribution | GPUs | fill | cluster | model | docs | tokens | plan s "
        "| step s | plan / step | worst | efficiency |"
    )
    if args.no_pool:
        header += " `--no-pool` plan s | efficiency |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows: list[dict] = []
    for shape in shapes:
        found = measure(shape, args.seeds, args.no_pool)
        rows += found
        print_rows(shape, found)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
