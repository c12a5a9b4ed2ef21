"""Stage 3 of the planner: each node's documents onto its GPUs (see ``partition``).

``place_within_nodes`` gives the documents stage 2 sent to each node (``placement``) a ring of
the node's GPUs (``placement.place_intra``) or one GPU, rings first, longest first, then the
whole documents by LPT; a node whose documents do not fit is placed again with a looser
``_Attempt``, and what the last attempt hands on goes wherever room is left
(``placement.place_anywhere``). Where numba is installed, every node's attempts run in one
compiled call (``loops/node_rings.py``); without it, a node placed alike in an earlier staged
try is placed as it was then (``done``).
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.planner.loops import node_rings
from megatron_zeppelin.planner.place.loads import Loads, LoadsSnapshot
from megatron_zeppelin.planner.place.placement import (
    CapacityError,
    Heap,
    Placement,
    TierChoice,
    capacity_error,
    local_placement,
    longest_first,
    place_anywhere,
    place_intra,
    pop_with_room,
)
from megatron_zeppelin.planner.plan.plan import Tier

__all__ = ["place_within_nodes"]


@dataclass(frozen=True)
class _Attempt:
    """How to place one node's documents; tighter capacity needs the later attempts."""

    by_room: bool
    """Local documents to the GPU with the most room (worst fit, keeps tokens even)."""
    spread: bool
    """Every ring over all the node's GPUs (the layout that leaves the most room on each)."""
    hand_on: bool
    """Documents that still find no room go to other nodes instead of failing."""


_ATTEMPTS = (
    _Attempt(by_room=False, spread=False, hand_on=False),
    _Attempt(by_room=True, spread=False, hand_on=False),
    _Attempt(by_room=True, spread=True, hand_on=True),
)


def place_within_nodes(
    lengths: np.ndarray,
    choice: TierChoice,
    by_node: list[list[int]],
    loads: Loads,
    placements: list[Placement | None],
    done: dict | None = None,
) -> int:
    """Level 2 on every node (``_place_node``); a node whose documents do not fit is placed
    again with the next ``_Attempt``. Documents the last attempt hands on go wherever room is
    left (``place_anywhere``). Returns how many documents capacity moved to a higher tier.
    Where numba is installed, every node in one compiled call (``_place_nodes_compiled``: the
    same rings, GPUs and loads). Else ``done``: the nodes placed before (by ``_node_key``),
    shared by placements of one batch with the same cost model, capacity and topology: a node
    whose documents, loads and target are those of one placed before is placed as it was (the
    staged placement's tries differ in a few documents, and most nodes of a batch of few
    documents per node come out alike)."""
    batch = _NodeBatch(lengths, choice, by_node, loads)
    overflow: list[int] = []
    if node_rings.compiled():
        promotions = _place_nodes_compiled(batch, loads, placements, overflow)
    else:
        promotions = 0
        for node in range(loads.topology.num_nodes):
            promotions += _place_node_attempts(batch, node, loads, placements, overflow, done)
    for doc in longest_first(overflow, lengths):
        placements[doc] = place_anywhere(doc, int(lengths[doc]), loads)
        promotions += 1
    return promotions


def _place_node_attempts(
    batch: _NodeBatch,
    node: int,
    loads: Loads,
    placements: list[Placement | None],
    overflow: list[int],
    done: dict | None,
    first_attempt: int = 0,
) -> int:
    """One node's documents by ``_place_node``, attempt after attempt from ``first_attempt``
    until one places them all, or as placed before (``done``); how many became rings for lack
    of room."""
    choice, k = batch.choice, loads.topology.gpus_per_node
    docs = batch.docs(node)
    ranks = list(loads.topology.ranks_of_node(node))
    target = batch.target(node, ranks) if choice.pack else None
    mine = [*docs.ring_docs, *docs.whole_docs]
    saved, first = loads.snapshot(ranks), len(overflow)
    key = None if done is None else _node_key(docs, mine, saved, choice, loads, target)
    if key is not None and key in done:
        placed, values, promoted, handed_on = done[key]
        for doc, placement in placed:
            placements[doc] = placement
        loads.restore(values)
        overflow += handed_on
        return promoted
    for attempt in _ATTEMPTS[first_attempt:]:
        try:
            promoted = _place_node(
                docs,
                ranks,
                choice,
                k if attempt.spread else 2,
                batch.spread if attempt.spread else choice.largest_ring,
                loads,
                placements,
                target=target,
                by_room=attempt.by_room,
                overflow=overflow if attempt.hand_on else None,
                local=batch.local,
            )
            break
        except CapacityError:
            assert not attempt.hand_on, "the last attempt hands leftovers on instead of failing"
            loads.restore(saved)
    if key is not None:
        placed = [(doc, placements[doc]) for doc in mine]
        done[key] = (placed, loads.snapshot(ranks), promoted, overflow[first:])
    return promoted


