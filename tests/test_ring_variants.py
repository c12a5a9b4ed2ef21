"""Megatron's attention variants in the ring engine: sliding windows and sinks.

Tier: threads (the ring tests), pure (the kernel pairs and the sink maths). The engine on
thread-ranks against the dense float64 reference (``testing.reference``) with Megatron's
maths: a window (``--window-size w,0``: query ``p`` sees key positions ``p - w .. p`` of its
document) and a sink (``--softmax-type``: one logit per head in every row's softmax
denominator). Windows of 0, 2 and 5 positions (narrower than a ring chunk, so ring blocks fall
wholly or partly outside the band), 30 (wider than chunks, narrower than documents) and one
wider than every document, on flat rings (zigzag, not zigzag, uneven shares) and on the 2-D
scheme; output, dQ/dK/dV and the sink's gradient to 1e-10 in float64.
"""

from __future__ import annotations

import pytest
import torch
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ring_threads import PLANS as FLAT_PLANS
from test_ring_threads import make_plan
from test_two_d_threads import PLANS as TWO_D_PLANS

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.attention.layout import RankLayout
from megatron_zeppelin.attention.merge import add_sink_, sink_gradient
from megatron_zeppelin.attention.pairs import block_pairs
from megatron_zeppelin.comm.threads import ThreadExchanger, ThreadHub, run_ranks
from megatron_zeppelin.planner.plan.plan import Plan, SequencePlan, Span, Tier, TokenRange
from megatron_zeppelin.testing.reference import attention_rows, random_qkv, reference_attention
from megatron_zeppelin.testing.tolerances import assert_close
from megatron_zeppelin.topology.model import Topology

NAMES = ("out", "dq", "dk", "dv", "dsink")


def run_variant(plan: Plan, *, layers, heads=(4, 2), seed=0, dtype=torch.float64):  # noqa: ANN001
    """Every rank runs one engine over ``layers`` (``(window, sink_n)`` per layer, one engine
    for all of them, as Megatron's layers share a micro-batch's engine); returns, per layer,
    the reference and the gathered ``out``, ``dq``, ``dk``, ``dv`` and ``dsink``."""
    nq, nkv = heads
    gen = torch.Generator().manual_seed(seed + 1)
    q, k, v = random_qkv(plan.num_tokens, num_heads=nq, num_kv_heads=nkv, head_dim=8, seed=seed)
    douts = [torch.randn(q.shape, generator=gen, dtype=torch.float64) for _ in layers]

    def rank_fn(rank: int, exchanger: ThreadExchanger):
        rows = attention_rows(plan, rank)
        engine = ZeppelinAttention(plan, rank, exchanger, kernel="torch")
        got = []
        for (window, sink), dout in zip(layers, douts):
            ql, kl, vl = (x[rows].to(dtype).requires_grad_() for x in (q, k, v))
            s = None if sink is None else sink.detach().to(dtype).clone().requires_grad_()
            out = engine(ql, kl, vl, window=window, sink_n=s)
            out.backward(dout[rows].to(dtype))
            got.append((out.detach(), ql.grad, kl.grad, vl.grad, None if s is None else s.grad))
        return rows, got

    results = run_ranks(rank_fn, plan.world_size, timeout_s=120)
    compared = []
    for layer, ((window, sink), dout) in enumerate(zip(layers, douts)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        s = None if sink is None else sink.detach().clone().requires_grad_()
        ref = reference_attention(*leaves, plan.lengths, window=window, sink_n=s)
        ref.backward(dout)
        want = [ref.detach(), *(x.grad for x in leaves), None if s is None else s.grad]
        got = [torch.zeros_like(w) if w is not None else None for w in want]
        for rows, per_layer in results:
            for i, t in enumerate(per_layer[layer][:4]):
                got[i][rows] = t.to(torch.float64)
            if s is not None:
                got[4] += per_layer[layer][4].to(torch.float64)
        compared.append((want, got))
    return compared


def _assert_layers(compared, *, dtype=torch.float64, label: str = "") -> None:  # noqa: ANN001
    for layer, (want, got) in enumerate(compared):
        for name, w, g in zip(NAMES, want, got):
            if w is not None:
                assert_close(g, w, dtype=dtype, name=f"{label} layer {layer} {name}")


SINK = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)


