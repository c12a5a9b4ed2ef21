"""Tier: pure. The array timeline's shortcuts give what the long way gives: the column rings of
2-D documents read as arrays (``heads.column_layout``) against the head-layout plan
(``heads.head_plan``) they stand for, the table index of calls and ports
(``phases.unique_inverse``) against ``np.unique``, and the routes' hops as arrays
(``transfers._RouteTable``) against ``stepwise.route_hops``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.heads import column_layout, head_plan
from megatron_zeppelin.planner.plan.linear_layout import attention_layout
from megatron_zeppelin.planner.plan.phases import (
    attention_blocks,
    is_zigzag,
    split_by_layout,
    unique_inverse,
    zigzag_blocks,
)
from megatron_zeppelin.planner.plan.plan import (
    Plan,
    Route,
    RoutePart,
    Scheme,
    SequencePlan,
    Tier,
    zigzag_spans,
)
from megatron_zeppelin.planner.simulate.stepwise import route_hops
from megatron_zeppelin.planner.simulate.transfers import (
    _RouteTable,
    ring_messages,
    ring_messages_of,
)
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

TOPO = Topology(num_nodes=4, gpus_per_node=2, nics_per_node=2)


def _plan(seqs: list[SequencePlan]) -> Plan:
    """``seqs`` with the linear modules on the attention layout."""
    linear = attention_layout(seqs, TOPO.world_size)
    return Plan(topology=TOPO, sequences=tuple(seqs), linear=linear)


def _two_d(seq_id: int, length: int, nodes: list[int]) -> SequencePlan:
    """A document over whole ``nodes`` with the flat ring's zigzag spans, run 2-D."""
    ring = tuple(r for n in nodes for r in TOPO.ranks_of_node(n))
    tier = Tier.of_ring(ring, TOPO.gpus_per_node)
    return SequencePlan(seq_id, length, tier, ring, zigzag_spans(length, ring), Scheme.TWO_D)


@settings(max_examples=40, deadline=None)
@given(
    docs=st.lists(
        st.tuples(
            st.integers(1, 400),  # short ones leave chunks empty: the other layouts' path
            st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
        ),
        min_size=1,
        max_size=4,
    )
)
@example(docs=[(3, [1, 0]), (5, [2]), (400, [3, 1, 2])])  # empty chunks; one node; whole
def test_column_layout_is_the_head_plans_layout(docs) -> None:  # noqa: ANN001
    """Blocks and ring messages of the column rings, from arrays, equal those of the head-layout
    plan's sequences: rows in the same order (so sums come out alike), one node or several,
    with or without empty chunks."""
    plan = _plan([_two_d(i, length, nodes) for i, (length, nodes) in enumerate(docs)])
    heads = head_plan(plan)
    assert heads is not None
    local, zigzag, other = column_layout(plan)
    expected = split_by_layout(heads.plan.sequences)
    for got, want in zip(local, expected[0]):
        np.testing.assert_array_equal(got, want)
    assert [seq for _, seq in other] == [
        dataclasses.replace(seq, id=0) for _, seq in expected[2]
    ]  # only the id differs: the timeline never reads it
    num_phases = max(len(s.ring) for s in heads.plan.sequences)
    got = zigzag_blocks(zigzag, num_phases, local=local, other=other)
    want = attention_blocks(heads.plan.sequences)
    assert got.num_phases == want.num_phases
    for field in ("pass_id", "rank", "phase", "num_q", "pairs"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    got_messages, want_messages = (
        ring_messages_of(zigzag, other),
        ring_messages(heads.plan.sequences),
    )
    assert got_messages.num_steps == want_messages.num_steps
    for field in ("group", "src", "dst", "tokens"):
        np.testing.assert_array_equal(getattr(got_messages, field), getattr(want_messages, field))


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(12, 400),  # every chunk of a ring of 6 holds a token
    ring=st.lists(st.integers(0, 7), min_size=2, max_size=6, unique=True),
    change=st.sampled_from(["none", "swap", "rank", "drop"]),
    where=st.integers(0, 11),
)
def test_zigzag_layout_is_two_spans_per_ring_position_in_ring_order(
    length: int, ring: list[int], change: str, where: int
) -> None:
    """``is_zigzag`` (read at C level) says what its definition says: a document's spans are
    two per ring position, in ring order. Spans as ``zigzag_spans`` lays them are; one moved to
    another rank, or one left out, are not; two swapped are where both are on one rank."""
    spans = list(zigzag_spans(length, tuple(ring)))
    at = where % len(spans)
    if change == "swap":
        spans[at], spans[-1] = spans[-1], spans[at]
    elif change == "rank":
        spans[at] = dataclasses.replace(spans[at], rank=max(ring) + 1)
    elif change == "drop":
        del spans[at]
    seq = SequencePlan(0, length, Tier.INTRA, tuple(ring), tuple(spans))
    by_definition = len(spans) == 2 * len(ring) and all(
        spans[2 * i].rank == r and spans[2 * i + 1].rank == r for i, r in enumerate(ring)
    )
    assert is_zigzag(seq) == by_definition
    if change == "none":
        assert by_definition
    elif change in ("rank", "drop"):
        assert not by_definition


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(st.integers(0, 2**40), max_size=50),
    small=st.booleans(),
)
def test_unique_inverse_is_numpys(keys, small) -> None:  # noqa: ANN001
    """Through the table (keys in a small range) or the sort (sparse keys), the same unique
    keys and inverse as ``np.unique``."""
    array = np.asarray([k % 97 if small else k for k in keys], dtype=np.int64)
    unique, inverse = unique_inverse(array)
    want_unique, want_inverse = np.unique(array, return_inverse=True)
    np.testing.assert_array_equal(unique, want_unique)
    np.testing.assert_array_equal(inverse, want_inverse)
    np.testing.assert_array_equal(unique[inverse], array)


