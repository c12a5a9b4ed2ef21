"""A rank's linear-layout batch: labels inside documents, positions, and only its own reads.

Tier: pure (hand-built plans over an in-memory reader, and one small ``.bin/.idx`` in a tmp dir).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.megatron.documents.batch import (
    build_linear_batch,
    build_reference_batch,
    pad_linear_batch,
)
from megatron_zeppelin.megatron.documents.sampler import DocumentSlice
from megatron_zeppelin.planner.plan.plan import Plan, SequencePlan, Span, Tier, TokenRange
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

TOPOLOGY = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=1)
VOCAB_PER_DOC = 1000  # document d uses token ids [d * 1000, d * 1000 + 1000): leaks are visible


class RecordingReader:
    """In-memory documents; records every read so tests can see what a rank touched."""

    def __init__(self, docs: list[np.ndarray]) -> None:
        self.docs = docs
        self.reads: list[tuple[int, int, int]] = []

    def read(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray:
        end = len(self.docs[doc]) if end is None else end
        assert 0 <= start <= end <= len(self.docs[doc])
        self.reads.append((doc, start, end))
        return self.docs[doc][start:end]


def _docs(lengths: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [d * VOCAB_PER_DOC + rng.integers(0, VOCAB_PER_DOC, n) for d, n in enumerate(lengths)]


@st.composite
def micro_batches(draw):
    """Documents (some as pieces of longer ones), and a plan with a random linear layout."""
    doc_lengths = draw(st.lists(st.integers(1, 60), min_size=1, max_size=6))
    slices = []
    for doc, n in enumerate(doc_lengths):
        start = draw(st.integers(0, n - 1))
        end = draw(st.integers(start + 1, n))
        slices.append(DocumentSlice(doc, start, end))
    world = TOPOLOGY.world_size
    sequences, linear = [], [[] for _ in range(world)]
    for i, piece in enumerate(slices):
        length = piece.num_tokens
        owner = draw(st.integers(0, world - 1))
        sequences.append(SequencePlan(i, length, Tier.LOCAL, (owner,), (Span(owner, 0, length),)))
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, length - 1)), max_size=3))))
        bounds = [0] + [c for c in cuts if c < length] + [length]
        for a, b in zip(bounds, bounds[1:]):
            linear[draw(st.integers(0, world - 1))].append(TokenRange(i, a, b))
    for ranges in linear:  # the linear buffer order is the plan's, not sorted
        draw(st.randoms()).shuffle(ranges)
    plan = Plan(topology=TOPOLOGY, sequences=tuple(sequences), linear=linear)
    return doc_lengths, slices, plan


@settings(max_examples=examples(80), deadline=None)
@given(case=micro_batches(), seed=st.integers(0, 100))
def test_labels_stay_inside_documents_and_positions_are_per_document(case, seed):
    doc_lengths, slices, plan = case
    docs = _docs(doc_lengths, seed)
    for rank in range(plan.world_size):
        batch = build_linear_batch(plan, rank, slices, RecordingReader(docs))
        assert batch.num_tokens == plan.num_linear_tokens(rank)
        offset = 0
        for r in plan.linear_ranges(rank):
            piece = slices[r.seq]
            doc = docs[piece.doc]
            sl = slice(offset, offset + r.num_tokens)
            offset += r.num_tokens
            pos = np.arange(r.start, r.end)
            assert batch.position_ids_t[sl].tolist() == pos.tolist()
            assert batch.tokens_t[sl].tolist() == doc[piece.start + pos].tolist()
            labels, mask = batch.labels_t[sl].numpy(), batch.loss_mask_t[sl].numpy()
            # Every label is a token of the same document (the vocabularies do not overlap).
            assert (labels // VOCAB_PER_DOC == piece.doc).all()
            is_last = pos == piece.num_tokens - 1
            assert (mask == np.where(is_last, 0.0, 1.0)).all()
            inside = ~is_last
            assert (labels[inside] == doc[piece.start + pos[inside] + 1]).all()
            # The last token's label is its own token, never the next document's first.
            assert (labels[is_last] == doc[piece.start + pos[is_last]]).all()


@settings(max_examples=examples(60), deadline=None)
@given(case=micro_batches(), seed=st.integers(0, 100))
def test_ranks_together_rebuild_the_single_device_batch(case, seed):
    doc_lengths, slices, plan = case
    reader = RecordingReader(_docs(doc_lengths, seed))
    reference = build_reference_batch(slices, reader)
    starts = np.cumsum([0] + [s.num_tokens for s in slices])
    gathered = {}
    for rank in range(plan.world_size):
        batch = build_linear_batch(plan, rank, slices, reader)
        index = torch.tensor(
            [starts[r.seq] + p for r in batch.ranges for p in range(r.start, r.end)],
            dtype=torch.long,
        )
        for key, value in batch.as_megatron().items():
            assert value.shape == (1, batch.num_tokens)
            gathered.setdefault(key, []).append((index, value[0]))
    for key, parts in gathered.items():
        full = torch.empty_like(reference.as_megatron()[key][0])
        for index, value in parts:
            full[index] = value
        assert torch.equal(full, reference.as_megatron()[key][0]), key
    assert reference.num_loss_tokens == sum(s.num_tokens - 1 for s in slices)


@settings(max_examples=examples(60), deadline=None)
@given(case=micro_batches(), seed=st.integers(0, 100))
def test_a_rank_reads_only_its_ranges_and_one_label_token(case, seed):
    doc_lengths, slices, plan = case
    for rank in range(plan.world_size):
        reader = RecordingReader(_docs(doc_lengths, seed))
        build_linear_batch(plan, rank, slices, reader)
        expected = []
        for r in plan.linear_ranges(rank):
            piece = slices[r.seq]
            extra = 1 if r.end < piece.num_tokens else 0
            expected.append((piece.doc, piece.start + r.start, piece.start + r.end + extra))
        assert reader.reads == expected


def test_reads_from_a_real_dataset_count_only_own_tokens(tmp_path):
    from megatron_zeppelin.job.synthetic import write_synthetic_dataset
    from megatron_zeppelin.megatron.documents.data import DocumentDataset

    lengths = [40, 25, 70]
    prefix = write_synthetic_dataset(str(tmp_path / "d"), lengths=lengths, seed=2).path_prefix
    slices = [DocumentSlice(d, 0, n) for d, n in enumerate(lengths)]
    # Rank r holds quarter r of the concatenated stream: ranges cut through documents.
    total, world = sum(lengths), TOPOLOGY.world_size
    bounds = [round(r * total / world) for r in range(world + 1)]
    starts = np.cumsum([0] + lengths)
    linear = [[] for _ in range(world)]
    for rank in range(world):
        for seq, n in enumerate(lengths):
            a, b = max(bounds[rank], starts[seq]), min(bounds[rank + 1], starts[seq] + n)
            if b > a:
                linear[rank].append(TokenRange(seq, int(a - starts[seq]), int(b - starts[seq])))
    sequences = [
        SequencePlan(i, n, Tier.LOCAL, (0,), (Span(0, 0, n),)) for i, n in enumerate(lengths)
    ]
    plan = Plan(topology=TOPOLOGY, sequences=tuple(sequences), linear=linear)
    full = DocumentDataset(prefix)
    for rank in range(world):
        ds = DocumentDataset(prefix)
        batch = build_linear_batch(plan, rank, slices, ds)
        extra = sum(r.end < lengths[r.seq] for r in plan.linear_ranges(rank))
        assert ds.num_tokens_read == plan.num_linear_tokens(rank) + extra
        first = plan.linear_ranges(rank)[0]
        assert batch.tokens_t[0].item() == full.read(first.seq, first.start, first.start + 1)[0]


def test_a_plan_for_another_micro_batch_is_refused():
    plan = Plan(
        topology=TOPOLOGY,
        sequences=(SequencePlan(0, 10, Tier.LOCAL, (0,), (Span(0, 0, 10),)),),
        linear=[[TokenRange(0, 0, 10)], [], [], []],
    )
    reader = RecordingReader(_docs([12], 0))
    with pytest.raises(ValueError, match="built for another micro-batch"):
        build_linear_batch(plan, 0, [DocumentSlice(0, 0, 12)], reader)
    with pytest.raises(ValueError, match="no document slice"):
        build_linear_batch(plan, 0, [], reader)
    with pytest.raises(ValueError, match="outside the plan's world"):
        build_linear_batch(plan, 4, [DocumentSlice(0, 0, 10)], reader)
    empty = build_linear_batch(plan, 1, [DocumentSlice(0, 0, 10)], reader)
    assert empty.num_tokens == 0 and empty.labels_t.dtype == torch.int64


@settings(max_examples=examples(60), deadline=None)
@given(case=micro_batches(), seed=st.integers(0, 100), multiple=st.integers(1, 4))
def test_padding_makes_a_non_empty_multiple_and_never_reaches_the_loss(case, seed, multiple):
    doc_lengths, slices, plan = case
    reader = RecordingReader(_docs(doc_lengths, seed))
    for rank in range(plan.world_size):
        batch = build_linear_batch(plan, rank, slices, reader)
        padded = pad_linear_batch(batch, multiple)
        rows = padded.num_tokens
        assert rows % multiple == 0 and rows >= multiple and rows >= batch.num_tokens
        assert padded.num_padding == rows - batch.num_tokens < multiple + (batch.num_tokens == 0)
        # The real rows are untouched; padding rows carry no loss.
        real = batch.num_tokens
        assert torch.equal(padded.tokens_t[:real], batch.tokens_t)
        assert torch.equal(padded.position_ids_t[:real], batch.position_ids_t)
        assert padded.num_loss_tokens == batch.num_loss_tokens
        assert not padded.loss_mask_t[real:].any()
        assert padded.ranges == batch.ranges
