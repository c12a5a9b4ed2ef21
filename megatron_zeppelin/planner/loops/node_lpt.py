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
Compiled by numba where it is installed (``loops/jit.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from megatron_zeppelin.planner.loops import jit

__all__ = ["compiled", "give", "warm"]


def compiled() -> bool:
    """Whether ``give`` runs in this process."""
    return _compiled() is not None


def warm() -> None:
    """The loop built (or read from numba's cache) now (``search.partition.warm``)."""
    if compiled():
        one, two = np.zeros(1, dtype=np.int64), np.zeros(1)
        give(two, one, 1, 0, one, two, one, 0, one)


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


@functools.cache
def _compiled() -> Callable | None:
    """``_give`` compiled (``loops/jit.py``), or ``None`` without numba."""
    return jit.compile_loops(globals(), "_least_with_room", "_give")
