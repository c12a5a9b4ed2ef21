"""Step-time simulator: times a plan on its topology with the cost model, per rank.

One transformer layer is simulated (forward plus backward) and multiplied by ``num_layers``.

Timeline of one layer on one rank:

* **linear**: one GEMM pass over the rank's linear tokens (``CostModel.linear_time``).
* **remapping** (plans whose linear layout differs from the attention layout): four all-to-alls,
  forward Q/K/V to the attention layout and the output back, backward the output gradient to the
  attention layout and dQ/dK/dV back. Each is a synchronization point: every rank waits for the
  slowest before attention and after it, so a layer takes ``max(linear) + all-to-alls +
  max(attention)``. Without remapping a layer takes ``max(linear + attention)`` over ranks.
  Both are ``steptime.layer_seconds``, the function the planner minimizes.
  Each all-to-all drains every GPU's NVLink port and every NIC (per direction) in parallel and
  overlaps with nothing (``steptime.remap_seconds``, which the planner uses as well).
* **ring attention**: phase 0 computes the local documents and every ring document's own
  diagonal block while ring step 0 is in flight; phase ``k`` computes the blocks received in
  step ``k-1`` while step ``k`` travels (``schedule.ring_schedule``). A phase lasts
  ``max(compute, transfer)``. Convention for forward plus backward: the forward phase computes
  ``1 / (1 + 2.5)`` of a block's fwd+bwd time and moves K/V; the backward phase computes the rest
  and moves K/V plus dK/dV, twice the bytes.
* **2-D documents** (``Scheme.TWO_D``, ``stepwise.TwoDLayer``): their column rings
  (``heads.head_plan``) compute a head group's share of the pairs in one more call per phase and
  send a group's K/V heads in the same ring steps as the flat rings, sharing their links; the
  four head all-to-alls inside each node (Q/K/V in and the output back, dO in and dQ/dK/dV back)
  hide behind nothing.
* **all-gather attention** (``AttentionComm.ALLGATHER``): the same messages all-gather K/V before
  any compute (forward) and reduce-scatter dK/dV after it (backward), not overlapped.

The timeline is computed with arrays for every phase and step at once (``phases.py``,
``transfers.py``); ``stepwise.py`` computes it message by message and is its reference.

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

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field, replace
from operator import attrgetter

import numpy as np

from megatron_zeppelin.planner.cost.costmodel import FWD_SHARE, CostModel, causal_pairs
from megatron_zeppelin.planner.cost.steptime import layer_seconds, remap_seconds
from megatron_zeppelin.planner.plan.heads import AttentionShape, column_layout, node_members
from megatron_zeppelin.planner.plan.phases import (
    Local,
    call_key,
    phase_seconds,
    split_by_layout,
    unique_inverse,
    zigzag_blocks,
)
from megatron_zeppelin.planner.plan.plan import AttentionComm, Plan, Route, Tier
from megatron_zeppelin.planner.plan.schedule import (
    ring_link_bytes,
    ring_schedule,
    routes_by_edge,
)
from megatron_zeppelin.planner.simulate.stepwise import (
    TwoDLayer,
    attention_phases,
    exposed_and_transfer,
    phase_compute_time,
    step_transfer_times,
    subplan,
    two_d_forward_bytes,
    two_d_forward_messages,
)
from megatron_zeppelin.planner.simulate.transfers import (
    RingMessages,
    ring_messages_of,
    transfer_times,
)

__all__ = [
    "RankTime",
    "SimResult",
    "attention_phases",
    "attention_seconds",
    "lower_bound",
    "phase_compute_time",
    "remap_matrix",
    "simulate",
    "simulate_rounds",
    "step_transfer_times",
    "tier_figures",
    "two_d_forward_messages",
]


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
                }
                for r in self.per_rank
            ],
        }


def remap_matrix(plan: Plan) -> dict[tuple[int, int], int]:
    """Tokens the remapping moves from each linear holder to each attention holder."""
    owners: dict[int, tuple[list[int], list[tuple[int, int, int]]]] = {}
    for seq in plan.sequences:
        pieces = sorted((s.start, s.end, s.rank) for s in seq.attention)
        owners[seq.id] = ([start for start, _, _ in pieces], pieces)
    moved: dict[tuple[int, int], int] = defaultdict(int)
    for rank, ranges in enumerate(plan.linear):
        for r in ranges:
            starts, pieces = owners[r.seq]
            # The attention pieces partition the document: those overlapping [start, end)
            # run from the last one starting at or before ``start``.
            for start, end, owner in pieces[max(0, bisect_right(starts, r.start) - 1) :]:
                if start >= r.end:
                    break
                if owner != rank:
                    moved[(rank, owner)] += min(end, r.end) - max(start, r.start)
    return dict(moved)


# --- one plan ----------------------------------------------------------------------------------
@dataclass
class _Layer:
    """Seconds of one layer, per rank."""

    linear: list[float]
    attention: list[float]  # wall time of the attention phase: compute + exposed
    attention_compute: list[float]
    attention_exposed: list[float]
    remap_s: float


def exposed_seconds(compute: float, forward_s: float, backward_s: float) -> float:
    """Transfer time a ring phase cannot hide: the forward moves K/V behind ``FWD_SHARE`` of the
    phase's compute, the backward K/V plus dK/dV behind the rest; a phase lasts the longer of
    its compute and its transfer, so only the excess is exposed."""
    return max(0.0, forward_s - compute * FWD_SHARE) + max(
        0.0, backward_s - compute * (1 - FWD_SHARE)
    )


@dataclass(frozen=True)
class _Calls:
    """Kernel calls as arrays: pass, rank, phase and seconds of each (``phases.phase_seconds``)."""

    pass_id: np.ndarray
    rank: np.ndarray
    phase: np.ndarray
    seconds: np.ndarray

    def keys(self, world: int, num_phases: int) -> np.ndarray:
        return call_key(self.pass_id, self.rank, self.phase, world, num_phases)

    def plus(self, other: _Calls, world: int, num_phases: int) -> _Calls:
        """Both sets of calls, seconds summed per (pass, rank, phase)."""
        keys, inverse = unique_inverse(
            np.concatenate([self.keys(world, num_phases), other.keys(world, num_phases)])
        )
        seconds = np.bincount(inverse, weights=np.concatenate([self.seconds, other.seconds]))
        pass_rank, phase = keys // num_phases, keys % num_phases
        return _Calls(pass_rank // world, pass_rank % world, phase, seconds)


def _two_d(plan: Plan, cost: CostModel) -> tuple[_Calls, RingMessages, np.ndarray, int] | None:
    """A plan's 2-D documents (``stepwise.TwoDLayer`` as arrays): their column rings' calls
    (a head group's share of the pairs), their K/V messages (scaled to the flat rings' bytes
    per token), every rank's seconds in the four head all-to-alls, and their phases. The column
    rings are ``head_plan``'s, read as arrays (``heads.column_layout``)."""
    if not plan.has_two_d:
        return None
    local, zigzag, other = column_layout(plan)
    num_phases = max([1] + [z.size for z in zigzag] + [len(seq.ring) for _, seq in other])
    shape = AttentionShape.of_model(cost.model)
    groups = shape.groups(plan.topology.gpus_per_node)
    d, value, kv = shape.head_dim, shape.value_bytes, cost.model.kv_bytes_per_token()
    blocks = zigzag_blocks(zigzag, num_phases, local=local, other=other)
    blocks = replace(blocks, pairs=blocks.pairs * (groups.num_q / shape.num_heads))
    calls = _Calls(*phase_seconds(blocks, cost, plan.world_size))
    rings = ring_messages_of(zigzag, other)
    rings = replace(rings, scale=np.full(len(rings.tokens), 2 * groups.num_kv * d * value / kv))
    # Forward: Q/K/V in, the output back; backward: dO in, dQ/dK/dV back. One group each.
    qkv, out = (groups.num_q + 2 * groups.num_kv) * d * value, groups.num_q * d * value
    exchanges = _head_exchanges(
        plan, [(True, qkv / kv), (False, out / kv), (True, out / kv), (False, qkv / kv)]
    )
    _, ranks, (seconds,) = transfer_times(exchanges, plan.topology, cost, {}, (kv,))
    all_to_all = np.bincount(ranks, weights=seconds, minlength=plan.world_size)
    return calls, rings, all_to_all, num_phases


