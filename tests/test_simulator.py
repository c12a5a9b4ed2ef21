"""Properties of the step-time simulator: monotone in bandwidth, exact on one GPU, bounded below,
routing relieves NIC-bound plans, and byte counts agree with the ring schedule.

Tier: pure.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from examples import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_zeppelin.planner.baselines.baselines import (
    BASELINES,
    build_baseline,
    plan_without_remap,
)
from megatron_zeppelin.planner.baselines.baselines import sequence_on as place
from megatron_zeppelin.planner.cost.calibration import apply_calibration, load_calibration
from megatron_zeppelin.planner.cost.costmodel import CostModel, LinkCost
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.plan import Plan, Route, RoutePart, TokenRange
from megatron_zeppelin.planner.plan.schedule import Message, Segment, link_bytes, ring_schedule
from megatron_zeppelin.planner.simulate.simulator import (
    simulate,
    simulate_rounds,
    step_transfer_times,
)
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

TOPO = Topology(num_nodes=2, gpus_per_node=4, nics_per_node=2)
CAPACITY = 4096
MODEL = get_model("llama-7b")
COST = CostModel.default(MODEL, TOPO)
H100 = Path(__file__).resolve().parents[1] / "configs" / "calibration" / "h100-bf16-llama-7b.json"
MEASURED = apply_calibration(COST, load_calibration(str(H100)), source=str(H100))
SLOW = settings(
    max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

batches = st.lists(st.integers(1, 3 * CAPACITY), min_size=1, max_size=30)


def faster(cost: CostModel, factor: float) -> CostModel:
    return cost.with_figures(
        "test",
        nvlink=LinkCost(cost.nvlink.bytes_per_s * factor, cost.nvlink.latency_s),
        nic=LinkCost(cost.nic.bytes_per_s * factor, cost.nic.latency_s),
    )


@SLOW
@given(lengths=batches, name=st.sampled_from(BASELINES), factor=st.floats(1.0, 50.0))
def test_more_bandwidth_never_slows_a_plan(lengths, name, factor) -> None:
    plans = build_baseline(name, lengths, topology=TOPO, capacity=CAPACITY, cost_model=COST)
    slow = simulate_rounds(plans, COST).step_time_s
    fast = simulate_rounds(plans, faster(COST, factor)).step_time_s
    assert fast <= slow * (1 + 1e-12)


@SLOW
@given(lengths=batches, name=st.sampled_from(BASELINES), measured=st.booleans())
def test_lower_bound_never_above_simulated_time(lengths, name, measured) -> None:
    """With the default curves and with the shipped H100 calibration's, whose linear curve falls
    for calls far larger than a GPU's share."""
    cost = MEASURED if measured else COST
    plans = build_baseline(name, lengths, topology=TOPO, capacity=CAPACITY, cost_model=cost)
    result = simulate_rounds(plans, cost)
    assert 0 < result.lower_bound_s <= result.step_time_s * (1 + 1e-12)
    assert 0 < result.efficiency <= 1 + 1e-12
    for rank in result.per_rank:  # the parts of a rank's step add up to the step
        total = rank.compute_s + rank.comm_exposed_s + rank.idle_s
        assert total == pytest.approx(result.step_time_s, rel=1e-9)


def test_lower_bound_of_an_even_batch_under_a_falling_linear_curve() -> None:
    """One 16K-token document per GPU is a perfect spread: its bound is just under its step
    even where the measured linear curve falls for a call of the whole batch's 128K tokens."""
    assert MEASURED.linear.fall_tokens is not None
    plan = plan_without_remap(
        [place(i, 16384, (i,), TOPO) for i in range(TOPO.world_size)],
        TOPO,
        name="even",
        capacity=None,
    )
    result = simulate(plan, MEASURED)
    assert 0.99 < result.efficiency <= 1 + 1e-12


def test_lower_bound_of_many_short_documents_under_measured_overheads() -> None:
    """40 short documents per GPU, one call each: the bound charges no more call overheads than
    the calls pay, though the measured diagonal curve's overhead exceeds the unmasked one's."""
    assert MEASURED.diagonal.overhead_s > MEASURED.attention.overhead_s
    world = TOPO.world_size
    docs = [place(i, 100, (i % world,), TOPO) for i in range(40 * world)]
    plan = plan_without_remap(docs, TOPO, name="short", capacity=None)
    result = simulate(plan, MEASURED)
    assert 0.95 < result.efficiency <= 1 + 1e-12


@settings(max_examples=examples(40), deadline=None)
@given(lengths=st.lists(st.integers(1, 20000), min_size=1, max_size=20))
def test_one_gpu_equals_the_sum_of_costs(lengths) -> None:
    one = Topology(num_nodes=1, gpus_per_node=1, nics_per_node=1)
    cost = CostModel.default(MODEL, one)
    plan = plan_without_remap(
        [place(i, n, (0,), one) for i, n in enumerate(lengths)], one, name="one", capacity=None
    )
    result = simulate(plan, cost)
    overhead = cost.attention.overhead_s
    attention = overhead + sum(cost.document_attention_time(n) - overhead for n in lengths)
    expected = MODEL.num_layers * (cost.linear_time(sum(lengths)) + attention)
    assert result.step_time_s == pytest.approx(expected, rel=1e-12)
    assert result.per_rank[0].comm_exposed_s == 0 and result.per_rank[0].idle_s == 0
    assert result.efficiency == pytest.approx(1.0, rel=1e-12)


