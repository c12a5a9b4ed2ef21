"""Planner latency: median and p90 over seeds, in one process, for a grid of cluster sizes,
micro-batch sizes and length distributions.

Topology preset zeppelin-C (8 GPUs per node), model llama-7b, capacity per GPU
``max(65536, ceil(1.25 * tokens / GPUs))`` so every batch fits. Each measurement samples a fresh
batch (``sample_lengths`` with the seed) and times ``plan_batch`` alone, including the plan's own
validation. The process first plans one batch untimed: the first plan of a process pays one-time
costs (imports numpy makes on first use, the cost model's first tables) that a training run pays
once, not every step.

    python scripts/bench_planner.py                 # full grid
    python scripts/bench_planner.py --quick         # 1024 GPUs x 4M tokens only
    python scripts/bench_planner.py --quick --no-2d # the same with every ring flat
    python scripts/bench_planner.py --quick --no-pool # without the pool placement
    python scripts/bench_planner.py --quick --distributions wikipedia   # one distribution
    python scripts/bench_planner.py --docs 1000 10000 100000   # by document count, 1024 GPUs
    python scripts/bench_planner.py --json out.json

The grid's rows also give each plan's efficiency (lower bound over the simulated step, median
over the seeds; simulated outside the timed call) and how many of the seeds' searches ended at
a placement within reach of the batch's least load (``planner/place/least_load.py``).

``--docs`` sizes each batch by its number of documents instead (``N`` times the distribution's
mean length in tokens) on 1024 GPUs, to show how planning grows with the documents; the peak
resident memory of the process so far is reported with each row (rows run smallest first).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import statistics
import time

from megatron_zeppelin.planner.baselines.distributions import (
    DISTRIBUTIONS,
    MAX_BATCH_TOKENS,
    distribution_mean,
    sample_lengths,
)
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.planner.simulate.simulator import simulate
from megatron_zeppelin.topology.presets import get_topology

GPUS = (16, 64, 256, 1024)
TOKENS = (1 << 20, 1 << 22, 1 << 24)


def capacity_for(num_tokens: int, world_size: int) -> int:
    return max(65536, math.ceil(1.25 * num_tokens / world_size))


def measure(
    num_gpus: int,
    num_tokens: int,
    distribution: str,
    seeds: int,
    options: PlannerOptions,
    *,
    quality: bool = False,
) -> dict:
    """``quality``: also simulate every plan (untimed) for its efficiency, and count the plans
    whose search ended at the batch's least load (``search._settle``)."""
    topology = get_topology("zeppelin-C", num_nodes=num_gpus // 8)
    cost_model = CostModel.default(get_model("llama-7b"), topology)
    capacity = capacity_for(num_tokens, num_gpus)
    times, cpu_times, docs, efficiencies, near = [], [], [], [], 0
    for seed in range(seeds):
        lengths = sample_lengths(distribution, num_tokens=num_tokens, seed=seed)
        gc.collect()  # start every run from the same collector state
        start, cpu_start = time.perf_counter(), time.process_time()
        plan = plan_batch(
            lengths, topology=topology, cost_model=cost_model, capacity=capacity, options=options
        )
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        docs.append(len(lengths))
        if quality:
            efficiencies.append(simulate(plan, cost_model).efficiency)
            near += any(c.get("near_least_load") for c in plan.meta["candidates"])
    times.sort()
    return {
        "gpus": num_gpus,
        "tokens": num_tokens,
        "distribution": distribution,
        "capacity": capacity,
        "documents": round(statistics.mean(docs)),
        "median_ms": 1e3 * statistics.median(times),
        "p90_ms": 1e3 * times[min(len(times) - 1, math.ceil(0.9 * len(times)) - 1)],
        # CPU time of this process: a fairer figure on a machine shared with other jobs.
        "cpu_median_ms": 1e3 * statistics.median(cpu_times),
        # Predicted per-GPU seconds (attention + linear), max over mean: what the planner
        # balances. Attention alone is reported too; it is uneven by design where GPUs with
        # more attention hold fewer tokens.
        "imbalance": plan.meta["load_imbalance"],
        "attention_imbalance": plan.meta["attention_imbalance"],
        "tiers": plan.meta["tier_counts"],
        # ru_maxrss is in KiB on Linux; MB here is 10^6 bytes, as everywhere in the project.
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,
        # Lower bound over simulated step (``simulate``), the median over the seeds.
        "efficiency": statistics.median(efficiencies) if efficiencies else None,
        "near_least_load": near,
    }


def by_documents(
    counts: list[int], distributions: list[str], seeds: int, options: PlannerOptions
) -> list[dict]:
    """1024 GPUs, batches of about ``count`` documents (module docstring)."""
    rows = []
    print(
        "| GPUs | documents | distribution | tokens | median ms | p90 ms | CPU median ms "
        "| peak RSS MB |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for count in sorted(counts):
        for distribution in distributions:
            tokens = int(count * distribution_mean(distribution))
            if tokens > MAX_BATCH_TOKENS:  # ``sample_lengths`` refuses it
                print(
                    f"| 1024 | {count} | {distribution} | {tokens} | over the sampler's "
                    f"{MAX_BATCH_TOKENS} tokens per batch: skipped | | | |",
                    flush=True,
                )
                continue
            row = measure(1024, tokens, distribution, seeds, options)
            rows.append(row)
            print(
                f"| 1024 | {row['documents']} | {distribution} | {tokens} "
                f"| {row['median_ms']:.1f} | {row['p90_ms']:.1f} | {row['cpu_median_ms']:.1f} "
                f"| {row['peak_rss_mb']:.0f} |",
                flush=True,
            )
    return rows


def warm_up(options: PlannerOptions) -> None:
    """Plan one batch of 1M tokens on 1024 GPUs, untimed (module docstring)."""
    measure(1024, 1 << 20, "wikipedia", 1, options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only 1024 GPUs x 4M tokens")
    parser.add_argument("--docs", type=int, nargs="+", help="batches of this many documents")
    parser.add_argument("--seeds", type=int, default=7, help="batches per cell (default 7)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--no-2d", action="store_true", help="every ring flat (PlannerOptions)")
    parser.add_argument(
        "--no-pool", action="store_true", help="the staged placement only (PlannerOptions)"
    )
    parser.add_argument(
        "--distributions",
        nargs="+",
        choices=sorted(DISTRIBUTIONS),
        default=list(DISTRIBUTIONS),
        help="length distributions to measure (default: all)",
    )
    args = parser.parse_args()
    options = PlannerOptions(two_d=not args.no_2d, pool=not args.no_pool)
    warm_up(options)
    if args.docs:
        rows = by_documents(args.docs, args.distributions, args.seeds, options)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    grid = [(1024, 1 << 22)] if args.quick else [(g, t) for g in GPUS for t in TOKENS]
    rows = []
    print(
        "| GPUs | tokens | distribution | docs | capacity | median ms | p90 ms | CPU median ms "
        "| load imbal. | attn imbal. | efficiency | ended at least load |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for num_gpus, num_tokens in grid:
        for distribution in args.distributions:
            row = measure(num_gpus, num_tokens, distribution, args.seeds, options, quality=True)
            rows.append(row)
            print(
                f"| {num_gpus} | {num_tokens >> 20}M | {distribution} | {row['documents']} | "
                f"{row['capacity']} | {row['median_ms']:.1f} | {row['p90_ms']:.1f} | "
                f"{row['cpu_median_ms']:.1f} | {row['imbalance']:.3f} | "
                f"{row['attention_imbalance']:.3f} | {row['efficiency']:.3f} | "
                f"{row['near_least_load']}/{args.seeds} |",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
