"""One pool order's rings (``pool.place_pool``) placed in one compiled call.

The pool places a batch's rings one after the other, longest first, each where
``pool_rings.place_ring`` finds it GPUs on the loads the rings before it left. The search for a
ring's GPUs is compiled already (``ring_search.py``), but each ring still cost Python its turn:
the search's arguments, adding the ring to ``Loads`` member by member, and the arrays kept in
step. Where few documents share a GPU, a thousand-GPU batch has hundreds of rings per order and
the turns took as long as the searches.

Here the whole line runs compiled: each ring's tries (``pool_rings.ring_tries``, worked out
before, as they depend on the length and the goal alone) are searched by ``ring_search``'s own
loop, and the ring is added to the loads as ``Loads.add_ring`` adds it: each member's zigzag
tokens (``ring_prices._zigzag_tokens``), and its share priced as ``Loads.rank_share`` prices it
over NVLink, or flat across nodes (a member whose edges stay inside its node waits less), with
the same float operations in the same order. A ring over whole nodes may take the 2-D scheme,
which ``Loads`` prices (``schemes.py``): its share comes with its try (``Tries.shares``). The
same GPUs and the same loads to the last bit (``tests/test_whole_docs.py`` compares the three
ways: this line, ring by ring compiled, and numpy). Compiled by numba where it is installed
(``loops/jit.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from megatron_zeppelin.planner.loops import jit, ring_prices, ring_search
from megatron_zeppelin.planner.loops.ring_prices import (
    _flat_share,
    _min_ring,
    _share,
    _zigzag_tokens,
)
from megatron_zeppelin.planner.loops.ring_search import Tries, _tries
from megatron_zeppelin.planner.loops.ring_search import _place as _search

__all__ = ["Line", "compiled", "place", "tries", "warm"]

_NODE = ring_search.PLACES["node"]
_WHOLE = ring_search.PLACES["whole"]


def compiled() -> bool:
    """Whether ``place`` runs in this process."""
    return _compiled() is not None


def warm() -> None:
    """The loops built (or read from numba's cache) now (``search.partition.warm``)."""
    if compiled():
        lengths, terms = np.asarray([1000, 4000]), np.ones(15)
        found, offsets, _ = tries(lengths, 2, 4, 8192, (0.1, 100, 4096), True, terms)
        loads = np.zeros(4), np.zeros(4), np.zeros(4), np.zeros(4, dtype=np.int64)
        place(Line(*loads), [1000, 4000], found, offsets, 8192, 0.0, 0, 1.0, 2, terms)


class Line:
    """Every GPU's ``Loads`` figures as arrays (``cost``, ``attention``, ``exposed``,
    ``tokens``), which ``place`` adds the rings to."""

    def __init__(
        self, cost: np.ndarray, attention: np.ndarray, exposed: np.ndarray, tokens: np.ndarray
    ) -> None:
        self.cost, self.attention, self.exposed, self.tokens = cost, attention, exposed, tokens


def place(
    line: Line,
    lengths: list[int],
    tries: Tries,
    offsets: np.ndarray,
    capacity: int,
    weight: float,
    floor: int,
    limit: float,
    k: int,
    terms: np.ndarray,
) -> tuple[int, list[int], list[tuple[int, ...]]]:
    """The documents of ``lengths`` placed one after the other as ``pool_rings.place_ring``
    places them, each with its fallback, added to ``line``: how many were placed (all, or up to
    the first that finds no GPUs), and for each its try's place (``ring_search.PLACES``) and
    its ring. ``tries``: every document's, one after the other, each's starting at its
    ``offsets`` (one more than the documents; ``tries`` gives them so). ``terms``:
    ``Loads.ring_terms``."""
    kernel = _compiled()
    assert kernel is not None, "ring_line.place runs where the loop compiles"
    if not lengths:
        return 0, [], []
    columns = tries.columns()
    chosen = np.empty(len(lengths), dtype=np.int64)
    ring_at = np.zeros(len(lengths) + 1, dtype=np.int64)
    ranks = np.empty(int(tries.sizes.sum()), dtype=np.int64)  # room for any ring each may try
    stop = kernel(
        line.cost, line.attention, line.exposed, line.tokens, capacity, float(weight),
        int(floor), float(limit), int(k), np.asarray(lengths, dtype=np.int64), offsets, *columns,
        terms, chosen, ring_at, ranks,
    )  # fmt: skip
    places = tries.places[chosen[:stop]].tolist()
    flat, at = ranks.tolist(), ring_at.tolist()
    rings = [tuple(flat[at[i] : at[i + 1]]) for i in range(stop)]
    return int(stop), places, rings


def _add(cost, attention, exposed, tokens, ring, length, place, share, weight, k, terms):  # noqa: ANN001, ANN202, E501, PLR0913 - compiled by numba
    """``Loads.add_ring`` of a ring found at ``place``: over NVLink on one node, else across
    nodes (``share``: a 2-D-capable ring's ``(compute, crossing, inner)``, ``Tries.shares``)."""
    g = ring.shape[0]
    if place == _NODE:
        compute, waits = _share(length, g, terms)
        for position in range(g):
            rank, n = ring[position], _zigzag_tokens(length, g, position)
            cost[rank] += compute + waits + weight * n
            attention[rank] += compute
            exposed[rank] += waits
            tokens[rank] += n
        return
    if place == _WHOLE:
        compute, edge, inner = share[0], share[1], share[2]
    else:
        compute, edge, inner = _flat_share(length, g, terms)
    for position in range(g):
        rank, n = ring[position], _zigzag_tokens(length, g, position)
        node = rank // k
        before = ring[position - 1] // k if position > 0 else ring[g - 1] // k
        after = ring[position + 1] // k if position < g - 1 else ring[0] // k
        waits = edge if before != node or after != node else inner
        cost[rank] += compute + waits + weight * n
        attention[rank] += compute
        exposed[rank] += waits
        tokens[rank] += n


def _line(
    cost,
    attention,
    exposed,
    tokens,
    capacity,
    weight,
    floor,
    limit,
    k,
    lengths,
    offsets,
    sizes,
    per_rank,
    keys,
    places,
    shares,
    terms,
    chosen,
    ring_at,
    ranks,
):  # noqa: ANN001, ANN202, E501, PLR0913 - compiled by numba
    """``place``: ring after ring, ``ring_search``'s search with its fallback on the loads so
    far, then ``_add``; the index of the first ring no GPUs take, or the number of rings."""
    room = np.empty(cost.shape[0], dtype=np.int64)
    for i in range(lengths.shape[0]):
        for r in range(cost.shape[0]):
            room[r] = capacity - tokens[r]
        low, high = offsets[i], offsets[i + 1]
        index, ring = _search(
            cost, tokens, room, weight, floor, sizes[low:high], per_rank[low:high],
            keys[low:high], places[low:high], limit, k, True,
        )  # fmt: skip
        if index < 0:
            return i
        at = low + index
        chosen[i] = at
        _add(
            cost, attention, exposed, tokens, ring, lengths[i], places[at], shares[at], weight,
            k, terms,
        )  # fmt: skip
        ring_at[i + 1] = ring_at[i] + ring.shape[0]
        ranks[ring_at[i] : ring_at[i + 1]] = ring
    return lengths.shape[0]


def tries(
    lengths: np.ndarray,
    k: int,
    world: int,
    capacity: int,
    goal: tuple[float, int, int],
    two_d: bool,
    terms: np.ndarray,
) -> tuple[Tries, np.ndarray, np.ndarray]:
    """``pool_rings.ring_tries`` of every length at once, as one ``Tries`` (where each length's
    start: ``offsets``, one more than the lengths), and which lengths asked whether they may
    take the 2-D scheme wide (``ring_options.wide_two_d``: those are left for ``ring_tries``,
    as are the 2-D keys and shares over whole nodes, ``nan``). ``goal``: the target load, the
    per-rank tokens below which a ring does not cross nodes, and the most tokens a member takes
    (``ring_options.PoolGoal``)."""
    kernel = _compiled_tries()
    assert kernel is not None, "ring_line.tries runs where the loop compiles"
    target, nic_chunk, most = goal
    *columns, offsets, asked = kernel(
        lengths, int(k), int(world), int(capacity), float(target), int(nic_chunk), int(most),
        bool(two_d), terms,
    )  # fmt: skip
    return Tries(*columns, np.full((len(columns[0]), 3), np.nan)), offsets, asked


def _sizes(length, work, target, k, world, capacity, most):  # noqa: ANN001, ANN202 - compiled
    """``pool_rings.ring_sizes`` (``ring_options.narrowest`` the least of them)."""
    low = _min_ring(length, most, 1)
    low = _min_ring(length, capacity, 1) if low < 0 else low
    low = max(2, 2 if low < 0 else low)
    start = min(world, max(low, math.floor(work / target)))
    stop = min(world, 2 * start + 2 * k)
    sizes = np.empty(stop - low + 1, dtype=np.int64)
    for i in range(stop - start + 1):
        sizes[i] = start + i
    for i in range(start - low):
        sizes[stop - start + 1 + i] = start - 1 - i
    return sizes


def _all_tries(lengths, k, world, capacity, target, nic_chunk, most, two_d, terms):  # noqa: ANN001, ANN202, E501, PLR0913 - compiled by numba
    """``tries``: each length's sizes, then its tries at them (``ring_search._tries``, not
    wide), one after the other."""
    count = lengths.shape[0]
    offsets = np.zeros(count + 1, dtype=np.int64)
    asked = np.zeros(count, dtype=np.bool_)
    parts = []
    for i in range(count):
        length = lengths[i]
        work = _share(length, 1, terms)[0] + terms[11] * length
        sizes = _sizes(length, work, target, k, world, capacity, most)
        found = _tries(length, sizes, k, capacity, nic_chunk, two_d, False, terms)
        parts.append(found)
        asked[i] = found[4]
        offsets[i + 1] = offsets[i] + found[0].shape[0]
    total = offsets[count]
    sizes, per_rank = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
    keys, places = np.empty(total), np.empty(total, dtype=np.int64)
    for i in range(count):
        low, high = offsets[i], offsets[i + 1]
        sizes[low:high], per_rank[low:high] = parts[i][0], parts[i][1]
        keys[low:high], places[low:high] = parts[i][2], parts[i][3]
    return sizes, per_rank, keys, places, offsets, asked


@functools.cache
def _compiled() -> Callable | None:
    """``_line`` compiled (after ``ring_search``'s search and ``ring_prices``' prices, which it
    calls), or ``None`` without numba."""
    kernels = ring_search.kernels()
    if kernels is None or not ring_prices.bind(globals()):
        return None
    globals()["_search"], globals()["_tries"] = kernels
    return jit.compile_loops(globals(), "_add", "_line")


@functools.cache
def _compiled_tries() -> Callable | None:
    """``_all_tries`` compiled (after ``_compiled``, which binds what it calls), or ``None``."""
    if _compiled() is None:
        return None
    return jit.compile_loops(globals(), "_sizes", "_all_tries")
