"""The refinement's changes of whole documents (``refine.py``), round after round: in each, the
move or swap of one of the busiest GPU's local documents that lowers the higher of the two GPUs'
loads the most, until the busiest GPU has none that helps.

A **move** gives a document to the least loaded other GPU with room for it (ties: the lowest
rank). A **swap** takes back a lighter document of one of the ``light`` least loaded GPUs that
hold any (by load, then rank): pair ``(i, j)`` sheds ``delta = work[i] - work[j] > 0`` from
the busiest GPU (load ``top``), both GPUs keep within capacity, and its peak is
``max(top - delta, cost[owner of j] + delta)``. The least peak wins, where it beats the best
move's and ``top`` by ``MIN_GAIN``; ties go to the first GPU listed, then to the busiest GPU's
first document, then to the first of theirs.

Two implementations make the same changes, in the same order, with the same float operations
(``tests/test_local_changes.py``), so a plan is the same with either:

- ``refine._best_change``, a round at a time with numpy (``light_gpus``, ``best_swap``);
- where numba is installed (``loops/jit.py``), ``Rounds``: every round in one compiled loop
  over plain arrays (``_rounds``), which the caller then replays on ``Loads`` and the
  placements. A round there costs microseconds instead of the tenth of a millisecond or more of
  numpy calls: every move's GPU is found in one walk along the GPUs kept sorted by load
  (``_moves``; the busiest GPU is at its end, and after a change its two GPUs walk from where
  they stood to their new places, ``_reorder``), and the swap search passes over a GPU whose
  load alone is above the best peak so far and over a document that sheds too little to beat
  it (both exact: a pair's peak is at least either), and over a GPU whose load leaves no swap
  of it below the best peak (``_SLACK``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from megatron_zeppelin.planner.loops import jit

__all__ = [
    "MIN_GAIN",
    "Change",
    "Rounds",
    "best_swap",
    "by_rank",
    "compiled",
    "light_gpus",
    "warm",
]

MIN_GAIN = 1e-6
"""A change must lower the pair's peak by this fraction of the busiest load."""
_FILTERED_SWAPS = 4096
"""From this many pairs on, ``best_swap`` leaves out the documents no swap can take before it
weighs the pairs (the same answer; below it, leaving them out costs more than weighing them)."""
_CHUNK = 4096
"""Rounds per call of the compiled loop (the size of its log of changes)."""

_SPARE = 64
"""Room for more documents in each GPU's row beyond the most any holds at first (a full row is
widened, twice over, when a document moves into it)."""

Change = tuple[int, int, int | None]
"""``(destination, document given, document taken back or None)`` (``refine._best_change``)."""


def light_gpus(cost: np.ndarray, count: np.ndarray, busiest: int, light: int) -> np.ndarray:
    """The ``light + 1`` least loaded GPUs holding local documents, by load then rank, less the
    busiest."""
    holders = np.where(count > 0, cost, np.inf)
    order = np.argsort(holders, kind="stable")[: light + 1]
    return order[(order != busiest) & (count[order] > 0)]


def best_swap(
    lengths: np.ndarray,
    given: np.ndarray,
    their_length: np.ndarray,
    their_work: np.ndarray,
    owner_cost: np.ndarray,
    position: np.ndarray,
    owner_room: np.ndarray,
    busiest_room: int,
    top: float,
    bound: float,
) -> tuple[int, int] | None:
    """The swap of least peak below ``bound`` (module docstring), every pair weighed at once:
    ``(i, j)``, the busiest GPU's document and theirs, or ``None``. ``lengths``, ``given``: the
    busiest GPU's documents' tokens and work; ``their_length``, ``their_work``: the light
    GPUs' documents, GPU by GPU in the order listed; ``owner_cost``, ``owner_room``,
    ``position``: for each of those, its GPU's load, token room and place in that order."""
    cols = np.arange(len(their_work))
    if len(given) * len(cols) > _FILTERED_SWAPS:
        # Only their documents lighter than the busiest GPU's heaviest, with token room on
        # both sides for a swap with one of its documents, can be swapped: the others are left
        # out of the matrix (about half of them on a nearly full batch of short documents).
        cols = cols[
            (their_work < given.max())
            & (lengths.min() - their_length <= owner_room)
            & (their_length - lengths.max() <= busiest_room)
        ]
    delta = given[:, None] - their_work[cols][None, :]  # what the busiest GPU sheds
    grow = lengths[:, None] - their_length[cols][None, :]  # tokens the light GPU gains
    ok = (delta > 0) & (grow <= owner_room[cols][None, :]) & (-grow <= busiest_room)
    peak = np.where(ok, np.maximum(top - delta, owner_cost[cols][None, :] + delta), np.inf)
    low = float(peak.min()) if peak.size else math.inf
    if not low < bound:
        return None
    rows, at = np.nonzero(peak == low)
    col = cols[at]
    pick = int(np.lexsort((col, rows, position[col]))[0])  # ties: the first GPU listed
    return int(rows[pick]), int(col[pick])


