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
after ``rounds`` changes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.members import move_member, replace_ring
from megatron_zeppelin.planner.place.placement import Placement
from megatron_zeppelin.planner.place.pool import PoolGoal
from megatron_zeppelin.planner.plan.plan import Tier

__all__ = ["refine"]

_LIGHT = 16
"""The least loaded GPUs holding local documents whose documents a swap may take."""
_MIN_GAIN = 1e-6
"""A change must lower the pair's peak by this fraction of the busiest load."""
_SORTED_MOVES = 16
"""From this many documents on the busiest GPU, their moves are found from the GPUs sorted by
load (``_moves``); fewer are each weighed against every GPU (``_scanned_moves``): the same
answers, whichever is cheaper."""
_FILTERED_SWAPS = 4096
"""From this many pairs on, the documents no swap can take are left out before the pairs are
weighed (the same answer; below it, leaving them out costs more than weighing them)."""


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
    on_rank: list[list[int]] = [[] for _ in range(world)]
    rings_on: list[list[int]] = [[] for _ in range(world)]
    for doc, placement in enumerate(placements):
        for rank in placement.ring:
            (on_rank if placement.tier == Tier.LOCAL else rings_on)[rank].append(doc)
    cost = np.asarray(loads.cost, dtype=np.float64)
    tokens = np.asarray(loads.tokens, dtype=np.int64)
    # Each GPU's local documents as an array and how many, kept in step with ``on_rank``: a
    # swap weighs the documents of many GPUs at once, joined from these.
    held = _Held(
        [np.asarray(d, dtype=np.int64) for d in on_rank], np.array(list(map(len, on_rank)))
    )
    changes = 0
    for _ in range(rounds):
        busiest = int(np.argmax(cost))
        change = None
        if on_rank[busiest]:
            change = _best_change(busiest, held, array, work, cost, tokens, loads.capacity, light)
        if change is not None:
            _apply(change, busiest, array, attention, placements, loads, on_rank)
            for rank in (busiest, change[0]):
                cost[rank], tokens[rank] = loads.cost[rank], loads.tokens[rank]
                held.docs[rank] = np.asarray(on_rank[rank], dtype=np.int64)
                held.count[rank] = len(on_rank[rank])
        elif goal is None or not (
            _resize(busiest, array, placements, loads, goal, rings_on)
            or _move_member(busiest, array, placements, loads, rings_on)
        ):
            break
        else:
            cost = np.asarray(loads.cost, dtype=np.float64)
            tokens = np.asarray(loads.tokens, dtype=np.int64)
        changes += 1
    return changes


def _apply(
    change: tuple[int, int, int | None],
    busiest: int,
    array: np.ndarray,
    attention: np.ndarray,
    placements: list[Placement],
    loads: Loads,
    on_rank: list[list[int]],
) -> None:
    dest, give, take = change
    for doc, src, dst in ((give, busiest, dest), (take, dest, busiest)):
        if doc is None:
            continue
        length, seconds = int(array[doc]), float(attention[doc])
        loads.add_local(src, -length, -seconds)
        loads.add_local(dst, length, seconds)
        on_rank[src].remove(doc)
        on_rank[dst].append(doc)
        placements[doc] = Placement(Tier.LOCAL, (dst,))


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
    below = loads.cost[busiest] * (1 - _MIN_GAIN)
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
    below = loads.cost[busiest] * (1 - _MIN_GAIN)
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
    if best_peak < top * (1 - _MIN_GAIN):
        i = int(np.argmin(peaks))
        best = (int(dest[i]), int(docs[i]), None)
    # Swaps: for a shorter document of one of the least loaded GPUs holding any, all at once.
    holders = np.where(held.count > 0, cost, np.inf)
    light = np.argpartition(holders, min(light_count, len(cost) - 1))[: light_count + 1]
    light = light[(light != busiest) & (held.count[light] > 0)]
    if not len(light):
        return best
    theirs = np.concatenate([held.docs[rank] for rank in light.tolist()])
    position = np.repeat(np.arange(len(light)), held.count[light])  # each column's GPU, as listed
    owner = light[position]
    their_work, their_length = work[theirs], array[theirs]
    cols = np.arange(len(theirs))
    if len(docs) * len(theirs) > _FILTERED_SWAPS:
        # Only their documents lighter than the busiest GPU's heaviest, with token room on
        # both sides for a swap with one of its documents, can be swapped: the others are left
        # out of the matrix (about half of them on a nearly full batch of short documents).
        cols = cols[
            (their_work < given.max())
            & (lengths.min() - their_length <= room[owner])
            & (their_length - lengths.max() <= room[busiest])
        ]
    delta = given[:, None] - their_work[cols][None, :]  # what the busiest GPU sheds
    grow = lengths[:, None] - their_length[cols][None, :]  # tokens the light GPU gains
    ok = (delta > 0) & (grow <= room[owner[cols]][None, :]) & (-grow <= room[busiest])
    peak = np.where(ok, np.maximum(top - delta, cost[owner[cols]][None, :] + delta), np.inf)
    low = float(peak.min()) if peak.size else np.inf
    if low < min(best_peak, top * (1 - _MIN_GAIN)):
        rows, at = np.nonzero(peak == low)
        col = cols[at]
        pick = int(np.lexsort((col, rows, position[col]))[0])  # ties: the first GPU listed
        i, j = int(rows[pick]), int(col[pick])
        best = (int(owner[j]), int(docs[i]), int(theirs[j]))
    return best
