"""Remapping between the linear and the attention layout.

Tier: pure (``planner.plan.remap_layout`` against a simulated all-to-all over random layouts, with
Hypothesis) and processes (``comm.remap`` on 4 gloo ranks: forward, backward, round trip).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from test_comm_exchange import hand_plan

from megatron_zeppelin.launch.ranks import run_distributed
from megatron_zeppelin.planner.plan.plan import TokenRange
from megatron_zeppelin.planner.plan.remap_layout import (
    RemapLayout,
    attention_to_linear_layout,
    linear_to_attention_layout,
    plan_layouts,
    remap_between,
    remap_pair,
)

Layout = list[list[TokenRange]]


def token_ids(ranges: list[TokenRange]) -> np.ndarray:
    """One id per token of a buffer: which document and which position."""
    ids = [np.arange(r.start, r.end) + 1_000_000 * r.seq for r in ranges]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)


def simulate(layouts: list[RemapLayout], buffers: list[np.ndarray]) -> list[np.ndarray]:
    """What ``all_to_all_single`` with these splits and gathers would leave on every rank."""
    world = len(layouts)
    chunks = []
    for lay, buf in zip(layouts, buffers):
        send = buf[lay.send_index]
        chunks.append(np.split(send, np.cumsum(lay.send_counts)[:-1]))
    out = []
    for r, lay in enumerate(layouts):
        recv = np.concatenate([chunks[s][r] for s in range(world)])
        assert [len(chunks[s][r]) for s in range(world)] == list(lay.recv_counts)
        out.append(recv[lay.recv_index])
    return out


@st.composite
def two_layouts(draw) -> tuple[Layout, Layout]:
    """Two random layouts of the same documents over the same ranks."""
    world = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))

    def layout() -> Layout:
        out: Layout = [[] for _ in range(world)]
        for seq, length in enumerate(lengths):
            cuts = (
                sorted(set(draw(st.lists(st.integers(1, length - 1), max_size=4))))
                if length > 1
                else []
            )
            bounds = [0, *cuts, length]
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                out[draw(st.integers(0, world - 1))].append(TokenRange(seq, lo, hi))
        for ranges in out:  # any order within a rank's buffer is allowed
            order = draw(st.permutations(range(len(ranges))))
            ranges[:] = [ranges[i] for i in order]
        return out

    return layout(), layout()


@pytest.mark.pure
@settings(max_examples=examples(60), deadline=None)
@given(two_layouts())
def test_simulated_remap_lands_every_token_where_the_target_layout_says(layouts):
    src, dst = layouts
    world = len(src)
    moves = [remap_between(src, dst, r) for r in range(world)]
    out = simulate(moves, [token_ids(src[r]) for r in range(world)])
    for r in range(world):
        assert np.array_equal(out[r], token_ids(dst[r]))
    # The inverse brings every token home, whatever order the forward used.
    back = simulate([m.inverse() for m in moves], out)
    for r in range(world):
        assert np.array_equal(back[r], token_ids(src[r]))
    # Splits agree pairwise: what r sends to s is what s expects from r.
    for r in range(world):
        for s in range(world):
            assert moves[r].send_counts[s] == moves[s].recv_counts[r]


@pytest.mark.pure
def test_plan_remap_keeps_rows_that_stay_and_round_trips():
    plan = hand_plan()
    world = plan.world_size
    there = [linear_to_attention_layout(plan, r) for r in range(world)]
    back = [attention_to_linear_layout(plan, r) for r in range(world)]
    linear = [token_ids(plan.linear_ranges(r)) for r in range(world)]
    attention = simulate(there, linear)
    for r in range(world):
        assert np.array_equal(attention[r], token_ids(plan.attention_ranges(r)))
        # A token present in both of a rank's buffers never leaves the rank.
        kept = len(np.intersect1d(linear[r], attention[r]))
        assert there[r].send_counts[r] == kept
        assert there[r].moved_rows == len(linear[r]) - kept
    assert all(np.array_equal(a, b) for a, b in zip(simulate(back, attention), linear))


@pytest.mark.pure
def test_a_plans_layouts_and_remaps_worked_out_at_once_are_those_of_each_rank():
    """``plan_layouts`` (one pass over the spans) and ``remap_pair`` (both directions from one
    set of owners) give what asking ``Plan`` rank by rank, and ``remap_between``, give."""
    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.megatron.plans.plan_workers import PlanRecipe
    from megatron_zeppelin.planner.baselines.distributions import sample_lengths
    from megatron_zeppelin.planner.cost.costmodel import CostModel
    from megatron_zeppelin.planner.cost.models import get_model
    from megatron_zeppelin.topology.presets import get_topology

    topology = get_topology("zeppelin-C", num_nodes=4)
    config = ZeppelinConfig(capacity=32768)
    cost = CostModel.default(get_model("llama-7b"), topology)
    wide = PlanRecipe(topology, cost, config, config.planner_options(cost))(
        sample_lengths("prolong", num_tokens=1 << 20, seed=1)
    )
    for plan in (hand_plan(), wide):
        world = plan.world_size
        linear = [plan.linear_ranges(r) for r in range(world)]
        attention = [plan.attention_ranges(r) for r in range(world)]
        assert plan_layouts(plan) == (linear, attention) and linear != attention
        for rank in range(0, world, 3):
            pair = remap_pair(plan, rank)
            alone = remap_between(linear, attention, rank), remap_between(attention, linear, rank)
            for got, want in zip(pair, alone):
                assert (got.send_counts, got.recv_counts) == (want.send_counts, want.recv_counts)
                assert np.array_equal(got.send_index, want.send_index)
                assert np.array_equal(got.recv_index, want.recv_index)


# --- processes ------------------------------------------------------------------------------


def _remap_worker(rank: int, world_size: int) -> None:
    from megatron_zeppelin.comm.remap import attention_to_linear, linear_to_attention

    plan = hand_plan()
    ids = torch.as_tensor(token_ids(plan.linear_ranges(rank)), dtype=torch.float64)
    x_tf = torch.stack([ids, -ids, ids * 0.5], dim=1).requires_grad_(True)
    y_tf = linear_to_attention(x_tf, plan, rank, None)
    expected = torch.as_tensor(token_ids(plan.attention_ranges(rank)), dtype=torch.float64)
    assert torch.equal(y_tf[:, 0], expected) and torch.equal(y_tf[:, 1], -expected)
    z_tf = attention_to_linear(y_tf, plan, rank, None)
    assert torch.equal(z_tf, x_tf)  # round trip forward
    # Backward of the round trip is the identity too; and the gradient of one direction alone
    # is the other direction applied to the upstream gradient.
    upstream = torch.randn(
        z_tf.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)
    )
    (grad,) = torch.autograd.grad(z_tf, x_tf, upstream)
    assert torch.equal(grad, upstream)
    g_attn = torch.randn(
        y_tf.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9 + rank)
    )
    (grad,) = torch.autograd.grad(y_tf, x_tf, g_attn, retain_graph=True)
    assert torch.equal(grad, attention_to_linear(g_attn, plan, rank, None))
    try:
        linear_to_attention(x_tf[1:], plan, rank, None)
    except ValueError as exc:
        assert "buffer order" in str(exc)
    else:
        raise AssertionError("a tensor with the wrong token count was accepted")


@pytest.mark.dist
def test_remap_all_to_all_forward_backward_and_round_trip():
    run_distributed(_remap_worker, hand_plan().world_size, timeout_s=60.0)
