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

Host work. Both directions run every layer, so what they cost the host counts (a GPU waits for a
host that queues its kernels late): row indices reach the device once per exchange and are
reused by every layer (``HeadAllToAll.on``, copies the stream orders: a plain ``.to("cuda")``
from pageable memory would make the host wait for the device each time), the rows a start sends
are gathered once per source whatever the number of destinations, and a finish whose parts all
land in the same heads writes them with one call per target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_zeppelin.comm.protocol import Exchanger, Pending
from megatron_zeppelin.devices import to_device
from megatron_zeppelin.planner.plan.schedule import Message

__all__ = ["HeadAllToAll", "HeadExchange", "HeadRanges"]

Rows = torch.Tensor | slice | None
"""Rows of a buffer as the attention layouts give them (``attention.layout.Rows``): every row,
a run of rows, or an int64 index."""


@dataclass(frozen=True)
class HeadExchange:
    """One direction of the head all-to-all as one rank sees it (``attention.head_layout``)."""

    messages: list[Message]
    """The messages this rank sends or receives (``schedule.exchange_messages`` with its
    ``rank``), in the order of every rank's."""
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
    """Rows ``rows`` of ``x`` (an index already on ``x``'s device)."""
    if rows is None:
        return x
    if isinstance(rows, slice):
        return x[rows]
    return x.index_select(0, rows)


