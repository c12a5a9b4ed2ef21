"""Tier: pure. The 2-D scheme in the plan file and its geometry (head groups, token layout, head
plan, the head all-to-all's messages and bytes)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.planner.plan.heads import AttentionShape, head_groups, head_plan
from megatron_zeppelin.planner.plan.plan import (
    PLAN_FORMAT,
    Plan,
    Scheme,
    SequencePlan,
    Span,
    Tier,
    TokenRange,
    node_chunks,
    zigzag_spans,
)
from megatron_zeppelin.planner.plan.schedule import (
    engine_link_bytes,
    exchange_messages,
    ring_schedule,
    training_link_bytes,
    two_d_link_bytes,
)
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

TOPO = Topology(num_nodes=3, gpus_per_node=4, nics_per_node=4)


def plan_of(seqs: list[SequencePlan], topology: Topology = TOPO) -> Plan:
    linear: list[list[TokenRange]] = [[] for _ in range(topology.world_size)]
    for seq in seqs:
        for s in seq.attention:
            linear[s.rank].append(TokenRange(seq.id, s.start, s.end))
    return Plan(topology=topology, sequences=tuple(seqs), linear=tuple(map(tuple, linear)))


def node_pieces(length: int, ring: tuple[int, ...], gpus_per_node: int) -> tuple[Span, ...]:
    """A 2-D token layout other than zigzag: each node's tokens, in position order, cut into
    ``G`` near-equal consecutive pieces, piece ``j`` to the node's rank ``j``."""
    rows = [ring[i : i + gpus_per_node] for i in range(0, len(ring), gpus_per_node)]
    spans = []
    for i, row in enumerate(rows):
        chunks = node_chunks(length, len(rows), i)
        total = sum(end - start for start, end in chunks)
        cuts = [round(j * total / len(row)) for j in range(len(row) + 1)]
        for rank, lo, hi in zip(row, cuts, cuts[1:]):
            offset = 0  # position in the node's tokens of the chunk being walked
            for start, end in chunks:
                a, b = max(lo, offset), min(hi, offset + end - start)
                if b > a:
                    spans.append(Span(rank, start + a - offset, start + b - offset))
                offset += end - start
    return tuple(spans)


def two_d(seq_id: int, length: int, nodes: list[int], topology: Topology = TOPO) -> SequencePlan:
    ring = tuple(r for n in nodes for r in topology.ranks_of_node(n))
    spans = node_pieces(length, ring, topology.gpus_per_node)
    return SequencePlan(seq_id, length, Tier.INTER, ring, spans, Scheme.TWO_D)


def test_plan_file_round_trip_writes_format_2_and_reads_format_1() -> None:
    flat = SequencePlan(1, 40, Tier.INTRA, (4, 5), zigzag_spans(40, (4, 5)))
    plan = plan_of([two_d(0, 1001, [2, 0]), flat])
    data = plan.to_dict()
    assert data["format"] == PLAN_FORMAT == "zeppelin-plan/2"
    assert data["sequences"][0]["scheme"] == "2d" and "scheme" not in data["sequences"][1]
    restored = Plan.from_json(plan.to_json())
    assert restored == plan and restored.sequences[0].is_two_d and restored.has_two_d
    old = json.loads(plan_of([flat]).to_json())
    old["format"] = "zeppelin-plan/1"
    assert not Plan.from_dict(old).has_two_d
    with pytest.raises(ValueError, match="zeppelin-plan/1"):
        Plan.from_dict({**old, "format": "zeppelin-plan/0"})
    bad = json.loads(plan.to_json())
    bad["sequences"][0]["scheme"] = "ulysses"
    with pytest.raises(ValueError, match="unknown scheme 'ulysses'"):
        Plan.from_dict(bad)


def test_malformed_two_d_documents_are_refused() -> None:
    good = two_d(0, 500, [0, 1])
    plan_of([good])
    part_node = SequencePlan(
        0, 500, Tier.INTER, (0, 1, 4, 5), zigzag_spans(500, (0, 1, 4, 5)), Scheme.TWO_D
    )
    with pytest.raises(ValueError, match="whole nodes"):
        plan_of([part_node])
    # A node's ranks in any order (a rank's head group is its local index), but together.
    assert plan_of([dataclasses.replace(good, ring=(1, 0, 3, 2, 7, 4, 5, 6))])
    interleaved = dataclasses.replace(good, ring=(0, 4, 1, 5, 2, 6, 3, 7))
    with pytest.raises(ValueError, match="whole nodes"):
        plan_of([interleaved])
    # A flat zigzag ring's spans lie inside the node chunks of the same node order (a flat
    # inter-node document becomes 2-D without moving a token), not inside another order's.
    assert plan_of(
        [SequencePlan(0, 500, Tier.INTER, good.ring, zigzag_spans(500, good.ring), Scheme.TWO_D)]
    )
    swapped = zigzag_spans(500, good.ring[4:] + good.ring[:4])
    with pytest.raises(ValueError, match="outside its node's chunks"):
        plan_of([SequencePlan(0, 500, Tier.INTER, good.ring, swapped, Scheme.TWO_D)])
    with pytest.raises(ValueError, match="at least 2 ranks"):
        plan_of([SequencePlan(0, 5, Tier.LOCAL, (3,), (Span(3, 0, 5),), Scheme.TWO_D)])


