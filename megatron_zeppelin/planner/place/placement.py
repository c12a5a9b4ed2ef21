"""Stage 2 of the planner, documents onto nodes (see ``partition``), and what stages 2 and 3 share.

``place_across_nodes`` gives every inter-node document a ring over consecutive whole nodes and
every other document a node; stage 3 (``within_nodes.place_within_nodes``) then gives the
documents of each node a ring of its GPUs or one GPU. Both record a ``Placement`` (the
document's tier and ring) and add its predicted work to ``Loads``; the rings themselves are
placed here (``place_inter`` across nodes, ``place_intra`` inside one, ``place_anywhere`` where
room is left).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, replace

import numpy as np

from megatron_zeppelin.planner.loops import node_lpt
from megatron_zeppelin.planner.place.loads import Loads, min_ring
from megatron_zeppelin.planner.plan.plan import Tier, zigzag_loads

__all__ = [
    "CapacityError",
    "Placement",
    "TierChoice",
    "local_placement",
    "longest_first",
    "place_across_nodes",
    "place_anywhere",
    "place_inter_documents",
]


@dataclass(frozen=True)
class Placement:
    """Where one document's attention runs: its tier and its ring (one rank when local)."""

    tier: Tier
    ring: tuple[int, ...]
    tokens: tuple[int, ...] | None = None
    """Each member's tokens where the ring's shares are uneven (``shares.py``); ``None``:
    zigzag, equal shares."""


@dataclass(frozen=True)
class TierChoice:
    """Stage 1's answer for every document (arrays indexed by document)."""

    work: np.ndarray
    """Seconds on one GPU: attention plus linear modules."""
    attention: np.ndarray
    """Seconds of attention on one GPU (``Loads.ring_seconds(length, 1)``)."""
    split: np.ndarray
    """Split over a ring (inside a node unless ``inter``)."""
    inter: np.ndarray
    """Ring over whole nodes."""
    wanted_nodes: dict[int, int]
    """Per inter-node document, how many nodes its ring should span."""
    largest_ring: np.ndarray
    """Per document, the largest in-node ring whose chunks still hide their NVLink transfers."""
    splittable: np.ndarray
    """Documents that may still become rings where whole documents leave GPUs uneven."""
    pack: bool = True
    """In-node rings as small as end within the node's mean (else as soon as possible)."""

    def with_rings(self, docs: list[int]) -> TierChoice:
        """The same choice with ``docs`` split over in-node rings as well."""
        split = self.split.copy()
        split[docs] = True
        return replace(self, split=split)


class CapacityError(ValueError):
    """The placement ran out of room on the GPUs it tried (not a bad input)."""


def capacity_error(doc: int, length: int, where: str) -> CapacityError:
    return CapacityError(
        f"document {doc} ({length} tokens) finds no room {where}: the capacity is too tight for "
        "this batch; raise the capacity or use smaller micro-batches"
    )


Heap = list[tuple[float, int]]


def pop_with_room(heap: Heap, used: list[int], limit: int, needed: int) -> tuple[float, int] | None:
    """Pop the least ``(key, index)`` whose index has ``limit - used[index] >= needed`` tokens of
    room; the items passed over stay in the heap."""
    skipped = []
    while heap and limit - used[heap[0][1]] < needed:
        skipped.append(heapq.heappop(heap))
    found = heapq.heappop(heap) if heap else None
    for item in skipped:
        heapq.heappush(heap, item)
    return found


def longest_first(docs, lengths: np.ndarray) -> list[int]:
    docs = np.fromiter(docs, dtype=np.int64)
    return docs[np.lexsort((docs, -lengths[docs]))].tolist()


# --- stage 2: across nodes -----------------------------------------------------------------------
def place_across_nodes(
    lengths: np.ndarray,
    choice: TierChoice,
    loads: Loads,
    placements: list[Placement | None],
    *,
    inter_placed: bool = False,
) -> tuple[list[list[int]], int]:
    """Inter-node documents (longest first) get rings over consecutive nodes
    (``place_inter_documents``, unless ``inter_placed``: done already); every other document a
    node, by LPT on work counting the shares inter-node rings left on each node. Returns the
    documents of every node and how many had to become inter-node rings for lack of room on
    any single node."""
    if not inter_placed:
        place_inter_documents(lengths, choice, loads, placements)
    rest = np.flatnonzero(~choice.inter)
    return _nodes_by_lpt(lengths, rest, choice, loads, placements, int(choice.inter.sum()))


