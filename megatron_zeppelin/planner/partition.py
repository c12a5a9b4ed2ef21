"""Zeppelin's hierarchical sequence partitioning: lengths + topology + cost model -> ``Plan``.

Every document gets a tier first, from its length alone, so a longer document never lands in a
lower tier than a shorter one (see ``thresholds.py`` for ``T_intra < T_inter``):

* **inter-node** when it cannot fit one node (capacity), or when it is long enough that a ring
  over two whole nodes still hides its NIC transfers *and* its attention costs more than one
  node's fair share (total attention / nodes): one node could not be balanced around it;
* **intra-node** when it cannot fit one GPU, or when it is at least ``T_intra`` long and costs
  more than one GPU's fair share (total attention / GPUs);
* **local** otherwise: the whole document on one GPU.

Level 1 (across nodes). Inter-node documents, longest first, take ``n`` consecutive nodes: the
fewest that hold them and bring their cost under a node's share, but no more than keeps a chunk
above the NIC chunk threshold. The window of nodes with the lowest peak load and room wins (ties:
leftmost). The ring visits the nodes in order and all GPUs of each node, so it has exactly ``n``
cross-node edges; each document starts its in-node order at another GPU so the cross-node
edges of different documents leave from different GPUs (and NICs). The other documents go to
nodes by greedy LPT (longest processing time first) on attention cost plus the cost of moving
their tokens in the remapping (token imbalance between nodes becomes NIC traffic).

Level 2 (inside each node). Intra-node documents, longest first, take a ring of the
least-loaded GPUs with room. The ring size (any size from what capacity needs to the node's GPUs,
but no larger than keeps each chunk above the NVLink chunk threshold) is the one whose busiest
member would finish first, using the predicted per-rank ring time (``_Loads.ring_seconds``).
Local documents then go by LPT to the least-loaded GPU with room,
counting the shares GPUs already carry from inter-node rings. A local document that finds no GPU
with room (fragmentation under tight capacity) becomes a ring: the one case that can break the
tier order, counted in ``meta["capacity_promotions"]``.

Zigzag chunks come from ``zigzag_spans``; the linear layout from ``linear_layout.py``; routing of
cross-node ring edges from ``routing.py``. Everything iterates lists and sorted keys, so the same
input always gives the same plan.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.planner.costmodel import CostModel
from megatron_zeppelin.planner.linear_layout import attention_ranges_by_rank, build_linear_layout
from megatron_zeppelin.planner.plan import (
    Plan,
    SequencePlan,
    Span,
    Tier,
    zigzag_bounds,
    zigzag_spans,
)
from megatron_zeppelin.planner.routing import build_routes
from megatron_zeppelin.planner.thresholds import (
    attention_costs,
    remap_seconds_per_token,
    tier_thresholds,
)
from megatron_zeppelin.topology.model import Topology

__all__ = ["PlannerOptions", "plan_batch", "tier_thresholds"]


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the Zeppelin planner; the defaults are the paper's method."""

    thresholds: str | tuple[int, int] = "auto"
    """``"auto"`` (from the cost model) or explicit ``(intra_node, inter_node)`` thresholds,
    in tokens."""
    capacity: int | None = None
    """Per-GPU token capacity; overrides ``plan_batch``'s ``capacity`` argument when set."""
    allow_split: bool = True
    """Split documents for balance. ``False``: split only what capacity forces."""
    routing: bool = True
    """Spread cross-node ring traffic over every NIC through proxy GPUs."""
    remap: bool = True
    """Even linear layout. ``False``: the linear layout is the attention layout."""

    def resolved_thresholds(self, cost_model: CostModel) -> tuple[int, int]:
        if self.thresholds == "auto":
            return tier_thresholds(cost_model)
        try:
            intra, inter = (int(t) for t in self.thresholds)  # type: ignore[union-attr]
        except (TypeError, ValueError):
            raise ValueError(
                f"thresholds must be 'auto' or (intra_node, inter_node) tokens, got "
                f"{self.thresholds!r}"
            ) from None
        if not 1 <= intra <= inter:
            raise ValueError(
                f"thresholds ({intra}, {inter}): need 1 <= intra-node <= inter-node tokens"
            )
        return intra, inter


