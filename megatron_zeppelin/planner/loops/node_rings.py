"""Stage 3 on one node (``within_nodes._place_node``) in one compiled loop.

A node's in-node rings come first, longest first: each is the smallest ring of the node's least
loaded GPUs with room that ends within the node's mean load (``pack``), else the one that ends
soonest (``placement.place_intra``); then its whole documents, longest first, each on the GPU of
least load (or tokens, ``by_room``) with room for it. A staged try places a thousand-GPU batch's
nodes this way, a few hundred rings a try at about 18 microseconds each in Python; here a node is
one compiled call over its GPUs' loads, with the same float operations in the same order and the
same ties (the lower GPU), so it places as ``_place_node`` does
(``tests/test_placement_shortcuts.py`` compares the two).

``place_nodes`` runs every node of a staged try this way in one call, each node's attempts in
turn (``within_nodes._ATTEMPTS``) and its mean load summed as ``within_nodes`` sums it: Python
then only writes the placements. A ring's price at each size is worked out as
``Loads.rank_share`` and ``Loads.ring_key`` work it out over NVLink, with the same operations
on the same terms (``ring_prices.py``). A whole document no GPU has room for (it would become a
ring) is left to ``_place_node``: the call answers ``AGAIN`` and the caller's loads are
untouched (``place_nodes`` stops at that node). Compiled by numba where it is installed
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

__all__ = ["AGAIN", "FULL", "PLACED", "compiled", "place", "place_nodes", "warm"]

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
        two, cuts = np.asarray([0, 1]), np.asarray([0, 1, 2])  # a node of two GPUs, a ring, a GPU
        loads = np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2, np.int64)
        lengths = np.asarray([1000, 10])
        given = two, np.asarray([0, 2]), np.ones(2), lengths
        docs = (cuts, lengths, np.full(2, 2), lengths, np.full(2, 0.1))
        out = np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(1, np.int64)
        place_nodes(loads, 4096, np.ones(15), 2, True, 0.0, given, docs, 0, out)


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


def place_nodes(
    loads: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    capacity: int,
    terms: np.ndarray,
    k: int,
    packed: bool,
    less: float,
    given: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    docs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    start: int,
    out: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> tuple[int, int]:
    """Every node from ``start`` placed as ``within_nodes.place_within_nodes`` places it: its
    documents by ``place``, attempt after attempt (``within_nodes._ATTEMPTS``) until one places
    them all (the second is left out: it differs from the first only in where whole documents
    go, once every ring has found room). ``loads``: every GPU's ``cost``,
    ``attention``, ``exposed`` and ``tokens``, a node's written only once an attempt placed it;
    ``given``: the documents stage 2 gave each node, in its order, where they start per node,
    and every document's work and length (for the node's mean load, with ``packed``; the work
    less ``less`` seconds a token, ``Loads.token_weight`` where only attention is balanced, else
    nothing); ``docs``: the nodes'
    documents as ``place`` takes them, one after the other (rings then whole documents, each
    node's longest first), where each node's rings and whole documents start (two cuts per
    node and the end), the rings' lengths and largest sizes, the whole documents' lengths and
    attention seconds; ``out``: each ring's members (``place``'s ``rings``), each whole
    document's GPU, and each node's attempt. Returns where it stopped: ``(num_nodes, 0)``, or
    a node and the attempt at which a whole document found no GPU with room (``AGAIN``), for
    the caller to place before calling again from the next node."""
    kernel = _compiled_nodes()
    assert kernel is not None, "place_nodes runs where the loop compiles"
    node, at = kernel(*loads, capacity, terms, k, packed, less, *given, *docs, start, *out)
    return int(node), int(at)


def _nodes(
    cost,
    attention,
    exposed,
    tokens,
    capacity,
    terms,
    k,
    packed,
    less,
    given,
    given_at,
    work,
    lengths,
    cuts,
    ring_lengths,
    largest,
    whole_lengths,
    whole_seconds,
    start,
    rings,
    ranks,
    used,
):  # noqa: ANN001, ANN202, E501, PLR0913 - compiled by numba
    """``place_nodes``: per node, its mean load (``within_nodes._NodeBatch.target``, the same
    sums in the same order), then ``_place`` on a copy of its GPUs' loads for each attempt
    (by load, then by room with every ring over the whole node and rings without room handed
    on) until one places every document."""
    nodes = cost.shape[0] // k
    cost_of, attention_of, exposed_of = np.empty(k), np.empty(k), np.empty(k)
    tokens_of = np.empty(k, dtype=np.int64)
    whole_node = np.full(ring_lengths.shape[0], k, dtype=np.int64)
    for node in range(start, nodes):
        first = node * k
        target = 0.0
        if packed:
            total, held = 0.0, 0
            for i in range(given_at[node], given_at[node + 1]):
                total += work[given[i]]
                held += lengths[given[i]]
            if less != 0.0:  # only attention is balanced: less the linear seconds
                total -= less * float(held)
            busy = 0.0
            for j in range(k):
                busy += cost[first + j]
            target = (busy + total) / k
        low, middle, high = cuts[2 * node], cuts[2 * node + 1], cuts[2 * node + 2]
        # The second attempt differs from the first only in where whole documents go, after
        # every ring: a node whose rings find no room at the first find none at the second.
        for at in (0, 2):
            for j in range(k):
                cost_of[j], attention_of[j] = cost[first + j], attention[first + j]
                exposed_of[j], tokens_of[j] = exposed[first + j], tokens[first + j]
            spread = at == 2
            answer = _place(
                cost_of, attention_of, exposed_of, tokens_of, capacity, target, packed, terms,
                ring_lengths[low:middle], (whole_node if spread else largest)[low:middle],
                whole_lengths[middle:high], whole_seconds[middle:high], k if spread else 2,
                spread, spread, rings[low:middle], ranks[middle:high],
            )  # fmt: skip
            if answer == AGAIN:
                return node, at
            if answer == PLACED:
                for j in range(k):
                    cost[first + j], attention[first + j] = cost_of[j], attention_of[j]
                    exposed[first + j], tokens[first + j] = exposed_of[j], tokens_of[j]
                used[node] = at
                break
    return nodes, 0


@functools.cache
def _compiled() -> Callable | None:
    """``_place`` compiled (``loops/jit.py``; the prices of ``ring_prices.py`` first), or
    ``None`` without numba."""
    if not ring_prices.bind(globals()):
        return None
    return jit.compile_loops(globals(), "_ring", "_place")


@functools.cache
def _compiled_nodes() -> Callable | None:
    """``_nodes`` compiled (after ``_place``, which it calls), or ``None`` without numba."""
    if _compiled() is None:
        return None
    return jit.compile_loops(globals(), "_nodes")
