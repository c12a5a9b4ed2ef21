"""Stage 1 of the planner: every document's tier, from its length, its work and the cost model.

See ``partition`` for the rules. Vectorized over the batch: the planner runs every step for
thousands of documents.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.planner.cost.thresholds import attention_costs
from megatron_zeppelin.planner.place.loads import Loads, min_ring
from megatron_zeppelin.planner.place.placement import TierChoice
from megatron_zeppelin.topology.model import Topology

__all__ = ["TierRules", "assign_tiers", "chunk_thresholds"]

_SPLIT_SHARE = 0.5
"""A document at least ``T_intra`` long is split once its work passes this fraction of a GPU's
fair share: greedy packing finishes within one item of the optimum, so items of half a share or
more leave GPUs visibly uneven."""
_MIN_BALANCE_CHUNK = 64
"""Tokens per zigzag chunk below which no document is split for balance alone."""


@dataclass(frozen=True)
class TierRules:
    """What stage 1 needs of the planner's options."""

    allow_split: bool
    """Split for balance; ``False``: only what capacity forces."""
    auto: bool
    """Thresholds from the cost model (``True``) or the user's (explicit, kept as given)."""
    thresholds: tuple[int, int]
    """``(T_intra, T_inter)`` in tokens."""
    chunks: tuple[int, int]
    """Per-rank chunk thresholds on NVLink and across NICs (``chunk_thresholds``)."""