def position_tokens(length: int, ring_size: int) -> list[int]:
    """Tokens each ring position holds under zigzag (chunks ``i`` and ``2g-1-i``)."""
    if ring_size == 1:
        return [length]
    bounds = zigzag_bounds(length, ring_size)
    g2 = 2 * ring_size - 1
    return [
        bounds[i][1] - bounds[i][0] + bounds[g2 - i][1] - bounds[g2 - i][0]
        for i in range(ring_size)
    ]


def _min_ring(length: int, capacity: int, *, start: int = 1, multiple: int = 1) -> int | None:
    """Smallest ring size (a multiple of ``multiple``, at least ``start``) whose zigzag chunks
    fit ``capacity`` per rank; ``None`` when even one token per rank would not fit."""
    g = max(start, math.ceil(length / capacity))
    g = multiple * math.ceil(g / multiple)
    while g <= length + multiple:
        if max(position_tokens(length, g)) <= capacity:
            return g
        g += multiple
    return None


class _Loads:
    """Per-GPU predicted attention seconds and tokens while documents are placed."""

    def __init__(self, topology: Topology, capacity: int, cost_model: CostModel) -> None:
        self.topology = topology
        self.capacity = capacity
        self.token_weight = remap_seconds_per_token(cost_model, "nvlink", topology.gpus_per_node)
        self.cost = [0.0] * topology.world_size
        self.tokens = [0] * topology.world_size
        eff = cost_model.attention
        self._pair_seconds = cost_model.model.attn_flops_per_pair() / eff.flops_per_s
        self._half_tokens = eff.half_tokens
        self._overhead_s = eff.overhead_s

    def ring_seconds(self, length: int, ring_size: int) -> float:
        """One rank's attention seconds in a zigzag ring: ``L^2 / 2g`` pairs at the efficiency
        of a ``L/g``-token chunk, plus one kernel call per ring step."""
        if ring_size == 1:
            return self._pair_seconds * length * (length + 1) / 2 * (1 + self._half_tokens / length)
        chunk = length / ring_size
        pairs = length * length / (2 * ring_size)
        return self._pair_seconds * pairs * (1 + self._half_tokens / chunk) + (
            ring_size * self._overhead_s
        )

    def add_ring(self, ring: Sequence[int], length: int) -> None:
        seconds = self.ring_seconds(length, len(ring))
        for rank, n in zip(ring, position_tokens(length, len(ring))):
            self.cost[rank] += seconds
            self.tokens[rank] += n

    def load(self, rank: int) -> float:
        return self.cost[rank] + self.token_weight * self.tokens[rank]

    def room(self, rank: int) -> int:
        return self.capacity - self.tokens[rank]


def _check_inputs(lengths: Sequence[int], topology: Topology, capacity: int) -> np.ndarray:
    if len(lengths) == 0:
        raise ValueError("the batch is empty: give at least one document length")
    for i, length in enumerate(lengths):
        if not isinstance(length, (int, np.integer)) or isinstance(length, bool) or length < 1:
            raise ValueError(f"document {i} has length {length!r}; lengths must be integers >= 1")
    if not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity must be a positive number of tokens per GPU, got {capacity!r}")
    cluster = capacity * topology.world_size
    array = np.asarray(lengths, dtype=np.int64)
    longest = int(array.argmax())
    if array[longest] > cluster:
        raise ValueError(
            f"document {longest} has {int(array[longest])} tokens, more than the cluster "
            f"capacity of {cluster} tokens ({topology.world_size} GPUs x {capacity}); "
            "raise the capacity, add GPUs, or cut the document"
        )
    total = int(array.sum())
    if total > cluster:
        raise ValueError(
            f"the batch has {total} tokens, more than the cluster capacity of {cluster} "
            f"({topology.world_size} GPUs x {capacity}); use smaller micro-batches"
        )
    return array


