"""Seeded, resumable sampling of whole documents into steps and cost-balanced micro-batches.

A training step takes documents in a shuffled order (one permutation per epoch, drawn from the
seed and the epoch number) until the next one would overrun ``tokens_per_step``. A document
longer than ``max_length`` is either cut into near-equal pieces of at most ``max_length`` tokens
(``long_documents="split"``; each piece is planned as its own sequence) or keeps only its first
``max_length`` tokens (``"truncate"``). Empty documents are skipped.

The step's units are then spread over ``num_micro_batches`` micro-batches by **cost**, not by
count: attention grows with ``L^2`` and the linear layers with ``L``, so a micro-batch that
draws all the long documents costs far more than one holding many short ones, and no plan can
repair that. Units are placed longest-cost first on the cheapest micro-batch that still has
room (``micro_batch_capacity``), which keeps every micro-batch within one unit's cost of the
mean. A unit that fits nowhere waits at the head of the next step and is placed first there.

Everything is a pure function of the seed and the state: every rank computes the same batches
without talking to the others, and ``state_dict()`` / ``load_state_dict()`` resume exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LONG_DOCUMENT_POLICIES = ("split", "truncate")
_STATE_FORMAT = "zeppelin-sampler/1"


@dataclass(frozen=True)
class DocumentSlice:
    """Tokens ``[start, end)`` of dataset document ``doc``; one planned sequence."""

    doc: int
    start: int
    end: int
    epoch: int = field(default=0, compare=False)
    """Epoch the slice was drawn in (for logs and checks; not part of its identity)."""

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class DocumentCost:
    """Cost of one sequence of ``L`` tokens: ``attention * L^2 + linear * L`` (any unit)."""

    attention: float = 1.0
    """Weight of the quadratic term (causal attention pairs)."""
    linear: float = 0.0
    """Weight of the linear term (GEMMs per token)."""

    def __call__(self, length: int | np.ndarray) -> float | np.ndarray:
        return self.attention * np.square(length, dtype=np.float64) + self.linear * length

    @classmethod
    def from_model(cls, model: Any) -> DocumentCost:
        """Weights in FLOPs from a ``planner.models.ModelSpec`` (a causal document of ``L``
        tokens has about ``L^2 / 2`` query-key pairs)."""
        return cls(attention=model.attn_flops_per_pair() / 2, linear=model.linear_flops_per_token())


@dataclass(frozen=True)
class StepBatch:
    """The documents of one training step, spread over its micro-batches."""

    step: int
    """0-based index of this step in the sampler's stream."""
    epoch: int
    """Epoch of the newest slice in the step (steps may straddle an epoch boundary)."""
    micro_batches: tuple[tuple[DocumentSlice, ...], ...]
    """Per micro-batch, its sequences in plan order: sequence ``i`` of the plan is slice ``i``."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for mb in self.micro_batches for s in mb)

    def lengths(self, micro_batch: int) -> list[int]:
        """Sequence lengths of one micro-batch: what every rank hands the planner."""
        return [s.num_tokens for s in self.micro_batches[micro_batch]]


def balance_by_cost(
    lengths: Sequence[int],
    num_bins: int,
    *,
    cost: DocumentCost,
    capacity: int | None = None,
    num_first: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """Assign items (by index) to ``num_bins`` so that the cost per bin is even.

    Longest-processing-time greedy: items by decreasing cost (ties by index), each onto the
    cheapest bin whose token count stays within ``capacity``. The first ``num_first`` items are
    placed before all others (units left over from the previous step, so none waits forever).
    Returns ``(bins, left_over)``: item indices per bin in increasing index order, and the items
    no bin could hold.
    """
    costs = cost(np.asarray(lengths, dtype=np.int64)) if len(lengths) else np.zeros(0)
    order = sorted(range(len(lengths)), key=lambda i: (i >= num_first, -costs[i], i))
    bin_cost = [0.0] * num_bins
    bin_tokens = [0] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    left_over = []
    for i in order:
        fits = [
            b for b in range(num_bins) if capacity is None or bin_tokens[b] + lengths[i] <= capacity
        ]
        if not fits:
            left_over.append(i)
            continue
        b = min(fits, key=lambda j: (bin_cost[j], bin_tokens[j], j))
        bins[b].append(i)
        bin_cost[b] += float(costs[i])
        bin_tokens[b] += int(lengths[i])
    return [sorted(b) for b in bins], sorted(left_over)


class DocumentSampler:
    """Yields ``StepBatch`` objects forever; see the module docstring."""

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        tokens_per_step: int,
        num_micro_batches: int = 1,
        seed: int = 0,
        max_length: int | None = None,
        long_documents: str = "split",
        micro_batch_capacity: int | None = None,
        cost: DocumentCost | None = None,
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or (self.lengths < 0).any():
            raise ValueError("document lengths must be a flat list of non-negative integers")
        if not (self.lengths > 0).any():
            raise ValueError("the dataset has no non-empty document to sample")
        if tokens_per_step < 1 or num_micro_batches < 1:
            raise ValueError("tokens_per_step and num_micro_batches must be positive")
        if long_documents not in LONG_DOCUMENT_POLICIES:
            raise ValueError(
                f"long_documents must be one of {LONG_DOCUMENT_POLICIES}, got {long_documents!r}"
            )
        if micro_batch_capacity is not None and (
            micro_batch_capacity < 1 or tokens_per_step > num_micro_batches * micro_batch_capacity
        ):
            raise ValueError(
                f"tokens_per_step {tokens_per_step} cannot fit in {num_micro_batches} micro-batches"
                f" of {micro_batch_capacity} tokens: lower tokens_per_step or raise the capacity"
            )
        # A unit can never be larger than a step or a micro-batch, or it could never be placed.
        limit = min(tokens_per_step, micro_batch_capacity or tokens_per_step)
        if max_length is None:
            max_length = limit
        if not 1 <= max_length <= limit:
            raise ValueError(
                f"max_length {max_length} must lie in 1..{limit} (the step budget and the "
                "micro-batch capacity): lower max_length or raise tokens_per_step"
            )
        self.tokens_per_step = int(tokens_per_step)
        self.num_micro_batches = int(num_micro_batches)
        self.seed = int(seed)
        self.max_length = int(max_length)
        self.long_documents = long_documents
        self.micro_batch_capacity = micro_batch_capacity
        self.cost = cost if cost is not None else DocumentCost()
        # Cursor: the next unit is piece ``piece`` of document ``order(epoch)[position]``.
        self._epoch = 0
        self._position = 0
        self._piece = 0
        self._step = 0
        self._carry: list[DocumentSlice] = []
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._units_cache: tuple[tuple[int, int], list[DocumentSlice]] | None = None

    # --- the stream of units ---------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        """Document order of one epoch: a permutation drawn from ``(seed, epoch)`` only."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
            self._order_cache = (epoch, rng.permutation(self.lengths.shape[0]))
        return self._order_cache[1]

    def pieces(self, doc: int, *, epoch: int = 0) -> list[DocumentSlice]:
        """The units one document becomes under ``max_length`` and the long-document policy."""
        length = int(self.lengths[doc])
        if length <= self.max_length:
            return [DocumentSlice(doc, 0, length, epoch)] if length else []
        if self.long_documents == "truncate":
            return [DocumentSlice(doc, 0, self.max_length, epoch)]
        num_pieces = -(-length // self.max_length)
        cuts = [round(j * length / num_pieces) for j in range(num_pieces + 1)]
        return [DocumentSlice(doc, cuts[j], cuts[j + 1], epoch) for j in range(num_pieces)]

    def _peek(self) -> DocumentSlice:
        """The unit under the cursor, skipping empty documents (moves past them)."""
        while True:
            order = self.epoch_order(self._epoch)
            if self._position >= order.shape[0]:
                self._epoch, self._position, self._piece = self._epoch + 1, 0, 0
                continue
            key = (self._epoch, self._position)
            if self._units_cache is None or self._units_cache[0] != key:
                units = self.pieces(int(order[self._position]), epoch=self._epoch)
                self._units_cache = (key, units)  # a split document is peeked once per piece
            units = self._units_cache[1]
            if self._piece < len(units):
                return units[self._piece]
            self._position, self._piece = self._position + 1, 0

    def _advance(self) -> None:
        self._piece += 1

    # --- steps -----------------------------------------------------------------------------
    def next_step(self) -> StepBatch:
        """Take the next step's units and balance them over the micro-batches."""
        units = list(self._carry)
        num_carried = len(units)
        total = sum(u.num_tokens for u in units)
        while True:
            unit = self._peek()
            if total + unit.num_tokens > self.tokens_per_step:
                break
            units.append(unit)
            total += unit.num_tokens
            self._advance()
        bins, left_over = balance_by_cost(
            [u.num_tokens for u in units],
            self.num_micro_batches,
            cost=self.cost,
            capacity=self.micro_batch_capacity,
            num_first=num_carried,
        )
        # Left-over units keep their draw order so the next step is the same after a resume.
        self._carry = [units[i] for i in left_over]
        assert len(left_over) < len(units), "max_length <= capacity guarantees progress"
        batch = StepBatch(
            step=self._step,
            epoch=max(u.epoch for u in units),
            micro_batches=tuple(tuple(units[i] for i in b) for b in bins),
        )
        self._step += 1
        return batch

    def __iter__(self) -> Iterator[StepBatch]:
        while True:
            yield self.next_step()

    # --- resume ----------------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "num_documents": int(self.lengths.shape[0]),
            "num_tokens": int(self.lengths.sum()),
            "tokens_per_step": self.tokens_per_step,
            "num_micro_batches": self.num_micro_batches,
            "max_length": self.max_length,
            "long_documents": self.long_documents,
            "micro_batch_capacity": self.micro_batch_capacity,
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and lists (safe in a checkpoint): where the stream stands."""
        return {
            "format": _STATE_FORMAT,
            "config": self._fingerprint(),
            "step": self._step,
            "epoch": self._epoch,
            "position": self._position,
            "piece": self._piece,
            "carry": [[u.doc, u.start, u.end, u.epoch] for u in self._carry],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``; refuses a state saved with other settings or data."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError("not a sampler state: expected a dict from DocumentSampler.state_dict")
        saved, mine = state["config"], self._fingerprint()
        changed = sorted(k for k in mine if saved.get(k) != mine[k])
        if changed:
            details = ", ".join(f"{k}: saved {saved.get(k)!r}, now {mine[k]!r}" for k in changed)
            raise ValueError(
                f"the sampler state was saved with other settings or another dataset ({details});"
                " resume with the same dataset and data flags, or start a new run"
            )
        self._step = int(state["step"])
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._piece = int(state["piece"])
        self._carry = [DocumentSlice(*map(int, unit)) for unit in state["carry"]]

    @property
    def step(self) -> int:
        """Index of the next step ``next_step()`` returns."""
        return self._step
