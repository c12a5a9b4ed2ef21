"""The placement with uneven shares at one target load (``shares._lay``), in one compiled call.

``shares.place_shares`` bisects the least target load at which every document finds room,
laying the batch out along the GPUs a dozen times: each document priced as work at that target,
the documents worth more than a node given whole nodes, the others each to the node with the
least work left that holds it, every node's documents laid end to end along its GPUs, and each
document's stretches made its ring's members (a member whose share is too small hands it to the
others). With numpy that is a Python pass over every document and stretch per target; here it is
one compiled loop that makes the same choices with the same float operations in the same order
(``tests/test_shares.py`` compares the two), its rings priced as ``Loads.ring_key`` prices them
(``ring_prices.py``: over NVLink, or flat across nodes). Compiled by numba where it is installed
(``loops/jit.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from megatron_zeppelin.planner.loops import jit, ring_prices
from megatron_zeppelin.planner.loops.ring_prices import _flat_key, _key

__all__ = ["Laid", "compiled", "lay", "warm"]

Laid = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Per document, in order: where its members start in the next two (``offsets``, one more than
the documents), each member's rank, and its tokens; a document of one member is whole on it."""


def compiled() -> bool:
    """Whether ``lay`` runs in this process."""
    return _compiled() is not None


def warm() -> None:
    """The loop built (or read from numba's cache) now (``search.partition.warm``)."""
    kernel = _compiled()
    if kernel is not None:
        lengths, whole = np.asarray([1000, 10], dtype=np.int64), np.asarray([1.0, 0.01])
        kernel(lengths, whole, 0.5, 2, 1, 4000.0, 4096, np.ones(15), 0.1, 0.3, 0.01)


def lay(
    lengths: np.ndarray,
    whole: np.ndarray,
    target: float,
    k: int,
    num_nodes: int,
    room: float,
    capacity: int,
    terms: np.ndarray,
    shares: tuple[float, float, float],
) -> Laid | None:
    """``shares._lay`` at ``target``: the documents' members (``Laid``), or ``None`` where one
    finds no room. ``whole``: each document's ``Loads.ring_key`` on one GPU; ``room``: the
    tokens the line fills of a GPU; ``terms``: ``Loads.ring_terms``; ``shares``: ``MIN_SHARE``,
    ``MIN_NIC_SHARE`` and ``_SPREAD``."""
    kernel = _compiled()
    assert kernel is not None, "lay runs compiled only (shares._lay without numba)"
    found = kernel(lengths, whole, target, k, num_nodes, room, capacity, terms, *shares)
    return None if found[0][0] < 0 else found


def _work(length, whole, target, k, terms):  # noqa: ANN001, ANN202 - compiled by numba
    """``shares._work``: the document as a ring of the size its work at ``target`` needs."""
    size = max(1, math.ceil(whole / target))
    if size == 1:
        return whole
    if size <= k:
        return size * _key(length, size, terms)
    return size * _flat_key(length, size, terms)


def _split(length, shares, count, tokens):  # noqa: ANN001, ANN202 - compiled by numba
    """``shares._split`` of the first ``count`` shares, into ``tokens``."""
    total = 0.0
    for i in range(count):
        total += shares[i]
    exact = np.empty(count)
    given = 0
    for i in range(count):
        exact[i] = length * shares[i] / total
        tokens[i] = int(exact[i])
        given += tokens[i]
    behind = np.empty(count)
    for i in range(count):
        behind[i] = tokens[i] - exact[i]
    order = np.argsort(behind, kind="mergesort")  # stable, as ``sorted``
    rest = length - given
    if rest < 0:  # a slice ``[:rest]`` of Python's
        rest = max(0, count + rest)
    for i in range(min(rest, count)):
        tokens[order[i]] += 1


def _members(length, ranks, shares, count, k, target, tokens, limits):  # noqa: ANN001, ANN202
    """``shares._members`` of the first ``count`` stretches (``ranks``, ``shares``, changed in
    place): how many members keep a share (their tokens in ``tokens``); 1 where the document
    is whole on ``ranks[0]``. ``limits``: ``MIN_SHARE``, ``MIN_NIC_SHARE``, ``_SPREAD``."""
    min_share, min_nic_share, spread = limits
    while count > 1:
        across = False
        for i in range(1, count):
            if ranks[i] // k != ranks[0] // k:
                across = True
        least = 0
        for i in range(1, count):
            if shares[i] < shares[least]:
                least = i
        _split(length, shares, count, tokens)
        smallest = shares[least]
        spare = smallest < min_share * target and smallest <= spread * target * (count - 1)
        fewest = tokens[0]
        for i in range(1, count):
            fewest = min(fewest, tokens[i])
        if fewest >= 2 and not spare and not (across and smallest < min_nic_share * target):
            return count
        small = 0
        for i in range(1, count):
            if tokens[i] < tokens[small] or (
                tokens[i] == tokens[small] and shares[i] < shares[small]
            ):
                small = i
        for i in range(small, count - 1):
            ranks[i] = ranks[i + 1]
            shares[i] = shares[i + 1]
        count -= 1
    return 1


