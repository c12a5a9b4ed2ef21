"""Tier: threads. The 2-D scheme (heads split inside each node, rings across nodes) on thread-ranks.

Plans built by hand mix 2-D documents (over 2 and 3 whole nodes, lengths not divisible by the
node count, one shorter than the ranks it spans, a token layout that is not the planner's) with
flat inter-node, intra-node and local ones. Output and dQ/dK/dV must match the dense float64
reference to 1e-10 in float64 and 1e-5 in float32, for MHA, GQA that splits K/V heads and GQA
that replicates them; the bytes counted per link class must equal
``schedule.engine_link_bytes``, routing on and off.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from test_ring_threads import run_engine
from test_two_d_plan import node_pieces

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.comm.counters import LinkCounters, comparable
from megatron_zeppelin.comm.threads import ThreadExchanger, ThreadHub
from megatron_zeppelin.planner.plan.heads import AttentionShape, head_plan
from megatron_zeppelin.planner.plan.plan import (
    Plan,
    Route,
    RoutePart,
    Scheme,
    SequencePlan,
    Span,
    Tier,
    TokenRange,
    zigzag_spans,
)
from megatron_zeppelin.planner.plan.schedule import engine_link_bytes, ring_schedule
from megatron_zeppelin.testing.reference import random_qkv
from megatron_zeppelin.testing.tolerances import assert_close
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.threads

TOPO_2X2 = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2)
TOPO_3X2 = Topology(num_nodes=3, gpus_per_node=2, nics_per_node=1)
TOPO_2X3 = Topology(num_nodes=2, gpus_per_node=3, nics_per_node=3)
TOPO_2X4 = Topology(num_nodes=2, gpus_per_node=4, nics_per_node=4)


def mixed_plan(topology: Topology, docs, *, spans=None, routed: bool = False) -> Plan:  # noqa: ANN001
    """``(length, ring, two_d)`` documents: zigzag rings, or the 2-D scheme on whole nodes;
    ``two_d`` is ``"zigzag"`` (the planner's token layout) or ``"pieces"`` (one run of each
    node's tokens per rank); ``spans`` overrides one document's spans."""
    seqs, linear = [], defaultdict(list)
    for i, (length, ring, two_d) in enumerate(docs):
        nodes = {topology.node_of(r) for r in ring}
        tier = Tier.LOCAL if len(ring) == 1 else Tier.INTRA if len(nodes) == 1 else Tier.INTER
        if two_d == "pieces":
            attention = node_pieces(length, ring, topology.gpus_per_node)
        else:
            attention = zigzag_spans(length, ring)
        attention = (spans or {}).get(i) or attention
        scheme = Scheme.TWO_D if two_d else Scheme.RING
        seqs.append(SequencePlan(i, length, tier, ring, tuple(attention), scheme))
        for s in attention:
            linear[s.rank].append(TokenRange(i, s.start, s.end))
    lin = tuple(tuple(linear[r]) for r in range(topology.world_size))
    routes = ()
    if routed:  # every cross-node edge of the flat rings over every NIC, unequal shares
        k = topology.gpus_per_node
        plan = Plan(topology=topology, sequences=tuple(seqs), linear=lin)
        edges = {(m.src, m.dst) for step in ring_schedule(plan) for m in step}
        routes = tuple(
            Route(
                src,
                dst,
                tuple(
                    RoutePart(topology.node_of(src) * k + j, topology.node_of(dst) * k + j, j + 1)
                    for j in range(k)
                ),
            )
            for src, dst in sorted(e for e in edges if not topology.same_node(*e))
        )
    return Plan(topology=topology, sequences=tuple(seqs), linear=lin, routes=routes)


PLANS = {
    # 2-D documents over both nodes (one in each token layout) beside flat inter-node,
    # intra-node and local ones.
    "2x2": lambda: mixed_plan(
        TOPO_2X2,
        [
            (37, (0, 1, 2, 3), "zigzag"),
            (5, (1,), False),
            (23, (2, 3), False),
            (29, (2, 3, 0, 1), "pieces"),
            (41, (3, 0, 1), False),
            (1, (0,), False),
        ],
    ),
    # Three nodes: a 2-D document on two of them in the planner's rotated in-node order, two on
    # all three (one of 3 tokens on 6 ranks).
    "3x2": lambda: mixed_plan(
        TOPO_3X2,
        [
            (50, (0, 1, 2, 3, 4, 5), "pieces"),
            (31, (5, 4, 1, 0), "zigzag"),
            (3, (2, 3, 4, 5, 0, 1), "zigzag"),
            (19, (2, 3), False),
            (7, (5,), False),
        ],
    ),
    # Four GPUs per node: every rank sends the same rows to three others, each with its own heads
    # (the all-to-all's one-gather path), K/V heads replicated over pairs of GPUs.
    "2x4": lambda: mixed_plan(
        TOPO_2X4,
        [(61, (0, 1, 2, 3, 4, 5, 6, 7), "zigzag"), (17, (4, 5, 6), False), (9, (2,), False)],
    ),
    # Three GPUs per node; a token layout of the document's own (ranks hold single chunks).
    "2x3-own-layout": lambda: mixed_plan(
        TOPO_2X3,
        [(44, (0, 1, 2, 3, 4, 5), "zigzag"), (13, (3, 4, 5), False), (9, (1,), False)],
        spans={
            0: [
                Span(0, 0, 3),
                Span(2, 3, 11),
                Span(3, 11, 22),
                Span(4, 22, 30),
                Span(5, 30, 33),
                Span(1, 33, 44),
            ]
        },
    ),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_two_d_matches_reference(plan_name: str, dtype: torch.dtype) -> None:
    plan = PLANS[plan_name]()
    assert plan.has_two_d and head_plan(plan) is not None
    ref, got = run_engine(plan, dtype, heads=(6, 6) if plan.topology.gpus_per_node == 3 else (4, 2))
    for name in ("out", "dq", "dk", "dv"):
        assert_close(got[name], ref[name], dtype=dtype, name=f"{plan_name} {name}")


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1), (8, 1)])
def test_grouped_query_heads_split_or_replicated(heads) -> None:  # noqa: ANN001
    # Two GPUs per node: 4 and 2 K/V heads split over them, 1 is replicated on both.
    ref, got = run_engine(PLANS["2x2"](), torch.float64, heads=heads, seed=4)
    for name in ("out", "dq", "dk", "dv"):
        assert_close(got[name], ref[name], dtype=torch.float64, name=f"{heads} {name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("routing", [True, False])
def test_bytes_per_link_class_equal_the_prediction(dtype, routing) -> None:  # noqa: ANN001
    for name, heads in (("3x2", (4, 1)), ("2x3-own-layout", (6, 3))):
        plan = PLANS[name]()
        plan = Plan(
            topology=plan.topology,
            sequences=plan.sequences,
            linear=plan.linear,
            routes=_all_routes(plan),
        )
        counters = [LinkCounters(plan.topology) for _ in range(plan.world_size)]
        run_engine(plan, dtype, heads=heads, routing=routing, counters=counters)
        measured = LinkCounters.merged(plan.topology, [c.to_dict() for c in counters]).to_dict()
        nq, nkv = heads
        shape = AttentionShape(nq, nkv, 8, dtype.itemsize, dtype.itemsize)
        assert measured == comparable(engine_link_bytes(plan, shape, routing=routing)), name
        assert measured["nic"] > 0 and measured["nvlink"] > 0


def _all_routes(plan: Plan) -> tuple[Route, ...]:
    """Routes for the flat rings' cross-node edges and for the rails the column rings use, so
    that a 2-D message on a routed edge is routed (and predicted so)."""
    topo, k = plan.topology, plan.topology.gpus_per_node
    heads = head_plan(plan)
    edges = {(m.src, m.dst) for step in ring_schedule(plan) for m in step}
    edges |= {(m.src, m.dst) for step in ring_schedule(heads.plan) for m in step}
    return tuple(
        Route(
            src,
            dst,
            tuple(
                RoutePart(topo.node_of(src) * k + j, topo.node_of(dst) * k + j, 1) for j in range(k)
            ),
        )
        for src, dst in sorted(e for e in edges if not topo.same_node(*e))
    )


def test_head_counts_that_do_not_split_are_refused() -> None:
    plan = PLANS["2x3-own-layout"]()
    hub = ThreadHub(plan.world_size)
    engine = ZeppelinAttention(plan, 0, ThreadExchanger(hub, 0), kernel="torch")
    assert engine.heads is not None and engine.num_steps >= 1
    q, k, v = random_qkv(engine.num_tokens, num_heads=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="3 GPUs of each node.*--no-2d"):
        engine(q, k, v)


def test_planner_plans_with_two_d_documents_match_reference() -> None:
    from megatron_zeppelin.planner.baselines.distributions import sample_lengths
    from megatron_zeppelin.planner.cost.costmodel import CostModel
    from megatron_zeppelin.planner.cost.models import get_model
    from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch

    cost = CostModel.default(get_model("tiny"), TOPO_2X2)  # 4 heads over 2 K/V heads
    lengths = sample_lengths("prolong", num_tokens=500, seed=1, max_length=400) + [1, 2, 9, 31]
    plan = plan_batch(
        lengths,
        topology=TOPO_2X2,
        cost_model=cost,
        capacity=200,
        options=PlannerOptions(thresholds=(8, 16)),
    )
    assert plan.has_two_d and plan.tier_counts()["intra"] and plan.tier_counts()["local"]
    ref, got = run_engine(plan, torch.float64, heads=(4, 2), seed=2)
    for name in ("out", "dq", "dk", "dv"):
        assert_close(got[name], ref[name], dtype=torch.float64, name=f"planned {name}")


def test_flat_documents_around_two_d_rows_are_taken_as_views() -> None:
    # The 2-D document sits between flat ones in every token buffer: the flat documents' own
    # calls must not gather around its rows.
    plan = mixed_plan(
        TOPO_2X2,
        [
            (40, (0, 1), False),
            (9, (0,), False),
            (37, (0, 1, 2, 3), "zigzag"),
            (7, (1,), False),
            (30, (2, 3), False),
            (5, (0,), False),
        ],
    )
    hub = ThreadHub(plan.world_size)
    for rank in range(plan.world_size):
        engine = ZeppelinAttention(plan, rank, ThreadExchanger(hub, rank), kernel="torch")
        calls = engine.layout.own_calls
        assert calls and all(isinstance(c.q_index, slice) for c in calls), rank
        assert all(isinstance(c.k_index, slice) for c in calls), rank
