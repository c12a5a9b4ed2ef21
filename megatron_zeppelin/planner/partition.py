"""Zeppelin's hierarchical sequence partitioning: lengths + topology + cost model -> ``Plan``.

What is balanced is each GPU's predicted **work**: its attention seconds plus its tokens' linear
seconds (``linear_seconds_per_token``), plus the ring transfers its compute cannot hide
(``Loads.ring_finish``). Linear modules are most of a step at typical lengths; balancing
attention alone leaves tokens uneven and the remapping then has to move them across nodes.

Every document gets a tier first:

* **inter-node** when it cannot fit one node (capacity), or when its work exceeds one node's fair
  share and the cost model predicts that a ring over ``n >= 2`` whole nodes (exposed NIC
  transfers included, over every NIC when routing) beats a ring on one node; ``n`` is the fewest
  nodes whose per-rank time fits one GPU's share, else the fastest (with explicit thresholds:
  at least ``T_inter`` long and more attention than a node's share of the batch's attention);
* **intra-node** when it cannot fit one GPU, or when it is at least ``T_intra`` long and its
  work exceeds half a GPU's fair share, or (automatic thresholds only) when its work exceeds
  twice a GPU's share, which unbalances its GPU more than a ring's unhidden NVLink steps cost;
* **local** otherwise: the whole document on one GPU.

Work and the tier rules grow with length, so a longer document never lands in a lower tier
than a shorter one (see ``thresholds.py`` for ``T_intra < T_inter``).

Level 1 (across nodes). Inter-node documents, longest first, take ``n`` consecutive nodes. The
window of nodes with the lowest peak load and room wins (ties: leftmost). The ring visits the
nodes in order and all GPUs of each node, so it has exactly ``n`` cross-node edges; each document
starts its in-node order at another GPU so the cross-node edges of different documents leave from
different GPUs (and NICs). The other documents go to nodes by greedy LPT (longest processing time
first) on work; a node keeps a small token reserve while any other node has room, so its GPUs can
still pack documents whole.

Level 2 (inside each node). Intra-node documents, longest first, take a ring of the
least-loaded GPUs with room. The ring size (any size from what capacity needs to the node's GPUs,
but no larger than keeps each chunk above the NVLink chunk threshold) is the one whose busiest
member would finish first (``Loads.ring_finish``). Local documents then go by LPT to the
least-loaded GPU with room, counting the shares GPUs already carry from inter-node rings.

Tight capacity. A local document that finds no GPU with room becomes a ring (counted in
``meta["capacity_promotions"]``: the one case that can break the tier order). A node whose
documents do not fit is placed again with local documents on the GPU with the most room, then
with every ring over all its GPUs, handing what still does not fit to other nodes. If placement
still runs out of room, the whole batch is planned again splitting only what capacity forces
(``meta["fallback"]``). A ``ValueError`` then means the batch truly cannot be placed.

Zigzag chunks come from ``zigzag_spans``; the 2-D scheme for the inter-node documents the cost
model predicts faster with it from ``schemes.py``; the linear layout from ``linear_layout.py``
(the candidate the cost model predicts fastest); routing of cross-node ring edges from
``routing.py``.
Everything iterates lists and sorted keys, so the same input always gives the same plan.
"""

from __future__ import annotations

