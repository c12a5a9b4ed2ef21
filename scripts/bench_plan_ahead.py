"""Planning ahead: how much a planner running beside training slows the thread that launches
the step's operators, in a thread of the training process and in planner processes.

The training thread is stood in for by a stream of small PyTorch operators on CPU (a matmul, a
ReLU and an add on ``--size`` x ``--size`` tensors, one thread): like kernel launches, each
releases the interpreter lock while it runs and takes it back after. Meanwhile the planner
plans ``--plans`` micro-batches of ``--tokens`` (default 4M) on 1024 GPUs (zeppelin-C,
LLaMA-7B, capacity ``max(65536, 1.25 x tokens / GPUs)``, ``--dist`` lengths), submitted at once,
as ``feed.MicroBatchFeed`` does:

- ``none``: no planning (the stream's own rate);
- ``thread``: the planner thread of ``feed.py`` (``--zeppelin-plan-workers 0``);
- ``processes N``: ``plan_workers.PlannerProcesses`` with N workers (``--zeppelin-plan-workers
  N``); the training process only sends lengths and decodes plans (in a reader thread).

For each: operators per second while the plans were being made, relative to ``none``, the
longest the stream stood still (the longest gap between two of its operator triples), the full
passes of Python's collector meanwhile, and the wall time the plans took. The last row,
``processes 1, collector off``, runs with ``gc.disable()`` as Megatron's ``--manual-gc`` does:
every plan brings the training process thousands of new objects, and the collector's full
passes over everything hold the interpreter lock. Then what a plan costs the training process
with planner processes: decoding it (``plan_wire.decode``; median over the plans, best of 3
each), beside making it (CPU time); and how long a plan takes from its lengths sent to a
planner process to the plan in the training process, one plan at a time, with the collector on
and off.

    python scripts/bench_plan_ahead.py
    python scripts/bench_plan_ahead.py --size 256
    python scripts/bench_plan_ahead.py --dist wikipedia --tokens 10166509   # ~10^4 documents
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time

import torch

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.megatron.plans.feed import PlanningStats, _CollectorWatch, _PlannerThread
from megatron_zeppelin.megatron.plans.plan_workers import PlannerProcesses, PlanRecipe
from megatron_zeppelin.planner.baselines.distributions import DISTRIBUTIONS, sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan import plan_wire
from megatron_zeppelin.topology.presets import get_topology


def recipe(tokens: int) -> PlanRecipe:
    topology = get_topology("zeppelin-C", num_nodes=128)
    cost_model = CostModel.default(get_model("llama-7b"), topology)
    config = ZeppelinConfig(capacity=max(65536, math.ceil(1.25 * tokens / topology.world_size)))
    return PlanRecipe(topology, cost_model, config, config.planner_options(cost_model))


def operators(x: torch.Tensor, until) -> tuple[int, float, float]:
    """Run the operator stream until ``until()`` is true; (operators run, seconds, longest gap
    between two operator triples in seconds)."""
    count, start = 0, time.perf_counter()
    last, longest = start, 0.0
    while not until():
        for _ in range(50):
            y = x @ x
            y = y.relu_()
            y = y + 1
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now
        count += 150
    return count, time.perf_counter() - start, longest


def run(
    mode: str,
    workers: int,
    batches: list[list[int]],
    x: torch.Tensor,
    rate: float,
    tokens: int,
    *,
    collector: bool = True,
) -> dict:
    plan = recipe(tokens)
    if mode == "thread":
        planner = _PlannerThread(plan, lambda seconds: None)
    else:
        planner = PlannerProcesses(plan, workers, lambda seconds: None)
        # A worker's start (interpreter, imports) is paid once per run, not per plan.
        planner.submit(batches[0]).result()
    gc.collect()  # every row starts from the same heap
    if not collector:
        gc.disable()
    passes = PlanningStats()  # the feed's count of the collector's own full passes
    watch = _CollectorWatch(passes)
    watch.start()
    try:
        start = time.perf_counter()
        futures = [planner.submit(lengths) for lengths in batches]
        count, seconds, longest = operators(x, lambda: all(f.done() for f in futures))
        planned = time.perf_counter() - start
        results = [future.result() for future in futures]
    finally:
        watch.stop()
        gc.enable()
    del results
    planner.close()
    return {
        "ops_per_s": count / seconds,
        "relative": count / seconds / rate,
        "longest_ms": 1e3 * longest,
        "passes": passes.collections,
        "longest_pass_ms": 1e3 * passes.longest_collection_s,
        "plans_s": planned,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64, help="operator tensors' side (default 64)")
    parser.add_argument("--plans", type=int, default=8, help="micro-batches planned (default 8)")
    parser.add_argument("--dist", default="wlbllm", choices=sorted(DISTRIBUTIONS))
    parser.add_argument("--tokens", type=int, default=1 << 22, help="per micro-batch")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.size, args.size)
    batches = [
        list(sample_lengths(args.dist, num_tokens=args.tokens, seed=seed))
        for seed in range(args.plans)
    ]
    recipe(args.tokens)(batches[0])  # the process's one-time costs, before anything is timed
    deadline = time.perf_counter() + 3.0
    count, seconds, longest = operators(x, lambda: time.perf_counter() > deadline)
    rate = count / seconds
    documents = round(sum(map(len, batches)) / len(batches))
    print(
        f"{args.plans} plans of {args.dist} ({args.tokens:,} tokens, ~{documents} documents, "
        f"1024 GPUs), operators {args.size}^2"
    )
    print(
        "| planner | operators/s | vs none | longest stop ms | collector full passes "
        "(longest ms) | plans took s |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| none | {rate:,.0f} | 1.00 | {1e3 * longest:.1f} | | |")
    rows = [("thread", "thread", 0, True)]
    rows += [(f"processes {w}", "processes", w, True) for w in args.workers]
    rows += [("processes 1, collector off", "processes", 1, False)]
    for name, mode, workers, collector in rows:
        row = run(mode, workers, batches, x, rate, args.tokens, collector=collector)
        print(
            f"| {name} | {row['ops_per_s']:,.0f} | {row['relative']:.2f} | "
            f"{row['longest_ms']:.1f} | {row['passes']} ({row['longest_pass_ms']:.0f}) | "
            f"{row['plans_s']:.2f} |",
            flush=True,
        )
    made, loaded, plan = [], [], recipe(args.tokens)
    for lengths in batches:
        start = time.process_time()
        made_plan = plan(lengths)
        made.append(time.process_time() - start)
        blob = plan_wire.encode(made_plan)
        loads = []
        for _ in range(3):
            start = time.process_time()
            plan_wire.decode(blob)
            loads.append(time.process_time() - start)
        loaded.append(min(loads))
    print(
        f"per plan: made in {1e3 * statistics.median(made):.0f} ms, decoded in "
        f"{1e3 * statistics.median(loaded):.1f} ms (medians)"
    )
    waits = [round_trips(batches, args.tokens, collector) for collector in (True, False)]
    print(
        "per plan, from its lengths sent to a planner process to the plan in this process, "
        f"one at a time: {1e3 * waits[0]:.0f} ms with the collector on, {1e3 * waits[1]:.0f} "
        "ms with it off (medians)"
    )


def round_trips(batches: list[list[int]], tokens: int, collector: bool) -> float:
    """Median seconds from ``submit`` to the plan in this process, one plan at a time, with one
    planner process: making it, encoding it there, decoding it here, and whatever passes the
    collector makes meanwhile (``collector=False``: ``gc.disable()``, as ``--manual-gc``)."""
    planner = PlannerProcesses(recipe(tokens), 1, lambda seconds: None)
    planner.submit(batches[0]).result()
    gc.collect()
    if not collector:
        gc.disable()
    seconds, kept = [], []  # the plans stay, as the feed keeps those planned ahead
    try:
        for lengths in batches:
            start = time.perf_counter()
            kept.append(planner.submit(lengths).result())
            seconds.append(time.perf_counter() - start)
            del kept[:-2]
    finally:
        gc.enable()
        planner.close()
    return statistics.median(seconds)


if __name__ == "__main__":
    main()