@settings(max_examples=examples(60), deadline=None)
@given(
    length=st.integers(1, 400),
    nodes=st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True),
    rotate=st.integers(0, 3),
)
def test_a_flat_whole_node_ring_is_a_two_d_token_layout(length, nodes, rotate) -> None:  # noqa: ANN001
    # The planner's inter-node rings: whole nodes, each node's ranks in a rotated order.
    flat = tuple(r for n in nodes for r in (TOPO.rank_of(n, (rotate + t) % 4) for t in range(4)))
    ring = tuple(r for n in nodes for r in TOPO.ranks_of_node(n))
    tier = Tier.INTER if len(nodes) > 1 else Tier.INTRA
    for spans in (zigzag_spans(length, flat), node_pieces(length, ring, 4)):
        plan = plan_of([SequencePlan(0, length, tier, ring, spans, Scheme.TWO_D)])  # validates
        for i, node in enumerate(nodes):
            held = sum(e - s for s, e in node_chunks(length, len(nodes), i))
            counts = [plan.num_attention_tokens(r) for r in TOPO.ranks_of_node(node)]
            assert sum(counts) == held and max(counts) - min(counts) <= 2


def test_head_groups_split_or_replicate_kv_heads() -> None:
    split = head_groups(8, 4, 4)
    assert split.q == ((0, 2), (2, 4), (4, 6), (6, 8)) and split.kv == (
        (0, 1),
        (1, 2),
        (2, 3),
        (3, 4),
    )
    assert not split.replicated
    shared = head_groups(8, 2, 4)  # query heads 0-3 use K/V head 0, 4-7 K/V head 1
    assert shared.kv == ((0, 1), (0, 1), (1, 2), (1, 2)) and shared.replicated
    for q_heads, kv_heads, groups in ((8, 4, 4), (8, 2, 4), (32, 8, 8), (4, 1, 4), (16, 16, 8)):
        g = head_groups(q_heads, kv_heads, groups)
        per_kv = q_heads // kv_heads
        for (qa, qb), (ka, kb) in zip(g.q, g.kv):
            # Every query head of a group uses a K/V head of the group, in GQA's order.
            assert {h // per_kv for h in range(qa, qb)} == set(range(ka, kb))
    for q_heads, kv_heads, groups in ((6, 2, 4), (12, 3, 4), (8, 8, 3)):
        with pytest.raises(ValueError, match="flat ring"):
            head_groups(q_heads, kv_heads, groups)


def test_head_plan_rings_are_rails_with_zigzag_node_chunks() -> None:
    plan = plan_of([two_d(0, 999, [2, 0]), two_d(1, 77, [1, 2])])
    heads = head_plan(plan)
    assert heads.document == (0, 0, 0, 0, 1, 1, 1, 1)
    for seq, doc in zip(heads.plan.sequences, heads.document):
        assert {TOPO.local_of(r) for r in seq.ring} == {TOPO.local_of(seq.ring[0])}  # one rail
        nodes = [TOPO.node_of(r) for r in seq.ring]
        assert nodes == ([2, 0] if doc == 0 else [1, 2])
        for i, rank in enumerate(seq.ring):
            spans = [(s.start, s.end) for s in seq.spans_of(rank)]
            assert spans == node_chunks(seq.length, len(nodes), i)
    # The flat schedule leaves 2-D documents out; the head plan's has one step per node pair.
    assert ring_schedule(plan) == [] and len(ring_schedule(heads.plan)) == 1


def test_head_all_to_all_messages_stay_inside_nodes_and_mirror_each_other() -> None:
    plan = plan_of([two_d(0, 999, [2, 0]), two_d(1, 77, [1, 2])])
    inbound, outbound = (exchange_messages(plan, to_heads=t) for t in (True, False))
    assert inbound and all(TOPO.same_node(m.src, m.dst) for m in inbound)
    back = {(m.dst, m.src): m.num_tokens for m in outbound}
    assert {(m.src, m.dst): m.num_tokens for m in inbound} == back
    for m in inbound:  # a rank sends all its own tokens to every other rank of the node
        for g in m.segments:
            spans = plan.sequence(g.seq).spans_of(m.src)
            assert g.origin == m.src and g.num_tokens == sum(s.num_tokens for s in spans)
    # Node 2 holds both documents: its messages carry a segment of each.
    assert len(inbound) == 3 * 4 * 3
    assert [len(m.segments) for m in inbound] == [1] * 24 + [2] * 12


def test_two_d_bytes_add_up_from_the_scheme() -> None:
    length = 1000
    plan = plan_of([two_d(0, length, [0, 1, 2])])
    shape = AttentionShape(
        num_heads=8, num_kv_heads=4, head_dim=16, value_bytes=2, grad_value_bytes=4
    )
    got = two_d_link_bytes(plan, shape, routing=False)
    assert training_link_bytes(
        plan, kv_bytes_per_token=128, grad_bytes_per_token=256, routing=False
    ) == {"nvlink": 0, "nic": 0}
    assert engine_link_bytes(plan, shape, routing=False) == got
    # Rings: each of 4 rails carries the document's K/V blocks of one K/V head: every node's
    # block travels n - 1 = 2 hops, forward twice (forward and backward) and dK/dV once.
    kv_values = 2 * 1 * 16
    assert got["nic"] == 4 * 2 * length * kv_values * (2 * 2 + 4)
    # All-to-alls: a rank sends its tokens to each of the 3 others with their group's heads
    # (and keeps its own group's), both ways: Q, K, V and dO in; O and dQ, dK, dV out.
    per_token = (2 + 2 * 1) * 16 * (2 + 4) + 2 * 16 * (2 + 2)
    assert got["nvlink"] == 3 * length * per_token
