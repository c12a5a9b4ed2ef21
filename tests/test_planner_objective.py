"""The planner's objective is the simulator's step time: one function, and the same numbers.

Tier: pure. The oracle of the simulator's array timeline is ``stepwise.reference_attention``,
the same timeline computed one ring step and one rank at a time.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from examples import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_zeppelin.planner.baselines.baselines import (
    BASELINES,
    build_baseline,
    plan_without_remap,
    sequence_on,
)
from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost import steptime
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.place.schemes import every_two_d
from megatron_zeppelin.planner.plan import linear_layout
from megatron_zeppelin.planner.plan.plan import Route, RoutePart, Span
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.planner.simulate import simulator
from megatron_zeppelin.planner.simulate.simulator import remap_matrix, simulate
from megatron_zeppelin.planner.simulate.stepwise import reference_attention
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

MODEL = get_model("llama-7b")
SLOW = settings(
    max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _close(a, b) -> bool:
    return np.allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-15)


@st.composite
def _batches(draw):
    topo = Topology(
        num_nodes=draw(st.integers(1, 3)),
        gpus_per_node=draw(st.sampled_from([2, 4])),
        nics_per_node=draw(st.sampled_from([1, 2])),
    )
    lengths = draw(st.lists(st.integers(1, 40_000), min_size=1, max_size=25))
    capacity = max(64, int(sum(lengths) / topo.world_size * draw(st.floats(1.1, 2.5))) + 8)
    return lengths, topo, capacity


@SLOW
@given(_batches(), st.sampled_from(["zeppelin", *BASELINES]), st.booleans())
def test_array_timeline_matches_the_step_by_step_one(batch, builder, routing) -> None:
    lengths, topo, capacity = batch
    cost = CostModel.default(MODEL, topo)
    if builder == "zeppelin":
        plans = [plan_batch(lengths, topology=topo, cost_model=cost, capacity=capacity)]
    else:
        try:
            plans = build_baseline(
                builder, lengths, topology=topo, capacity=capacity, cost_model=cost
            )
        except (ValueError, IndexError):  # a baseline's own limits (megatron-core's scheduler)
            return
    for plan in plans:
        sequential = plan.meta.get("execution") == "sequential"
        got = simulator._attention_layer(plan, cost, routing, sequential=sequential)
        if sequential:  # every document its own pass: the sum of the documents alone
            want = ([0.0] * topo.world_size, [0.0] * topo.world_size)
            for seq in plan.sequences:
                alone = plan_without_remap([seq], topo, name="one", capacity=None)
                for total, part in zip(want, reference_attention(alone, cost, routing)):
                    for r, value in enumerate(part):
                        total[r] += value
        else:
            want = reference_attention(plan, cost, routing)
        assert _close(got[0], want[0]) and _close(got[1], want[1])


@pytest.mark.parametrize(("preset", "nodes"), [("zeppelin-A", 3), ("zeppelin-C", 2)])
def test_two_d_documents_are_timed_like_the_stepwise_timeline(preset: str, nodes: int) -> None:
    """Column rings share the phases and the links with the flat rings; the head all-to-alls
    hide behind nothing: the same seconds as the stepwise timeline."""
    topo = get_topology(preset, num_nodes=nodes)
    cost = CostModel.default(MODEL, topo)
    lengths = [
        *sample_lengths("prolong", num_tokens=6_000 * topo.world_size, seed=1),
        9 * 16_384,
        7 * 16_384,
    ]
    # The staged placement: its rings across nodes take whole nodes, as the 2-D scheme needs.
    options = PlannerOptions(pool=False)
    plan = plan_batch(lengths, topology=topo, cost_model=cost, capacity=32_768, options=options)
    plan = every_two_d(plan)
    assert any(s.is_two_d for s in plan.sequences)
    for routing in (True, False):
        got = simulator._attention_layer(plan, cost, routing)
        want = reference_attention(plan, cost, routing)
        assert _close(got[0], want[0]) and _close(got[1], want[1])


def test_any_spans_are_timed_like_zigzag_ones() -> None:
    """A document whose spans are not zigzag (contiguous pieces) is timed block by block."""
    topo = Topology(num_nodes=1, gpus_per_node=4, nics_per_node=1)
    cost = CostModel.default(MODEL, topo)
    seq = sequence_on(0, 10_000, (0, 1, 2, 3), topo)
    cut = (0, 1000, 4000, 9000, 10_000)
    pieces = tuple(Span(r, cut[r], cut[r + 1]) for r in range(4))
    plan = plan_without_remap(
        [dataclasses.replace(seq, attention=pieces)], topo, name="x", capacity=None
    )
    got = simulator._attention_layer(plan, cost, True)
    assert _close(got[0], reference_attention(plan, cost, True)[0])
    assert got[0][3] > got[0][0]  # the last piece sees the most keys


@settings(max_examples=examples(30), deadline=None)
@given(
    lengths=st.lists(st.integers(1, 24), min_size=1, max_size=3),
    weights=st.lists(st.integers(0, 3), min_size=4, max_size=4).filter(lambda w: sum(w) > 0),
)
def test_routes_with_idle_parts_are_timed_like_the_stepwise_timeline(lengths, weights) -> None:
    """Route parts of no weight, and messages too short to give every part a row, leave legs
    out of ``schedule.message_legs``; the array timeline still puts each part's tokens on that
    part's own hops."""
    topo = Topology(num_nodes=2, gpus_per_node=4, nics_per_node=2)
    cost = CostModel.default(MODEL, topo)
    a, b = topo.rank_of(0, 0), topo.rank_of(1, 1)
    seqs = [sequence_on(i, n, (a, b), topo) for i, n in enumerate(lengths)]
    routes = tuple(
        Route(
            src,
            dst,
            tuple(
                RoutePart(
                    topo.rank_of(topo.node_of(src), j),
                    topo.rank_of(topo.node_of(dst), (j + 1) % 4),
                    w,
                )
                for j, w in enumerate(weights)
            ),
        )
        for src, dst in ((a, b), (b, a))
    )
    plan = dataclasses.replace(
        plan_without_remap(seqs, topo, name="routed", capacity=None), routes=routes
    )
    got = simulator._attention_layer(plan, cost, True)
    want = reference_attention(plan, cost, True)
    assert _close(got[0], want[0]) and _close(got[1], want[1])


