"""Which attention each rank computes at each ring step, precomputed once per plan (pure).

Buffers. A rank's attention buffer holds its query rows in the plan's canonical order
(``plan.attention_ranges``); its K/V rows are the same tokens. The K/V *block* of a document on a
rank is that rank's rows of the document (its spans in listed order, contiguous in the buffer).
A tier's rings are a list of ``RingStep`` records, one per ring step: step ``s`` brings, for
every document of the tier with more than ``s + 1`` ring members, the block of ring position
``i - s - 1`` (``i`` the rank's own position; ``schedule.py`` has the ring semantics). What a
step brings is its *held buffer*: the incoming messages concatenated in message order (by
source rank, then document id). Compute 0 uses the rank's own buffer (local documents and its
own blocks); the compute of step ``s`` uses the held buffer of step ``s``, and the gradient of
that buffer travels back in the same step of the backward.

Masks: which pairs of query and key rows a kernel call computes, and with which mask, is
``pairs.py``'s; the calls of a block are one varlen call per kind of pair (``kernel_calls``).
Under zigzag (rank ``i`` of ``g`` holds chunks ``i`` and ``2g-1-i``) compute 0 is one causal call
and every ring step's compute one unmasked call, whatever the number of documents; with a
sliding window up to four. ``RankLayout.windowed`` derives a layout's calls for another window
from the same schedule (Megatron's ``--window-attn-skip-freq`` mixes windowed and full layers in
one model).

Row indices (``Rows``) are int64 CPU tensors, ``None`` for "every row of the buffer, in order" or
a ``slice`` for a run of consecutive rows, so the common cases need no gather or scatter: under
zigzag every index of a ring step is such a run (one or two chunks, adjacent in the buffer).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from megatron_zeppelin.attention.kernels.kernel_api import VarlenBatch
from megatron_zeppelin.attention.pairs import Pair, block_pairs
from megatron_zeppelin.planner.plan.plan import Plan, Route, Tier
from megatron_zeppelin.planner.plan.schedule import Message, gradient_schedule, ring_schedule

__all__ = [
    "KernelCall",
    "RankLayout",
    "RingStep",
    "RowMove",
    "Rows",
    "TierLayout",
    "compact_rows",
    "kernel_calls",
    "range_rows",
    "rows_of",
]


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
    q_groups: tuple[torch.Tensor, torch.Tensor] | None = None
    """Where rows repeat: the distinct query rows and each row's place among them
    (``merge.merge_rows_``'s ``groups``), found here so that no layer has to."""


def kernel_calls(pairs: list[Pair], *, num_q_rows: int, num_k_rows: int) -> list[KernelCall]:
    """One call per kind of pair (``Pair.kind``) covering ``pairs``: at most two without a
    window (causal pairs, unmasked pairs), up to four with one.

    A one-query pair without a window has the same mask either way (bottom-right causal lets
    its single query see every key), so it joins whichever of those two calls exists, the
    causal one if both do.
    """
    either = [p.window is None and p.q_end - p.q_start == 1 for p in pairs]
    has_causal = any(p.kind == (True, None) and not e for p, e in zip(pairs, either))
    has_full = any(p.kind == (False, None) and not e for p, e in zip(pairs, either))
    single_kind = (has_causal or not has_full, None)
    kinds = [single_kind if e else p.kind for p, e in zip(pairs, either)]
    calls = []
    # Plain calls first, then the windowed ones (causal before unmasked).
    for causal, window in sorted(set(kinds), key=lambda k: (k[1] is not None, not k[0])):
        chosen = [p for p, kind in zip(pairs, kinds) if kind == (causal, window)]
        q_index = range_rows([p.q_start for p in chosen], [p.q_end for p in chosen], num_q_rows)
        k_index = range_rows([p.k_start for p in chosen], [p.k_end for p in chosen], num_k_rows)
        batch = VarlenBatch(
            [p.q_end - p.q_start for p in chosen],
            [p.k_end - p.k_start for p in chosen],
            causal=causal,
            window=window,
        )
        # Rows are unique when the pairs' query intervals do not overlap (checked per pair,
        # not per row: a call can cover a hundred thousand rows).
        spans = sorted((p.q_start, p.q_end) for p in chosen)
        unique = all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        groups = None
        if not unique:
            touched, inverse = np.unique(q_index.numpy(), return_inverse=True)
            groups = (torch.from_numpy(touched), torch.from_numpy(inverse.reshape(-1)))
        calls.append(KernelCall(batch, q_index, k_index, unique, groups))
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


@dataclass(frozen=True)
class RingStep:
    """Ring step ``index`` of one tier as one rank sees it, and the compute that uses it.

    Forward: the step carries K/V blocks one hop on. This rank sends rows of the buffer it held
    before the step (its own buffer at step 0, else the previous step's held buffer) and
    receives the step's *held buffer*, against which ``calls`` run. Backward: the same K/V
    travel again, and after ``calls`` the held buffer's gradient goes back one hop on the same
    edges (``grad``). What this rank receives of it belongs either to the next step's held
    buffer (a block still on its way home: add it, pass it on) or to its own buffer (the last
    hop: a finished dK/dV).
    """

    index: int
    kv: list[Message]
    """The step's K/V messages this rank sends, receives or relays (``schedule.ring_schedule``
    with its ``rank``), in the order of every rank's."""
    recv_from: list[int]
    """Sources of this rank's incoming messages in message order (K/V and dK/dV alike: a
    gradient message travels the edge of the K/V message with the same index)."""
    sends: dict[int, Rows]
    """Destination -> rows of the buffer held before the step."""
    held_rows: int
    """Rows of the held buffer: the incoming K/V messages concatenated in message order."""
    calls: list[KernelCall]
    """This rank's queries against the held buffer."""
    grad: list[Message]
    """The dK/dV messages of ``kv``'s edges (``schedule.gradient_schedule``)."""
    grad_sends: dict[int, Rows]
    """Destination -> rows of the held buffer's gradient."""
    grad_to_next: RowMove | None
    """Gradient rows received in this step -> rows of the next step's held-buffer gradient."""
    grad_to_own: RowMove | None
    """Gradient rows received in this step -> rows of this rank's own buffer (finished)."""


@dataclass(frozen=True)
class TierLayout:
    """One tier's rings as seen from one rank: its ring steps in order."""

    tier: Tier
    steps: list[RingStep]
    held: tuple[_Held, ...] = ()
    """Each step's held buffer, from which ``RankLayout.windowed`` derives the step's calls
    for another window."""

    @property
    def num_steps(self) -> int:
        return len(self.steps)


@dataclass(frozen=True)
class _Held:
    """A held buffer: its sources, rows, where each block starts, and the calls against it."""

    recv_from: list[int]
    num_rows: int
    where: dict[tuple[int, int], int]
    """(document, block owner) -> first row."""
    calls: list[KernelCall]
    blocks: tuple[tuple[int, int, int], ...] = ()
    """(document, block owner, first row) of the blocks this rank has queries of."""


class RankLayout:
    """Everything one rank needs to run the plan's attention (see the module docstring), for
    queries that see every earlier key of their document or, with ``window``, the ``window``
    key positions before their own."""

    def __init__(
        self,
        plan: Plan,
        rank: int,
        *,
        window: int | None = None,
        routes: Mapping[tuple[int, int], Route] | None = None,
    ) -> None:
        """``routes``: the ring edges' routes the exchanger sends by (``plan.route_index`` by
        default); the messages this rank relays over them are in its steps too."""
        if window is not None and window < 0:
            raise ValueError(f"an attention window counts key positions, got {window}")
        self.plan = plan
        self.rank = rank
        self.window = window
        # Only the documents this rank holds a block of: at a thousand GPUs the rest of the
        # plan is a thousand times more (its spans lie on its ring, ``plan_checks``).
        mine = [seq for seq in plan.sequences if rank in seq.ring]
        # Positions and rows of this rank's block of every document it holds queries of, in
        # the attention buffer's order (``Plan.attention_ranges``: by id, spans as listed).
        self.own_spans: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        self.block_spans: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        row = 0
        for seq in mine:
            for span in seq.attention:
                self.block_spans[(seq.id, span.rank)].append((span.start, span.end))
                if span.rank == rank:
                    self.own_spans[seq.id].append((span.start, span.end, row))
                    row += span.end - span.start
        self.num_tokens = row
        self.own_rows = {
            seq: (spans[0][2], spans[-1][2] + spans[-1][1] - spans[-1][0])
            for seq, spans in self.own_spans.items()
        }
        # 2-D documents' attention runs on the head layout (``head_layout.py``). The other
        # documents between two of them make one run of rows: one set of calls per run takes
        # its rows as views instead of gathering around the 2-D rows.
        self.two_d = frozenset(seq.id for seq in mine if seq.is_two_d)
        self.own_calls = self._own_calls()
        # Inter-node first: its messages are the slowest, so they are posted first. Each step
        # lists the messages this rank sends, receives or relays: the exchanger acts on no
        # other, and the rest of a thousand GPUs' schedule would cost the host every layer.
        routes = plan.route_index if routes is None else routes
        self.tiers = [
            t
            for t in (self._tier(Tier.INTER, routes), self._tier(Tier.INTRA, routes))
            if t.num_steps > 0
        ]

    @property
    def num_steps(self) -> int:
        return max((t.num_steps for t in self.tiers), default=0)

    def windowed(self, window: int | None) -> RankLayout:
        """This layout with every query seeing only the ``window`` key positions before its own
        (``None``: all of them): the same ring schedule, its calls derived again."""
        if window == self.window:
            return self
        if window is not None and window < 0:
            raise ValueError(f"an attention window counts key positions, got {window}")
        other = copy.copy(self)
        other.window = window
        other.own_calls = other._own_calls()
        other.tiers = []
        for tier in self.tiers:
            held = tuple(replace(h, calls=other._calls(h.blocks, h.num_rows)) for h in tier.held)
            steps = [replace(step, calls=h.calls) for step, h in zip(tier.steps, held)]
            other.tiers.append(TierLayout(tier.tier, steps, held))
        return other

    def _own_calls(self) -> list[KernelCall]:
        """Compute 0's calls: local documents and this rank's own blocks. 2-D documents'
        attention runs on the head layout (``head_layout.py``); the other documents between
        two of them make one run of rows, and one set of calls per run takes its rows as views
        instead of gathering around the 2-D rows."""
        runs: list[list[Pair]] = [[]]
        for seq, spans in self.own_spans.items():
            if seq in self.two_d:
                runs.append([])
            else:
                runs[-1] += block_pairs(spans, spans, self.window)
        rows = self.num_tokens
        return [
            call
            for pairs in runs
            if pairs
            for call in kernel_calls(pairs, num_q_rows=rows, num_k_rows=rows)
        ]

    def _tier(self, tier: Tier, routes: Mapping[tuple[int, int], Route]) -> TierLayout:
        kv_steps = ring_schedule(self.plan, tiers=(tier,), rank=self.rank, routes=routes)
        grad_steps = gradient_schedule(self.plan, tiers=(tier,), kv_steps=kv_steps)
        own = _Held(
            [],
            self.num_tokens,
            {(seq, self.rank): rows[0] for seq, rows in self.own_rows.items()},
            [],
        )
        held = [self._held(messages) for messages in kv_steps]
        steps = []
        for s, (kv, grad) in enumerate(zip(kv_steps, grad_steps)):
            following = held[s + 1] if s + 1 < len(held) else None
            to_next, to_own = self._grad_moves(grad, following)
            steps.append(
                RingStep(
                    index=s,
                    kv=kv,
                    recv_from=held[s].recv_from,
                    sends=self._outgoing(kv, held[s - 1] if s else own),
                    held_rows=held[s].num_rows,
                    calls=held[s].calls,
                    grad=grad,
                    grad_sends=self._outgoing(grad, held[s]),
                    grad_to_next=to_next,
                    grad_to_own=to_own,
                )
            )
        return TierLayout(tier, steps, tuple(held))

    def _held(self, messages: list[Message]) -> _Held:
        """The buffer ``messages`` bring this rank, and this rank's calls against it."""
        incoming = [m for m in messages if m.dst == self.rank]
        where, blocks, row = {}, [], 0
        for seg in (s for m in incoming for s in m.segments):
            where[(seg.seq, seg.origin)] = row
            if seg.seq in self.own_spans and seg.num_tokens:
                blocks.append((seg.seq, seg.origin, row))
            row += seg.num_tokens
        calls = self._calls(blocks, row)
        return _Held([m.src for m in incoming], row, where, calls, tuple(blocks))

    def _calls(self, blocks, num_rows: int) -> list[KernelCall]:  # noqa: ANN001
        """This rank's calls against a held buffer of ``num_rows`` rows holding ``blocks``
        (``_Held.blocks``)."""
        pairs = []
        for seq, origin, row in blocks:
            k_spans = []
            for s, e in self.block_spans[(seq, origin)]:
                k_spans.append((s, e, row))
                row += e - s
            pairs += block_pairs(self.own_spans[seq], k_spans, self.window)
        return kernel_calls(pairs, num_q_rows=self.num_tokens, num_k_rows=num_rows)

    def _outgoing(self, messages: list[Message], source: _Held) -> dict[int, Rows]:
        """Destination -> rows of ``source`` this rank sends in ``messages``."""
        sends = {}
        for m in (m for m in messages if m.src == self.rank):
            segs = [s for s in m.segments if s.num_tokens]
            starts = [source.where[(s.seq, s.origin)] for s in segs]
            ends = [a + s.num_tokens for a, s in zip(starts, segs)]
            sends[m.dst] = range_rows(starts, ends, source.num_rows)
        return sends

    def _grad_moves(
        self, messages: list[Message], following: _Held | None
    ) -> tuple[RowMove | None, RowMove | None]:
        """Where the gradient rows this rank receives in ``messages`` go: into ``following``
        (the next step's held buffer, still travelling) or home into its own buffer."""
        to_next: list[tuple[int, int, int]] = []  # (received row, target row, length)
        to_own: list[tuple[int, int, int]] = []
        row = 0
        for seg in (s for m in messages if m.dst == self.rank for s in m.segments):
            if not seg.num_tokens:
                continue
            if seg.origin == self.rank:  # the last hop: the gradient of this rank's own block
                to_own.append((row, self.own_rows[seg.seq][0], seg.num_tokens))
            else:
                assert following is not None, "a gradient still travelling after the last compute"
                to_next.append((row, following.where[(seg.seq, seg.origin)], seg.num_tokens))
            row += seg.num_tokens
        num_next = following.num_rows if following is not None else 0
        return (
            RowMove.of(to_next, num_src_rows=row, num_dst_rows=num_next),
            RowMove.of(to_own, num_src_rows=row, num_dst_rows=self.num_tokens),
        )
