"""A placement over the world's GPUs as one pool: rings sized to the mean, on any GPUs.

The staged placement (``placement.py``) gives an inter-node document whole nodes and every other
document a node first: a document worth 1.5 nodes takes 2, and where documents are few per node
the nodes do not fill evenly. Here every GPU is a slot of the same target load (the batch's work
over the GPUs, raised by what splitting adds), and a GPU's load is projected to what it will be
once it holds the tokens a nearly full batch forces on every GPU (``_floor_tokens``):

1. every document whose work exceeds a GPU's share (and every document capacity forces to split)
   gets, longest first, the smallest ring whose per-member load ``Loads.ring_key`` fits under
   the target on GPUs that still have that much room: inside one node where one has enough such
   GPUs (NVLink; the most loaded that still fit, so free GPUs stay free), else over whole nodes
   with the 2-D scheme where its price fits, else over part of the GPUs of a window of
   consecutive nodes (a flat ring across nodes: the engine runs any ring, ``attention/ring.py``).
   Pieces too short to hide a NIC transfer cross nodes only for a document no node holds;
2. every other document, longest first, goes whole to the GPU with room of the least projected
   load, over the whole world (a local document talks to nobody, so its node does not matter);
   one no GPU has room for becomes a ring (a capacity promotion).

No ring gives a member more tokens than the GPUs' mean and half the room it leaves
(``_member_tokens``), so a document split only for capacity does not fill its members with
tokens far below the target load.

``POOL_ORDERS`` may put the long whole documents before the rings; ``POOL_RETRIES`` size the rings
below the target where none of those packs evenly. A batch no order puts a whole document of
before the rings (all long documents) is placed with its rings sized a little above and below
the target instead (``RING_ORDERS``, ``RING_RETRIES``; ``pool_orders``). ``search`` places
every order, refines each (``refine.py``, which re-places a ring or moves a member of one through
``members.py``), and keeps a pool placement only where the simulator times it faster than the
staged ones.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from megatron_zeppelin.planner.loops import ring_line, whole_docs
from megatron_zeppelin.planner.loops.ring_search import PLACES
from megatron_zeppelin.planner.place.least_load import least_load
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import (
    Heap,
    Placement,
    TierChoice,
    capacity_error,
    local_placement,
)
from megatron_zeppelin.planner.place.pool_rings import (
    Arrays,
    place_ring,
    ring_sizes,
    ring_tries_all,
)
from megatron_zeppelin.planner.place.ring_options import TOLERANCE, PoolGoal, price
from megatron_zeppelin.planner.plan.plan import Tier

__all__ = [
    "ALL_ORDERS",
    "POOL_ORDERS",
    "POOL_RETRIES",
    "RING_ORDERS",
    "RING_RETRIES",
    "PoolBatch",
    "PoolGoal",
    "PoolOrder",
    "early_count",
    "pool_orders",
    "place_pool",
    "pool_batch",
    "pool_goal",
]


class PoolOrder(NamedTuple):
    """How ``place_pool`` places a batch (its arguments of the same names)."""

    first: float | None
    scale: float = 1.0
    cross: float = 1.0


POOL_ORDERS = (PoolOrder(None), PoolOrder(math.inf), PoolOrder(0.15))
"""The orders ``search`` tries (``place_pool``'s arguments): rings first; whole
documents of more than half a GPU's room first; those and the ones worth more than 0.15 of a
GPU's share first (the slack rings leave on their members is too small for them). Which packs a
batch best is not predicted well enough by ``Loads``: the simulator decides."""
POOL_RETRIES = (
    PoolOrder(None, 0.9),
    PoolOrder(0.15, 0.9),
    PoolOrder(None, 0.8),
    PoolOrder(0.15, 0.8),
    PoolOrder(0.15, 0.8, cross=2.0),
)
"""Tried after ``POOL_ORDERS`` where none of them packs evenly: rings sized to 0.9 and 0.8 of
the target, so their members keep room for the whole documents that capacity or a late long
one forces on them (a nearly full batch, or few documents per GPU); the last with pieces twice
as long before a ring crosses nodes (``cross``): ``Loads`` prices each ring alone, and many
flat rings of short pieces sharing a node's NICs and NVLink ports run slower than it predicts."""
RING_ORDERS = (PoolOrder(None), PoolOrder(None, 1.05), PoolOrder(None, 0.95))
"""``POOL_ORDERS`` of a batch no order puts a whole document of before the rings (``pool_orders``:
they would all place it alike): the rings sized to the target and a little above and below it.
Integer ring sizes leave each member short of the target by what the last, shortest rings must
fill; which target leaves the least over is not predicted well by the target itself."""
RING_RETRIES = (PoolOrder(None, 0.9), PoolOrder(None, 0.85), PoolOrder(None, 0.8))
"""``POOL_RETRIES`` of such a batch."""
ALL_ORDERS = tuple(dict.fromkeys((*POOL_ORDERS, *POOL_RETRIES, *RING_ORDERS, *RING_RETRIES)))
"""Every order ``search`` may place a batch in, each once."""
_MEMBER_ROOM = 0.5
"""A ring member takes at most the GPUs' mean tokens and this share of the room it leaves
(``_member_tokens``)."""
_NODE = PLACES["node"]
"""A ring's place on one node (over NVLink), by ``ring_search``'s code."""
_TARGET_ROUNDS = 3
"""Rounds of sizing every ring against the target and raising the target by what they add."""


@dataclass(frozen=True)
class PoolBatch:
    """What every order of ``place_pool`` reads of a batch alike (``pool_batch``), computed
    once per batch; its target only when an order asks for it."""

    array: np.ndarray
    """The documents' lengths."""
    pricing: Loads
    """Empty loads that price the rings."""
    balanced: np.ndarray
    """Each document's work: attention and linear seconds."""
    share: float
    """A GPU's share of the batch's work."""
    rings: np.ndarray
    """Which documents are placed as rings."""
    ring_docs: list[int]
    """Those, longest first."""
    least_load: float
    """The least load a placement's busiest GPU can end at (``least_load.least_load``)."""
    member_tokens: int
    """``_member_tokens``: the most tokens a ring member takes."""
    tries: dict = field(default_factory=dict, compare=False, repr=False)
    """``pool_rings.place_ring``'s memo of every order's rings (priced by ``pricing``)."""
    lines: dict = field(default_factory=dict, compare=False, repr=False)
    """Where numba is installed, every ring's tries at once (``pool_rings.ring_tries_all``), by
    goal: orders of the same goal try the same rings."""

    @functools.cached_property
    def target(self) -> float:
        """``_target``: the load every GPU should end at."""
        return _target(self.array, self.balanced, self.ring_docs, self.pricing, self.member_tokens)


def pool_orders(
    array: np.ndarray, loads: Loads, batch: PoolBatch
) -> tuple[tuple[PoolOrder, ...], tuple[PoolOrder, ...]]:
    """The orders of ``place_pool`` to try, and those to retry with:
    ``POOL_ORDERS`` and ``POOL_RETRIES``, or ``RING_ORDERS`` and ``RING_RETRIES`` where no
    order's ``first`` puts a whole document before the rings (they would place alike)."""
    firsts = [o.first for o in (*POOL_ORDERS, *POOL_RETRIES) if o.first is not None]
    whole = ~batch.rings
    least = min(firsts) * batch.share
    early = (array[whole] > loads.capacity // 2) | (batch.balanced[whole] > least)
    if early.any():
        return POOL_ORDERS, POOL_RETRIES
    return RING_ORDERS, RING_RETRIES


def pool_batch(array: np.ndarray, choice: TierChoice, loads: Loads, nic_chunk: int) -> PoolBatch:
    """``_split`` and the least load of the batch, and its target when asked (they depend on
    neither the order nor the placement); ``nic_chunk`` as in ``PoolGoal``."""
    balanced, share, rings = _split(array, choice, loads)
    ring_docs = np.flatnonzero(rings)
    ring_docs = ring_docs[np.lexsort((ring_docs, -array[ring_docs]))].tolist()
    most = _member_tokens(array, loads)
    least = least_load(array, balanced, loads, nic_chunk=nic_chunk, member_tokens=most)
    return PoolBatch(array, loads, balanced, share, rings, ring_docs, least, most)


def place_pool(
    array: np.ndarray,
    choice: TierChoice,
    loads: Loads,
    nic_chunk: int,
    first: float | None,
    scale: float = 1.0,
    batch: PoolBatch | None = None,
    cross: float = 1.0,
    least: bool = False,
) -> tuple[list[Placement], int]:
    """Every document's placement (module docstring), its work added to ``loads``, and how many
    documents meant to stay whole became rings for lack of room on any GPU; a document
    is a ring where its work, with the linear seconds of the tokens its GPU must hold besides
    (``_floor_tokens``), exceeds a GPU's share. With ``first``, whole documents of more than
    half a GPU's room or ``first`` of a GPU's share of work are placed before the rings, while
    GPUs are free to hold them (ring pieces then fill what they leave). Rings are sized to
    ``scale`` times the target (with ``least``, the batch's least load), and cross nodes only
    with pieces of ``cross`` times ``nic_chunk`` tokens. ``batch``: ``pool_batch`` of the same
    batch, when known.
    Raises ``CapacityError`` where a document finds no room."""
    batch = batch or pool_batch(array, choice, loads, nic_chunk)
    rings = batch.rings
    floor = _floor_tokens(array, loads)
    aim = scale * (batch.least_load if least else batch.target)
    goal = PoolGoal(aim, floor, math.ceil(cross * nic_chunk), batch.member_tokens)
    placements: list[Placement | None] = [None] * len(array)
    whole = np.flatnonzero(~rings)
    whole = whole[np.lexsort((whole, -array[whole]))]
    count = early_count(batch, first)
    promotions = _place_whole(whole[:count], array, choice.attention, loads, placements, goal)
    if ring_line.compiled():
        _place_rings_compiled(batch, loads, goal, placements)
    else:
        arrays = Arrays(np.asarray(loads.cost), np.asarray(loads.tokens))
        for doc in batch.ring_docs:
            placed = place_ring(doc, int(array[doc]), loads, goal, arrays=arrays, memo=batch.tries)
            placements[doc] = placed
            arrays.update(placed.ring, loads)  # type: ignore[union-attr]
    promotions += _place_whole(whole[count:], array, choice.attention, loads, placements, goal)
    return placements, promotions  # type: ignore[return-value]


def _place_rings_compiled(
    batch: PoolBatch, loads: Loads, goal: PoolGoal, placements: list[Placement | None]
) -> None:
    """``place_pool``'s rings in one compiled call (``ring_line.py``: the same GPUs and loads as
    ``place_ring`` ring by ring), their tries worked out at once per goal (``batch.lines``)."""
    docs = batch.ring_docs
    lengths = batch.array[docs]
    found = batch.lines.get(goal)
    if found is None:
        found = batch.lines[goal] = ring_tries_all(lengths, loads, goal)
    lengths = lengths.tolist()
    line = ring_line.Line(
        np.asarray(loads.cost), np.asarray(loads.attention), np.asarray(loads.exposed),
        np.asarray(loads.tokens),
    )  # fmt: skip
    k, limit = loads.topology.gpus_per_node, goal.target * TOLERANCE
    weight, terms = loads.linear_weight, loads.ring_terms()
    stop, places, rings = ring_line.place(
        line, lengths, *found, loads.capacity, weight, goal.floor, limit, k, terms
    )
    loads.cost[:], loads.attention[:] = line.cost.tolist(), line.attention.tolist()
    loads.exposed[:], loads.tokens[:] = line.exposed.tolist(), line.tokens.tolist()
    for doc, where, ring in zip(docs, places, rings):
        placements[doc] = Placement(Tier.INTRA if where == _NODE else Tier.INTER, ring)
    if stop < len(docs):
        raise capacity_error(docs[stop], lengths[stop], "on any GPUs of the pool")


def early_count(batch: PoolBatch, first: float | None) -> int:
    """How many whole documents ``place_pool`` places before the rings with ``first``: those of
    more than half a GPU's room or worth more than ``first`` of a GPU's share (two orders that
    differ in ``first`` alone and place as many before the rings place alike)."""
    if first is None:
        return 0
    whole = ~batch.rings
    capacity = batch.pricing.capacity
    big = (batch.array[whole] > capacity // 2) | (batch.balanced[whole] > first * batch.share)
    return int(np.count_nonzero(big))


def _split(
    array: np.ndarray, choice: TierChoice, loads: Loads
) -> tuple[np.ndarray, float, np.ndarray]:
    """Each document's work (attention and linear seconds), a GPU's share of the batch's, and
    which documents ``place_pool`` rings: those the tiers split, and those whose work, with the
    linear seconds of the tokens their GPU must hold besides (``_floor_tokens``), exceeds a
    GPU's share."""
    balanced = choice.attention + loads.linear_weight * array
    share = float(balanced.sum()) / loads.topology.world_size
    whole_load = balanced + loads.linear_weight * np.maximum(0, _floor_tokens(array, loads) - array)
    rings = (choice.split | choice.inter | (whole_load > share)) & (array >= 2)
    return balanced, share, rings


def _target(
    array: np.ndarray, balanced: np.ndarray, ring_docs: list[int], loads: Loads, most: int
) -> float:
    """The load every GPU should end at: the batch's work over the GPUs, where each ring
    counts its members' total at the size it would take for the current target."""
    world = loads.topology.world_size
    whole = float(balanced.sum()) - float(balanced[ring_docs].sum())
    target = float(balanced.sum()) / world
    for _ in range(_TARGET_ROUNDS):
        total = whole
        for doc in ring_docs:
            size, key = _size_for(int(array[doc]), float(balanced[doc]), target, loads, most)
            total += size * key
        if total / world <= target:
            break  # every later round would size the rings alike
        target = total / world
    return target


def _size_for(
    length: int, work: float, target: float, loads: Loads, most: int
) -> tuple[int, float]:
    """The smallest ring whose members' load fits the target (2-D priced where the size is
    whole nodes), else the one with the least load per member."""
    best = (math.inf, 2)
    for size in ring_sizes(length, work, target, loads, most):
        key = price(length, size, loads, two_d=loads.two_d is not None)
        if key <= target * TOLERANCE:
            return size, key
        if key < best[0]:
            best = (key, size)
    return best[1], best[0]


def _member_tokens(array: np.ndarray, loads: Loads) -> int:
    """The most tokens a ring member takes: the GPUs' mean and ``_MEMBER_ROOM`` of the room the
    mean leaves. A ring sized to fill its members' capacity leaves them full of tokens far
    below the target load (a mid-length document on two GPUs carries less attention per token
    than a long ring's share), work the other GPUs then carry; at a nearly full batch the limit
    is the capacity, near enough."""
    mean = float(array.sum()) / loads.topology.world_size
    return min(loads.capacity, int(mean + _MEMBER_ROOM * max(0.0, loads.capacity - mean)))


def _floor_tokens(array: np.ndarray, loads: Loads) -> int:
    """Tokens every GPU ends up holding however the batch is placed, near enough: with the other
    GPUs full, a GPU may fall short of the mean by no more than the room the mean leaves (a
    batch that fills most of the capacity leaves no GPU free to hold only attention-heavy
    pieces)."""
    mean = float(array.sum()) / loads.topology.world_size
    return max(0, int(2 * mean - loads.capacity))


def _projected(loads: Loads, floor: int) -> np.ndarray:
    """Each GPU's load once it holds at least ``floor`` tokens, the missing ones priced at their
    linear seconds alone (the least they can cost)."""
    tokens = np.asarray(loads.tokens)
    return np.asarray(loads.cost) + loads.linear_weight * np.maximum(0, floor - tokens)


def pool_goal(array: np.ndarray, loads: Loads, nic_chunk: int) -> PoolGoal:
    """What ``members.replace_ring`` keeps of ``place_pool``'s goal (its target is set per
    call)."""
    return PoolGoal(0.0, _floor_tokens(array, loads), nic_chunk, _member_tokens(array, loads))


def _place_whole(
    docs: np.ndarray,
    array: np.ndarray,
    attention: np.ndarray,
    loads: Loads,
    placements: list[Placement | None],
    goal: PoolGoal,
) -> int:
    """Whole documents, longest first, on the GPU with room of the least ``_projected`` load
    (ties: the lowest rank), over the world. A GPU without room for the current document is
    parked until the documents get short enough for it (they only get shorter, and a parked GPU
    takes nothing), so a nearly full cluster costs a heap operation per document, not a pass
    over every GPU. A document no GPU has room for becomes a ring of GPUs that have (of two
    GPUs or more: ``ring_sizes``). Returns how many did."""
    if whole_docs.compiled():
        return _place_whole_compiled(docs, array, attention, loads, placements, goal)
    floor, capacity, weight = goal.floor, loads.capacity, loads.linear_weight
    keys = _projected(loads, floor).tolist()
    heap, parked = _heaps(keys)
    local = [local_placement(r) for r in range(loads.topology.world_size)]
    rings = 0
    for doc, length, seconds in zip(docs.tolist(), array[docs].tolist(), attention[docs].tolist()):
        while parked and -parked[0][0] >= length:
            rank = heapq.heappop(parked)[1]
            heapq.heappush(heap, (keys[rank], rank))
        while heap:
            key, rank = heap[0]
            if key != keys[rank]:
                heapq.heappop(heap)  # stale
            elif capacity - loads.tokens[rank] < length:
                heapq.heappop(heap)
                heapq.heappush(parked, (loads.tokens[rank] - capacity, rank))
            else:
                break
        if not heap:
            placed = place_ring(doc, length, loads, goal)
            placements[doc] = placed
            rings += 1
            # Only the ring's members changed: they go back on the heap with their new keys
            # (their parked entries, if any, are looked at again when due).
            for rank in placed.ring:
                keys[rank] = loads.cost[rank] + weight * max(0, floor - loads.tokens[rank])
                heapq.heappush(heap, (keys[rank], rank))
            continue
        rank = heap[0][1]
        loads.add_local(rank, length, seconds)
        placements[doc] = local[rank]
        keys[rank] = loads.cost[rank] + weight * max(0, floor - loads.tokens[rank])
        heapq.heapreplace(heap, (keys[rank], rank))  # the top was its entry: one sift
    return rings


def _place_whole_compiled(
    docs: np.ndarray,
    array: np.ndarray,
    attention: np.ndarray,
    loads: Loads,
    placements: list[Placement | None],
    goal: PoolGoal,
) -> int:
    """``_place_whole`` in numba's compiled loop (``whole_docs.py``: the same GPUs), handing
    back each document no GPU has room for to be made a ring here; how many were."""
    state = whole_docs.WholeDocs(loads, goal.floor)
    lengths = np.ascontiguousarray(array[docs], dtype=np.int64)
    seconds = np.ascontiguousarray(attention[docs], dtype=np.float64)
    ranks = np.empty(len(docs), dtype=np.int64)
    local = [local_placement(r) for r in range(loads.topology.world_size)]
    start = rings = 0
    while True:
        stop = state.place(lengths, seconds, start, ranks)
        given = map(local.__getitem__, ranks[start:stop].tolist())
        deque(map(placements.__setitem__, docs[start:stop].tolist(), given), maxlen=0)
        state.write_loads()
        if stop == len(docs):
            return rings
        placed = place_ring(int(docs[stop]), int(lengths[stop]), loads, goal)
        placements[int(docs[stop])] = placed
        state.placed_ring(placed.ring)
        start, rings = stop + 1, rings + 1


def _heaps(keys: list[float]) -> tuple[Heap, Heap]:
    """Every GPU by its key (``_place_whole``'s heap), none parked yet."""
    heap: Heap = [(key, r) for r, key in enumerate(keys)]
    heapq.heapify(heap)
    return heap, []
