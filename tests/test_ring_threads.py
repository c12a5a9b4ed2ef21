"""Tier: threads. The ring-attention engine on N thread-ranks against the dense reference.

Plans over 2 nodes x 2 GPUs and 2 nodes x 3 GPUs, built by hand (documents spanning both nodes,
one node, local ones, one-token documents, lengths not divisible by 2g, rings of 3, 5 and 6, a
non-zigzag placement, uneven shares) and by the planner. Output and dQ/dK/dV must match the
float64 reference to 1e-10 in float64 and 1e-5 in float32; routing must not change results,
the bytes the forward moves must equal ``schedule.link_bytes`` and those of a forward and backward
``schedule.training_link_bytes``.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.attention.layout import (
    RankLayout,
    compact_rows,
    range_rows,
    rows_of,
)
from megatron_zeppelin.attention.pairs import block_pairs
from megatron_zeppelin.attention.ring import _RowSum
from megatron_zeppelin.comm.counters import LinkCounters, comparable
from megatron_zeppelin.comm.exchange import ZeppelinCommError
from megatron_zeppelin.comm.threads import ThreadExchanger, ThreadHub, run_ranks
from megatron_zeppelin.planner.plan.plan import (
    Plan,
    Route,
    RoutePart,
    SequencePlan,
    Span,
    Tier,
    TokenRange,
    share_spans,
    zigzag_spans,
)
from megatron_zeppelin.planner.plan.schedule import link_bytes, ring_schedule, training_link_bytes
from megatron_zeppelin.testing.reference import attention_rows, random_qkv, reference_attention
from megatron_zeppelin.testing.tolerances import assert_close
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.threads

TOPO_2X2 = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2)
TOPO_2X3 = Topology(num_nodes=2, gpus_per_node=3, nics_per_node=3)

DOCS_2X2 = [
    (37, (0, 1, 2, 3)),
    (5, (1,)),
    (1, (2,)),
    (23, (2, 3)),
    (3, (0, 1, 2, 3)),
    (41, (3, 0, 1)),
    (19, (0,)),
    (1, (1, 2)),
]
DOCS_2X3 = [
    (61, (0, 1, 2, 3, 4)),
    (29, (0, 1, 2)),
    (1, (5,)),
    (2, (3, 4, 5)),
    (45, (5, 2)),
    (17, (4,)),
    (1, (1, 4)),
    (50, (2, 3, 4, 5, 0, 1)),
    (13, (3, 4, 5)),
]


def make_plan(topology: Topology, docs, *, spans=None, routed: bool = False) -> Plan:  # noqa: ANN001
    """Zigzag plan for ``(length, ring)`` documents; ``spans`` overrides one document's spans."""
    seqs, linear = [], defaultdict(list)
    for i, (length, ring) in enumerate(docs):
        nodes = {topology.node_of(r) for r in ring}
        tier = Tier.LOCAL if len(ring) == 1 else Tier.INTRA if len(nodes) == 1 else Tier.INTER
        attention = (spans or {}).get(i) or zigzag_spans(length, ring)
        seqs.append(SequencePlan(i, length, tier, ring, tuple(attention)))
        for s in attention:
            linear[s.rank].append(TokenRange(i, s.start, s.end))
    lin = tuple(tuple(linear[r]) for r in range(topology.world_size))
    plan = Plan(topology=topology, sequences=tuple(seqs), linear=lin)
    if not routed:
        return plan
    k = topology.gpus_per_node
    edges = {(m.src, m.dst) for step in ring_schedule(plan) for m in step}
    routes = []
    for src, dst in sorted(e for e in edges if not topology.same_node(*e)):
        a, b = topology.node_of(src), topology.node_of(dst)
        parts = tuple(RoutePart(a * k + j, b * k + j, j + 1) for j in range(k))  # unequal shares
        routes.append(Route(src, dst, parts))
    return Plan(topology=topology, sequences=plan.sequences, linear=lin, routes=tuple(routes))


