"""Step-time simulator: times a plan on its topology with the cost model, per rank.

One transformer layer is simulated (forward plus backward) and multiplied by ``num_layers``.

Timeline of one layer on one rank:

* **linear**: one GEMM pass over the rank's linear tokens (``CostModel.linear_time``).
* **remapping** (plans whose linear layout differs from the attention layout): four all-to-alls,
  forward Q/K/V to the attention layout and the output back, backward the output gradient to the
  attention layout and dQ/dK/dV back. Each is a synchronization point: every rank waits for the
  slowest before attention and after it, so a layer takes ``max(linear) + all-to-alls +
  max(attention)``. Without remapping a layer takes ``max(linear + attention)`` over ranks.
  Each all-to-all drains every GPU's NVLink port and every NIC (per direction) in parallel and
  overlaps with nothing (``linear_layout.remap_seconds``, which the planner uses as well).
* **ring attention**: phase 0 computes the local documents and every ring document's own
  diagonal block while ring step 0 is in flight; phase ``k`` computes the blocks received in
  step ``k-1`` while step ``k`` travels (``schedule.ring_schedule``). A phase lasts
  ``max(compute, transfer)``. Convention for forward plus backward: the forward phase computes
  ``1 / (1 + 2.5)`` of a block's fwd+bwd time and moves K/V; the backward phase computes the rest
  and moves K/V plus dK/dV, twice the bytes.
* **2-D documents** (``Scheme.TWO_D``, ``TwoDLayer``): their column rings (``heads.head_plan``)
  compute a head group's share of the pairs in one more call per phase and send a group's K/V
  heads in the same ring steps as the flat rings, sharing their links; the four head
  all-to-alls inside each node (Q/K/V in and the output back, dO in and dQ/dK/dV back) hide
  behind nothing.
* **all-gather attention** (``AttentionComm.ALLGATHER``): the same messages all-gather K/V before
  any compute (forward) and reduce-scatter dK/dV after it (backward), not overlapped.

Transfers share links: in one ring step all messages (and route parts) that use the same GPU's
NVLink port (per direction) or the same NIC (per direction) split its bandwidth; a message
finishes when its most loaded link has drained, plus one latency per hop. Routed messages follow
``schedule.link_bytes``: sender -> source proxy (NVLink), proxy NIC -> proxy NIC, destination
proxy -> receiver (NVLink).

Plans with ``meta["execution"] == "sequential"`` (Megatron's dynamic CP) run every document as its
own forward/backward pass: a rank's time is the sum over its documents.

The lower bound is the batch's compute with no communication, perfectly spread over the GPUs:
every document's attention computed whole (the most efficient kernel shape) and all tokens'
linear work, divided by the world size. It depends only on the batch, so ``efficiency`` compares
builders on the same footing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_zeppelin.planner.costmodel import CostModel, causal_pairs
from megatron_zeppelin.planner.heads import AttentionShape, head_plan
from megatron_zeppelin.planner.linear_layout import remap_seconds
from megatron_zeppelin.planner.models import ATTN_BWD_OVER_FWD
from megatron_zeppelin.planner.plan import (
    AttentionComm,
    Plan,
    SequencePlan,
    Tier,
)
from megatron_zeppelin.planner.schedule import (
    Message,
    exchange_messages,
    link_bytes,
    message_legs,
    ring_schedule,
    routes_by_edge,
)

FWD_SHARE = 1.0 / (1.0 + ATTN_BWD_OVER_FWD)


@dataclass(frozen=True)
class RankTime:
    """Seconds of one rank over a whole step (all layers)."""

    compute_s: float
    comm_exposed_s: float
    """Communication not hidden behind this rank's compute (ring, all-gather, remapping)."""
    idle_s: float
    """Waiting for other ranks (synchronization points, the step's slowest rank)."""
    linear_s: float = 0.0
    """The linear part of ``compute_s``."""
    attention_s: float = 0.0
    """The attention part of ``compute_s``."""