def _write(target: torch.Tensor, rows: Rows, part: torch.Tensor, *, add: bool) -> None:
    """``target[rows] = part`` (or ``+=``), in place; ``target`` may be a view; an index is
    already on the target's device."""
    if part.dtype != target.dtype:
        part = part.to(target.dtype)
    if rows is None or isinstance(rows, slice):
        view = target if rows is None else target[rows]
        if add:
            view.add_(part)
        else:
            view.copy_(part)
    elif add:
        target.index_add_(0, rows, part)
    else:
        target.index_copy_(0, rows, part)


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
        self._moved: dict[tuple[int, str], torch.Tensor] = {}
        self._joined: dict[tuple, Any] = {}  # indices, and the plans of head writes

    def on(self, rows: Rows, device: torch.device) -> Rows:
        """``rows`` on ``device``, moved once (the exchanges, and so their rows, live as long as
        this object: one micro-batch's engine)."""
        if not isinstance(rows, torch.Tensor) or rows.device == device:
            return rows
        key = (id(rows), str(device))
        if key not in self._moved:
            self._moved[key] = to_device(rows, device)
        return self._moved[key]

    def _joined_rows(self, exchange: HeadExchange, parts, device: torch.device) -> torch.Tensor:  # noqa: ANN001
        """The target rows of every part of ``exchange`` one after another, on ``device``."""
        key = (id(exchange), str(device))
        if key not in self._joined:
            rows = [_as_index(rows, len(part)) for _, rows, part in parts]
            self._joined[key] = to_device(torch.cat(rows), device)
        return self._joined[key]

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
        mine = cut(self.group_of(me))
        cuts = {dst: cut(self.group_of(dst)) for dst in exchange.sends}
        joined = None
        if all(c == mine for c in cuts.values()):
            # One cut for every destination: cut once, then take each one's rows.
            joined = _cut(sources, mine)
            parts = self._rows_of(joined, exchange)
        else:
            parts = self._heads_of(sources, exchange, cuts)
        payload = {(me, dst): part for dst, part in parts.items()}
        row_shape = (sum(b - a for a, b in mine), sources[0].shape[-1])
        pending = self.exchanger.start(
            exchange.messages, payload, row_shape=row_shape, dtype=sources[0].dtype, tag=tag
        )
        own = None
        if exchange.keep is not None:
            rows = exchange.keep[0]
            own = (
                self._take(joined, rows)
                if joined is not None
                else _cut([self._take(x, rows) for x in sources], mine)
            )
        return _InFlight(exchange, pending, own)

    def _take(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        return _take(x, self.on(rows, x.device))

    def _sends_by_kind(self, exchange: HeadExchange) -> tuple[list, list, bool]:
        """The destinations of ``exchange`` whose rows are an index, ``(dst, rows)``; those whose
        rows are a run or every row; and whether every destination takes the same rows (worked
        out once per exchange)."""
        key = (id(exchange), "kinds")
        if key not in self._joined:
            sends = exchange.sends
            rows = next(iter(sends.values()), None)
            same = all(r is rows or (not _is_index(r) and r == rows) for r in sends.values())
            self._joined[key] = (
                [(dst, r) for dst, r in sends.items() if _is_index(r)],
                [(dst, r) for dst, r in sends.items() if not _is_index(r)],
                same,
            )
        return self._joined[key]

    def _rows_of(self, x: torch.Tensor, exchange: HeadExchange) -> dict[int, torch.Tensor]:
        """Each destination's rows of ``x``: runs as views, the indexed ones in one gather for
        all of them, then cut apart (views of one new tensor)."""
        picked, runs, _ = self._sends_by_kind(exchange)
        parts = {dst: _take(x, rows) for dst, rows in runs}
        if len(picked) < 2:
            parts.update({dst: self._take(x, rows) for dst, rows in picked})
            return parts
        key = (id(exchange), "sends", str(x.device))
        if key not in self._joined:
            self._joined[key] = to_device(torch.cat([rows for _, rows in picked]), x.device)
        taken, offset = x.index_select(0, self._joined[key]), 0
        for dst, rows in picked:
            parts[dst] = taken[offset : offset + rows.shape[0]]
            offset += rows.shape[0]
        return parts

    def _heads_of(self, sources, exchange: HeadExchange, cuts) -> dict[int, torch.Tensor]:  # noqa: ANN001
        """Each destination's rows of ``sources`` cut to its heads. Where every destination
        takes the same rows and as many heads (the head layout's way in), the heads are put in
        destination order in one gather and the rows split by destination in one copy."""
        sends = exchange.sends
        rows = next(iter(sends.values()))
        widths = {sum(b - a for a, b in c) for c in cuts.values()}
        same_rows = self._sends_by_kind(exchange)[2]
        if not (same_rows and len(widths) == 1 and len(sends) > 2):
            taken: dict[int, list[torch.Tensor]] = {}  # each source's rows, gathered once
            parts = {}
            for dst, dst_rows in sends.items():
                if id(dst_rows) not in taken:
                    taken[id(dst_rows)] = [self._take(x, dst_rows) for x in sources]
                parts[dst] = _cut(taken[id(dst_rows)], cuts[dst])
            return parts
        base = [self._take(x, rows) for x in sources]
        joined = torch.cat(base, dim=1) if len(base) > 1 else base[0]
        widths_in = tuple(x.shape[1] for x in sources)
        key = (
            id(exchange),
            "heads",
            tuple(map(tuple, cuts.values())),
            widths_in,
            str(joined.device),
        )
        if key not in self._joined:
            starts = [0]
            for x in sources[:-1]:
                starts.append(starts[-1] + x.shape[1])
            heads = [
                h
                for c in cuts.values()
                for s, (a, b) in zip(starts, c)
                for h in range(a + s, b + s)
            ]
            self._joined[key] = to_device(torch.tensor(heads), joined.device)
        t, d, width = joined.shape[0], joined.shape[-1], widths.pop()
        arranged = joined.index_select(1, self._joined[key]).view(t, len(sends), width, d)
        blocks = arranged.transpose(0, 1).contiguous()
        return {dst: blocks[i] for i, dst in enumerate(cuts)}

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
        if not parts:
            return
        device = targets[0].device
        ranges = [place(self.group_of(src)) for src, _, _ in parts]
        rows = parts[0][1]
        if len(parts) > 1 and all(r == ranges[0] for r in ranges):
            # Every part lands in the same heads: one write per target for all of them.
            rows = self._joined_rows(exchange, parts, device)
            parts = [(None, rows, torch.cat([received for _, _, received in parts]))]
            ranges = ranges[:1]
        elif len(parts) > 1 and not isinstance(rows, torch.Tensor):
            if all(p[1] == rows for p in parts) and (add or _disjoint(ranges)):
                # Every part lands in the same rows, each in its own heads: one write per target.
                self._write_heads(rows, [p[2] for p in parts], ranges, targets, add=add)
                return
        for (_, rows, received), heads in zip(parts, ranges):
            rows = self.on(rows, device)
            offset = 0
            for target, (a, b) in zip(targets, heads):
                part = received[:, offset : offset + b - a]
                _write(target.narrow(1, a, b - a), rows, part, add=add)
                offset += b - a

    def _write_heads(self, rows: Rows, received, ranges, targets, *, add: bool) -> None:  # noqa: ANN001
        """Parts of the same ``rows`` into the heads ``ranges`` of each target, one write per
        target (``index_add_`` sums the parts of a replicated K/V head)."""
        device = targets[0].device
        for target, (pieces, heads) in zip(targets, self._head_writes(ranges, device)):
            block = torch.cat([received[p][:, a:b] for p, a, b in pieces], dim=1)
            if block.dtype != target.dtype:
                block = block.to(target.dtype)
            view = target if rows is None else target[rows]
            if add:
                view.index_add_(1, heads, block)
            else:
                view.index_copy_(1, heads, block)

    def _head_writes(self, ranges, device: torch.device) -> list:  # noqa: ANN001
        """Per target of ``_write_heads``: which columns of which part it takes, ``(part,
        start, end)``, and the heads they fill, on ``device``. The ranges follow the plan and
        the head counts, so they are worked out once and every layer reuses them."""
        key = ("writes", tuple(map(tuple, ranges)), str(device))
        if key not in self._joined:
            writes = []
            for i in range(len(ranges[0])):
                pieces, heads = [], []
                for p, per_target in enumerate(ranges):
                    offset = sum(b - a for a, b in per_target[:i])
                    a, b = per_target[i]
                    pieces.append((p, offset, offset + b - a))
                    heads.extend(range(a, b))
                writes.append((pieces, to_device(torch.tensor(heads), device)))
            self._joined[key] = writes
        return self._joined[key]


def _cut(taken: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The gathered rows of every source, each cut to its head range, side by side (one new
    tensor: what a message carries)."""
    pieces = [x[:, a:b] for x, (a, b) in zip(taken, ranges)]
    return torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0].contiguous()


def _as_index(rows: Rows, num_rows: int) -> torch.Tensor:
    """``rows`` of a part of ``num_rows`` rows as an int64 index (host)."""
    if isinstance(rows, torch.Tensor):
        return rows.cpu()
    assert rows is not None, "a part of a joined write names its rows"
    return torch.arange(rows.start, rows.start + num_rows)


def _disjoint(ranges: Sequence[Sequence[tuple[int, int]]]) -> bool:
    """Whether no two parts write the same head of any target."""
    for i in range(len(ranges[0])):
        heads = [h for per_target in ranges for h in range(*per_target[i])]
        if len(heads) != len(set(heads)):
            return False
    return True


def _is_index(rows: Rows) -> bool:
    return isinstance(rows, torch.Tensor)
