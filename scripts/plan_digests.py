"""The plans of the benchmark batches, by digest and simulated step, to compare two versions of
the planner batch by batch.

A change meant only to make planning faster must leave every plan as it was: the same digest
(SHA-256 of the plan's JSON as ``megatron/runtime.py:plan_digest`` takes it, but with the meta
too, less ``meta["candidates"]``: the search's trail of what it placed and timed, which a faster
search may shorten without changing the plan it keeps). A change meant to change plans
is judged by each batch's simulated step against the one before. The batches:

- ``sweep``: ``compare_sweep.py``'s configurations, 3 seeds each at fill 0.9 (66 batches);
- ``stress``: its stress grid (16, 128 and 1024 GPUs, fills 0.5 and 0.95, 2 seeds: 72);
- ``latency``: ``bench_planner.py --quick``'s cells (1024 GPUs, 4M tokens, 7 seeds: 28);
- ``scale``: ``bench_plan_scale.py``'s shapes and its embedded grid, 2 seeds (40; its stress
  grid is ``stress``'s 1024-GPU cells).

    python scripts/plan_digests.py --write before.json            # every set
    python scripts/plan_digests.py --against before.json          # the same, compared
    python scripts/plan_digests.py --sets latency --against before.json

``--against`` prints each batch whose plan changed (its step after over before, and both plan
times), then how many plans are the same and the steps' ratios: the largest, and the geometric
mean. Plan seconds are CPU seconds of one process (``time.process_time``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_plan_scale import EMBEDDED, SHAPES  # noqa: E402
from compare_sweep import STRESS_CAPACITY, STRESS_MAX_LENGTH, configurations  # noqa: E402

from megatron_zeppelin.planner.baselines.distributions import (  # noqa: E402
    DISTRIBUTIONS,
    STRESS_DISTRIBUTIONS,
    sample_lengths,
)
from megatron_zeppelin.planner.cost.costmodel import CostModel  # noqa: E402
from megatron_zeppelin.planner.cost.models import get_model  # noqa: E402
from megatron_zeppelin.planner.plan.plan import Plan  # noqa: E402
from megatron_zeppelin.planner.search.partition import plan_batch  # noqa: E402
from megatron_zeppelin.planner.simulate.simulator import simulate  # noqa: E402
from megatron_zeppelin.topology.presets import get_topology  # noqa: E402

SETS = ("sweep", "stress", "latency", "scale")
Batch = tuple[str, str, str, int, int, int, int | None, int]
"""Its name, cluster, model, GPUs, tokens, capacity, longest document kept, seed."""


def batches(sets: list[str]) -> Iterator[Batch]:
    """Every batch of ``sets`` (module docstring)."""
    if "sweep" in sets:
        for p in configurations(False):
            tokens = int(0.9 * p["gpus"] * p["capacity"])
            for seed in range(3):
                yield (
                    "sweep " + p["dist"],
                    p["cluster"],
                    p["model"],
                    p["gpus"],
                    tokens,
                    p["capacity"],
                    131072,
                    seed,
                )
    if "stress" in sets:
        for dist in STRESS_DISTRIBUTIONS:
            for gpus in (16, 128, 1024):
                for fill in (0.5, 0.95):
                    tokens = int(fill * gpus * STRESS_CAPACITY)
                    cut = min(STRESS_MAX_LENGTH, tokens // 2)
                    for seed in range(2):
                        yield (
                            "stress " + dist,
                            "zeppelin-C",
                            "llama-7b",
                            gpus,
                            tokens,
                            STRESS_CAPACITY,
                            cut,
                            seed,
                        )
    if "latency" in sets:
        tokens = 1 << 22
        for dist in DISTRIBUTIONS:
            for seed in range(7):
                yield (
                    "latency " + dist,
                    "zeppelin-C",
                    "llama-7b",
                    1024,
                    tokens,
                    max(65536, math.ceil(1.25 * tokens / 1024)),
                    None,
                    seed,
                )
    if "scale" in sets:
        for s in (*SHAPES, *EMBEDDED):
            for seed in range(2):
                yield (
                    "scale " + s.dist,
                    s.cluster,
                    s.model,
                    s.gpus,
                    s.tokens,
                    s.capacity,
                    min(s.tokens // 2, 1 << 20),
                    seed,
                )


def plan_one(batch: Batch) -> dict:
    name, cluster, model, gpus, tokens, capacity, cut, seed = batch
    topology = get_topology(cluster, num_nodes=gpus // 8)
    cost = CostModel.default(get_model(model), topology)
    lengths = sample_lengths(name.split()[1], num_tokens=tokens, seed=seed, max_length=cut)
    gc.collect()
    start = time.process_time()
    plan = plan_batch(lengths, topology=topology, cost_model=cost, capacity=capacity)
    seconds = time.process_time() - start
    return {
        "key": " ".join(map(str, batch)),
        "digest": _digest(plan),
        "step_s": simulate(plan, cost).step_time_s,
        "plan_s": seconds,
    }


def _digest(plan: Plan) -> str:
    """The plan's digest (module docstring): everything but ``meta["candidates"]``."""
    data = plan.to_dict()
    data["meta"] = {key: value for key, value in data["meta"].items() if key != "candidates"}
    return hashlib.sha256(json.dumps(data, separators=(",", ":")).encode()).hexdigest()[:16]


def compare(rows: list[dict], path: str) -> None:
    """``--against`` (module docstring)."""
    with open(path) as f:
        before = {r["key"]: r for r in json.load(f)}
    same, ratios, times = 0, [], []
    for row in rows:
        old = before.get(row["key"])
        if old is None:
            continue
        ratio = row["step_s"] / old["step_s"]
        ratios.append(ratio)
        times.append(row["plan_s"] / old["plan_s"])
        if row["digest"] == old["digest"]:
            same += 1
        else:
            print(
                f"{row['key']}: step x{ratio:.4f}, plan {old['plan_s']:.2f} -> "
                f"{row['plan_s']:.2f} s"
            )
    print(
        f"{same} of {len(ratios)} plans the same; step after / before: max {max(ratios):.4f}, "
        f"geometric mean {_geomean(ratios):.4f}; plan time after / before: geometric mean "
        f"{_geomean(times):.3f}"
    )


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.mean(map(math.log, values)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    parser.add_argument("--write", help="write every batch's digest, step and plan time here")
    parser.add_argument("--against", help="compare with a file --write wrote before")
    parser.add_argument("--first", type=int, help="only the first N batches of the sets")
    args = parser.parse_args()
    rows = []
    for batch in islice(batches(args.sets), args.first):
        rows.append(plan_one(batch))
        print(
            f"{rows[-1]['key']}: {rows[-1]['digest']} {rows[-1]['plan_s']:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    if args.write:
        with open(args.write, "w") as f:
            json.dump(rows, f, indent=1)
    if args.against:
        compare(rows, args.against)


if __name__ == "__main__":
    main()
