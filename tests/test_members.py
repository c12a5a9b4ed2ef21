"""Tier: pure. A GPU's place in a ring moved to another GPU (``planner/place/members.py``), the move
the pass after the pool placement (``planner/place/refine.py``) makes where the busiest GPU holds
ring shares that nothing else relieves.

The move is kept only where every member of the ring ends below the bound it is given and the
new member has room; otherwise the loads are left exactly as they were.
"""

from __future__ import annotations

import pytest

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.members import move_member
from megatron_zeppelin.planner.place.pool_rings import place_on
from megatron_zeppelin.planner.plan.plan import Tier, zigzag_loads
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

CAPACITY = 32_768


def _loads(num_nodes: int, capacity: int = CAPACITY) -> Loads:
    topology = get_topology("zeppelin-C", num_nodes=num_nodes)
    cost = CostModel.default(get_model("llama-7b"), topology)
    return Loads(topology, capacity, cost, topology.nics_per_node)


def _state(loads: Loads) -> tuple[list, list, list, list]:
    return loads.cost[:], loads.attention[:], loads.exposed[:], loads.tokens[:]


def test_move_member_keeps_loads_when_it_finds_nothing() -> None:
    """Asked for every member to end below a load none can reach, the move gives ``None`` and
    the loads are exactly as they were."""
    loads = _loads(2)
    ring = place_on((0, 1, 2, 3), 60_000, loads, False)
    loads.add_local(0, 9_000)
    before = _state(loads)
    assert move_member(60_000, ring, loads, 0, 1e-9) is None
    assert _state(loads) == before


def test_move_member_relieves_the_busy_gpu_in_its_node() -> None:
    """A ring inside a node whose member 0 also holds a long whole document: its place goes to
    a free GPU of the same node, so the ring keeps NVLink, every member ends below the busy
    GPU's load, and the loads are those of the ring placed afresh on its new members."""
    loads = _loads(2)
    length = 60_000
    ring = place_on((0, 1, 2, 3), length, loads, False)
    loads.add_local(0, 12_000)
    for rank in range(8, 16):  # the other node busier than the free GPUs of node 0
        loads.add_local(rank, 20_000)
    below = loads.cost[0]
    new = move_member(length, ring, loads, 0, below)
    assert new is not None
    assert 0 not in new.ring and len(new.ring) == 4
    assert new.tier == Tier.INTRA and all(r < 8 for r in new.ring)
    assert max(loads.cost[r] for r in new.ring) < below
    assert loads.cost[0] < below
    fresh = _loads(2)
    fresh.add_local(0, 12_000)
    for rank in range(8, 16):
        fresh.add_local(rank, 20_000)
    fresh.add_ring(new.ring, length)
    assert loads.cost == pytest.approx(fresh.cost, abs=1e-12)
    assert loads.tokens == fresh.tokens


def test_move_member_respects_room() -> None:
    """No GPU outside the ring has room for a member's tokens: nothing moves, however light
    those GPUs are."""
    capacity = 16_000
    loads = _loads(1, capacity)
    length = 40_000
    ring = place_on((0, 1, 2, 3), length, loads, False)
    loads.add_local(0, capacity - max(zigzag_loads(length, 4)))
    for rank in range(4, 8):
        loads.tokens[rank] = capacity - max(zigzag_loads(length, 4)) + 1
    before = _state(loads)
    assert move_member(length, ring, loads, 0, loads.cost[0]) is None
    assert _state(loads) == before


def test_move_member_keeps_every_member_within_capacity() -> None:
    """A ring listed node by node gets its members in rank order, so a move can shift the
    others' places in the zigzag: a 7-token ring over three GPUs holds 2, 2 and 3 tokens by
    place. Rank 3, full but for its 2 tokens, would take the third place (3 tokens) once rank 0
    joins the ring before it: the move must not be made (or must leave rank 3 where it was)."""
    length, capacity = 7, 1_000
    loads = _loads(2, capacity)
    assert zigzag_loads(length, 3) == (2, 2, 3)
    ring = place_on((2, 3, 8), length, loads, False)
    loads.add_local(3, capacity - loads.tokens[3])  # rank 3 full
    loads.add_local(8, 900)  # rank 8 the busy one
    for rank in [*range(9, 16), 1, 4, 5, 6, 7]:  # rank 0 the least loaded GPU with room
        loads.add_local(rank, 500)
    assert loads.tokens[3] == capacity
    move_member(length, ring, loads, 8, float("inf"))
    assert max(loads.tokens) <= capacity