import gc
import heapq
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from megatron_zeppelin.planner.costmodel import CostModel
from megatron_zeppelin.planner.linear_layout import (
    LAYOUTS,
    attention_ranges_by_rank,
    choose_linear_layout,
    moved_tokens,
)
from megatron_zeppelin.planner.loads import Loads, min_ring, position_tokens
from megatron_zeppelin.planner.plan import (
    Plan,
    SequencePlan,
    Span,
    Tier,
    zigzag_spans,
)
from megatron_zeppelin.planner.routing import build_routes
from megatron_zeppelin.planner.schemes import choose_schemes
from megatron_zeppelin.planner.thresholds import (
    attention_costs,
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
    """Move tokens for the linear modules where the cost model says it pays (see
    ``linear_layout``). ``False``: the linear layout is the attention layout."""
    linear_layout: str = "auto"
    """With ``remap``: ``"auto"`` (the fastest predicted of ``attention``, ``node``, ``even``) or
    one of those three forced."""
    two_d: bool = True
    """Let the cost model run inter-node documents with their heads split inside each node and
    one ring per rail across nodes (``schemes.py``). ``False``: every ring is flat."""

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


_SPLIT_SHARE = 0.5
"""A document at least ``T_intra`` long is split once its work passes this fraction of a GPU's
fair share: greedy packing finishes within one item of the optimum, so items of half a share or
more leave GPUs visibly uneven."""
_MIN_BALANCE_CHUNK = 64
"""Tokens per zigzag chunk below which no document is split for balance alone."""


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


class CapacityError(ValueError):
    """The placement ran out of room on the GPUs it tried (not a bad input)."""


def _capacity_error(doc: int, length: int, where: str) -> ValueError:
    return CapacityError(
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
        try:
            return _plan_batch(lengths, topology, cost_model, capacity, options)
        except CapacityError:
            # Balance splits and cross-node rings can fragment a tight cluster; plan again
            # splitting only what capacity forces (every GPU then keeps the most room).
            options = options or PlannerOptions()
            if not options.allow_split:
                raise
            plan = _plan_batch(
                lengths, topology, cost_model, capacity, replace(options, allow_split=False)
            )
            plan.meta["fallback"] = "capacity: balance splits off"
            return plan


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
    if options.linear_layout != "auto" and options.linear_layout not in LAYOUTS:
        raise ValueError(
            f"linear_layout must be 'auto' or one of {', '.join(LAYOUTS)}, got "
            f"{options.linear_layout!r}"
        )
    intra_threshold, inter_threshold = options.resolved_thresholds(cost_model)
    k, num_nodes = topology.gpus_per_node, topology.num_nodes
    num_links = topology.nics_per_node if options.routing else 1
    loads = Loads(topology, capacity, cost_model, num_links, two_d=options.two_d)
    # A document's work on one GPU: its attention plus its tokens' linear modules.
    work = attention_costs(cost_model, array) + loads.token_weight * array
    total_work = float(work.sum())
    node_share, gpu_share = total_work / num_nodes, total_work / topology.world_size
    nvlink_chunk = max(1, intra_threshold // 2)
    nic_chunk = max(1, inter_threshold // 2)
    if options.routing:  # routed, one cross-node edge uses every NIC of its node
        nic_chunk = max(1, math.ceil(nic_chunk / topology.nics_per_node))

    # Tiers (vectorized). Zigzag rounding may put a token or two more than
    # L/g on a rank, so documents near a node's capacity are checked exactly.
    split = array > capacity
    inter = array > capacity * k
    for doc in np.flatnonzero(~inter & (array > (capacity - 2) * k)).tolist():
        inter[doc] = (min_ring(int(array[doc]), capacity) or k + 1) > k
    if options.allow_split:
        split |= (array >= intra_threshold) & (work > _SPLIT_SHARE * gpu_share)
        # A document worth several GPUs' shares unbalances whichever GPU holds it whole; an
        # NVLink ring that does not quite hide its transfers costs less than that (few documents
        # per GPU: large clusters, small micro-batches).
        # Explicit thresholds are the user's word and stay as given.
        if options.thresholds == "auto":
            split |= (array >= 2 * min(nvlink_chunk, _MIN_BALANCE_CHUNK)) & (work > 2 * gpu_share)
    if num_nodes == 1:
        inter[:] = False
    # Documents no node can balance go across nodes when the cost model says the cross-node
    # ring (its exposed NIC transfers included) beats a ring on one node.
    wanted_nodes: dict[int, int] = {}
    if num_nodes > 1:
        candidates = options.allow_split & (work > node_share)
        if options.thresholds != "auto":
            # Explicit thresholds keep the paper's rule: at least ``T_inter`` long and more
            # attention than one node's share of the batch's attention.
            attention = work - loads.token_weight * array
            candidates = options.allow_split & (array >= inter_threshold)
            candidates &= attention > attention.sum() / num_nodes
        for doc in np.flatnonzero(inter | candidates).tolist():
            length, best = int(array[doc]), 2
            if options.allow_split and options.thresholds == "auto":
                best = loads.best_num_nodes(length, gpu_share, num_links)
            elif options.allow_split:  # explicit thresholds: the user's word, no cost veto
                by_share = math.ceil(float(work[doc]) / node_share)
                best = max(2, min(by_share, length // (k * nic_chunk), num_nodes))
            if best > 1 or inter[doc]:
                inter[doc] = True
                wanted_nodes[doc] = max(2, best)
    rings: list[tuple[int, ...] | None] = [None] * len(array)
    meta_promotions = 0

    # --- level 1: inter-node rings on consecutive nodes ----------------------------------------
    inter_docs = sorted(np.flatnonzero(inter).tolist(), key=lambda d: (-int(array[d]), d))
    for order, doc in enumerate(inter_docs):
        rings[doc] = _place_inter(doc, int(array[doc]), wanted_nodes[doc], order, loads)

    # Everything else goes to nodes by LPT on work; a node's load counts its inter-node shares.
    by_node: list[list[int]] = [[] for _ in range(num_nodes)]
    assigned_key, assigned_tokens = [0.0] * num_nodes, [0] * num_nodes
    node_tokens = [0] * num_nodes
    heap: list[tuple[float, int]] = []

    def refresh_nodes() -> None:
        """Node loads: their GPUs' inter-node shares plus the documents given to them so far."""
        heap.clear()
        for n in range(num_nodes):
            ranks = topology.ranks_of_node(n)
            node_tokens[n] = sum(loads.tokens[r] for r in ranks) + assigned_tokens[n]
            cost = sum(loads.cost[r] for r in ranks) + assigned_key[n]
            heap.append((cost, n))
        heapq.heapify(heap)

    refresh_nodes()
    rest = np.flatnonzero(~inter)
    key = work[rest]
    node_room = capacity * k
    # Filling a node to the last token leaves its GPUs no room to pack documents whole: nodes
    # keep a small reserve while any other node has room, and give it up only when none has.
    reserve = min(node_room // 32, 4 * int(array.max()))
    for idx in np.lexsort((rest, -key)).tolist():
        doc, length = int(rest[idx]), int(array[rest[idx]])
        # A ring's zigzag rounding may put a token more than L/g on a GPU: leave a little slack.
        needed = length + 2 * k if split[doc] else length
        skipped = []
        while heap and node_room - node_tokens[heap[0][1]] < needed + reserve:
            skipped.append(heapq.heappop(heap))
        if not heap:
            for item in skipped:
                heapq.heappush(heap, item)
            skipped = []
            while heap and node_room - node_tokens[heap[0][1]] < needed:
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
    spread = np.full(len(array), k, dtype=np.int64)
    overflow: list[int] = []
    for node in range(num_nodes):
        ranks = list(topology.ranks_of_node(node))
        saved = [(loads.cost[r], loads.attention[r], loads.tokens[r]) for r in ranks]
        # Fragmentation under tight capacity: start the node again with local documents on the
        # GPU with the most room, then also with every ring spread over all its GPUs (the
        # layout that leaves the most room on each), giving up leftovers to other nodes.
        for attempt in range(3):
            if attempt:
                for r, (cost, attention, tokens) in zip(ranks, saved):
                    loads.cost[r], loads.attention[r], loads.tokens[r] = cost, attention, tokens
            try:
                meta_promotions += _place_node(
                    by_node[node], ranks, array, split,
                    k if attempt == 2 else 2, spread if attempt == 2 else largest,
                    loads, rings, by_room=attempt > 0, overflow=overflow if attempt == 2 else None,
                )  # fmt: skip
                break
            except ValueError:
                assert attempt < 2, "the last attempt hands leftovers on instead of failing"
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
    loads: Loads,
    rings: list[tuple[int, ...] | None],
    *,
    by_room: bool = False,
    overflow: list[int] | None = None,
) -> int:
    """Level 2 on one node: rings first (longest first), then local documents by LPT. Returns
    how many local documents had to become rings for lack of room.

    With ``by_room`` (a retry under tight capacity), local documents go to the GPU with the
    most room instead (worst fit, which keeps tokens even); with ``overflow``, documents that
    still find no room are appended to it instead of failing."""

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
    # Heap keys: predicted load (attention plus linear seconds), or tokens alone.
    key_of = loads.tokens if by_room else loads.cost
    heap = [(key_of[r], r) for r in ranks]
    heapq.heapify(heap)
    tokens_of = loads.tokens
    capacity = loads.capacity
    for doc in local:
        length = int(array[doc])
        skipped = []
        while heap and capacity - tokens_of[heap[0][1]] < length:
            skipped.append(heapq.heappop(heap))
        if heap:
            _, rank = heapq.heappop(heap)
            loads.add_local(rank, length)
            rings[doc] = (rank,)
            heapq.heappush(heap, (key_of[rank], rank))
            for item in skipped:
                heapq.heappush(heap, item)
        else:  # no GPU has room for it whole: a ring of the GPUs with room
            rings[doc] = ring(doc, length)
            promotions += rings[doc] is not None
            heap = [(key_of[r], r) for r in ranks]
            heapq.heapify(heap)
    return promotions


def _place_anywhere(doc: int, length: int, loads: Loads) -> tuple[int, ...]:
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
    loads: Loads,
    reserved: list[int] | None = None,
) -> tuple[int, ...]:
    """Ring over consecutive nodes (all their GPUs) with the lowest peak load that has room;
    ``reserved`` counts per node the tokens of documents already given to it but not yet placed
    on its GPUs."""
    topo = loads.topology
    k, num_nodes = topo.gpus_per_node, topo.num_nodes
    need = min_ring(length, loads.capacity, start=wanted_nodes * k, multiple=k)
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
    doc: int, length: int, smallest: int, largest: int, ranks: list[int], loads: Loads
) -> tuple[int, ...]:
    """Ring of the least-loaded GPUs of one node that have room, in local-index order.

    Among ring sizes ``smallest..largest`` (more if capacity needs them), the one whose busiest
    member finishes first wins: ``g`` least-loaded GPUs end at ``load_g + ring_seconds(g)``, and
    bigger rings trade shorter per-rank work for less efficient chunks and more steps. When no
    such ring has room, smaller rings are tried (a full GPU cannot join any ring).
    """
    k = len(ranks)
    node = loads.topology.node_of(ranks[0])
    start = min_ring(length, loads.capacity, start=min(smallest, k))
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
        finish = max(loads.load(r) for r in chosen) + loads.ring_finish(length, g, "nvlink")
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
    loads: Loads,
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
    if options.two_d:  # before routing and the linear layout, which read the rings
        sequences = list(choose_schemes(sequences, topology, cost_model, routing=options.routing))
    by_rank = attention_ranges_by_rank(sequences, topology.world_size)
    if not options.remap:
        candidates: tuple[str, ...] = ("attention",)
    elif options.linear_layout == "auto":
        candidates = LAYOUTS
    else:
        candidates = (options.linear_layout,)
    linear, moves, layout, predicted = choose_linear_layout(
        by_rank, topology, cost_model, loads.attention, candidates=candidates
    )
    routes = build_routes(sequences, topology) if options.routing else ()
    cost = np.asarray(loads.attention)
    work = np.asarray(loads.cost)
    tokens = np.asarray(loads.tokens)
    counts = {t.value: 0 for t in Tier}
    for seq in sequences:
        counts[seq.tier.value] += 1
    meta = {
        **meta,
        "tier_counts": counts,
        "max_ring_size": max(len(r) for r in rings),  # type: ignore[arg-type]
        "attention_imbalance": float(cost.max() / cost.mean()) if cost.mean() > 0 else 1.0,
        "load_imbalance": float(work.max() / work.mean()),
        "attention_token_imbalance": float(tokens.max() / tokens.mean()),
        "linear_layout": layout,
        "linear_layout_seconds": predicted,
        "remap_tokens": moved_tokens(moves, topology),
        "num_routes": len(routes),
        "two_d_documents": sum(seq.is_two_d for seq in sequences),
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
