"""The planner's stages and records: tiers from rings, load snapshots, placements.

Tier: pure.
"""

from __future__ import annotations

import pytest
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.plan.plan import Tier, zigzag_bounds, zigzag_loads
from megatron_zeppelin.planner.search.partition import plan_batch
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure


def test_tier_of_ring() -> None:
    assert Tier.of_ring((5,), 4) == Tier.LOCAL
    assert Tier.of_ring((4, 5, 7), 4) == Tier.INTRA
    assert Tier.of_ring((3, 4), 4) == Tier.INTER
    assert Tier.of_ring([0, 8, 1], 8) == Tier.INTER


@settings(max_examples=examples(50), deadline=None)
@given(length=st.integers(1, 10_000), ring_size=st.integers(1, 64))
def test_zigzag_loads_are_the_chunks_of_each_position(length: int, ring_size: int) -> None:
    loads = zigzag_loads(length, ring_size)
    assert sum(loads) == length and len(loads) == ring_size
    if ring_size > 1:
        bounds = zigzag_bounds(length, ring_size)
        last = 2 * ring_size - 1
        for i, n in enumerate(loads):
            assert n == sum(e - s for s, e in (bounds[i], bounds[last - i]))


def test_loads_snapshot_restores_exactly() -> None:
    topo = Topology(num_nodes=2, gpus_per_node=4, nics_per_node=2)
    loads = Loads(topo, 10_000, CostModel.default(get_model("llama-7b"), topo))
    loads.add_local(1, 3000)
    before = (list(loads.cost), list(loads.attention), list(loads.tokens))
    saved = loads.snapshot([0, 1, 2, 3])
    loads.add_ring((0, 1, 2), 6000)
    loads.add_local(3, 100)
    assert (list(loads.cost), list(loads.tokens)) != (before[0], before[2])
    loads.restore(saved)
    assert (list(loads.cost), list(loads.attention), list(loads.tokens)) == before


@pytest.mark.parametrize(("preset", "nodes"), [("zeppelin-A", 4), ("zeppelin-C", 2)])
def test_placement_tier_matches_its_ring(preset: str, nodes: int) -> None:
    """The tier decided during placement is the one the ring stands for."""
    topo = get_topology(preset, num_nodes=nodes)
    cost = CostModel.default(get_model("llama-7b"), topo)
    capacity = 24_576
    long = capacity * topo.gpus_per_node + 1000  # fits no node: crosses nodes
    fill = int(0.7 * capacity * topo.world_size) - long
    lengths = sample_lengths("magi_realworld", num_tokens=fill, seed=2)
    plan = plan_batch([*lengths, long], topology=topo, cost_model=cost, capacity=capacity)
    assert {Tier.LOCAL, Tier.INTER} <= {Tier(s.tier) for s in plan.sequences}
    for seq in plan.sequences:
        assert seq.tier == Tier.of_ring(seq.ring, topo.gpus_per_node)
