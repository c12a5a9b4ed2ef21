"""The pool's search for a ring's GPUs (``pool_rings._place``) as one compiled call.

``pool_rings.place_ring`` tries each ring size and place in turn (``pool_rings.Tries``), and
``_members`` answers each try with about a dozen numpy calls over every GPU: which GPUs may take
a member of ``per_rank`` tokens and end within the limit, then, by place, whole nodes, GPUs of
one node, or GPUs over a window of nodes. A plan of a thousand GPUs asks it ten to twenty-five
thousand times. Here the same answer comes from one pass over the GPUs and a few over the nodes,
compiled by numba where it is installed (``loops/jit.py``): the same GPUs in the same order,
ties broken as numpy's stable sorts and first minima break them (``tests/test_ring_search.py``
compares the two).

A GPU's end as a member (``pool_rings._Ends``) is worked out here too, from its load and tokens,
with the same operations. ``place`` runs the tries in order as ``pool_rings._place`` does, each
answered here, and where no try fits the target, ``pool_rings._soonest`` in the same way: its
heap of tries by what is known of their end, each bound raised as it comes up, and the same try
wins. One call places a ring: Python's share of a ring is its tries (once per length and goal)
and adding it to ``Loads``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.planner.loops import jit, ring_prices
from megatron_zeppelin.planner.loops.ring_prices import _flat_key, _key, _most_tokens

__all__ = ["PLACES", "Tries", "compiled", "kernels", "place", "tries", "warm"]

PLACES = {"whole": 0, "node": 1, "any": 2}
"""``ring_options.options``' places, by their code in the compiled loop."""


@dataclass(frozen=True)
class Tries:
    """Every ring ``pool_rings.place_ring`` may try for one document, in the order it tries
    them: each size of ``pool_rings.ring_sizes`` with a place to go, and at it each place
    ``ring_options.options`` allows (``pool_rings.ring_tries``). They depend on the document's
    length, the goal and the pricing alone, not on the loads, so a placement of many rings works
    them out once per length and goal (``place_ring``'s ``memo``)."""

    sizes: np.ndarray
    per_rank: np.ndarray
    """The most tokens a member takes (``ring_options.most_tokens``)."""
    keys: np.ndarray
    """What the ring adds to each member's load there (``ring_options.options``)."""
    places: np.ndarray
    """Where, by ``PLACES``' code."""
    shares: np.ndarray | None = None
    """Per try, one row: where its place is whole nodes, ``Loads.rank_share``'s compute seconds
    and exposed seconds at a member whose edges cross nodes and at one whose edges stay inside
    (the 2-D scheme's price, which ``Loads`` works out); ``nan`` elsewhere (``ring_line.py``
    prices those rings itself). ``None`` where no compiled loop reads it."""

    def columns(self) -> tuple:
        """The columns in their order (``shares`` last)."""
        return self.sizes, self.per_rank, self.keys, self.places, self.shares


def place(
    cost: np.ndarray,
    tokens: np.ndarray,
    room: np.ndarray,
    weight: float,
    floor: int,
    tries: Tries,
    limit: float,
    k: int,
    fallback: bool,
) -> tuple[int, tuple[int, ...]] | None:
    """``pool_rings._place`` compiled: of ``tries`` (``pool_rings.Tries``), the index of the
    first whose ring's members all end within ``limit``, and its ring; else, with ``fallback``,
    of the first whose busiest member ends soonest (``pool_rings._soonest``); ``None`` where
    none finds GPUs (callers ask ``compiled()`` first)."""
    kernel = _compiled_place()
    assert kernel is not None, "ring_search.place runs where the loop compiles"
    index, ring = kernel(
        cost, tokens, room, float(weight), int(floor), tries.sizes, tries.per_rank, tries.keys,
        tries.places, float(limit), int(k), bool(fallback),
    )  # fmt: skip
    return (int(index), tuple(ring.tolist())) if index >= 0 else None