def test_step_time_is_the_shared_layer_function() -> None:
    """The simulator and the planner's layout pricing call the same ``layer_seconds``, and a
    step is ``num_layers`` of it over the simulator's per-rank figures."""
    assert simulator.layer_seconds is steptime.layer_seconds
    assert linear_layout.layer_seconds is steptime.layer_seconds
    assert simulator.remap_seconds is steptime.remap_seconds
    # The planner prices moves as arrays, through the function ``remap_seconds`` wraps.
    assert linear_layout.remap_seconds_of is steptime.remap_seconds_of
    topo = get_topology("zeppelin-A", num_nodes=2)
    cost = CostModel.default(MODEL, topo)
    lengths = sample_lengths("magi_realworld", num_tokens=int(0.7 * 16_384 * 16), seed=4)
    plan = plan_batch(
        lengths,
        topology=topo,
        cost_model=cost,
        capacity=16_384,
        options=PlannerOptions(linear_layout="node"),
    )
    compute, exposed = simulator._attention_layer(plan, cost, True)
    linear = [cost.linear_time(plan.num_linear_tokens(r)) for r in range(topo.world_size)]
    moves = {(b, a): n for (a, b), n in remap_matrix(plan).items()}
    remap = steptime.remap_seconds(moves, topo, cost)
    layer = steptime.layer_seconds(linear, np.add(compute, exposed).tolist(), remap)
    assert simulate(plan, cost).step_time_s == pytest.approx(MODEL.num_layers * layer, rel=1e-12)


@pytest.mark.parametrize(
    ("preset", "nodes", "dist", "fill"),
    [
        ("zeppelin-B", 4, "wlbllm", 0.7),
        ("zeppelin-A", 2, "prolong", 0.9),
        ("zeppelin-C", 4, "magi_realworld", 0.7),
    ],
)
def test_planner_keeps_the_candidate_the_simulator_times_fastest(preset, nodes, dist, fill):
    """Where several placements are close, the simulator times them and the fastest is kept;
    the plan's predicted step is then exactly the simulated one. Otherwise the lone candidate's
    estimate is within 5% of the simulation."""
    topo = get_topology(preset, num_nodes=nodes)
    cost = CostModel.default(MODEL, topo)
    for seed in range(3):
        lengths = sample_lengths(
            dist, num_tokens=int(fill * 16_384 * topo.world_size), seed=seed, max_length=131_072
        )
        plan = plan_batch(lengths, topology=topo, cost_model=cost, capacity=16_384)
        step = simulate(plan, cost).step_time_s
        timed = [
            c["simulated_layer_s"] for c in plan.meta["candidates"] if "simulated_layer_s" in c
        ]
        if plan.meta["timed_by"] == "simulator":
            assert plan.meta["predicted_step_s"] == pytest.approx(step, rel=1e-9)
            assert step == pytest.approx(MODEL.num_layers * min(timed), rel=1e-9)
        else:
            assert not timed
            assert plan.meta["predicted_step_s"] == pytest.approx(step, rel=0.05)


@settings(max_examples=examples(60), deadline=None)
@given(
    weights=st.lists(st.integers(0, 9), min_size=1, max_size=8).filter(lambda w: sum(w) > 0),
    tokens=st.lists(st.integers(0, 200_000), min_size=1, max_size=6),
)
def test_route_split_of_many_messages_is_the_route_split_of_each(weights, tokens) -> None:
    """The array timeline splits every message of an edge at once, exactly as the plan's one
    split function splits each."""
    from megatron_zeppelin.planner.plan.plan import split_by_weights
    from megatron_zeppelin.planner.simulate.transfers import split_by_weights_array

    parts = split_by_weights_array(np.asarray(tokens), weights)
    assert [list(row) for row in parts] == [split_by_weights(n, weights) for n in tokens]