def place_inter_documents(
    lengths: np.ndarray, choice: TierChoice, loads: Loads, placements: list[Placement | None]
) -> None:
    """Stage 2's first part: the inter-node documents' rings, longest first. It reads only
    ``choice.inter`` and ``choice.wanted_nodes``, not which documents ring inside nodes."""
    inter_docs = longest_first(np.flatnonzero(choice.inter).tolist(), lengths)
    for order, doc in enumerate(inter_docs):
        wanted = choice.wanted_nodes[doc]
        placements[doc] = place_inter(doc, int(lengths[doc]), wanted, order, loads)


class _Nodes:
    """Node loads (work) and tokens during level 1, and the least-loaded node with room: from
    a heap while its top has room (the common case), else by one pass over all nodes (a
    fragmented, nearly full cluster would otherwise pop most of the heap for every document).
    Heap entries whose load has changed since are skipped."""

    def __init__(self, load: list[float], tokens: list[int], room: int) -> None:
        self.load, self.tokens, self.room = load, tokens, room
        self.heap: Heap = [(value, n) for n, value in enumerate(load)]
        heapq.heapify(self.heap)
        # The same as arrays, for the pass over all nodes (kept in step by ``set``).
        self.load_array = np.asarray(load, dtype=np.float64)
        self.tokens_array = np.asarray(tokens, dtype=np.int64)

    def pick(self, needed: int) -> int | None:
        heap, load = self.heap, self.load
        while heap[0][0] != load[heap[0][1]]:
            heapq.heappop(heap)  # stale
        if self.room - self.tokens[heap[0][1]] >= needed:
            return heap[0][1]
        fits = self.room - self.tokens_array >= needed
        if not fits.any():
            return None
        return int(np.argmin(np.where(fits, self.load_array, np.inf)))

    def add(self, node: int, work: float, tokens: int) -> None:
        heap, load = self.heap, self.load
        top = heap[0][1] == node and heap[0][0] == load[node]  # ``pick``'s usual answer
        self.set(node, load[node] + work, self.tokens[node] + tokens)
        if top:  # its entry is stale now: replace it (one sift instead of a push and a pop)
            heapq.heapreplace(heap, (load[node], node))
        else:
            heapq.heappush(heap, (load[node], node))

    def set(self, node: int, load: float, tokens: int) -> None:
        self.load[node] = self.load_array[node] = load
        self.tokens[node] = self.tokens_array[node] = tokens