def tries(
    length: int,
    sizes: np.ndarray,
    k: int,
    capacity: int,
    nic_chunk: int,
    two_d: bool,
    wide: bool,
    terms: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """``ring_options.options`` of each of ``sizes`` (``pool_rings.ring_tries``) compiled: the
    tries' sizes, tokens per member, keys and places, in order, and whether ``wide``
    (``ring_options.wide_two_d`` of the document) was asked. A key over whole nodes (the 2-D
    scheme's, ``Loads``' to price) is left ``nan``; ``terms``: ``Loads.ring_terms``."""
    kernel = _compiled_tries()
    assert kernel is not None, "ring_search.tries runs where the loop compiles"
    *found, asked = kernel(length, sizes, k, capacity, nic_chunk, two_d, wide, terms)
    return (*found, bool(asked))


def compiled() -> bool:
    """Whether ``place`` and ``tries`` run in this process."""
    return _compiled() is not None


def kernels() -> tuple[Callable, Callable] | None:
    """``place``'s and ``tries``' compiled loops, for compiled loops to call (``ring_line.py``),
    or ``None`` without numba."""
    search, tries = _compiled_place(), _compiled_tries()
    return None if search is None or tries is None else (search, tries)


def warm() -> None:
    """The loops built (or read from numba's cache) now (``search.partition.warm``)."""
    if compiled():
        one, two = np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.float64)
        _compiled_place()(two, one, one, 0.0, 0, one, one, two, one, 1.0, 1, True)
        tries(4, np.full(1, 2), 2, 4, 1, True, False, np.ones(15))


def _smallest(values, count):  # noqa: ANN001, ANN202 - compiled by numba, typed by its arguments
    """The indices of the ``count`` least of ``values`` by value then index (numpy's stable
    argsort, its first ``count``), in that order: by insertion, for the few GPUs of a node."""
    order = np.empty(count, dtype=np.int64)
    size = 0
    for j in range(values.shape[0]):
        at = size if size < count else count
        while at > 0 and values[order[at - 1]] > values[j]:
            at -= 1
        if at >= count:
            continue
        for move in range(min(size, count - 1), at, -1):
            order[move] = order[move - 1]
        order[at] = j
        size = min(size + 1, count)
    return order[:size]


def _nth_value(values, count, work):  # noqa: ANN001, ANN202 - compiled by numba
    """The ``count``-th least of ``values`` (from 1): ``values[_smallest(values, count)[-1]]``
    without building the indices, sorted by insertion in ``work`` (as long as ``values``; a
    node's few GPUs, for every node in turn)."""
    for i in range(values.shape[0]):
        item, at = values[i], i
        while at > 0 and work[at - 1] > item:
            work[at] = work[at - 1]
            at -= 1
        work[at] = item
    return work[count - 1]


def _below(values, bound):  # noqa: ANN001, ANN202 - compiled by numba
    """How many of ``values`` are less than ``bound``. Where fewer than a ring's size are, the
    size-th least of them is not less than ``bound`` either: a node's GPUs need no sorting to
    know that the node does not beat the best so far."""
    count = 0
    for value in values:
        count += value < bound
    return count


def _sorted_small(items):  # noqa: ANN001, ANN202 - compiled by numba
    """``items`` in increasing order, in place, by insertion (a ring's few nodes or GPUs)."""
    for i in range(1, items.shape[0]):
        item, at = items[i], i
        while at > 0 and items[at - 1] > item:
            items[at] = items[at - 1]
            at -= 1
        items[at] = item
    return items


def _whole(ok, ends, num, k):  # noqa: ANN001, ANN202 - compiled by numba
    """``pool_rings._whole_nodes``."""
    nodes = ends.shape[0] // k
    full = np.empty(nodes, dtype=np.int64)
    worst = np.empty(nodes)
    count = 0
    for node in range(nodes):
        every, most = True, -np.inf
        for j in range(k):
            every = every and ok[node * k + j]
            most = max(most, ends[node * k + j])
        if every:
            full[count], worst[count] = node, most
            count += 1
    if count < num:
        return np.empty(0, dtype=np.int64)
    chosen = _sorted_small(full[:count][_smallest(worst[:count], num)].copy())
    ring = np.empty(num * k, dtype=np.int64)
    for i in range(num):
        for j in range(k):
            ring[i * k + j] = chosen[i] * k + j
    return ring


def _in_node(ok, ends, size, k, best_fit):  # noqa: ANN001, ANN202 - compiled by numba
    """``pool_rings._in_node``."""
    nodes = ends.shape[0] // k
    sign = -1.0 if best_fit else 1.0
    masked, work = np.empty(k), np.empty(k)
    pick, pick_value = -1, np.inf
    for node in range(nodes):
        eligible = 0
        for j in range(k):
            eligible += ok[node * k + j]
        if eligible < size:
            continue
        for j in range(k):
            masked[j] = sign * ends[node * k + j] if ok[node * k + j] else np.inf
        if pick >= 0 and _below(masked, pick_value) < size:
            continue  # its value is no less than the pick's: not sorted to learn it
        value = _nth_value(masked, size, work)
        if pick < 0 or value < pick_value:
            pick, pick_value = node, value
    if pick < 0:
        return np.empty(0, dtype=np.int64)
    for j in range(k):
        masked[j] = sign * ends[pick * k + j] if ok[pick * k + j] else np.inf
    return _sorted_small(_smallest(masked, size) + pick * k)


