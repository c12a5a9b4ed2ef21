"""The document stream of a blend: token shares that follow the weights, determinism, exact
resume of every source, a single pass, and a single dataset unchanged by being one source.

Tier: pure (Hypothesis properties over random blends; no files, no processes).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.megatron.documents.sampler import DocumentSampler
from megatron_zeppelin.megatron.documents.stream import DocumentStream

pytestmark = pytest.mark.pure

MAX_LENGTH = 300


@st.composite
def blends(draw):
    """Sources of random documents (each with tokens) and weights, some of them 0."""
    num_sources = draw(st.integers(1, 4), label="sources")
    sizes = [draw(st.integers(1, 25)) for _ in range(num_sources)]
    lengths = [draw(st.integers(0, 2 * MAX_LENGTH)) for _ in range(sum(sizes))]
    offsets = np.cumsum([0, *sizes])
    for k in range(num_sources):  # every source has a document with tokens in it
        lengths[offsets[k]] = max(lengths[offsets[k]], 1)
    weights = draw(
        st.one_of(
            st.none(),
            st.lists(st.integers(0, 9), min_size=num_sources, max_size=num_sources).filter(any),
        )
    )
    return lengths, sizes, weights


def _stream(lengths, sizes, weights, seed=5, **kwargs) -> DocumentStream:
    return DocumentStream(
        lengths, seed=seed, max_length=MAX_LENGTH, source_sizes=sizes, weights=weights, **kwargs
    )


@settings(max_examples=examples(60), deadline=None)
@given(blend=blends(), seed=st.integers(0, 2**31))
def test_every_source_keeps_its_share_of_the_tokens_within_whole_documents(blend, seed):
    lengths, sizes, weights = blend
    stream = _stream(lengths, sizes, weights, seed=seed)
    tokens = np.zeros(len(sizes))
    offsets = np.cumsum([0, *sizes])
    for _ in range(400):
        unit = stream.take()
        source = int(np.searchsorted(offsets, unit.doc, side="right")) - 1
        tokens[source] += unit.num_tokens
        share = np.asarray(stream.weights) * tokens.sum()
        # Greedy by deficit: a source runs ahead by at most the unit it just took, so none
        # falls behind by more than the others' lead.
        assert (tokens - share <= MAX_LENGTH + 1e-6).all()
        assert (share - tokens <= (len(sizes) - 1) * MAX_LENGTH + 1e-6).all()
    assert all(tokens[k] == 0 for k, w in enumerate(stream.weights) if w == 0)


def test_weights_default_to_the_sources_own_tokens_as_megatron_blends_prefixes():
    stream = _stream([100, 100, 10, 10, 10, 10], [2, 4], None)
    assert stream.weights == pytest.approx((200 / 240, 40 / 240))
    weighted = _stream([100, 100, 10, 10, 10, 10], [2, 4], [1, 1])
    assert weighted.weights == (0.5, 0.5)


@settings(max_examples=examples(40), deadline=None)
@given(blend=blends(), stop=st.integers(0, 15))
def test_a_blended_sampler_resumes_from_its_state_as_the_uninterrupted_run(blend, stop):
    lengths, sizes, weights = blend
    make = lambda: DocumentSampler(  # noqa: E731
        lengths,
        tokens_per_step=4 * MAX_LENGTH,
        num_micro_batches=2,
        micro_batch_capacity=2 * MAX_LENGTH,
        max_length=MAX_LENGTH,
        seed=11,
        source_sizes=sizes,
        weights=weights,
    )
    uninterrupted = make()
    expected = [uninterrupted.next_step() for _ in range(stop + 5)]
    first = make()
    for _ in range(stop):
        first.next_step()
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [resumed.next_step() for _ in range(5)] == expected[stop:]
    # The same draws on every rank: a second sampler of the same settings agrees.
    assert [make().next_step() for _ in range(1)] == expected[:1]


def test_a_state_of_another_blend_is_refused():
    lengths = [50, 60, 70, 80]
    a = DocumentSampler(lengths, tokens_per_step=200, source_sizes=[2, 2], weights=[1, 3])
    b = DocumentSampler(lengths, tokens_per_step=200, source_sizes=[2, 2], weights=[3, 1])
    with pytest.raises(ValueError, match=r"weights: saved \[0.25, 0.75\], now \[0.75, 0.25\]"):
        b.load_state_dict(a.state_dict())
    c = DocumentSampler(lengths, tokens_per_step=200, source_sizes=[1, 3], weights=[1, 3])
    with pytest.raises(ValueError, match=r"source_documents: saved \[2, 2\], now \[1, 3\]"):
        c.load_state_dict(a.state_dict())


def test_one_dataset_draws_the_same_documents_alone_or_as_the_first_source():
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 400, 80)
    alone = DocumentSampler(lengths, tokens_per_step=2000, num_micro_batches=2, seed=9)
    weighted = DocumentSampler(
        lengths, tokens_per_step=2000, num_micro_batches=2, seed=9, source_sizes=[80], weights=[7]
    )
    assert [alone.next_step() for _ in range(8)] == [weighted.next_step() for _ in range(8)]


@settings(max_examples=examples(40), deadline=None)
@given(blend=blends())
def test_one_pass_hands_out_every_document_once_then_only_empty_steps(blend):
    lengths, sizes, _ = blend
    sampler = DocumentSampler(
        lengths,
        tokens_per_step=3 * MAX_LENGTH,
        num_micro_batches=3,
        micro_batch_capacity=MAX_LENGTH,
        max_length=MAX_LENGTH,
        source_sizes=sizes,
        num_epochs=1,
    )
    pieces = []
    while not sampler.exhausted:
        step = sampler.next_step()
        pieces += [(u.doc, u.start, u.end) for mb in step.micro_batches for u in mb]
    expected = [(u.doc, u.start, u.end) for d in range(len(lengths)) for u in sampler.pieces(d)]
    assert sorted(pieces) == sorted(expected)
    assert all(not mb for mb in sampler.next_step().micro_batches)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(source_sizes=[1, 1]), "add up to the 3 documents"),
        (dict(source_sizes=[2, 1], weights=[1]), "1 weights given for 2 sources"),
        (dict(source_sizes=[2, 1], weights=[1, -1]), "must be finite, non-negative"),
        (dict(source_sizes=[2, 1], weights=[0, 0]), "not all zero"),
        (dict(source_sizes=[2, 1], weights=[1, 1]), "source 1 has weight 0.5 but no document"),
        (dict(num_epochs=0), "num_epochs must be positive"),
    ],
)
def test_bad_blends_raise_actionable_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DocumentStream([5, 6, 0], seed=0, max_length=10, **kwargs)
