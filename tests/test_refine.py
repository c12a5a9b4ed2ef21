"""Tier: pure. The pass after the pool placement (``planner/place/refine.py``) and the ring
re-placement it uses (``members.replace_ring``).

The pass may only move whole documents (or re-place a ring) where both GPUs it touches end
below the busiest load, so it can never raise the predicted step nor break capacity.
"""

from __future__ import annotations

import numpy as np
import pytest
from pool_batches import stress_batch

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.members import remove_ring, replace_ring
from megatron_zeppelin.planner.place.placement import Placement
from megatron_zeppelin.planner.place.pool import ALL_ORDERS, place_pool, pool_goal
from megatron_zeppelin.planner.place.pool_rings import place_on
from megatron_zeppelin.planner.place.refine import refine
from megatron_zeppelin.planner.place.tiers import assign_tiers
from megatron_zeppelin.planner.plan.plan import Tier, zigzag_loads
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

CAPACITY = 32_768
ORDERS = list(ALL_ORDERS)


def _setup(name: str, gpus: int, fill: float, seed: int):  # noqa: ANN202
    batch = stress_batch(name, gpus, fill, seed, CAPACITY)
    return batch.array, batch.topology, batch.cost, batch.rules


def _tokens_from(placements: list[Placement], array: np.ndarray, world: int) -> list[int]:
    """Each GPU's tokens as the placements say (zigzag shares over each ring)."""
    tokens = [0] * world
    for placement, length in zip(placements, array.tolist()):
        for rank, n in zip(placement.ring, zigzag_loads(length, len(placement.ring))):
            tokens[rank] += n
    return tokens


@pytest.mark.parametrize(
    ("name", "gpus", "fill", "seed"),
    [
        ("lognormal", 32, 0.95, 0),
        ("mixture", 32, 0.5, 1),
        ("power-law", 16, 0.95, 0),
        ("uniform-long", 32, 0.5, 1),
        ("long-tail", 32, 0.95, 0),
    ],
)
@pytest.mark.parametrize(("first", "scale", "cross"), ORDERS)
def test_refine_never_raises_the_busiest_load_and_keeps_capacity(
    name: str,
    gpus: int,
    fill: float,
    seed: int,
    first: float | None,
    scale: float,
    cross: float,
) -> None:
    array, topology, cost, rules = _setup(name, gpus, fill, seed)
    loads = Loads(topology, CAPACITY, cost, topology.nics_per_node, two_d=True)
    choice = assign_tiers(array, loads, rules)
    placements, _ = place_pool(array, choice, loads, rules.chunks[1], first, scale, cross=cross)
    before = max(loads.cost)
    goal = pool_goal(array, loads, rules.chunks[1])
    refine(array, placements, loads, choice.attention, topology.world_size, goal)
    assert max(loads.cost) <= before * (1 + 1e-12)
    assert max(loads.tokens) <= CAPACITY
    assert loads.tokens == _tokens_from(placements, array, topology.world_size)
    assert sum(loads.tokens) == int(array.sum())
    for placement in placements:
        assert len(set(placement.ring)) == len(placement.ring)
        assert placement.tier == Tier.of_ring(placement.ring, topology.gpus_per_node)
    # The loads still price every document where it now is: a fresh ``Loads`` agrees.
    fresh = Loads(topology, CAPACITY, cost, topology.nics_per_node, two_d=True)
    for doc, placement in enumerate(placements):
        if placement.tier == Tier.LOCAL:
            fresh.add_local(placement.ring[0], int(array[doc]))
    ringed = [r for p in placements if p.tier != Tier.LOCAL for r in p.ring]
    for rank in set(range(topology.world_size)) - set(ringed):
        assert loads.cost[rank] == pytest.approx(fresh.cost[rank], rel=1e-9, abs=1e-12)


def test_refine_moves_documents_off_an_overloaded_gpu() -> None:
    """Every document on one GPU of two: the pass moves documents to the other until the
    busiest cannot get lower, and the busiest load falls."""
    topology = get_topology("zeppelin-C", num_nodes=1)
    cost = CostModel.default(get_model("llama-7b"), topology)
    array = np.asarray([4000, 3000, 3000, 2000, 1000, 500, 500])
    loads = Loads(topology, CAPACITY, cost)
    attention = np.asarray([loads.ring_seconds(int(n), 1) for n in array])
    placements = [Placement(Tier.LOCAL, (0,)) for _ in array]
    for length, seconds in zip(array.tolist(), attention.tolist()):
        loads.add_local(0, length, seconds)
    before = max(loads.cost)
    changes = refine(array, placements, loads, attention, rounds=100)
    assert changes > 0
    assert max(loads.cost) < 0.5 * before
    assert loads.tokens == _tokens_from(placements, array, topology.world_size)


def test_refine_swaps_where_no_gpu_has_room() -> None:
    """Two nearly full GPUs and no room elsewhere: no move fits, but swapping the busiest GPU's
    long document for a slightly shorter one of the other GPU lowers the busiest."""
    topology = get_topology("zeppelin-C", num_nodes=1)
    cost = CostModel.default(get_model("llama-7b"), topology)
    capacity = 16_000
    array = np.asarray([12_000, 2_000, 2_000, 11_950, 1_975, 1_975])
    where = [0, 0, 0, 1, 1, 1]
    loads = Loads(topology, capacity, cost)
    attention = np.asarray([loads.ring_seconds(int(n), 1) for n in array])
    placements = [Placement(Tier.LOCAL, (r,)) for r in where]
    for rank, length, seconds in zip(where, array.tolist(), attention.tolist()):
        loads.add_local(rank, length, seconds)
    # The other six GPUs are full of nothing useful: no room anywhere.
    for rank in range(2, topology.world_size):
        loads.tokens[rank] = capacity
    before = max(loads.cost)
    assert refine(array, placements, loads, attention, rounds=10) > 0
    assert max(loads.cost) < before
    assert placements[0].ring == (1,) and placements[3].ring == (0,)
    assert max(loads.tokens) <= capacity