def run_engine(
    plan: Plan,
    dtype: torch.dtype,
    *,
    heads=(4, 2),
    backward=True,
    routing=True,
    counters=None,
    seed=0,
    device="cpu",
    kernel="torch",
    head_dim=8,
):  # noqa: ANN001
    """Run the engine on every rank; return (reference, gathered) dicts of out/dq/dk/dv (on the
    CPU). Each rank's inputs reach ``device`` from the main thread."""
    nq, nkv = heads
    q, k, v = random_qkv(
        plan.num_tokens, num_heads=nq, num_kv_heads=nkv, head_dim=head_dim, seed=seed
    )
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    ref_out = reference_attention(q, k, v, plan.lengths)
    dout = torch.randn(
        ref_out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )
    ref_out.backward(dout)
    ref = {"out": ref_out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    inputs = {
        rank: [x.detach()[attention_rows(plan, rank)].to(device) for x in (q, k, v, dout)]
        for rank in range(plan.world_size)
    }

    def rank_fn(rank: int, exchanger: ThreadExchanger):
        rows = attention_rows(plan, rank)
        *leaves, dout_rows = inputs[rank]
        ql, kl, vl = (x.clone().requires_grad_() for x in leaves)
        out = ZeppelinAttention(plan, rank, exchanger, kernel=kernel)(ql, kl, vl)
        assert not torch.autograd.is_multithreading_enabled()  # the rank runs its own backward
        if backward:
            out.backward(dout_rows.to(dtype))
        grads = [None if x.grad is None else x.grad.cpu() for x in (ql, kl, vl)]
        return rows, out.detach().cpu(), *grads

    results = run_ranks(rank_fn, plan.world_size, routing=routing, counters=counters, timeout_s=120)
    got = {name: torch.zeros_like(t, dtype=dtype) for name, t in ref.items()}
    for rows, *tensors in results:
        for name, t in zip(got, tensors):
            if t is not None:
                got[name][rows] = t
    return ref, got


PLANS = {
    "2x2": lambda: make_plan(TOPO_2X2, DOCS_2X2),
    "2x3": lambda: make_plan(TOPO_2X3, DOCS_2X3),
    "2x3-not-zigzag": lambda: make_plan(
        TOPO_2X3,
        [(30, (0, 1, 2)), (30, (3, 4, 0)), (9, (5,))],
        spans={
            0: [Span(0, 0, 10), Span(1, 10, 20), Span(2, 20, 30)],
            1: [Span(3, 0, 4), Span(4, 4, 8), Span(3, 8, 12), Span(0, 12, 13), Span(4, 13, 30)],
        },
    ),
    # Uneven shares (``shares.py``): a member at a GPU boundary holds a small part of a ring.
    "2x3-uneven-shares": lambda: make_plan(
        TOPO_2X3,
        [(40, (0, 1, 2)), (31, (2, 3, 4, 5)), (9, (5,))],
        spans={
            0: list(share_spans(40, (0, 1, 2), (17, 19, 4))),
            1: list(share_spans(31, (2, 3, 4, 5), (3, 12, 11, 5))),
        },
    ),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_engine_matches_reference(plan_name: str, dtype: torch.dtype) -> None:
    ref, got = run_engine(PLANS[plan_name](), dtype)
    for name in ("out", "dq", "dk", "dv"):
        assert_close(got[name], ref[name], dtype=dtype, name=f"{plan_name} {name}")


def test_grouped_query_heads_and_multi_query() -> None:
    plan = PLANS["2x2"]()
    for heads in ((6, 3), (4, 1)):
        ref, got = run_engine(plan, torch.float64, heads=heads, seed=3)
        for name in ("out", "dq", "dk", "dv"):
            assert_close(got[name], ref[name], dtype=torch.float64, name=f"{heads} {name}")


def test_routing_keeps_results_and_bytes_match_the_schedule() -> None:
    plan = make_plan(TOPO_2X3, DOCS_2X3, routed=True)
    assert plan.routes
    counters = [LinkCounters(plan.topology) for _ in range(plan.world_size)]
    ref, got = run_engine(plan, torch.float64, backward=False, counters=counters)
    assert_close(got["out"], ref["out"], dtype=torch.float64, name="routed out")
    measured = LinkCounters.merged(plan.topology, [c.to_dict() for c in counters]).to_dict()
    # Forward moves K and V: 2 * nkv * d values of 8 bytes per token.
    predicted = link_bytes(plan, ring_schedule(plan), bytes_per_token=2 * 2 * 8 * 8, routing=True)
    assert measured == comparable(predicted)
    assert measured["nic"] > 0 and len([key for key in measured if key.startswith("nic:")]) > 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("routing", [True, False])
def test_forward_and_backward_bytes_match_the_training_prediction(dtype, routing) -> None:  # noqa: ANN001
    plan = make_plan(TOPO_2X3, DOCS_2X3, routed=True)
    counters = [LinkCounters(plan.topology) for _ in range(plan.world_size)]
    run_engine(plan, dtype, routing=routing, counters=counters)
    measured = LinkCounters.merged(plan.topology, [c.to_dict() for c in counters]).to_dict()
    per_token = 2 * 2 * 8 * dtype.itemsize  # K and V (and dK, dV): 2 x nkv x d values
    predicted = training_link_bytes(
        plan, kv_bytes_per_token=per_token, grad_bytes_per_token=per_token, routing=routing
    )
    assert measured == comparable(predicted)
    if not routing:
        # Backward resends K/V, and over a whole ring the gradients are as many rows as the
        # blocks (each block's gradient makes g - 1 hops): three times the forward in all.
        forward = link_bytes(plan, ring_schedule(plan), bytes_per_token=per_token, routing=False)
        assert measured["nvlink"] + measured["nic"] == 3 * (forward["nvlink"] + forward["nic"])


def test_planner_plans_match_reference() -> None:
    partition = pytest.importorskip("megatron_zeppelin.planner.search.partition")
    from megatron_zeppelin.planner.baselines.distributions import sample_lengths
    from megatron_zeppelin.planner.cost.costmodel import CostModel
    from megatron_zeppelin.planner.cost.models import get_model

    cost = CostModel.default(get_model("tiny"), TOPO_2X3)
    tiers_seen: set[str] = set()
    for name, seed in (("prolong", 3), ("wlbllm", 3)):
        lengths = sample_lengths(name, num_tokens=700, seed=seed, max_length=400) + [1, 2, 9, 31]
        plan = partition.plan_batch(
            lengths,
            topology=TOPO_2X3,
            cost_model=cost,
            capacity=150,
            options=partition.PlannerOptions(thresholds=(8, 16)),
        )
        tiers_seen |= {t for t, n in plan.tier_counts().items() if n}
        ref, got = run_engine(plan, torch.float64, seed=seed)
        for key in ("out", "dq", "dk", "dv"):
            assert_close(got[key], ref[key], dtype=torch.float64, name=f"{name} {key}")
    assert tiers_seen == {"local", "intra", "inter"}


def test_pool_placement_plans_match_reference() -> None:
    """A plan of the pool placement (``planner/place/pool.py``): a ring across nodes over part of
    the nodes' GPUs beside whole documents, forward and backward exact."""
    from megatron_zeppelin.planner.cost.costmodel import CostModel
    from megatron_zeppelin.planner.cost.models import get_model
    from megatron_zeppelin.planner.cost.thresholds import tier_thresholds
    from megatron_zeppelin.planner.place.loads import Loads
    from megatron_zeppelin.planner.place.pool import place_pool
    from megatron_zeppelin.planner.place.tiers import TierRules, assign_tiers, chunk_thresholds

    cost = CostModel.default(get_model("tiny"), TOPO_2X3)
    thresholds = tier_thresholds(cost)
    rules = TierRules(True, True, thresholds, chunk_thresholds(thresholds, TOPO_2X3, True))
    lengths = np.array([350, 60, 37, 20, 9, 3, 1])  # 350 tokens fit no node of 3 x 100
    loads = Loads(TOPO_2X3, 100, cost, TOPO_2X3.nics_per_node)
    choice = assign_tiers(lengths, loads, rules)
    placements, _ = place_pool(lengths, choice, loads, rules.chunks[1], None)
    assert any(p.tier == Tier.INTER and len(p.ring) % 3 for p in placements)
    plan = make_plan(TOPO_2X3, [(int(n), p.ring) for n, p in zip(lengths, placements)])
    ref, got = run_engine(plan, torch.float64, seed=5)
    for key in ("out", "dq", "dk", "dv"):
        assert_close(got[key], ref[key], dtype=torch.float64, name=f"pool {key}")


def test_zigzag_needs_one_kernel_call_per_step() -> None:
    plan = make_plan(TOPO_2X3, DOCS_2X3)
    for rank in range(plan.world_size):
        layout = RankLayout(plan, rank)
        assert [c.batch.causal for c in layout.own_calls] == [True]
        for tier in layout.tiers:
            for step in tier.steps:
                assert all(not call.batch.causal for call in step.calls)
                assert len(step.calls) <= 1


@st.composite
def _span_layout(draw):  # noqa: ANN202
    length = draw(st.integers(1, 30))
    cuts = sorted(set(draw(st.lists(st.integers(1, length - 1), max_size=6)))) if length > 1 else []
    bounds = list(zip([0, *cuts], [*cuts, length]))
    owner = draw(st.lists(st.booleans(), min_size=len(bounds), max_size=len(bounds)))
    mine = [b for b, o in zip(bounds, owner) if o]
    theirs = [b for b, o in zip(bounds, owner) if not o] or mine
    return mine, theirs


@settings(max_examples=examples(150), deadline=None)
@given(layout=_span_layout())
def test_block_pairs_cover_each_visible_entry_once(layout) -> None:  # noqa: ANN001
    mine, theirs = layout

    def with_rows(spans):  # noqa: ANN001, ANN202
        out, row = [], 0
        for s, e in spans:
            out.append((s, e, row))
            row += e - s
        return out, [p for s, e in spans for p in range(s, e)]

    q_spans, q_pos = with_rows(mine)
    k_spans, k_pos = with_rows(theirs)
    seen = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int64)
    for p in block_pairs(q_spans, k_spans):
        lq, lk = p.q_end - p.q_start, p.k_end - p.k_start
        block = torch.ones(lq, lk, dtype=torch.int64)
        seen[p.q_start : p.q_end, p.k_start : p.k_end] += block.tril(lk - lq) if p.causal else block
    want = (torch.tensor(k_pos)[None, :] <= torch.tensor(q_pos)[:, None]).long()
    assert torch.equal(seen, want)


def test_engine_rejects_bad_inputs() -> None:
    plan = make_plan(TOPO_2X2, DOCS_2X2)
    hub = ThreadHub(plan.world_size)
    engine = ZeppelinAttention(plan, 1, ThreadExchanger(hub, 1), kernel="torch")
    t = engine.num_tokens
    q, k, v = random_qkv(t, num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="attention layout"):
        engine(q[:-1], k[:-1], v[:-1])
    with pytest.raises(ValueError, match="share a dtype"):
        engine(q, k.float(), v)
    with pytest.raises(ValueError, match="multiple"):
        engine(q[:, :3], k, v)
    with pytest.raises(ValueError, match="exchanger spans"):
        ZeppelinAttention(plan, 0, ThreadExchanger(ThreadHub(6), 0))
    with pytest.raises(ValueError, match="unknown attention kernel"):
        ZeppelinAttention(plan, 0, ThreadExchanger(hub, 0), kernel="nope")


def test_exchanger_misuse_and_missing_peers_raise() -> None:
    plan = make_plan(TOPO_2X2, DOCS_2X2)
    step = ring_schedule(plan)[0]
    hub = ThreadHub(plan.world_size)
    exchanger = ThreadExchanger(hub, 1, timeout_s=0.3)
    sends = {(m.src, m.dst): torch.zeros(m.num_tokens, 2) for m in step if m.src == 1}
    pending = exchanger.start(step, sends, row_shape=(2,), dtype=torch.float32, tag="t")
    with pytest.raises(ZeppelinCommError, match="timed out"):  # nobody else sends
        pending.wait()
    with pytest.raises(ZeppelinCommError, match="twice"):
        pending.wait()
    with pytest.raises(ZeppelinCommError, match="needs"):
        bad = {key: t[:, :1] for key, t in sends.items()}
        exchanger.start(step, bad, row_shape=(2,), dtype=torch.float32, tag="t2")


def test_a_failing_rank_fails_the_run_quickly() -> None:
    plan = make_plan(TOPO_2X2, DOCS_2X2)

    def rank_fn(rank: int, exchanger: ThreadExchanger):
        if rank == 2:
            raise RuntimeError("boom")
        q, k, v = random_qkv(plan.num_attention_tokens(rank), num_heads=2, head_dim=4)
        return ZeppelinAttention(plan, rank, exchanger, kernel="torch")(q, k, v)

    with pytest.raises(RuntimeError, match="rank 2 failed"):
        run_ranks(rank_fn, plan.world_size, timeout_s=30)


@settings(max_examples=examples(100), deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), min_size=1, max_size=4),
    num_rows=st.integers(0, 60),
)
def test_compact_rows_names_the_same_rows(runs, num_rows) -> None:  # noqa: ANN001
    index = rows_of([a for a, _ in runs], [a + n for a, n in runs])
    num_rows = max(num_rows, int(index.max()) + 1 if index.numel() else 0)
    rows = compact_rows(index, num_rows)
    assert torch.equal(torch.arange(num_rows)[slice(None) if rows is None else rows], index)
    consecutive = index.numel() > 0 and bool((index.diff() == 1).all())
    assert isinstance(rows, torch.Tensor) != consecutive


