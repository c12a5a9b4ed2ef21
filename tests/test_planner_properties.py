"""Properties of the Zeppelin planner over random batches and topologies.

Tier: pure (no torch, no processes). Hypothesis draws 1-4 nodes x 1-8 GPUs with NIC counts that
divide the GPUs, document lengths from 1 token to several GPUs' capacity, and capacities from
tight to loose.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from examples import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost import steptime
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.linear_layout import (
    _count_moves,
    _move_arrays,
    attention_ranges_by_rank,
    balanced_layout,
)
from megatron_zeppelin.planner.plan.plan import Plan, Tier
from megatron_zeppelin.planner.plan.schedule import link_bytes, ring_schedule
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch, tier_thresholds
from megatron_zeppelin.planner.simulate.simulator import simulate
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import PRESETS, get_topology

pytestmark = pytest.mark.pure

SETTINGS = settings(
    max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def topologies(draw) -> Topology:
    gpus = draw(st.integers(1, 8))
    nics = draw(st.sampled_from([n for n in range(1, gpus + 1) if gpus % n == 0]))
    return Topology(num_nodes=draw(st.integers(1, 4)), gpus_per_node=gpus, nics_per_node=nics)


@st.composite
def batches(draw, slack=(1.3, 3.0)):
    """(lengths, topology, capacity) with room: capacity >= slack x the even share."""
    topo = draw(topologies())
    lengths = draw(
        st.lists(
            st.one_of(st.integers(1, 300), st.integers(300, 20_000), st.integers(20_000, 90_000)),
            min_size=1,
            max_size=40,
        )
    )
    share = sum(lengths) / topo.world_size
    factor = draw(st.floats(*slack))
    capacity = max(int(share * factor) + 8, 64)
    return lengths, topo, capacity


def _cost(topo: Topology, model: str = "llama-7b") -> CostModel:
    return CostModel.default(get_model(model), topo)


def _plan(lengths, topo, capacity, **options) -> Plan:
    return plan_batch(
        lengths,
        topology=topo,
        cost_model=_cost(topo),
        capacity=capacity,
        options=PlannerOptions(**options),
    )


def _covered_once(ranges_by_doc: dict[int, list[tuple[int, int]]], lengths: list[int]) -> None:
    assert sorted(ranges_by_doc) == list(range(len(lengths)))
    for doc, ranges in ranges_by_doc.items():
        pos = 0
        for start, end in sorted(ranges):
            assert start == pos and end > start, (doc, ranges)
            pos = end
        assert pos == lengths[doc]


@SETTINGS
@given(batches(slack=(1.05, 3.0)))
def test_every_token_once_and_capacity_respected(batch):
    """Any batch that fits the cluster plans (the last resort lays documents end to end)."""
    lengths, topo, capacity = batch
    plan = _plan(lengths, topo, capacity)
    attention, linear = defaultdict(list), defaultdict(list)
    for rank in range(topo.world_size):
        for r in plan.attention_ranges(rank):
            attention[r.seq].append((r.start, r.end))
        for r in plan.linear_ranges(rank):
            linear[r.seq].append((r.start, r.end))
        assert plan.num_attention_tokens(rank) <= capacity
        assert plan.num_linear_tokens(rank) <= capacity
    _covered_once(attention, lengths)
    _covered_once(linear, lengths)


@SETTINGS
@given(batches())
def test_zigzag_chunks_even_and_linear_layout_balanced(batch):
    lengths, topo, capacity = batch
    plan = _plan(lengths, topo, capacity)
    uneven = plan.meta["placement"] == "shares"  # members' shares differ, each mirrored
    for seq in plan.sequences:
        if seq.ring_size > 1:
            chunks = [s.num_tokens for s in seq.attention]
            if seq.length >= 2 * seq.ring_size or uneven:
                assert len(chunks) == 2 * seq.ring_size
            if uneven:
                assert all(abs(a - b) <= 1 for a, b in zip(chunks[::2], chunks[1::2])), seq
            else:
                assert max(chunks) - min(chunks) <= 1, seq
            assert [s.rank for s in seq.attention[::2]] == list(seq.ring)
    _check_linear_layout(plan)
    # Forced, the even layout is even whatever it costs; the placement is then the fastest the
    # planner found for that layout (it used to be the automatic plan's, whatever the layout),
    # timed as the simulator times it.
    even = _plan(lengths, topo, capacity, linear_layout="even")
    assert even.meta["linear_layout"] == "even"
    counts = [even.num_linear_tokens(r) for r in range(topo.world_size)]
    assert max(counts) - min(counts) <= 1
    assert all(c.get("layout", "even") == "even" for c in even.meta["candidates"])
    if even.meta["timed_by"] == "simulator":
        step = simulate(even, _cost(topo)).step_time_s
        assert even.meta["predicted_step_s"] == pytest.approx(step, rel=1e-9)


def _check_linear_layout(plan: Plan) -> None:
    """The linear layout is "as even as the cost model says pays": one of the candidates
    (``attention``: the attention layout; ``node``: even inside every node; ``even``: even over
    the world), and its predicted layer time is the least of the three."""
    topo = plan.topology
    predicted = plan.meta["linear_layout_seconds"]
    chosen = plan.meta["linear_layout"]
    assert set(predicted) == {"attention", "node", "even"}
    assert predicted[chosen] == min(predicted.values())
    counts = [plan.num_linear_tokens(r) for r in range(topo.world_size)]
    if chosen == "attention":
        for rank in range(topo.world_size):
            ranges = sorted((r.seq, r.start, r.end) for r in plan.attention_ranges(rank))
            merged = [(r.seq, r.start, r.end) for r in plan.linear_ranges(rank)]
            assert sum(e - s for _, s, e in ranges) == sum(e - s for _, s, e in merged)
            assert plan.meta["remap_tokens"] == {"intra_node": 0, "inter_node": 0}
    elif chosen == "node":
        for node in range(topo.num_nodes):
            in_node = [counts[r] for r in topo.ranks_of_node(node)]
            assert max(in_node) - min(in_node) <= 1
        assert plan.meta["remap_tokens"]["inter_node"] == 0
    else:
        assert max(counts) - min(counts) <= 1


@SETTINGS
@given(batches())
def test_deterministic_and_json_round_trip(batch):
    lengths, topo, capacity = batch
    first = _plan(lengths, topo, capacity)
    again = _plan(list(lengths), topo, capacity)
    assert first == again
    assert first.to_json() == again.to_json()
    restored = Plan.from_json(first.to_json())
    assert restored == first
    assert restored.meta == first.meta


@SETTINGS
@given(batches(slack=(1.5, 4.0)))
def test_longer_document_never_in_lower_tier(batch):
    """Guaranteed by the staged placement unless capacity fragmentation turned a local document
    into a ring, which the plan reports in ``meta["capacity_promotions"]``. The pool placement
    sizes rings by where GPUs have room (a shorter document may cross nodes over part of their
    GPUs where a longer one fills a node), and so does the one with uneven ring shares;
    ``meta["placement"]`` says which was kept."""
    lengths, topo, capacity = batch
    rank = {Tier.LOCAL: 0, Tier.INTRA: 1, Tier.INTER: 2}
    for plan in (_plan(lengths, topo, capacity), _plan(lengths, topo, capacity, pool=False)):
        if plan.meta["capacity_promotions"] or plan.meta["placement"] != "staged":
            continue
        by_length = sorted(plan.sequences, key=lambda s: s.length)
        for shorter, longer in zip(by_length, by_length[1:]):
            assert rank[Tier(longer.tier)] >= rank[Tier(shorter.tier)], (shorter, longer)


@SETTINGS
@given(batches())
def test_inter_node_rings_use_fewest_crossings(batch):
    """Every ring across nodes visits them node by node; the staged placement's rings also take
    consecutive nodes (the pool placement's 2-D rings take whole nodes wherever they are)."""
    lengths, topo, capacity = batch
    for plan in (_plan(lengths, topo, capacity), _plan(lengths, topo, capacity, pool=False)):
        for seq in plan.sequences:
            if seq.tier != Tier.INTER:
                continue
            nodes = [topo.node_of(r) for r in seq.ring]
            crossings = sum(nodes[i] != nodes[(i + 1) % len(nodes)] for i in range(len(nodes)))
            assert crossings == len(set(nodes))  # visited node by node
            if plan.meta["placement"] == "staged":
                assert sorted(set(nodes)) == list(range(min(nodes), max(nodes) + 1))


def _nic_step_loads(plan: Plan, routing: bool) -> list[dict[int, list[int]]]:
    """Per ring step, per node: bytes on each of its NICs (1 byte per token)."""
    topo = plan.topology
    loads = []
    for step in ring_schedule(plan, (Tier.INTER,)):
        counts = link_bytes(plan, [step], bytes_per_token=1, routing=routing)
        per_node = {
            node: [counts.get(f"nic:{node}.{nic}", 0) for nic in range(topo.nics_per_node)]
            for node in range(topo.num_nodes)
        }
        loads.append(per_node)
    return loads


@SETTINGS
@given(batches(slack=(1.3, 2.0)), st.sampled_from(["zeppelin-A", "zeppelin-C"]))
def test_routing_balances_nics_in_every_step(batch, preset):
    lengths, _, _ = batch
    topo = get_topology(preset, num_nodes=3)
    lengths = [*lengths, 300_000, 200_000]  # long documents, so inter-node rings exist
    capacity = max(20_000, int(sum(lengths) / topo.world_size * 1.5))
    plan = _plan(lengths, topo, capacity)
    edges: set[tuple[int, int]] = set()
    for step in ring_schedule(plan, (Tier.INTER,)):
        for msg in step:
            if not topo.same_node(msg.src, msg.dst):
                edges.add((msg.src, msg.dst))
    assert edges == {(r.src, r.dst) for r in plan.routes}
    for per_node in _nic_step_loads(plan, routing=True):
        for node, nic_bytes in per_node.items():
            total = sum(nic_bytes)
            if total == 0:
                continue
            # Tolerance: 1% of the node's step traffic plus rounding of a few tokens per part.
            assert max(nic_bytes) - min(nic_bytes) <= 0.01 * total + 4 * len(plan.routes), (
                node,
                nic_bytes,
            )
    unrouted = _plan(lengths, topo, capacity, routing=False)
    assert unrouted.routes == ()


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("model", ["llama-7b", "llama3-8b", "tiny"])
def test_thresholds_order(preset, model):
    topo = get_topology(preset, num_nodes=2)
    intra, inter = tier_thresholds(CostModel.default(get_model(model), topo))
    assert 1 <= intra < inter


def test_explicit_thresholds_override_auto():
    topo = get_topology("zeppelin-C", num_nodes=2)
    lengths = [20_000] + [100] * 200
    auto = _plan(lengths, topo, 100_000)
    assert auto.sequences[0].tier != Tier.LOCAL  # far above the auto thresholds
    kept = _plan(lengths, topo, 100_000, thresholds=(30_000, 50_000))
    assert kept.tier_counts() == {"local": len(lengths), "intra": 0, "inter": 0}
    assert kept.meta["thresholds"] == [30_000, 50_000]


def test_capacity_forces_splits_across_gpus_and_nodes():
    topo = get_topology("zeppelin-A", num_nodes=4)
    capacity = 4096
    plan = _plan([3 * capacity, 9 * capacity, 100], topo, capacity, allow_split=False)
    tiers = [Tier(s.tier) for s in plan.sequences]
    assert tiers == [Tier.INTRA, Tier.INTER, Tier.LOCAL]
    assert len({topo.node_of(r) for r in plan.sequences[1].ring}) == 2  # fewest nodes
    assert plan.sequences[0].ring_size == 3  # fewest GPUs that hold it


def test_balance_beats_round_robin_on_skewed_batch():
    topo = get_topology("zeppelin-C", num_nodes=2)
    lengths = [60_000, 30_000] + [2_000] * 40 + [200] * 200
    plan = _plan(lengths, topo, 65_536)
    # Predicted per-GPU time (attention + linear) within 10% of the mean.
    assert plan.meta["load_imbalance"] < 1.1
    _check_linear_layout(plan)
    even = _plan(lengths, topo, 65_536, linear_layout="even")
    counts = [even.num_linear_tokens(r) for r in range(topo.world_size)]
    assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("capacity", [23, 24, 30])
def test_one_gpu_batch_that_fits_exactly(capacity):
    """Regression: a batch of exactly the capacity on a single GPU used to find no room."""
    topo = Topology(num_nodes=1, gpus_per_node=1, nics_per_node=1)
    plan = _plan([7, 1, 12, 3], topo, capacity)
    assert plan.tier_counts() == {"local": 4, "intra": 0, "inter": 0}
    assert plan.num_attention_tokens(0) == plan.num_linear_tokens(0) == 23


@pytest.mark.parametrize(("dist", "fill"), [("wikipedia", 0.9), ("magi_realworld", 0.8)])
def test_tight_but_feasible_batches_plan(dist, fill):
    """Regression: batches at 80-90% of the cluster's capacity, which every baseline plans,
    must plan too (short documents always find room when the overall fill allows)."""
    topo = get_topology("zeppelin-B", num_nodes=4)
    capacity = 16_384
    lengths = sample_lengths(dist, num_tokens=int(fill * capacity * topo.world_size), seed=0)
    plan = _plan(lengths, topo, capacity)
    assert max(plan.num_attention_tokens(r) for r in range(topo.world_size)) <= capacity


def test_remapping_used_only_where_it_pays():
    """Two long documents kept whole (no balance splits) leave two GPUs of a node holding every
    token: the node layout moves half of them over NVLink and the simulated step is faster than
    without remapping. A batch the planner balances well moves nothing."""
    topo = get_topology("zeppelin-C", num_nodes=2)
    cost = _cost(topo)
    skewed = _plan([30_000, 30_000, 500, 500], topo, 65_536, allow_split=False)
    assert skewed.meta["linear_layout"] in ("node", "even")
    assert sum(skewed.meta["remap_tokens"].values()) > 0
    with_remap, without = simulate(skewed, cost), simulate(skewed, cost, remap=False)
    assert with_remap.step_time_s < without.step_time_s
    balanced = _plan(sample_lengths("prolong", num_tokens=400_000, seed=1), topo, 65_536)
    if balanced.meta["linear_layout"] == "attention":
        assert (
            simulate(balanced, cost).step_time_s
            == simulate(balanced, cost, remap=False).step_time_s
        )
    else:
        assert (
            simulate(balanced, cost).step_time_s
            <= simulate(balanced, cost, remap=False).step_time_s
        )


@pytest.mark.parametrize("dist", ["wikipedia", "prolong"])
def test_simulated_efficiency_of_balanced_plans(dist):
    """The planner balances attention plus linear work: on a 4-node cluster the simulated step
    stays within 20% of the batch's lower bound (perfect spread, no communication)."""
    topo = get_topology("zeppelin-C", num_nodes=4)
    cost = _cost(topo)
    lengths = sample_lengths(dist, num_tokens=int(0.7 * 16_384 * topo.world_size), seed=0)
    plan = _plan(lengths, topo, 16_384)
    assert simulate(plan, cost).efficiency > 0.8


@SETTINGS
@given(batches())
def test_linear_layout_priced_from_counts_matches_built_layout(batch):
    """``choose_linear_layout`` prices the balanced layouts from token counts alone; the moves
    it assumes are the ones ``balanced_layout`` then makes."""
    lengths, topo, capacity = batch
    plan = _plan(lengths, topo, capacity, remap=False)
    by_rank = attention_ranges_by_rank(plan.sequences, topo.world_size)
    counts = [plan.num_attention_tokens(r) for r in range(topo.world_size)]
    for scope in ("node", "even"):
        layout, moves = balanced_layout(by_rank, topo, scope=scope)
        tokens = [sum(r.num_tokens for r in ranges) for ranges in layout]
        assert _count_moves(counts, tokens, topo) == moves
        src, dst, moved = _move_arrays(counts, tokens, topo)  # what the pricing reads
        assert len(moved) == len(moves) and (moved > 0).all()  # every pair once
        assert steptime.remap_seconds_of(src, dst, moved, topo, _cost(topo)) == (
            steptime.remap_seconds(moves, topo, _cost(topo))
        )
        assert sum(moves.values()) == sum(max(0, c - t) for c, t in zip(counts, tokens))