def _head_exchanges(plan: Plan, kinds: list[tuple[bool, float]]) -> RingMessages:
    """``schedule.exchange_messages`` of every ``(to_heads, scale)`` in ``kinds``, one group
    each, as arrays: inside each node of a 2-D document every rank sends every other one its
    own tokens (to the head layout) or the other's (back)."""
    members = node_members(plan)
    k = plan.topology.gpus_per_node
    rows = np.asarray([row for _, row, _ in members], dtype=np.int64).reshape(-1, k)
    held = np.asarray(
        [[tokens.get(r, 0) for r in row] for _, row, tokens in members], dtype=np.int64
    ).reshape(-1, k)
    a, b = np.nonzero(~np.eye(k, dtype=bool))  # every ordered pair of a node's ranks
    src, dst = rows[:, a].reshape(-1), rows[:, b].reshape(-1)
    # A rank's messages to one other rank (of its node: ``dst % k`` names it) are one message.
    keys, inverse = unique_inverse(src * k + dst % k)
    senders = keys // k
    receivers = (senders // k) * k + keys % k
    merged = [
        np.bincount(inverse, weights=held[:, side].reshape(-1)).astype(np.int64)
        for side in (a, b)  # its own tokens, the other's
    ]
    columns: list[list[np.ndarray]] = [[], [], [], [], []]
    for group, (to_heads, scale) in enumerate(kinds):
        tokens = merged[0 if to_heads else 1]
        busy = tokens > 0
        for column, values in zip(
            columns,
            (
                np.full(busy.sum(), group),
                senders[busy],
                receivers[busy],
                tokens[busy],
                np.full(busy.sum(), scale),
            ),
        ):
            column.append(values)
    group, src, dst, tokens, scale = (np.concatenate(c) for c in columns)
    return RingMessages(group, src, dst, tokens, len(kinds), scale)


def attention_seconds(
    plan: Plan,
    cost: CostModel,
    routes: dict[tuple[int, int], Route],
    *,
    sequential: bool = False,
    whole: Local | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the attention compute seconds of one layer and the communication seconds it
    does not hide (module docstring). ``routes``: the routes in use, by edge; ``sequential``:
    every document is its own pass (no overlap between documents); ``whole``: the documents
    whole on one rank as ``split_by_layout`` reads them, where ``plan.sequences`` lists only
    the others, in order (a candidate placement timed without building a record for each of
    its whole documents, ``search/candidate.py``): the same seconds."""
    world, topology = plan.world_size, plan.topology
    allgather = AttentionComm(plan.attention_comm) == AttentionComm.ALLGATHER
    flat = [s for s in plan.sequences if not s.is_two_d] if plan.has_two_d else plan.sequences
    local, zigzag, other = split_by_layout(flat, list(range(len(flat))) if sequential else None)
    if whole is not None:
        assert not sequential and not len(local[0]), "whole documents given twice"
        local = whole
    num_phases = max(map(len, map(attrgetter("ring"), flat)), default=1)
    blocks = zigzag_blocks(zigzag, num_phases, local=local, other=other)
    calls = _Calls(*phase_seconds(blocks, cost, world, merge_ring_phases=allgather))
    messages = ring_messages_of(zigzag, other)
    num_phases, exposed = blocks.num_phases, np.zeros(world)
    two_d = None if sequential or allgather else _two_d(plan, cost)
    if two_d is not None:
        more_calls, rings, exposed, phases = two_d
        num_phases = max(num_phases, phases)
        calls = calls.plus(more_calls, world, num_phases)
        messages = messages.joined(rings)
    compute = np.bincount(calls.rank, weights=calls.seconds, minlength=world)
    kv = cost.model.kv_bytes_per_token()
    groups, ranks, (forward, backward) = transfer_times(
        messages,
        topology,
        cost,
        routes,
        (kv, 2 * kv),
    )
    if allgather:
        # All-gather K/V forward, reduce-scatter dK/dV backward, neither overlapped.
        return compute, np.bincount(ranks, weights=2 * forward, minlength=world)
    # Step k of a pass hides behind phase k of the same pass (the last phase hides nothing).
    steps = max(messages.num_steps, 1)
    wanted = call_key(groups // steps, ranks, groups % steps, world, num_phases)
    keys = calls.keys(world, num_phases)
    hidden = np.zeros(len(wanted))
    if len(keys):
        at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
        hidden = np.where(keys[at] == wanted, calls.seconds[at], 0.0)
    step_exposed = np.maximum(0.0, forward - hidden * FWD_SHARE)
    step_exposed += np.maximum(0.0, backward - hidden * (1 - FWD_SHARE))
    return compute, exposed + np.bincount(ranks, weights=step_exposed, minlength=world)


def _attention_layer(
    plan: Plan, cost: CostModel, routing: bool, *, sequential: bool = False
) -> tuple[list[float], list[float]]:
    """``attention_seconds`` of a plan, with its routes when ``routing``."""
    routes = routes_by_edge(plan, routing=routing)
    compute, exposed = attention_seconds(plan, cost, routes, sequential=sequential)
    return compute.tolist(), exposed.tolist()


def tier_figures(plan: Plan, cost: CostModel, *, routing: bool) -> dict[str, dict]:
    """Each kind of split document alone (intra-node rings, flat inter-node rings, 2-D), one
    layer on its busiest rank: attention compute, transfer and exposed seconds (forward and
    backward), and the forward bytes per link class. What a tier's own steps hide of its own
    transfers; in the step all tiers share the phases and the links (``stepwise``'s timeline,
    which also adds up the transfers)."""
    kinds = {
        "intra": [s for s in plan.sequences if s.tier == Tier.INTRA and not s.is_two_d],
        "inter": [s for s in plan.sequences if s.tier == Tier.INTER and not s.is_two_d],
        "2d": [s for s in plan.sequences if s.is_two_d],
    }
    out = {}
    for name, sequences in kinds.items():
        if not sequences:
            continue
        sub = subplan(plan, tuple(sequences))
        phases = attention_phases(sub, sub.sequences)
        compute = [
            [phase_compute_time(cost, b, diagonal=k == 0) for k, b in enumerate(p)] for p in phases
        ]
        two_d = TwoDLayer.of(sub, cost, routing)
        if two_d is not None:
            compute = two_d.add_compute(cost, compute)
        exposed, transfer = exposed_and_transfer(
            sub, cost, routing, compute, ring_schedule(sub), two_d
        )
        busiest = max(range(sub.world_size), key=lambda r: sum(compute[r]) + exposed[r])
        sent, _ = _bytes(sub, cost, routing, {})
        out[name] = {
            "documents": len(sequences),
            "compute_s": sum(compute[busiest]),
            "transfer_s": transfer[busiest],
            "exposed_s": exposed[busiest],
            "nvlink_bytes": sent.get("nvlink", 0),
            "nic_bytes": sent.get("nic", 0),
        }
    return out


def _linear_seconds(plan: Plan, cost: CostModel, *, layout: str, sequential: bool) -> list[float]:
    """Per rank, linear seconds over its tokens of the ``"linear"`` or ``"attention"`` layout;
    ``sequential``: one GEMM pass per document."""
    world = plan.world_size
    if sequential:
        rank, tokens = [], []
        for seq in plan.sequences:
            held: dict[int, int] = defaultdict(int)
            for span in seq.attention:
                held[span.rank] += span.num_tokens
            rank += list(held)
            tokens += list(held.values())
        times = cost.linear_times(np.asarray(tokens, dtype=np.float64))
        ranks = np.asarray(rank, dtype=np.int64)
        return np.bincount(ranks, weights=times, minlength=world).tolist()
    if layout == "linear":
        counts = [sum(r.end - r.start for r in ranges) for ranges in plan.linear]
    else:
        counts = [0] * world
        for seq in plan.sequences:
            for span in seq.attention:
                counts[span.rank] += span.end - span.start
    return cost.linear_times(np.asarray(counts, dtype=np.float64)).tolist()


def _layer(plan: Plan, cost: CostModel, routing: bool, moved: dict[tuple[int, int], int]) -> _Layer:
    """One layer of ``plan``; ``moved``: its remapping (``remap_matrix``, empty: none)."""
    sequential = plan.meta.get("execution") == "sequential"
    attn_compute, attn_exposed = _attention_layer(plan, cost, routing, sequential=sequential)
    wall = [c + e for c, e in zip(attn_compute, attn_exposed)]
    if moved and not sequential:
        linear = _linear_seconds(plan, cost, layout="linear", sequential=False)
        # Q/K/V (then dQ/dK/dV) to the attention holders, the output (then its gradient) back:
        # four all-to-alls, the same pricing the planner uses to choose the layout.
        by_attention_holder = {(b, a): n for (a, b), n in moved.items()}
        remap_s = remap_seconds(by_attention_holder, plan.topology, cost)
    else:
        linear = _linear_seconds(plan, cost, layout="attention", sequential=sequential)
        remap_s = 0.0
    return _Layer(linear, wall, attn_compute, attn_exposed, remap_s)


def _bytes(
    plan: Plan, cost: CostModel, routing: bool, moved: dict[tuple[int, int], int]
) -> tuple[dict, dict]:
    kv = cost.model.kv_bytes_per_token()
    # One forward's K/V around the flat rings (2-D documents: on the head layout).
    tiers = (Tier.INTRA, Tier.INTER)
    ring = ring_link_bytes(plan, tiers, bytes_per_token=kv, routing=routing)
    for key, value in two_d_forward_bytes(plan, cost, routing).items():
        ring[key] = ring.get(key, 0) + value
    remap_out = {"nvlink": 0, "nic": 0}
    per_token = cost.remap_bytes(1)
    for (a, b), n in moved.items():
        remap_out["nvlink" if plan.topology.same_node(a, b) else "nic"] += n * per_token
    return ring, remap_out


def lower_bound(lengths: list[int], cost: CostModel, world_size: int) -> float:
    """Seconds of the batch's compute spread perfectly over ``world_size`` GPUs (all layers).

    The linear modules count as one call over the whole batch, or as each GPU's even share where
    that is faster: a measured curve that falls for large calls (``Efficiency.fall_tokens``)
    would price the whole batch in one call above what any GPU runs. Attention pays one call
    overhead; a document's own is taken off at the larger of the two curves' (measured curves
    differ), so many documents never add up to more overhead than their calls pay."""
    overhead = max(cost.attention.overhead_s, cost.diagonal.overhead_s)
    attention = sum(max(0.0, cost.document_attention_time(n) - overhead) for n in lengths)
    attention += overhead
    total = sum(lengths)
    share = -(-total // world_size)  # some GPU runs at least this many tokens
    linear = min(cost.linear_time(total), world_size * cost.linear_time(share))
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
        moved = remap_matrix(plan) if remap else {}
        layer = _layer(plan, cost_model, use_routes, moved)
        layer_time = layer_seconds(layer.linear, layer.attention, layer.remap_s)
        step += layers * layer_time
        for r in range(world):
            linear[r] += layers * layer.linear[r]
            attention[r] += layers * layer.attention_compute[r]
            exposed[r] += layers * (layer.attention_exposed[r] + layer.remap_s)
        breakdown["linear_s"] += layers * max(layer.linear)
        breakdown["attention_s"] += layers * max(layer.attention)
        breakdown["remap_s"] += layers * layer.remap_s
        ring, remap_bytes = _bytes(plan, cost_model, use_routes, moved)
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
