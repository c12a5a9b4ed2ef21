"""Which attention each rank computes at each ring step, precomputed once per plan (pure).

Buffers. A rank's attention buffer holds its query rows in the plan's canonical order
(``plan.attention_ranges``); its K/V rows are the same tokens. The K/V *block* of a document on a
rank is that rank's rows of the document (its spans in listed order, contiguous in the buffer).
At *compute* ``c`` the rank holds, for every document of a ring tier with more than ``c``
members, the block of ring position ``i - c`` (``i`` its own position; ``schedule.py`` has the
ring semantics): compute 0 uses its own buffer (local documents and its own blocks), compute
``c >= 1`` a *held buffer*, the messages received at ring step ``c - 1`` concatenated in message
order (by source rank, then document id).

Masks. Query and key rows carry absolute positions inside their document; causality means key
position <= query position. One query span ``[qs, qe)`` against one key span ``[ks, ke)`` is
fully visible when ``ke - 1 <= qs``, hidden when ``ks > qe - 1`` and cut by the diagonal
otherwise. Kernels (flash-attn's included) only offer "no mask" and "causal aligned to the
bottom-right corner" (query ``i`` of ``lq`` sees key ``j <= i + lk - lq``), so a diagonal span
pair is cut into rows that see no key (dropped), a bottom-right causal band, and rows below the
band that see every key (an unmasked pair). Neighbouring pairs are then joined where the joined
pair has the same mask. Under zigzag (rank ``i`` of ``g`` holds chunks ``i`` and ``2g-1-i``):

    compute 0, own block       causal  chunk i      x chunk i
                               causal  chunk 2g-1-i x (chunk i, chunk 2g-1-i)
    compute c, block j < i     full    (both chunks) x chunk j
    compute c, block j > i     full    chunk 2g-1-i  x (both chunks of j)

so compute 0 is one causal call and every later compute one unmasked call, whatever the number
of documents. Plans that are not zigzag (any spans) work too, with more pairs.

Row indices (``Rows``) are int64 CPU tensors, ``None`` for "every row of the buffer, in order" or
a ``slice`` for a run of consecutive rows, so the common cases need no gather or scatter: under
zigzag every index of a ring step is such a run (one or two chunks, adjacent in the buffer).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from megatron_zeppelin.attention.kernel_api import VarlenBatch
from megatron_zeppelin.planner.plan import Plan, Tier
from megatron_zeppelin.planner.schedule import (
    Message,
    block_tokens,
    gradient_schedule,
    ring_schedule,
)

__all__ = [
    "KernelCall",
    "Pair",
    "RankLayout",
    "RowMove",
    "Rows",
    "TierLayout",
    "block_pairs",
    "compact_rows",
    "kernel_calls",
    "range_rows",
    "rows_of",
]


@dataclass(frozen=True)
class Pair:
    """Query rows ``[q_start, q_end)`` against key rows ``[k_start, k_end)``; ``causal``:
    bottom-right aligned mask, else unmasked."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool


def _span_pairs(qs: int, qe: int, q_row: int, ks: int, ke: int, k_row: int) -> list[Pair]:
    """Kernel pairs for query positions ``[qs, qe)`` at ``q_row`` against keys ``[ks, ke)`` at
    ``k_row``. Key ``c`` (0-based in the span) is visible to query ``r`` iff ``c <= r + shift``."""
    lq, lk, shift = qe - qs, ke - ks, qs - ks
    # A one-key span at the query's own start (shift 0) stays a causal band: it then joins the
    # other diagonal blocks of a zigzag chunk pair instead of forcing an unmasked call.
    if shift >= lk - 1 and shift > 0:
        return [Pair(q_row, q_row + lq, k_row, k_row + lk, False)]
    if shift + lq - 1 < 0:
        return []
    first = max(0, -shift)  # first query that sees a key
    stop = min(lq, lk - shift)  # queries from here on see every key
    band = Pair(q_row + first, q_row + stop, k_row, k_row + stop + shift, True)
    pairs = [band]
    if stop < lq:
        pairs.append(Pair(q_row + stop, q_row + lq, k_row, k_row + lk, False))
    return pairs


