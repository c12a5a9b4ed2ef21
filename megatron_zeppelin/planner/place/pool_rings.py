"""Where the pool placement puts one ring: its size, its GPUs, and what it adds to ``Loads``.

``place_ring`` tries ring sizes from the document's work over the target upwards, then smaller
ones (``ring_sizes``), and at each size the places ``ring_options.options`` allows, in order: the
first that finds GPUs whose members all end within the target wins (``_members``: one node,
whole nodes, or part of the GPUs of a window of nodes). Where none does, the size and GPUs whose
busiest member ends soonest (``_soonest``). The tries depend on the document's length and the
goal alone (``ring_tries``): a placement of many rings works them out once per length. Where
numba is installed, the whole search is one compiled call (``loops/ring_search.py``) that finds
the same GPUs.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.planner.loops import ring_line, ring_search
from megatron_zeppelin.planner.loops.ring_search import Tries
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import Placement, capacity_error
from megatron_zeppelin.planner.place.ring_options import (
    TOLERANCE,
    PoolGoal,
    most_tokens,
    narrowest,
    options,
    price,
    wide_two_d,
)
from megatron_zeppelin.planner.plan.plan import Tier

__all__ = ["Arrays", "place_on", "place_ring", "ring_sizes", "ring_tries", "ring_tries_all"]


def ring_sizes(length: int, work: float, target: float, loads: Loads, most: int) -> list[int]:
    """Ring sizes worth pricing: from the document's work over the target up to a few times it,
    then the smaller ones down to the least whose members take at most ``most`` tokens
    (``_member_tokens``; where GPUs lack room for the larger ones)."""
    topo = loads.topology
    world = topo.world_size
    low = narrowest(length, loads, most)
    start = min(world, max(low, math.floor(work / target)))
    stop = min(world, 2 * start + 2 * topo.gpus_per_node)
    return [*range(start, stop + 1), *range(start - 1, low - 1, -1)]


_NAMES = {code: where for where, code in ring_search.PLACES.items()}
_WHOLE = ring_search.PLACES["whole"]
_TYPES = (np.int64, np.int64, np.float64, np.int64)
"""``Tries``' columns' types."""


def ring_tries(length: int, loads: Loads, goal: PoolGoal) -> Tries:
    """``Tries`` of a document of ``length`` under ``goal``, priced by ``loads``: at each size of
    ``ring_sizes``, the places ``options`` allows. Where numba is installed, every size in one
    compiled call (``ring_search.tries``: the same tries, the same keys to the last bit), the
    2-D scheme's keys and shares over whole nodes from ``Loads`` (``Tries.shares``)."""
    work = loads.ring_seconds(length, 1) + loads.linear_weight * length
    sizes = ring_sizes(length, work, goal.target, loads, goal.member_tokens)
    if not ring_search.compiled():
        found = []
        for size in sizes:
            places = options(length, size, loads, goal)
            if places:  # else pieces too short to cross nodes, and no node's ring this wide
                most = most_tokens(length, size)
                found += [(size, most, key, ring_search.PLACES[at]) for key, at in places]
        columns = list(zip(*found)) if found else [(), (), (), ()]
        return Tries(*(np.asarray(c, dtype=t) for c, t in zip(columns, _TYPES)))
    k, terms = loads.topology.gpus_per_node, loads.ring_terms()
    two_d = loads.two_d is not None
    array = np.asarray(sizes, dtype=np.int64)
    args = (length, array, k, loads.capacity, goal.nic_chunk, two_d)
    *found, asked = ring_search.tries(*args, False, terms)
    if asked and wide_two_d(length, loads, goal):
        *found, _ = ring_search.tries(*args, True, terms)
    tries = Tries(*found, np.full((len(found[0]), 3), np.nan))
    _price_whole(tries, np.full(len(tries.sizes), length), loads)
    return tries


