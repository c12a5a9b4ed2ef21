"""The simulator's timeline step by step and message by message (pure Python).

The simulator itself (``simulator.py``) computes the same timeline with arrays, for every phase
and ring step at once; this module is its reference and the home of the pieces both use:
``attention_phases`` (what every rank computes in every phase), ``message_paths`` and
``route_hops`` (a message's legs, ``schedule.message_legs``, and the hops of a route's parts),
``step_transfer_times`` (one ring step on shared links), the 2-D documents' column rings and
head all-to-alls (``TwoDLayer``), and ``reference_attention``, the whole timeline of one layer
(tests compare the array version with it). See the simulator's module docstring for the model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_zeppelin.planner.cost.costmodel import FWD_SHARE, CostModel, causal_pairs
from megatron_zeppelin.planner.plan.heads import AttentionShape, head_plan
from megatron_zeppelin.planner.plan.plan import AttentionComm, Plan, Route, SequencePlan, Tier
from megatron_zeppelin.planner.plan.schedule import (
    Message,
    exchange_messages,
    head_swap_tokens,
    message_legs,
    ring_link_bytes,
    ring_schedule,
    route_paths,
    routes_by_edge,
)
from megatron_zeppelin.topology.model import Topology

__all__ = [
    "TwoDLayer",
    "attention_phases",
    "exposed_and_transfer",
    "hop_ports",
    "message_paths",
    "phase_compute_time",
    "reference_attention",
    "route_hops",
    "step_transfer_times",
    "subplan",
    "two_d_forward_bytes",
    "two_d_forward_messages",
]


def phase_compute_time(
    cost: CostModel, blocks: list[tuple[int, int]], *, diagonal: bool = False
) -> float:
    """One varlen attention call over ``blocks`` of ``(num_query_tokens, causal_pairs)``: each
    block runs at the efficiency of its own query count, the call overhead is paid once.
    ``diagonal``: the blocks are cut by the causal diagonal (phase 0: whole local documents and
    every ring document's own block), priced on the cost model's diagonal curve."""
    return cost.attention_call_time(blocks, diagonal=diagonal)


def _spans_by_rank(seq: SequencePlan) -> dict[int, list[tuple[int, int]]]:
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for s in seq.attention:
        spans[s.rank].append((s.start, s.end))
    return spans


def attention_phases(
    plan: Plan, sequences: tuple[SequencePlan, ...], *, pair_share: float = 1.0
) -> list[list[list]]:
    """Per rank, per phase, the ``(num_q, pairs)`` blocks it computes (module docstring).
    2-D documents are left out (``two_d_phases``); ``pair_share`` scales the pairs (a head
    group's share of the heads)."""
    world = plan.world_size
    sequences = tuple(s for s in sequences if not s.is_two_d)
    num_phases = max((s.ring_size for s in sequences), default=1)
    phases: list[list[list]] = [[[] for _ in range(num_phases)] for _ in range(world)]
    for seq in sequences:
        spans = _spans_by_rank(seq)
        g = seq.ring_size
        for i, rank in enumerate(seq.ring):
            mine = spans.get(rank, [])
            num_q = sum(e - s for s, e in mine)
            if not num_q:
                continue
            for k in range(g):
                theirs = spans.get(seq.ring[(i - k) % g], [])
                pairs = sum(causal_pairs(qs, qe, ks, ke) for qs, qe in mine for ks, ke in theirs)
                phases[rank][k].append((num_q, pairs * pair_share))
    return phases


# --- communication -----------------------------------------------------------------------------
def hop_ports(topo: Topology, a: int, b: int) -> tuple:
    """The hop ``a -> b`` as ``(link kind, out port, in port)``: NVLink inside a node (the
    GPUs' ports), across nodes the NICs next to ``a`` and ``b``."""
    if topo.same_node(a, b):
        return ("nvlink", ("gpu-out", a), ("gpu-in", b))
    return (
        "nic",
        ("nic-out", topo.node_of(a), topo.nic_of(a)),
        ("nic-in", topo.node_of(b), topo.nic_of(b)),
    )


def message_paths(topo: Topology, msg: Message, routes: dict) -> list[tuple[int, list[tuple]]]:
    """``(tokens, hops)`` per leg of a message (``schedule.message_legs``); a hop is
    ``hop_ports``."""
    legs = message_legs(msg, routes.get((msg.src, msg.dst)))
    return [(leg.num_tokens, [hop_ports(topo, a, b) for a, b in leg.hops]) for leg in legs]


def route_hops(topo: Topology, route: Route) -> list[list[tuple]]:
    """The hops (``hop_ports``) of each of ``route``'s parts, in part order, whatever the
    tokens (``schedule.route_paths``): the array timeline splits the tokens itself."""
    return [
        [hop_ports(topo, a, b) for a, b in zip(path[:-1], path[1:])] for path in route_paths(route)
    ]


def step_transfer_times(
    plan: Plan,
    cost: CostModel,
    messages: list[Message],
    bytes_per_token: float,
    routing: bool,
    *,
    more: Sequence[tuple[list[Message], float]] = (),
) -> list[float]:
    """Per rank, the time until its messages of one ring step (sent and received) arrive, with
    every link's bandwidth shared by all the step's traffic on it. ``more``: other messages of
    the same step with their own bytes per token (the 2-D documents' column rings)."""
    routes = routes_by_edge(plan, routing=routing)
    weighted = [(m, bytes_per_token) for m in messages] + [(m, b) for ms, b in more for m in ms]
    paths = [(msg, message_paths(plan.topology, msg, routes)) for msg, _ in weighted]
    load: dict[tuple, float] = defaultdict(float)
    for (_, per_token), (_, parts) in zip(weighted, paths):
        for n, hops in parts:
            for _kind, out_port, in_port in hops:
                load[out_port] += n * per_token
                load[in_port] += n * per_token
    per_rank = [0.0] * plan.world_size
    for msg, parts in paths:
        finish = 0.0
        for n, hops in parts:
            if n <= 0:
                continue
            # Pipelined over its hops: the most loaded link sets the pace, every hop adds latency.
            drain = max(
                load[port] / cost.link(kind).bytes_per_s
                for kind, out_port, in_port in hops
                for port in (out_port, in_port)
            )
            finish = max(finish, drain + sum(cost.link(kind).latency_s for kind, _, _ in hops))
        per_rank[msg.src] = max(per_rank[msg.src], finish)
        per_rank[msg.dst] = max(per_rank[msg.dst], finish)
    return per_rank


# --- 2-D documents ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TwoDLayer:
    """A plan's 2-D documents in one layer: their column rings' compute per rank and phase
    (a head group's share of the pairs, one more kernel call per phase: another buffer), their
    K/V messages per ring step, and the four head all-to-alls per rank (forward: Q/K/V in, the
    output back; backward: dO in, dQ/dK/dV back), which hide behind nothing."""

    phases: list[list[list]]
    steps: list[list[Message]]
    kv_bytes_per_token: float
    all_to_all_s: list[float]

    @classmethod
    def of(cls, plan: Plan, cost: CostModel, routing: bool) -> TwoDLayer | None:
        heads = head_plan(plan)
        if heads is None:
            return None
        shape = AttentionShape.of_model(cost.model)
        groups = shape.groups(heads.num_groups)
        d, value = shape.head_dim, shape.value_bytes
        qkv, out = (groups.num_q + 2 * groups.num_kv) * d * value, groups.num_q * d * value
        inbound, outbound = (exchange_messages(plan, to_heads=t) for t in (True, False))
        seconds = [0.0] * plan.world_size
        # Forward: Q/K/V in, the output back; backward: dO in, dQ/dK/dV back.
        for messages, per_token in (
            (inbound, qkv),
            (outbound, out),
            (inbound, out),
            (outbound, qkv),
        ):
            times = step_transfer_times(plan, cost, messages, per_token, routing=False)
            seconds = [a + b for a, b in zip(seconds, times)]
        return cls(
            attention_phases(
                heads.plan, heads.plan.sequences, pair_share=groups.num_q / shape.num_heads
            ),
            ring_schedule(heads.plan),
            2 * groups.num_kv * d * value,
            seconds,
        )

    def add_compute(self, cost: CostModel, compute: list[list[float]]) -> list[list[float]]:
        """``compute`` (seconds per rank and phase) with the column rings' calls added."""
        merged = []
        for flat, mine in zip(compute, self.phases):
            n = max(len(flat), len(mine))
            flat = flat + [0.0] * (n - len(flat))
            merged.append(
                [
                    c
                    + (phase_compute_time(cost, mine[k], diagonal=k == 0) if k < len(mine) else 0.0)
                    for k, c in enumerate(flat)
                ]
            )
        return merged

    def step(self, k: int) -> list[tuple[list[Message], float]]:
        """The column rings' forward messages of ring step ``k`` with their bytes per token."""
        return [(self.steps[k], self.kv_bytes_per_token)] if k < len(self.steps) else []


def two_d_forward_messages(plan: Plan, cost: CostModel) -> list[tuple[list[Message], int]]:
    """The 2-D documents' messages of one layer's forward, each list with its bytes per token:
    Q/K/V to the head layout, the output back (NVLink), the column rings' K/V step by step."""
    heads = head_plan(plan)
    if heads is None:
        return []
    shape = AttentionShape.of_model(cost.model)
    groups = shape.groups(heads.num_groups)
    d, value = shape.head_dim, shape.value_bytes
    return [
        (exchange_messages(plan, to_heads=True), (groups.num_q + 2 * groups.num_kv) * d * value),
        (exchange_messages(plan, to_heads=False), groups.num_q * d * value),
        *((step, 2 * groups.num_kv * d * value) for step in ring_schedule(heads.plan)),
    ]


def two_d_forward_bytes(plan: Plan, cost: CostModel, routing: bool) -> dict[str, int]:
    """Bytes per link class of ``two_d_forward_messages``, counted without listing them (as
    ``schedule.two_d_link_bytes`` counts: the all-to-all per node row, the column rings per
    document and edge, ``ring_link_bytes``)."""
    heads = head_plan(plan)
    if heads is None:
        return {}
    shape = AttentionShape.of_model(cost.model)
    groups = shape.groups(heads.num_groups)
    d, value = shape.head_dim, shape.value_bytes
    there, back = (groups.num_q + 2 * groups.num_kv) * d * value, groups.num_q * d * value
    total = {"nvlink": head_swap_tokens(plan) * (there + back), "nic": 0}
    ring = ring_link_bytes(
        heads.plan,
        (Tier.INTRA, Tier.INTER),
        bytes_per_token=2 * groups.num_kv * d * value,
        routing=routing,
        routes_of=plan,
    )
    for key, n in ring.items():
        total[key] = total.get(key, 0) + n
    return total


# --- one layer ---------------------------------------------------------------------------------
def reference_attention(
    plan: Plan, cost: CostModel, routing: bool
) -> tuple[list[float], list[float]]:
    """Per rank, attention compute seconds and the communication seconds it does not hide, one
    ring step and one rank at a time (the documents run concurrently)."""
    world = plan.world_size
    kv = cost.model.kv_bytes_per_token()
    phases = attention_phases(plan, plan.sequences)
    compute = [
        [phase_compute_time(cost, blocks, diagonal=k == 0) for k, blocks in enumerate(per_rank)]
        for per_rank in phases
    ]
    steps = ring_schedule(plan)
    if AttentionComm(plan.attention_comm) == AttentionComm.ALLGATHER:
        # All-gather K/V forward, reduce-scatter dK/dV backward, neither overlapped.
        comm = [0.0] * world
        for step in steps:
            for r, t in enumerate(step_transfer_times(plan, cost, step, kv, routing)):
                comm[r] += t
        # One call over every block: the phases merge into a single kernel launch.
        merged = [
            phase_compute_time(cost, p[0], diagonal=True)
            + phase_compute_time(cost, [b for blocks in p[1:] for b in blocks])
            for p in phases
        ]
        return merged, [2 * c for c in comm]
    two_d = TwoDLayer.of(plan, cost, routing)
    if two_d is not None:
        compute = two_d.add_compute(cost, compute)
    exposed, _ = exposed_and_transfer(plan, cost, routing, compute, steps, two_d)
    return [sum(c) for c in compute], exposed


def exposed_and_transfer(
    plan: Plan,
    cost: CostModel,
    routing: bool,
    compute: list[list[float]],
    steps: list[list[Message]],
    two_d: TwoDLayer | None,
) -> tuple[list[float], list[float]]:
    """Per rank, the ring transfers (and head all-to-alls) its compute does not hide, and all
    of their seconds (each ring step's forward and backward transfers and the all-to-alls)."""
    kv = cost.model.kv_bytes_per_token()
    num_steps = max(len(steps), len(two_d.steps) if two_d is not None else 0)
    fwd, bwd = [], []
    for k in range(num_steps):
        step = steps[k] if k < len(steps) else []
        more = two_d.step(k) if two_d is not None else []
        fwd.append(step_transfer_times(plan, cost, step, kv, routing, more=more))
        bwd.append(
            step_transfer_times(
                plan, cost, step, 2 * kv, routing, more=[(ms, 2 * b) for ms, b in more]
            )
        )
    exposed = list(two_d.all_to_all_s) if two_d is not None else [0.0] * plan.world_size
    transfer = list(exposed)
    for r in range(plan.world_size):
        for k, c in enumerate(compute[r]):
            # A phase lasts max(compute, transfer): only the transfer's excess is exposed.
            tf = fwd[k][r] if k < len(fwd) else 0.0
            tb = bwd[k][r] if k < len(bwd) else 0.0
            exposed[r] += max(0.0, tf - c * FWD_SHARE) + max(0.0, tb - c * (1 - FWD_SHARE))
            transfer[r] += tf + tb
    return exposed, transfer


def subplan(plan: Plan, sequences: tuple[SequencePlan, ...]) -> Plan:
    """The plan reduced to ``sequences``, run concurrently (no builder meta)."""
    ids = {s.id for s in sequences}
    linear = tuple(tuple(r for r in ranges if r.seq in ids) for ranges in plan.linear)
    return Plan(
        plan.topology,
        sequences,
        linear,
        routes=plan.routes,
        capacity=None,
        attention_comm=plan.attention_comm,
        name=plan.name,
    )
