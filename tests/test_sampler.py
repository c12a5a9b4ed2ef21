"""The document sampler: whole documents per epoch, budgets, cost balance, exact resume.

Tier: pure (Hypothesis properties over random length lists; no files, no processes).
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.megatron.documents.sampler import (
    DocumentCost,
    DocumentSampler,
    balance_by_cost,
)

pytestmark = pytest.mark.pure

lengths_strategy = st.lists(st.integers(0, 3000), min_size=1, max_size=60).filter(
    lambda xs: any(xs)
)


def _config(draw_lengths, data):
    """A sampler setting that is valid for the drawn lengths."""
    num_mb = data.draw(st.integers(1, 4), label="num_micro_batches")
    capacity = data.draw(st.one_of(st.none(), st.integers(500, 4000)), label="capacity")
    budget_hi = 8000 if capacity is None else num_mb * capacity
    budget = data.draw(st.integers(500, budget_hi), label="tokens_per_step")
    limit = budget if capacity is None else min(budget, capacity)
    max_length = data.draw(st.integers(min(64, limit), limit), label="max_length")
    policy = data.draw(st.sampled_from(["split", "truncate"]), label="policy")
    return dict(
        tokens_per_step=budget,
        num_micro_batches=num_mb,
        seed=data.draw(st.integers(0, 2**31), label="seed"),
        max_length=max_length,
        long_documents=policy,
        micro_batch_capacity=capacity,
        cost=DocumentCost(attention=1.0, linear=500.0),
    )


def _epochs(sampler: DocumentSampler, num_epochs: int, max_steps: int = 5000):
    """Steps until every unit of the first ``num_epochs`` epochs has been handed out."""
    steps = []
    while True:
        state = sampler.state_dict()
        epoch = min(source[0] for source in state["sources"])
        if epoch >= num_epochs and all(c[3] >= num_epochs for c in state["carry"]):
            return steps
        steps.append(sampler.next_step())
        assert len(steps) < max_steps


@settings(max_examples=examples(60), deadline=None)
@given(lengths=lengths_strategy, data=st.data())
def test_every_document_once_per_epoch_whole_or_as_its_pieces(lengths, data):
    cfg = _config(lengths, data)
    sampler = DocumentSampler(lengths, **cfg)
    steps = _epochs(sampler, num_epochs=2)
    seen: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for step in steps:
        for mb in step.micro_batches:
            for s in mb:
                if s.epoch < 2:
                    seen[(s.epoch, s.doc)].append((s.start, s.end))
    max_length = cfg["max_length"]
    for epoch in range(2):
        for doc, length in enumerate(lengths):
            pieces = sorted(seen.get((epoch, doc), []))
            if length == 0:
                assert pieces == []
            elif length <= max_length:
                assert pieces == [(0, length)]  # whole, exactly once
            elif cfg["long_documents"] == "truncate":
                assert pieces == [(0, max_length)]
            else:
                # Split: the pieces tile the document, each within max_length, as even as possible.
                assert pieces[0][0] == 0 and pieces[-1][1] == length
                assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
                sizes = [e - s for s, e in pieces]
                assert max(sizes) <= max_length and max(sizes) - min(sizes) <= 1
                assert len(pieces) == -(-length // max_length)


@settings(max_examples=examples(60), deadline=None)
@given(lengths=lengths_strategy, data=st.data())
def test_budgets_and_capacities_are_respected(lengths, data):
    cfg = _config(lengths, data)
    sampler = DocumentSampler(lengths, **cfg)
    for _ in range(15):
        step = sampler.next_step()
        assert len(step.micro_batches) == cfg["num_micro_batches"]
        assert 0 < step.num_tokens <= cfg["tokens_per_step"]
        for i, mb in enumerate(step.micro_batches):
            assert step.lengths(i) == [s.num_tokens for s in mb]
            assert all(0 < s.num_tokens <= cfg["max_length"] for s in mb)
            if cfg["micro_batch_capacity"] is not None:
                assert sum(step.lengths(i)) <= cfg["micro_batch_capacity"]


@settings(max_examples=examples(100), deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20000), min_size=1, max_size=40),
    num_bins=st.integers(1, 6),
    linear=st.floats(0, 1e4),
)
def test_cost_balance_stays_within_one_item_of_the_mean(lengths, num_bins, linear):
    cost = DocumentCost(attention=1.0, linear=linear)
    bins, left_over = balance_by_cost(lengths, num_bins, cost=cost)
    assert left_over == []
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    costs = [float(cost(lengths[i])) for i in range(len(lengths))]
    bin_costs = [sum(costs[i] for i in b) for b in bins]
    # Greedy on the cheapest bin: no bin exceeds the mean by more than the largest item.
    assert max(bin_costs) <= sum(costs) / num_bins + max(costs) + 1e-6 * sum(costs)


def _imbalance(micro_batches, cost):
    per_mb = [sum(float(cost(s.num_tokens)) for s in mb) for mb in micro_batches]
    return max(per_mb) / (sum(per_mb) / len(per_mb))


def test_balance_by_cost_beats_balance_by_count_on_a_long_tail():
    # A long tail like real corpora: mostly short documents, a few very long ones.
    rng = np.random.default_rng(0)
    lengths = np.where(rng.random(3000) < 0.03, rng.integers(8000, 32000, 3000), 300)
    lengths = (lengths * rng.uniform(0.5, 1.5, 3000)).astype(int)
    cost = DocumentCost(attention=1.0, linear=4000.0)
    sampler = DocumentSampler(
        lengths, tokens_per_step=200_000, num_micro_batches=4, seed=1, cost=cost
    )
    by_cost, by_count = [], []
    for _ in range(20):
        step = sampler.next_step()
        by_cost.append(_imbalance(step.micro_batches, cost))
        # The same documents dealt out by count: equal numbers per micro-batch, in draw order.
        units = sorted((s for mb in step.micro_batches for s in mb), key=lambda s: s.doc)
        units = [units[i] for i in rng.permutation(len(units))]
        dealt = [units[i::4] for i in range(4)]
        by_count.append(_imbalance(dealt, cost))
    assert np.mean(by_cost) < np.mean(by_count)
    assert sum(a <= b + 1e-9 for a, b in zip(by_cost, by_count)) >= 18


@settings(max_examples=examples(40), deadline=None)
@given(lengths=lengths_strategy, data=st.data(), stop=st.integers(0, 12))
def test_resume_from_state_equals_an_uninterrupted_run(lengths, data, stop):
    cfg = _config(lengths, data)
    uninterrupted = DocumentSampler(lengths, **cfg)
    expected = [uninterrupted.next_step() for _ in range(stop + 6)]

    first = DocumentSampler(lengths, **cfg)
    for _ in range(stop):
        first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints hold plain data
    resumed = DocumentSampler(lengths, **cfg)
    resumed.load_state_dict(state)
    assert resumed.step == stop
    got = [resumed.next_step() for _ in range(6)]
    assert got == expected[stop:]
    assert [s.epoch for s in got] == [s.epoch for s in expected[stop:]]


def test_same_seed_same_batches_on_every_rank_and_other_seed_differs():
    lengths = np.random.default_rng(3).integers(1, 4000, 500)
    make = lambda seed: DocumentSampler(  # noqa: E731
        lengths, tokens_per_step=30000, num_micro_batches=2, seed=seed
    )
    ranks = [make(7) for _ in range(3)]
    batches = [[r.next_step() for _ in range(5)] for r in ranks]
    assert batches[0] == batches[1] == batches[2]
    other = [make(8).next_step() for _ in range(1)]
    assert other[0] != batches[0][0]


def test_state_from_other_settings_is_refused():
    lengths = [100, 200, 300]
    a = DocumentSampler(lengths, tokens_per_step=400, seed=1)
    b = DocumentSampler(lengths, tokens_per_step=500, seed=1)
    with pytest.raises(ValueError, match="tokens_per_step: saved 400, now 500"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="not a sampler state"):
        b.load_state_dict({"step": 3})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokens_per_step=0), "must be positive"),
        (dict(tokens_per_step=100, max_length=200), "max_length 200 must lie in 1..100"),
        (dict(tokens_per_step=100, long_documents="drop"), "long_documents must be one of"),
        (
            dict(tokens_per_step=1000, num_micro_batches=2, micro_batch_capacity=400),
            "cannot fit in 2 micro-batches",
        ),
    ],
)
def test_bad_settings_raise_actionable_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DocumentSampler([10, 20], **kwargs)
    with pytest.raises(ValueError, match="no non-empty document"):
        DocumentSampler([0, 0], tokens_per_step=10)