def _place_nodes_compiled(
    batch: _NodeBatch, loads: Loads, placements: list[Placement | None], overflow: list[int]
) -> int:
    """``place_within_nodes``' nodes in one compiled call (``node_rings.place_nodes``: each
    node's attempts as ``_place_node_attempts`` makes them), on copies of the loads written
    back at the end; a node where a whole document finds no GPU with room (it would become a
    ring) is placed by ``_place_node_attempts`` from that attempt, between calls. How many
    documents became rings for lack of room."""
    choice, k, nodes = batch.choice, loads.topology.gpus_per_node, loads.topology.num_nodes
    arrays = (
        np.asarray(loads.cost, dtype=np.float64), np.asarray(loads.attention, dtype=np.float64),
        np.asarray(loads.exposed, dtype=np.float64), np.asarray(loads.tokens, dtype=np.int64),
    )  # fmt: skip
    less = 0.0 if loads.balance_linear else loads.token_weight
    lengths = np.asarray(batch.lengths, dtype=np.int64)
    given = batch.given, batch.given_at, np.asarray(choice.work, dtype=np.float64), lengths
    docs = batch.sorted_docs()
    rings = np.zeros(len(docs[1]), dtype=np.int64)
    gpus = np.zeros(len(docs[1]), dtype=np.int64)
    used = np.full(nodes, -1, dtype=np.int64)  # each node's attempt; -1: placed in Python
    terms, promotions, start = loads.ring_terms(), 0, 0
    while True:
        stop, attempt = node_rings.place_nodes(
            arrays, loads.capacity, terms, k, choice.pack, less, given, docs, start,
            (rings, gpus, used),
        )  # fmt: skip
        _write(arrays, loads)
        if stop == nodes:
            break
        promotions += _place_node_attempts(batch, stop, loads, placements, overflow, None, attempt)
        mine = slice(stop * k, (stop + 1) * k)
        for array, values in zip(
            arrays, (loads.cost, loads.attention, loads.exposed, loads.tokens)
        ):
            array[mine] = values[mine]
        start = stop + 1
    batch.placed(used >= 0, rings, gpus, placements, overflow)
    return promotions


def _write(arrays: tuple[np.ndarray, ...], loads: Loads) -> None:
    """``Loads`` given the compiled loop's figures (the same values: the same operations)."""
    cost, attention, exposed, tokens = arrays
    loads.cost[:], loads.attention[:] = cost.tolist(), attention.tolist()
    loads.exposed[:], loads.tokens[:] = exposed.tolist(), tokens.tolist()


def _node_key(
    docs: _NodeDocs,
    mine: list[int],
    held: LoadsSnapshot,
    choice: TierChoice,
    loads: Loads,
    target: float | None,
) -> tuple:
    """What ``place_within_nodes``' attempts on one node read: its documents (which ring;
    ``mine``: all of them), the largest ring each may take, its GPUs and their loads (``held``,
    ``Loads.snapshot``), the target, and the balance mode (the linear seconds a token adds)."""
    ranks, values = held
    return (
        tuple(docs.ring_docs),
        tuple(docs.whole_docs),
        tuple(choice.largest_ring[mine].tolist()),
        ranks,
        tuple(values),
        target,
        loads.linear_weight,
    )


@dataclass(frozen=True)
class _NodeDocs:
    """One node's documents as stage 3 places them, longest first (ties: lower index): its
    in-node rings, then the others with their attention seconds on one GPU."""

    ring_docs: list[int]
    ring_lengths: list[int]
    whole_docs: list[int]
    whole_lengths: list[int]
    whole_seconds: list[float]


