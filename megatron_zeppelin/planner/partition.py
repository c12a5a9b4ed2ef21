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

The stages: ``assign_tiers`` (here), ``place_across_nodes`` and ``place_within_nodes``
(``placement.py``), then ``_assemble``. Zigzag chunks come from ``zigzag_spans``; the linear
layout from ``linear_layout.py`` (the candidate the cost model predicts fastest); routing of
cross-node ring edges from ``routing.py``.
Everything iterates lists and sorted keys, so the same input always gives the same plan.
"""

from __future__ import annotations

import gc
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
from megatron_zeppelin.planner.loads import Loads, min_ring
from megatron_zeppelin.planner.placement import (
    CapacityError,
    Placement,
    TierChoice,
    place_across_nodes,
    place_within_nodes,
)
from megatron_zeppelin.planner.plan import Plan, SequencePlan, Span, Tier, zigzag_spans
from megatron_zeppelin.planner.routing import build_routes
from megatron_zeppelin.planner.thresholds import attention_costs, tier_thresholds
from megatron_zeppelin.topology.model import Topology

__all__ = ["CapacityError", "PlannerOptions", "plan_batch", "tier_thresholds"]


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
    thresholds = options.resolved_thresholds(cost_model)
    with _collector_paused():
        try:
            return _plan(array, topology, cost_model, capacity, options, thresholds)
        except CapacityError:
            # Balance splits and cross-node rings can fragment a tight cluster; plan again
            # splitting only what capacity forces (every GPU then keeps the most room).
            if not options.allow_split:
                raise
            options = replace(options, allow_split=False)
            plan = _plan(array, topology, cost_model, capacity, options, thresholds)
            plan.meta["fallback"] = "capacity: balance splits off"
            return plan


def _plan(
    array: np.ndarray,
    topology: Topology,
    cost_model: CostModel,
    capacity: int,
    options: PlannerOptions,
    thresholds: tuple[int, int],
) -> Plan:
    """The three stages, then the plan around their placements."""
    num_links = topology.nics_per_node if options.routing else 1
    loads = Loads(topology, capacity, cost_model, num_links)
    chunks = _chunk_thresholds(thresholds, topology, options.routing)
    choice = assign_tiers(array, loads, options, chunks)
    placements: list[Placement | None] = [None] * len(array)
    by_node, promotions = place_across_nodes(array, choice, loads, placements)
    promotions += place_within_nodes(array, choice, by_node, loads, placements)
    meta = {
        "thresholds": list(thresholds),
        "chunk_thresholds": {"nvlink": chunks[0], "nic": chunks[1]},
        "capacity_promotions": promotions,
    }
    return _assemble(array, placements, cost_model, capacity, options, loads, meta)


def _chunk_thresholds(
    thresholds: tuple[int, int], topology: Topology, routing: bool
) -> tuple[int, int]:
    """Per-rank chunk (tokens) below which a ring on NVLink, and across NICs, stops hiding its
    transfers: half the tier threshold (a two-rank ring), over every NIC when routed."""
    nvlink_chunk = max(1, thresholds[0] // 2)
    nic_chunk = max(1, thresholds[1] // 2)
    if routing:  # routed, one cross-node edge uses every NIC of its node
        nic_chunk = max(1, math.ceil(nic_chunk / topology.nics_per_node))
    return nvlink_chunk, nic_chunk


# --- stage 1: tiers --------------------------------------------------------------------------
def assign_tiers(
    array: np.ndarray, loads: Loads, options: PlannerOptions, chunks: tuple[int, int]
) -> TierChoice:
    """Every document's tier (module docstring), vectorized over the batch."""
    topology = loads.topology
    # A document's work on one GPU: its attention plus its tokens' linear modules.
    work = attention_costs(loads.cost_model, array) + loads.token_weight * array
    split, inter = _capacity_splits(array, loads.capacity, topology.gpus_per_node)
    if options.allow_split:
        split |= _balance_splits(array, work, options, topology, chunks[0])
    if topology.num_nodes == 1:
        inter[:] = False
    wanted_nodes = _inter_node_choices(array, work, inter, loads, options, chunks[1])
    largest = np.full(len(array), 2, dtype=np.int64)
    if options.allow_split:  # rings stay small enough that every chunk hides its transfer
        largest = np.maximum(2, np.minimum(topology.gpus_per_node, array // chunks[0]))
    return TierChoice(work, split, inter, wanted_nodes, largest)


def _capacity_splits(
    array: np.ndarray, capacity: int, gpus_per_node: int
) -> tuple[np.ndarray, np.ndarray]:
    """Documents that fit no GPU (``split``) and no node (``inter``). Zigzag rounding may put
    a token or two more than ``L/g`` on a rank, so documents near a node's capacity are checked
    exactly."""
    k = gpus_per_node
    split = array > capacity
    inter = array > capacity * k
    for doc in np.flatnonzero(~inter & (array > (capacity - 2) * k)).tolist():
        inter[doc] = (min_ring(int(array[doc]), capacity) or k + 1) > k
    return split, inter


def _balance_splits(
    array: np.ndarray,
    work: np.ndarray,
    options: PlannerOptions,
    topology: Topology,
    nvlink_chunk: int,
) -> np.ndarray:
    """Documents worth a ring for balance: at least ``T_intra`` long with more than half a GPU's
    share of work; with automatic thresholds also any document worth two GPUs' shares, which
    unbalances whichever GPU holds it whole more than an NVLink ring that does not quite hide
    its transfers costs (few documents per GPU: large clusters, small micro-batches). Explicit
    thresholds are the user's word and stay as given."""
    gpu_share = float(work.sum()) / topology.world_size
    intra_threshold = 2 * nvlink_chunk
    split = (array >= intra_threshold) & (work > _SPLIT_SHARE * gpu_share)
    if options.thresholds == "auto":
        split |= (array >= 2 * min(nvlink_chunk, _MIN_BALANCE_CHUNK)) & (work > 2 * gpu_share)
    return split


def _inter_node_choices(
    array: np.ndarray,
    work: np.ndarray,
    inter: np.ndarray,
    loads: Loads,
    options: PlannerOptions,
    nic_chunk: int,
) -> dict[int, int]:
    """Documents no node can balance go across nodes when the cost model says the cross-node
    ring (its exposed NIC transfers included) beats a ring on one node; marks them in ``inter``
    and returns how many nodes each ring spans."""
    topology = loads.topology
    k, num_nodes = topology.gpus_per_node, topology.num_nodes
    wanted_nodes: dict[int, int] = {}
    if num_nodes == 1:
        return wanted_nodes
    node_share = float(work.sum()) / num_nodes
    gpu_share = float(work.sum()) / topology.world_size
    auto = options.thresholds == "auto"
    candidates = options.allow_split & (work > node_share)
    if not auto:
        # Explicit thresholds keep the paper's rule: at least ``T_inter`` long and more
        # attention than one node's share of the batch's attention.
        inter_threshold = options.resolved_thresholds(loads.cost_model)[1]
        attention = work - loads.token_weight * array
        candidates = options.allow_split & (array >= inter_threshold)
        candidates &= attention > attention.sum() / num_nodes
    for doc in np.flatnonzero(inter | candidates).tolist():
        length, best = int(array[doc]), 2
        if options.allow_split and auto:
            best = loads.best_num_nodes(length, gpu_share, loads.num_links)
        elif options.allow_split:  # explicit thresholds: the user's word, no cost veto
            by_share = math.ceil(float(work[doc]) / node_share)
            best = max(2, min(by_share, length // (k * nic_chunk), num_nodes))
        if best > 1 or inter[doc]:
            inter[doc] = True
            wanted_nodes[doc] = max(2, best)
    return wanted_nodes


# --- the plan ------------------------------------------------------------------------------------
def _assemble(
    array: np.ndarray,
    placements: list[Placement | None],
    cost_model: CostModel,
    capacity: int,
    options: PlannerOptions,
    loads: Loads,
    meta: dict,
) -> Plan:
    topology = loads.topology
    sequences = []
    for doc, placement in enumerate(placements):
        assert placement is not None, doc
        length, ring = int(array[doc]), placement.ring
        spans = (Span(ring[0], 0, length),) if len(ring) == 1 else zigzag_spans(length, ring)
        sequences.append(SequencePlan(doc, length, placement.tier, ring, spans))
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
    for placement in placements:
        counts[placement.tier.value] += 1  # type: ignore[union-attr]
    meta = {
        **meta,
        "tier_counts": counts,
        "max_ring_size": max(len(p.ring) for p in placements),  # type: ignore[union-attr]
        "attention_imbalance": float(cost.max() / cost.mean()) if cost.mean() > 0 else 1.0,
        "load_imbalance": float(work.max() / work.mean()),
        "attention_token_imbalance": float(tokens.max() / tokens.mean()),
        "linear_layout": layout,
        "linear_layout_seconds": predicted,
        "remap_tokens": moved_tokens(moves, topology),
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