@pytest.mark.threads
@pytest.mark.parametrize("plan_name", sorted(FLAT_PLANS))
def test_flat_rings_with_windows_match_the_reference(plan_name: str) -> None:
    # Windows narrower than every chunk, a few chunks wide, and one per layer of one engine.
    layers = [(0, SINK), (2, None), (5, SINK), (30, None), (None, SINK)]
    _assert_layers(run_variant(FLAT_PLANS[plan_name](), layers=layers), label=plan_name)


@pytest.mark.threads
@pytest.mark.parametrize("plan_name", sorted(TWO_D_PLANS))
def test_two_d_documents_with_windows_and_sinks_match_the_reference(plan_name: str) -> None:
    plan = TWO_D_PLANS[plan_name]()
    heads = (6, 6) if plan.topology.gpus_per_node == 3 else (4, 2)
    sink = torch.linspace(-1.0, 1.5, heads[0], dtype=torch.float64)
    layers = [(3, None), (11, sink), (None, sink)]
    _assert_layers(run_variant(plan, layers=layers, heads=heads, seed=2), label=plan_name)


@pytest.mark.threads
def test_float32_and_a_window_wider_than_every_document() -> None:
    plan = FLAT_PLANS["2x3"]()
    _assert_layers(
        run_variant(plan, layers=[(4, SINK), (1000, None)], dtype=torch.float32, seed=5),
        dtype=torch.float32,
        label="float32",
    )
    # A window wider than every document is no window: the same calls as the plain layout.
    for rank in range(plan.world_size):
        plain, wide = RankLayout(plan, rank), RankLayout(plan, rank, window=1000)
        batches = lambda layout: [  # noqa: E731
            (c.batch.causal, c.batch.window, c.batch.lengths_q.tolist())
            for c in [
                *layout.own_calls,
                *(c for t in layout.tiers for s in t.steps for c in s.calls),
            ]
        ]
        assert batches(wide) == batches(plain)


@pytest.mark.threads
def test_ring_blocks_outside_the_band_cost_no_compute() -> None:
    """One 96-token document over six ranks (chunks of 8): with a window of 4 most ring steps
    compute nothing for most ranks, though every block still travels the ring."""
    topo = Topology(num_nodes=2, gpus_per_node=3, nics_per_node=3)
    plan = make_plan(topo, [(96, (0, 1, 2, 3, 4, 5))])
    for rank in range(plan.world_size):
        plain, narrow = RankLayout(plan, rank), RankLayout(plan, rank, window=4)
        steps = [s for t in narrow.tiers for s in t.steps]
        assert all(s.kv for s in steps)  # the schedule is unchanged
        assert sum(not s.calls for s in steps) >= 3, rank  # at most two neighbours' chunks
        pairs = lambda layout: sum(  # noqa: E731
            int(c.batch.lengths_q @ c.batch.lengths_k)
            for c in [
                *layout.own_calls,
                *(c for t in layout.tiers for s in t.steps for c in s.calls),
            ]
        )
        assert pairs(narrow) < pairs(plain) / 3
    _assert_layers(run_variant(plan, layers=[(4, None)], seed=7), label="96 over 6")


@pytest.mark.pure
def test_sink_gradient_passes_gradcheck_through_a_local_plan() -> None:
    """The autograd function on one rank (local documents, a window, a sink): its gradients,
    the sink's included, against finite differences in float64."""
    topo = Topology(num_nodes=1, gpus_per_node=1, nics_per_node=1)
    lengths = (5, 1, 8)
    seqs = tuple(
        SequencePlan(i, n, Tier.LOCAL, (0,), (Span(0, 0, n),)) for i, n in enumerate(lengths)
    )
    linear = ((*(TokenRange(i, 0, n) for i, n in enumerate(lengths)),),)
    plan = Plan(topology=topo, sequences=seqs, linear=linear)
    engine = ZeppelinAttention(plan, 0, ThreadExchanger(ThreadHub(1), 0), kernel="torch")
    q, k, v = random_qkv(sum(lengths), num_heads=2, num_kv_heads=1, head_dim=4, seed=3)
    sink = torch.tensor([0.3, -0.7], dtype=torch.float64)
    inputs = tuple(x.requires_grad_() for x in (q, k, v, sink))
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: engine(q, k, v, window=3, sink_n=s), inputs, atol=1e-7, fast_mode=True
    )