@dataclass(frozen=True)
class SimResult:
    """Predicted step of one batch (all rounds of a builder together)."""

    name: str
    step_time_s: float
    lower_bound_s: float
    efficiency: float
    """``lower_bound_s / step_time_s``."""
    per_rank: tuple[RankTime, ...]
    link_bytes: dict[str, int]
    """One layer, forward: ring (or all-gather) bytes per link class plus remapping bytes."""
    ring_bytes: dict[str, int]
    remap_bytes: dict[str, int]
    tokens_per_s: float
    mfu: float
    num_tokens: int
    num_rounds: int = 1
    breakdown: dict[str, float] = field(default_factory=dict)
    """Per step, seconds of the slowest rank's linear, attention and remapping work."""

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "step_time_s": self.step_time_s,
            "lower_bound_s": self.lower_bound_s,
            "efficiency": self.efficiency,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "num_tokens": self.num_tokens,
            "num_rounds": self.num_rounds,
            "link_bytes": self.link_bytes,
            "ring_bytes": self.ring_bytes,
            "remap_bytes": self.remap_bytes,
            "breakdown": self.breakdown,
            "per_rank": [
                {
                    "compute_s": r.compute_s,
                    "comm_exposed_s": r.comm_exposed_s,
                    "idle_s": r.idle_s,
                    "linear_s": r.linear_s,
                    "attention_s": r.attention_s,
                }  # fmt: skip
                for r in self.per_rank
            ],
        }


# --- compute -----------------------------------------------------------------------------------
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
def _message_paths(plan: Plan, msg: Message, routes: dict) -> list[tuple[int, list[tuple]]]:
    """``(tokens, hops)`` per leg of a message (``schedule.message_legs``); a hop is
    ``(link kind, out port, in port)``."""
    topo = plan.topology

    def hop(a: int, b: int) -> tuple:
        if topo.same_node(a, b):
            return ("nvlink", ("gpu-out", a), ("gpu-in", b))
        return (
            "nic",
            ("nic-out", topo.node_of(a), topo.nic_of(a)),
            ("nic-in", topo.node_of(b), topo.nic_of(b)),
        )

    legs = message_legs(msg, routes.get((msg.src, msg.dst)))
    return [(leg.num_tokens, [hop(a, b) for a, b in leg.hops]) for leg in legs]


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
    paths = [(msg, _message_paths(plan, msg, routes)) for msg, _ in weighted]
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


def remap_matrix(plan: Plan) -> dict[tuple[int, int], int]:
    """Tokens the remapping moves from each linear holder to each attention holder."""
    owners: dict[int, list[tuple[int, int, int]]] = {}
    for seq in plan.sequences:
        owners[seq.id] = sorted((s.start, s.end, s.rank) for s in seq.attention)
    moved: dict[tuple[int, int], int] = defaultdict(int)
    for rank, ranges in enumerate(plan.linear):
        for r in ranges:
            for start, end, owner in owners[r.seq]:
                overlap = min(end, r.end) - max(start, r.start)
                if overlap > 0 and owner != rank:
                    moved[(rank, owner)] += overlap
    return dict(moved)


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
        for messages, per_token in ((inbound, qkv), (outbound, out), (inbound, out),
                                    (outbound, qkv)):  # fmt: skip
            times = step_transfer_times(plan, cost, messages, per_token, routing=False)
            seconds = [a + b for a, b in zip(seconds, times)]
        return cls(
            attention_phases(heads.plan, heads.plan.sequences,
                             pair_share=groups.num_q / shape.num_heads),
            ring_schedule(heads.plan),
            2 * groups.num_kv * d * value,
            seconds,
        )  # fmt: skip

    def add_compute(self, cost: CostModel, compute: list[list[float]]) -> list[list[float]]:
        """``compute`` (seconds per rank and phase) with the column rings' calls added."""
        merged = []
        for flat, mine in zip(compute, self.phases):
            n = max(len(flat), len(mine))
            flat = flat + [0.0] * (n - len(flat))
            merged.append([
                c + (phase_compute_time(cost, mine[k], diagonal=k == 0) if k < len(mine) else 0.0)
                for k, c in enumerate(flat)
            ])  # fmt: skip
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
    """Bytes per link class of ``two_d_forward_messages``."""
    total: dict[str, int] = {}
    for messages, per_token in two_d_forward_messages(plan, cost):
        for key, n in link_bytes(plan, [messages], bytes_per_token=per_token,
                                 routing=routing).items():  # fmt: skip
            total[key] = total.get(key, 0) + n
    return total


# --- one plan ----------------------------------------------------------------------------------
@dataclass
class _Layer:
    """Seconds of one layer, per rank."""

    linear: list[float]
    attention: list[float]  # wall time of the attention phase: compute + exposed
    attention_compute: list[float]
    attention_exposed: list[float]
    remap_s: float


def _attention_layer(plan: Plan, cost: CostModel, routing: bool) -> tuple[list[float], list[float]]:
    """Per rank, attention compute seconds and the communication seconds it does not hide."""
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
    exposed, _ = _exposed(plan, cost, routing, compute, steps, two_d)
    return [sum(c) for c in compute], exposed


