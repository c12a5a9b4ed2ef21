"""Planning ahead at scale: how long training steps wait for their plans, and the CPU planning
takes, with plans shared from one rank per node or planned on every rank.

``--ranks`` gloo processes on this machine stand in for as many nodes, one rank each, so every
one of them plans, as the first rank of every node does (``megatron/plans/shared_plans.py``). Each
runs the real feed (``feed.MicroBatchFeed`` over a ``DocumentSampler``, ``--ahead`` micro-batches
planned ahead in one planner process) on the first shape of ``bench_plan_scale.py`` (power-law
lengths, 1024 GPUs at 75% of 16384 tokens each, zeppelin-B, LLaMA-3B), and trains each
micro-batch for the step the simulator predicts for its plan (``meta["predicted_step_s"]``, a
sleep standing in for the GPUs): plans are asked for at the predicted step rate.

Per step, the seconds the training thread waited for its plan (the first step waits for the
first plans whatever is done); per rank, the CPU seconds of its planner process per plan made
there, and of the training process's own threads (receiving and decoding the plans, the
sampler) per plan taken, and the sampler's share of it. ``--no-share``: every rank plans every
micro-batch itself.

    python scripts/bench_plan_share.py                 # 2 ranks, plans shared
    python scripts/bench_plan_share.py --no-share      # every rank plans every micro-batch
    python scripts/bench_plan_share.py --ranks 2 --steps 16 --ahead 2

On a cluster of ``n`` nodes the planning rank of each node plans one micro-batch in ``n``: the
last line works out what that costs a node per second of training at 128 nodes (8 GPUs each).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_plan_scale import SHAPES  # noqa: E402

from megatron_zeppelin.comm.plan_share import PlanShare  # noqa: E402
from megatron_zeppelin.config import ZeppelinConfig  # noqa: E402
from megatron_zeppelin.megatron.documents.sampler import DocumentSampler  # noqa: E402
from megatron_zeppelin.megatron.plans.feed import MicroBatchFeed  # noqa: E402
from megatron_zeppelin.megatron.plans.plan_workers import PlanRecipe  # noqa: E402
from megatron_zeppelin.planner.baselines.distributions import sample_lengths  # noqa: E402
from megatron_zeppelin.planner.cost.costmodel import CostModel  # noqa: E402
from megatron_zeppelin.planner.cost.models import get_model  # noqa: E402
from megatron_zeppelin.topology.model import Topology  # noqa: E402
from megatron_zeppelin.topology.presets import get_topology  # noqa: E402

SHAPE = SHAPES[0]
NODES, GPUS_PER_NODE = 128, 8


def _recipe() -> PlanRecipe:
    topology = get_topology(SHAPE.cluster, num_nodes=SHAPE.gpus // GPUS_PER_NODE)
    cost = CostModel.default(get_model(SHAPE.model), topology)
    config = ZeppelinConfig(capacity=SHAPE.capacity)
    return PlanRecipe(topology, cost, config, config.planner_options(cost))


def _sampler(steps: int, ahead: int) -> DocumentSampler:
    """A corpus with room for every micro-batch the run draws, one micro-batch per step."""
    corpus = sample_lengths(SHAPE.dist, num_tokens=(steps + ahead + 2) * SHAPE.tokens, seed=0)
    return DocumentSampler(
        corpus,
        tokens_per_step=SHAPE.tokens,
        micro_batch_capacity=SHAPE.capacity * SHAPE.gpus,
        max_length=SHAPE.tokens // 2,
    )


def _cpu_of(pid: int) -> float:
    """User and system CPU seconds of a live process (``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(sampler: DocumentSampler) -> list[float]:
    """The CPU seconds ``sampler.next_step`` takes, in its thread, summed as it goes."""
    seconds, draw = [0.0], sampler.next_step

    def next_step():  # noqa: ANN202 - the sampler's own
        start = time.thread_time()
        try:
            return draw()
        finally:
            seconds[0] += time.thread_time() - start

    sampler.next_step = next_step  # type: ignore[method-assign]
    return seconds


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: dict) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    share = None
    if args.share:
        nodes = Topology(num_nodes=world, gpus_per_node=1, nics_per_node=1)
        share = PlanShare.create(nodes, [range(world)], timeout_s=600)
    sampler = _sampler(args.steps, args.ahead)
    drawing = _timed(sampler)
    feed = MicroBatchFeed(sampler, _recipe(), ahead=args.ahead, workers=1, share=share)
    waits, steps = [], []
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    try:
        for _ in range(args.steps):
            start = time.perf_counter()
            item = feed.next()
            waits.append(time.perf_counter() - start)
            steps.append(item.plan.meta["predicted_step_s"])
            time.sleep(steps[-1])  # the GPUs train the micro-batch
        planner_cpu = sum(map(_cpu_of, feed.planner_pids))  # before they end
        made = feed.stats.num_made
    finally:
        feed.close()
    now = resource.getrusage(resource.RUSAGE_SELF)
    own = now.ru_utime + now.ru_stime - cpu.ru_utime - cpu.ru_stime
    out[rank] = {"waits": waits, "steps": steps, "planner_cpu": planner_cpu, "own_cpu": own,
                 "made": made, "startup_s": feed.stats.startup_s,
                 "sampler_cpu": drawing[0]}  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="processes, one per node (2)")
    parser.add_argument("--steps", type=int, default=12, help="micro-batches trained (12)")
    parser.add_argument("--ahead", type=int, default=2, help="--zeppelin-plan-ahead (2)")
    parser.add_argument("--no-share", dest="share", action="store_false")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(args.ranks, os.path.join(tmp, "store"), args, out),
                 nprocs=args.ranks)  # fmt: skip
        results = [out[r] for r in range(args.ranks)]
    how = "shared from the rank that made it" if args.share else "planned on every rank"
    print(f"{args.ranks} ranks, {args.steps} micro-batches of {SHAPE.name}, plans {how}, "
          f"{args.ahead} planned ahead")  # fmt: skip
    step = statistics.mean(s for r in results for s in r["steps"])
    later = [w for r in results for w in r["waits"][1:]]
    first = max(r["waits"][0] for r in results)
    print(f"predicted step {step:.2f} s; first step waited {first:.2f} s (planner processes "
          f"started in {max(r['startup_s'] for r in results):.2f} s); later steps waited "
          f"{max(later):.3f} s at most, {statistics.mean(later):.3f} s on average")  # fmt: skip
    planner = sum(r["planner_cpu"] for r in results) / sum(r["made"] for r in results)
    own = statistics.mean(r["own_cpu"] for r in results) / args.steps
    drawn = statistics.mean(r["sampler_cpu"] for r in results) / args.steps
    print(f"CPU per plan made: {planner:.2f} s in a planner process; per plan taken: "
          f"{own:.3f} s in the training process, of which {drawn:.3f} s drawing the "
          "micro-batches from the sampler")  # fmt: skip
    # On the cluster: one planner per node plans 1 micro-batch in NODES; every GPU's rank
    # takes every plan.
    per_node = (planner / NODES + GPUS_PER_NODE * own) / step
    every = (GPUS_PER_NODE * (planner + own)) / step
    print(f"at {NODES} nodes of {GPUS_PER_NODE} GPUs: {per_node:.2f} cores per node with plans "
          f"shared, {every:.2f} with every rank planning every micro-batch")  # fmt: skip


if __name__ == "__main__":
    main()
