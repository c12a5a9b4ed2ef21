"""The stream of document units a sampler draws from: one or more sources, in seeded epochs.

A *source* is one dataset's documents (of one split); a blend has several. Each source walks
its own documents in epochs, one permutation per epoch drawn from the seed, the epoch and the
source's index (the first source from the seed and the epoch only, so a single dataset keeps
one order whether or not it is written as a blend). A document longer than ``max_length`` is
cut into near-equal pieces of at most ``max_length`` tokens (``long_documents="split"``) or
keeps only its first ``max_length`` tokens (``"truncate"``); empty documents are skipped.

Sources are interleaved by **tokens**, the way Megatron's ``BlendedDataset`` interleaves
samples of ``--seq-length`` tokens (``helpers.cpp``, ``build_blending_indices``): the next
unit comes from the source furthest behind its share, ``weight * max(T, 1) - tokens`` with
``T`` the tokens drawn from all sources so far (ties to the first source). Whole documents
keep every source within one unit of its share of the tokens drawn. A source of weight 0 is
never drawn.

With ``num_epochs`` the stream ends once every source has walked that many epochs (a full
pass over a validation split); without, it never ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LONG_DOCUMENT_POLICIES = ("split", "truncate")


@dataclass(frozen=True, slots=True)  # thousands per step: no instance dict each
class DocumentSlice:
    """Tokens ``[start, end)`` of document ``doc``; one planned sequence."""

    doc: int
    start: int
    end: int
    epoch: int = field(default=0, compare=False)
    """Epoch of its source the slice was drawn in (for logs and checks; not its identity)."""

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class _Cursor:
    """Where one source stands: piece ``piece`` of document ``order(epoch)[position]``."""

    epoch: int = 0
    position: int = 0
    piece: int = 0
    tokens: int = 0
    """Tokens drawn from the source so far."""


class DocumentStream:
    """Units (``DocumentSlice``) of ``lengths`` in draw order; see the module docstring.

    ``lengths`` lists the documents of every source back to back, ``source_sizes`` how many
    belong to each source (default: one source), ``weights`` each source's share of the tokens
    (default: its own share of the tokens, as Megatron blends prefixes given without weights).
    Document ids in the slices index ``lengths``.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        seed: int,
        max_length: int,
        long_documents: str = "split",
        source_sizes: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
        num_epochs: int | None = None,
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or (self.lengths < 0).any():
            raise ValueError("document lengths must be a flat list of non-negative integers")
        if not (self.lengths > 0).any():
            raise ValueError("the dataset has no non-empty document to sample")
        if long_documents not in LONG_DOCUMENT_POLICIES:
            raise ValueError(
                f"long_documents must be one of {LONG_DOCUMENT_POLICIES}, got {long_documents!r}"
            )
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be positive or None, got {num_epochs}")
        sizes = [self.lengths.shape[0]] if source_sizes is None else [int(s) for s in source_sizes]
        if not sizes or min(sizes) < 0 or sum(sizes) != self.lengths.shape[0]:
            raise ValueError(
                f"source sizes {sizes} must be non-negative and add up to the "
                f"{self.lengths.shape[0]} documents"
            )
        self.offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        tokens = [int(self.lengths[a:b].sum()) for a, b in zip(self.offsets, self.offsets[1:])]
        self.weights = _normalized(tokens if weights is None else weights, len(sizes))
        for k, (w, n) in enumerate(zip(self.weights, tokens)):
            if w > 0 and n == 0:
                raise ValueError(
                    f"source {k} has weight {w:g} but no document with tokens in it: give it "
                    "weight 0 or a dataset with documents"
                )
        self.seed = int(seed)
        self.max_length = int(max_length)
        self.long_documents = long_documents
        self.num_epochs = num_epochs
        self._cursors = [_Cursor() for _ in sizes]
        self._drawn = 0
        """Tokens drawn from all sources."""
        self._peeked: tuple[int | None, DocumentSlice | None] | None = None
        """The next source and unit, once looked at (until taken)."""
        self._orders: dict[int, tuple[int, np.ndarray]] = {}
        self._units: dict[int, tuple[tuple[int, int], list[DocumentSlice]]] = {}

    @property
    def num_sources(self) -> int:
        return len(self._cursors)

    # --- one source ------------------------------------------------------------------------
    def epoch_order(self, source: int, epoch: int) -> np.ndarray:
        """Document ids of one source's epoch: a permutation drawn from the seed, the epoch and
        the source (the first source: the seed and the epoch only)."""
        cached = self._orders.get(source)
        if cached is None or cached[0] != epoch:
            key = [self.seed, epoch] if source == 0 else [self.seed, epoch, source]
            rng = np.random.default_rng(np.random.SeedSequence(key))
            size = int(self.offsets[source + 1] - self.offsets[source])
            self._orders[source] = (epoch, self.offsets[source] + rng.permutation(size))
        return self._orders[source][1]

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

    def _head(self, source: int) -> DocumentSlice | None:
        """The unit under a source's cursor, moving past empty documents; ``None`` once the
        source has walked ``num_epochs`` epochs."""
        cursor = self._cursors[source]
        while self.num_epochs is None or cursor.epoch < self.num_epochs:
            order = self.epoch_order(source, cursor.epoch)
            if cursor.position >= order.shape[0]:
                cursor.epoch, cursor.position, cursor.piece = cursor.epoch + 1, 0, 0
                continue
            key = (cursor.epoch, cursor.position)
            cached = self._units.get(source)
            if cached is None or cached[0] != key:
                cached = (key, self.pieces(int(order[cursor.position]), epoch=cursor.epoch))
                self._units[source] = cached  # a split document is looked at once per piece
            if cursor.piece < len(cached[1]):
                return cached[1][cursor.piece]
            cursor.position, cursor.piece = cursor.position + 1, 0
        return None

    # --- the blend ---------------------------------------------------------------------------
    def _next(self) -> tuple[int | None, DocumentSlice | None]:
        """The source furthest behind its share of the tokens (Megatron's blending rule) and
        its next unit; ``(None, None)`` once every source has ended."""
        if len(self._cursors) == 1:
            head = self._head(0)
            return (None, None) if head is None else (0, head)
        drawn = max(self._drawn, 1)
        best, best_error = (None, None), 0.0
        for k, (weight, cursor) in enumerate(zip(self.weights, self._cursors)):
            if weight <= 0:
                continue
            head = self._head(k)
            error = weight * drawn - cursor.tokens
            if head is not None and (best[0] is None or error > best_error):
                best, best_error = (k, head), error
        return best

    def peek(self) -> DocumentSlice | None:
        """The next unit, without taking it; ``None`` when the stream has ended."""
        if self._peeked is None:
            self._peeked = self._next()
        return self._peeked[1]

    def take(self) -> DocumentSlice | None:
        """The next unit, taken."""
        unit = self.peek()
        source, self._peeked = self._peeked[0], None
        if unit is None:
            return None
        cursor = self._cursors[source]
        cursor.piece += 1
        cursor.tokens += unit.num_tokens
        self._drawn += unit.num_tokens
        return unit

    def take_whole(self, budget: int) -> list[DocumentSlice]:
        """Whole documents taken while their tokens add up to at most ``budget``: what ``take``
        one unit at a time gives, stopping before the first that does not fit, where that is a
        run of whole documents of one source's current epoch (one source, nothing peeked,
        documents of ``1..max_length`` tokens); otherwise fewer, or none (``take`` the rest).
        Leaves the stream as those ``take`` calls would: the last document's cursor past its
        one piece."""
        if len(self._cursors) != 1 or self._peeked is not None:
            return []
        cursor, taken = self._cursors[0], []
        if self.num_epochs is not None and cursor.epoch >= self.num_epochs:
            return []
        order = self.epoch_order(0, cursor.epoch)
        start = cursor.position
        if cursor.piece:  # past the document under the cursor only if it was whole
            if not 0 < self.lengths[order[start]] <= self.max_length or cursor.piece != 1:
                return []
            start += 1
        window = 1024
        while start < order.shape[0] and budget > 0:
            docs = order[start : start + window]
            lengths = self.lengths[docs]
            whole = np.flatnonzero((lengths == 0) | (lengths > self.max_length))
            stop = int(whole[0]) if whole.size else docs.shape[0]
            fit = int(np.searchsorted(np.cumsum(lengths[:stop]), budget, side="right"))
            if fit:
                tokens = int(lengths[:fit].sum())
                epochs = [cursor.epoch] * fit
                taken += map(
                    DocumentSlice, docs[:fit].tolist(), [0] * fit, lengths[:fit].tolist(), epochs
                )
                cursor.position, cursor.piece = start + fit - 1, 1
                cursor.tokens += tokens
                self._drawn += tokens
                budget -= tokens
            if fit < docs.shape[0] or stop < docs.shape[0]:
                break
            start, window = start + fit, 2 * window
        return taken

    # --- resume ------------------------------------------------------------------------------
    def fingerprint(self) -> dict[str, Any]:
        """What the stream's state is only valid for."""
        sizes = np.diff(self.offsets)
        return {
            "seed": self.seed,
            "source_documents": [int(n) for n in sizes],
            "source_tokens": [
                int(self.lengths[a:b].sum()) for a, b in zip(self.offsets, self.offsets[1:])
            ],
            "weights": list(self.weights),
            "max_length": self.max_length,
            "long_documents": self.long_documents,
            "num_epochs": self.num_epochs,
        }

    def state_dict(self) -> list[list[int]]:
        """Per source: ``[epoch, position, piece, tokens]``."""
        return [[c.epoch, c.position, c.piece, c.tokens] for c in self._cursors]

    def load_state_dict(self, state: Sequence[Sequence[int]]) -> None:
        if len(state) != len(self._cursors):
            raise ValueError(
                f"the stream state has {len(state)} sources, this stream {len(self._cursors)}"
            )
        self._cursors = [_Cursor(*map(int, cursor)) for cursor in state]
        self._drawn = sum(c.tokens for c in self._cursors)
        self._peeked = None


def _normalized(weights: Sequence[float], num_sources: int) -> tuple[float, ...]:
    """Weights as shares summing to 1 (numpy float64, as Megatron normalizes a blend)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (num_sources,):
        raise ValueError(f"{w.size} weights given for {num_sources} sources")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(
            f"source weights {list(weights)} must be finite, non-negative and not all zero"
        )
    return tuple(float(x) for x in w / w.sum())
