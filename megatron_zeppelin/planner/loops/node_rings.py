"""Stage 3 on one node (``within_nodes._place_node``) in one compiled loop.

A node's in-node rings come first, longest first: each is the smallest ring of the node's least
loaded GPUs with room that ends within the node's mean load (``pack``), else the one that ends
soonest (``placement.place_intra``); then its whole documents, longest first, each on the GPU of
least load (or tokens, ``by_room``) with room for it. A staged try places a thousand-GPU batch's
nodes this way, a few hundred rings a try at about 18 microseconds each in Python; here a node is
one compiled call over its GPUs' loads, with the same float operations in the same order and the
same ties (the lower GPU), so it places as ``_place_node`` does
(``tests/test_placement_shortcuts.py`` compares the two).

A ring's price at each size is worked out as ``Loads.rank_share`` and ``Loads.ring_key`` work
it out over NVLink, with the same operations on the same terms (``ring_prices.py``). A whole
document no GPU has room for (it would become a ring) is left to ``_place_node``: the call
answers ``AGAIN`` and the caller's loads are untouched. Compiled by numba where it is installed
(``loops/jit.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from megatron_zeppelin.planner.loops import jit, ring_prices
from megatron_zeppelin.planner.loops.ring_prices import (
    _key,
    _min_ring,
    _most_tokens,
    _share,
    _zigzag_tokens,
)

__all__ = ["AGAIN", "FULL", "PLACED", "compiled", "place", "warm"]

PLACED, FULL, AGAIN = 0, 1, 2
"""``place``'s answers: every document placed (rings that found no room handed on, where
allowed); a ring found no room (``CapacityError``); a whole document found no GPU with room."""


def compiled() -> bool:
    """Whether ``place`` runs in this process."""
    return _compiled() is not None


def warm() -> None:
    """The loop built (or read from numba's cache) now (``search.partition.warm``)."""
    if compiled():
        one, terms = np.ones(1, dtype=np.int64), np.ones(12)
        place(np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1, np.int64), 4, 0.0, False, terms,
              one, one, one, np.zeros(1), 1, False, False, one, one)  # fmt: skip


def place(
    cost: np.ndarray,
    attention: np.ndarray,
    exposed: np.ndarray,
    tokens: np.ndarray,
    capacity: int,
    target: float,
    packed: bool,
    terms: np.ndarray,
    ring_lengths: np.ndarray,
    largest: np.ndarray,
    whole_lengths: np.ndarray,
    whole_seconds: np.ndarray,
    smallest: int,
    by_room: bool,
    hand_on: bool,
    rings: np.ndarray,
    ranks: np.ndarray,
) -> int:
    """One node's documents placed on its GPUs' loads (``cost`` ... ``tokens``, by local index,
    changed in place): each ring's members as a bit mask in ``rings`` (0: handed on), each whole
    document's GPU in ``ranks``. ``terms``: ``Loads.ring_terms``; ``packed``: whether
    ``target`` is the node's mean load to end within. Returns ``PLACED``, ``FULL`` or
    ``AGAIN``; the loads are the caller's to throw away unless ``PLACED``."""
    kernel = _compiled()
    assert kernel is not None, "place runs where the loop compiles"
    return int(
        kernel(
            cost, attention, exposed, tokens, capacity, target, packed, terms, ring_lengths,
            largest, whole_lengths, whole_seconds, smallest, by_room, hand_on, rings, ranks,
        )
    )  # fmt: skip


def _ring(
    cost,
    attention,
    exposed,
    tokens,
    capacity,
    target,
    packed,
    terms,
    length,
    largest,
    smallest,
    order,
):  # noqa: ANN001, ANN202, E501 - compiled by numba
    """``placement.place_intra`` on the node's GPUs: the members' bit mask, 0 where no ring has
    room. ``order``: scratch, the GPUs by load."""
    k = cost.shape[0]
    start = min(smallest, k)
    if not (length + 2 * start <= capacity * start and start <= length + 1):
        start = _min_ring(length, capacity, start)
    if start < 0 or start > k:
        return 0
    for i in range(k):  # by load, ties the lower GPU (a stable sort by insertion)
        at = i
        while at > 0 and cost[order[at - 1]] > cost[i]:
            order[at] = order[at - 1]
            at -= 1
        order[at] = i
    best_finish, best_size, best_mask = np.inf, 0, 0
    last = min(start, smallest) - 1
    count = (k - start + 1) + max(0, last - 1)
    for step in range(count):
        g = start + step if step <= k - start else last - (step - (k - start + 1))
        if best_size > 0 and (g < start or g > max(largest, start)):
            break
        most = capacity - _most_tokens(length, g)
        mask, taken, busiest = 0, 0, -1
        for j in range(k):
            if taken == g:
                break
            r = order[j]
            if tokens[r] <= most:
                mask |= 1 << r
                taken += 1
                busiest = r
        if taken < g:
            continue
        finish = cost[busiest] + _key(length, g, terms)
        if packed and finish <= target:
            best_finish, best_size, best_mask = finish, g, mask
            break
        if best_size == 0 or finish < best_finish:
            best_finish, best_size, best_mask = finish, g, mask
    if best_size == 0:
        return 0
    compute, waits = _share(length, best_size, terms)
    position = 0
    for r in range(k):  # ``Loads.add_ring`` over NVLink, members in GPU order
        if best_mask >> r & 1:
            n = _zigzag_tokens(length, best_size, position)
            cost[r] += compute + waits + terms[11] * n
            attention[r] += compute
            exposed[r] += waits
            tokens[r] += n
            position += 1
    return best_mask


def _place(
    cost,
    attention,
    exposed,
    tokens,
    capacity,
    target,
    packed,
    terms,
    ring_lengths,
    largest,
    whole_lengths,
    whole_seconds,
    smallest,
    by_room,
    hand_on,
    rings,
    ranks,
):  # noqa: ANN001, ANN202, E501, PLR0913 - compiled by numba
    """``place``: ``within_nodes._place_node``'s loops."""
    order = np.empty(cost.shape[0], dtype=np.int64)
    for i in range(ring_lengths.shape[0]):
        rings[i] = _ring(
            cost, attention, exposed, tokens, capacity, target, packed, terms, ring_lengths[i],
            largest[i], smallest, order,
        )  # fmt: skip
        if rings[i] == 0 and not hand_on:
            return 1
    for j in range(whole_lengths.shape[0]):
        length, best = whole_lengths[j], -1
        for r in range(cost.shape[0]):
            if capacity - tokens[r] >= length:
                if best < 0:
                    best = r
                elif by_room and tokens[r] < tokens[best]:
                    best = r
                elif not by_room and cost[r] < cost[best]:
                    best = r
        if best < 0:
            return 2  # it would become a ring: ``_place_node`` places the node
        cost[best] += whole_seconds[j] + terms[11] * length
        attention[best] += whole_seconds[j]
        tokens[best] += length
        ranks[j] = best
    return 0


@functools.cache
def _compiled() -> Callable | None:
    """``_place`` compiled (``loops/jit.py``; the prices of ``ring_prices.py`` first), or
    ``None`` without numba."""
    if not ring_prices.bind(globals()):
        return None
    return jit.compile_loops(globals(), "_ring", "_place")