def ring_tries_all(lengths: np.ndarray, loads: Loads, goal: PoolGoal) -> tuple[Tries, np.ndarray]:
    """``ring_tries`` of each of ``lengths``, one after the other in one ``Tries``, and where
    each length's start (one more than the lengths), worked out in one compiled call
    (``ring_line.tries``) but for a length that may take the 2-D scheme wide
    (``ring_options.wide_two_d``, asked of ``Loads``), whose tries come from ``ring_tries``,
    and the 2-D scheme's keys and shares over whole nodes, also from ``Loads``. Only where
    numba is installed."""
    topo, two_d = loads.topology, loads.two_d is not None
    limits = goal.target, goal.nic_chunk, goal.member_tokens
    found, offsets, asked = ring_line.tries(
        lengths, topo.gpus_per_node, topo.world_size, loads.capacity, limits, two_d,
        loads.ring_terms(),
    )  # fmt: skip
    wide = [i for i in np.flatnonzero(asked).tolist() if wide_two_d(int(lengths[i]), loads, goal)]
    if wide:  # those lengths' tries again, wide, in their place
        parts = [_slice(found, offsets, i) for i in range(len(lengths))]
        for i in wide:
            parts[i] = ring_tries(int(lengths[i]), loads, goal)
        found = Tries(*map(np.concatenate, zip(*(t.columns() for t in parts))))
        offsets = np.concatenate(([0], np.cumsum([len(t.sizes) for t in parts])))
    _price_whole(found, np.repeat(lengths, np.diff(offsets)), loads)
    return found, offsets


def _price_whole(tries: Tries, lengths: np.ndarray, loads: Loads) -> None:
    """The tries over whole nodes of ``tries`` (each of a document of ``lengths``, per try)
    priced by ``Loads``, the 2-D scheme where faster: their keys and shares (``Tries``)."""
    assert tries.shares is not None, "Tries.shares kept"
    for i in np.flatnonzero(tries.places == _WHOLE).tolist():
        length, size = int(lengths[i]), int(tries.sizes[i])
        tries.keys[i] = price(length, size, loads, two_d=True)
        share = loads.rank_share(length, size, "nic", loads.num_links)
        tries.shares[i] = share.compute_s, share.exposed_at(True), share.exposed_at(False)


def _slice(tries: Tries, offsets: np.ndarray, i: int) -> Tries:
    """The tries of the ``i``-th length of ``tries`` (``ring_tries_all``)."""
    at = slice(int(offsets[i]), int(offsets[i + 1]))
    return Tries(*(column[at] for column in tries.columns()))


def place_ring(
    doc: int,
    length: int,
    loads: Loads,
    goal: PoolGoal,
    *,
    fallback: bool = True,
    barred: np.ndarray | None = None,
    arrays: Arrays | None = None,
    memo: dict | None = None,
) -> Placement | None:
    """The first ring of ``ring_tries`` that finds GPUs ending within the target; if none does,
    the size and GPUs that end soonest (``None`` without ``fallback``). Across nodes only with
    pieces of at least ``goal.nic_chunk`` tokens, or where capacity leaves no other way. GPUs
    ``barred`` are not used. ``arrays``: ``loads``' cost and tokens as arrays, when kept;
    ``memo``: the tries of earlier calls with loads priced alike, by length and goal. Where
    numba is installed, the search runs as one compiled call (``ring_search.place``: the same
    try and GPUs)."""
    k = loads.topology.gpus_per_node
    if arrays is None:
        arrays = Arrays(np.asarray(loads.cost), np.asarray(loads.tokens))
    room = loads.capacity - arrays.tokens
    if barred is not None:
        room = np.where(barred, -1, room)
    tries = memo.get((length, goal)) if memo is not None else None
    if tries is None:
        tries = ring_tries(length, loads, goal)
        if memo is not None:
            memo[(length, goal)] = tries
    limit = goal.target * TOLERANCE
    weight, floor = loads.linear_weight, goal.floor
    if ring_search.compiled():
        cost, tokens = arrays.cost, arrays.tokens
        found = ring_search.place(cost, tokens, room, weight, floor, tries, limit, k, fallback)
    else:
        found = _place(tries, arrays, room, weight, floor, limit, k, fallback=fallback)
    if found is None:
        if fallback:
            raise capacity_error(doc, length, "on any GPUs of the pool")
        return None
    index, ring = found
    return place_on(ring, length, loads, int(tries.places[index]) == _WHOLE)


