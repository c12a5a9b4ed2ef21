"""One rank's micro-batch in the linear layout: tokens, labels, loss mask and positions.

Every rank plans the same micro-batch (the sampler's ``DocumentSlice`` list; plan sequence ``i``
is slice ``i``) and then reads from the ``.bin`` only the token ranges the plan gives it in the
linear layout (``plan.linear_ranges(rank)``, in that order), plus, after each range, the one
token that follows it inside the same sequence: the label of the range's last token.

A rank's buffer may end in padding rows (``pad_linear_batch``): a multiple of the
tensor-parallel size under sequence parallelism, and never empty.

Shapes: ``t`` is the rank's linear row count; all tensors are flat ``[t]``
(``as_megatron()`` adds Megatron's micro-batch dimension: ``[1, t]``).

Labels never cross a sequence boundary. The last token of every sequence has ``loss_mask`` 0
and, as its label, its own token id: a valid vocabulary index for every loss implementation,
and never a token of another document. A piece of a split document is its own sequence here,
as it is for attention, so the same rule applies at the cut. ``position_ids`` are positions
inside the token's own sequence (what per-document rotary embeddings need), wherever the
token's range lies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from megatron_zeppelin.megatron.documents.sampler import DocumentSlice
from megatron_zeppelin.planner.plan.plan import Plan, TokenRange


class TokenReader(Protocol):
    """What the batch builder needs from a dataset (``data.DocumentDataset`` is one)."""

    def read(self, doc: int, start: int = 0, end: int | None = None) -> np.ndarray: ...


@dataclass(frozen=True)
class LinearBatch:
    """A rank's linear-layout tensors; see the module docstring for shapes and rules."""

    tokens_t: torch.Tensor
    """Token ids, ``int64``."""
    labels_t: torch.Tensor
    """Next token inside the same sequence, ``int64``."""
    loss_mask_t: torch.Tensor
    """1.0 where the label is a real next token, 0.0 on each sequence's last token."""
    position_ids_t: torch.Tensor
    """Position of each token inside its own sequence, ``int64``."""
    ranges: tuple[TokenRange, ...]
    """The plan's linear ranges of this rank, in buffer order."""
    num_padding: int = 0
    """Rows after the ranges' tokens that pad the buffer (``pad_linear_batch``)."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_t.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        """Tokens that count in the loss (for the per-token loss denominator)."""
        return int(self.loss_mask_t.sum().item())

    def as_megatron(self) -> dict[str, torch.Tensor]:
        """Megatron's batch keys with its ``[b, s]`` shape (``b = 1``)."""
        return {
            "tokens": self.tokens_t.unsqueeze(0),
            "labels": self.labels_t.unsqueeze(0),
            "loss_mask": self.loss_mask_t.unsqueeze(0),
            "position_ids": self.position_ids_t.unsqueeze(0),
        }

    def to(self, device: torch.device | str) -> LinearBatch:
        return LinearBatch(
            tokens_t=self.tokens_t.to(device),
            labels_t=self.labels_t.to(device),
            loss_mask_t=self.loss_mask_t.to(device),
            position_ids_t=self.position_ids_t.to(device),
            ranges=self.ranges,
            num_padding=self.num_padding,
        )


def check_slices_match_plan(plan: Plan, slices: Sequence[DocumentSlice]) -> None:
    """Raise ``ValueError`` unless plan sequence ``i`` is slice ``i`` with the same length."""
    for seq in plan.sequences:
        if not 0 <= seq.id < len(slices):
            raise ValueError(
                f"plan sequence {seq.id} has no document slice ({len(slices)} given): build the "
                "plan from this micro-batch's lengths, in the sampler's order"
            )
        if slices[seq.id].num_tokens != seq.length:
            raise ValueError(
                f"plan sequence {seq.id} has {seq.length} tokens but its document slice has "
                f"{slices[seq.id].num_tokens}: the plan was built for another micro-batch"
            )