def _across(ok, ends, size, k):  # noqa: ANN001, ANN202, PLR0912 - compiled by numba
    """``pool_rings._across``."""
    nodes = ends.shape[0] // k
    counts = np.zeros(nodes, dtype=np.int64)
    worst = np.full(nodes, -np.inf)
    for r in range(ends.shape[0]):
        counts[r // k] += ok[r]
        worst[r // k] = max(worst[r // k], ends[r])
    least = max(2, -(-size // k))
    order = np.empty(0, dtype=np.int64)
    for num in range(least, min(nodes, least + 1) + 1):
        best, first, total = -1, -1, 0
        for node in range(num):
            total += counts[node]
        for start in range(nodes - num + 1):
            if start > 0:
                total += counts[start + num - 1] - counts[start - 1]
            if total > best:
                best, first = total, start
        if best >= size:
            order = np.arange(first, first + num)
            break
    if order.shape[0] == 0:  # no window: the most eligible GPUs first, then the least loaded
        order = np.arange(nodes)
        for i in range(1, nodes):
            node, at = order[i], i
            while at > 0 and (
                counts[order[at - 1]] < counts[node]
                or (counts[order[at - 1]] == counts[node] and worst[order[at - 1]] > worst[node])
            ):
                order[at] = order[at - 1]
                at -= 1
            order[at] = node
    ring = np.empty(size, dtype=np.int64)
    taken, used = 0, 0
    masked = np.empty(k)
    for node in order:
        if taken == size:
            break
        take = min(counts[node], size - taken)
        if take <= 0:
            continue
        for j in range(k):
            masked[j] = ends[node * k + j] if ok[node * k + j] else np.inf
        for j in _smallest(masked, take):
            ring[taken] = node * k + j
            taken += 1
        used += 1
    if used < 2:
        return np.empty(0, dtype=np.int64)  # one node's ring is priced on NVLink
    return _sorted_small(ring)


def _members(cost, tokens, room, weight, floor, size, key, per_rank, limit, k, where, best_fit):  # noqa: ANN001, ANN202, E501 - compiled by numba
    """``pool_rings._members`` of ``pool_rings._Ends``' ends; ``where`` a code of ``PLACES``."""
    world = cost.shape[0]
    ends = np.empty(world)
    ok = np.empty(world, dtype=np.bool_)
    eligible = 0
    for r in range(world):
        ends[r] = cost[r] + weight * max(0, floor - tokens[r] - per_rank) if floor else cost[r]
        ok[r] = room[r] >= per_rank and ends[r] + key <= limit
        eligible += ok[r]
    if eligible < size:
        return np.empty(0, dtype=np.int64)
    if where == 0:
        return _whole(ok, ends, size // k, k)
    if where == 1:
        return _in_node(ok, ends, size, k, best_fit)
    return _across(ok, ends, size, k)


def _split(work, low, high, pivot):  # noqa: ANN001, ANN202 - compiled by numba
    """Hoare's partition of ``work[low:high + 1]`` around ``pivot`` (a value in it), in place:
    ``(i, j)``, everything up to ``j`` at most ``pivot``, everything from ``i`` at least it."""
    i, j = low, high
    while i <= j:
        while work[i] < pivot:
            i += 1
        while work[j] > pivot:
            j -= 1
        if i <= j:
            work[i], work[j] = work[j], work[i]
            i += 1
            j -= 1
    return i, j


def _select(work, kth):  # noqa: ANN001, ANN202 - compiled by numba
    """``work`` rearranged in place by selection (numba's own partition takes seconds to
    compile) so that its ``kth`` item (from 0) is the ``kth`` least, none before it greater and
    none after it less: the values ``np.partition(work, kth)`` puts up to ``kth``, in another
    order."""
    low, high = 0, work.shape[0] - 1
    while low < high:
        i, j = _split(work, low, high, work[(low + high) // 2])
        if kth <= j:
            high = j
        elif kth >= i:
            low = i
        else:
            break
    return work


def _kth(values, kth):  # noqa: ANN001, ANN202 - compiled by numba, typed by its arguments
    """The ``kth`` least of ``values`` (from 0), on a copy: ``np.partition(values, kth)[kth]``."""
    return _select(values.copy(), kth)[kth]


def _least(values, count):  # noqa: ANN001, ANN202 - compiled by numba, typed by its arguments
    """The ``count`` least of ``values`` in increasing order: ``np.sort(values)[:count]``, by
    selection and then a sort of those alone (a ring's sizes ask for a few dozen of a thousand
    GPUs' loads, and sorting all of them took half of ``_place``)."""
    count = min(count, values.shape[0])
    work = values.copy()
    if 0 < count < work.shape[0]:
        _select(work, count - 1)
    return _sorted(work[:count])


def _bound(cost, tokens, room, weight, floor, size, per_rank, k, where):  # noqa: ANN001, ANN202
    """``pool_rings._soonest``'s second bound of a try: for a ring in one node, the least over
    the nodes of the ``size``-th least end of their GPUs with room (``pool_rings._node_end``);
    else the ``size``-th least end of the GPUs with room. ``inf`` where none has that many."""
    world = cost.shape[0]
    ends = np.empty(world)
    eligible = 0
    for r in range(world):
        ends[r] = cost[r] + weight * max(0, floor - tokens[r] - per_rank) if floor else cost[r]
        if room[r] < per_rank:
            ends[r] = np.inf
        else:
            eligible += 1
    if where == 1:
        best, work = np.inf, np.empty(k)
        for node in range(world // k):
            mine = ends[node * k : (node + 1) * k]
            if _below(mine, best) >= size:  # else its ``size``-th least is no less than best
                best = min(best, _nth_value(mine, size, work))
        return best
    return _kth(ends, size - 1) if eligible >= size else np.inf


def _heap_push(bounds, tries, size, bound, index):  # noqa: ANN001, ANN202 - compiled by numba
    """``(bound, index)`` onto the heap of ``size`` entries (the least on top); its new size."""
    at = size
    while at > 0:
        up = (at - 1) // 2
        if bounds[up] < bound or (bounds[up] == bound and tries[up] < index):
            break
        bounds[at], tries[at] = bounds[up], tries[up]
        at = up
    bounds[at], tries[at] = bound, index
    return size + 1


def _heap_pop(bounds, tries, size):  # noqa: ANN001, ANN202 - compiled by numba
    """The top of the heap taken off; its new size."""
    size -= 1
    bound, index, at = bounds[size], tries[size], 0
    while True:
        child = 2 * at + 1
        if child >= size:
            break
        if child + 1 < size and (
            bounds[child + 1] < bounds[child]
            or (bounds[child + 1] == bounds[child] and tries[child + 1] < tries[child])
        ):
            child += 1
        if bound < bounds[child] or (bound == bounds[child] and index < tries[child]):
            break
        bounds[at], tries[at] = bounds[child], tries[child]
        at = child
    if size > 0:
        bounds[at], tries[at] = bound, index
    return size


def _soonest(cost, tokens, room, least, weight, floor, sizes, per_rank, keys, places, k):  # noqa: ANN001, ANN202, E501, PLR0913 - compiled by numba
    """``place``'s fallback: ``pool_rings._soonest``'s heap of tries by what is known of their
    end (a try has one entry at a time: ``(bound, index)``, least first), each bound raised as it
    comes up: the ``size``-th least load plus the key, then ``_bound`` plus the key, then its
    ring's busiest end plus the key. The first to come off with its end known is the answer."""
    count = sizes.shape[0]
    bounds, tries = np.empty(count), np.empty(count, dtype=np.int64)
    stage = np.zeros(count, dtype=np.int64)
    size = 0
    for i in range(count):
        size = _heap_push(bounds, tries, size, least[sizes[i] - 1] + keys[i], i)
    none = np.empty(0, dtype=np.int64)
    while size > 0:
        i = tries[0]
        size = _heap_pop(bounds, tries, size)
        if stage[i] == 0:
            bound = _bound(cost, tokens, room, weight, floor, sizes[i], per_rank[i], k, places[i])
            if bound < np.inf:
                stage[i] = 1
                size = _heap_push(bounds, tries, size, bound + keys[i], i)
            continue
        ring = _members(
            cost, tokens, room, weight, floor, sizes[i], keys[i], per_rank[i], np.inf, k,
            places[i], False,
        )  # fmt: skip
        if stage[i] == 2 or (ring.shape[0] > 0 and places[i] == 1):
            return i, ring  # its end known: the least of every bound left
        if ring.shape[0] == 0:
            continue
        most = -np.inf
        for r in ring:
            extra = max(0, floor - tokens[r] - per_rank[i]) if floor else 0
            most = max(most, cost[r] + weight * extra if floor else cost[r])
        stage[i] = 2
        size = _heap_push(bounds, tries, size, most + keys[i], i)
    return -1, none


def _sorted(values):  # noqa: ANN001, ANN202 - compiled by numba, typed by its arguments
    """``np.sort(values)`` (a copy), by quicksort by hand, short stretches by insertion
    (numba's own sort takes seconds to compile): a few thousand values at most."""
    out = values.copy()
    stack = np.empty(128, dtype=np.int64)  # stretches left to sort, the shorter side first
    top = 0
    low, high = 0, out.shape[0] - 1
    while True:
        while high - low > 16:
            middle = (low + high) // 2  # the median of three as the pivot
            if out[middle] < out[low]:
                out[middle], out[low] = out[low], out[middle]
            if out[high] < out[low]:
                out[high], out[low] = out[low], out[high]
            if out[high] < out[middle]:
                out[high], out[middle] = out[middle], out[high]
            i, j = _split(out, low, high, out[middle])
            if j - low < high - i:  # the longer side waits: the stack stays short
                stack[top], stack[top + 1] = i, high
                high = j
            else:
                stack[top], stack[top + 1] = low, j
                low = i
            top += 2
        for i in range(low + 1, high + 1):
            item, at = out[i], i
            while at > low and out[at - 1] > item:
                out[at] = out[at - 1]
                at -= 1
            out[at] = item
        if top == 0:
            return out
        top -= 2
        low, high = stack[top], stack[top + 1]


def _place(cost, tokens, room, weight, floor, sizes, per_rank, keys, places, limit, k, fallback):  # noqa: ANN001, ANN202, E501, PLR0913 - compiled by numba
    """``place``: the tries in order, each skipped where the ``size``-th least load plus its key
    is over ``limit`` (no ``size`` GPUs can end within it), else asked of ``_members`` (best
    fit); the first to find GPUs wins. Else ``_soonest`` where ``fallback``. ``least``: the
    loads sorted as far as the largest size."""
    least = _least(cost, sizes.max()) if sizes.shape[0] else cost[:0]
    for i in range(sizes.shape[0]):
        if least[sizes[i] - 1] + keys[i] > limit:
            continue
        ring = _members(
            cost, tokens, room, weight, floor, sizes[i], keys[i], per_rank[i], limit, k,
            places[i], np.isfinite(limit),
        )  # fmt: skip
        if ring.shape[0] > 0:
            return i, ring
    if not fallback:
        return -1, np.empty(0, dtype=np.int64)
    return _soonest(cost, tokens, room, least, weight, floor, sizes, per_rank, keys, places, k)


def _tries(length, sizes, k, capacity, nic_chunk, two_d, wide, terms):  # noqa: ANN001, ANN202, PLR0913 - compiled by numba
    """``tries``: size by size, the places ``ring_options.options`` allows in its order (one
    node; whole nodes; flat across nodes), each's key (``ring_prices``), and the size's most
    tokens per member."""
    count = 0
    found = np.empty(3 * sizes.shape[0], dtype=np.int64)
    per_rank = np.empty(3 * sizes.shape[0], dtype=np.int64)
    keys = np.empty(3 * sizes.shape[0])
    places = np.empty(3 * sizes.shape[0], dtype=np.int64)
    asked = False
    for size in sizes:
        first = count
        cross = length // size >= nic_chunk or length > k * capacity
        if size <= k:
            keys[count], places[count] = _key(length, size, terms), 1
            count += 1
        if size % k == 0 and size > k and two_d:
            spread = size >= 2 * k and length // (size // k) >= nic_chunk
            asked = asked or (spread and not cross)
            if cross or (spread and wide):
                keys[count], places[count] = np.nan, 0
                count += 1
        if cross:
            keys[count], places[count] = _flat_key(length, size, terms), 2
            count += 1
        if count > first:
            most = _most_tokens(length, size)
            for i in range(first, count):
                found[i], per_rank[i] = size, most
    return found[:count], per_rank[:count], keys[:count], places[:count], asked


@functools.cache
def _compiled() -> Callable | None:
    """``_members`` compiled (``loops/jit.py``), or ``None`` without numba."""
    return jit.compile_loops(
        globals(),
        "_smallest",
        "_nth_value",
        "_below",
        "_sorted_small",
        "_whole",
        "_in_node",
        "_across",
        "_members",
    )


@functools.cache
def _compiled_place() -> Callable | None:
    """``_place`` compiled (after ``_members``, which it calls), or ``None`` without numba."""
    if _compiled() is None:
        return None
    names = (
        "_split", "_select", "_kth", "_bound", "_heap_push", "_heap_pop", "_soonest", "_sorted",
        "_least", "_place",
    )  # fmt: skip
    return jit.compile_loops(globals(), *names)


@functools.cache
def _compiled_tries() -> Callable | None:
    """``_tries`` compiled (the prices of ``ring_prices.py`` first), or ``None`` without
    numba."""
    if not ring_prices.bind(globals()):
        return None
    return jit.compile_loops(globals(), "_tries")
