"""Tier: pure. Rings across nodes that together want more nodes than the cluster has share
them out (``tiers.share_nodes``): the busiest ring member ends as light as any sharing makes it,
and no ring is left at two nodes while the longer ones take the rest."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.cost.thresholds import tier_thresholds
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.tiers import (
    TierRules,
    assign_tiers,
    chunk_thresholds,
    share_nodes,
)
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure


def _loads(num_nodes: int, *, two_d: bool) -> Loads:
    topology = get_topology("zeppelin-C", num_nodes=num_nodes)
    cost = CostModel.default(get_model("llama-7b"), topology)
    return Loads(topology, 65536, cost, topology.nics_per_node, two_d=two_d)


def _carried(loads: Loads, array: np.ndarray, nodes: dict[int, int]) -> float:
    k = loads.topology.gpus_per_node
    return max(loads.ring_key(int(array[d]), n * k, "nic") for d, n in nodes.items())


@pytest.mark.parametrize("two_d", [False, True])
def test_the_shared_nodes_leave_the_busiest_member_as_light_as_any_sharing(two_d: bool) -> None:
    """Against every way to share 12 nodes among three rings (2 to 8 nodes each)."""
    loads = _loads(12, two_d=two_d)
    array = np.array([150_000, 120_000, 60_000])
    fewest, most = {0: 2, 1: 2, 2: 2}, {0: 8, 1: 8, 2: 8}
    nodes = share_nodes(array, fewest, most, loads)
    assert sum(nodes.values()) == 12
    assert all(fewest[d] <= nodes[d] <= most[d] for d in nodes)
    best = min(
        _carried(loads, array, dict(enumerate(split)))
        for split in itertools.product(range(2, 9), repeat=3)
        if sum(split) <= 12
    )
    assert _carried(loads, array, nodes) == pytest.approx(best, rel=1e-12)


def test_a_ring_takes_no_more_than_it_is_best_at_alone() -> None:
    loads = _loads(16, two_d=True)
    array = np.array([150_000, 140_000])
    nodes = share_nodes(array, {0: 2, 1: 2}, {0: 5, 1: 20}, loads)
    assert nodes[0] == 5 and nodes[1] == 11


def test_long_rings_no_longer_starve_the_next_one_to_two_nodes() -> None:
    """Five documents of 139K-156K tokens and one of 89K on 128 nodes with the 2-D scheme: alone,
    each of the five is best on about 26 nodes, so handing nodes out longest first left the 89K
    document two nodes, its members carrying several times what the others do. Shared out, the
    rings fit the cluster and the busiest member carries less."""
    loads = _loads(128, two_d=True)
    topology, cost = loads.topology, loads.cost_model
    long = [156_058, 154_601, 153_162, 140_825, 139_257, 89_354]
    array = np.array(long + [1_500] * 2000)
    thresholds = tier_thresholds(cost)
    rules = TierRules(True, True, thresholds, chunk_thresholds(thresholds, topology, True))
    nodes = assign_tiers(array, loads, rules).wanted_nodes
    assert set(nodes) == set(range(len(long)))
    assert sum(nodes.values()) <= topology.num_nodes
    # Longest first, each taking what it is best at alone from what the longer ones left:
    free, sequential = topology.num_nodes, {}
    work = float(np.sum([loads.ring_key(int(n), 1, "nvlink") for n in array]))
    for doc in range(len(long)):
        alone = loads.best_num_nodes(long[doc], work - loads.ring_key(long[doc], 1, "nvlink"))
        sequential[doc] = max(2, min(alone, free))
        free = max(0, free - sequential[doc])
    assert min(sequential.values()) == 2 and min(nodes.values()) > 2
    assert _carried(loads, array, nodes) < 0.75 * _carried(loads, array, sequential)
