"""What one rank needs to run a plan's 2-D documents, precomputed once per plan (pure).

The scheme is ``planner/plan/heads.py``'s; here is what it means for one rank's buffers. Rank
``(i, j)`` (node ``i`` of the document's ring, local GPU ``j``) holds a 2-D document twice:

    token buffer (layout.RankLayout)             head buffer (this module)
    rows: its piece of node i's tokens           rows: all of node i's tokens of the document,
          (the plan's attention spans)                 chunk i then chunk 2n-1-i
    heads: all H query heads, all K/V heads      heads: group j's query heads and K/V heads

A rank's head buffer lists its 2-D documents by id, each as the rank's spans in the head plan
(``heads.head_plan``); the column rings run on it with an ordinary ``RankLayout`` of the head
plan (``ring``), so their masks are the zigzag ones of ``layout.py`` for a ring of ``n``:

    compute 0         causal   chunks (i, 2n-1-i) of the node x themselves
    ring step, j < i  full     both chunks x node j's chunks    (keys all earlier)
    ring step, j > i  full     chunk 2n-1-i x node j's chunks   (chunk i sees none of them)

Where rows go (``HeadExchange``). To the head layout, every rank of a node sends each other rank
of the node its own tokens of the document with the receiver's heads, and keeps its own tokens
with its own heads; the receiver writes them at the rows of those tokens in its head buffer.
Back to the token layout, every rank sends each other rank that rank's tokens with the sender's
heads; the receiver writes them into its token buffer at the sender's heads. Gradients go the
same way: dO to the head layout; dQ, dK, dV back, where a replicated K/V head's dK and dV from
several ranks are summed into the token that owns it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from megatron_zeppelin.attention.layout import RankLayout, Rows, range_rows
from megatron_zeppelin.comm.heads import HeadExchange
from megatron_zeppelin.planner.plan.heads import head_plan
from megatron_zeppelin.planner.plan.plan import Plan
from megatron_zeppelin.planner.plan.schedule import Message, exchange_messages

__all__ = ["HeadLayout"]


Span3 = tuple[int, int, int]
"""Positions ``[start, end)`` of a document at ``row`` of a buffer (``RankLayout.own_spans``)."""
Runs = list[tuple[int, int]]
"""Runs of rows of a buffer: ``(first row, number of rows)``."""


def _rows(runs: Runs, num_rows: int) -> Rows:
    return range_rows([r for r, _ in runs], [r + n for r, n in runs], num_rows)


class HeadLayout:
    """A rank's head buffer, its column rings and both directions of the head all-to-all."""

    def __init__(self, plan: Plan, tokens: RankLayout) -> None:
        heads = head_plan(plan)
        if heads is None:
            raise ValueError(f"plan {plan.name!r} has no 2-D documents")
        self.rank = tokens.rank
        self.num_groups = heads.num_groups
        self.group = plan.topology.local_of(self.rank)
        self.ring = RankLayout(heads.plan, self.rank, routes=plan.route_index)
        """The column rings on the head buffer (a column edge the plan routes is sent like any
        message on it: the exchanger routes by the plan's edges)."""
        self.num_rows = self.ring.num_tokens
        self._tokens = tokens
        self._head_spans: dict[int, list[Span3]] = {
            heads.document[vid]: spans for vid, spans in self.ring.own_spans.items()
        }
        mine = sorted(seq for seq in tokens.two_d if seq in tokens.own_spans)
        keep_tokens = [r for seq in mine for r in self._token_runs(seq)]
        keep_heads = [r for seq in mine for r in self._head_runs(seq, self.rank)]
        keep = None
        if keep_tokens:
            keep = (_rows(keep_tokens, tokens.num_tokens), _rows(keep_heads, self.num_rows))
        self.to_heads = self._exchange(
            exchange_messages(plan, to_heads=True, rank=self.rank),
            send=lambda seq, dst: self._token_runs(seq),
            receive=lambda seq, src: self._head_runs(seq, src),
            keep=keep,
            num_rows=(tokens.num_tokens, self.num_rows),
        )
        """Token layout -> head layout (Q, K, V forward; dO backward)."""
        self.to_tokens = self._exchange(
            exchange_messages(plan, to_heads=False, rank=self.rank),
            send=lambda seq, dst: self._head_runs(seq, dst),
            receive=lambda seq, src: self._token_runs(seq),
            keep=(keep[1], keep[0]) if keep is not None else None,
            num_rows=(self.num_rows, tokens.num_tokens),
        )
        """Head layout -> token layout (the output forward; dQ, dK, dV backward)."""

    @property
    def num_steps(self) -> int:
        return self.ring.num_steps

    def windowed(self, window: int | None) -> HeadLayout:
        """This layout with the column rings' queries seeing only the ``window`` key positions
        before their own (``RankLayout.windowed``); the exchanges stay the same."""
        if window == self.ring.window:
            return self
        other = copy.copy(self)
        other.ring = self.ring.windowed(window)
        return other

    def _token_runs(self, seq: int) -> Runs:
        """This rank's rows of document ``seq`` in its token buffer."""
        return [(row, e - s) for s, e, row in self._tokens.own_spans[seq]]

    def _head_runs(self, seq: int, rank: int) -> Runs:
        """The rows of ``rank``'s tokens of document ``seq`` in this rank's head buffer (both
        on one node: each of ``rank``'s spans lies inside one of the node's chunks)."""
        buffer = self._head_spans[seq]
        runs = []
        for a, b in self._tokens.block_spans[(seq, rank)]:
            row = next(r + a - s for s, e, r in buffer if s <= a and b <= e)
            runs.append((row, b - a))
        return runs

    def _exchange(
        self,
        messages: list[Message],
        *,
        send: Callable[[int, int], Runs],
        receive: Callable[[int, int], Runs],
        keep: tuple[Rows, Rows] | None,
        num_rows: tuple[int, int],
    ) -> HeadExchange:
        """The exchange of ``messages``: ``send(seq, dst)`` the runs of the source buffer one
        segment sends, ``receive(seq, src)`` the runs of the target buffer it fills;
        ``num_rows``: rows of the source and of the target buffer."""
        me = self.rank
        sends = {
            m.dst: _rows([r for g in m.segments for r in send(g.seq, m.dst)], num_rows[0])
            for m in messages
            if m.src == me
        }
        receives = [
            (m.src, _rows([r for g in m.segments for r in receive(g.seq, m.src)], num_rows[1]))
            for m in messages
            if m.dst == me
        ]
        return HeadExchange(messages, sends, receives, keep)