def _exposed(
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
        bwd.append(step_transfer_times(plan, cost, step, 2 * kv, routing,
                                       more=[(ms, 2 * b) for ms, b in more]))  # fmt: skip
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


def tier_figures(plan: Plan, cost: CostModel, *, routing: bool) -> dict[str, dict]:
    """Each kind of split document alone (intra-node rings, flat inter-node rings, 2-D), one
    layer on its busiest rank: attention compute, transfer and exposed seconds (forward and
    backward), and the forward bytes per link class. What a tier's own steps hide of its own
    transfers; in the step all tiers share the phases and the links."""
    kinds = {
        "intra": [s for s in plan.sequences if s.tier == Tier.INTRA and not s.is_two_d],
        "inter": [s for s in plan.sequences if s.tier == Tier.INTER and not s.is_two_d],
        "2d": [s for s in plan.sequences if s.is_two_d],
    }
    out = {}
    for name, sequences in kinds.items():
        if not sequences:
            continue
        sub = _subplan(plan, tuple(sequences))
        phases = attention_phases(sub, sub.sequences)
        compute = [[phase_compute_time(cost, b, diagonal=k == 0) for k, b in enumerate(p)]
                   for p in phases]  # fmt: skip
        two_d = TwoDLayer.of(sub, cost, routing)
        if two_d is not None:
            compute = two_d.add_compute(cost, compute)
        exposed, transfer = _exposed(sub, cost, routing, compute, ring_schedule(sub), two_d)
        busiest = max(range(sub.world_size), key=lambda r: sum(compute[r]) + exposed[r])
        sent, _ = _bytes(sub, cost, routing, remap=False)
        out[name] = {
            "documents": len(sequences),
            "compute_s": sum(compute[busiest]),
            "transfer_s": transfer[busiest],
            "exposed_s": exposed[busiest],
            "nvlink_bytes": sent.get("nvlink", 0),
            "nic_bytes": sent.get("nic", 0),
        }
    return out


def _subplan(plan: Plan, sequences: tuple[SequencePlan, ...]) -> Plan:
    """The plan reduced to ``sequences``, run concurrently (no builder meta)."""
    ids = {s.id for s in sequences}
    linear = tuple(tuple(r for r in ranges if r.seq in ids) for ranges in plan.linear)
    return Plan(plan.topology, sequences, linear, routes=plan.routes, capacity=None,
                attention_comm=plan.attention_comm, name=plan.name)  # fmt: skip


def _layer(plan: Plan, cost: CostModel, routing: bool, remap: bool) -> _Layer:
    world = plan.world_size
    if plan.meta.get("execution") == "sequential":
        # Every document is its own pass: sum per rank, no overlap between documents.
        total = _Layer([0.0] * world, [0.0] * world, [0.0] * world, [0.0] * world, 0.0)
        for seq in plan.sequences:
            one = _concurrent_layer(_subplan(plan, (seq,)), cost, routing, remap=False)
            for r in range(world):
                total.linear[r] += one.linear[r]
                total.attention[r] += one.attention[r]
                total.attention_compute[r] += one.attention_compute[r]
                total.attention_exposed[r] += one.attention_exposed[r]
        return total
    return _concurrent_layer(plan, cost, routing, remap)


def _concurrent_layer(plan: Plan, cost: CostModel, routing: bool, remap: bool) -> _Layer:
    world = plan.world_size
    attn_compute, attn_exposed = _attention_layer(plan, cost, routing)
    wall = [c + e for c, e in zip(attn_compute, attn_exposed)]
    moved = remap_matrix(plan) if remap else {}
    if moved:
        linear = [cost.linear_time(plan.num_linear_tokens(r)) for r in range(world)]
        # Q/K/V (then dQ/dK/dV) to the attention holders, the output (then its gradient) back:
        # four all-to-alls, the same pricing the planner uses to choose the layout.
        by_attention_holder = {(b, a): n for (a, b), n in moved.items()}
        remap_s = remap_seconds(by_attention_holder, plan.topology, cost)
    else:
        linear = [cost.linear_time(plan.num_attention_tokens(r)) for r in range(world)]
        remap_s = 0.0
    return _Layer(linear, wall, attn_compute, attn_exposed, remap_s)


def _bytes(plan: Plan, cost: CostModel, routing: bool, remap: bool) -> tuple[dict, dict]:
    steps = ring_schedule(plan)
    ring = link_bytes(plan, steps, bytes_per_token=cost.model.kv_bytes_per_token(), routing=routing)
    for key, value in two_d_forward_bytes(plan, cost, routing).items():
        ring[key] = ring.get(key, 0) + value
    remap_out = {"nvlink": 0, "nic": 0}
    if remap:
        per_token = cost.remap_bytes(1)
        for (a, b), n in remap_matrix(plan).items():
            remap_out["nvlink" if plan.topology.same_node(a, b) else "nic"] += n * per_token
    return ring, remap_out


def lower_bound(lengths: list[int], cost: CostModel, world_size: int) -> float:
    """Seconds of the batch's compute spread perfectly over ``world_size`` GPUs (all layers)."""
    overhead = cost.attention.overhead_s
    attention = sum(cost.document_attention_time(n) - overhead for n in lengths) + overhead
    linear = cost.linear_time(sum(lengths))
    return cost.model.num_layers * (attention + linear) / world_size


def model_flops(lengths: list[int], cost: CostModel) -> float:
    """FLOPs of the batch's transformer layers, forward plus backward, per GPU of a TP group."""
    m = cost.model
    pairs = sum(causal_pairs(0, n, 0, n) for n in lengths)
    per_layer = pairs * m.attn_flops_per_pair() + sum(lengths) * m.linear_flops_per_token()
    return m.num_layers * per_layer


def simulate(
    plan: Plan, cost_model: CostModel, *, routing: bool | None = None, remap: bool = True
) -> SimResult:
    """Predict one plan's step (module docstring). ``routing=None`` uses the plan's routes when
    it has any; ``remap=False`` runs linear modules in the attention layout."""
    return simulate_rounds([plan], cost_model, routing=routing, remap=remap)


def simulate_rounds(
    plans: list[Plan], cost_model: CostModel, *, routing: bool | None = None, remap: bool = True
) -> SimResult:
    """Predict a batch that runs as ``plans`` one after another (a baseline's rounds)."""
    if not plans:
        raise ValueError("give at least one plan to simulate")
    world = plans[0].world_size
    if any(p.topology != plans[0].topology for p in plans):
        raise ValueError("all rounds of a batch must share one topology")
    layers = cost_model.model.num_layers
    step = 0.0
    linear = [0.0] * world
    attention = [0.0] * world
    exposed = [0.0] * world
    breakdown = {"linear_s": 0.0, "attention_s": 0.0, "remap_s": 0.0}
    ring_total: dict[str, int] = defaultdict(int)
    remap_total: dict[str, int] = defaultdict(int)
    lengths: list[int] = []
    for plan in plans:
        use_routes = bool(plan.routes) if routing is None else routing
        layer = _layer(plan, cost_model, use_routes, remap)
        if layer.remap_s > 0:
            layer_time = max(layer.linear) + layer.remap_s + max(layer.attention)
        else:
            layer_time = max(a + b for a, b in zip(layer.linear, layer.attention))
        step += layers * layer_time
        for r in range(world):
            linear[r] += layers * layer.linear[r]
            attention[r] += layers * layer.attention_compute[r]
            exposed[r] += layers * (layer.attention_exposed[r] + layer.remap_s)
        breakdown["linear_s"] += layers * max(layer.linear)
        breakdown["attention_s"] += layers * max(layer.attention)
        breakdown["remap_s"] += layers * layer.remap_s
        ring, remap_bytes = _bytes(plan, cost_model, use_routes, remap)
        for k, v in ring.items():
            ring_total[k] += v
        for k, v in remap_bytes.items():
            remap_total[k] += v
        lengths += plan.lengths
    per_rank = []
    for r in range(world):
        compute = linear[r] + attention[r]
        idle = max(0.0, step - compute - exposed[r])
        per_rank.append(RankTime(compute, exposed[r], idle, linear[r], attention[r]))
    bound = lower_bound(lengths, cost_model, world)
    merged = dict(ring_total)
    for k, v in remap_total.items():
        merged[k] = merged.get(k, 0) + v
    peak = plans[0].topology.gpu_flops
    return SimResult(
        name=plans[0].name,
        step_time_s=step,
        lower_bound_s=bound,
        efficiency=bound / step if step > 0 else 1.0,
        per_rank=tuple(per_rank),
        link_bytes=merged,
        ring_bytes=dict(ring_total),
        remap_bytes=dict(remap_total),
        tokens_per_s=sum(lengths) / step if step > 0 else 0.0,
        mfu=model_flops(lengths, cost_model) / (step * world * peak) if step > 0 else 0.0,
        num_tokens=sum(lengths),
        num_rounds=len(plans),
        breakdown=breakdown,
    )