_ROUTED = Topology(num_nodes=3, gpus_per_node=4, nics_per_node=2, nic_of_gpu=(1, 0, 0, 1))


def _port_id(port: tuple, topo: Topology) -> int:
    """``stepwise.hop_ports``' port tuples as the table's ids: GPU out / in, then NIC out / in
    per (node, NIC)."""
    world, m = topo.world_size, topo.nics_per_node
    if port[0] in ("gpu-out", "gpu-in"):
        return port[1] + (world if port[0] == "gpu-in" else 0)
    base = 2 * world + (0 if port[0] == "nic-out" else topo.num_nodes * m)
    return base + port[1] * m + port[2]


@settings(max_examples=60, deadline=None)
@given(
    routes=st.lists(
        st.tuples(
            st.integers(0, 11),
            st.integers(1, 2),  # the destination's node, after the source's
            st.integers(0, 3),
            st.lists(
                st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 5)),
                min_size=1,
                max_size=3,
            ),
        ),
        max_size=6,
    )
)
def test_route_table_is_route_hops(routes) -> None:  # noqa: ANN001
    """Every route's padded weights, parts, and hops in part then path order, with their
    ports and links, are what ``stepwise.route_hops`` gives route by route: proxies equal to
    the sender or the receiver (a hop skipped), or not; parts of no weight too."""
    topo, k = _ROUTED, _ROUTED.gpus_per_node
    made = []
    for src, later, dst_local, parts in routes:
        dst = ((src // k + later) % topo.num_nodes) * k + dst_local
        made.append(
            Route(
                src,
                dst,
                tuple(RoutePart((src // k) * k + a, (dst // k) * k + b, w) for a, b, w in parts),
            )
        )
    cost = CostModel.default(get_model("llama-7b"), topo)
    table = _RouteTable.of(made, topo, cost)
    widest = max((len(r.parts) for r in made), default=1)
    assert table.weights.shape == (len(made), widest)
    hops = []
    for i, route in enumerate(made):
        weights = [p.weight for p in route.parts]
        assert table.weights[i].tolist() == weights + [0] * (widest - len(weights))
        assert table.num_parts[i] == len(route.parts)
        found = [(p, hop) for p, path in enumerate(route_hops(topo, route)) for hop in path]
        assert table.num_hops[i] == len(found)
        assert table.hop_start[i] == len(hops)
        hops += found
    assert table.part.tolist() == [p for p, _ in hops]
    assert table.out_port.tolist() == [_port_id(out, topo) for _, (_, out, _) in hops]
    assert table.in_port.tolist() == [_port_id(into, topo) for _, (_, _, into) in hops]
    links = [cost.link(kind) for _, (kind, _, _) in hops]
    assert table.bandwidth.tolist() == [link.bytes_per_s for link in links]
    assert table.latency.tolist() == [link.latency_s for link in links]