def _nodes_by_lpt(
    lengths: np.ndarray,
    rest: np.ndarray,
    choice: TierChoice,
    loads: Loads,
    placements: list[Placement | None],
    num_inter: int,
) -> tuple[list[list[int]], int]:
    topo = loads.topology
    k, num_nodes = topo.gpus_per_node, topo.num_nodes
    by_node: list[list[int]] = [[] for _ in range(num_nodes)]
    key = _placed_work(lengths, rest, choice, loads)
    order = np.lexsort((rest, -key))
    docs, sizes, works = rest[order].tolist(), lengths[rest][order].tolist(), key[order].tolist()
    # The work and tokens of the documents given to each node so far, the work in the order
    # given (as ``_Nodes`` adds it); and what its GPUs hold of inter-node rings, worked out
    # again only for the nodes a promoted document's ring lands on.
    works_given: list[list[float]] = [[] for _ in range(num_nodes)]
    tokens_given = [0] * num_nodes
    if node_lpt.compiled():
        busy, held = node_lpt.ring_shares(*_arrays(loads), k)
        shares = list(zip(busy.tolist(), held.tolist()))
    else:
        shares = [_ring_shares(loads, n, k) for n in range(num_nodes)]

    def nodes() -> _Nodes:
        """Node loads: their GPUs' inter-node shares plus the documents given to them so far,
        attention and linear work alike."""
        load, tokens = [], []
        for n in range(num_nodes):
            busy, held = shares[n]
            work = sum(works_given[n]) if works_given[n] else 0.0
            load.append(busy + loads.token_weight * held + work)
            tokens.append(held + tokens_given[n])
        return _Nodes(load, tokens, loads.capacity * k)

    def give(node: int, doc: int, work: float, length: int) -> None:
        by_node[node].append(doc)
        works_given[node].append(work)
        tokens_given[node] += length

    state = nodes()
    # Filling a node to the last token leaves its GPUs no room to pack documents whole: nodes
    # keep a small reserve while any other node has room, and give it up only when none has.
    reserve = min(state.room // 32, 4 * int(lengths.max()))
    promotions = 0
    # A ring's zigzag rounding may put a token more than L/g on a GPU: leave a little slack.
    needs = (lengths[rest] + np.where(choice.split[rest], 2 * k, 0))[order].tolist()

    def spread(doc: int, length: int) -> _Nodes:
        """``doc`` over nodes, as a long document would be (no single node has room for it);
        the nodes' loads worked out again."""
        nonlocal promotions
        if num_nodes == 1:
            raise capacity_error(doc, length, "on the node")
        placed = place_inter(doc, length, 2, num_inter, loads, list(tokens_given))
        placements[doc] = placed
        promotions += 1
        for n in {rank // k for rank in placed.ring}:
            shares[n] = _ring_shares(loads, n, k)
        return nodes()

    if node_lpt.compiled():  # the same nodes, in one compiled loop
        arrays = np.asarray(needs, dtype=np.int64), np.asarray(works, dtype=np.float64)
        lengths_given, given = np.asarray(sizes, dtype=np.int64), np.empty(len(docs), np.int64)
        start = 0
        while True:
            stop = node_lpt.give(
                state.load_array, state.tokens_array, state.room, reserve, *arrays,
                lengths_given, start, given,
            )  # fmt: skip
            for i, node in enumerate(given[start:stop].tolist(), start):
                give(node, docs[i], works[i], sizes[i])
            if stop == len(docs):
                return by_node, promotions
            state, start = spread(docs[stop], sizes[stop]), stop + 1
    heap, load, held, room = state.heap, state.load, state.tokens, state.room
    for doc, length, needed, work in zip(docs, sizes, needs, works):
        # ``_Nodes.take_top``, inline: the heap's top is current and has room (the usual case).
        value, node = heap[0]
        if value == load[node] and room - held[node] >= needed + reserve:
            state.set(node, load[node] + work, held[node] + length)
            heapq.heapreplace(heap, (load[node], node))
            give(node, doc, work, length)
            continue
        # The heap's top is stale or full: ``pick`` looks further.
        picked = state.pick(needed + reserve)
        picked = state.pick(needed) if picked is None else picked
        if picked is not None:
            state.add(picked, work, length)
            give(picked, doc, work, length)
            continue
        state = spread(doc, length)
        heap, load, held = state.heap, state.load, state.tokens
    return by_node, promotions


def _arrays(loads: Loads) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``Loads``' attention, exposed seconds and tokens as arrays."""
    attention = np.asarray(loads.attention, dtype=np.float64)
    return attention, np.asarray(loads.exposed, dtype=np.float64), np.asarray(loads.tokens)


def _ring_shares(loads: Loads, node: int, k: int) -> tuple[float, int]:
    """What the GPUs of ``node`` hold so far (the inter-node rings' shares): their attention
    and exposed seconds, and their tokens."""
    ranks = slice(node * k, (node + 1) * k)  # ``topo.ranks_of_node(node)``
    busy = sum(a + e for a, e in zip(loads.attention[ranks], loads.exposed[ranks]))
    return busy, sum(loads.tokens[ranks])


def _placed_work(
    lengths: np.ndarray, rest: np.ndarray, choice: TierChoice, loads: Loads
) -> np.ndarray:
    """What each document will cost its node: its work, or for an in-node ring its members'
    total (chunks compute less efficiently, transfers may not hide) at the smallest ring whose
    members stay within one GPU's share of the batch's work."""
    key = choice.work[rest].copy()
    k = loads.topology.gpus_per_node
    share = float(choice.work.sum()) / loads.topology.world_size
    rings = np.flatnonzero(choice.split[rest])
    if node_lpt.compiled():  # the same sizes and sums, in one compiled loop
        ring_lengths = np.ascontiguousarray(lengths[rest[rings]], dtype=np.int64)
        found = np.empty(len(rings))
        terms, weight = loads.ring_terms(), loads.token_weight
        key[rings] = node_lpt.placed_work(ring_lengths, share, k, terms, weight, found)
        return key
    for i in rings.tolist():
        length = int(lengths[rest[i]])
        for g in range(2, k + 1):
            finish = loads.ring_finish(length, g, "nvlink")
            if finish <= share or g == k:
                key[i] = g * finish
                break
    return key


@functools.cache
def local_placement(rank: int) -> Placement:
    """A whole document on ``rank``: one record per GPU, shared."""
    return Placement(Tier.LOCAL, (rank,))


# --- rings ---------------------------------------------------------------------------------------
def place_anywhere(doc: int, length: int, loads: Loads) -> Placement:
    """The GPU with the most room if it holds the document, else a ring on the node with the
    most room, else a ring across nodes."""
    topo = loads.topology
    rank = min(range(topo.world_size), key=lambda r: (loads.tokens[r], r))
    if loads.room(rank) >= length:
        loads.add_ring((rank,), length)
        return Placement(Tier.LOCAL, (rank,))
    by_room = sorted(
        range(topo.num_nodes),
        key=lambda n: (sum(loads.tokens[r] for r in topo.ranks_of_node(n)), n),
    )
    for node in by_room:
        try:
            return place_intra(
                doc, length, 2, topo.gpus_per_node, list(topo.ranks_of_node(node)), loads
            )
        except CapacityError:
            continue
    if topo.num_nodes == 1:
        raise capacity_error(doc, length, "on any GPU")
    return place_inter(doc, length, 2, doc, loads)


def place_inter(
    doc: int,
    length: int,
    wanted_nodes: int,
    order: int,
    loads: Loads,
    reserved: list[int] | None = None,
) -> Placement:
    """Ring over consecutive nodes (all their GPUs) with the lowest peak load that has room;
    ``reserved`` counts per node the tokens of documents already given to it but not yet placed
    on its GPUs. ``order`` rotates the in-node order so cross-node edges vary per document."""
    topo = loads.topology
    k, num_nodes = topo.gpus_per_node, topo.num_nodes
    need = min_ring(length, loads.capacity, start=wanted_nodes * k, multiple=k)
    if need is None or need > topo.world_size:
        raise capacity_error(doc, length, "even spread over every GPU")
    tokens = np.asarray(loads.tokens, dtype=np.int64).reshape(num_nodes, k)
    cost_by_node = np.asarray(loads.cost).reshape(num_nodes, k).sum(axis=1)
    node_room = loads.capacity * k - tokens.sum(axis=1) - np.asarray(reserved or [0] * num_nodes)
    for num in range(need // k, num_nodes + 1):
        per_rank = max(zigzag_loads(length, num * k))
        fits = ((loads.capacity - tokens.max(axis=1)) >= per_rank) & (node_room >= per_rank * k)
        if not fits.any():
            continue
        windows = np.lib.stride_tricks.sliding_window_view(cost_by_node, num).max(axis=1)
        ok = np.lib.stride_tricks.sliding_window_view(fits, num).all(axis=1)
        if not ok.any():
            continue
        first = int(np.flatnonzero(ok)[np.argmin(windows[ok])])
        offset = order % k
        turn = [(offset + t) % k for t in range(k)]  # ``topo.rank_of(node, turn[t])``
        ring = tuple(node * k + local for node in range(first, first + num) for local in turn)
        loads.add_ring(ring, length, "nic")
        return Placement(Tier.INTER, ring)
    raise capacity_error(doc, length, "on any window of consecutive nodes")


def place_intra(
    doc: int,
    length: int,
    smallest: int,
    largest: int,
    ranks: list[int],
    loads: Loads,
    target: float | None = None,
) -> Placement:
    """Ring of the least-loaded GPUs of one node that have room, in local-index order (one GPU
    when the node has only one).

    Sizes ``smallest..largest`` are candidates (more if capacity needs them). ``g`` least-loaded
    GPUs end at ``load_g + ring_key(g)``: bigger rings trade shorter per-rank work for less
    efficient chunks and more steps. With a ``target``, the smallest ring whose members all end
    within it wins (the other GPUs stay free for whole documents); otherwise, or when none does,
    the size whose busiest member finishes first. When no such ring has room, smaller rings are
    tried (a full GPU cannot join any ring).
    """
    k = len(ranks)
    cost, tokens, capacity = loads.cost, loads.tokens, loads.capacity
    start = min(smallest, k)
    if not (length + 2 * start <= capacity * start and start <= length + 1):  # else it fits
        start = min_ring(length, capacity, start=start)
    if start is None or start > k:
        raise capacity_error(doc, length, f"on node {loads.topology.node_of(ranks[0])}")
    by_load = sorted(sorted(ranks), key=cost.__getitem__)  # ties: the lower rank
    held = [tokens[r] for r in by_load]
    fullest, ring_key = max(held), loads.ring_key
    best: tuple[float, int, list[int]] | None = None
    sizes = [*range(start, k + 1), *range(min(start, smallest) - 1, 1, -1)]
    for g in sizes:
        if best is not None and (g < start or g > max(largest, start)):
            break
        # The ``g`` least loaded that have room for a member's share.
        most = capacity - max(zigzag_loads(length, g))  # tokens a member may hold already
        if fullest <= most:  # every GPU has room (the usual case)
            chosen = by_load[:g]
        else:
            chosen = [r for r, held_r in zip(by_load, held) if held_r <= most][:g]
        if len(chosen) < g:
            continue
        # ``chosen`` keeps ``by_load``'s order: its last member is its busiest.
        finish = cost[chosen[-1]] + ring_key(length, g, "nvlink")
        if target is not None and finish <= target:
            best = (finish, g, chosen)
            break
        if best is None or finish < best[0]:
            best = (finish, g, chosen)
    if best is None:
        raise capacity_error(doc, length, f"on node {loads.topology.node_of(ranks[0])}")
    ring = tuple(sorted(best[2]))
    loads.add_ring(ring, length)
    return Placement(Tier.LOCAL if len(ring) == 1 else Tier.INTRA, ring)