def _join(a: Pair, b: Pair) -> Pair | None:
    """``a`` and ``b`` as one pair with the same visibility, or ``None``."""
    same_q = a.q_start == b.q_start and a.q_end == b.q_end
    if not a.causal and same_q and a.k_end == b.k_start:
        # Keys appended after fully visible keys: the mask of ``b`` extends unchanged, since a
        # causal pair always has at least as many keys as queries.
        return Pair(a.q_start, a.q_end, a.k_start, b.k_end, b.causal)
    if not a.causal and not b.causal and a.q_end == b.q_start:
        if (a.k_start, a.k_end) == (b.k_start, b.k_end):
            return Pair(a.q_start, b.q_end, a.k_start, a.k_end, False)
    if a.causal and b.causal and a.q_end == b.q_start and a.k_start == b.k_start:
        # Stacked causal bands share a diagonal when b's keys extend a's by b's query count.
        if b.k_end - a.k_end == b.q_end - b.q_start:
            return Pair(a.q_start, b.q_end, a.k_start, b.k_end, True)
    return None


def block_pairs(
    q_spans: list[tuple[int, int, int]], k_spans: list[tuple[int, int, int]]
) -> list[Pair]:
    """Kernel pairs for one document: query spans ``(start, end, row)`` against key spans."""
    pairs = [p for q in q_spans for k in k_spans for p in _span_pairs(*q, *k)]
    joined = True
    while joined and len(pairs) > 1:
        joined = False
        for i, a in enumerate(pairs):
            for j, b in enumerate(pairs):
                both = _join(a, b) if i != j else None
                if both is not None:
                    pairs = [p for n, p in enumerate(pairs) if n not in (i, j)] + [both]
                    joined = True
                    break
            if joined:
                break
    return sorted(pairs, key=lambda p: (p.q_start, p.k_start))


def rows_of(starts: list[int], ends: list[int]) -> torch.Tensor:
    """Concatenated ``arange(start, end)`` of every range (int64)."""
    starts_np = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(ends, dtype=np.int64) - starts_np
    owner = np.repeat(np.arange(len(starts_np)), lengths)
    first = np.cumsum(lengths) - lengths
    return torch.from_numpy(starts_np[owner] + np.arange(owner.shape[0]) - first[owner])


Rows = torch.Tensor | slice | None
"""Rows of a buffer: ``None`` every row in order, a ``slice`` a run of consecutive rows (taken
as a view), else an int64 index tensor."""


def compact_rows(index: torch.Tensor, num_rows: int) -> Rows:
    """``index`` as ``None`` or a ``slice`` when it is one run of consecutive rows."""
    rows = index.numpy()
    if rows.shape[0] == 0 or not (np.diff(rows) == 1).all():
        return index
    if rows.shape[0] == num_rows and rows[0] == 0:
        return None
    return slice(int(rows[0]), int(rows[-1]) + 1)


def range_rows(starts: list[int], ends: list[int], num_rows: int) -> Rows:
    """``compact_rows(rows_of(starts, ends), num_rows)``, without building the index when the
    ranges join into one run (the common case under zigzag, and a build-time hot spot)."""
    runs = [(a, b) for a, b in zip(starts, ends) if b > a]
    if runs and all(prev[1] == nxt[0] for prev, nxt in zip(runs, runs[1:])):
        first, last = runs[0][0], runs[-1][1]
        return None if (first, last) == (0, num_rows) else slice(first, last)
    return rows_of(starts, ends)


@dataclass
class KernelCall:
    """One varlen kernel call: which query rows and which held K/V rows it packs."""

    batch: VarlenBatch
    q_index: Rows
    k_index: Rows
    q_unique: bool
    """Each query row appears once, so merging needs no scatter-reduce."""


