"""Tier: pure. The array timeline's shortcuts give what the long way gives: the column rings of
2-D documents read as arrays (``heads.column_layout``) against the head-layout plan
(``heads.head_plan``) they stand for, and the table index of calls and ports
(``phases.unique_inverse``) against ``np.unique``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatron_zeppelin.planner.plan.heads import column_layout, head_plan
from megatron_zeppelin.planner.plan.linear_layout import attention_layout
from megatron_zeppelin.planner.plan.phases import (
    attention_blocks,
    split_by_layout,
    unique_inverse,
    zigzag_blocks,
)
from megatron_zeppelin.planner.plan.plan import (
    Plan,
    Scheme,
    SequencePlan,
    Tier,
    zigzag_spans,
)
from megatron_zeppelin.planner.simulate.transfers import ring_messages, ring_messages_of
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