@pytest.mark.pure
def test_sink_maths_equals_one_more_zero_key() -> None:
    gen = torch.Generator().manual_seed(11)
    scores = torch.randn(5, 3, 6, generator=gen, dtype=torch.float64)  # rows, heads, keys
    values = torch.randn(5, 3, 6, 4, generator=gen, dtype=torch.float64)
    sink = torch.tensor([0.0, 1.5, -2.0], dtype=torch.float64)
    lse = scores.logsumexp(-1)
    out = torch.einsum("rhk,rhkd->rhd", torch.softmax(scores, -1), values)
    add_sink_(out, lse, sink)
    # Megatron's SoftmaxOne: the sink logit appended as one more column, then dropped.
    with_sink = torch.cat([scores, sink.expand(5, 3)[..., None]], -1).softmax(-1)[..., :-1]
    torch.testing.assert_close(out, torch.einsum("rhk,rhkd->rhd", with_sink, values))
    torch.testing.assert_close(
        lse, torch.cat([scores, sink.expand(5, 3)[..., None]], -1).logsumexp(-1)
    )
    # A row that saw no key stays empty and adds nothing to the sink's gradient.
    empty_out, empty_lse = torch.zeros(1, 3, 4, dtype=torch.float64), torch.full((1, 3), -torch.inf)
    add_sink_(empty_out, empty_lse, sink)
    assert not empty_out.any() and torch.isneginf(empty_lse).all()
    grad = sink_gradient(torch.ones(1, 3, 4, dtype=torch.float64), empty_out, empty_lse, sink)
    assert torch.equal(grad, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="one logit per head"):
        add_sink_(out, lse, sink[:2])


@st.composite
def _spans(draw):  # noqa: ANN202
    length = draw(st.integers(1, 40))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, length - 1)), max_size=6))))
    bounds = [(a, b) for a, b in zip([0, *cuts], [*cuts, length]) if b > a]
    owner = draw(st.lists(st.booleans(), min_size=len(bounds), max_size=len(bounds)))
    mine = [b for b, o in zip(bounds, owner) if o]
    theirs = [b for b, o in zip(bounds, owner) if not o] or mine
    return mine, theirs


@pytest.mark.pure
@settings(max_examples=examples(200), deadline=None)
@given(layout=_spans(), window=st.integers(0, 45))
def test_windowed_pairs_cover_each_visible_entry_once(layout, window: int) -> None:  # noqa: ANN001
    mine, theirs = layout

    def with_rows(spans):  # noqa: ANN001, ANN202
        out, row = [], 0
        for s, e in spans:
            out.append((s, e, row))
            row += e - s
        return out, torch.tensor([p for s, e in spans for p in range(s, e)])

    (q_spans, q_pos), (k_spans, k_pos) = with_rows(mine), with_rows(theirs)
    seen = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int64)
    for p in block_pairs(q_spans, k_spans, window):
        lq, lk = p.q_end - p.q_start, p.k_end - p.k_start
        block = torch.ones(lq, lk, dtype=torch.int64)
        block = block.tril(lk - lq) if p.causal else block
        block = block.triu(lk - lq - p.window) if p.window is not None else block
        assert block.sum(1).min() > 0, "a pair with a query that sees no key"
        seen[p.q_start : p.q_end, p.k_start : p.k_end] += block
    distance = q_pos[:, None] - k_pos[None, :]
    assert torch.equal(seen, ((distance >= 0) & (distance <= window)).long())