def build_linear_batch(
    plan: Plan,
    rank: int,
    slices: Sequence[DocumentSlice],
    dataset: TokenReader,
) -> LinearBatch:
    """Read rank ``rank``'s linear-layout tokens of this micro-batch and derive its targets."""
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is outside the plan's world of {plan.world_size} GPUs")
    check_slices_match_plan(plan, slices)
    ranges = tuple(plan.linear_ranges(rank))
    tokens, labels, mask, positions = [], [], [], []
    for r in ranges:
        piece = slices[r.seq]
        length = piece.num_tokens
        # One extra token when the range stops inside its sequence: the last label.
        has_next = r.end < length
        read = dataset.read(piece.doc, piece.start + r.start, piece.start + r.end + has_next)
        read = np.asarray(read, dtype=np.int64)
        assert read.shape[0] == r.num_tokens + has_next, (r, read.shape)
        own = read[: r.num_tokens]
        nxt = read[1:] if has_next else np.concatenate((read[1:], read[-1:]))
        keep = np.ones(r.num_tokens, dtype=np.float32)
        if not has_next:
            keep[-1] = 0.0  # the sequence's last token predicts nothing
        tokens.append(own)
        labels.append(nxt)
        mask.append(keep)
        positions.append(np.arange(r.start, r.end, dtype=np.int64))

    return _assemble(tokens, labels, mask, positions, ranges)


def pad_linear_batch(batch: LinearBatch, multiple: int = 1) -> LinearBatch:
    """``batch`` with padding rows at its end, so that it holds a positive multiple of
    ``multiple`` rows: Megatron's sequence parallelism splits a rank's rows over its
    ``multiple`` tensor-parallel GPUs, and its attention cannot reshape an empty rank's zero
    rows. A padding row is token 0 with label 0, loss mask 0 and position 0: it never reaches
    the loss, and core attention gives it a zero output (it attends to nothing, nothing to it).
    The plan never sees it, so the cost model and the logged imbalance do not either."""
    if multiple < 1:
        raise ValueError(f"padding multiple must be positive, got {multiple}")
    rows = batch.num_tokens
    pad = max(multiple, -(-rows // multiple) * multiple) - rows
    if pad == 0:
        return batch
    zeros = torch.zeros(pad, dtype=torch.int64)
    return LinearBatch(
        tokens_t=torch.cat([batch.tokens_t, zeros]),
        labels_t=torch.cat([batch.labels_t, zeros]),
        loss_mask_t=torch.cat([batch.loss_mask_t, torch.zeros(pad, dtype=torch.float32)]),
        position_ids_t=torch.cat([batch.position_ids_t, zeros]),
        ranges=batch.ranges,
        num_padding=batch.num_padding + pad,
    )


def build_reference_batch(slices: Sequence[DocumentSlice], dataset: TokenReader) -> LinearBatch:
    """The whole micro-batch on one device, sequences back to back: the single-GPU oracle the
    distributed batches are checked against (same labels, mask and positions per token)."""
    tokens, labels, mask, positions, ranges = [], [], [], [], []
    for i, piece in enumerate(slices):
        own = np.asarray(dataset.read(piece.doc, piece.start, piece.end), dtype=np.int64)
        tokens.append(own)
        labels.append(np.concatenate((own[1:], own[-1:])))
        keep = np.ones(piece.num_tokens, dtype=np.float32)
        keep[-1] = 0.0
        mask.append(keep)
        positions.append(np.arange(piece.num_tokens, dtype=np.int64))
        ranges.append(TokenRange(i, 0, piece.num_tokens))
    return _assemble(tokens, labels, mask, positions, tuple(ranges))


def _assemble(tokens, labels, mask, positions, ranges: tuple[TokenRange, ...]) -> LinearBatch:
    def cat(parts: list[np.ndarray], dtype: type) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=dtype))

    return LinearBatch(
        tokens_t=cat(tokens, np.int64),
        labels_t=cat(labels, np.int64),
        loss_mask_t=cat(mask, np.float32),
        position_ids_t=cat(positions, np.int64),
        ranges=ranges,
    )
