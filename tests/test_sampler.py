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


def _units(step):
    return [[(u.doc, u.start, u.end, u.epoch) for u in mb] for mb in step.micro_batches]


def _one_by_one(sampler: DocumentSampler) -> DocumentSampler:
    """``sampler`` taking every unit with ``peek``/``take``: the bulk path turned off."""
    sampler.stream.take_whole = lambda budget: []  # type: ignore[method-assign]
    return sampler


def _same_steps(lengths, cfg: dict, num_steps: int) -> None:
    bulk, single = DocumentSampler(lengths, **cfg), _one_by_one(DocumentSampler(lengths, **cfg))
    for _ in range(num_steps):
        assert _units(bulk.next_step()) == _units(single.next_step())
        assert bulk.state_dict() == single.state_dict()


@settings(max_examples=examples(60), deadline=None)
@given(lengths=lengths_strategy, data=st.data(), epochs=st.one_of(st.none(), st.integers(1, 3)))
def test_documents_taken_in_bulk_are_those_taken_one_by_one(lengths, data, epochs):
    """Runs of whole documents are taken in bulk (``DocumentStream.take_whole``): every step,
    its units' epochs and the sampler's state after it are those of taking them one by one."""
    _same_steps(lengths, {**_config(lengths, data), "num_epochs": epochs}, 12)


@pytest.mark.parametrize("policy", ["split", "truncate"])
def test_bulk_runs_of_thousands_of_documents_are_those_taken_one_by_one(policy):
    """Steps of thousands of documents (the bulk path's windows grow), with empty documents,
    documents cut in pieces and epochs ending inside steps."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 400, size=9000)
    lengths[rng.choice(9000, 300, replace=False)] = 0
    lengths[rng.choice(9000, 40, replace=False)] = 5000
    cfg = dict(
        tokens_per_step=700_000, num_micro_batches=3, seed=5, max_length=2048,
        long_documents=policy, micro_batch_capacity=300_000,
    )  # fmt: skip
    _same_steps(lengths, cfg, 8)
    # Steps filled to the last token: one token per document.
    _same_steps(np.ones(9000, dtype=np.int64), {**cfg, "tokens_per_step": 2500}, 5)


def _balance_one_by_one(lengths, num_bins, cost, capacity, num_first):
    """``balance_by_cost``'s rule written plainly: by cost, each onto the cheapest bin that
    fits (ties to fewer tokens, then the lower index)."""
    costs = [float(cost(np.int64(n))) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (i >= num_first, -costs[i], i))
    bin_cost, bin_tokens = [0.0] * num_bins, [0] * num_bins
    bins, left_over = [[] for _ in range(num_bins)], []
    for i in order:
        fits = [
            b for b in range(num_bins) if capacity is None or bin_tokens[b] + lengths[i] <= capacity
        ]
        if not fits:
            left_over.append(i)
            continue
        b = min(fits, key=lambda j: (bin_cost[j], bin_tokens[j], j))
        bins[b].append(i)
        bin_cost[b] += costs[i]
        bin_tokens[b] += lengths[i]
    return [sorted(b) for b in bins], sorted(left_over)


@settings(max_examples=examples(60), deadline=None)
@given(
    lengths=st.lists(st.integers(1, 3000), max_size=60),
    num_bins=st.integers(1, 5),
    capacity=st.one_of(st.none(), st.integers(1, 6000)),
    num_first=st.integers(0, 5),
    linear=st.sampled_from([0.0, 500.0]),
)
def test_balance_by_cost_follows_its_rule(lengths, num_bins, capacity, num_first, linear):
    cost = DocumentCost(attention=1.0, linear=linear)
    args = (lengths, num_bins, cost, capacity, num_first)
    got = balance_by_cost(lengths, num_bins, cost=cost, capacity=capacity, num_first=num_first)
    assert got == _balance_one_by_one(*args)
