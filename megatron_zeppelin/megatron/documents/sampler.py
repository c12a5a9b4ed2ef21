"""Seeded, resumable sampling of whole documents into steps and cost-balanced micro-batches.

A training step takes units (whole documents, or pieces of long ones) from a
``stream.DocumentStream`` until the next one would overrun ``tokens_per_step``: one or more
sources (a Megatron blend), each walked in seeded epochs, interleaved in proportion to their
weights by tokens (see ``stream.py``).

The step's units are then spread over ``num_micro_batches`` micro-batches by **cost**, not by
count: attention grows with ``L^2`` and the linear layers with ``L``, so a micro-batch that
draws all the long documents costs far more than one holding many short ones, and no plan can
repair that. Units are placed longest-cost first on the cheapest micro-batch that still has
room (``micro_batch_capacity``), which keeps every micro-batch within one unit's cost of the
mean. A unit that fits nowhere waits at the head of the next step and is placed first there.

Everything is a pure function of the seed and the state: every rank computes the same batches
without talking to the others, and ``state_dict()`` / ``load_state_dict()`` resume exactly,
every source's place included.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_zeppelin.megatron.documents.stream import (
    LONG_DOCUMENT_POLICIES,
    DocumentSlice,
    DocumentStream,
)

__all__ = [
    "LONG_DOCUMENT_POLICIES",
    "DocumentCost",
    "DocumentSampler",
    "DocumentSlice",
    "StepBatch",
    "balance_by_cost",
]
_STATE_FORMAT = "zeppelin-sampler/2"


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
        """Weights in FLOPs from a ``planner.cost.models.ModelSpec`` (a causal document of ``L``
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
    tokens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    costs = cost(tokens) if tokens.size else np.zeros(0)
    index = np.arange(tokens.size)
    order = np.lexsort((index, -costs, index >= num_first)).tolist()  # last key first
    costs, tokens = np.asarray(costs, dtype=np.float64).tolist(), tokens.tolist()
    bin_cost = [0.0] * num_bins
    bin_tokens = [0] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    left_over = []
    for i in order:
        n, best = tokens[i], -1
        for b in range(num_bins):  # the cheapest that fits; ties to fewer tokens, then index
            if capacity is not None and bin_tokens[b] + n > capacity:
                continue
            if best < 0 or (bin_cost[b], bin_tokens[b]) < (bin_cost[best], bin_tokens[best]):
                best = b
        if best < 0:
            left_over.append(i)
            continue
        bins[best].append(i)
        bin_cost[best] += costs[i]
        bin_tokens[best] += n
    return [sorted(b) for b in bins], sorted(left_over)


class DocumentSampler:
    """Yields ``StepBatch`` objects; see the module docstring.

    ``source_sizes`` and ``weights`` describe a blend (``stream.DocumentStream``); with
    ``num_epochs`` the stream ends after that many epochs of every source, and the steps after
    its end are empty (``exhausted`` says when).
    """

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
        source_sizes: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
        num_epochs: int | None = None,
    ) -> None:
        if tokens_per_step < 1 or num_micro_batches < 1:
            raise ValueError("tokens_per_step and num_micro_batches must be positive")
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
        self.stream = DocumentStream(
            lengths,
            seed=seed,
            max_length=max_length,
            long_documents=long_documents,
            source_sizes=source_sizes,
            weights=weights,
            num_epochs=num_epochs,
        )
        self.lengths = self.stream.lengths
        self.tokens_per_step = int(tokens_per_step)
        self.num_micro_batches = int(num_micro_batches)
        self.micro_batch_capacity = micro_batch_capacity
        self.cost = cost if cost is not None else DocumentCost()
        self._step = 0
        self._carry: list[DocumentSlice] = []

    @property
    def max_length(self) -> int:
        return self.stream.max_length

    def pieces(self, doc: int, *, epoch: int = 0) -> list[DocumentSlice]:
        """The units one document becomes under ``max_length`` and the long-document policy."""
        return self.stream.pieces(doc, epoch=epoch)

    # --- steps -----------------------------------------------------------------------------
    def next_step(self) -> StepBatch:
        """Take the next step's units and balance them over the micro-batches."""
        units = list(self._carry)
        num_carried = len(units)
        total = sum(u.num_tokens for u in units)
        while True:
            # Runs of whole documents in bulk, the rest (a split document, an epoch's end, a
            # blend) one unit at a time: the same units either way.
            whole = self.stream.take_whole(self.tokens_per_step - total)
            units += whole
            total += sum(u.num_tokens for u in whole)
            unit = self.stream.peek()
            if unit is None or total + unit.num_tokens > self.tokens_per_step:
                break
            units.append(self.stream.take())
            total += unit.num_tokens
        bins, left_over = balance_by_cost(
            [u.num_tokens for u in units],
            self.num_micro_batches,
            cost=self.cost,
            capacity=self.micro_batch_capacity,
            num_first=num_carried,
        )
        # Left-over units keep their draw order so the next step is the same after a resume.
        self._carry = [units[i] for i in left_over]
        assert not units or len(left_over) < len(units), "max_length <= capacity: progress"
        batch = StepBatch(
            step=self._step,
            epoch=max((u.epoch for u in units), default=0),
            micro_batches=tuple(tuple(units[i] for i in b) for b in bins),
        )
        self._step += 1
        return batch

    def __iter__(self) -> Iterator[StepBatch]:
        while True:
            yield self.next_step()

    @property
    def exhausted(self) -> bool:
        """Whether every step from here on is empty (only with ``num_epochs``)."""
        return not self._carry and self.stream.peek() is None

    # --- resume ----------------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        return {
            **self.stream.fingerprint(),
            "tokens_per_step": self.tokens_per_step,
            "num_micro_batches": self.num_micro_batches,
            "micro_batch_capacity": self.micro_batch_capacity,
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and lists (safe in a checkpoint): where the stream stands."""
        return {
            "format": _STATE_FORMAT,
            "config": self._fingerprint(),
            "step": self._step,
            "sources": self.stream.state_dict(),
            "carry": [[u.doc, u.start, u.end, u.epoch] for u in self._carry],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``; refuses a state saved with other settings or data."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a sampler state of this version (format {found!r}, expected "
                f"{_STATE_FORMAT!r}, from DocumentSampler.state_dict): resume with the version "
                "that wrote it, or delete the state file to replay the sampler instead"
            )
        saved, mine = state["config"], self._fingerprint()
        changed = sorted(k for k in mine if saved.get(k) != mine[k])
        if changed:
            details = ", ".join(f"{k}: saved {saved.get(k)!r}, now {mine[k]!r}" for k in changed)
            raise ValueError(
                f"the sampler state was saved with other settings or another dataset ({details});"
                " resume with the same dataset and data flags, or start a new run"
            )
        self.stream.load_state_dict(state["sources"])
        self._step = int(state["step"])
        self._carry = [DocumentSlice(*map(int, unit)) for unit in state["carry"]]

    @property
    def step(self) -> int:
        """Index of the next step ``next_step()`` returns."""
        return self._step
