"""Tier: pure. Choosing per inter-node document between the flat ring and the 2-D scheme.

The chooser's closed forms must be the simulator's own figures for a document alone (so the
planner and the simulator agree on what is faster), the chooser must turn a document into a
valid 2-D one without moving a token, keep the flat ring where the heads do not split, and the
planner's plans must carry the choice through routing, the linear layout and the plan file.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import ModelSpec, get_model
from megatron_zeppelin.planner.place.schemes import choose_schemes, faster_scheme, scheme_seconds
from megatron_zeppelin.planner.plan.plan import (
    Plan,
    Scheme,
    SequencePlan,
    Tier,
    TokenRange,
    zigzag_spans,
)
from megatron_zeppelin.planner.plan.routing import build_routes
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.planner.simulate.simulator import simulate, tier_figures
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure


def one_document(topology: Topology, length: int, ring: tuple[int, ...], scheme: Scheme) -> Plan:
    seq = SequencePlan(0, length, Tier.INTER, ring, zigzag_spans(length, ring), scheme)
    linear = [[] for _ in range(topology.world_size)]
    for s in seq.attention:
        linear[s.rank].append(TokenRange(0, s.start, s.end))
    routes = build_routes([seq], topology)
    return Plan(topology, (seq,), tuple(map(tuple, linear)), routes=routes)


def attention_seconds(plan: Plan, cost: CostModel) -> float:
    """The slowest rank's attention (compute and exposed transfers) of one layer."""
    result = simulate(plan, cost, remap=False)
    layers = cost.model.num_layers
    return max(r.attention_s + r.comm_exposed_s for r in result.per_rank) / layers


@pytest.mark.parametrize("preset", ["zeppelin-A", "zeppelin-B", "zeppelin-C"])
@pytest.mark.parametrize("model", ["llama-7b", "llama3-8b"])
def test_closed_forms_are_the_simulators_figures_for_one_document(preset, model) -> None:  # noqa: ANN001
    for num_nodes, length in ((2, 16384), (3, 70001)):
        topology = get_topology(preset, num_nodes=num_nodes)
        cost = CostModel.default(get_model(model), topology)
        ring = tuple(range(topology.world_size))
        flat = one_document(topology, length, ring, Scheme.RING)
        predicted = scheme_seconds(flat.sequences[0], topology, cost, routing=True)
        assert set(predicted) == {Scheme.RING, Scheme.TWO_D}
        for scheme in Scheme:
            simulated = attention_seconds(one_document(topology, length, ring, scheme), cost)
            assert predicted[scheme] == pytest.approx(simulated, rel=0.01), (scheme, num_nodes)


def test_the_chooser_turns_whole_node_rings_into_valid_two_d_documents() -> None:
    topology = get_topology("zeppelin-B", num_nodes=3)
    cost = CostModel.default(get_model("llama-7b"), topology)
    k = topology.gpus_per_node
    # The planner's inter-node rings: whole nodes, each node's ranks rotated.
    rotated = tuple(topology.rank_of(n, (3 + t) % k) for n in (2, 0) for t in range(k))
    long_doc = one_document(topology, 65536, rotated, Scheme.RING).sequences[0]
    part_nodes = dataclasses.replace(
        long_doc, id=1, ring=rotated[:-1], attention=zigzag_spans(65536, rotated[:-1])
    )
    intra = SequencePlan(2, 9000, Tier.INTRA, (8, 9), zigzag_spans(9000, (8, 9)))
    chosen = choose_schemes([long_doc, part_nodes, intra], topology, cost, routing=True)
    assert faster_scheme(long_doc, topology, cost, routing=True) == Scheme.TWO_D
    two_d, kept, same = chosen
    assert two_d.is_two_d and two_d.attention == long_doc.attention  # no token moves
    assert two_d.ring == long_doc.ring  # only the scheme changes
    assert kept == part_nodes and same == intra  # not whole nodes; not across nodes
    linear = [[] for _ in range(topology.world_size)]
    for seq in (two_d, intra):
        for s in seq.attention:
            linear[s.rank].append(TokenRange(seq.id, s.start, s.end))
    plan = Plan(topology, (two_d, intra), tuple(map(tuple, linear)))  # validates the grid
    assert build_routes(plan.sequences, topology) == ()  # rails: nothing to route


def test_heads_that_do_not_split_keep_the_flat_ring() -> None:
    topology = get_topology("zeppelin-B", num_nodes=2)
    odd = ModelSpec("odd", 8, 3072, 12, 4, 8192)  # 12 heads do not split over 8 GPUs
    cost = CostModel.default(odd, topology)
    seq = one_document(topology, 65536, tuple(range(16)), Scheme.RING).sequences[0]
    assert set(scheme_seconds(seq, topology, cost, routing=True)) == {Scheme.RING}
    assert choose_schemes([seq], topology, cost, routing=True) == (seq,)
    replicated = CostModel.default(get_model("llama3-8b"), topology)  # 8 K/V heads, 8 GPUs
    mqa = dataclasses.replace(
        replicated, model=dataclasses.replace(replicated.model, num_kv_heads=1)
    )
    assert Scheme.TWO_D in scheme_seconds(seq, topology, mqa, routing=True)


def test_planner_uses_the_scheme_where_it_is_faster_and_can_be_told_not_to() -> None:
    # A ~100K-token document over three nodes of H800s: the flat ring's steps cannot hide their
    # transfers (the batch the efficiency table calls out).
    topology = get_topology("zeppelin-B", num_nodes=4)
    cost = CostModel.default(get_model("llama-7b"), topology)
    lengths = sample_lengths(
        "magi_realworld", num_tokens=int(0.7 * 32 * 16384), seed=0, max_length=131072
    )
    plans = {
        two_d: plan_batch(
            lengths,
            topology=topology,
            cost_model=cost,
            capacity=16384,
            options=PlannerOptions(two_d=two_d),
        )
        for two_d in (True, False)
    }
    assert plans[True].has_two_d and not plans[False].has_two_d
    assert plans[True].meta["two_d_documents"] == sum(s.is_two_d for s in plans[True].sequences)
    for seq in plans[True].sequences:
        if seq.is_two_d:  # no route serves a 2-D document's ring
            edges = {(r.src, r.dst) for r in plans[True].routes}
            assert not edges & {(a, b) for a, b in zip(seq.ring, seq.ring[1:])}
    assert Plan.from_json(plans[True].to_json()) == plans[True]
    steps = {two_d: simulate(plan, cost).step_time_s for two_d, plan in plans.items()}
    assert steps[True] < steps[False]
    # Each kind of split document alone: the kinds' bytes add up to the plan's ring bytes, and
    # the 2-D document waits less on its transfers than the same document as a flat ring (the
    # two plans may give it rings of different sizes: seconds, not shares of its transfers).
    kinds = {two_d: tier_figures(plan, cost, routing=True) for two_d, plan in plans.items()}
    for two_d, plan in plans.items():
        ring = simulate(plan, cost).ring_bytes
        for link in ("nvlink", "nic"):
            assert sum(f[f"{link}_bytes"] for f in kinds[two_d].values()) == ring[link]
    assert set(kinds[True]) == {"intra", "2d"} and set(kinds[False]) == {"intra", "inter"}
    assert kinds[True]["2d"]["exposed_s"] < kinds[False]["inter"]["exposed_s"]