def _place(
    tries: Tries,
    arrays: Arrays,
    room: np.ndarray,
    weight: float,
    floor: int,
    limit: float,
    k: int,
    *,
    fallback: bool,
) -> tuple[int, tuple[int, ...]] | None:
    """``place_ring``'s search with numpy: the index of the try it places and the ring's GPUs,
    or ``None``. The first try whose members all end within ``limit`` (``_members``); else, with
    ``fallback``, the soonest of all (``_soonest``)."""
    # A member ends no lower than its GPU's cost: where the ``size``-th least cost plus the
    # ring's key is over the limit, no ``size`` GPUs qualify (``_members``' answer, for less).
    least = np.sort(arrays.cost)
    ends: dict[int, _Ends] = {}  # by tokens per member: a GPU's end depends on nothing else
    listed = []
    for size, per_rank, key, code in zip(
        tries.sizes.tolist(), tries.per_rank.tolist(), tries.keys.tolist(), tries.places.tolist()
    ):
        where = _NAMES[code]
        lazy = ends.get(per_rank)
        if lazy is None:
            lazy = ends[per_rank] = _Ends(arrays, weight, floor, per_rank)
        listed.append((size, per_rank, lazy, key, where))
        if float(least[size - 1]) + key > limit:
            continue
        ring = _members(lazy.get(), room, size, key, per_rank, limit, k, where)
        if ring is not None:
            return len(listed) - 1, ring
    return _soonest(listed, room, least, k) if fallback else None


def _soonest(
    tries: list, room: np.ndarray, least: np.ndarray, k: int
) -> tuple[int, tuple[int, ...]] | None:
    """Of ``tries``, the index of the first ring (in their order) whose busiest member ends
    soonest, and its GPUs (``None`` where no try finds any). Tries come off a heap by what is
    known of their end, each bound raised as it comes up until the end is known: first the
    ``size``-th least cost of any GPU (``least``, sorted: a member ends no lower than its cost),
    then the ``size``-th least end of the GPUs with room (a partition; for a ring inside one
    node its end itself, ``_node_end``), then the end of the ring ``_members`` finds. The first
    try to come off with its end known is the soonest (ties: the first), as a look at every one
    would find."""
    heap = [
        (float(least[size - 1]) + key, index, 0) for index, (size, *_, key, _) in enumerate(tries)
    ]
    heapq.heapify(heap)
    found: dict[int, tuple[int, ...]] = {}
    while heap:
        _, index, stage = heapq.heappop(heap)
        size, per_rank, lazy, key, where = tries[index]
        if stage == 2:
            return index, found[index]
        ends = lazy.get()
        if stage == 0:
            if where == "node":
                end = _node_end(ends, room, size, per_rank, k)
                if end is not None:
                    heapq.heappush(heap, (end + key, index, 1))
                continue
            fits = ends[room >= per_rank]
            if len(fits) >= size:
                tight = float(np.partition(fits, size - 1)[size - 1]) + key
                heapq.heappush(heap, (tight, index, 1))
            continue
        ring = _members(ends, room, size, key, per_rank, math.inf, k, where)
        if ring is None:
            continue
        if where == "node":
            return index, ring  # its end was known: the least of every bound left
        found[index] = ring
        heapq.heappush(heap, (float(ends[list(ring)].max()) + key, index, 2))
    return None


def _node_end(ends: np.ndarray, room: np.ndarray, size: int, per_rank: int, k: int) -> float | None:
    """Where the busiest member of the ring ``_in_node`` finds without a limit ends: the least,
    over the nodes, ``size``-th least end of their GPUs with ``per_rank`` tokens of room
    (``None`` where no node has ``size`` of them)."""
    by_node = np.where(room >= per_rank, ends, np.inf).reshape(-1, k)
    end = float(np.partition(by_node, size - 1, axis=1)[:, size - 1].min())
    return end if math.isfinite(end) else None


class _Ends:
    """Each GPU's load as a ring member of ``per_rank`` tokens would end it (with the linear
    seconds of the tokens it must hold besides, ``PoolGoal.floor``), worked out once, where
    asked."""

    def __init__(self, arrays: Arrays, weight: float, floor: int, per_rank: int) -> None:
        self.arrays, self.weight, self.floor, self.per_rank = arrays, weight, floor, per_rank
        self.ends: np.ndarray | None = None

    def get(self) -> np.ndarray:
        if self.ends is None:
            cost, tokens = self.arrays.cost, self.arrays.tokens
            if self.floor:
                extra = np.maximum(0, self.floor - tokens - self.per_rank)
                self.ends = cost + self.weight * extra
            else:
                self.ends = cost  # no GPU needs tokens besides what it is given
        return self.ends


@dataclass
class Arrays:
    """``Loads``' cost and tokens as arrays, kept in step while rings are placed (converting
    its lists for every ring costs more than placing it)."""

    cost: np.ndarray
    tokens: np.ndarray

    def update(self, ranks: tuple[int, ...], loads: Loads) -> None:
        index = list(ranks)
        self.cost[index] = [loads.cost[r] for r in index]
        self.tokens[index] = [loads.tokens[r] for r in index]


