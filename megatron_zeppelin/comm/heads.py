"""The 2-D scheme's head all-to-all: 2-D documents between the token and the head layout.

Inside each node the ranks of a 2-D document swap heads for tokens (``attention/head_layout.py``
has the picture and ``HeadExchange`` the rows). The all-to-all is posted as the point-to-point
messages of ``schedule.exchange_messages`` through the ring's exchanger, which is how NCCL runs
an all-to-all anyway (grouped sends and receives on the node's communicator); so it shares the
ring's tags, timeouts, errors that name the exchange, and byte counters. Its messages never
leave the node, so routing never touches them. Every rank of the plan starts every head
exchange, in the same order as the ring's, whether or not it sends anything (the exchanger's
point-to-point tags are handed out in program order).

A message's rows are the chosen rows of several tensors, each cut to a head range (the
receiver's group to the head layout, the sender's back), side by side along the head dim:
``(t, heads of all the ranges, d)``. Letters: t rows, n heads, d head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_zeppelin.comm.protocol import Exchanger, Pending
from megatron_zeppelin.planner.schedule import Message

__all__ = ["HeadAllToAll", "HeadExchange", "HeadRanges"]

Rows = torch.Tensor | slice | None
"""Rows of a buffer as the attention layouts give them (``attention.layout.Rows``): every row,
a run of rows, or an int64 index."""


@dataclass(frozen=True)
class HeadExchange:
    """One direction of the head all-to-all as one rank sees it (``attention.head_layout``)."""

    messages: list[Message]
    """Every rank's messages (``schedule.exchange_messages``), in global order."""
    sends: dict[int, Rows]
    """Destination -> rows of the source buffer it receives."""
    receives: list[tuple[int, Rows]]
    """Per incoming message in message order: its source and the rows of the target buffer its
    rows fill."""
    keep: tuple[Rows, Rows] | None
    """This rank's own part: rows of the source buffer -> rows of the target buffer."""


HeadRanges = Callable[[int], Sequence[tuple[int, int]]]
"""Head group -> one ``[start, end)`` head range per tensor."""


def _take(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    if rows is None:
        return x
    if isinstance(rows, slice):
        return x[rows]
    return x.index_select(0, rows.to(x.device))


def _pack(sources: Sequence[torch.Tensor], rows: Rows, ranges: Sequence[tuple[int, int]]):  # noqa: ANN202
    """``rows`` of every source, each cut to its head range, side by side along the heads."""
    return torch.cat([_take(x, rows)[:, a:b] for x, (a, b) in zip(sources, ranges)], dim=1)


def _write(target: torch.Tensor, rows: Rows, part: torch.Tensor, *, add: bool) -> None:
    """``target[rows] = part`` (or ``+=``), in place; ``target`` may be a view."""
    part = part.to(target.dtype)
    if rows is None or isinstance(rows, slice):
        view = target if rows is None else target[rows]
        if add:
            view.add_(part)
        else:
            view.copy_(part)
    elif add:
        target.index_add_(0, rows.to(target.device), part)
    else:
        target.index_copy_(0, rows.to(target.device), part)


@dataclass
class _InFlight:
    """One started head exchange: the exchanger's pending receipts and this rank's own part."""

    exchange: HeadExchange
    pending: Pending
    own: torch.Tensor | None


class HeadAllToAll:
    """Both directions of the head all-to-all for one rank, over ``exchanger``.

    ``group_of(rank)``: the head group of a rank of the node (its local GPU index)."""

    def __init__(self, exchanger: Exchanger, rank: int, group_of: Callable[[int], int]) -> None:
        self.exchanger = exchanger
        self.rank = rank
        self.group_of = group_of

    def start(
        self,
        exchange: HeadExchange,
        sources: Sequence[torch.Tensor],
        cut: HeadRanges,
        *,
        tag: str,
    ) -> _InFlight:
        """Post ``exchange``: to each destination the rows it needs of ``sources``, each cut to
        ``cut(group)`` (the destination's group, or this rank's own: callers decide by what
        ``cut`` ignores). Every source must share a dtype and a head dim."""
        me = self.rank
        payload = {
            (me, dst): _pack(sources, rows, cut(self.group_of(dst)))
            for dst, rows in exchange.sends.items()
        }
        mine = cut(self.group_of(me))
        row_shape = (sum(b - a for a, b in mine), sources[0].shape[-1])
        pending = self.exchanger.start(
            exchange.messages, payload, row_shape=row_shape, dtype=sources[0].dtype, tag=tag
        )
        own = _pack(sources, exchange.keep[0], mine) if exchange.keep is not None else None
        return _InFlight(exchange, pending, own)

    def finish(
        self,
        inflight: _InFlight,
        targets: Sequence[torch.Tensor],
        place: HeadRanges,
        *,
        add: bool = False,
    ) -> None:
        """Wait for ``inflight`` and write what came (and this rank's own part) into
        ``targets``: the rows from rank ``src`` go, head range by head range, to
        ``place(group of src)`` of each target; ``add`` sums instead of writing (replicated
        K/V heads' gradients)."""
        got = inflight.pending.wait()
        exchange = inflight.exchange
        parts = [(src, rows, got[(src, self.rank)]) for src, rows in exchange.receives]
        if exchange.keep is not None:
            parts.append((self.rank, exchange.keep[1], inflight.own))
        for src, rows, received in parts:
            offset = 0
            for target, (a, b) in zip(targets, place(self.group_of(src))):
                part = received[:, offset : offset + b - a]
                _write(target.narrow(1, a, b - a), rows, part, add=add)
                offset += b - a
