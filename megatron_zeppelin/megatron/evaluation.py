"""Validation and test through Zeppelin's path: forward only, on held-out documents.

Megatron's ``evaluate()`` runs ``--eval-iters`` iterations, each calling ``forward_step`` (with
``forward_only=True``) for ``--eval-global-batch-size / data-parallel size`` micro-batches, and
prints the loss sum over all of them and all ranks divided by their token count. Zeppelin
answers each evaluation iteration with one step of an evaluation sampler: that many
micro-batches of whole documents of the split, each within the training micro-batch's token
budget, planned and run exactly as training micro-batches are (``step.run_micro_batch``). The
printed validation loss is then the per-token loss over every token of the documents the
evaluation drew, as one process computes it on the same documents.

Each split has its own sampler (seeded with ``--seed``, as Megatron seeds every split), so
evaluating never moves the training sampler, and resuming training is unaffected. Which
documents an evaluation sees follows what Megatron's loaders do:

* **validation**: one stream over the validation documents that every evaluation continues,
  as Megatron's validation loader continues from ``consumed_valid_samples``: evaluation ``k``
  of the run (counted from iteration 0, across resumes) takes steps ``k * eval_iters`` to
  ``(k + 1) * eval_iters - 1``; after a resume the stream starts at
  ``consumed_valid_samples / eval_global_batch_size`` steps (Megatron restores that count from
  the checkpoint; the stream's state there is saved beside the checkpoints at the end of every
  evaluation, ``resume.py``), and at 0 with ``--skip-train``, as Megatron's loader does;
* **--full-validation**: every evaluation is one pass over all validation documents, each
  exactly once, from the same start (the stream's steps up to the end of its first epoch;
  Megatron runs as many iterations as its loader has batches, which the marker dataset sets
  to that number of steps);
* **test**: the first ``--eval-iters`` steps of a stream over the test documents, evaluated
  once after training (Megatron builds the test loader from sample 0 in every run).

Megatron's loaders still run over datasets of markers (``Markers``): each marker says which
split its micro-batch belongs to, so ``forward_step`` knows which stream to draw from.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_zeppelin.megatron.documents.blend import SPLITS, DocumentSet, check_data_flags
from megatron_zeppelin.megatron.documents.sampler import DocumentSampler
from megatron_zeppelin.megatron.plans.feed import FedMicroBatch, MicroBatchFeed

SamplerFactory = Callable[..., DocumentSampler]
"""``(documents, num_micro_batches, num_epochs=None) -> DocumentSampler`` with the run's
token budget, seed and long-document policy."""


def is_evaluating(args: argparse.Namespace) -> bool:
    """Whether Megatron will evaluate (its ``do_valid`` / ``do_test``, given data)."""
    return (
        bool(getattr(args, "full_validation", False))
        or int(getattr(args, "eval_iters", 0) or 0) > 0
    )


def eval_batch_size(args: argparse.Namespace) -> int:
    """Samples (micro-batches of all ranks) per evaluation iteration: Megatron's
    ``--eval-global-batch-size``, which defaults to ``--global-batch-size``."""
    return int(getattr(args, "eval_global_batch_size", None) or args.global_batch_size)


def check_flags(args: argparse.Namespace) -> None:
    """Check the data the flags name (``blend.check_data_flags``) for the splits the run will
    read. (The evaluation and data flags Zeppelin cannot honour, such as
    ``--multiple-validation-sets`` or ``--eval-micro-batch-size`` above 1, are refused with every
    other flag's answer: ``megatron.coverage``.)"""
    splits = [] if getattr(args, "skip_train", False) else ["train"]
    if is_evaluating(args):
        splits += ["valid", "test"]
    check_data_flags(args, splits=splits)


class Markers(torch.utils.data.Dataset):
    """What Megatron's data loader iterates: per sample, the index of its split (0 train,
    1 validation, 2 test), nothing else.

    Zeppelin draws whole documents itself; Megatron's loop only needs an indexable dataset of
    the length it asked for, so its own sampler, ``DataLoader`` and consumed-sample bookkeeping
    work unchanged. ``split`` is Megatron's ``Split``: its loader reads it to give validation
    and test their evaluation batch sizes."""

    def __init__(self, num_samples: int, split: str = "train") -> None:
        # lazy: megatron-core's dataset package pulls in its tokenizers.
        from megatron.core.datasets.utils import Split

        self.num_samples = int(num_samples)
        self.split = Split[split]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        return self.split.value


def marker_split(marker: Any) -> str:
    """The split a marker batch from Megatron's loader belongs to."""
    return SPLITS[int(torch.as_tensor(marker).reshape(-1)[0])]


@dataclass
class EvalStream:
    """One split's evaluation micro-batches, with the documents they read."""

    feed: MicroBatchFeed
    documents: DocumentSet
    pass_steps: int | None = None
    """With --full-validation: the steps of one pass, after which the stream starts again."""
    start: dict | None = None
    """The sampler's state where every pass starts."""
    save: Callable[[int, dict], None] | None = None
    """Called with the step and the state at the end of every evaluation."""
    steps_per_evaluation: int = 1

    def next(self) -> FedMicroBatch:
        if self.pass_steps is not None and self.feed.state_dict()["step"] == self.pass_steps:
            self.feed.load_state_dict(self.start)
        item = self.feed.next()
        done = item.step.step + 1
        if self.save and item.is_last_of_step and done % self.steps_per_evaluation == 0:
            self.save(done, self.feed.state_dict())
        return item

    def close(self) -> None:
        self.feed.close()


def pass_steps(sampler: DocumentSampler) -> int:
    """Steps one pass of a ``num_epochs=1`` sampler takes (the sampler is used up)."""
    steps = 0
    while not sampler.exhausted:
        sampler.next_step()
        steps += 1
    return steps


def evaluation_streams(
    args: argparse.Namespace,
    documents: dict[str, DocumentSet | None],
    *,
    make_sampler: SamplerFactory,
    make_feed: Callable[[DocumentSampler], MicroBatchFeed],
    data_parallel: int,
    restore: Callable[[DocumentSampler, int], None],
    save: Callable[[int, dict], None] | None,
) -> dict[str, EvalStream]:
    """The validation and test streams of the module docstring, for the splits with documents
    (none where the run does not evaluate). ``restore(sampler, step)`` brings the validation
    sampler to ``step``; ``save(step, state)`` keeps its state at the end of an evaluation."""
    if not is_evaluating(args):
        return {}
    eval_batch = eval_batch_size(args)
    num_micro_batches = eval_batch // data_parallel
    streams = {}
    for split in ("valid", "test"):
        docs = documents.get(split)
        if docs is None:
            continue
        full = split == "valid" and bool(getattr(args, "full_validation", False))
        sampler = make_sampler(docs, num_micro_batches, num_epochs=1 if full else None)
        if full:
            steps = pass_steps(make_sampler(docs, num_micro_batches, num_epochs=1))
            streams[split] = EvalStream(make_feed(sampler), docs, steps, sampler.state_dict())
            continue
        if split == "test":
            streams[split] = EvalStream(make_feed(sampler), docs)
            continue
        restore(sampler, _first_step(args, eval_batch))
        iters = int(getattr(args, "eval_iters", 0) or 0)
        streams[split] = EvalStream(
            make_feed(sampler), docs, save=save, steps_per_evaluation=max(iters, 1)
        )
    return streams


def _first_step(args: argparse.Namespace, eval_batch: int) -> int:
    """Where Megatron's validation loader starts, in evaluation steps."""
    if getattr(args, "skip_train", False):
        return 0
    return int(getattr(args, "consumed_valid_samples", 0) or 0) // eval_batch


def marker_counts(
    args: argparse.Namespace,
    num_samples: list[int | None],
    streams: dict[str, EvalStream],
    data_parallel: int,
) -> dict[str, int]:
    """How many markers each split's loader gets: what Megatron asked for, and with
    --full-validation (Megatron asks for none) one per rank per step of the pass. Megatron
    then runs that many iterations for the test split too (its ``eval_iters`` becomes the
    validation loader's length), so the test loader gets at least as many steps."""
    counts = {split: int(n or 0) for split, n in zip(SPLITS, num_samples)}
    valid = streams.get("valid")
    if valid is not None and valid.pass_steps is not None:
        counts["valid"] = valid.pass_steps * data_parallel
        counts["test"] = max(counts["test"], valid.pass_steps * eval_batch_size(args))
    return counts