def _capacity_error(doc: int, length: int, where: str) -> ValueError:
    return ValueError(
        f"document {doc} ({length} tokens) finds no room {where}: the capacity is too tight for "
        "this batch; raise the capacity or use smaller micro-batches"
    )


@contextmanager
def _collector_paused() -> Iterator[None]:
    """A plan is thousands of small acyclic objects: the cyclic collector's passes over them
    while they are built cost more than the planning itself, and find nothing to free."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan_batch(
    lengths: Sequence[int],
    *,
    topology: Topology,
    cost_model: CostModel,
    capacity: int | None = None,
    options: PlannerOptions | None = None,
) -> Plan:
    """Zeppelin's plan for one micro-batch of documents (see the module docstring)."""
    with _collector_paused():
        return _plan_batch(lengths, topology, cost_model, capacity, options)


def _plan_batch(
    lengths: Sequence[int],
    topology: Topology,
    cost_model: CostModel,
    capacity: int | None,
    options: PlannerOptions | None,
) -> Plan:
    options = options or PlannerOptions()
    if options.capacity is not None:
        capacity = options.capacity
    if capacity is None:
        raise ValueError("give a per-GPU token capacity (capacity= or PlannerOptions.capacity)")
    array = _check_inputs(lengths, topology, capacity)
    intra_threshold, inter_threshold = options.resolved_thresholds(cost_model)
    k, num_nodes = topology.gpus_per_node, topology.num_nodes
    attn = attention_costs(cost_model, array)
    total_cost = float(attn.sum())
    node_share, gpu_share = total_cost / num_nodes, total_cost / topology.world_size
    nvlink_chunk = max(1, intra_threshold // 2)
    nic_chunk = max(1, inter_threshold // 2)
    if options.routing:  # routed, one cross-node edge uses every NIC of its node
        nic_chunk = max(1, math.ceil(nic_chunk / topology.nics_per_node))

    # Tiers from length alone (vectorized). Zigzag rounding may put a token or two more than
    # L/g on a rank, so documents near a node's capacity are checked exactly.
    split = array > capacity
    inter = array > capacity * k
    for doc in np.flatnonzero(~inter & (array > (capacity - 2) * k)).tolist():
        inter[doc] = (_min_ring(int(array[doc]), capacity) or k + 1) > k
    if options.allow_split:
        split |= (array >= intra_threshold) & (attn > gpu_share)
        if num_nodes > 1:
            inter |= (array >= 2 * k * nic_chunk) & (attn > node_share)
    if num_nodes == 1:
        inter[:] = False
    loads = _Loads(topology, capacity, cost_model)
    rings: list[tuple[int, ...] | None] = [None] * len(array)
    meta_promotions = 0

    # --- level 1: inter-node rings on consecutive nodes ----------------------------------------
    inter_docs = sorted(np.flatnonzero(inter).tolist(), key=lambda d: (-int(array[d]), d))
    for order, doc in enumerate(inter_docs):
        length, cost = int(array[doc]), float(attn[doc])
        wanted = 1
        if options.allow_split:
            wanted = min(math.ceil(cost / node_share), length // (k * nic_chunk))
        rings[doc] = _place_inter(doc, length, max(2, wanted), order, loads)

    # Everything else goes to nodes by LPT; a node's load counts its inter-node shares.
    nic_weight = remap_seconds_per_token(cost_model, "nic", topology.nics_per_node)
    by_node: list[list[int]] = [[] for _ in range(num_nodes)]
    assigned_key, assigned_tokens = [0.0] * num_nodes, [0] * num_nodes
    node_tokens = [0] * num_nodes
    heap: list[tuple[float, int]] = []

    def refresh_nodes() -> None:
        """Node loads: their GPUs' inter-node shares plus the documents given to them so far."""
        heap.clear()
        for n in range(num_nodes):
            ranks = topology.ranks_of_node(n)
            gpu_tokens = sum(loads.tokens[r] for r in ranks)
            node_tokens[n] = gpu_tokens + assigned_tokens[n]
            cost = sum(loads.cost[r] for r in ranks) + nic_weight * gpu_tokens + assigned_key[n]
            heap.append((cost, n))
        heapq.heapify(heap)

    refresh_nodes()
    rest = np.flatnonzero(~inter)
    key = attn[rest] + nic_weight * array[rest]
    node_room = capacity * k
    for idx in np.lexsort((rest, -key)).tolist():
        doc, length = int(rest[idx]), int(array[rest[idx]])
        skipped = []
        while heap and node_room - node_tokens[heap[0][1]] < length + 2 * k:
            skipped.append(heapq.heappop(heap))
        if heap:
            load, node = heapq.heappop(heap)
            by_node[node].append(doc)
            assigned_key[node] += float(key[idx])
            assigned_tokens[node] += length
            node_tokens[node] += length
            heapq.heappush(heap, (load + float(key[idx]), node))
            for item in skipped:
                heapq.heappush(heap, item)
        else:  # no single node has room: spread it over nodes, as a long document would be
            if num_nodes == 1:
                raise _capacity_error(doc, length, "on the node")
            rings[doc] = _place_inter(doc, length, 2, len(inter_docs), loads, assigned_tokens)
            meta_promotions += 1
            refresh_nodes()

    # --- level 2: intra-node rings and local documents, node by node --------------------------
    # Rings stay small enough that every chunk hides its NVLink transfer.
    largest = np.full(len(array), 2, dtype=np.int64)
    if options.allow_split:
        largest = np.maximum(2, np.minimum(k, array // nvlink_chunk))
    overflow: list[int] = []
    for node in range(num_nodes):
        ranks = list(topology.ranks_of_node(node))
        saved = ([loads.cost[r] for r in ranks], [loads.tokens[r] for r in ranks])
        try:
            meta_promotions += _place_node(
                by_node[node], ranks, array, split, 2, largest, loads, rings
            )
        except ValueError:
            # Fragmentation under tight capacity: start the node again with every ring spread
            # over all its GPUs, the layout that leaves the most room on each.
            for i, r in enumerate(ranks):
                loads.cost[r], loads.tokens[r] = saved[0][i], saved[1][i]
            spread = np.full(len(array), k, dtype=np.int64)
            meta_promotions += _place_node(
                by_node[node], ranks, array, split, k, spread, loads, rings, overflow=overflow
            )
    # Documents a full node could not take go wherever room is left, as a last resort.
    for doc in sorted(overflow, key=lambda d: (-int(array[d]), d)):
        rings[doc] = _place_anywhere(doc, int(array[doc]), loads)
        meta_promotions += 1

    return _assemble(
        array, rings, topology, cost_model, capacity, options, loads,
        meta={
            "thresholds": [intra_threshold, inter_threshold],
            "chunk_thresholds": {"nvlink": nvlink_chunk, "nic": nic_chunk},
            "capacity_promotions": meta_promotions,
        },
    )  # fmt: skip


def _place_node(
    docs: list[int],
    ranks: list[int],
    array: np.ndarray,
    split: np.ndarray,
    smallest: int,
    largest: np.ndarray,
    loads: _Loads,
    rings: list[tuple[int, ...] | None],
    *,
    overflow: list[int] | None = None,
) -> int:
    """Level 2 on one node: rings first (longest first), then local documents by LPT. Returns
    how many local documents had to become rings for lack of room.

    With ``overflow`` (the retry under tight capacity), local documents go to the GPU with the
    most room instead (worst fit, which keeps tokens even), and documents that still find no
    room are appended to ``overflow`` instead of failing."""
    by_room = overflow is not None

    def ring(doc: int, length: int) -> tuple[int, ...] | None:
        try:
            return _place_intra(doc, length, smallest, int(largest[doc]), ranks, loads)
        except ValueError:
            if overflow is None:
                raise
            overflow.append(doc)
            return None

    promotions = 0
    for doc in sorted((d for d in docs if split[d]), key=lambda d: (-int(array[d]), d)):
        rings[doc] = ring(doc, int(array[doc]))
    local = sorted((d for d in docs if not split[d]), key=lambda d: (-int(array[d]), d))
    # Heap keys: predicted load (tokens weighted by their remapping cost), or tokens alone.
    weight = 1.0 if by_room else loads.token_weight
    cost_scale = 0.0 if by_room else 1.0
    heap = [(cost_scale * loads.cost[r] + weight * loads.tokens[r], r) for r in ranks]
    heapq.heapify(heap)
    cost_of, tokens_of = loads.cost, loads.tokens
    capacity = loads.capacity
    for doc in local:
        length = int(array[doc])
        cost = loads.ring_seconds(length, 1)
        skipped = []
        while heap and capacity - tokens_of[heap[0][1]] < length:
            skipped.append(heapq.heappop(heap))
        if heap:
            _, rank = heapq.heappop(heap)
            cost_of[rank] += cost
            tokens_of[rank] += length
            rings[doc] = (rank,)
            heapq.heappush(heap, (cost_scale * cost_of[rank] + weight * tokens_of[rank], rank))
            for item in skipped:
                heapq.heappush(heap, item)
        else:  # no GPU has room for it whole: a ring of the GPUs with room
            rings[doc] = ring(doc, length)
            promotions += rings[doc] is not None
            heap = [(cost_scale * loads.cost[r] + weight * loads.tokens[r], r) for r in ranks]
            heapq.heapify(heap)
    return promotions


def _place_anywhere(doc: int, length: int, loads: _Loads) -> tuple[int, ...]:
    """The GPU with the most room if it holds the document, else a ring on the node with the
    most room, else a ring across nodes."""
    topo = loads.topology
    rank = min(range(topo.world_size), key=lambda r: (loads.tokens[r], r))
    if loads.room(rank) >= length:
        loads.add_ring((rank,), length)
        return (rank,)
    by_room = sorted(
        range(topo.num_nodes),
        key=lambda n: (sum(loads.tokens[r] for r in topo.ranks_of_node(n)), n),
    )
    for node in by_room:
        try:
            return _place_intra(
                doc, length, 2, topo.gpus_per_node, list(topo.ranks_of_node(node)), loads
            )
        except ValueError:
            continue
    if topo.num_nodes == 1:
        raise _capacity_error(doc, length, "on any GPU")
    return _place_inter(doc, length, 2, doc, loads)


def _place_inter(
    doc: int,
    length: int,
    wanted_nodes: int,
    order: int,
    loads: _Loads,
    reserved: list[int] | None = None,
) -> tuple[int, ...]:
    """Ring over consecutive nodes (all their GPUs) with the lowest peak load that has room;
    ``reserved`` counts per node the tokens of documents already given to it but not yet placed
    on its GPUs."""
    topo = loads.topology
    k, num_nodes = topo.gpus_per_node, topo.num_nodes
    need = _min_ring(length, loads.capacity, start=wanted_nodes * k, multiple=k)
    if need is None or need > topo.world_size:
        raise _capacity_error(doc, length, "even spread over every GPU")
    tokens = np.asarray(loads.tokens, dtype=np.int64).reshape(num_nodes, k)
    cost_by_node = np.asarray(loads.cost).reshape(num_nodes, k).sum(axis=1)
    node_room = loads.capacity * k - tokens.sum(axis=1) - np.asarray(reserved or [0] * num_nodes)
    for num in range(need // k, num_nodes + 1):
        per_rank = max(position_tokens(length, num * k))
        fits = ((loads.capacity - tokens.max(axis=1)) >= per_rank) & (node_room >= per_rank * k)
        if num > num_nodes or not fits.any():
            continue
        windows = np.lib.stride_tricks.sliding_window_view(cost_by_node, num).max(axis=1)
        ok = np.lib.stride_tricks.sliding_window_view(fits, num).all(axis=1)
        if not ok.any():
            continue
        first = int(np.flatnonzero(ok)[np.argmin(windows[ok])])
        offset = order % k  # rotate the in-node order so cross-node edges vary per document
        ring = tuple(
            topo.rank_of(node, (offset + t) % k)
            for node in range(first, first + num)
            for t in range(k)
        )
        loads.add_ring(ring, length)
        return ring
    raise _capacity_error(doc, length, "on any window of consecutive nodes")


def _place_intra(
    doc: int, length: int, smallest: int, largest: int, ranks: list[int], loads: _Loads
) -> tuple[int, ...]:
    """Ring of the least-loaded GPUs of one node that have room, in local-index order.

    Among ring sizes ``smallest..largest`` (more if capacity needs them), the one whose busiest
    member finishes first wins: ``g`` least-loaded GPUs end at ``load_g + ring_seconds(g)``, and
    bigger rings trade shorter per-rank work for less efficient chunks and more steps. When no
    such ring has room, smaller rings are tried (a full GPU cannot join any ring).
    """
    k = len(ranks)
    node = loads.topology.node_of(ranks[0])
    start = _min_ring(length, loads.capacity, start=min(smallest, k))
    if start is None or start > k:
        raise _capacity_error(doc, length, f"on node {node}")
    by_load = sorted(ranks, key=lambda r: (loads.load(r), r))
    best: tuple[float, int, list[int]] | None = None
    sizes = [*range(start, k + 1), *range(min(start, smallest) - 1, 1, -1)]
    for g in sizes:
        if best is not None and (g > max(largest, start) or g < start):
            break
        per_rank = max(position_tokens(length, g))
        chosen = [r for r in by_load if loads.room(r) >= per_rank][:g]
        if len(chosen) < g:
            continue
        finish = max(loads.load(r) for r in chosen) + loads.ring_seconds(length, g)
        if best is None or finish < best[0]:
            best = (finish, g, chosen)
    if best is None:
        raise _capacity_error(doc, length, f"on node {node}")
    ring = tuple(sorted(best[2]))
    loads.add_ring(ring, length)
    return ring


def _assemble(
    array: np.ndarray,
    rings: list[tuple[int, ...] | None],
    topology: Topology,
    cost_model: CostModel,
    capacity: int,
    options: PlannerOptions,
    loads: _Loads,
    meta: dict,
) -> Plan:
    sequences = []
    for doc, ring in enumerate(rings):
        assert ring is not None, doc
        length = int(array[doc])
        if len(ring) == 1:
            tier, spans = Tier.LOCAL, (Span(ring[0], 0, length),)
        else:
            first_node = ring[0] // topology.gpus_per_node
            same = all(r // topology.gpus_per_node == first_node for r in ring)
            tier, spans = (Tier.INTRA if same else Tier.INTER), zigzag_spans(length, ring)
        sequences.append(SequencePlan(doc, length, tier, ring, spans))
    by_rank = attention_ranges_by_rank(sequences, topology.world_size)
    linear, moved = build_linear_layout(by_rank, topology, remap=options.remap)
    routes = build_routes(sequences, topology) if options.routing else ()
    cost = np.asarray(loads.cost)
    tokens = np.asarray(loads.tokens)
    counts = {t.value: 0 for t in Tier}
    for seq in sequences:
        counts[seq.tier.value] += 1
    meta = {
        **meta,
        "tier_counts": counts,
        "max_ring_size": max(len(r) for r in rings),  # type: ignore[arg-type]
        "attention_imbalance": float(cost.max() / cost.mean()) if cost.mean() > 0 else 1.0,
        "attention_token_imbalance": float(tokens.max() / tokens.mean()),
        "remap_tokens": moved,
        "num_routes": len(routes),
        "cost_sources": dict(cost_model.sources),
    }
    return Plan(
        topology=topology,
        sequences=tuple(sequences),
        linear=linear,
        routes=routes,
        capacity=capacity,
        name="zeppelin",
        meta=meta,
    )
