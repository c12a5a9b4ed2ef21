"""Per inter-node document, the flat ring or the 2-D scheme: whichever the cost model says is
faster (the scheme itself: ``heads.py``).

A document placed on a ring of ``g = n * G`` ranks over ``n`` whole nodes can instead split its
heads inside each node and run one ring per rail across the nodes. Both are priced for the
document alone, per rank, with the formulas the simulator applies step by step (zigzag makes
every step of a ring alike, so a closed form does): attention compute, plus for each ring step
the part of its transfer the step's compute does not hide (forward: K/V while the forward runs;
backward: K/V and dK/dV while the backward runs), plus, for the 2-D scheme, its four head
all-to-alls (which hide behind nothing).

    flat ring   g - 1 steps of L/g query tokens against L/g keys, all heads; a step moves
                L/g tokens of K/V, cross-node edges over every NIC of the node with routing
    2-D         n - 1 steps of L/n query tokens against L/n keys, 1/G of the heads; a step
                moves L/n tokens of one group's K/V heads over the rank's own rail

Per step the 2-D scheme computes ``G`` times more for the same bytes per rank (with K/V heads
split; replicated K/V heads send ``G/nkv`` times more), so it wins where the flat ring's steps are
too short to hide their transfers: long documents over several nodes. A document keeps the flat
ring when the model's heads do not split over the node's GPUs (``heads.head_groups``).

``choose_schemes`` is the planner's hook, called on the placed documents before the linear layout
and routing: a document that switches keeps its ring and its token spans (the flat zigzag spans
over whole nodes already lie in the node chunks the scheme needs); only its scheme changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from megatron_zeppelin.planner.cost.costmodel import FWD_SHARE, CostModel, Efficiency
from megatron_zeppelin.planner.plan.heads import AttentionShape, HeadGroups, head_groups
from megatron_zeppelin.planner.plan.plan import Plan, Scheme, SequencePlan, Tier
from megatron_zeppelin.planner.plan.routing import build_routes
from megatron_zeppelin.topology.model import Topology

__all__ = [
    "choose_schemes",
    "every_two_d",
    "faster_scheme",
    "SchemePrices",
    "scheme_seconds",
]


def _nodes_of(seq: SequencePlan, topology: Topology) -> list[int] | None:
    """The nodes of ``seq``'s ring in ring order when the ring is whole nodes, else ``None``."""
    k = topology.gpus_per_node
    if len(seq.ring) % k:
        return None
    nodes = [topology.node_of(seq.ring[i]) for i in range(0, len(seq.ring), k)]
    whole = {r for n in nodes for r in topology.ranks_of_node(n)}
    return nodes if len(set(nodes)) == len(nodes) and whole == set(seq.ring) else None


def _curve(curve: Efficiency, flops_per_pair: float) -> tuple[float, float, float, float]:
    """``(overhead, seconds per pair at the peak, half_tokens, 1 / fall_tokens)`` of a curve:
    ``CostModel.attention_call_time`` of a call of one block in scalar arithmetic (the planner
    prices thousands of rings per batch)."""
    inverse_fall = 1.0 / curve.fall_tokens if curve.fall_tokens else 0.0
    return curve.overhead_s, flops_per_pair / curve.flops_per_s, curve.half_tokens, inverse_fall


def _call_seconds(curve: tuple[float, float, float, float], num_q: float, pairs: float) -> float:
    overhead, pair_s, half, inverse_fall = curve
    if num_q <= 0 or pairs <= 0:
        return 0.0
    return overhead + pairs * pair_s * (1.0 + half / num_q + num_q * inverse_fall)


