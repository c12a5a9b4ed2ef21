"""Tier: pure. The pool placement (``planner/place/pool.py``) on small stress batches.

Where documents are few per GPU, a ring across nodes over whole nodes leaves GPUs uneven; the
pool candidate sizes rings to the mean load on any GPUs (across nodes over part of a node's GPUs
too), and the search keeps it only where the simulator times it faster.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from pool_batches import NEEDS_NUMBA

import megatron_zeppelin.planner.search.search as search
from megatron_zeppelin.planner.baselines.distributions import STRESS_DISTRIBUTIONS, sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.cost.thresholds import tier_thresholds
from megatron_zeppelin.planner.loops import ring_line
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.pool import (
    ALL_ORDERS,
    POOL_ORDERS,
    POOL_RETRIES,
    RING_ORDERS,
    RING_RETRIES,
    early_count,
    place_pool,
    pool_batch,
    pool_orders,
)
from megatron_zeppelin.planner.place.tiers import TierRules, assign_tiers, chunk_thresholds
from megatron_zeppelin.planner.plan.plan import Tier, zigzag_loads
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.planner.simulate.simulator import simulate
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

CAPACITY = 32_768
ORDERS = list(ALL_ORDERS)


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


@pytest.mark.parametrize(("name", "gpus", "seed"), [("lognormal", 16, 1), ("power-law", 128, 0)])
def test_only_the_best_predicted_pool_placements_are_timed(name: str, gpus: int, seed: int):
    """Of the pool placements predicted within ``search._SHORTLIST`` of the best staged one,
    the ``_MAX_POOL_TIMED`` best predicted are timed by the simulator, no others."""
    lengths, topology, cost = _batch(name, gpus, 0.95, seed)
    plan = plan_batch(lengths, topology=topology, cost_model=cost, capacity=CAPACITY)
    tried = [c for c in plan.meta["candidates"] if not c.get("retimed")]
    staged = min(c["predicted_layer_s"] for c in tried if c["placement"] == "staged")
    pooled = [c for c in tried if c["placement"] == "pool"]
    within = sorted(
        (c for c in pooled if c["predicted_layer_s"] <= search._SHORTLIST * staged),
        key=lambda c: c["predicted_layer_s"],
    )
    assert len(within) > search._MAX_POOL_TIMED  # more than the few: some are left untimed
    timed = sorted(
        (c for c in pooled if "simulated_layer_s" in c), key=lambda c: c["predicted_layer_s"]
    )
    assert timed == within[: search._MAX_POOL_TIMED]


@pytest.mark.parametrize(
    ("name", "fill", "seed"),
    [
        ("lognormal", 0.95, 0),
        ("power-law", 0.95, 1),
        ("uniform-long", 0.5, 0),
        ("uniform-long", 0.5, 1),
    ],
)
def test_candidates_left_untimed_could_not_have_been_kept(
    name: str, fill: float, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shortlisted candidate predicted too far above one timed already is not timed
    (``search._timed``: behind one of its kind, or a staged one too far behind the pool's
    fastest to be refined again); timing every one keeps the same plan. These batches leave out a
    pool placement, a staged one behind another, and a staged one behind the pool."""
    lengths, topology, cost = _batch(name, 16, fill, seed)

    def planned() -> tuple[dict, int]:
        plan = plan_batch(lengths, topology=topology, cost_model=cost, capacity=CAPACITY)
        data = plan.to_dict()
        timed = sum("simulated_layer_s" in c for c in data["meta"].pop("candidates"))
        return data, timed

    plan, timed = planned()
    monkeypatch.setattr(search, "_UNDERCUT", 0.0)  # nothing is ever predicted too far behind
    every, all_timed = planned()
    assert timed < all_timed
    assert plan == every