def _members(
    cost: np.ndarray,
    room: np.ndarray,
    size: int,
    key: float,
    per_rank: int,
    limit: float,
    k: int,
    where: str,
) -> tuple[int, ...] | None:
    """``size`` GPUs with ``per_rank`` tokens of room that end within ``limit`` after adding
    ``key``, in ring order (node by node): ``"whole"`` nodes; one ``"node"``; or ``"any"`` GPUs
    of two nodes or more."""
    ok = (room >= per_rank) & (cost + key <= limit)
    if np.count_nonzero(ok) < size:
        return None  # the common answer, without looking node by node
    by_node = ok.reshape(-1, k)
    node_cost = cost.reshape(-1, k)
    if where == "whole":
        return _whole_nodes(by_node, node_cost, size // k)
    if where == "node":
        return _in_node(by_node, node_cost, size, best_fit=math.isfinite(limit))
    return _across(by_node, node_cost, size)


def _whole_nodes(by_node: np.ndarray, node_cost: np.ndarray, num: int) -> tuple[int, ...] | None:
    """``num`` nodes with every GPU eligible, the least loaded first, in node order (the 2-D
    scheme needs whole nodes, not consecutive ones: a window of free consecutive nodes is rare
    once rings of every size have been placed)."""
    k = by_node.shape[1]
    full = np.flatnonzero(by_node.all(axis=1))
    if len(full) < num:
        return None
    chosen = full[np.argsort(node_cost[full].max(axis=1), kind="stable")[:num]]
    return tuple(int(n) * k + j for n in sorted(chosen.tolist()) for j in range(k))


def _in_node(
    by_node: np.ndarray, node_cost: np.ndarray, size: int, *, best_fit: bool
) -> tuple[int, ...] | None:
    """``size`` eligible GPUs of one node. Best fit: the most loaded that still qualify, on the
    node where the least loaded of them is most loaded (free GPUs stay free); otherwise the
    least loaded."""
    k = by_node.shape[1]
    enough = np.flatnonzero(by_node.sum(axis=1) >= size)
    if not len(enough):
        return None
    sign = -1.0 if best_fit else 1.0
    masked = np.where(by_node[enough], sign * node_cost[enough], np.inf)
    pick = int(np.argmin(np.partition(masked, size - 1, axis=1)[:, size - 1]))
    ranks = np.argsort(masked[pick], kind="stable")[:size]
    return tuple(int(enough[pick]) * k + int(j) for j in sorted(ranks.tolist()))


def _across(by_node: np.ndarray, node_cost: np.ndarray, size: int) -> tuple[int, ...] | None:
    """``size`` eligible GPUs over two nodes or more: of a window of consecutive nodes where one
    with at most one node more than the ring needs has them all, else the nodes with the most
    eligible GPUs first (the fewest cross-node edges); the least loaded of each (ties: the lower
    GPU), node by node."""
    k = by_node.shape[1]
    counts = by_node.sum(axis=1)
    if int(counts.sum()) < size:
        return None
    least = max(2, -(-size // k))
    running = np.concatenate(([0], np.cumsum(counts)))
    for num in range(least, min(len(counts), least + 1) + 1):
        totals = running[num:] - running[:-num]  # eligible GPUs of each window of ``num``
        if totals.max() >= size:
            first = int(np.argmax(totals))
            order = np.arange(first, first + num)
            break
    else:
        order = np.lexsort((node_cost.max(axis=1), -counts))
    # Each node in order gives its eligible GPUs until the ring has ``size``.
    have = counts[order]
    take = np.clip(size - (np.cumsum(have) - have), 0, have)
    nodes, take = order[take > 0], take[take > 0]
    if len(nodes) < 2:
        return None  # one node's ring is priced on NVLink
    masked = np.where(by_node[nodes], node_cost[nodes], np.inf)
    cheapest = np.argsort(masked, axis=1, kind="stable")
    chosen = sorted(
        (int(node), int(j))
        for node, row, count in zip(nodes.tolist(), cheapest, take.tolist())
        for j in row[:count].tolist()
    )
    return tuple(node * k + j for node, j in chosen)


def place_on(ring: tuple[int, ...], length: int, loads: Loads, two_d: bool) -> Placement:
    k = loads.topology.gpus_per_node
    if len({r // k for r in ring}) == 1:
        loads.add_ring(ring, length)
        return Placement(Tier.INTRA, ring)
    loads.add_ring(ring, length, "nic", flat=not two_d)
    return Placement(Tier.INTER, ring)