def _cross_node_plan(topo: Topology, lengths: list[int], routed: bool) -> Plan:
    """Documents on a two-rank ring across nodes (local GPU 0 of each node)."""
    a, b = topo.rank_of(0, 0), topo.rank_of(1, 0)
    seqs = [place(i, n, (a, b), topo) for i, n in enumerate(lengths)]
    plan = plan_without_remap(seqs, topo, name="cross", capacity=None)
    if not routed:
        return plan
    gpus = topo.gpus_per_node
    routes = tuple(
        Route(
            src,
            dst,
            tuple(
                RoutePart(topo.rank_of(topo.node_of(src), j), topo.rank_of(topo.node_of(dst), j), 1)
                for j in range(gpus)
            ),
        )
        for src, dst in ((a, b), (b, a))
    )
    return dataclasses.replace(plan, routes=routes)


@settings(max_examples=examples(30), deadline=None)
@given(lengths=st.lists(st.integers(16384, 131072), min_size=1, max_size=4))
def test_routing_never_slower_for_nic_bound_plans(lengths) -> None:
    topo = Topology(num_nodes=2, gpus_per_node=8, nics_per_node=8, nic_gbit=100.0)
    cost = CostModel.default(MODEL, topo)
    plan = _cross_node_plan(topo, lengths, routed=True)
    routed = simulate(plan, cost, routing=True)
    direct = simulate(plan, cost, routing=False)
    assert routed.step_time_s <= direct.step_time_s
    # The same bytes cross nodes either way; routing spreads them over every NIC of the node.
    assert routed.link_bytes["nic"] == direct.link_bytes["nic"]
    nics = [k for k, v in routed.ring_bytes.items() if k.startswith("nic:0.") and v > 0]
    assert len(nics) == topo.nics_per_node
    assert simulate(plan, cost).step_time_s == routed.step_time_s  # auto: routes are used


def test_routing_helps_a_nic_bound_document() -> None:
    topo = Topology(num_nodes=2, gpus_per_node=8, nics_per_node=8, nic_gbit=50.0)
    cost = CostModel.default(MODEL, topo)
    plan = _cross_node_plan(topo, [65536], routed=True)
    assert (
        simulate(plan, cost, routing=True).step_time_s
        < simulate(plan, cost, routing=False).step_time_s
    )


@SLOW
@given(lengths=batches, name=st.sampled_from(BASELINES))
def test_ring_bytes_match_the_schedule(lengths, name) -> None:
    plans = build_baseline(name, lengths, topology=TOPO, capacity=CAPACITY, cost_model=COST)
    result = simulate_rounds(plans, COST)
    expected: dict[str, int] = {}
    for plan in plans:
        got = link_bytes(
            plan, ring_schedule(plan), bytes_per_token=MODEL.kv_bytes_per_token(), routing=False
        )
        for k, v in got.items():
            expected[k] = expected.get(k, 0) + v
    assert result.ring_bytes == expected
    assert result.remap_bytes == {"nvlink": 0, "nic": 0}  # baselines never remap


def test_links_are_shared_within_a_step() -> None:
    one_nic = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=1)
    two_nics = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2)
    times = []
    for topo in (one_nic, two_nics):
        plan = plan_without_remap([], topo, name="empty", capacity=None)
        cost = CostModel.default(MODEL, topo)
        step = [Message(0, 2, (Segment(0, 0, 8192),)), Message(1, 3, (Segment(1, 1, 8192),))]
        times.append(max(step_transfer_times(plan, cost, step, 1024, routing=False)))
    # Two messages through one NIC take about twice as long as through a NIC each.
    assert times[0] > 1.8 * times[1] - 2 * COST.nic.latency_s


def test_remapping_costs_time_and_bytes_only_when_tokens_move() -> None:
    topo = Topology(num_nodes=1, gpus_per_node=2, nics_per_node=1)
    cost = CostModel.default(MODEL, topo)
    seqs = [place(0, 6000, (0,), topo), place(1, 2000, (1,), topo)]
    base = plan_without_remap(seqs, topo, name="zeppelin", capacity=None)
    # Linear layout with 4000 tokens each: rank 0 hands 2000 tokens of document 0 to rank 1.
    linear = ((TokenRange(0, 0, 4000),), (TokenRange(0, 4000, 6000), TokenRange(1, 0, 2000)))
    remapped = dataclasses.replace(base, linear=linear)
    on = simulate(remapped, cost)
    off = simulate(remapped, cost, remap=False)
    assert on.remap_bytes["nvlink"] == 2000 * cost.remap_bytes(1) and on.remap_bytes["nic"] == 0
    assert on.breakdown["remap_s"] > 0 and off.breakdown["remap_s"] == 0
    assert off.step_time_s == simulate(base, cost).step_time_s
    # Balanced linear work: the remapped plan's linear phase is shorter.
    assert on.breakdown["linear_s"] < off.breakdown["linear_s"]


def test_sequential_passes_time_each_document_on_the_ranks_holding_it() -> None:
    """Megatron's dynamic CP runs each document as its own pass; with the highest ranks idle
    (two 2-token documents on rings of 4 hold tokens on one rank each), every pass's compute
    still lands on the rank that holds the document's tokens."""
    from megatron_zeppelin.planner.simulate.simulator import attention_seconds

    plans = build_baseline("megatron-dynamic-cp", [2, 2], topology=TOPO, capacity=64)
    (plan,) = plans
    holders = sorted({span.rank for seq in plan.sequences for span in seq.attention})
    assert plan.meta["execution"] == "sequential" and max(holders) < TOPO.world_size - 1
    compute, _ = attention_seconds(plan, COST, {}, sequential=True)
    assert sorted(r for r in range(TOPO.world_size) if compute[r] > 0) == holders