@settings(max_examples=examples(100), deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), min_size=0, max_size=4),
    num_rows=st.integers(0, 60),
)
def test_range_rows_matches_the_compacted_index(runs, num_rows) -> None:  # noqa: ANN001
    starts, ends = [a for a, _ in runs], [a + n for a, n in runs]
    index = rows_of(starts, ends)
    num_rows = max(num_rows, int(index.max()) + 1 if index.numel() else 0)
    fast, slow = range_rows(starts, ends, num_rows), compact_rows(index, num_rows)
    if isinstance(slow, torch.Tensor):
        assert isinstance(fast, torch.Tensor) and torch.equal(fast, slow)
    else:
        assert fast == slow


def test_zigzag_ring_steps_take_views_not_gathers() -> None:
    # One long document over both nodes and one over a node, plus local ones: the shape of a
    # planned micro-batch. Every ring-step index must be a view (no gather, no scatter).
    plan = make_plan(TOPO_2X3, [(96, (0, 1, 2, 3, 4, 5)), (36, (3, 4, 5)), (7, (0,)), (5, (3,))])
    num_indices = 0
    for rank in range(plan.world_size):
        for tier in RankLayout(plan, rank).tiers:
            steps = tier.steps
            indices = [i for s in steps for c in s.calls for i in (c.q_index, c.k_index)]
            indices += [
                i for s in steps for sends in (s.sends, s.grad_sends) for i in sends.values()
            ]
            moves = [m for s in steps for m in (s.grad_to_next, s.grad_to_own) if m is not None]
            indices += [i for m in moves for i in (m.src, m.dst)]
            assert not any(isinstance(i, torch.Tensor) for i in indices), (rank, tier.tier)
            num_indices += len(indices)
    assert num_indices > 6 * 5 * 3  # every rank of the big ring: calls, sends, gradients


