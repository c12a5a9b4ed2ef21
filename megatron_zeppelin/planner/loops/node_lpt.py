"""Stage 2's documents onto nodes (``placement._nodes_by_lpt``) in one compiled loop.

Documents come in LPT order (most work first); each goes to the node of least load among those
with room for its tokens and the node's reserve, else among those with room for its tokens
alone (ties: the lowest node), and its work and tokens are added to the node's. numpy's version
keeps a heap of the nodes and looks over every node only where the heap's top is full: on a
nearly full batch that is most documents, each a few numpy calls over the nodes. Here every
document is one compiled pass over the nodes, which finds the same node: the heap's top, where
it has room, is the least ``(load, node)`` of all, and numpy's pass takes the first least load
of those with room (``tests/test_placement_shortcuts.py`` compares the two).

A document no node has room for is handed back: the caller spreads it over nodes
(``placement.place_inter``) and works the nodes' loads out again before the loop goes on.

What the loop reads is worked out compiled too, with ``placement``'s operations in its order:
each document's work on its node (``placed_work``: an in-node ring's members' total at the
smallest ring within a GPU's share, priced as ``Loads.ring_finish`` prices it, through
``ring_prices.py``) and what each node's GPUs hold of the inter-node rings (``ring_shares``).
Compiled by numba where it is installed (``loops/jit.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from megatron_zeppelin.planner.loops import jit, ring_prices
from megatron_zeppelin.planner.loops.ring_prices import _share

__all__ = ["compiled", "give", "placed_work", "ring_shares", "warm"]


def compiled() -> bool:
    """Whether ``give``, ``placed_work`` and ``ring_shares`` run in this process."""
    return _compiled() is not None and _compiled_work() is not None


def warm() -> None:
    """The loop built (or read from numba's cache) now (``search.partition.warm``)."""
    if compiled():
        one, two = np.zeros(1, dtype=np.int64), np.zeros(1)
        give(two, one, 1, 0, one, two, one, 0, one)
        placed_work(np.full(1, 1000), 1.0, 2, np.ones(15), 0.1, np.zeros(1))
        ring_shares(np.zeros(2), np.zeros(2), np.zeros(2, dtype=np.int64), 2)


def give(
    load: np.ndarray,
    tokens: np.ndarray,
    room: int,
    reserve: int,
    needs: np.ndarray,
    works: np.ndarray,
    sizes: np.ndarray,
    start: int,
    out: np.ndarray,
) -> int:
    """Documents ``start`` onwards given nodes, each one's node in ``out``, ``load`` and
    ``tokens`` (per node) raised by its work and tokens (``sizes``), until one no node has
    room for (``needs``: its tokens and the slack its ring may need): its index, or
    ``len(needs)`` once all are given."""
    kernel = _compiled()
    assert kernel is not None, "give runs where the loop compiles"
    return int(kernel(load, tokens, room, reserve, needs, works, sizes, start, out))


def _least_with_room(load, tokens, room, needed):  # noqa: ANN001, ANN202 - compiled by numba
    """The node of least load with ``needed`` tokens of room (the first of equal loads), or -1."""
    best = -1
    for node in range(load.shape[0]):
        if room - tokens[node] >= needed and (best < 0 or load[node] < load[best]):
            best = node
    return best


def _give(load, tokens, room, reserve, needs, works, sizes, start, out):  # noqa: ANN001, ANN202
    """``give``: ``placement._nodes_by_lpt``'s loop, compiled by numba."""
    for doc in range(start, needs.shape[0]):
        node = _least_with_room(load, tokens, room, needs[doc] + reserve)
        if node < 0:
            node = _least_with_room(load, tokens, room, needs[doc])
        if node < 0:
            return doc  # no node has room: spread over nodes by the caller
        load[node] = load[node] + works[doc]
        tokens[node] = tokens[node] + sizes[doc]
        out[doc] = node
    return needs.shape[0]


def placed_work(
    lengths: np.ndarray, share: float, k: int, terms: np.ndarray, weight: float, out: np.ndarray
) -> np.ndarray:
    """``placement._placed_work``'s rings: into ``out``, each length's members' total at the
    smallest ring of two GPUs or more (of ``k``) whose ``Loads.ring_finish`` over NVLink is
    within ``share``, else at ``k``. ``terms``: ``Loads.ring_terms``; ``weight``:
    ``Loads.token_weight`` (the finish counts the tokens' linear seconds whatever is
    balanced)."""
    kernel = _compiled_work()
    assert kernel is not None, "placed_work runs where the loop compiles"
    kernel(lengths, float(share), int(k), terms, float(weight), out)
    return out


def ring_shares(
    attention: np.ndarray, exposed: np.ndarray, tokens: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """``placement._ring_shares`` of every node: its GPUs' attention and exposed seconds, and
    their tokens, summed GPU by GPU."""
    kernel = _compiled_shares()
    assert kernel is not None, "ring_shares runs where the loop compiles"
    return kernel(attention, exposed, tokens, int(k))


def _placed_work(lengths, share, k, terms, weight, out):  # noqa: ANN001, ANN202 - compiled
    """``placed_work``."""
    for i in range(lengths.shape[0]):
        length = lengths[i]
        for g in range(2, k + 1):
            compute, waits = _share(length, g, terms)
            finish = compute + waits + weight * length / g
            if finish <= share or g == k:
                out[i] = g * finish
                break


def _ring_shares(attention, exposed, tokens, k):  # noqa: ANN001, ANN202 - compiled by numba
    """``ring_shares``."""
    nodes = attention.shape[0] // k
    busy, held = np.empty(nodes), np.zeros(nodes, dtype=np.int64)
    for node in range(nodes):
        total = 0.0
        for rank in range(node * k, (node + 1) * k):
            total += attention[rank] + exposed[rank]
            held[node] += tokens[rank]
        busy[node] = total
    return busy, held


@functools.cache
def _compiled() -> Callable | None:
    """``_give`` compiled (``loops/jit.py``), or ``None`` without numba."""
    return jit.compile_loops(globals(), "_least_with_room", "_give")


@functools.cache
def _compiled_work() -> Callable | None:
    """``_placed_work`` compiled (the prices of ``ring_prices.py`` first), or ``None``."""
    if not ring_prices.bind(globals()):
        return None
    return jit.compile_loops(globals(), "_placed_work")


@functools.cache
def _compiled_shares() -> Callable | None:
    """``_ring_shares`` compiled, or ``None`` without numba."""
    return jit.compile_loops(globals(), "_ring_shares")
