"""The pool's compiled ring search on the rings of one batch: its milliseconds, call by call.

``pool_rings.place_ring`` asks ``loops/ring_search.place`` for every ring the pool placement
makes: thousands a plan at 1024 GPUs, each over every GPU. Timing the plan says little about
this one part on a 2-core machine whose speed moves by a third between runs, so this script
plans one batch of ``bench_plan_scale.py``'s rows once, keeps every call's arguments (each GPU's
load, tokens and room as they were), and then times the compiled search alone over those calls,
the fastest of ``--repeats`` passes: all of it, and the first-fit tries alone (no fallback to
the soonest ring). The pool places an order's rings in one compiled call (``loops/ring_line.py``),
which makes the same searches: the calls are recorded with it turned off, ring by ring, and the
line itself is timed too, over every order's rings (the searches and the rings added to the
loads). The same calls can be timed by another version of the planner (run the script with
``PYTHONPATH`` set to its tree): the plans are the same, and so are the calls.

    python scripts/bench_ring_search.py --only 2 --seed 1    # the lognormal on dgx-h100
    python scripts/bench_ring_search.py --only 9 --repeats 5

``--only``: the row of ``bench_plan_scale.py --stress --embedded`` (0: the first). numba is
needed: without it the search runs in numpy and the script says so.
"""

from __future__ import annotations

import argparse
import time

import bench_plan_scale as scale
import numpy as np

from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.loops import ring_line, ring_search
from megatron_zeppelin.planner.place import pool
from megatron_zeppelin.planner.search.partition import PlannerOptions, warm


def record(shape: scale.Shape, lengths: list[int]) -> list[tuple]:
    """Every call ``place_ring`` makes to ``ring_search.place`` while ``shape``'s batch is
    planned with the rings placed one by one, its arrays copied as they were."""
    calls: list[tuple] = []
    place, line = ring_search.place, pool.ring_line.compiled

    def kept(cost, tokens, room, *rest):  # noqa: ANN001, ANN002, ANN202 - place's arguments
        calls.append((cost.copy(), tokens.copy(), room.copy(), *rest))
        return place(cost, tokens, room, *rest)

    ring_search.place, pool.ring_line.compiled = kept, lambda: False
    try:
        scale.plan_once(shape, lengths, PlannerOptions())
    finally:
        ring_search.place, pool.ring_line.compiled = place, line
    return calls


def record_lines(shape: scale.Shape, lengths: list[int]) -> list[tuple]:
    """Every call of ``ring_line.place`` (one pool order's rings) while ``shape``'s batch is
    planned, its loads copied as they were."""
    calls: list[tuple] = []
    place = ring_line.place

    def kept(line, *rest):  # noqa: ANN001, ANN002, ANN202 - ring_line.place's arguments
        loads = (line.cost, line.attention, line.exposed, line.tokens)
        calls.append((tuple(a.copy() for a in loads), *rest))
        return place(line, *rest)

    ring_line.place = kept
    try:
        scale.plan_once(shape, lengths, PlannerOptions())
    finally:
        ring_line.place = place
    return calls


def timed_lines(calls: list[tuple], repeats: int) -> float:
    """The fastest of ``repeats`` passes over ``calls`` (milliseconds), each on fresh copies of
    the loads (made before the clock starts)."""
    best = np.inf
    for _ in range(repeats):
        lines = [ring_line.Line(*(a.copy() for a in loads)) for loads, *_ in calls]
        start = time.perf_counter()
        for line, (_, *rest) in zip(lines, calls):
            ring_line.place(line, *rest)
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def timed(calls: list[tuple], fallback: bool, repeats: int) -> tuple[float, int]:
    """The fastest of ``repeats`` passes over ``calls`` (milliseconds), and how many found no
    try within the target (those the fallback answers)."""
    best, missed = np.inf, 0
    for _ in range(repeats):
        missed = 0
        start = time.perf_counter()
        for cost, tokens, room, weight, floor, tries, limit, k, asked in calls:
            found = ring_search.place(
                cost, tokens, room, weight, floor, tries, limit, k, asked and fallback
            )
            missed += found is None
        best = min(best, time.perf_counter() - start)
    return 1e3 * best, missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, default=2, help="the row (default 2: lognormal)")
    parser.add_argument("--seed", type=int, default=0, help="the batch's seed (default 0)")
    parser.add_argument("--repeats", type=int, default=3, help="passes timed (default 3)")
    args = parser.parse_args()
    if not warm() or not ring_search.compiled() or not ring_line.compiled():
        raise SystemExit("numba is not installed: the ring search runs in numpy, not timed here")
    shapes = scale.SHAPES + scale.STRESS + scale.EMBEDDED
    if not 0 <= args.only < len(shapes):
        raise SystemExit(f"--only takes a row from 0 to {len(shapes) - 1}, not {args.only}")
    shape = shapes[args.only]
    lengths = sample_lengths(
        shape.dist,
        num_tokens=shape.tokens,
        seed=args.seed,
        max_length=min(shape.tokens // 2, 1 << 20),
    )
    calls = record(shape, lengths)
    lines = record_lines(shape, lengths)
    tries = sum(len(call[5].sizes) for call in calls)
    whole, _ = timed(calls, True, args.repeats)
    first, missed = timed(calls, False, args.repeats)
    print(
        f"{shape.name}, seed {args.seed}: {len(lengths)} documents, {len(calls)} rings searched "
        f"({tries / max(1, len(calls)):.1f} tries each), {missed} to the soonest"
    )
    print(f"ring search: {whole:.1f} ms in all, {first:.1f} ms of first-fit tries")
    print(f"rings' lines: {timed_lines(lines, args.repeats):.1f} ms for {len(lines)} pool orders")


if __name__ == "__main__":
    main()
