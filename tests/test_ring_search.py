"""Tier: pure. The pool's search for a ring's GPUs compiled by numba
(``planner/loops/ring_search.py``) against numpy's (``pool_rings._members`` of
``pool_rings._Ends``' ends): the same GPUs, in the same order, ties included.

Skipped where numba is not installed (the ``fast`` extra).
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
from pool_batches import NEEDS_NUMBA

from megatron_zeppelin.planner.loops import ring_search
from megatron_zeppelin.planner.loops.ring_search import Tries
from megatron_zeppelin.planner.place.pool_rings import Arrays, _Ends, _members, _place

pytestmark = [pytest.mark.pure, NEEDS_NUMBA]


def _random_gpus(rng: np.random.Generator, least_nodes: int):  # noqa: ANN202
    """GPUs per node, GPUs, and their loads with many ties (a few values, GPUs one rounding
    step apart), tokens, rooms that bar some, the linear weight and a floor that raises some
    ends (``0`` half the time)."""
    k = int(rng.choice([2, 4, 8]))
    world = k * int(rng.integers(least_nodes, 17))
    cost = rng.choice([0.0, 0.5, 1.0, 1.0 + 2**-52, 2.0], size=world) * rng.choice([1.0, 1.1])
    tokens = rng.integers(0, 100, size=world).astype(np.int64)
    weight = float(rng.choice([0.0, 1e-3, 0.01]))
    floor = int(rng.choice([0, 0, 60, 150]))
    return k, world, cost, tokens, 120 - tokens, weight, floor


@pytest.mark.parametrize("seed", range(300))
def test_compiled_members_are_numpys(seed: int) -> None:
    """The compiled ``_members`` (``ring_search.place``'s answer to each try) against numpy's:
    random loads with many ties (a few values, GPUs one rounding step apart), rooms that bar
    some GPUs, every place and a finite or infinite limit; floors that raise some ends."""
    assert ring_search.compiled()
    rng = np.random.default_rng(seed)
    k, world, cost, tokens, room, weight, floor = _random_gpus(rng, least_nodes=1)
    per_rank = int(rng.integers(1, 80))
    ends = _Ends(Arrays(cost, tokens), weight, floor, per_rank)
    for where in ("whole", "node", "any"):
        if where == "whole":
            size = k * int(rng.integers(2, max(3, world // k + 1)))
        elif where == "node":
            size = int(rng.integers(2, k + 1)) if k > 1 else 1
        else:
            size = int(rng.integers(2, world + 1))
        key = float(rng.choice([0.0, 0.25, 1.0]))
        for limit in (float(rng.choice([1.0, 1.5, 2.5, 3.5])), math.inf):
            want = _members(ends.get(), room, size, key, per_rank, limit, k, where)
            ring = ring_search._compiled()(
                cost, tokens, room, weight, floor, size, key, per_rank, limit, k,
                ring_search.PLACES[where], math.isfinite(limit),
            )  # fmt: skip
            got = tuple(ring.tolist()) if len(ring) else None
            assert got == want, (where, size, key, limit)


def _random_tries(rng: np.random.Generator, k: int, world: int) -> Tries:
    """Up to a dozen tries of every place, of sizes some of which find no GPUs."""
    rows = []
    for _ in range(int(rng.integers(1, 12))):
        where = str(rng.choice(["whole", "node", "any"]))
        size = {
            "whole": k * int(rng.integers(2, max(3, world // k + 1))),
            "node": int(rng.integers(2, k + 1)),
            "any": int(rng.integers(2, world + 1)),
        }[where]
        per_rank = int(rng.integers(1, 130))
        key = float(rng.choice([0.0, 0.25, 1.0, 1.0 + 2**-52]))
        rows.append((size, per_rank, key, where))
    sizes, per_rank, keys, wheres = zip(*rows)
    return Tries(
        np.asarray(sizes, dtype=np.int64),
        np.asarray(per_rank, dtype=np.int64),
        np.asarray(keys, dtype=np.float64),
        np.asarray([ring_search.PLACES[where] for where in wheres], dtype=np.int64),
    )


def test_compiled_ring_search_is_numpys() -> None:
    """``pool_rings._place`` (the tries in order with numpy's ``_members``, then
    ``_soonest``'s heap in Python) against ``ring_search.place``: the same try and the same
    GPUs, on loads with ties and tries of every place, some of which find nothing, under limits
    some tries fit within and some none do, with the fallback and without. Every answer comes
    up: a try within the limit, the soonest of all, none."""
    kinds = collections.Counter()
    for seed in range(150):
        rng = np.random.default_rng(1000 + seed)
        k, world, cost, tokens, room, weight, floor = _random_gpus(rng, least_nodes=2)
        arrays, tries = Arrays(cost, tokens), _random_tries(rng, k, world)
        for limit in (0.5, 1.5, 2.5, 3.5):
            found = {}
            for fallback in (True, False):
                want = _place(tries, arrays, room, weight, floor, limit, k, fallback=fallback)
                got = ring_search.place(
                    cost, tokens, room, weight, floor, tries, limit, k, fallback
                )
                assert got == want, (seed, limit, fallback)
                found[fallback] = want
            kinds["fits" if found[False] else "soonest" if found[True] else "none"] += 1
    assert min(kinds["fits"], kinds["soonest"], kinds["none"]) > 0, kinds


def test_compiled_sort_is_numpys() -> None:
    """The compiled loop's sort by hand (``ring_search._sorted``) and its least few by selection
    (``_least``, every count from none to all) against ``np.sort``: empty, short and long
    arrays, random, with many ties, sorted and reversed; the values left as they were."""
    assert ring_search._compiled_place() is not None  # puts the compiled loops in place
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 5, 17, 18, 33, 100, 1024, 8192):
        for values in (
            rng.random(n),
            rng.choice([0.0, 1.0, 1.0 + 2**-52, 2.0], n),
            np.sort(rng.random(n)),
            np.sort(rng.random(n))[::-1].copy(),
        ):
            want, given = np.sort(values).tolist(), values.tolist()
            assert ring_search._sorted(values).tolist() == want, n
            for count in sorted({0, 1, 2, 7, 8, 33, n // 2, n - 1, n}):
                if 0 <= count <= n:
                    assert ring_search._least(values, count).tolist() == want[:count], (n, count)
            assert values.tolist() == given, n  # each works on a copy