def kernel_calls(pairs: list[Pair], *, num_q_rows: int, num_k_rows: int) -> list[KernelCall]:
    """At most two calls (causal pairs, unmasked pairs) covering ``pairs``.

    A one-query pair has the same mask either way (bottom-right causal lets its single query
    see every key), so it joins whichever call exists, the causal one if both do.
    """
    either = [p.q_end - p.q_start == 1 for p in pairs]
    has_causal = any(p.causal and not e for p, e in zip(pairs, either))
    has_full = any(not p.causal and not e for p, e in zip(pairs, either))
    single_kind = has_causal or not has_full
    kinds = [single_kind if e else p.causal for p, e in zip(pairs, either)]
    calls = []
    for causal in (True, False):
        chosen = [p for p, kind in zip(pairs, kinds) if kind == causal]
        if not chosen:
            continue
        q_index = range_rows([p.q_start for p in chosen], [p.q_end for p in chosen], num_q_rows)
        k_index = range_rows([p.k_start for p in chosen], [p.k_end for p in chosen], num_k_rows)
        batch = VarlenBatch(
            [p.q_end - p.q_start for p in chosen],
            [p.k_end - p.k_start for p in chosen],
            causal=causal,
        )
        # Rows are unique when the pairs' query intervals do not overlap (checked per pair,
        # not per row: a call can cover a hundred thousand rows).
        spans = sorted((p.q_start, p.q_end) for p in chosen)
        unique = all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        calls.append(KernelCall(batch, q_index, k_index, unique))
    return calls


@dataclass(frozen=True)
class RowMove:
    """Add rows ``src`` of a received buffer to rows ``dst`` of a target."""

    src: Rows
    dst: Rows

    @staticmethod
    def of(
        moves: list[tuple[int, int, int]], *, num_src_rows: int, num_dst_rows: int
    ) -> RowMove | None:
        """The move of ``(src row, dst row, length)`` ranges, or ``None`` when there are none."""
        if not moves:
            return None
        src = range_rows([a for a, _, _ in moves], [a + k for a, _, k in moves], num_src_rows)
        dst = range_rows([b for _, b, _ in moves], [b + k for _, b, k in moves], num_dst_rows)
        return RowMove(src, dst)


@dataclass
class TierLayout:
    """One tier's rings as seen from one rank; ``n = num_steps`` ring steps, computes 1..n."""

    tier: Tier
    kv_steps: list[list[Message]]
    """Global K/V messages per step (``schedule.ring_schedule``)."""
    grad_steps: list[list[Message]]
    """Global dK/dV messages per step (``schedule.gradient_schedule``): step ``d`` returns the
    gradient of the blocks held at compute ``d + 1`` one hop on, the last hop reaching the
    block's owner."""
    recv_from: list[list[int]]
    """Per step, the sources of this rank's incoming messages in message order."""
    sends: list[dict[int, Rows]]
    """Per step, destination -> rows of the buffer held at compute ``step`` to send."""
    held_rows: list[int]
    """Rows of the held buffer of compute ``c`` (index ``c``; index 0 unused)."""
    calls: list[list[KernelCall]]
    """Kernel calls of compute ``c`` (index 0 unused)."""
    grad_sends: list[dict[int, Rows]]
    """Per step ``d``, destination -> rows of compute ``d + 1``'s gradient buffer to send."""
    grad_into_held: list[RowMove | None]
    """Per step ``d``, received rows -> rows of compute ``d + 2``'s gradient buffer."""
    grad_into_own: list[RowMove | None]
    """Per step ``d``, received rows -> rows of this rank's own buffer: finished gradients."""

    @property
    def num_steps(self) -> int:
        return len(self.kv_steps)


