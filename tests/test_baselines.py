"""Baseline builders produce valid plans that follow each system's rules.

Tier: pure (no torch.distributed; megatron-core's scheduler is plain Python).
"""

from __future__ import annotations

import sys

import pytest
from examples import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_zeppelin.planner.baselines.baselines import (
    BASELINES,
    build_baseline,
    megatron_dynamic_cp,
)
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.plan import AttentionComm, Tier, zigzag_loads
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

TOPO = Topology(num_nodes=2, gpus_per_node=4, nics_per_node=2)
CAPACITY = 4096
COST = CostModel.default(get_model("llama-7b"), TOPO)

batches = st.lists(st.integers(1, 3 * CAPACITY), min_size=1, max_size=40)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _check_common(name: str, plans, lengths: list[int]) -> None:
    assert plans and all(p.name == name for p in plans)
    seen = sorted(s.id for p in plans for s in p.sequences)
    assert seen == list(range(len(lengths))), "every document placed exactly once"
    for plan in plans:
        assert not plan.routes
        for seq in plan.sequences:
            assert seq.length == lengths[seq.id]
        for rank in range(plan.world_size):  # no remapping: linear layout = attention layout
            assert plan.linear_ranges(rank) == plan.attention_ranges(rank)
        if plan.meta.get("execution") == "sequential":
            for seq in plan.sequences:  # one document resident at a time
                for rank in seq.ring:
                    held = sum(s.num_tokens for s in seq.spans_of(rank))
                    assert held <= CAPACITY
        else:
            assert plan.capacity == CAPACITY  # Plan checks both layouts on construction


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=batches, name=st.sampled_from(BASELINES))
def test_baselines_make_valid_plans(lengths: list[int], name: str) -> None:
    plans = build_baseline(name, lengths, topology=TOPO, capacity=CAPACITY, cost_model=COST)
    _check_common(name, plans, lengths)


