"""What a rank spends taking a 1024-GPU plan: the plan's wire form (``plan_wire``) against its
pickle (``Plan.__reduce__``), the collector's passes included.

One plan of ``bench_plan_scale.py``'s first shape (power-law lengths, 1024 GPUs at 75% of 16384
tokens each, zeppelin-B, LLaMA-3B; seed 0) is planned once. Then, alternating the two forms
``--rounds`` times, CPU seconds (``time.process_time``) per plan of:

* making the bytes (in the planner process) and reading them back, the collector off;
* taking ``--plans`` plans one after another with Python's collector on, as a training process
  does: the last ``--keep`` plans held (planned ahead, then trained), beside torch's modules and
  a heap of ``--heap`` other long-lived objects (a training process's own); the collector's
  passes over the whole process that the plans bring are counted in, and counted.

Then what a rank works out from each plan it takes before its first layer, the remap's two
directions for its rank (``remap_layout.remap_pair``), against the same from every rank's ranges
asked of the plan rank by rank (``Plan.linear_ranges``, ``Plan.attention_ranges``) and
``remap_between`` per direction, as it was done before ``remap_pair``; the collector off. And
the whole of that work, part by part, as a training step does it: the rank's linear batch
(``build_linear_batch``, tokens read from a reader of zeros), both layouts and the remap (as
core attention works them out), and its engine (``ZeppelinAttention``: its ring steps, its
attention layout, the 2-D documents' head layout), for three ranks. Last, what the logging
rank adds for each plan line it prints (``--zeppelin-log-plan-every``): the plan's summary
(``runtime.plan_summary``: its digest, tiers, imbalance and predicted bytes per link class);
and the simulator's report of the plan (``simulate``: what ``zeppelin plan`` and the benchmarks
print for each plan).

    python scripts/bench_plan_wire.py
    python scripts/bench_plan_wire.py --rounds 5 --plans 16 --heap 500000
"""

from __future__ import annotations

import argparse
import gc
import pickle
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch  # noqa: F401 - a training process's modules, for the collector to walk

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_plan_scale import SHAPES  # noqa: E402

from megatron_zeppelin.attention.engine import ZeppelinAttention  # noqa: E402
from megatron_zeppelin.config import ZeppelinConfig  # noqa: E402
from megatron_zeppelin.megatron.documents.batch import build_linear_batch  # noqa: E402
from megatron_zeppelin.megatron.documents.sampler import DocumentSlice  # noqa: E402
from megatron_zeppelin.megatron.runtime import plan_summary  # noqa: E402
from megatron_zeppelin.planner.baselines.distributions import sample_lengths  # noqa: E402
from megatron_zeppelin.planner.cost.costmodel import CostModel  # noqa: E402
from megatron_zeppelin.planner.cost.models import get_model  # noqa: E402
from megatron_zeppelin.planner.plan import plan_wire  # noqa: E402
from megatron_zeppelin.planner.plan.plan import Plan  # noqa: E402
from megatron_zeppelin.planner.plan.remap_layout import (  # noqa: E402
    plan_layouts,
    remap_between,
    remap_pair,
)
from megatron_zeppelin.planner.search.partition import plan_batch  # noqa: E402
from megatron_zeppelin.planner.simulate.simulator import simulate  # noqa: E402
from megatron_zeppelin.topology.presets import get_topology  # noqa: E402

SHAPE = SHAPES[0]
FORMS: dict[str, tuple[Callable[[Plan], bytes], Callable[[bytes], Plan]]] = {
    "pickle": (lambda plan: pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads),
    "wire": (plan_wire.encode, plan_wire.decode),
}