def test_row_sum_adds_parts_and_never_writes_into_a_view_it_was_given() -> None:
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(6, 2, 3, generator=gen, dtype=torch.float64) for _ in range(4)]
    expected = parts[0] + parts[1] + parts[2]
    expected[[1, 4]] += parts[3][:2]
    total = _RowSum((6, 2, 3), torch.float64, torch.device("cpu"))
    total.add(None, parts[0])  # a full first part (what a kernel returns for the whole buffer)
    total.add(slice(0, 6), parts[1])
    total.add(None, parts[2])
    total.add(torch.tensor([1, 4]), parts[3][:2])
    assert torch.allclose(total.result(), expected, rtol=0, atol=1e-12)
    # A first part that is a view of a buffer still in use (one half of a received K/V
    # gradient) must come out of later additions unchanged.
    both = torch.randn(6, 2, 2, 3, generator=gen, dtype=torch.float64)
    kept = both.clone()
    half = _RowSum((6, 2, 3), torch.float64, torch.device("cpu"))
    half.add(None, both[:, 0])
    half.add(None, parts[0])
    assert torch.equal(both, kept)
    assert torch.allclose(half.result(), kept[:, 0] + parts[0], rtol=0, atol=1e-12)
    # A first partial part starts from zeros; nothing added gives zeros of the buffer's shape.
    partial = _RowSum((6, 2, 3), torch.float64, torch.device("cpu"))
    partial.add(slice(2, 4), parts[0][:2])
    assert torch.equal(partial.result()[2:4], parts[0][:2]) and not partial.result()[:2].any()
    empty = _RowSum((6, 2, 3), torch.float32, torch.device("cpu"))
    assert empty.result().shape == (6, 2, 3) and empty.result().dtype == torch.float32
    assert not empty.result().any()