def _lay(  # noqa: ANN202, PLR0912, PLR0915 - compiled by numba
    lengths,  # noqa: ANN001
    whole,  # noqa: ANN001
    target,  # noqa: ANN001
    k,  # noqa: ANN001
    num_nodes,  # noqa: ANN001
    room,  # noqa: ANN001
    capacity,  # noqa: ANN001
    terms,  # noqa: ANN001
    min_share,  # noqa: ANN001
    min_nic_share,  # noqa: ANN001
    spread,  # noqa: ANN001
):
    """``lay``'s loop: ``(offsets, ranks, tokens)``, ``offsets[0] < 0`` where a document finds
    no room (steps 1-4 of ``shares.py``, as ``shares._lay`` takes them)."""
    n = lengths.shape[0]
    world = num_nodes * k
    failed = (np.full(1, -1, dtype=np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
    node_work = k * target
    tolerance = 1e-9 * node_work
    work = np.empty(n)
    for d in range(n):
        amount = _work(lengths[d], whole[d], target, k, terms)
        floor = target * lengths[d] / room
        work[d] = floor if floor > amount else amount
    order = np.argsort(-work, kind="mergesort")  # by work, ties by document: as ``sorted``
    # Step 2 and 3: each piece of a document a node takes, in the order taken.
    left = np.full(num_nodes, node_work)
    piece_node = np.empty(n + num_nodes, dtype=np.int64)
    piece_doc = np.empty(n + num_nodes, dtype=np.int64)
    piece_amount = np.empty(n + num_nodes)
    pieces = 0
    after = 0
    for doc in order:
        amount = work[doc]
        if amount > node_work + tolerance:
            full = int(amount // node_work)
            extra = amount - full * node_work
            if extra <= tolerance:
                extra = 0.0
            if after + full + (1 if extra > 0 else 0) > num_nodes:
                return failed
            for node in range(after, after + full):
                piece_node[pieces], piece_doc[pieces], piece_amount[pieces] = node, doc, node_work
                pieces += 1
                left[node] = 0.0
            after += full
            if extra > 0:
                piece_node[pieces], piece_doc[pieces], piece_amount[pieces] = after, doc, extra
                pieces += 1
                left[after] -= extra
                after += 1
            continue
        # The node with the least work left that holds it (ties: the lower node).
        least = amount - tolerance
        best = -1
        for node in range(num_nodes):
            if left[node] >= least and (best < 0 or left[node] < left[best]):
                best = node
        if best < 0:
            return failed
        piece_node[pieces], piece_doc[pieces], piece_amount[pieces] = best, doc, amount
        pieces += 1
        left[best] -= amount
    # Step 4: each node's pieces end to end along its GPUs, a stretch of ``target`` each.
    by_node = np.argsort(piece_node[:pieces], kind="mergesort")
    most = pieces * k
    stretch_doc = np.empty(most, dtype=np.int64)
    stretch_rank = np.empty(most, dtype=np.int64)
    stretch_share = np.empty(most)
    stretches = 0
    current, position = -1, 0.0
    for p in by_node:
        node = piece_node[p]
        if node != current:
            current, position = node, 0.0
        start = position
        end = position + piece_amount[p]
        position = end
        first = min(k - 1, int(start / target))
        last = min(k - 1, max(first, math.ceil(end / target - 1e-9) - 1))
        for gpu in range(first, last + 1):
            share = min(end, (gpu + 1) * target) - max(start, gpu * target)
            if share > tolerance:
                stretch_doc[stretches] = piece_doc[p]
                stretch_rank[stretches] = node * k + gpu
                stretch_share[stretches] = share
                stretches += 1
    by_doc = np.argsort(stretch_doc[:stretches], kind="mergesort")  # node order kept
    offsets = np.zeros(n + 1, dtype=np.int64)
    ranks = np.empty(stretches, dtype=np.int64)
    tokens = np.empty(stretches, dtype=np.int64)
    tokens_on = np.zeros(world, dtype=np.int64)
    limits = (min_share, min_nic_share, spread)
    at = 0  # the next stretch of ``by_doc``
    out = 0
    for doc in range(n):
        count = 0
        while at + count < stretches and stretch_doc[by_doc[at + count]] == doc:
            count += 1
        doc_ranks = np.empty(count, dtype=np.int64)
        doc_shares = np.empty(count)
        for i in range(count):
            doc_ranks[i] = stretch_rank[by_doc[at + i]]
            doc_shares[i] = stretch_share[by_doc[at + i]]
        at += count
        length = lengths[doc]
        kept = 1
        if count > 1:
            kept = _members(length, doc_ranks, doc_shares, count, k, target, tokens[out:], limits)
        if kept == 1:
            ranks[out] = doc_ranks[0]
            tokens[out] = length
        else:
            for i in range(kept):
                ranks[out + i] = doc_ranks[i]
        for i in range(kept):
            tokens_on[ranks[out + i]] += tokens[out + i]
        out += kept
        offsets[doc + 1] = out
    if tokens_on.max() > capacity:
        return failed
    return offsets, ranks[:out].copy(), tokens[:out].copy()


@functools.cache
def _compiled() -> Callable | None:
    """``_lay`` compiled (``loops/jit.py``; the prices of ``ring_prices.py`` first), or ``None``
    without numba."""
    if not ring_prices.bind(globals()):
        return None
    return jit.compile_loops(globals(), "_work", "_split", "_members", "_lay")
