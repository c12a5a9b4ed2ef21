"""The pool's whole documents (``pool._place_whole``) placed in one compiled loop.

Documents come longest first; each goes to the GPU of least projected load (ties: the lowest
rank) among those with room for it, and its work is added as ``Loads.add_local`` adds it. A GPU
without room for the current document is parked until the documents get short enough for it.
A thousand-GPU batch of ten thousand documents does this for every document of every pool
order; here each costs a few heap steps of compiled code instead of Python's. The choice is the
same as ``pool._place_whole``'s: the least ``(projected load, rank)`` over the GPUs with room,
whatever the heaps' layout (``tests/test_whole_docs.py`` compares the two).

A document no GPU has room for is handed back: the caller makes it a ring
(``pool_rings.place_ring``, on ``Loads`` brought up to date first), and its members go back on
the heap with their new loads (``WholeDocs.placed_ring``). Compiled by numba where it is
installed (``loops/jit.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import numpy as np

from megatron_zeppelin.planner.loops import jit

__all__ = ["LoadLists", "WholeDocs", "compiled", "warm"]


def compiled() -> bool:
    """Whether ``WholeDocs`` runs in this process."""
    return _compiled() is not None


def warm() -> None:
    """The loop built (or read from numba's cache) now (``search.partition.warm``)."""
    kernel = _compiled()
    if kernel is not None:
        one, two, sizes = np.zeros(1, dtype=np.int64), np.zeros(1), np.zeros(2, dtype=np.int64)
        kernel(one, two, 1, two, two, one, two, 0, 0.0, 0, two, one, one, one, sizes, one)
        _push(two, one, sizes, 0, 0.0, 0)
        _push(one, one, sizes, 1, 0, 0)


class LoadLists(Protocol):
    """What ``WholeDocs`` reads and writes of ``place.loads.Loads``."""

    cost: list[float]
    attention: list[float]
    tokens: list[int]
    linear_weight: float
    capacity: int


class WholeDocs:
    """The loads of every GPU as arrays and the loop's two heaps, kept between the documents a
    ring interrupts."""

    def __init__(self, loads: LoadLists, floor: int) -> None:
        self.loads, self.floor = loads, int(floor)
        self.weight, self.capacity = float(loads.linear_weight), int(loads.capacity)
        self.cost = np.asarray(loads.cost, dtype=np.float64)
        self.attention = np.asarray(loads.attention, dtype=np.float64)
        self.tokens = np.asarray(loads.tokens, dtype=np.int64)
        self.keys = self.cost + self.weight * np.maximum(0, self.floor - self.tokens)
        world = len(self.cost)
        # Every GPU on the heap (sorted by key then rank: a heap already), none parked; room for
        # the entries rings add besides, grown as they come (``placed_ring``).
        order = np.lexsort((np.arange(world), self.keys))
        self.heap_keys = np.resize(self.keys[order], 2 * world)
        self.heap_ranks = np.resize(order.astype(np.int64), 2 * world)
        self.parked_room = np.empty(2 * world, dtype=np.int64)
        self.parked_ranks = np.empty(2 * world, dtype=np.int64)
        self.sizes = np.array([world, 0], dtype=np.int64)  # on the heap, parked

    def place(self, lengths: np.ndarray, seconds: np.ndarray, start: int, out: np.ndarray) -> int:
        """Documents ``start`` onwards placed, each one's GPU in ``out``, until one no GPU has
        room for: its index (``len(lengths)`` once all are placed)."""
        kernel = _compiled()
        assert kernel is not None, "WholeDocs runs where the loop compiles"
        return int(
            kernel(
                lengths, seconds, start, self.cost, self.attention, self.tokens, self.keys,
                self.capacity, self.weight, self.floor, self.heap_keys, self.heap_ranks,
                self.parked_room, self.parked_ranks, self.sizes, out,
            )
        )  # fmt: skip

    @property
    def heap_parts(self) -> tuple[np.ndarray, ...]:
        return self.heap_keys, self.heap_ranks, self.parked_room, self.parked_ranks

    def write_loads(self) -> None:
        """``Loads`` given the loop's figures (the same values: the same operations)."""
        self.loads.cost[:] = self.cost.tolist()
        self.loads.attention[:] = self.attention.tolist()
        self.loads.tokens[:] = self.tokens.tolist()

    def placed_ring(self, ring: tuple[int, ...]) -> None:
        """After a ring was placed on ``Loads`` (written first, ``write_loads``): its members'
        loads read back and put on the heap with their new keys (their parked entries, if
        any, are looked at again when due)."""
        loads = self.loads
        # Either heap may come to hold every entry: the GPUs and what rings pushed besides.
        if int(self.sizes.sum()) + len(ring) > len(self.heap_keys):
            more = 2 * (len(self.heap_keys) + len(ring))
            self.heap_keys, self.heap_ranks = (np.resize(a, more) for a in self.heap_parts[:2])
            self.parked_room, self.parked_ranks = (np.resize(a, more) for a in self.heap_parts[2:])
        for rank in ring:
            self.cost[rank], self.attention[rank] = loads.cost[rank], loads.attention[rank]
            self.tokens[rank] = loads.tokens[rank]
            key = loads.cost[rank] + self.weight * max(0, self.floor - loads.tokens[rank])
            self.keys[rank] = key
            _push(self.heap_keys, self.heap_ranks, self.sizes, 0, key, rank)  # compiled


def _before(key_a, rank_a, key_b, rank_b):  # noqa: ANN001, ANN202 - compiled by numba
    return key_a < key_b or (key_a == key_b and rank_a < rank_b)


def _push(keys, ranks, sizes, which, key, rank):  # noqa: ANN001, ANN202 - compiled by numba
    """``(key, rank)`` onto the heap ``keys, ranks`` of ``sizes[which]`` entries (least on top)."""
    at = sizes[which]
    sizes[which] += 1
    while at > 0:
        up = (at - 1) // 2
        if not _before(key, rank, keys[up], ranks[up]):
            break
        keys[at], ranks[at] = keys[up], ranks[up]
        at = up
    keys[at], ranks[at] = key, rank


def _replace_top(keys, ranks, sizes, which, key, rank):  # noqa: ANN001, ANN202 - compiled
    """The top of the heap replaced by ``(key, rank)`` and sifted down."""
    size, at = sizes[which], 0
    while True:
        child = 2 * at + 1
        if child >= size:
            break
        if child + 1 < size and _before(
            keys[child + 1], ranks[child + 1], keys[child], ranks[child]
        ):
            child += 1
        if not _before(keys[child], ranks[child], key, rank):
            break
        keys[at], ranks[at] = keys[child], ranks[child]
        at = child
    keys[at], ranks[at] = key, rank


def _pop(keys, ranks, sizes, which):  # noqa: ANN001, ANN202 - compiled by numba
    """The top of the heap taken off."""
    sizes[which] -= 1
    last = sizes[which]
    if last > 0:
        _replace_top(keys, ranks, sizes, which, keys[last], ranks[last])


def _place(
    lengths,
    seconds,
    start,
    cost,
    attention,
    tokens,
    keys,
    capacity,
    weight,
    floor,
    heap_keys,
    heap_ranks,
    parked_room,
    parked_ranks,
    sizes,
    out,
):  # noqa: ANN001, ANN202, E501, PLR0913 - compiled by numba
    """``WholeDocs.place``: ``pool._place_whole``'s loop, its heaps as arrays."""
    for doc in range(start, lengths.shape[0]):
        length = lengths[doc]
        # Parked GPUs with room for this document (their most room on top) come back.
        while sizes[1] > 0 and -parked_room[0] >= length:
            rank = parked_ranks[0]
            _pop(parked_room, parked_ranks, sizes, 1)
            _push(heap_keys, heap_ranks, sizes, 0, keys[rank], rank)
        while sizes[0] > 0:
            key, rank = heap_keys[0], heap_ranks[0]
            if key != keys[rank]:
                _pop(heap_keys, heap_ranks, sizes, 0)  # stale
            elif capacity - tokens[rank] < length:
                _pop(heap_keys, heap_ranks, sizes, 0)
                _push(parked_room, parked_ranks, sizes, 1, tokens[rank] - capacity, rank)
            else:
                break
        if sizes[0] == 0:
            return doc  # no GPU has room: a ring, placed by the caller
        rank = heap_ranks[0]
        cost[rank] += seconds[doc] + weight * length
        attention[rank] += seconds[doc]
        tokens[rank] += length
        out[doc] = rank
        keys[rank] = cost[rank] + weight * max(0, floor - tokens[rank])
        _replace_top(heap_keys, heap_ranks, sizes, 0, keys[rank], rank)
    return lengths.shape[0]


@functools.cache
def _compiled() -> Callable | None:
    """``_place`` compiled (``loops/jit.py``), or ``None`` without numba."""
    return jit.compile_loops(globals(), "_before", "_replace_top", "_pop", "_push", "_place")