def _plan() -> Plan:
    topology = get_topology(SHAPE.cluster, num_nodes=SHAPE.gpus // 8)
    cost = CostModel.default(get_model(SHAPE.model), topology)
    options = ZeppelinConfig(capacity=SHAPE.capacity).planner_options(cost)
    lengths = sample_lengths(
        SHAPE.dist, num_tokens=SHAPE.tokens, seed=0, max_length=min(SHAPE.tokens // 2, 1 << 20)
    )
    return plan_batch(
        lengths, topology=topology, cost_model=cost, capacity=SHAPE.capacity, options=options
    )


def _cpu(fn: Callable, *args: object, repeat: int = 5) -> float:
    """Median CPU seconds of ``fn(*args)`` (the collector off)."""
    seconds = []
    for _ in range(repeat):
        start = time.process_time()
        fn(*args)
        seconds.append(time.process_time() - start)
    return statistics.median(seconds)


class _Passes:
    """The collector's full passes (generation 2) and their CPU seconds."""

    def __init__(self) -> None:
        self.count, self.seconds, self._began = 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.process_time()
        else:
            self.count += 1
            self.seconds += time.process_time() - self._began


def _taking(data: bytes, read: Callable[[bytes], Plan], plans: int, keep: int) -> tuple:
    """CPU seconds per plan of taking ``plans`` plans with the collector on, ``keep`` held."""
    held: deque = deque(maxlen=keep)
    passes = _Passes()
    gc.collect()
    gc.enable()
    gc.callbacks.append(passes)
    try:
        start = time.process_time()
        for _ in range(plans):
            held.append(read(data))
        seconds = time.process_time() - start
    finally:
        gc.callbacks.remove(passes)
        gc.disable()
        held.clear()
    return seconds / plans, passes.count / plans, passes.seconds / plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the forms (3)")
    parser.add_argument("--plans", type=int, default=12, help="plans taken per round (12)")
    parser.add_argument("--keep", type=int, default=3, help="plans held at once (3)")
    parser.add_argument("--heap", type=int, default=300_000, help="other objects held (300000)")
    args = parser.parse_args()
    plan = _plan()
    gc.disable()
    heap = [[i] for i in range(args.heap)]  # noqa: F841 - long-lived objects the passes walk
    print(
        f"{SHAPE.name}: {len(plan.sequences)} documents, "
        f"{sum(len(s.attention) for s in plan.sequences)} spans, "
        f"{sum(map(len, plan.linear))} ranges; {len(gc.get_objects())} objects in the process"
    )
    rows: dict[str, list[tuple]] = {name: [] for name in FORMS}
    for _ in range(args.rounds):
        for name, (write, read) in FORMS.items():
            rows[name].append(_round(plan, write, read, args))
    print("form       bytes  make ms  read ms  take ms, collector on  full passes a plan (ms)")
    for name, runs in rows.items():
        size, make, read, take, passes, pass_s = (statistics.median(c) for c in zip(*runs))
        spread = f"{1e3 * min(r[3] for r in runs):.0f}-{1e3 * max(r[3] for r in runs):.0f}"
        print(
            f"{name:7s} {int(size):8d} {1e3 * make:8.1f} {1e3 * read:8.1f} {1e3 * take:8.1f} "
            f"({spread:>7s}) {passes:19.2f} ({1e3 * pass_s:.1f})"
        )
    _remaps(plan, args.rounds)
    _first_layer(plan, args.rounds)


def _remap_rank_by_rank(plan: Plan, rank: int) -> tuple:
    """Both directions from each rank's ranges asked of the plan, one direction at a time."""
    pairs = []
    for _ in range(2):
        linear = [plan.linear_ranges(r) for r in range(plan.world_size)]
        attention = [plan.attention_ranges(r) for r in range(plan.world_size)]
        pairs.append((linear, attention))
    (linear, attention), (linear_again, attention_again) = pairs
    return remap_between(linear, attention, rank), remap_between(
        attention_again, linear_again, rank
    )


def _remaps(plan: Plan, rounds: int) -> None:
    ranks = (0, plan.world_size // 2 + 3, plan.world_size - 1)
    for name, fn in (("rank by rank", _remap_rank_by_rank), ("remap_pair", remap_pair)):
        seconds = [_cpu(fn, plan, rank, repeat=1) for rank in ranks * rounds]
        print(
            f"a rank's two remaps of the plan, {name}: {1e3 * statistics.median(seconds):.0f} ms "
            f"({1e3 * min(seconds):.0f}-{1e3 * max(seconds):.0f}; ranks {list(ranks)})"
        )


class _Zeros:
    """A dataset that reads zeros (``batch.TokenReader``)."""

    def read(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray:
        return np.zeros(end - start, dtype=np.int32)


class _NoTransport:
    """The exchanger the engine is built with; nothing is sent."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def for_plan(self, plan: Plan) -> _NoTransport:
        return self


def _first_layer(plan: Plan, rounds: int) -> None:
    """CPU milliseconds of each part of a rank's work with a plan before its first layer."""
    slices = [DocumentSlice(seq.id, 0, seq.length) for seq in plan.sequences]
    ranks = (0, plan.world_size // 2 + 3, plan.world_size - 1)
    parts: dict[str, Callable[[int], object]] = {
        "linear batch": lambda rank: build_linear_batch(plan, rank, slices, _Zeros()),
        "layouts and remap": lambda rank: remap_pair(plan, rank, plan_layouts(plan)),
        "engine": lambda rank: ZeppelinAttention(plan, rank, _NoTransport(rank, plan.world_size)),
    }
    total = []
    for name, fn in parts.items():
        seconds = [_cpu(fn, rank, repeat=1) for rank in ranks * rounds]
        total.append(statistics.median(seconds))
        print(
            f"before the first layer, {name}: {1e3 * statistics.median(seconds):.1f} ms "
            f"({1e3 * min(seconds):.1f}-{1e3 * max(seconds):.1f}; ranks {list(ranks)})"
        )
    print(f"before the first layer, in all: {1e3 * sum(total):.1f} ms per plan per rank")
    spec = get_model(SHAPE.model)
    cost = CostModel.default(spec, plan.topology)
    for name, fn in (
        ("the plan line's summary", lambda: plan_summary(plan, spec, routing=True)),
        ("the simulator's report", lambda: simulate(plan, cost)),
    ):
        seconds = [_cpu(fn, repeat=1) for _ in range(rounds)]
        print(
            f"{name}: {1e3 * statistics.median(seconds):.1f} ms "
            f"({1e3 * min(seconds):.1f}-{1e3 * max(seconds):.1f})"
        )


def _round(plan: Plan, write: Callable, read: Callable, args: argparse.Namespace) -> tuple:
    """One form's bytes, make and read CPU seconds, and ``_taking``'s figures."""
    data = write(plan)
    assert read(data) == plan
    taking = _taking(data, read, args.plans, args.keep)
    return len(data), _cpu(write, plan), _cpu(read, data), *taking


if __name__ == "__main__":
    main()