class RankLayout:
    """Everything one rank needs to run the plan's attention (see the module docstring)."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan = plan
        self.rank = rank
        ranges = plan.attention_ranges(rank)
        self.num_tokens = sum(r.num_tokens for r in ranges)
        # Positions and rows of this rank's block of every document it holds queries of.
        self.own_spans: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        row = 0
        for r in ranges:
            self.own_spans[r.seq].append((r.start, r.end, row))
            row += r.num_tokens
        self.own_rows = {
            seq: (spans[0][2], spans[-1][2] + spans[-1][1] - spans[-1][0])
            for seq, spans in self.own_spans.items()
        }
        self.block_spans: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        self.rings = {seq.id: seq.ring for seq in plan.sequences}
        for seq in plan.sequences:
            for span in seq.attention:
                self.block_spans[(seq.id, span.rank)].append((span.start, span.end))
        own_pairs = [p for seq, spans in self.own_spans.items() for p in block_pairs(spans, spans)]
        self.own_calls = kernel_calls(
            own_pairs, num_q_rows=self.num_tokens, num_k_rows=self.num_tokens
        )
        # Inter-node first: its messages are the slowest, so they are posted first.
        sizes = block_tokens(plan)  # shared by the four schedules below
        self.tiers = [
            t
            for t in (self._tier(Tier.INTER, sizes), self._tier(Tier.INTRA, sizes))
            if t.num_steps > 0
        ]

    @property
    def num_steps(self) -> int:
        return max((t.num_steps for t in self.tiers), default=0)

    def _tier(self, tier: Tier, sizes: dict[tuple[int, int], int]) -> TierLayout:
        me = self.rank
        kv_steps = ring_schedule(self.plan, tiers=(tier,), sizes=sizes)
        grad_steps = gradient_schedule(self.plan, tiers=(tier,), sizes=sizes, kv_steps=kv_steps)
        n = len(kv_steps)
        # Where each (document, origin) block sits in the buffer of compute c.
        where: list[dict[tuple[int, int], int]] = [
            {(seq, me): rows[0] for seq, rows in self.own_rows.items()}
        ]
        recv_from, held_rows, calls = [], [0], [[]]
        for step in kv_steps:
            incoming = [m for m in step if m.dst == me]
            recv_from.append([m.src for m in incoming])
            offsets, pairs, row = {}, [], 0
            for seg in (s for m in incoming for s in m.segments):
                offsets[(seg.seq, seg.origin)] = row
                if seg.seq in self.own_spans and seg.num_tokens:
                    k_spans, k_row = [], row
                    for s, e in self.block_spans[(seg.seq, seg.origin)]:
                        k_spans.append((s, e, k_row))
                        k_row += e - s
                    pairs += block_pairs(self.own_spans[seg.seq], k_spans)
                row += seg.num_tokens
            where.append(offsets)
            held_rows.append(row)
            calls.append(kernel_calls(pairs, num_q_rows=self.num_tokens, num_k_rows=row))

        def outgoing(messages: list[Message], at: int) -> dict[int, Rows]:
            num_rows = self.num_tokens if at == 0 else held_rows[at]
            sends = {}
            for m in (m for m in messages if m.src == me):
                segs = [s for s in m.segments if s.num_tokens]
                starts = [where[at][(s.seq, s.origin)] for s in segs]
                ends = [a + s.num_tokens for a, s in zip(starts, segs)]
                sends[m.dst] = range_rows(starts, ends, num_rows)
            return sends

        sends = [outgoing(step, s) for s, step in enumerate(kv_steps)]
        grad_sends = [outgoing(step, d + 1) for d, step in enumerate(grad_steps)]
        grad_into_held: list[RowMove | None] = []
        grad_into_own: list[RowMove | None] = []
        for d, step in enumerate(grad_steps):
            # (received row, target row, length) per segment, for each of the two targets.
            into_held: list[tuple[int, int, int]] = []
            into_own: list[tuple[int, int, int]] = []
            row = 0
            for seg in (s for m in step if m.dst == me for s in m.segments):
                if not seg.num_tokens:
                    continue
                if seg.origin == me:  # the last hop: the gradient of this rank's own block
                    into_own.append((row, self.own_rows[seg.seq][0], seg.num_tokens))
                else:
                    assert d + 2 <= n, "a gradient still travelling after the last compute"
                    into_held.append((row, where[d + 2][(seg.seq, seg.origin)], seg.num_tokens))
                row += seg.num_tokens
            held_target = held_rows[d + 2] if d + 2 <= n else 0
            grad_into_held.append(RowMove.of(into_held, num_src_rows=row, num_dst_rows=held_target))
            grad_into_own.append(
                RowMove.of(into_own, num_src_rows=row, num_dst_rows=self.num_tokens)
            )
        return TierLayout(
            tier,
            kv_steps,
            grad_steps,
            recv_from[:n],
            sends,
            held_rows,
            calls,
            grad_sends,
            grad_into_held,
            grad_into_own,
        )
