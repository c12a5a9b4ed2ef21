"""Tier: pure. The pool placement (``planner/pool.py``) on small stress batches.

Where documents are few per GPU, a ring across nodes over whole nodes leaves GPUs uneven; the
pool candidate sizes rings to the mean load on any GPUs (across nodes over part of a node's GPUs
too), and the search keeps it only where the simulator times it faster.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_zeppelin.planner.costmodel import CostModel
from megatron_zeppelin.planner.distributions import STRESS_DISTRIBUTIONS, sample_lengths
from megatron_zeppelin.planner.loads import Loads
from megatron_zeppelin.planner.models import get_model
from megatron_zeppelin.planner.partition import PlannerOptions, plan_batch
from megatron_zeppelin.planner.plan import Tier
from megatron_zeppelin.planner.pool import (
    POOL_ORDERS,
    POOL_RETRIES,
    least_ring_load,
    place_pool,
    pool_batch,
)
from megatron_zeppelin.planner.simulator import simulate
from megatron_zeppelin.planner.thresholds import tier_thresholds
from megatron_zeppelin.planner.tiers import TierRules, assign_tiers, chunk_thresholds
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

CAPACITY = 32_768


def _batch(name: str, gpus: int, fill: float, seed: int) -> tuple[list[int], Topology, CostModel]:
    """A stress batch as ``scripts/compare_sweep.py --stress`` draws it."""
    topology = get_topology("zeppelin-C", num_nodes=gpus // 8)
    cost = CostModel.default(get_model("llama-7b"), topology)
    tokens = int(fill * gpus * CAPACITY)
    lengths = sample_lengths(name, num_tokens=tokens, seed=seed, max_length=tokens // 2)
    return lengths, topology, cost


def _steps(lengths, topology, cost) -> tuple[float, float, object]:  # noqa: ANN001
    """The step of the default plan, of the staged placement alone, and the default plan."""
    plan = plan_batch(lengths, topology=topology, cost_model=cost, capacity=CAPACITY)
    staged = plan_batch(
        lengths,
        topology=topology,
        cost_model=cost,
        capacity=CAPACITY,
        options=PlannerOptions(pool=False),
    )
    return simulate(plan, cost).step_time_s, simulate(staged, cost).step_time_s, plan


@pytest.mark.parametrize("name", STRESS_DISTRIBUTIONS)
def test_plans_are_never_slower_than_the_staged_placement(name: str) -> None:
    """The pool candidates are timed beside the staged ones, so adding them cannot lose."""
    lengths, topology, cost = _batch(name, 16, 0.5, seed=0)
    step, staged, plan = _steps(lengths, topology, cost)
    assert step <= staged * (1 + 1e-9)
    if any(c["placement"] == "pool" for c in plan.meta["candidates"]):
        assert plan.meta["timed_by"] == "simulator"
        assert plan.meta["predicted_step_s"] == pytest.approx(step, rel=1e-9)


@pytest.mark.parametrize(
    ("name", "seed", "bound"),
    [("uniform-long", 0, 0.88), ("uniform-long", 1, 0.88), ("power-law", 0, 0.94)],
)
def test_few_documents_per_gpu_fill_part_of_a_node(name: str, seed: int, bound: float) -> None:
    """Three or a few long documents on 16 GPUs: whole-node rings left one node far busier
    (efficiency 0.70-0.88); a ring over part of a node's GPUs across nodes, and every GPU given
    work, reach the bound."""
    lengths, topology, cost = _batch(name, 16, 0.5, seed)
    step, staged, plan = _steps(lengths, topology, cost)
    result = simulate(plan, cost)
    assert result.efficiency >= bound > result.lower_bound_s / staged
    k = topology.gpus_per_node
    partial = [s for s in plan.sequences if s.tier == Tier.INTER and len(s.ring) % k]
    assert partial, "a ring across nodes over part of a node's GPUs"
    busy = {span.rank for s in plan.sequences for span in s.attention}
    assert busy == set(range(topology.world_size)), "no GPU idle"


@pytest.mark.parametrize(("first", "scale"), [*POOL_ORDERS, *POOL_RETRIES])
def test_pool_placement_keeps_capacity_and_places_every_document(first, scale: float) -> None:  # noqa: ANN001
    """Every document placed once, rings of distinct ranks, no GPU over capacity, and a
    ring's tier matching the nodes it spans."""
    lengths, topology, cost = _batch("mixture", 32, 0.95, seed=1)
    array = np.asarray(lengths)
    thresholds = tier_thresholds(cost)
    rules = TierRules(True, True, thresholds, chunk_thresholds(thresholds, topology, True))
    loads = Loads(topology, CAPACITY, cost, topology.nics_per_node, two_d=True)
    placements, _ = place_pool(
        array, assign_tiers(array, loads, rules), loads, rules.chunks[1], first, scale
    )
    assert len(placements) == len(array) and all(p is not None for p in placements)
    assert max(loads.tokens) <= CAPACITY and sum(loads.tokens) == int(array.sum())
    for placement in placements:
        assert len(set(placement.ring)) == len(placement.ring)
        assert placement.tier == Tier.of_ring(placement.ring, topology.gpus_per_node)


@pytest.mark.parametrize(
    ("name", "gpus", "fill"),
    [
        ("mixture", 32, 0.95),
        ("uniform-long", 16, 0.5),
        ("power-law", 16, 0.5),
        ("lognormal", 32, 0.5),
    ],
)
def test_least_ring_load_bounds_every_pool_placement(name: str, gpus: int, fill: float) -> None:
    """The search skips the pool where ``least_ring_load`` or the mean work per GPU says it
    cannot end far enough below the staged plan; that is sound only if no order of the pool
    ends below either bound."""
    lengths, topology, cost = _batch(name, gpus, fill, seed=1)
    array = np.asarray(lengths)
    thresholds = tier_thresholds(cost)
    rules = TierRules(True, True, thresholds, chunk_thresholds(thresholds, topology, True))
    fresh = Loads(topology, CAPACITY, cost, topology.nics_per_node, two_d=True)
    bound = least_ring_load(array, assign_tiers(array, fresh, rules), fresh)
    share = pool_batch(array, assign_tiers(array, fresh, rules), fresh).share
    assert bound > 0
    for first, scale in (*POOL_ORDERS, *POOL_RETRIES):
        loads = Loads(topology, CAPACITY, cost, topology.nics_per_node, two_d=True)
        choice = assign_tiers(array, loads, rules)
        place_pool(array, choice, loads, rules.chunks[1], first, scale)
        assert max(loads.cost) >= bound * (1 - 1e-9), (first, scale)
        # The mean work per GPU bounds it too (splitting only adds work): the search's other
        # reason to skip the pool.
        assert max(loads.cost) >= share * (1 - 1e-9), (first, scale)