class _NodeBatch:
    """Every node's documents sorted for ``_place_node`` at once (a few numpy calls for the
    batch, not a sort per node), and what ``_place_node`` reads of them."""

    def __init__(
        self, lengths: np.ndarray, choice: TierChoice, by_node: list[list[int]], loads: Loads
    ) -> None:
        self.by_node, self.choice, self.loads = by_node, choice, loads
        docs = np.fromiter(itertools.chain.from_iterable(by_node), dtype=np.int64)
        counts = [len(d) for d in by_node]
        node = np.repeat(np.arange(len(by_node)), counts)
        self.given, self.given_at = docs, np.concatenate(([0], np.cumsum(counts)))
        """The documents stage 2 gave each node, in its order, and where each node's start."""
        # Node, then rings before whole documents, then longest first, then lower index.
        sort = np.lexsort((docs, -lengths[docs], ~choice.split[docs], node))
        self._docs, self._node = docs[sort], node[sort]
        self._lengths_of_docs = lengths[self._docs]
        self._cut_array = np.searchsorted(
            self._node * 2 + ~choice.split[self._docs], np.arange(2 * len(by_node) + 1)
        )
        self._cuts = self._cut_array.tolist()
        self.local = [local_placement(r) for r in range(loads.topology.world_size)]
        self.lengths = lengths
        k = loads.topology.gpus_per_node
        self.spread = np.full(len(lengths), k, dtype=np.int64)
        """Every ring over all of a node's GPUs (the last ``_Attempt``'s largest rings)."""

    def docs(self, node: int) -> _NodeDocs:
        """Node ``node``'s documents (lists made per node: a million documents at once would
        hold them all in memory)."""
        ring, whole, end = self._cuts[2 * node : 2 * node + 3]
        docs, lengths = self._docs, self._lengths_of_docs
        return _NodeDocs(
            docs[ring:whole].tolist(),
            lengths[ring:whole].tolist(),
            docs[whole:end].tolist(),
            lengths[whole:end].tolist(),
            self.choice.attention[docs[whole:end]].tolist(),
        )

    def target(self, node: int, ranks: list[int]) -> float:
        """The mean load of the node's GPUs once its documents are placed (``pack``)."""
        docs, loads = self.by_node[node], self.loads
        total = float(sum(self.choice.work[docs].tolist()))
        if not loads.balance_linear:  # only attention is balanced: less the linear seconds
            total -= loads.token_weight * float(sum(self.lengths[docs].tolist()))
        return (sum(loads.cost[r] for r in ranks) + total) / len(ranks)

    def sorted_docs(self) -> tuple[np.ndarray, ...]:
        """Every node's documents as ``node_rings.place_nodes`` takes them: where each node's
        rings and whole documents start, every document's length, largest ring and attention
        seconds on one GPU, in ``docs``' order (rings then whole documents, node by node)."""
        docs, lengths = self._docs, self._lengths_of_docs
        largest = np.ascontiguousarray(self.choice.largest_ring[docs], dtype=np.int64)
        seconds = np.ascontiguousarray(self.choice.attention[docs], dtype=np.float64)
        return self._cut_array, lengths, largest, lengths, seconds

    def placed(
        self,
        nodes: np.ndarray,
        rings: np.ndarray,
        gpus: np.ndarray,
        placements: list[Placement | None],
        overflow: list[int],
    ) -> None:
        """The placements of the documents of ``nodes`` (a mask) from ``place_nodes``' answer:
        each ring's members (a bit mask of the node's GPUs; 0: handed on, into ``overflow``)
        and each whole document's GPU, by position in ``sorted_docs``' order."""
        k = self.loads.topology.gpus_per_node
        split = self.choice.split[self._docs]
        mine = nodes[self._node]
        whole = mine & ~split
        ranks = (self._node[whole] * k + gpus[whole]).tolist()
        given = map(self.local.__getitem__, ranks)
        deque(map(placements.__setitem__, self._docs[whole].tolist(), given), maxlen=0)
        members = _members_of_masks(k)
        ring = mine & split
        for doc, node, mask in zip(
            self._docs[ring].tolist(), self._node[ring].tolist(), rings[ring].tolist()
        ):
            if mask == 0:  # no room: handed on
                overflow.append(doc)
                placements[doc] = None
                continue
            first = node * k
            members_of = tuple(first + j for j in members[mask])
            tier = Tier.LOCAL if len(members_of) == 1 else Tier.INTRA
            placements[doc] = Placement(tier, members_of)