class Rounds:
    """The compiled loop's state: each GPU's load, tokens and local documents (in the order
    ``refine`` keeps them) as arrays, changed in place round by round."""

    def __init__(
        self,
        held: tuple[np.ndarray, np.ndarray],
        cost: np.ndarray,
        tokens: np.ndarray,
        array: np.ndarray,
        work: np.ndarray,
        attention: np.ndarray,
        weight: float,
        capacity: int,
        light: int,
    ) -> None:
        """``held``: each GPU's local documents in a row and how many (``by_rank``)."""
        self.cost, self.tokens = cost, tokens
        self.docs, self.count = held
        self.lengths = np.ascontiguousarray(array, dtype=np.int64)
        self.work = np.ascontiguousarray(work, dtype=np.float64)
        self.attention = np.ascontiguousarray(attention, dtype=np.float64)
        self.weight, self.capacity = float(weight), int(capacity)
        self.light = int(light)

    def run(self, limit: int, apply: Callable[[Change, int], None]) -> tuple[int, bool]:
        """Up to ``limit`` rounds, each change then applied by ``apply(change, busiest)``
        (``refine._apply``: to ``Loads`` and the placements) in the order made: how many were
        made, and whether they stopped at a busiest GPU no change helps (else at ``limit``)."""
        kernel = _compiled()
        assert kernel is not None, "Rounds runs where the loop compiles (``compiled``)"
        log = np.empty((min(limit, _CHUNK), 4), dtype=np.int64)
        made, status = kernel(
            self.cost, self.tokens, self.docs, self.count, self.lengths, self.work,
            self.attention, self.weight, self.capacity, self.light, MIN_GAIN, log,
        )  # fmt: skip
        while status == _FULL:  # a GPU's row of documents is full: wider rows, then on
            self.docs = _widened(self.docs, self.count, max(2 * self.docs.shape[1], 1))
            more, status = kernel(
                self.cost, self.tokens, self.docs, self.count, self.lengths, self.work,
                self.attention, self.weight, self.capacity, self.light, MIN_GAIN, log[made:],
            )  # fmt: skip
            made += more
        for busiest, dest, give, take in log[:made].tolist():
            apply((dest, give, take if take >= 0 else None), busiest)
        if status == _LIMIT and made < limit:
            more, stuck = self.run(limit - made, apply)  # past the log's length
            return made + more, stuck
        return made, status == _STUCK


def compiled() -> bool:
    """Whether ``refine`` runs the compiled loop in this process."""
    return _compiled() is not None


def warm() -> None:
    """The loop built (or read from numba's cache) now (``search.partition.warm``)."""
    kernel = _compiled()
    if kernel is not None:
        one, two = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.float64)
        log = np.empty((1, 4), dtype=np.int64)
        kernel(two, one, np.zeros((1, 1), dtype=np.int64), one, one, two, two, 0.0, 0, 0, 0.0, log)


_SLACK = 1e-12
"""A margin, as a part of the busiest GPU's load, a thousand times the rounding error of the few
float operations a swap's bound takes: a bound within it of ruling a swap out leaves it in."""

_STUCK, _LIMIT, _FULL = 0, 1, 2
"""How ``_rounds`` stopped: at a busiest GPU no change helps, at its log's length, or at a GPU
whose row of documents is full."""


