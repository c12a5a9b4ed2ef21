"""Validation and test through the hooks, driven as Megatron's ``evaluate()`` drives them: its
loaders iterate the marker datasets the provider returns, and ``forward_step`` runs each
micro-batch of the marker's split. The validation stream continues from evaluation to
evaluation, starts where Megatron's count of consumed validation samples says, passes over
every validation document with ``--full-validation``, and never moves the training sampler.

Tier: threads (one in-process gloo rank with Megatron's parallel state, the stand-in
``megatron.training`` of ``tests/test_hooks.py``; the real ``pretrain()``:
``tests/host/test_pretrain_loop.py``).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_hooks import VOCAB, _megatron_args, megatron_training  # noqa: F401 - a fixture

from megatron_zeppelin.job.synthetic import write_synthetic_dataset
from megatron_zeppelin.megatron import hooks

pytestmark = pytest.mark.threads

EVAL_ITERS = 2
LENGTHS = [40, 7, 55, 13, 30, 2, 61, 24, 18, 33] * 4  # 40 documents; --split 6,2,2: 24, 8, 8


@pytest.fixture
def prefix(tmp_path) -> str:
    path = str(tmp_path / "docs")
    write_synthetic_dataset(path, lengths=LENGTHS, vocab_size=VOCAB)
    return path


def _start(megatron_training, prefix: str, **fields):  # noqa: F811 - the fixture's value
    hooks.reset()
    args = _megatron_args(prefix)
    args.split, args.eval_iters, args.consumed_valid_samples = "6,2,2", EVAL_ITERS, 0
    for key, value in fields.items():
        setattr(args, key, value)
    megatron_training(args)
    torch.manual_seed(0)  # the same weights in every run of a test
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hooks.model_provider(pre_process=True, post_process=True)
    return args, model


def _evaluate(model, markers, num_micro_batches: int) -> list:
    """What ``evaluate()`` does with a loader over ``markers``: forward only; returns each
    micro-batch's documents (as ids of the split's datasets) and its loss sum and count."""
    loader = _cyclic(torch.utils.data.DataLoader(markers, batch_size=1))
    stream = hooks._STATE.evaluation[markers.split.name]
    drawn = []
    with torch.no_grad():
        for _ in range(num_micro_batches):
            output, loss_func = hooks.forward_step(loader, model)
            _, count, report = loss_func(output)
            docs = _last_slices(stream)
            drawn.append((docs, float(report["lm loss"][0]), int(count)))
    return drawn


def _cyclic(loader):
    """Megatron's iterator over a validation loader with --full-validation (``cyclic_iter``):
    its ``eval_iters`` is the loader's length, and each iteration takes a step of
    micro-batches. Without it, the loader is longer than the evaluations here take."""
    while True:
        yield from loader


def _last_slices(stream) -> tuple:
    """The (dataset document, start, end) of the micro-batch the stream just handed out."""
    item = stream.feed._last
    return tuple((stream.documents.locate(s.doc)[1], s.start, s.end) for s in item.slices)


@pytest.fixture(autouse=True)
def _remember_last(monkeypatch):
    """Keep the last micro-batch a feed hands out, to see which documents it read."""
    from megatron_zeppelin.megatron.plans.feed import MicroBatchFeed

    real = MicroBatchFeed.next

    def remembering(self):
        self._last = real(self)
        return self._last

    monkeypatch.setattr(MicroBatchFeed, "next", remembering)


def test_each_split_gets_its_markers_and_evaluation_reads_only_held_out_documents(
    megatron_training,  # noqa: F811
    one_rank,
    prefix,
    tmp_path,
    capsys,
):
    from megatron_zeppelin.megatron.documents.resume import sampler_state_path

    save = str(tmp_path / "ckpt")
    args, model = _start(megatron_training, prefix, save=save)
    per_step = args.global_batch_size  # micro-batches per evaluation iteration (one rank)
    train, valid, test = hooks.train_valid_test_datasets_provider([4, 8, 4])
    assert [len(train), len(valid), len(test)] == [4, 8, 4]
    assert [train[0], valid[3], test[1]] == [0, 1, 2]  # each marker says its split

    training_state = hooks._STATE.feed.state_dict()
    first = _evaluate(model, valid, EVAL_ITERS * per_step)
    second = _evaluate(model, valid, EVAL_ITERS * per_step)
    tested = _evaluate(model, test, EVAL_ITERS * per_step)
    assert hooks._STATE.feed.state_dict() == training_state  # evaluation never moves training

    def documents(drawn):
        return {doc for docs, _, _ in drawn for doc, _, _ in docs}

    # Megatron's split of 40 one-sequence documents by 6,2,2: 0-23, 24-31, 32-39.
    assert documents(first) | documents(second) <= set(range(24, 32))
    assert documents(tested) <= set(range(32, 40))
    assert first != second  # the next evaluation continues the stream, as Megatron's loader
    assert all(count > 0 for _, _, count in first) and all(np.isfinite(s) for _, s, _ in first)

    # The validation stream's state is kept at the end of every evaluation (2 steps each).
    for step, there in ((1, False), (2, True), (3, False), (4, True)):
        assert os.path.exists(sampler_state_path(save, step, "valid")) == there

    # After a resume Megatron's loader starts at consumed_valid_samples: so does the stream,
    # from the state saved there, or replayed where the checkpoint has none.
    consumed = EVAL_ITERS * args.global_batch_size  # one evaluation done
    for said in ("sampler restored at validation step 2", "no sampler state for validation step 2"):
        capsys.readouterr()
        args, model = _start(megatron_training, prefix, consumed_valid_samples=consumed, load=save)
        _, valid, _ = hooks.train_valid_test_datasets_provider([4, 8, 4])
        assert said in capsys.readouterr().out
        resumed = _evaluate(model, valid, EVAL_ITERS * per_step)
        assert [d for d, _, _ in resumed] == [d for d, _, _ in second]
        for (_, loss, count), (_, expected, expected_count) in zip(resumed, second):
            assert count == expected_count and loss == pytest.approx(expected, rel=1e-6)
        Path(sampler_state_path(save, EVAL_ITERS, "valid")).unlink(missing_ok=True)

    # --skip-train evaluates from the start of the validation split, as Megatron's loader does.
    args, model = _start(megatron_training, prefix, consumed_valid_samples=4, skip_train=True)
    _, valid, _ = hooks.train_valid_test_datasets_provider([4, 8, 4])
    assert [d for d, _, _ in _evaluate(model, valid, per_step)] == [d for d, _, _ in first[:2]]
    # Without a training feed the first evaluation feed opens the run's one planner and the
    # next plans beside it (two planners sharing plans would broadcast on one group).
    feeds = hooks._FeedsOfRun(None)
    samplers = [stream.feed.sampler for stream in hooks._STATE.evaluation.values()]
    lead, beside = feeds(samplers[0]), feeds(samplers[1])
    assert lead._owns_planner and not beside._owns_planner
    assert beside._planner is lead._planner is not None
    beside.close()
    lead.close()


def test_full_validation_passes_over_every_validation_document_each_time(
    megatron_training,  # noqa: F811
    one_rank,
    prefix,
):
    args, model = _start(megatron_training, prefix, full_validation=True)
    # Megatron asks for no validation samples with --full-validation: one marker per step.
    _, valid, test = hooks.train_valid_test_datasets_provider([4, None, 4])
    num_steps = len(valid)
    assert num_steps == hooks._STATE.evaluation["valid"].pass_steps >= 1
    per_step = args.global_batch_size
    # Megatron then evaluates the test split for as many iterations: its loader has them.
    assert len(test) >= num_steps * per_step
    first = _evaluate(model, valid, num_steps * per_step)
    second = _evaluate(model, valid, num_steps * per_step)
    assert first == second
    pieces = sorted(p for docs, _, _ in first for p in docs)
    assert [doc for doc, _, _ in pieces] == list(range(24, 32))  # each document once
    assert [end - start for _, start, end in pieces] == LENGTHS[24:32]


def test_per_split_datasets_and_the_evaluation_batch_size(
    megatron_training,  # noqa: F811
    one_rank,
    prefix,
    tmp_path,
):
    other = str(tmp_path / "held_out")
    write_synthetic_dataset(other, lengths=[11, 23, 5, 40], vocab_size=VOCAB)
    args, model = _start(
        megatron_training,
        prefix,
        data_path=None,
        split=None,
        train_data_path=[prefix],
        valid_data_path=[other],
        eval_global_batch_size=4,
    )
    train, valid, test = hooks.train_valid_test_datasets_provider([4, 16, 0])
    assert test is None  # no --test-data-path: Megatron builds no test dataset either
    stream = hooks._STATE.evaluation["valid"]
    assert stream.feed.sampler.num_micro_batches == 4  # --eval-global-batch-size / DP
    assert hooks._STATE.dataset.source_sizes == [len(LENGTHS)]  # every training document
    drawn = _evaluate(model, valid, 8)
    assert {doc for docs, _, _ in drawn for doc, _, _ in docs} == {0, 1, 2, 3}
    assert {ds.path_prefix for ds in stream.documents.datasets} == {other}


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(sft=True), "drop --sft"),
        (dict(fim_data=True), "drop --fim-data"),
        (dict(dataloader_type="external"), "drop --dataloader-type external"),
        (dict(eval_micro_batch_size=2), "set --eval-micro-batch-size 1"),
        (dict(multiple_validation_sets=True), "drop --multiple-validation-sets"),
    ],
)
def test_data_and_evaluation_flags_zeppelin_cannot_honour_are_refused(flags, message, prefix):
    import argparse

    from megatron_zeppelin.megatron import coverage
    from megatron_zeppelin.megatron.evaluation import check_flags

    args = argparse.Namespace(data_path=[prefix], split="6,2,2", eval_iters=1, **flags)
    assert message in coverage.first_refusal(args)
    fine = argparse.Namespace(data_path=[prefix], split="6,2,2", eval_iters=1)
    assert coverage.first_refusal(fine) is None
    check_flags(fine)
