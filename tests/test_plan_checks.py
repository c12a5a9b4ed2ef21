"""Tier: pure. A plan's linear layout must partition every document: the checks run with arrays
where the values are plain integers and walk the ranges otherwise, and either way refuse a gap,
an overlap, a short or missing document, a range outside its document or an unknown one, naming
the first. The attention layout's linear ranges, built in one pass, are the sorted ones."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.planner.plan.linear_layout import (
    attention_layout,
    attention_ranges_by_rank,
    build_linear_layout,
)
from megatron_zeppelin.planner.plan.plan import (
    Plan,
    SequencePlan,
    Span,
    Tier,
    TokenRange,
    zigzag_spans,
)
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

TOPO = Topology(num_nodes=1, gpus_per_node=2, nics_per_node=1)
SEQUENCES = (
    SequencePlan(0, 10, Tier.LOCAL, (0,), (Span(0, 0, 10),)),
    SequencePlan(1, 6, Tier.INTRA, (0, 1), zigzag_spans(6, (0, 1))),
)


def _plan(rank0: list[tuple], rank1: list[tuple]) -> Plan:
    linear = tuple(tuple(TokenRange(*r) for r in ranges) for ranges in (rank0, rank1))
    return Plan(topology=TOPO, sequences=SEQUENCES, linear=linear, capacity=16)


def test_a_partition_is_accepted_with_its_tokens_per_rank() -> None:
    plan = _plan([(0, 0, 4), (1, 3, 6)], [(0, 4, 10), (1, 0, 3)])
    assert [plan.num_linear_tokens(r) for r in range(2)] == [7, 9]


@pytest.mark.parametrize(
    ("rank0", "rank1", "message"),
    [
        ([(0, 0, 5), (1, 0, 6)], [(0, 6, 10)], r"does not partition sequence 0 \(token 5\)"),
        ([(0, 0, 6), (1, 0, 6)], [(0, 5, 10)], r"does not partition sequence 0 \(token 6\)"),
        ([(0, 0, 8)], [(1, 0, 6)], r"covers \[0, 8\) of sequence 0"),
        ([(0, 0, 10)], [], r"covers \[0, 0\) of sequence 1"),
        ([(0, 0, 10), (1, 0, 6)], [(1, 3, 6)], r"does not partition sequence 1 \(token 6\)"),
        ([(0, 0, 10)], [(1, 0, 7)], r"range \[0, 7\) of sequence 1 is empty or outside"),
        ([(0, 0, 10), (2, 0, 1)], [(1, 0, 6)], "names unknown sequence 2"),
        # Not plain integers: walked, and refused where they leave a gap.
        ([(0, 0, 5.5)], [(0, 5, 10), (1, 0, 6)], r"does not partition sequence 0 \(token 5.5\)"),
    ],
)
def test_a_broken_linear_layout_is_refused_naming_the_first_fault(rank0, rank1, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        _plan(rank0, rank1)


def test_over_capacity_in_the_linear_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 0 holds 16 tokens in the linear layout"):
        Plan(
            topology=TOPO,
            sequences=SEQUENCES,
            linear=((TokenRange(0, 0, 10), TokenRange(1, 0, 6)), ()),
            capacity=15,
        )


@pytest.mark.parametrize(
    "spans",
    [
        (Span(0, 0, 3), Span(1, 3, 6)),  # in order: one pass
        (Span(1, 3, 6), Span(0, 0, 3)),  # listed backwards, on different ranks: still in order
        (Span(0, 3, 6), Span(1, 1, 3), Span(0, 0, 1)),  # a rank's pieces backwards: sorted
        (Span(0, 0, 2), Span(0, 2, 4), Span(1, 4, 6)),  # touching pieces merge
    ],
)
def test_the_attention_layout_in_one_pass_is_the_sorted_one(spans) -> None:  # noqa: ANN001
    """``attention_layout`` equals sorting and merging every rank's attention ranges, whether the
    pieces come in order (one pass) or not (it sorts)."""
    sequences = (SEQUENCES[0], SequencePlan(1, 6, Tier.INTRA, (0, 1), spans))
    by_rank = attention_ranges_by_rank(sequences, TOPO.world_size)
    expected, moves = build_linear_layout(by_rank, TOPO, "attention")
    assert attention_layout(sequences, TOPO.world_size) == expected and not moves


def test_documents_listed_out_of_order_on_a_rank_are_sorted() -> None:
    """A later-listed document with a lower id on the same rank sends the layout to the sort,
    even where its piece starts past the previous one's end."""
    sequences = (
        SequencePlan(1, 4, Tier.LOCAL, (0,), (Span(0, 0, 4),)),
        SequencePlan(0, 10, Tier.INTRA, (1, 0), (Span(1, 0, 6), Span(0, 6, 10))),
    )
    assert attention_layout(sequences, TOPO.world_size) == (
        (TokenRange(0, 6, 10), TokenRange(1, 0, 4)),
        (TokenRange(0, 0, 6),),
    )


@st.composite
def _pieces(draw) -> tuple[SequencePlan, ...]:  # noqa: ANN001
    """Documents cut at random points, each piece on a random rank of three, the documents
    and each one's pieces listed in any order (no validation: ``attention_layout`` sorts what
    is out of order)."""
    num_docs = draw(st.integers(1, 6))
    sequences = []
    for seq_id in draw(st.permutations(range(num_docs))):
        length = draw(st.integers(1, 12))
        cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=3))) if length > 1 else []
        bounds = list(zip([0, *cuts], [*cuts, length]))
        ranks = [draw(st.integers(0, 2)) for _ in bounds]
        spans = [Span(r, a, b) for r, (a, b) in zip(ranks, bounds)]
        spans = draw(st.permutations(spans))
        sequences.append(SequencePlan(seq_id, length, Tier.INTRA, tuple(ranks), tuple(spans)))
    return tuple(sequences)


@settings(max_examples=200, deadline=None)
@given(_pieces())
def test_the_attention_layout_from_columns_is_the_sorted_one(sequences) -> None:  # noqa: ANN001
    by_rank = attention_ranges_by_rank(sequences, 3)
    expected, _ = build_linear_layout(by_rank, Topology(1, 3, 1), "attention")
    assert attention_layout(sequences, 3) == expected