def by_rank(docs: np.ndarray, ranks: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    """``Rounds``' rows: the documents ``docs`` (in order) of each GPU (``ranks``, each's) in
    one row per GPU, in their order, with room to spare (zeros); and how many each holds."""
    count = np.bincount(ranks, minlength=world).astype(np.int64)
    # The same stable order; on 16-bit keys numpy sorts by radix, a tenth of the time.
    keys = ranks.astype(np.uint16) if world <= 1 << 16 else ranks
    order = np.argsort(keys, kind="stable")
    rows = np.zeros((world, int(count.max(initial=0)) + _SPARE), dtype=np.int64)
    first = np.cumsum(count) - count
    rows[ranks[order], np.arange(len(order)) - first[ranks[order]]] = docs[order]
    return rows, count


def _widened(rows: np.ndarray, count: np.ndarray, width: int) -> np.ndarray:
    """``rows`` (``by_rank``'s) in rows of ``width``, each GPU's documents kept, zeros after."""
    wider = np.zeros((rows.shape[0], width), dtype=np.int64)
    kept = np.arange(rows.shape[1]) < count[:, None]
    wider[:, : rows.shape[1]] = np.where(kept, rows, 0)
    return wider


def _least(values, k):  # noqa: ANN001, ANN202 - compiled by numba, typed by its arguments
    """The ``k`` least of ``values`` by value then index, in that order (``light_gpus``): a
    heap of the ``k`` least so far, its greatest on top, then emptied greatest first (by hand:
    numba's own sort and partition take ten seconds and more to compile)."""
    heap = np.empty(min(k, values.shape[0]), dtype=np.int64)
    size = 0
    if heap.shape[0] == 0:
        return heap
    for r in range(values.shape[0]):
        if size < heap.shape[0]:
            at = size  # sift up
            size += 1
            while at > 0:
                up = (at - 1) // 2
                if values[heap[up]] > values[r] or (values[heap[up]] == values[r] and heap[up] > r):
                    break
                heap[at] = heap[up]
                at = up
            heap[at] = r
        elif values[r] < values[heap[0]]:  # ties keep the lower index already held
            _sift_down(values, heap, size, r)
    out = np.empty(size, dtype=np.int64)
    for end in range(size - 1, -1, -1):
        out[end] = heap[0]
        _sift_down(values, heap, end, heap[end])
    return out


def _sift_down(values, heap, size, item):  # noqa: ANN001, ANN202 - compiled by numba
    """``item`` put in the place of the top of ``heap[:size]``, sifted down (the greatest by
    value then index on top)."""
    at = 0
    while True:
        child = 2 * at + 1
        if child >= size:
            break
        right = child + 1
        if right < size and (
            values[heap[right]] > values[heap[child]]
            or (values[heap[right]] == values[heap[child]] and heap[right] > heap[child])
        ):
            child = right
        if values[heap[child]] < values[item] or (
            values[heap[child]] == values[item] and heap[child] < item
        ):
            break
        heap[at] = heap[child]
        at = child
    if size > 0:
        heap[at] = item


def _rounds(
    cost, tokens, docs, count, lengths, work, attention, weight, capacity, light, gain, log
):  # noqa: ANN001, ANN202, E501, PLR0912, PLR0915 - compiled by numba
    """Rounds of ``refine._best_change`` and ``refine._apply`` on arrays (module docstring),
    logged in ``log``, until a busiest GPU has no change that helps, the log is full, or a
    GPU's row of ``docs`` is: ``(changes made, _STUCK | _LIMIT | _FULL)``. Each step is
    numpy's, in the same order: the first busiest GPU, moves to the first least loaded GPU
    with room, the swap ``best_swap`` picks, loads changed as ``Loads.add_local`` changes
    them."""
    world, width = cost.shape[0], docs.shape[1]
    if count[np.argmax(cost)] == 0:
        return 0, 0  # the busiest GPU holds no local document: nothing to order the GPUs for
    holders = np.empty(world)
    for r in range(world):
        holders[r] = cost[r] if count[r] > 0 else np.inf
    # Every GPU by (holders, rank), sorted again after each change (``_reorder``: only its two
    # GPUs move): the first ``light + 1`` are ``light_gpus``' pick, without a selection over
    # every GPU per round (a second refinement weighs swaps with all of them).
    order = _least(holders, world)
    # Every GPU by (load, rank), kept the same way: a move looks along it for the least loaded
    # GPU with room, not over every GPU.
    by_load = _least(cost, world)
    # Where each GPU stands in each (``_reorder`` moves a changed GPU along from there).
    at_order, at_load = np.empty(world, np.int64), np.empty(world, np.int64)
    for i in range(world):
        at_order[order[i]], at_load[by_load[i]] = i, i
    # ``_moves``' answers for the busiest GPU's documents.
    ends, ats = np.empty(width), np.empty(width, np.int64)
    made = 0
    while made < log.shape[0]:
        busiest = _busiest(cost, by_load)
        n = count[busiest]
        if n == 0:
            return made, 0
        top = cost[busiest]
        # Moves: each document to the least loaded other GPU with room (``_moves``).
        best_peak, give, dest, take = np.inf, -1, -1, -1
        move_i, move_dest = -1, -1
        mine = docs[busiest]
        _moves(cost, tokens, by_load, busiest, mine, n, lengths, work, capacity, ends, ats)
        for i in range(n):
            doc = mine[i]
            end, at = ends[i], ats[i]
            shed = top - work[doc]
            peak = shed if shed >= end else end
            if peak < best_peak:
                best_peak, move_i, move_dest = peak, i, at
        limit = top * (1 - gain)
        bound = best_peak if best_peak <= limit else limit
        if best_peak < limit:
            give, dest = docs[busiest, move_i], move_dest
        # Swaps with the light GPUs' documents, GPU by GPU in their order.
        busiest_room = capacity - tokens[busiest]
        best = bound
        for owner in order[: min(light + 1, world)]:
            if owner == busiest or count[owner] == 0 or cost[owner] > best:
                continue
            # A swap ends below ``best`` only where what it sheds exceeds ``top - best`` and the
            # owner then stays below ``best``: none of this owner's can where its load is past
            # ``2 best - top`` (with a margin far above the sums' rounding).
            if cost[owner] + (top - best) > best + _SLACK * top:
                continue
            owner_room = capacity - tokens[owner]
            for i in range(n):
                mine = docs[busiest, i]
                if top - work[mine] > best:
                    continue
                for j in range(count[owner]):
                    theirs = docs[owner, j]
                    delta = work[mine] - work[theirs]
                    if not delta > 0:
                        continue
                    grow = lengths[mine] - lengths[theirs]
                    if grow > owner_room or -grow > busiest_room:
                        continue
                    shed, rise = top - delta, cost[owner] + delta
                    peak = shed if shed >= rise else rise
                    if peak < best:
                        best, give, dest, take = peak, mine, owner, theirs
        if dest < 0:
            return made, 0
        if count[dest] == width:
            return made, 2
        # ``refine._apply``: the document given, then the one taken back.
        _move(give, busiest, dest, cost, tokens, docs, count, lengths, attention, weight)
        if take >= 0:
            _move(take, dest, busiest, cost, tokens, docs, count, lengths, attention, weight)
        for r in (busiest, dest):
            holders[r] = cost[r] if count[r] > 0 else np.inf
        _reorder(holders, order, at_order, busiest, dest)
        _reorder(cost, by_load, at_load, busiest, dest)
        log[made, 0], log[made, 1], log[made, 2], log[made, 3] = busiest, dest, give, take
        made += 1
    return made, 1


def _moves(cost, tokens, by_load, busiest, mine, count, lengths, work, capacity, ends, ats):  # noqa: ANN001, ANN202, PLR0913 - compiled by numba
    """Where each of the first ``count`` documents ``mine`` (off ``busiest``) ends soonest
    (``ats[i]``) and that end (``ends[i]``): of the other GPUs with room for it (holding at most
    ``capacity`` less its length in tokens), the one whose load plus its ``work`` is least, the
    lowest rank on ties (a pass over every GPU in rank order finds the same); ``(inf, -1)``
    where none has room. One walk along ``by_load`` (every GPU by load, then rank) serves them
    all: taken shortest first (``_least``: a GPU's documents sit longest first, so a sort by
    insertion would take the square of their number), each document's first GPU with room, the
    least loaded, is no earlier along it than the one before's. From there a GPU a little more
    loaded may end at the very same sum (rounding), so the look goes on while the sums are equal
    and stops at the first greater: the sum never falls as the load rises, so no GPU past it,
    with room or without, ends as soon."""
    sizes = np.empty(count, dtype=np.int64)
    for i in range(count):
        sizes[i] = lengths[mine[i]]
    order = _least(sizes, count)
    world = by_load.shape[0]
    first = 0
    for k in range(count):
        i = order[k]
        most = capacity - lengths[mine[i]]
        while first < world and (by_load[first] == busiest or tokens[by_load[first]] > most):
            first += 1
        if first == world:
            ends[i], ats[i] = np.inf, -1
            continue
        at = by_load[first]
        end = cost[at] + work[mine[i]]
        for index in range(first + 1, world):
            r = by_load[index]
            if r == busiest:
                continue
            sum_r = cost[r] + work[mine[i]]
            if sum_r > end:
                break
            if sum_r == end and tokens[r] <= most and r < at:
                at = r
        ends[i], ats[i] = end, at


def _busiest(cost, by_load):  # noqa: ANN001, ANN202 - compiled by numba
    """``np.argmax(cost)``, the first GPU of the greatest load, from the end of ``by_load``
    (every GPU by load, then rank): back along the GPUs of that load to the first of them."""
    at = by_load.shape[0] - 1
    while at > 0 and cost[by_load[at - 1]] == cost[by_load[at]]:
        at -= 1
    return by_load[at]


def _after(values, one, other):  # noqa: ANN001, ANN202 - compiled by numba
    """Whether ``one`` comes after ``other`` by value, then index."""
    return values[one] > values[other] or (values[one] == values[other] and one > other)


def _walk(values, order, at, item, skip):  # noqa: ANN001, ANN202 - compiled by numba
    """``item`` moved along ``order`` (``at``: where each stands) from where it stands to its
    place by value, then index, among every other but ``skip``, stepped over where met."""
    size, here = order.shape[0], at[item]
    left = here - 1
    if left >= 0 and order[left] == skip:
        left -= 1
    right = here + 1
    if right < size and order[right] == skip:
        right += 1
    step = 0
    if left >= 0 and _after(values, order[left], item):
        step = -1
    elif right < size and _after(values, item, order[right]):
        step = 1
    if step == 0:
        return
    while 0 <= here + step < size:
        there = order[here + step]
        if there != skip:
            past = _after(values, there, item) if step < 0 else _after(values, item, there)
            if not past:
                break
        order[here], at[there] = there, here
        here += step
    order[here], at[item] = item, here


def _reorder(values, order, at, one, other):  # noqa: ANN001, ANN202 - compiled by numba
    """``order`` (every index by value then index; ``at``: where each stands) sorted again after
    the values of ``one`` and ``other`` changed: ``one`` walked to its place among the others
    but ``other`` (the rest are in order), then ``other`` to its place among all, as an
    insertion sort of the two would place them (the same order as sorting every index)."""
    _walk(values, order, at, one, other)
    _walk(values, order, at, other, -1)


def _move(doc, src, dst, cost, tokens, docs, count, lengths, attention, weight):  # noqa: ANN001, ANN202, E501
    """``doc`` moved from GPU ``src`` to ``dst`` as ``refine._apply`` moves it: the loads
    changed by ``Loads.add_local``'s operations, the document taken out of ``src``'s row (the
    rest keep their order) and put at the end of ``dst``'s."""
    length, seconds = lengths[doc], attention[doc]
    cost[src] += -seconds + weight * -length
    tokens[src] += -length
    cost[dst] += seconds + weight * length
    tokens[dst] += length
    at = 0
    while docs[src, at] != doc:
        at += 1
    for j in range(at, count[src] - 1):
        docs[src, j] = docs[src, j + 1]
    count[src] -= 1
    docs[dst, count[dst]] = doc
    count[dst] += 1


@functools.cache
def _compiled() -> Callable | None:
    """``_rounds`` compiled (``loops/jit.py``), or ``None`` without numba."""
    return jit.compile_loops(
        globals(),
        "_sift_down",
        "_least",
        "_busiest",
        "_after",
        "_walk",
        "_reorder",
        "_moves",
        "_move",
        "_rounds",
    )