def chunk_thresholds(
    thresholds: tuple[int, int], topology: Topology, routing: bool
) -> tuple[int, int]:
    """Per-rank chunk (tokens) below which a ring on NVLink, and across NICs, stops hiding its
    transfers: half the tier threshold (a two-rank ring), over every NIC when routed."""
    nvlink_chunk = max(1, thresholds[0] // 2)
    nic_chunk = max(1, thresholds[1] // 2)
    if routing:  # routed, one cross-node edge uses every NIC of its node
        nic_chunk = max(1, math.ceil(nic_chunk / topology.nics_per_node))
    return nvlink_chunk, nic_chunk


def assign_tiers(array: np.ndarray, loads: Loads, rules: TierRules) -> TierChoice:
    """Every document's tier (``partition``'s docstring), vectorized over the batch."""
    topology = loads.topology
    # A document's work on one GPU: its attention plus its tokens' linear modules; what is
    # balanced: the same, or its attention alone (``Loads.balance_linear``).
    attention = attention_costs(loads.cost_model, array)
    work = attention + loads.token_weight * array
    balanced = attention + loads.linear_weight * array
    split, inter = _capacity_splits(array, loads.capacity, topology.gpus_per_node)
    if rules.allow_split:
        split |= _balance_splits(array, balanced, rules, topology)
    if topology.num_nodes == 1:
        inter[:] = False
    wanted_nodes = _inter_node_choices(array, balanced, attention, inter, loads, rules)
    largest = np.full(len(array), 2, dtype=np.int64)
    if rules.allow_split:  # rings stay small enough that every chunk hides its transfer
        largest = np.maximum(2, np.minimum(topology.gpus_per_node, array // rules.chunks[0]))
    # Automatic thresholds only: explicit ones are the user's word.
    splittable = ~split & ~inter & (rules.allow_split and rules.auto)
    splittable &= array >= 2 * min(rules.chunks[0], _MIN_BALANCE_CHUNK)
    return TierChoice(work, attention, split, inter, wanted_nodes, largest, splittable)


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
    array: np.ndarray, work: np.ndarray, rules: TierRules, topology: Topology
) -> np.ndarray:
    """Documents worth a ring for balance: at least ``T_intra`` long with more than half a GPU's
    share of work; with automatic thresholds also any document worth two GPUs' shares, which
    unbalances whichever GPU holds it whole more than an NVLink ring that does not quite hide
    its transfers costs (few documents per GPU: large clusters, small micro-batches). Explicit
    thresholds are the user's word and stay as given."""
    gpu_share = float(work.sum()) / topology.world_size
    nvlink_chunk = rules.chunks[0]
    split = (array >= 2 * nvlink_chunk) & (work > _SPLIT_SHARE * gpu_share)
    if rules.auto:
        split |= (array >= 2 * min(nvlink_chunk, _MIN_BALANCE_CHUNK)) & (work > 2 * gpu_share)
    return split


def _inter_node_choices(
    array: np.ndarray,
    work: np.ndarray,
    attention: np.ndarray,
    inter: np.ndarray,
    loads: Loads,
    rules: TierRules,
) -> dict[int, int]:
    """Documents whose balanced ``work`` exceeds a node's share go across nodes when
    ``Loads.best_num_nodes`` says a cross-node ring (its exposed NIC transfers included) ends
    the step sooner than a ring on one node; marks them in ``inter`` and returns how many nodes
    each ring spans. Longest first, a ring takes no more nodes than the longer ones have left
    (rings that share a node add up on its GPUs), unless capacity needs them; with automatic
    thresholds, where the rings would want more nodes than there are, the nodes are shared
    out among them instead (``share_nodes``)."""
    topology = loads.topology
    k, num_nodes = topology.gpus_per_node, topology.num_nodes
    wanted_nodes: dict[int, int] = {}
    if num_nodes == 1:
        return wanted_nodes
    node_share = float(work.sum()) / num_nodes
    candidates = rules.allow_split & (work > node_share)
    if not rules.auto:
        # Explicit thresholds keep the paper's rule: at least ``T_inter`` long and more
        # attention than one node's share of the batch's attention.
        candidates = rules.allow_split & (array >= rules.thresholds[1])
        candidates &= attention > attention.sum() / num_nodes
    spread = np.flatnonzero(inter | candidates)
    free = num_nodes
    fewest: dict[int, int] = {}  # what capacity needs, and what each ring is best at alone
    most: dict[int, int] = {}
    for doc in spread[np.lexsort((spread, -array[spread]))].tolist():
        length, best = int(array[doc]), 2
        if rules.allow_split and rules.auto:
            best = loads.best_num_nodes(length, float(work.sum() - work[doc]))
        elif rules.allow_split:  # explicit thresholds: the user's word, no cost veto
            by_share = math.ceil(float(work[doc]) / node_share)
            best = max(2, min(by_share, length // (k * rules.chunks[1]), num_nodes))
        if best > 1 or inter[doc]:
            needed = -(-(min_ring(length, loads.capacity) or length) // k)
            inter[doc] = True
            wanted_nodes[doc] = max(2, needed, min(best, free))
            free = max(0, free - wanted_nodes[doc])
            fewest[doc], most[doc] = max(2, needed), max(2, needed, best)
    if rules.auto and sum(most.values()) > num_nodes:
        return share_nodes(array, fewest, most, loads)
    return wanted_nodes


def share_nodes(
    array: np.ndarray, fewest: dict[int, int], most: dict[int, int], loads: Loads
) -> dict[int, int]:
    """Nodes for rings across nodes that together want more than there are: each ring starts
    at ``fewest`` and one node at a time goes to the ring whose members carry the most
    (``Loads.ring_key``), up to its ``most``, while nodes are left. The busiest ring member
    ends as light as any sharing makes it, where a ring's members carry less on more nodes
    (the rule of hand-outs to the largest: no node moved between two rings lowers the larger
    of their loads). Handing them out longest first instead leaves the last rings two nodes,
    whose members then carry several times the others' load."""
    k, num_nodes = loads.topology.gpus_per_node, loads.topology.num_nodes
    nodes = dict(fewest)

    def carried(doc: int) -> float:
        return loads.ring_key(int(array[doc]), nodes[doc] * k, "nic")

    heap = [(-carried(doc), doc) for doc in nodes if nodes[doc] < most[doc]]
    heapq.heapify(heap)
    left = num_nodes - sum(nodes.values())
    while left > 0 and heap:
        _, doc = heapq.heappop(heap)
        nodes[doc] += 1
        left -= 1
        if nodes[doc] < most[doc]:
            heapq.heappush(heap, (-carried(doc), doc))
    return nodes
