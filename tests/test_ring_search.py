"""Tier: pure. The pool's search for a ring's GPUs compiled by numba
(``planner/loops/ring_search.py``) against numpy's (``pool_rings._members`` of
``pool_rings._Ends``' ends): the same GPUs, in the same order, ties included.

Skipped where numba is not installed (the ``fast`` extra).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from pool_batches import NEEDS_NUMBA

from megatron_zeppelin.planner.loops import ring_search
from megatron_zeppelin.planner.place.placement import CapacityError
from megatron_zeppelin.planner.place.pool_rings import Arrays, _Ends, _members, _soonest

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
    """Random loads with many ties (a few values, GPUs one rounding step apart), rooms that
    bar some GPUs, every place and a finite or infinite limit; floors that raise some ends."""
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
            got = ring_search.members(
                cost, tokens, room, weight, floor, size, key, per_rank, limit, k, where
            )
            assert got == want, (where, size, key, limit)


@pytest.mark.parametrize("seed", range(150))
def test_compiled_soonest_is_numpys(seed: int) -> None:
    """``pool_rings._soonest`` (a heap of tries in Python, numpy's partitions and
    ``_members``) against ``ring_search.soonest``: the same try and the same GPUs, on loads with
    ties and tries of every place, some of which find nothing."""
    rng = np.random.default_rng(1000 + seed)
    k, world, cost, tokens, room, weight, floor = _random_gpus(rng, least_nodes=2)
    arrays = Arrays(cost, tokens)
    tries = []
    for _ in range(int(rng.integers(1, 12))):
        where = str(rng.choice(["whole", "node", "any"]))
        size = {
            "whole": k * int(rng.integers(2, max(3, world // k + 1))),
            "node": int(rng.integers(2, k + 1)),
            "any": int(rng.integers(2, world + 1)),
        }[where]
        per_rank = int(rng.integers(1, 130))
        key = float(rng.choice([0.0, 0.25, 1.0, 1.0 + 2**-52]))
        tries.append((size, per_rank, _Ends(arrays, weight, floor, per_rank), key, where))
    least = np.sort(cost)
    try:
        want = _soonest(tries, room, least, k, 0, 1)
    except CapacityError:
        want = None
    plain = [(size, per_rank, key, where) for size, per_rank, _, key, where in tries]
    got = ring_search.soonest(cost, tokens, room, least, weight, floor, plain, k)
    if want is None:
        assert got is None
    else:
        assert got is not None
        index, ring = got
        assert (ring, tries[index][4] == "whole") == want
