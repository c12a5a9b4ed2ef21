"""A batch that fits the cluster always plans, however tight the capacity.

Tier: pure.
"""

from __future__ import annotations

import numpy as np
import pytest
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.planner.search.spread import spread_evenly, wide_choices, zigzag_pieces
from megatron_zeppelin.planner.simulate.simulator import simulate
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure


def _plan(lengths, topo: Topology, capacity: int, **options):
    cost = CostModel.default(get_model("llama-7b"), topo)
    return plan_batch(
        lengths,
        topology=topo,
        cost_model=cost,
        capacity=capacity,
        options=PlannerOptions(**options),
    )


def _check(plan, lengths: list[int], capacity: int) -> None:
    """Every document once, every rank within capacity in both layouts."""
    assert [s.length for s in plan.sequences] == lengths
    assert plan.capacity == capacity  # Plan checks coverage and capacity on construction
    for rank in range(plan.world_size):
        assert plan.num_attention_tokens(rank) <= capacity
        assert plan.num_linear_tokens(rank) <= capacity


@pytest.mark.parametrize(
    ("nodes", "gpus", "nics", "capacity", "lengths"),
    [
        # 211 and 216 fit whole on the two GPUs, 247 and 65 zigzagged over both (367 / 372).
        (2, 1, 1, 377, [247, 211, 65, 216]),
        (3, 2, 1, 399, [1122, 1155]),
        *[(2, 3, 1, cap, [901, 650, 433, 301, 1, 77, 19, 230, 3]) for cap in (436, 437, 438, 439)],
    ],
)
def test_tight_batches_that_fit_are_planned(nodes, gpus, nics, capacity, lengths) -> None:
    topo = Topology(num_nodes=nodes, gpus_per_node=gpus, nics_per_node=nics)
    for options in ({}, {"allow_split": False}, {"routing": False}):
        _check(_plan(lengths, topo, capacity, **options), lengths, capacity)


@st.composite
def _tight(draw):
    topo = Topology(
        num_nodes=draw(st.integers(1, 3)), gpus_per_node=draw(st.integers(1, 4)), nics_per_node=1
    )
    capacity = draw(st.integers(16, 600))
    room = capacity * topo.world_size
    lengths = draw(st.lists(st.integers(1, room), min_size=1, max_size=12))
    total = 0
    kept = []
    for n in lengths:  # the batch fits the cluster, up to the last token
        if total + n <= room:
            kept.append(n)
            total += n
    return kept or [1], topo, capacity


@settings(max_examples=examples(80), deadline=None)
@given(_tight())
def test_any_batch_within_the_cluster_plans(batch) -> None:
    lengths, topo, capacity = batch
    _check(_plan(lengths, topo, capacity), lengths, capacity)


def test_too_large_a_batch_is_still_refused() -> None:
    topo = Topology(num_nodes=2, gpus_per_node=1, nics_per_node=1)
    with pytest.raises(ValueError, match="more than the cluster capacity"):
        _plan([300, 300, 200], topo, 399)


@given(
    length=st.integers(1, 5000),
    takes=st.lists(st.integers(0, 400), min_size=1, max_size=8),
)
@settings(max_examples=examples(60), deadline=None)
def test_zigzag_pieces_partition_the_document_with_each_ranks_share(length, takes) -> None:
    takes = [t for t in takes if t] or [1]
    takes[-1] += max(0, length - sum(takes))
    length = sum(takes)
    pieces = list(enumerate(takes))
    spans = zigzag_pieces(length, pieces)
    covered = sorted((s.start, s.end) for s in spans)
    assert covered[0][0] == 0 and covered[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    for rank, take in pieces:
        assert sum(s.num_tokens for s in spans if s.rank == rank) == take


def test_zigzag_pieces_even_out_causal_work() -> None:
    """Equal shares of one document do about the same causal work on every rank; contiguous
    pieces would give the last rank 2k-1 times the first's."""
    spans = zigzag_pieces(8000, [(rank, 1000) for rank in range(8)])
    work = [
        sum(s.end * (s.end + 1) - s.start * (s.start + 1) for s in spans if s.rank == r)
        for r in range(8)
    ]
    assert max(work) / min(work) < 1.01


def test_a_full_cluster_is_filled_evenly_and_the_fastest_spread_kept() -> None:
    """A batch of exactly capacity x GPUs leaves placement no gaps: the last resort fills every
    GPU to the same count, and of the spreads it tries keeps the one the simulator times
    fastest."""
    topo = Topology(num_nodes=2, gpus_per_node=4, nics_per_node=1)
    capacity = 8192
    lengths = sample_lengths("wikipedia", num_tokens=capacity * 8, seed=2)
    lengths[-1] += capacity * 8 - sum(lengths)
    plan = _plan(lengths, topo, capacity)
    _check(plan, lengths, capacity)
    assert "filled evenly" in plan.meta["fallback"]
    assert {plan.num_attention_tokens(rank) for rank in range(8)} == {capacity}
    cost = CostModel.default(get_model("llama-7b"), topo)
    array = np.asarray(lengths, dtype=np.int64)
    seconds = {}
    for wide in wide_choices(array, 8):
        candidate = spread_evenly(array, Loads(topo, capacity, cost, 1), wide)
        candidate.build(array, True)
        candidate.simulate(("attention",))
        seconds[wide] = candidate.seconds
    assert len(seconds) > 1
    assert seconds[plan.meta["spread_wide"]] == min(seconds.values())
    chosen = simulate(plan, cost)
    assert chosen.step_time_s == pytest.approx(plan.meta["predicted_step_s"], rel=1e-9)
    assert chosen.efficiency > 0.8