class SchemePrices:
    """Per-rank seconds of a document's ring across whole nodes, flat or 2-D, for one cost
    model and topology. The constants are computed once: the planner prices every candidate
    node count of every long document."""

    def __init__(self, cost: CostModel, topology: Topology) -> None:
        self.cost, self.topology = cost, topology
        flops = cost.model.attn_flops_per_pair()
        self._diagonal, self._unmasked = _curve(cost.diagonal, flops), _curve(cost.attention, flops)
        shape = AttentionShape.of_model(cost.model)
        k = topology.gpus_per_node
        try:
            self.groups: HeadGroups | None = head_groups(shape.num_heads, shape.num_kv_heads, k)
        except ValueError:
            self.groups = None
        if self.groups is not None:
            g, d, value = self.groups, shape.head_dim, shape.value_bytes
            self._share = g.num_q / shape.num_heads
            # A rail's NIC is shared by the ranks next to it when a node has fewer NICs.
            self._rail_bytes = 2 * g.num_kv * d * value * max(1.0, k / topology.nics_per_node)
            self._qkv_bytes = (g.num_q + 2 * g.num_kv) * d * value
            self._o_bytes = g.num_q * d * value

    def _ring(self, length: int, ring: int, share: float, step_s: float, step_2x_s: float):  # noqa: ANN202
        """One rank of a zigzag ring of ``ring`` ranks: compute (``share`` of the heads) plus
        the transfers it does not hide; ``step_s`` / ``step_2x_s``: one step's forward and
        backward transfer seconds."""
        chunk = length / ring
        pairs = length * length / (2 * ring) * share / ring
        own = _call_seconds(self._diagonal, chunk, pairs)
        step = _call_seconds(self._unmasked, chunk, pairs)
        exposed = max(0.0, step_s - FWD_SHARE * step)
        exposed += max(0.0, step_2x_s - (1 - FWD_SHARE) * step)
        return own + (ring - 1) * (step + exposed)

    def flat(self, length: int, ring_size: int, *, routing: bool) -> float:
        """One rank of a flat zigzag ring of ``ring_size`` ranks that crosses nodes."""
        nic, nvlink = self.cost.nic, self.cost.nvlink
        links = self.topology.nics_per_node if routing else 1

        def step(num_bytes: float) -> float:
            # The slowest message of a step is a cross-node edge's. Direct, it leaves through
            # the sender's NIC. Routed, it is split over the node's NICs and relayed over
            # NVLink (three hops); a relaying GPU's NVLink port also carries its own message.
            if links == 1:
                return max(nvlink.time(num_bytes), nic.time(num_bytes))
            drain = max(
                num_bytes * (1 + 1 / links) / nvlink.bytes_per_s,
                num_bytes / links / nic.bytes_per_s,
            )
            return drain + 2 * nvlink.latency_s + nic.latency_s

        kv = self.cost.kv_bytes(1) * length / ring_size
        return self._ring(length, ring_size, 1.0, step(kv), step(2 * kv))

    def two_d(self, length: int, num_nodes: int) -> float | None:
        """One rank of the 2-D scheme over ``num_nodes`` whole nodes; ``None`` when the
        model's heads do not split over a node's GPUs."""
        if self.groups is None:
            return None
        k, nic, nvlink = self.topology.gpus_per_node, self.cost.nic, self.cost.nvlink
        block = length / num_nodes * self._rail_bytes
        ring = self._ring(
            length,
            num_nodes,
            self._share,
            nic.latency_s + block / nic.bytes_per_s,
            nic.latency_s + 2 * block / nic.bytes_per_s,
        )
        if k == 1:
            return ring
        # Four all-to-alls: a rank sends its L/(nG) tokens to the G - 1 others, a group's
        # heads: Q, K, V and dO in; the output and dQ, dK, dV back.
        tokens = length / (num_nodes * k) * (k - 1)
        return (
            ring
            + 2 * nvlink.time(tokens * self._qkv_bytes)
            + 2 * nvlink.time(tokens * self._o_bytes)
        )


def scheme_seconds(
    seq: SequencePlan,
    topology: Topology,
    cost_model: CostModel,
    *,
    routing: bool,
    prices: SchemePrices | None = None,
) -> dict[Scheme, float]:
    """Predicted attention seconds (one layer, forward and backward) of one rank of ``seq``,
    an inter-node document, for each scheme it can run: the 2-D scheme only on whole nodes
    with heads that split. ``prices``: ``SchemePrices(cost_model, topology)`` when the caller
    prices several documents."""
    prices = prices or SchemePrices(cost_model, topology)
    seconds = {Scheme.RING: prices.flat(seq.length, len(seq.ring), routing=routing)}
    nodes = _nodes_of(seq, topology)
    if nodes is not None:
        two_d = prices.two_d(seq.length, len(nodes))
        if two_d is not None:
            seconds[Scheme.TWO_D] = two_d
    return seconds


def faster_scheme(
    seq: SequencePlan,
    topology: Topology,
    cost_model: CostModel,
    *,
    routing: bool,
    prices: SchemePrices | None = None,
) -> Scheme:
    """The scheme ``scheme_seconds`` predicts faster for ``seq`` (the flat ring on ties)."""
    seconds = scheme_seconds(seq, topology, cost_model, routing=routing, prices=prices)
    return min(seconds, key=lambda scheme: (seconds[scheme], scheme != Scheme.RING))


def choose_schemes(
    sequences: Sequence[SequencePlan], topology: Topology, cost_model: CostModel, *, routing: bool
) -> tuple[SequencePlan, ...]:
    """``sequences`` with every inter-node ring the cost model prefers as 2-D turned into one
    (see the module docstring); the others unchanged."""
    out, prices = list(sequences), None
    inter, ring = Tier.INTER, Scheme.RING
    for i, seq in enumerate(out):
        if seq.tier == inter and seq.scheme == ring:
            prices = prices or SchemePrices(cost_model, topology)
            faster = faster_scheme(seq, topology, cost_model, routing=routing, prices=prices)
            if faster == Scheme.TWO_D:
                out[i] = _as_two_d(seq, topology)
    return tuple(out)


def _as_two_d(seq: SequencePlan, topology: Topology) -> SequencePlan:
    assert _nodes_of(seq, topology) is not None, "the 2-D scheme runs on whole nodes only"
    return replace(seq, scheme=Scheme.TWO_D)


def every_two_d(plan: Plan) -> Plan:
    """``plan`` with every inter-node document on whole nodes run with the 2-D scheme, whatever
    the cost model says (routes rebuilt when the plan had any; rings and tokens unchanged):
    how ``zeppelin verify`` exercises the scheme on any batch."""
    topo = plan.topology
    sequences = tuple(
        _as_two_d(s, topo) if s.tier == Tier.INTER and _nodes_of(s, topo) else s
        for s in plan.sequences
    )
    routes = build_routes(sequences, topo) if plan.routes else ()
    return replace(
        plan, sequences=sequences, routes=routes, name=f"{plan.name}-2d", meta=dict(plan.meta)
    )