@pytest.mark.parametrize(
    ("name", "gpus", "fill", "seed", "behind"),
    [
        ("mixture", 32, 0.95, 2, True),
        ("uniform-long", 16, 0.5, 1, True),
        ("power-law", 16, 0.5, 0, False),
    ],
)
def test_a_staged_placement_timed_far_behind_the_pool_is_not_refined_again(
    name: str, gpus: int, fill: float, seed: int, behind: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fastest timed staged placement is refined again on the simulator's figures
    (``search._retime``) unless it is timed more than ``_RETIME_BEHIND`` above the fastest
    timed pool placement; with that bar out of reach, it is refined again as before."""
    lengths, topology, cost = _batch(name, gpus, fill, seed)
    retimed: list[bool] = []  # the kind of each placement refined again: pooled or not
    original = search._retime

    def spy(batch, best):  # noqa: ANN001, ANN202
        retimed.append(best.pooled)
        return original(batch, best)

    monkeypatch.setattr(search, "_retime", spy)
    plan = plan_batch(lengths, topology=topology, cost_model=cost, capacity=CAPACITY)
    timed = [
        c for c in plan.meta["candidates"] if "simulated_layer_s" in c and not c.get("retimed")
    ]
    pool = min(c["simulated_layer_s"] for c in timed if c["placement"] == "pool")
    staged = [c["simulated_layer_s"] for c in timed if c["placement"] != "pool"]
    # Not timed at all: predicted too far behind to be refined again (``search._timed``).
    assert (not staged or min(staged) > search._RETIME_BEHIND * pool) == behind
    assert retimed == ([True] if behind else [True, False])
    retimed.clear()
    monkeypatch.setattr(search, "_RETIME_BEHIND", 10.0)
    plan_batch(lengths, topology=topology, cost_model=cost, capacity=CAPACITY)
    assert retimed == [True, False]


@pytest.mark.parametrize(
    ("name", "seed", "bound"),
    [("uniform-long", 0, 0.88), ("uniform-long", 1, 0.88), ("power-law", 0, 0.94)],
)
def test_few_documents_per_gpu_fill_part_of_a_node(
    name: str, seed: int, bound: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three or a few long documents on 16 GPUs: whole-node rings left one node far busier
    (efficiency 0.70-0.88); a ring over part of a node's GPUs across nodes, and every GPU given
    work, reach the bound. (The pool's rings, that is: the placement with uneven shares, which
    may beat them here, is left out; ``tests/test_shares.py``.)"""
    monkeypatch.setattr(search, "place_shares", lambda *_: None)
    lengths, topology, cost = _batch(name, 16, 0.5, seed)
    step, staged, plan = _steps(lengths, topology, cost)
    result = simulate(plan, cost)
    assert result.efficiency >= bound > result.lower_bound_s / staged
    k = topology.gpus_per_node
    partial = [s for s in plan.sequences if s.tier == Tier.INTER and len(s.ring) % k]
    assert partial, "a ring across nodes over part of a node's GPUs"
    busy = {span.rank for s in plan.sequences for span in s.attention}
    assert busy == set(range(topology.world_size)), "no GPU idle"


@pytest.mark.parametrize(("first", "scale", "cross"), ORDERS)
def test_pool_placement_keeps_capacity_and_places_every_document(
    first,  # noqa: ANN001
    scale: float,
    cross: float,
) -> None:
    """Every document placed once, rings of distinct ranks, no GPU over capacity, and a
    ring's tier matching the nodes it spans."""
    lengths, topology, cost = _batch("mixture", 32, 0.95, seed=1)
    array = np.asarray(lengths)
    thresholds = tier_thresholds(cost)
    rules = TierRules(True, True, thresholds, chunk_thresholds(thresholds, topology, True))
    loads = Loads(topology, CAPACITY, cost, topology.nics_per_node, two_d=True)
    placements, _ = place_pool(
        array, assign_tiers(array, loads, rules), loads, rules.chunks[1], first, scale, cross=cross
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
def test_the_target_bounds_every_pool_placement(name: str, gpus: int, fill: float) -> None:
    """The search skips the pool where the batch's least load says it cannot end far enough
    below the staged plan; that is sound only if no order of the pool, its rings sized to the
    target or to the least load itself, ends below it (``least_load.py``), nor below the mean work
    per GPU."""
    lengths, topology, cost = _batch(name, gpus, fill, seed=1)
    array = np.asarray(lengths)
    thresholds = tier_thresholds(cost)
    rules = TierRules(True, True, thresholds, chunk_thresholds(thresholds, topology, True))
    fresh = Loads(topology, CAPACITY, cost, topology.nics_per_node, two_d=True)
    batch = pool_batch(array, assign_tiers(array, fresh, rules), fresh, rules.chunks[1])
    assert batch.least_load >= batch.share > 0
    for first, scale, cross in ORDERS:
        for least in (False, True):
            loads = Loads(topology, CAPACITY, cost, topology.nics_per_node, two_d=True)
            choice = assign_tiers(array, loads, rules)
            place_pool(array, choice, loads, rules.chunks[1], first, scale, batch, cross, least)
            assert max(loads.cost) >= batch.least_load * (1 - 1e-9), (first, scale, cross, least)


def _placed(name: str, gpus: int, fill: float, seed: int, first, scale: float):  # noqa: ANN001, ANN202
    lengths, topology, cost = _batch(name, gpus, fill, seed)
    array = np.asarray(lengths)
    thresholds = tier_thresholds(cost)
    rules = TierRules(True, True, thresholds, chunk_thresholds(thresholds, topology, True))
    loads = Loads(topology, CAPACITY, cost, topology.nics_per_node, two_d=True)
    choice = assign_tiers(array, loads, rules)
    placements, _ = place_pool(array, choice, loads, rules.chunks[1], first, scale)
    return array, choice, loads, placements


@pytest.mark.parametrize(
    ("name", "gpus", "fill", "seed"),
    [("uniform-long", 32, 0.5, 0), ("uniform-long", 64, 0.95, 1), ("mixture", 32, 0.95, 0)],
)
def test_pool_orders_skip_orders_that_place_alike(name: str, gpus: int, fill: float, seed: int):
    """Where no order puts a whole document before the rings, ``pool_orders`` gives the ring
    scales instead, and every order of ``POOL_ORDERS`` indeed places the batch alike; where
    one does, the orders are kept and some order places it differently."""
    array, choice, loads, _ = _placed(name, gpus, fill, seed, None, 1.0)
    fresh = Loads(loads.topology, CAPACITY, loads.cost_model, loads.num_links, two_d=True)
    nic_chunk = chunk_thresholds(tier_thresholds(loads.cost_model), loads.topology, True)[1]
    batch = pool_batch(array, choice, fresh, nic_chunk)
    orders, retries = pool_orders(array, fresh, batch)
    rings = {
        tuple((p.tier, p.ring) for p in _placed(name, gpus, fill, seed, *order[:2])[3])
        for order in POOL_ORDERS
    }
    if orders == RING_ORDERS:
        assert retries == RING_RETRIES
        assert len(rings) == 1
    else:
        assert (orders, retries) == (POOL_ORDERS, POOL_RETRIES)
        assert len(rings) > 1


@pytest.mark.parametrize(("first", "scale", "cross"), [*POOL_ORDERS, *POOL_RETRIES])
def test_ring_members_keep_room_for_other_documents(first, scale: float, cross: float) -> None:  # noqa: ANN001
    """One long document sets a high target load; four of 50K tokens must split for capacity
    but carry little work. No ring gives a member more than the GPUs' mean tokens and half the
    room the mean leaves: on two GPUs each (25K tokens a member) they filled their members far
    below the target load, and the other GPUs carried the difference."""
    topology = get_topology("zeppelin-C", num_nodes=4)
    cost = CostModel.default(get_model("llama-7b"), topology)
    array = np.asarray([300_000] + [50_000] * 4 + [240] * 100)
    thresholds = tier_thresholds(cost)
    rules = TierRules(True, True, thresholds, chunk_thresholds(thresholds, topology, True))
    loads = Loads(topology, CAPACITY, cost, topology.nics_per_node, two_d=True)
    choice = assign_tiers(array, loads, rules)
    placements, _ = place_pool(array, choice, loads, rules.chunks[1], first, scale, cross=cross)
    mean = float(array.sum()) / topology.world_size
    most = mean + 0.5 * (CAPACITY - mean)
    rings = [(int(array[d]), p) for d, p in enumerate(placements) if p.tier != Tier.LOCAL]
    assert len(rings) == 5
    for length, placement in rings:
        assert max(zigzag_loads(length, len(placement.ring))) <= most


@pytest.mark.parametrize(
    ("name", "gpus", "fill", "seed"),
    [("mixture", 32, 0.95, 0), ("long-tail", 64, 0.5, 1), ("lognormal", 64, 0.95, 0)],
)
def test_orders_placing_as_many_documents_first_place_alike(
    name: str, gpus: int, fill: float, seed: int
) -> None:
    """``pool.early_count``: orders that differ in ``first`` alone and place as many whole
    documents before the rings place every document alike (the search places one of them);
    orders that place different numbers first place differently."""
    array, choice, loads, _ = _placed(name, gpus, fill, seed, None, 1.0)
    fresh = Loads(loads.topology, CAPACITY, loads.cost_model, loads.num_links, two_d=True)
    nic_chunk = chunk_thresholds(tier_thresholds(loads.cost_model), loads.topology, True)[1]
    batch = pool_batch(array, choice, fresh, nic_chunk)
    placed: dict[int, set] = {}
    for first in (None, math.inf, 0.15, 0.05):
        placements = _placed(name, gpus, fill, seed, first, 1.0)[3]
        key = tuple((p.tier, p.ring) for p in placements)
        placed.setdefault(early_count(batch, first), set()).add(key)
    assert all(len(keys) == 1 for keys in placed.values())
    assert len({next(iter(keys)) for keys in placed.values()}) == len(placed)


@pytest.mark.parametrize("seed", range(40))
def test_soonest_ring_is_the_one_a_look_at_every_try_finds(seed: int) -> None:
    """``pool_rings._soonest`` (tries off a heap by bounds on their end) against a look at
    every try: the ring whose busiest member ends soonest, ties to the first try; equal loads,
    loads a rounding step apart, GPUs without room, tries no GPUs can take."""
    from megatron_zeppelin.planner.place.pool_rings import Arrays, _Ends, _members, _soonest

    rng = np.random.default_rng(seed)
    k, nodes = 8, int(rng.integers(2, 7))
    world = k * nodes
    cost = rng.choice([0.0, 1.0, 1.0 + 2**-52, 2.0, 3.0], size=world)
    cost = cost * rng.choice([1.0, 1.0, 1.1], size=world)
    tokens = rng.integers(0, 100, size=world)
    arrays, room = Arrays(cost, tokens), 100 - tokens
    tries = []
    for _ in range(int(rng.integers(1, 14))):
        size = int(rng.integers(2, min(3 * k, world) + 1))  # ring_sizes stop at the world
        where = "node" if size <= k and rng.random() < 0.6 else "any"
        if size % k == 0 and rng.random() < 0.5:
            where = "whole" if size > k else "node"
        per_rank = int(rng.integers(0, 90))
        weight, floor = float(rng.choice([0.0, 0.01])), int(rng.choice([0, 80]))
        key = float(rng.choice([0.0, 0.5, 1.0, 1.0 + 2**-52]))
        tries.append((size, per_rank, _Ends(arrays, weight, floor, per_rank), key, where))
    best = None
    for index, (size, per_rank, ends, key, where) in enumerate(tries):
        ring = _members(ends.get(), room, size, key, per_rank, math.inf, k, where)
        if ring is not None:
            end = float(ends.get()[list(ring)].max()) + key
            if best is None or (end, index) < best[:2]:
                best = (end, index, ring, where == "whole")
    found = _soonest(tries, room, np.sort(cost), k)
    assert found == (None if best is None else (best[1], best[2]))


@pytest.mark.parametrize(
    ("name", "gpus", "fill", "seed"),
    [("prolong", 64, 0.95, 1), ("lognormal", 32, 0.95, 2), ("mixture", 64, 0.5, 1)],
)
def test_rings_tried_once_per_length_and_goal_place_as_fresh(
    name: str, gpus: int, fill: float, seed: int
) -> None:
    """Every order placed with one ``PoolBatch`` (its memo of ring tries filled by the orders
    before: by length and goal, or with numba every ring's at once by goal) places every
    document and load as an order placed from scratch; the memo is read again (fewer tries
    kept than rings placed, or than orders). Keying the tries by length alone, not by the
    goal, fails it: the orders' targets differ."""
    from pool_batches import stress_batch

    batch = stress_batch(name, gpus, fill, seed, 32_768)
    chunk = batch.rules.chunks[1]
    choice = assign_tiers(batch.array, batch.new_loads(), batch.rules)
    shared = pool_batch(batch.array, choice, batch.new_loads(), chunk)
    for first, scale, cross in ALL_ORDERS:
        remembered, fresh = batch.new_loads(), batch.new_loads()
        got = place_pool(batch.array, choice, remembered, chunk, first, scale, shared, cross)
        want = place_pool(batch.array, choice, fresh, chunk, first, scale, cross=cross)
        assert got == want, (first, scale, cross)
        assert (remembered.cost, remembered.tokens) == (fresh.cost, fresh.tokens)
    if ring_line.compiled():  # every ring's tries at once, per goal
        assert 0 < len(shared.lines) < len(ALL_ORDERS), "no two orders share a goal"
    else:
        assert 0 < len(shared.tries) < len(ALL_ORDERS) * len(shared.ring_docs)


@NEEDS_NUMBA
@pytest.mark.parametrize("cluster", ["zeppelin-C", "dgx-h100"])
def test_ring_tries_are_options_size_by_size(cluster: str) -> None:
    """``pool_rings.ring_tries`` (every size in one compiled call, ``ring_search.tries``)
    against ``ring_options.options`` asked size by size: the same tries in the same order, the
    same keys to the last bit, over lengths from a few thousand tokens to
    a million, targets that make the 2-D scheme worth spreading or not, short and long NIC
    pieces, routed or not, balancing linear seconds or not, with and without the 2-D
    scheme."""
    from megatron_zeppelin.planner.loops import ring_search
    from megatron_zeppelin.planner.loops.ring_search import PLACES
    from megatron_zeppelin.planner.place.pool_rings import ring_sizes, ring_tries

    assert ring_search.compiled()
    from megatron_zeppelin.planner.place.ring_options import PoolGoal, most_tokens, options

    topology = get_topology(cluster, num_nodes=16)
    cost = CostModel.default(get_model("llama-7b"), topology)
    rng = np.random.default_rng(7)
    lengths = rng.integers(2_000, 1 << 20, 60).tolist() + [4_096, 65_536, 1 << 20]
    places = set()
    for balance_linear, two_d, links in ((True, True, 4), (False, True, 1), (True, False, 1)):
        loads = Loads(topology, 65_536, cost, links, balance_linear=balance_linear, two_d=two_d)
        for length in lengths:
            target = loads.ring_key(length, 8, "nvlink") * float(rng.choice([0.05, 0.3, 1.0]))
            chunk = int(rng.choice([512, 4_096, 32_768]))
            goal = PoolGoal(target, int(rng.choice([0, 30_000])), chunk, 65_536)
            work = loads.ring_seconds(length, 1) + loads.linear_weight * length
            want = [
                (size, most_tokens(length, size), key, PLACES[where])
                for size in ring_sizes(length, work, target, loads, goal.member_tokens)
                for key, where in options(length, size, loads, goal)
            ]
            tries = ring_tries(length, loads, goal)
            got = list(
                zip(
                    tries.sizes.tolist(),
                    tries.per_rank.tolist(),
                    tries.keys.tolist(),
                    tries.places.tolist(),
                )
            )
            assert got == want, (length, goal)
            places |= {where for *_, where in want}
    assert places == set(PLACES.values())


@NEEDS_NUMBA
@pytest.mark.parametrize("cluster", ["zeppelin-C", "dgx-h100", "slow-nvlink"])
def test_ring_tries_of_every_length_at_once_are_each_lengths(cluster: str) -> None:
    """``pool_rings.ring_tries_all`` (every length's sizes and tries in one compiled call,
    ``ring_line.tries``) against ``ring_tries`` length by length: the same tries in the same
    order, keys to the last bit, where each length's start, and over whole nodes the 2-D
    scheme's share (``Loads.rank_share``: compute seconds, exposed at a member whose edges
    cross nodes and at one whose edges do not); lengths that may take the 2-D scheme wide
    among them, routed or not, balancing linear seconds or not, with and without the 2-D
    scheme."""
    import dataclasses

    from megatron_zeppelin.planner.cost.costmodel import LinkCost
    from megatron_zeppelin.planner.loops.ring_search import PLACES
    from megatron_zeppelin.planner.place.pool_rings import ring_tries, ring_tries_all
    from megatron_zeppelin.planner.place.ring_options import PoolGoal, wide_two_d

    topology = get_topology(cluster.replace("slow-nvlink", "zeppelin-C"), num_nodes=16)
    cost = CostModel.default(get_model("llama-7b"), topology)
    if cluster == "slow-nvlink":  # the flat ring beats the 2-D scheme over some whole nodes
        cost = dataclasses.replace(cost, nvlink=LinkCost(cost.nic.bytes_per_s / 2, 3e-6))
    rng = np.random.default_rng(11)
    lengths = np.asarray(rng.integers(2_000, 1 << 20, 40).tolist() + [4_096, 65_536, 1 << 20])
    wide, whole, inner = 0, 0, 0
    for balance_linear, two_d, links in ((True, True, 4), (False, True, 1), (True, False, 1)):
        loads = Loads(topology, 65_536, cost, links, balance_linear=balance_linear, two_d=two_d)
        for factor, chunk, most in ((0.05, 512, 65_536), (0.3, 4_096, 20_000), (1.0, 32_768, 0)):
            target = loads.ring_key(1 << 18, 8, "nvlink") * factor
            goal = PoolGoal(target, 30_000 if most == 20_000 else 0, chunk, most or 65_536)
            found, offsets = ring_tries_all(lengths, loads, goal)
            for i, length in enumerate(lengths.tolist()):
                want = ring_tries(length, loads, goal)
                at = slice(int(offsets[i]), int(offsets[i + 1]))
                for column in ("sizes", "per_rank", "keys", "places"):
                    got = getattr(found, column)[at].tolist()
                    assert got == getattr(want, column).tolist(), (length, goal, column)
                rows = np.flatnonzero(want.places == PLACES["whole"]).tolist()
                for j in rows:
                    share = loads.rank_share(length, int(want.sizes[j]), "nic", links)
                    expect = [share.compute_s, share.exposed_at(True), share.exposed_at(False)]
                    assert found.shares[at][j].tolist() == expect, (length, goal)
                    inner += expect[1] != expect[2]
                assert np.isnan(np.delete(found.shares[at], rows, axis=0)).all()
                whole += len(rows)
                wide += two_d and wide_two_d(length, loads, goal)
    assert whole > 0 and wide > 0, (whole, wide)
    assert whole > 0 and wide > 0, (whole, wide)
    assert inner > 0 or cluster != "slow-nvlink", "no flat ring over whole nodes beat the 2-D"


def test_distinct_drops_only_placements_made_before() -> None:
    """``candidate.distinct`` keeps the first of candidates placing every document alike (even
    placed in another order, their loads' seconds rounding apart), and keeps placements that
    differ though every GPU holds the same tokens (two documents of one length swapped), or
    whose tokens differ."""
    from megatron_zeppelin.planner.place.placement import Placement
    from megatron_zeppelin.planner.search.candidate import Candidate, distinct

    topology = get_topology("zeppelin-C", num_nodes=2)
    cost = CostModel.default(get_model("llama-7b"), topology)
    array = np.asarray([3_000, 3_000, 5_000, 40_000])
    ring = Placement(Tier.INTRA, (4, 5, 6, 7))

    def placed(ranks: tuple[int, ...], backwards: bool = False) -> Candidate:
        placements = [Placement(Tier.LOCAL, (r,)) for r in ranks] + [ring]
        loads = Loads(topology, 65_536, cost)
        order = range(len(array))[::-1] if backwards else range(len(array))
        for doc in order:
            if doc < len(ranks):
                loads.add_local(ranks[doc], int(array[doc]))
            else:
                loads.add_ring(ring.ring, int(array[doc]))
        return Candidate(placements, loads, 0, 0, {"attention": max(loads.cost)})

    first, again = placed((0, 1, 2)), placed((0, 1, 2), backwards=True)
    swapped, other = placed((1, 0, 2)), placed((0, 2, 1))
    assert again.loads.tokens == swapped.loads.tokens == first.loads.tokens
    assert other.loads.tokens != first.loads.tokens
    kept = distinct([first, again, swapped, other, placed((1, 0, 2))])
    assert [id(c) for c in kept] == [id(first), id(swapped), id(other)]