@settings(max_examples=examples(30), deadline=None)
@given(lengths=batches)
def test_te_ring_cp_splits_every_document_over_its_whole_group(lengths: list[int]) -> None:
    plans = build_baseline("te-ring-cp", lengths, topology=TOPO, capacity=CAPACITY)
    cp = plans[0].meta["cp_size"]
    assert _is_pow2(cp)
    assert max(zigzag_loads(max(lengths), cp)) <= CAPACITY
    if cp > 1:  # the smallest power of two that holds the longest document
        assert max(zigzag_loads(max(lengths), cp // 2)) > CAPACITY
    for plan in plans:
        assert plan.attention_comm == AttentionComm.RING
        for seq in plan.sequences:
            assert len(seq.ring) == cp and seq.ring[0] % cp == 0
            assert list(seq.ring) == list(range(seq.ring[0], seq.ring[0] + cp))
    allgather = build_baseline("llama3-allgather-cp", lengths, topology=TOPO, capacity=CAPACITY)
    assert [p.sequences for p in allgather] == [p.sequences for p in plans]
    assert all(p.attention_comm == AttentionComm.ALLGATHER for p in allgather)


@settings(max_examples=examples(30), deadline=None)
@given(lengths=batches)
def test_hybrid_dp_keeps_short_documents_whole(lengths: list[int]) -> None:
    plans = build_baseline("hybrid-dp", lengths, topology=TOPO, capacity=CAPACITY)
    for plan in plans:
        for seq in plan.sequences:
            if seq.length <= CAPACITY:
                assert Tier(seq.tier) == Tier.LOCAL
            else:
                assert len(seq.ring) == plan.meta["cp_size"] >= 2


@settings(max_examples=examples(30), deadline=None)
@given(lengths=batches)
def test_flexsp_groups_are_disjoint_power_of_two_blocks(lengths: list[int]) -> None:
    for plan in build_baseline("flexsp", lengths, topology=TOPO, capacity=CAPACITY):
        group_of: dict[int, tuple[int, ...]] = {}
        for seq in plan.sequences:
            assert _is_pow2(len(seq.ring)) and seq.ring[0] % len(seq.ring) == 0
            for rank in seq.ring:
                assert group_of.setdefault(rank, seq.ring) == seq.ring


def test_megatron_baseline_calls_megatron_core() -> None:
    pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")
    lengths = [3 * CAPACITY, 2 * CAPACITY, 900, 300, 5000, 17, 4096, 1200]
    plans = megatron_dynamic_cp(
        lengths, topology=TOPO, capacity=CAPACITY, scheduler="megatron-core"
    )
    assert {p.meta["scheduler"] for p in plans} == {"megatron-core"}
    _check_common("megatron-dynamic-cp", plans, lengths)
    for plan in plans:
        for seq in plan.sequences:
            assert _is_pow2(len(seq.ring))
            # Megatron sizes a document's group by ceil(L / capacity), rounded to a power of 2.
            assert len(seq.ring) >= seq.length / CAPACITY


@settings(max_examples=examples(25), deadline=None)
@given(lengths=batches)
def test_megatron_reimplemented_scheduler_makes_valid_plans(lengths: list[int]) -> None:
    plans = megatron_dynamic_cp(lengths, topology=TOPO, capacity=CAPACITY)
    assert plans[0].meta["scheduler"] == "reimplemented"
    _check_common("megatron-dynamic-cp", plans, lengths)


@pytest.mark.parametrize("name", BASELINES)
def test_too_long_a_document_is_a_clear_error(name: str) -> None:
    with pytest.raises(ValueError, match="capacity"):
        build_baseline(name, [TOPO.world_size * CAPACITY + 1], topology=TOPO, capacity=CAPACITY)


def test_unknown_baseline_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="te-ring-cp"):
        build_baseline("ring-magic", [10], topology=TOPO, capacity=CAPACITY)


def test_flexsp_and_megatron_agree_exactly_when_one_document_sets_the_step() -> None:
    """Both size a document's group by memory alone (the smallest power of two that holds it):
    when that group's time for the longest document exceeds every other rank's work, both step
    times are that document's time on its group, whatever the rest of the batch. Where no
    document dominates, their schedules (and step times) differ."""
    from megatron_zeppelin.planner.baselines.baselines import (
        group_size_for,
        plan_without_remap,
        sequence_on,
    )
    from megatron_zeppelin.planner.simulate.simulator import simulate, simulate_rounds

    capacity = 8192
    dominated = [30_000] + [1500, 900, 2000, 700, 1200, 3000, 2500, 800] * 2
    times = {}
    for name in ("megatron-dynamic-cp", "flexsp"):
        plans = build_baseline(name, dominated, topology=TOPO, capacity=capacity, cost_model=COST)
        (longest,) = [s for p in plans for s in p.sequences if s.id == 0]
        size = group_size_for(30_000, capacity, TOPO.world_size)
        assert len(longest.ring) == size  # memory-sized, in both
        times[name] = simulate_rounds(plans, COST).step_time_s
    alone = plan_without_remap(
        [sequence_on(0, 30_000, tuple(range(size)), TOPO)], TOPO, name="alone", capacity=None
    )
    assert times["megatron-dynamic-cp"] == times["flexsp"] == simulate(alone, COST).step_time_s
    even = [3000, 2800, 2600, 2500, 2400] * 6
    steps = [
        simulate_rounds(
            build_baseline(name, even, topology=TOPO, capacity=capacity, cost_model=COST), COST
        ).step_time_s
        for name in ("megatron-dynamic-cp", "flexsp")
    ]
    assert steps[0] != pytest.approx(steps[1], rel=1e-3)


def test_megatron_scheduler_choice_is_checked(monkeypatch) -> None:
    with pytest.raises(ValueError, match="megatron-core"):
        megatron_dynamic_cp([10], topology=TOPO, capacity=CAPACITY, scheduler="fastest")
    # Without megatron-core its own scheduler cannot run; the reimplementation still does.
    monkeypatch.setitem(sys.modules, "megatron.core.pipeline_parallel.hybrid_cp_schedule", None)
    with pytest.raises(ValueError, match="megatron-core is not installed"):
        megatron_dynamic_cp([10], topology=TOPO, capacity=CAPACITY, scheduler="megatron-core")
    assert megatron_dynamic_cp([10], topology=TOPO, capacity=CAPACITY)[0].sequences
