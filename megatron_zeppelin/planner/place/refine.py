"""A cheap pass after a placement: whole documents moved off the busiest GPU while that helps.

A placement packs documents longest first, each onto the GPU then least loaded; what it leaves
uneven is mostly the last GPUs to receive a ring's share or a long document. Here, while the
busiest GPU holds local (whole) documents, the one change that lowers the pair's peak most is
made, among:

- **a move**: one of its local documents to the least loaded GPU with room for it;
- **a swap**: one of its local documents for a shorter one of a lightly loaded GPU, where both
  GPUs keep within capacity (a nearly full batch leaves no room to move into, but a shorter
  document carries less attention per token).

A change is made only where both GPUs end below the busiest GPU's load before it, so the
busiest load (``Loads.cost``, what the planner balances) never rises and every GPU stays within
capacity. With the pool placement's goal, a busiest GPU no such change helps has, in turn:

- **its rings placed again** (``members.replace_ring``) on GPUs no other ring uses;
- **its place in one of its rings moved** to the least loaded GPU with room
  (``members.move_member``): a GPU that two rings share while others are nearly idle.

The pass stops at a busiest GPU nothing improves (a ring's share, not the packing, sets it), or
after ``rounds`` changes. The moves and swaps run round after round in one compiled loop where
numba is installed (``loops/local_changes.py``: the same changes), a round at a time with numpy
(``_best_change``) otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter, itemgetter
from typing import NamedTuple

import numpy as np

from megatron_zeppelin.planner.loops.local_changes import (
    MIN_GAIN,
    Change,
    Rounds,
    best_swap,
    by_rank,
    compiled,
    light_gpus,
)
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.members import move_member, replace_ring
from megatron_zeppelin.planner.place.placement import Placement, local_placement
from megatron_zeppelin.planner.place.pool import PoolGoal
from megatron_zeppelin.planner.plan.plan import Tier

__all__ = ["refine"]

_LIGHT = 16
"""The least loaded GPUs holding local documents whose documents a swap may take."""
_SORTED_MOVES = 16
"""From this many documents on the busiest GPU, their moves are found from the GPUs sorted by
load (``_moves``); fewer are each weighed against every GPU (``_scanned_moves``): the same
answers, whichever is cheaper."""


def refine(
    array: np.ndarray,
    placements: list[Placement],
    loads: Loads,
    attention: np.ndarray,
    rounds: int,
    goal: PoolGoal | None = None,
    *,
    light: int = _LIGHT,
) -> int:
    """Moves and swaps of local documents (module docstring), applied to ``placements`` and
    ``loads``; ``attention``: each document's whole attention seconds
    (``Loads.ring_seconds(length, 1)``). With ``goal`` (the pool placement's), a busiest GPU
    no such change helps has its rings placed again (``members.replace_ring``), or else its place
    in one of them moved (``members.move_member``), longest first, where every member then ends
    below it. ``light``: how many of the least loaded GPUs holding local documents a swap may
    take from. Returns how many changes were made."""
    world = loads.topology.world_size
    work = attention + loads.linear_weight * array
    docs, ranks, rings_on = _held(placements, world)
    cost = np.asarray(loads.cost, dtype=np.float64)
    tokens = np.asarray(loads.tokens, dtype=np.int64)
    on_rank: list[list[int]] | None = None  # the compiled loop keeps its own
    if compiled():
        weight, capacity = loads.linear_weight, loads.capacity
        held = by_rank(docs, ranks, world)
        local = Rounds(held, cost, tokens, array, work, attention, weight, capacity, light)
    else:
        rows, count = by_rank(docs, ranks, world)
        on_rank = [row[:n].tolist() for row, n in zip(rows, count.tolist())]
        local = _NumpyRounds(on_rank, cost, tokens, array, work, loads, light)

    def apply(change: tuple[int, int, int | None], busiest: int) -> None:
        _apply(change, busiest, array, attention, placements, loads, on_rank)

    changes = 0
    while changes < rounds:
        # Local changes until the busiest GPU has none that helps (``local_changes.py``) ...
        made, stuck = local.run(rounds - changes, apply)
        changes += made
        if not stuck or changes >= rounds:
            continue
        # ... then, with the pool's goal, its rings.
        busiest = int(np.argmax(local.cost))
        if goal is None or not (
            _resize(busiest, array, placements, loads, goal, rings_on)
            or _move_member(busiest, array, placements, loads, rings_on)
        ):
            break
        local.cost[:] = loads.cost
        local.tokens[:] = loads.tokens
        changes += 1
    return changes


class _NumpyRounds:
    """``local_changes.Rounds`` with numpy, a round at a time (``_best_change``): where numba
    is not installed."""

    def __init__(
        self,
        on_rank: list[list[int]],
        cost: np.ndarray,
        tokens: np.ndarray,
        array: np.ndarray,
        work: np.ndarray,
        loads: Loads,
        light: int,
    ) -> None:
        self.on_rank, self.cost, self.tokens, self.loads = on_rank, cost, tokens, loads
        self.array, self.work, self.light = array, work, light
        # Each GPU's local documents as an array and how many, kept in step with ``on_rank``:
        # a swap weighs the documents of many GPUs at once, joined from these.
        self.held = _Held(
            [np.asarray(d, dtype=np.int64) for d in on_rank],
            np.fromiter(map(len, on_rank), dtype=np.int64, count=len(on_rank)),
        )

    def run(self, limit: int, apply: Callable[[Change, int], None]) -> tuple[int, bool]:
        """``Rounds.run``: up to ``limit`` changes, each applied by ``apply``."""
        held, cost, tokens, loads = self.held, self.cost, self.tokens, self.loads
        for made in range(limit):
            busiest = int(np.argmax(cost))
            if not held.count[busiest]:
                return made, True
            change = _best_change(
                busiest, held, self.array, self.work, cost, tokens, loads.capacity, self.light
            )
            if change is None:
                return made, True
            apply(change, busiest)
            for rank in (busiest, change[0]):
                cost[rank], tokens[rank] = loads.cost[rank], loads.tokens[rank]
                held.docs[rank] = np.asarray(self.on_rank[rank], dtype=np.int64)
                held.count[rank] = len(self.on_rank[rank])
        return limit, False


def _held(
    placements: list[Placement], world: int
) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """The local (whole) documents, in order, and each one's GPU; and each GPU's ring
    documents, in order. A batch's documents are mostly local: they are read with C-level maps,
    the rings one by one."""
    count = len(placements)
    tiers = map(attrgetter("tier"), placements)
    local = np.fromiter(map(Tier.LOCAL.__eq__, tiers), dtype=bool, count=count)
    firsts = map(itemgetter(0), map(attrgetter("ring"), placements))
    ranks = np.fromiter(firsts, dtype=np.int64, count=count)
    rings_on: list[list[int]] = [[] for _ in range(world)]
    for doc in np.flatnonzero(~local).tolist():
        for rank in placements[doc].ring:
            rings_on[rank].append(doc)
    docs = np.flatnonzero(local)
    return docs, ranks[docs], rings_on


def _apply(
    change: tuple[int, int, int | None],
    busiest: int,
    array: np.ndarray,
    attention: np.ndarray,
    placements: list[Placement],
    loads: Loads,
    on_rank: list[list[int]] | None,
) -> None:
    """A change made: to ``loads``, the placements and, where kept here, ``on_rank``."""
    dest, give, take = change
    for doc, src, dst in ((give, busiest, dest), (take, dest, busiest)):
        if doc is None:
            continue
        length, seconds = int(array[doc]), float(attention[doc])
        loads.add_local(src, -length, -seconds)
        loads.add_local(dst, length, seconds)
        if on_rank is not None:
            on_rank[src].remove(doc)
            on_rank[dst].append(doc)
        placements[doc] = local_placement(dst)


def _resize(
    busiest: int,
    array: np.ndarray,
    placements: list[Placement],
    loads: Loads,
    goal: PoolGoal,
    rings_on: list[list[int]],
) -> bool:
    """Whether one of the rings on ``busiest`` (longest first) found a place where every
    member ends below the busiest load (``members.replace_ring``)."""
    below = loads.cost[busiest] * (1 - MIN_GAIN)
    for doc in sorted(rings_on[busiest], key=lambda d: (-int(array[d]), d)):
        old = placements[doc]
        # A GPU in two rings of other members makes each wait on the other's steps (the
        # simulator's timeline, not ``Loads``, sees that): the ring goes where no other is.
        barred = np.fromiter((bool(r) for r in rings_on), bool, len(rings_on))
        barred[list(old.ring)] = [rings_on[r] != [doc] for r in old.ring]
        new = replace_ring(doc, int(array[doc]), old, loads, goal, below, barred)
        if new is not None:
            for rank in old.ring:
                rings_on[rank].remove(doc)
            for rank in new.ring:
                rings_on[rank].append(doc)
            placements[doc] = new
            return True
    return False


def _move_member(
    busiest: int,
    array: np.ndarray,
    placements: list[Placement],
    loads: Loads,
    rings_on: list[list[int]],
) -> bool:
    """Whether one of the rings on ``busiest`` (longest first) let another GPU take
    ``busiest``'s place in it, every member ending below the busiest load
    (``members.move_member``)."""
    below = loads.cost[busiest] * (1 - MIN_GAIN)
    for doc in sorted(rings_on[busiest], key=lambda d: (-int(array[d]), d)):
        old = placements[doc]
        new = move_member(int(array[doc]), old, loads, busiest, below)
        if new is not None:
            for rank in set(old.ring) - set(new.ring):
                rings_on[rank].remove(doc)
            for rank in set(new.ring) - set(old.ring):
                rings_on[rank].append(doc)
            placements[doc] = new
            return True
    return False


def _scanned_moves(
    busiest: int, lengths: np.ndarray, given: np.ndarray, cost: np.ndarray, room: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``_moves`` by a pass over every GPU per document (cheaper for a few documents)."""
    fits = room[None, :] >= lengths[:, None]
    fits[:, busiest] = False
    ends = np.where(fits, cost[None, :] + given[:, None], np.inf)
    dest = np.argmin(ends, axis=1)
    return dest, ends[np.arange(len(lengths)), dest]


def _moves(
    busiest: int, lengths: np.ndarray, given: np.ndarray, cost: np.ndarray, room: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each document's move: to the least loaded other GPU with room for it (ties: the lowest
    rank), and the load that GPU ends at (``inf`` where none has room). The GPUs sorted by
    load once, the first with room for a document is where the running most room along them
    first reaches its length: a search per document, not a pass over every GPU."""
    order = np.argsort(cost, kind="stable")
    spare = room.copy()
    spare[busiest] = -1
    spare_sorted, cost_sorted = spare[order], cost[order]
    first = np.searchsorted(np.maximum.accumulate(spare_sorted), lengths)
    found = first < len(order)
    at = np.minimum(first, len(order) - 1)
    dest = order[at]
    ends = np.where(found, cost_sorted[at] + given, np.inf)
    # A GPU a little more loaded may end at the very same load once the document is added
    # (rounding): the lowest rank of those takes it, as a scan of every GPU would choose.
    # (Equally loaded GPUs come after in rank order: they never take it.)
    more = np.searchsorted(cost_sorted, cost_sorted[at], side="right")
    nearly = np.minimum(more, len(order) - 1)
    tied = found & (more < len(order)) & (cost_sorted[nearly] + given == ends)
    for i in np.flatnonzero(tied).tolist():
        q, end, length = int(more[i]), float(ends[i]), int(lengths[i])
        while q < len(order) and float(cost_sorted[q] + given[i]) == end:
            if spare_sorted[q] >= length and order[q] < dest[i]:
                dest[i] = order[q]
            q += 1
    return dest, ends


class _Held(NamedTuple):
    """Each GPU's local documents (in ``refine``'s order of them) and how many."""

    docs: list[np.ndarray]
    count: np.ndarray


def _best_change(
    busiest: int,
    held: _Held,
    array: np.ndarray,
    work: np.ndarray,
    cost: np.ndarray,
    tokens: np.ndarray,
    capacity: int,
    light_count: int = _LIGHT,
) -> tuple[int, int, int | None] | None:
    """``(destination, document given, document taken back or None)`` of the move or swap
    that lowers the higher of the two GPUs' loads the most, if any lowers it."""
    top = float(cost[busiest])
    docs = held.docs[busiest]
    lengths, given = array[docs], work[docs]
    room = capacity - tokens
    moves = _moves if len(docs) >= _SORTED_MOVES else _scanned_moves
    dest, ends = moves(busiest, lengths, given, cost, room)
    peaks = np.maximum(top - given, ends)
    best_peak, best = float(peaks.min()), None
    if best_peak < top * (1 - MIN_GAIN):
        i = int(np.argmin(peaks))
        best = (int(dest[i]), int(docs[i]), None)
    # Swaps: for a shorter document of one of the least loaded GPUs holding any.
    light = light_gpus(cost, held.count, busiest, light_count)
    if not len(light):
        return best
    theirs = np.concatenate([held.docs[rank] for rank in light.tolist()])
    position = np.repeat(np.arange(len(light)), held.count[light])  # each column's GPU, as listed
    owner = light[position]
    swap = best_swap(
        lengths, given, array[theirs], work[theirs], cost[owner], position, room[owner],
        int(room[busiest]), top, min(best_peak, top * (1 - MIN_GAIN)),
    )  # fmt: skip
    if swap is not None:
        i, j = swap
        best = (int(owner[j]), int(docs[i]), int(theirs[j]))
    return best