def test_remove_undoes_add() -> None:
    """``remove_ring`` takes off exactly what ``place_on`` put on, in a node and across nodes."""
    topology = get_topology("zeppelin-C", num_nodes=4)
    cost = CostModel.default(get_model("llama-7b"), topology)
    loads = Loads(topology, CAPACITY, cost, topology.nics_per_node, two_d=True)
    loads.add_local(3, 5000)
    before = (loads.cost[:], loads.attention[:], loads.exposed[:], loads.tokens[:])
    for ring, whole in (((0, 1, 2), False), ((6, 7, 8, 9, 10), False), (tuple(range(16)), True)):
        placement = place_on(ring, 60_000, loads, whole)
        remove_ring(placement, 60_000, loads)
        after = (loads.cost, loads.attention, loads.exposed, loads.tokens)
        for want, got in zip(before, after):
            assert got == pytest.approx(want, abs=1e-12)


def test_replace_ring_keeps_loads_when_it_finds_nothing() -> None:
    """Asked for a ring ending below a load no ring can reach, ``replace_ring`` gives ``None``
    and leaves the loads as they were; given room, every new member ends below the bound."""
    topology = get_topology("zeppelin-C", num_nodes=2)
    cost = CostModel.default(get_model("llama-7b"), topology)
    array = np.asarray([100_000])
    loads = Loads(topology, CAPACITY, cost, topology.nics_per_node)
    old = place_on((0, 1, 2, 3), 100_000, loads, False)
    goal = pool_goal(array, loads, 0)
    before = (loads.cost[:], loads.tokens[:])
    barred = np.zeros(topology.world_size, dtype=bool)
    assert replace_ring(0, 100_000, old, loads, goal, 1e-9, barred) is None
    assert (loads.cost, loads.tokens) == before
    below = max(loads.cost) * 0.9
    new = replace_ring(0, 100_000, old, loads, goal, below, barred)
    assert new is not None and len(new.ring) > len(old.ring)
    assert max(loads.cost) < below
    assert sum(loads.tokens) == 100_000


@pytest.mark.parametrize("seed", range(40))
def test_moves_choose_the_gpu_a_scan_of_every_gpu_chooses(seed: int) -> None:
    """``refine._moves`` (GPUs sorted by load once) against ``_scanned_moves`` (every document
    against every GPU), ties included: equal loads, loads one rounding step apart that end
    equal once a document is added, GPUs without room, documents no GPU has room for."""
    from megatron_zeppelin.planner.place.refine import _moves, _scanned_moves

    rng = np.random.default_rng(seed)
    world = int(rng.integers(2, 64))
    base = rng.choice([0.5, 1.0, 1.0 + 2**-52, 1.0 + 2**-51, 3.0], size=world)
    cost = base * rng.choice([1.0, 1.0, 1.1], size=world)
    room = rng.integers(-5, 50, size=world)
    lengths = rng.integers(1, 60, size=int(rng.integers(1, 12)))
    given = rng.choice([2**-53, 1e-3, 0.25, 1.0], size=len(lengths))
    busiest = int(rng.integers(world))
    want_dest, want_ends = _scanned_moves(busiest, lengths, given, cost, room)
    dest, ends = _moves(busiest, lengths, given, cost, room)
    assert np.array_equal(ends, want_ends)
    reachable = np.isfinite(want_ends)
    assert np.array_equal(dest[reachable], want_dest[reachable])


def test_each_gpu_holds_its_documents_in_order() -> None:
    """``refine``'s view of a placement: each GPU's local documents in document order, in one
    row per GPU with room to spare, and each GPU's ring documents; against a plain pass over
    the placements (rings of one GPU among them, GPUs holding nothing)."""
    from megatron_zeppelin.planner.loops.local_changes import _SPARE, by_rank
    from megatron_zeppelin.planner.place.refine import _held

    rng = np.random.default_rng(4)
    world = 16
    placements = []
    for _ in range(300):
        if rng.random() < 0.1:
            size = int(rng.integers(1, 5))
            ring = tuple(sorted(rng.choice(world, size, replace=False).tolist()))
            placements.append(Placement(Tier.INTRA, ring))
        else:
            placements.append(Placement(Tier.LOCAL, (int(rng.integers(0, world - 2)),)))
    want_local = [[] for _ in range(world)]
    want_rings = [[] for _ in range(world)]
    for doc, p in enumerate(placements):
        for rank in p.ring:
            (want_local if p.tier == Tier.LOCAL else want_rings)[rank].append(doc)
    docs, ranks, rings_on = _held(placements, world)
    rows, count = by_rank(docs, ranks, world)
    assert rings_on == want_rings
    assert [row[:n].tolist() for row, n in zip(rows, count.tolist())] == want_local
    assert rows.shape[1] == max(map(len, want_local)) + _SPARE
    assert not rows[np.arange(rows.shape[1]) >= count[:, None]].any()  # zeros past each row