def test_one_engine_serves_many_layers_without_sharing_buffers() -> None:
    plan = PLANS["2x3"]()
    q, k, v = random_qkv(plan.num_tokens, num_heads=4, num_kv_heads=2, head_dim=8, seed=9)

    def rank_fn(rank: int, exchanger: ThreadExchanger):
        rows = attention_rows(plan, rank)
        attention = ZeppelinAttention(plan, rank, exchanger, kernel="torch")
        layers = []
        for scale in (1.0, 2.0):  # two layers, the second's inputs differ
            ql, kl, vl = (x[rows] * scale for x in (q, k, v))
            leaves = [x.clone().requires_grad_() for x in (ql, kl, vl)]
            out = attention(*leaves)
            out.backward(torch.ones_like(out))
            layers.append((out.detach(), *(x.grad for x in leaves)))
        return rows, layers

    results = run_ranks(rank_fn, plan.world_size, timeout_s=120)
    for layer, scale in enumerate((1.0, 2.0)):
        ql, kl, vl = (x.detach().mul(scale).requires_grad_() for x in (q, k, v))
        ref_out = reference_attention(ql, kl, vl, plan.lengths)
        ref_out.backward(torch.ones_like(ref_out))
        for name, ref in zip(("out", "dq", "dk", "dv"), (ref_out, ql.grad, kl.grad, vl.grad)):
            got = torch.zeros_like(ref)
            for rows, layers in results:
                got[rows] = layers[layer][("out", "dq", "dk", "dv").index(name)]
            assert_close(got, ref.detach(), dtype=torch.float64, name=f"layer {layer} {name}")


def test_uneven_shares_move_the_bytes_the_schedule_predicts() -> None:
    """A ring across nodes with uneven shares, routed: forward and backward bytes per link class
    and per NIC equal ``schedule.training_link_bytes``."""
    spans = {0: list(share_spans(44, (1, 2, 3, 4), (5, 17, 16, 6)))}
    plan = make_plan(TOPO_2X3, [(44, (1, 2, 3, 4)), (12, (0,))], spans=spans, routed=True)
    assert plan.routes
    counters = [LinkCounters(plan.topology) for _ in range(plan.world_size)]
    ref, got = run_engine(plan, torch.float64, counters=counters)
    for name in ("out", "dq", "dk", "dv"):
        assert_close(got[name], ref[name], dtype=torch.float64, name=f"uneven {name}")
    measured = LinkCounters.merged(plan.topology, [c.to_dict() for c in counters]).to_dict()
    per_token = 2 * 2 * 8 * 8
    predicted = training_link_bytes(
        plan, kv_bytes_per_token=per_token, grad_bytes_per_token=per_token, routing=True
    )
    assert measured == comparable(predicted) and measured["nic"] > 0