def _place_node(
    docs: _NodeDocs,
    ranks: list[int],
    choice: TierChoice,
    smallest: int,
    largest: np.ndarray,
    loads: Loads,
    placements: list[Placement | None],
    *,
    target: float | None = None,
    by_room: bool = False,
    overflow: list[int] | None = None,
    local: list[Placement],
) -> int:
    """One node: rings first (longest first), then local documents by LPT. With a ``target``
    (``pack``: the node's mean load), each ring is the smallest that ends within it where one
    does (the other GPUs stay free for whole documents); otherwise the one that ends soonest
    (wide rings, which spread the tokens too: better where the node is short of token room).
    Returns how many local documents had to become rings for lack of room. With ``overflow``,
    documents that find no room are appended to it instead of failing. ``local``: the
    placement of a whole document on each rank."""

    if node_rings.compiled():
        placed = _place_node_compiled(
            docs, ranks, smallest, largest, loads, placements, target, by_room, overflow, local
        )
        if placed is not None:
            return placed  # else a whole document finds no room: placed here, below

    def ring(doc: int, length: int) -> Placement | None:
        try:
            return place_intra(doc, length, smallest, int(largest[doc]), ranks, loads, target)
        except CapacityError:
            if overflow is None:
                raise
            overflow.append(doc)
            return None

    promotions = 0
    for doc, length in zip(docs.ring_docs, docs.ring_lengths):
        placements[doc] = ring(doc, length)
    # Heap keys: predicted load (attention plus linear seconds), or tokens alone.
    key_of = loads.tokens if by_room else loads.cost
    heap: Heap = [(key_of[r], r) for r in ranks]
    heapq.heapify(heap)
    cost, attention, tokens_of = loads.cost, loads.attention, loads.tokens
    capacity, weight = loads.capacity, loads.linear_weight
    heapreplace, heappush = heapq.heapreplace, heapq.heappush
    for doc, length, seconds in zip(docs.whole_docs, docs.whole_lengths, docs.whole_seconds):
        top = heap[0]  # the least loaded has room in the usual case: one sift, no pop
        found = top if capacity - tokens_of[top[1]] >= length else None
        found = found or pop_with_room(heap, tokens_of, capacity, length)
        if found is not None:
            rank = found[1]
            # ``Loads.add_local``, inline: the planner's innermost loop.
            cost[rank] += seconds + weight * length
            attention[rank] += seconds
            tokens_of[rank] += length
            placements[doc] = local[rank]
            (heapreplace if found is top else heappush)(heap, (key_of[rank], rank))
            continue
        # No GPU has room for it whole: a ring of the GPUs with room.
        placements[doc] = ring(doc, length)
        promotions += placements[doc] is not None
        heap = [(key_of[r], r) for r in ranks]
        heapq.heapify(heap)
    return promotions


def _place_node_compiled(
    docs: _NodeDocs,
    ranks: list[int],
    smallest: int,
    largest: np.ndarray,
    loads: Loads,
    placements: list[Placement | None],
    target: float | None,
    by_room: bool,
    overflow: list[int] | None,
    local: list[Placement],
) -> int | None:
    """``_place_node`` in one compiled call (``loops/node_rings.py``: the same rings and GPUs,
    the same loads), on copies of the node's loads written back once every document is placed;
    ``None`` (nothing changed) where a whole document finds no GPU with room."""
    first, stop = ranks[0], ranks[-1] + 1  # a node's ranks are consecutive
    k = stop - first
    cost = np.array(loads.cost[first:stop], dtype=np.float64)
    attention = np.array(loads.attention[first:stop], dtype=np.float64)
    exposed = np.array(loads.exposed[first:stop], dtype=np.float64)
    tokens = np.array(loads.tokens[first:stop], dtype=np.int64)
    rings = np.zeros(len(docs.ring_docs), dtype=np.int64)
    gpus = np.zeros(len(docs.whole_docs), dtype=np.int64)
    answer = node_rings.place(
        cost, attention, exposed, tokens, loads.capacity, 0.0 if target is None else target,
        target is not None, loads.ring_terms(),
        np.asarray(docs.ring_lengths, dtype=np.int64),
        np.ascontiguousarray(largest[docs.ring_docs], dtype=np.int64),
        np.asarray(docs.whole_lengths, dtype=np.int64),
        np.asarray(docs.whole_seconds, dtype=np.float64),
        smallest, by_room, overflow is not None, rings, gpus,
    )  # fmt: skip
    if answer == node_rings.AGAIN:
        return None
    if answer == node_rings.FULL:  # the first ring without members found no room
        i = int(np.flatnonzero(rings == 0)[0])
        doc, length = docs.ring_docs[i], docs.ring_lengths[i]
        raise capacity_error(doc, length, f"on node {loads.topology.node_of(first)}")
    loads.cost[first:stop] = cost.tolist()
    loads.attention[first:stop] = attention.tolist()
    loads.exposed[first:stop] = exposed.tolist()
    loads.tokens[first:stop] = tokens.tolist()
    members = _members_of_masks(k)
    for doc, mask in zip(docs.ring_docs, rings.tolist()):
        if mask == 0:  # no room: handed on (``overflow``)
            overflow.append(doc)  # type: ignore[union-attr]
            placements[doc] = None
            continue
        ring = tuple(first + j for j in members[mask])
        placements[doc] = Placement(Tier.LOCAL if len(ring) == 1 else Tier.INTRA, ring)
    for doc, gpu in zip(docs.whole_docs, gpus.tolist()):
        placements[doc] = local[first + gpu]
    return 0


@functools.cache
def _members_of_masks(k: int) -> list[tuple[int, ...]]:
    """The local GPUs of every bit mask over ``k`` GPUs, in order."""
    return [tuple(j for j in range(k) if mask >> j & 1) for mask in range(1 << k)]
