"""Tier: pure. Uneven ring shares (``plan.share_spans``) and the placement that lays documents
along the GPUs with them (``planner/place/shares.py``).

A member of a ring computes the document's attention in proportion to its tokens under
``share_spans``; the placement fills every GPU to one target load; the search keeps it only
where the simulator times it faster than the pool's rings of whole GPUs.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pool_batches import NEEDS_NUMBA, stress_batch

from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.place import shares
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.shares import MIN_NIC_SHARE, place_shares
from megatron_zeppelin.planner.plan.linear_layout import attention_layout
from megatron_zeppelin.planner.plan.plan import (
    Plan,
    SequencePlan,
    Tier,
    share_spans,
    zigzag_loads,
    zigzag_sequences,
    zigzag_spans,
)
from megatron_zeppelin.planner.plan.routing import build_routes
from megatron_zeppelin.planner.search.partition import plan_batch
from megatron_zeppelin.planner.simulate.simulator import simulate
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

CAPACITY = 32_768


def _pairs(start: int, end: int) -> int:
    """Causal pairs of query tokens ``[start, end)`` against their document's keys."""
    return (end * (end + 1) - start * (start + 1)) // 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(2, 400), min_size=1, max_size=9), st.integers(0, 10**6))
def test_share_spans_split_the_pairs_in_proportion_to_the_tokens(tokens, seed) -> None:  # noqa: ANN001
    length = sum(tokens)
    ring = tuple(np.random.default_rng(seed).permutation(64)[: len(tokens)].tolist())
    spans = share_spans(length, ring, tokens)
    assert all(s.end > s.start for s in spans)
    covered = sorted((s.start, s.end) for s in spans)
    assert covered[0][0] == 0 and covered[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    for rank, num in zip(ring, tokens):
        mine = [s for s in spans if s.rank == rank]
        assert len(mine) == 2 and sum(s.end - s.start for s in mine) == num
        # A front chunk and its mirror see ``num * (L + 1) / 2`` keys, as every member of a
        # zigzag ring does, off by what the mirrors' offsets differ (less than a token per
        # position before it per row, and half a document where ``num`` is odd).
        pairs = sum(_pairs(s.start, s.end) for s in mine)
        assert abs(pairs - num * (length + 1) / 2) <= num * len(tokens) + length


def test_share_spans_of_equal_tokens_are_the_zigzag_spans() -> None:
    for length, g in ((40, 4), (60, 3), (1024, 8)):  # even chunks: no rounding
        ring = tuple(range(g))
        tokens = [length // g] * g
        assert share_spans(length, ring, tokens) == zigzag_spans(length, ring)


@pytest.mark.parametrize("tokens", [[5, 5], [3, 8, 1], [10]])
def test_share_spans_refuse_shares_that_do_not_fit(tokens) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="token shares of at least 2"):
        share_spans(11, tuple(range(len(tokens) + (len(tokens) == 1))), tokens)


def test_a_small_share_computes_a_small_part() -> None:
    """The simulator times each member's compute in proportion to its tokens."""
    topology = get_topology("zeppelin-C", num_nodes=1)
    cost = CostModel.default(get_model("llama-7b"), topology)
    length, ring = 96_000, (0, 1, 2, 3)
    seconds = []
    for tokens in ([24_000] * 4, [8_000, 32_000, 32_000, 24_000]):
        seqs = (SequencePlan(0, length, Tier.INTRA, ring, share_spans(length, ring, tokens)),)
        plan = Plan(topology=topology, sequences=seqs, linear=attention_layout(seqs, 8))
        per_rank = simulate(plan, cost).per_rank
        seconds.append([per_rank[r].compute_s - per_rank[r].linear_s for r in ring])
    even, uneven = seconds
    assert max(even) == pytest.approx(min(even), rel=1e-9)
    # In proportion, but for the smaller blocks' lower rate (the cost model's efficiency curve).
    for share, got in zip([8_000, 32_000, 32_000, 24_000], uneven):
        assert got / even[0] == pytest.approx(share / 24_000, rel=0.1)
    assert uneven[0] < uneven[3] < uneven[1] == pytest.approx(uneven[2])


@pytest.mark.parametrize("link", ["nvlink", "nic"])
def test_equal_shares_cost_what_a_zigzag_ring_costs(link: str) -> None:
    topology = get_topology("zeppelin-C", num_nodes=2)
    cost = CostModel.default(get_model("llama-7b"), topology)
    ring = (4, 5, 6, 7, 8, 9) if link == "nic" else (1, 2, 3, 4, 5)
    length = 90_001
    zigzag = Loads(topology, CAPACITY * 8, cost, topology.nics_per_node)
    zigzag.add_ring(ring, length, link, flat=True)
    shared = Loads(topology, CAPACITY * 8, cost, topology.nics_per_node)
    shared.add_shares(ring, length, zigzag_loads(length, len(ring)), link)
    assert shared.tokens == zigzag.tokens
    np.testing.assert_allclose(shared.cost, zigzag.cost, rtol=1e-4)
    np.testing.assert_allclose(shared.exposed, zigzag.exposed, rtol=1e-4, atol=1e-12)


def _uniform_long(gpus: int, seed: int) -> tuple[np.ndarray, object, CostModel]:
    topology = get_topology("zeppelin-C", num_nodes=gpus // 8)
    cost = CostModel.default(get_model("llama-7b"), topology)
    tokens = int(0.5 * gpus * CAPACITY)
    lengths = sample_lengths("uniform-long", num_tokens=tokens, seed=seed, max_length=tokens // 2)
    return np.asarray(lengths), topology, cost


@pytest.mark.parametrize(("gpus", "seed"), [(16, 0), (64, 1), (128, 0)])
def test_every_document_is_laid_within_capacity(gpus: int, seed: int) -> None:
    array, topology, cost = _uniform_long(gpus, seed)
    loads = Loads(topology, CAPACITY, cost, topology.nics_per_node)
    placements = place_shares(array, loads)
    assert placements is not None and len(placements) == len(array)
    assert max(loads.tokens) <= CAPACITY and sum(loads.tokens) == int(array.sum())
    k = topology.gpus_per_node
    rings = [p.ring for p in placements]
    shares = {d: p.tokens for d, p in enumerate(placements) if p.tokens}
    for d, p in enumerate(placements):
        nodes = {rank // k for rank in p.ring}
        expected = Tier.INTRA if len(nodes) == 1 else Tier.INTER
        assert p.tier == (Tier.LOCAL if len(p.ring) == 1 else expected)
        if p.tokens:
            assert sum(p.tokens) == array[d] and min(p.tokens) >= 2
    seqs = zigzag_sequences(array.tolist(), rings, [p.tier for p in placements], shares)
    plan = Plan(
        topology=topology,
        sequences=seqs,
        linear=attention_layout(seqs, topology.world_size),
        routes=build_routes(seqs, topology),
        capacity=CAPACITY,
    )
    assert plan.num_tokens == int(array.sum())
    # The line fills every GPU to about one target: the busiest within a few percent of the mean.
    cost_s = np.asarray(loads.cost)
    assert cost_s.max() <= 1.08 * cost_s.mean()


def test_members_across_nodes_keep_a_share_that_hides_their_transfers() -> None:
    array, topology, cost = _uniform_long(128, 0)
    loads = Loads(topology, CAPACITY, cost, topology.nics_per_node)
    placements = place_shares(array, loads)
    assert placements is not None
    k = topology.gpus_per_node
    across = [(d, p) for d, p in enumerate(placements) if p.tier == Tier.INTER]
    assert across
    target = float(np.mean(loads.cost))
    for d, p in across:
        per_token = loads.ring_key(int(array[d]), len(p.ring), "nic", flat=True) / (
            array[d] / len(p.ring)
        )
        assert len({rank // k for rank in p.ring}) > 1
        assert min(p.tokens) * per_token >= 0.5 * MIN_NIC_SHARE * target


@NEEDS_NUMBA
@pytest.mark.parametrize(
    "batch",
    ["uniform-long 16 0.5 0", "uniform-long 128 0.5 1", "lognormal 128 0.5 0"]
    + ["long-tail 16 0.95 1", "mixture 128 0.5 0"],
)
def test_compiled_line_is_pythons(batch: str) -> None:
    """``loops/shares_line.py`` lays a batch out as ``shares._lay`` does, at every target from
    below the least that places every document (no room: ``None``) to above the most the
    bisection tries: the same rings, members and tokens."""
    name, gpus, fill, seed = batch.split()
    drawn = stress_batch(name, int(gpus), float(fill), int(seed))
    lengths, topology = drawn.array.tolist(), drawn.topology
    loads = Loads(topology, CAPACITY, drawn.cost, topology.nics_per_node)
    whole = [loads.ring_key(length, 1, "nvlink") for length in lengths]
    mean = sum(whole) / topology.world_size
    compiled = shares._compiled_lay(lengths, whole, loads)
    assert compiled is not None
    outcomes = set()
    for factor in np.linspace(0.9, 1.6, 36).tolist():
        expected = shares._lay(lengths, whole, loads, factor * mean)
        found = compiled(factor * mean)
        outcomes.add(expected is None)
        assert (found is None) == (expected is None), factor
        if expected is not None:
            assert shares._listed(found) == expected, factor
    assert outcomes == {True, False}  # targets with and without room


def test_no_room_gives_none() -> None:
    topology = get_topology("zeppelin-C", num_nodes=1)
    cost = CostModel.default(get_model("llama-7b"), topology)
    loads = Loads(topology, 1000, cost, topology.nics_per_node)
    assert place_shares(np.asarray([3000, 3000, 2500]), loads) is None


def test_the_search_keeps_shares_only_where_the_simulator_times_them_faster() -> None:
    array, topology, cost = _uniform_long(128, 0)
    plan = plan_batch(array.tolist(), topology=topology, cost_model=cost, capacity=CAPACITY)
    tried = plan.meta["candidates"]
    shares = [c for c in tried if c["placement"] == "shares"]
    assert shares, "every document is a ring here: the shares placement is tried"
    timed = [c for c in tried if "simulated_layer_s" in c]
    fastest = min(timed, key=lambda c: c["simulated_layer_s"])
    assert plan.meta["placement"] == fastest["placement"]
    assert simulate(plan, cost).step_time_s == pytest.approx(plan.meta["predicted_step_s"])


@pytest.mark.parametrize(("gpus", "seed"), [(16, 0), (1024, 1)])
def test_uneven_shares_speed_up_batches_of_long_documents_only(gpus, seed, monkeypatch) -> None:  # noqa: ANN001
    """Uniform-long at fill 0.5 (as ``compare_sweep.py --stress`` draws it): every document is a
    ring, the pool's rings of whole GPUs leave the busiest GPUs 6-9% above the mean, and the
    shares placement is kept for a faster step."""
    import megatron_zeppelin.planner.search.search as search

    array, topology, cost = _uniform_long(gpus, seed)

    def step() -> tuple[float, str]:
        plan = plan_batch(array.tolist(), topology=topology, cost_model=cost, capacity=CAPACITY)
        return simulate(plan, cost).step_time_s, plan.meta["placement"]

    with_shares, kept = step()
    monkeypatch.setattr(search, "place_shares", lambda *_: None)
    without, other = step()
    assert kept == "shares" and other != "shares"
    assert with_shares < 0.99 * without
