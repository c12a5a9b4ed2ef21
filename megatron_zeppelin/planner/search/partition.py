"""Zeppelin's hierarchical sequence partitioning: lengths + topology + cost model -> ``Plan``.

The objective is the step the engine runs, ``steptime.layer_seconds``: without a remapping a
layer takes ``max(linear + attention)`` over GPUs, with one ``max(linear) + remap +
max(attention)``, where a GPU's attention counts the ring transfers its compute cannot hide.
``search.py`` builds several placements (balancing attention plus linear work, or attention
alone with the linear layout evening the tokens; more documents as rings where whole documents
leave the busiest GPU above the mean; in-node rings packed or wide), prices each under every
allowed linear layout, and keeps the fastest, timed by the simulator where several are close.

Every placement runs three stages. **Tiers** (``tiers.assign_tiers``):

* **inter-node** when a document cannot fit one node (capacity), or when its balanced work
  exceeds one node's fair share and the cost model predicts that a ring over ``n >= 2`` whole
  nodes ends the step sooner than a ring on one node (``Loads.best_num_nodes``: the ring's
  per-rank time against the rest of the batch spread around it; where the rings together want
  more nodes than there are, ``tiers.share_nodes`` shares them out; with explicit thresholds: at
  least ``T_inter`` long and more attention than a node's share of the batch's attention);
* **intra-node** when it cannot fit one GPU, or when it is at least ``T_intra`` long and its
  work exceeds half a GPU's fair share, or (automatic thresholds only) when its work exceeds
  twice a GPU's share; the search may add the longest local documents (module ``search``);
* **local** otherwise: the whole document on one GPU.

Work and the tier rules grow with length, and the search adds rings longest first, so a longer
document never lands in a lower tier than a shorter one (see ``thresholds.py`` for
``T_intra < T_inter``).

**Across nodes** (``placement.place_across_nodes``). Inter-node documents, longest first, take
``n`` consecutive nodes: the window with the lowest peak load and room (ties: leftmost). The
ring visits the nodes in order and all GPUs of each node, so it has exactly ``n`` cross-node
edges; each document starts its in-node order at another GPU so the cross-node edges of
different documents leave from different GPUs (and NICs). The other documents go to nodes by
greedy LPT on what they will cost there (a ring's members' total); a node keeps a small token
reserve while any other node has room, so its GPUs can still pack documents whole.

**Within nodes** (``within_nodes.place_within_nodes``). Intra-node documents, longest first, take a
ring of the least-loaded GPUs with room: the smallest that ends within the node's mean, or the
one that ends soonest (no larger than keeps each chunk above the NVLink chunk threshold). Local
documents then go by LPT to the least-loaded GPU with room, counting the shares GPUs already
carry from inter-node rings.

Tight capacity. A local document that finds no GPU with room becomes a ring (counted in
``meta["capacity_promotions"]``: the one case that can break the tier order). A node whose
documents do not fit is placed again with local documents on the GPU with the most room, then
with every ring over all its GPUs, handing what still does not fit to other nodes. If placement
still runs out of room, the batch is planned again splitting only what capacity forces, and as
a last resort every GPU is filled to the same token count (``spread.py``;
``meta["fallback"]`` says which). Every batch that fits the cluster is planned; a ``ValueError``
means it does not (a document or the batch over ``capacity x GPUs``).

Zigzag chunks come from ``zigzag_spans``; the 2-D scheme, for the inter-node documents the cost
model predicts faster with it, from ``schemes.py`` (``Loads.rank_share`` prices both while
placing); the linear layout from ``linear_layout.py``; routing of cross-node ring edges from
``routing.py``. Everything iterates lists and sorted keys, so the same input always gives the
same plan.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import product
from operator import attrgetter

import numpy as np

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.thresholds import tier_thresholds
from megatron_zeppelin.planner.loops import (
    jit,
    local_changes,
    node_lpt,
    node_rings,
    ring_line,
    ring_search,
    shares_line,
    whole_docs,
)
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import CapacityError
from megatron_zeppelin.planner.place.tiers import TierRules, chunk_thresholds
from megatron_zeppelin.planner.plan.linear_layout import (
    LAYOUTS,
    attention_layout,
    attention_ranges_by_rank,
    build_linear_layout,
    moved_tokens,
)
from megatron_zeppelin.planner.plan.plan import Plan, Scheme, Tier
from megatron_zeppelin.planner.search.search import Candidate, search
from megatron_zeppelin.planner.search.spread import spread_evenly, wide_choices
from megatron_zeppelin.topology.model import Topology

__all__ = [
    "CapacityError",
    "PlannerOptions",
    "collector_paused",
    "plan_batch",
    "tier_thresholds",
    "warm",
]


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
    pool: bool = True
    """Also try the placement over the GPUs as one pool (``pool.py``: rings sized to the mean
    load on any GPUs, across nodes over part of a node's GPUs too). ``False``: only the staged
    placement (whole nodes for a ring across nodes)."""

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


def _check_inputs(lengths: Sequence[int], topology: Topology, capacity: int) -> np.ndarray:
    if len(lengths) == 0:
        raise ValueError("the batch is empty: give at least one document length")
    if not _plain_lengths(lengths):
        for i, length in enumerate(lengths):
            if not isinstance(length, (int, np.integer)) or isinstance(length, bool) or length < 1:
                raise ValueError(
                    f"document {i} has length {length!r}; lengths must be integers >= 1"
                )
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


def _plain_lengths(lengths: Sequence[int]) -> bool:
    """Whether ``lengths`` are integers >= 1 (no bools), told at array speed where it can be:
    an integer array, or a list of plain ints. ``False`` means: check them one by one."""
    if isinstance(lengths, np.ndarray):
        array = lengths
    elif type(lengths) in (list, tuple) and set(map(type, lengths)) == {int}:
        try:
            array = np.asarray(lengths, dtype=np.int64)
        except OverflowError:
            return False
    else:
        return False
    return array.ndim == 1 and array.dtype.kind in "iu" and bool((array >= 1).all())


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block. A plan is thousands of small
    acyclic objects (millions at 10^4 documents on 10^3 GPUs): the collector's passes over them
    while they are built and simulated cost more than the planning itself and find nothing to
    free (``zeppelin compare`` uses it per builder too; docs/BENCHMARKS.md)."""
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
    with collector_paused():
        try:
            return _plan(array, topology, cost_model, capacity, options, thresholds)
        except CapacityError:
            pass
        # Balance splits and cross-node rings can fragment a tight cluster; plan again
        # splitting only what capacity forces (every GPU then keeps the most room).
        if options.allow_split:
            try:
                plan = _plan(
                    array,
                    topology,
                    cost_model,
                    capacity,
                    replace(options, allow_split=False),
                    thresholds,
                )
                plan.meta["fallback"] = "capacity: balance splits off"
                return plan
            except CapacityError:
                pass
        return _spread_plan(array, topology, cost_model, capacity, options, thresholds)


def _spread_plan(
    array: np.ndarray,
    topology: Topology,
    cost_model: CostModel,
    capacity: int,
    options: PlannerOptions,
    thresholds: tuple[int, int],
) -> Plan:
    """The last resort (``spread.py``): always fits a batch that fits the cluster. Tries a few
    counts of longest documents over every GPU, the others in both orders, and keeps the fastest
    by the simulator."""
    nics = topology.nics_per_node if options.routing else 1
    best = None
    for wide, deal in product(wide_choices(array, topology.world_size), (True, False)):
        loads = Loads(topology, capacity, cost_model, nics)
        candidate = spread_evenly(array, loads, wide, deal)
        candidate.build(array, options.routing)
        candidate.simulate(("attention",))
        if best is None or candidate.seconds < best.seconds:
            best, best_wide = candidate, wide
    assert best is not None
    meta = {
        "thresholds": list(thresholds),
        "capacity_promotions": 0,
        "candidates": [],
        "fallback": "capacity: every GPU filled evenly"
        + (f", the {best_wide} longest documents over every GPU" if best_wide else ""),
        "spread_wide": best_wide,
    }
    return _assemble(best, cost_model, meta)


def _plan(
    array: np.ndarray,
    topology: Topology,
    cost_model: CostModel,
    capacity: int,
    options: PlannerOptions,
    thresholds: tuple[int, int],
) -> Plan:
    """The fastest of the candidate placements (``search``), assembled into a plan."""
    chunks = chunk_thresholds(thresholds, topology, options.routing)
    rules = TierRules(options.allow_split, options.thresholds == "auto", thresholds, chunks)
    num_links = topology.nics_per_node if options.routing else 1
    shares: dict[bool, dict] = {False: {}, True: {}}  # rank shares, with and without 2-D
    keys: dict[tuple[bool, bool], dict] = {}  # ring keys, by balance mode and 2-D
    best, tried, least = search(
        array,
        lambda balance_linear, two_d: Loads(
            topology,
            capacity,
            cost_model,
            num_links,
            balance_linear=balance_linear,
            two_d=two_d and options.two_d,
            shares=shares[two_d and options.two_d],
            keys=keys.setdefault((balance_linear, two_d and options.two_d), {}),
        ),
        rules,
        _layout_candidates(options),
        routing=options.routing,
        pool=options.pool,
    )
    meta = {
        "thresholds": list(thresholds),
        "chunk_thresholds": {"nvlink": chunks[0], "nic": chunks[1]},
        "capacity_promotions": best.promotions,
        "candidates": tried,
        "least_load_s": least,
    }
    return _assemble(best, cost_model, meta)


def _layout_candidates(options: PlannerOptions) -> tuple[str, ...]:
    if not options.remap:
        return ("attention",)
    return LAYOUTS if options.linear_layout == "auto" else (options.linear_layout,)


# --- the plan ------------------------------------------------------------------------------------
def _assemble(best: Candidate, cost_model: CostModel, meta: dict) -> Plan:
    loads = best.loads
    topology = loads.topology
    tokens = np.asarray(loads.tokens, dtype=np.float64)
    layout, sequences = best.layout, best.all_sequences()
    if layout == "attention":  # nothing moves
        linear, moves = attention_layout(sequences, topology.world_size), {}
    else:
        by_rank = attention_ranges_by_rank(sequences, topology.world_size)
        linear, moves = build_linear_layout(by_rank, topology, layout)
    tiers = Counter(map(attrgetter("tier"), best.placements))
    counts = {t.value: tiers[t] for t in Tier}
    meta = {
        **meta,
        "balance": best.balance,
        "placement": best.placement,
        "tier_counts": counts,
        "max_ring_size": max(map(len, map(attrgetter("ring"), best.placements))),
        "attention_imbalance": _imbalance(best.attention_s),
        "load_imbalance": _imbalance(best.attention_s + cost_model.linear_times(tokens)),
        "attention_token_imbalance": _imbalance(tokens),
        "linear_layout": layout,
        "linear_layout_seconds": best.every_layout(),
        "predicted_step_s": cost_model.model.num_layers * best.seconds,
        "timed_by": "simulator" if best.timed else "planner estimate",
        "remap_tokens": moved_tokens(moves, topology),
        "num_routes": len(best.routes),
        "two_d_documents": list(map(attrgetter("scheme"), sequences)).count(Scheme.TWO_D),
        "cost_sources": dict(cost_model.sources),
    }
    return Plan(
        topology=topology,
        sequences=sequences,
        linear=linear,
        routes=best.routes,
        capacity=loads.capacity,
        name="zeppelin",
        meta=meta,
    )


def _imbalance(values: np.ndarray) -> float:
    mean = float(values.mean())
    return float(values.max()) / mean if mean > 0 else 1.0


def warm() -> bool:
    """The planner's compiled loops (``planner/loops/``) built, or read from numba's cache, now
    and not in the first plan: a planner process calls this before it says it is ready (seconds
    the first time in an environment, about one after). Whether numba runs them."""
    if not jit.enabled():
        return False
    loops = (local_changes, node_lpt, node_rings, ring_line, ring_search, shares_line, whole_docs)
    for module in loops:
        module.warm()
    return True
