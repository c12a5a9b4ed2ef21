"""Where every row goes when a rank's tokens move between the linear and the attention layout.

Pure (numpy only): the communication layer turns a ``RemapLayout`` into one all-to-all.

A *layout* lists, per rank, the token ranges it holds; a rank's *buffer* is those ranges' tokens
in the order listed (``Plan.linear_ranges`` for the linear layout, ``Plan.attention_ranges`` for
the attention layout). Moving from layout S to layout D on rank r:

1. gather ``send_index`` rows of r's S-buffer: the rows for rank 0 first, then rank 1, ...;
   ``send_counts[d]`` of them for rank d, in the order they take in d's D-buffer;
2. all-to-all: r receives ``recv_counts[s]`` rows from each rank s, concatenated by s;
3. gather ``recv_index`` rows of the received buffer: row i of r's D-buffer is received row
   ``recv_index[i]``.

Both ends derive the same row order (destination-buffer order) from the plan alone, so nothing
about the order travels. ``RemapLayout.inverse()`` is the move back from D to S; for an all-to-all
the backward of one direction is the forward of the other, so the pair serves autograd too.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from megatron_zeppelin.planner.plan.plan import Plan, TokenRange

__all__ = [
    "RemapLayout",
    "plan_layouts",
    "remap_between",
    "remap_pair",
    "linear_to_attention_layout",
    "attention_to_linear_layout",
]

Layout = list[list[TokenRange]]


@dataclass(frozen=True)
class RemapLayout:
    """One rank's side of a move between two layouts (see the module docstring)."""

    rank: int
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    send_index: np.ndarray  # int64, len sum(send_counts): rows of the source buffer, in send order
    recv_index: np.ndarray  # int64, len sum(recv_counts): received row of each destination row
    num_src_rows: int
    num_dst_rows: int
    on_device: dict = field(default_factory=dict, compare=False, repr=False)
    """The two indices as tensors on the devices that used them (``comm/remap.py`` fills it, so
    every layer of a micro-batch reuses one copy)."""

    def __post_init__(self) -> None:
        assert len(self.send_index) == sum(self.send_counts) == self.num_src_rows
        assert len(self.recv_index) == sum(self.recv_counts) == self.num_dst_rows

    @property
    def moved_rows(self) -> int:
        """Rows this rank sends to other ranks (rows it keeps do not leave it)."""
        return sum(self.send_counts) - self.send_counts[self.rank]

    def inverse(self) -> RemapLayout:
        """The move back: destination rows return to where they came from."""
        # Forward: dst[i] = recv[recv_index[i]] and recv is, by source rank, the source rows
        # send_index of that rank. Backward sends dst rows back in the same recv order and puts
        # each arriving row at the source position it was gathered from.
        send_index = np.empty(self.num_dst_rows, dtype=np.int64)
        send_index[self.recv_index] = np.arange(self.num_dst_rows, dtype=np.int64)
        recv_index = np.empty(self.num_src_rows, dtype=np.int64)
        recv_index[self.send_index] = np.arange(self.num_src_rows, dtype=np.int64)
        return RemapLayout(
            rank=self.rank,
            send_counts=self.recv_counts,
            recv_counts=self.send_counts,
            send_index=send_index,
            recv_index=recv_index,
            num_src_rows=self.num_dst_rows,
            num_dst_rows=self.num_src_rows,
        )


def _buffer_offsets(ranges: list[TokenRange]) -> list[int]:
    offsets, pos = [], 0
    for r in ranges:
        offsets.append(pos)
        pos += r.num_tokens
    return offsets


def _owners(
    layout: Layout, seqs: set[int] | None = None
) -> dict[int, tuple[list[int], list[tuple[int, int, int, int]]]]:
    """Per sequence (of ``seqs`` alone where given), its ranges sorted by start:
    (starts, [(start, end, rank, buffer offset)])."""
    by_seq: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    for rank, ranges in enumerate(layout):
        offset = 0
        for r in ranges:
            if seqs is None or r.seq in seqs:
                by_seq[r.seq].append((r.start, r.end, rank, offset))
            offset += r.end - r.start
    out = {}
    for seq, items in by_seq.items():
        items.sort()
        out[seq] = ([it[0] for it in items], items)
    return out


def _pieces(r: TokenRange, owners: dict) -> list[tuple[int, int, int, int]]:
    """Split range ``r`` by the ranks holding it in another layout: (start, end, rank, offset of
    ``start`` in that rank's buffer), in token order."""
    if r.seq not in owners:
        raise ValueError(f"sequence {r.seq} appears in one layout but not the other")
    starts, items = owners[r.seq]
    i = max(bisect.bisect_right(starts, r.start) - 1, 0)
    out, pos = [], r.start
    while pos < r.end:
        if i >= len(items) or items[i][0] > pos or items[i][1] <= pos:
            raise ValueError(
                f"token {pos} of sequence {r.seq} is held by no rank in the other layout"
            )
        start, end, rank, offset = items[i]
        stop = min(end, r.end)
        out.append((pos, stop, rank, offset + pos - start))
        pos = stop
        i += 1
    return out


def remap_between(src: Layout, dst: Layout, rank: int) -> RemapLayout:
    """Rank ``rank``'s side of moving rows from layout ``src`` to layout ``dst``."""
    return _remap(src, dst, rank, _owners(src), _owners(dst))


def _remap(src: Layout, dst: Layout, rank: int, src_owners: dict, dst_owners: dict) -> RemapLayout:
    """``remap_between`` with both layouts' ``_owners`` given."""
    world = len(src)
    if len(dst) != world:
        raise ValueError(f"layouts list {len(src)} and {len(dst)} ranks; they must agree")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")

    # Sender side: each piece of my source buffer, keyed by where it lands (rank, dst offset).
    send: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    for r, offset in zip(src[rank], _buffer_offsets(src[rank])):
        for start, end, to, dst_offset in _pieces(r, dst_owners):
            send[to].append((dst_offset, offset + start - r.start, end - start))
    send_index = []
    for pieces in send:
        pieces.sort()  # destination-buffer order, which the receiver derives the same way
        send_index.extend(np.arange(s, s + n, dtype=np.int64) for _, s, n in pieces)
    send_counts = tuple(sum(n for _, _, n in pieces) for pieces in send)

    # Receiver side: my destination buffer in order, each piece from the rank that holds it.
    recv_pieces: list[tuple[int, int, int]] = []  # (from rank, dst offset, rows)
    for r, offset in zip(dst[rank], _buffer_offsets(dst[rank])):
        for start, end, frm, _ in _pieces(r, src_owners):
            recv_pieces.append((frm, offset + start - r.start, end - start))
    recv_counts = [0] * world
    for frm, _, n in recv_pieces:
        recv_counts[frm] += n
    base = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(np.int64)
    num_dst_rows = sum(r.num_tokens for r in dst[rank])
    recv_index = np.empty(num_dst_rows, dtype=np.int64)
    filled = list(base)
    # Pieces from one sender arrive in my destination-buffer order: walk them in that order.
    for frm, dst_offset, n in sorted(recv_pieces, key=lambda p: p[1]):
        recv_index[dst_offset : dst_offset + n] = np.arange(filled[frm], filled[frm] + n)
        filled[frm] += n
    empty = np.zeros(0, dtype=np.int64)
    return RemapLayout(
        rank=rank,
        send_counts=send_counts,
        recv_counts=tuple(recv_counts),
        send_index=np.concatenate(send_index) if send_index else empty,
        recv_index=recv_index,
        num_src_rows=sum(r.num_tokens for r in src[rank]),
        num_dst_rows=num_dst_rows,
    )


def plan_layouts(plan: Plan) -> tuple[Layout, Layout]:
    """Every rank's ranges in the plan's linear and attention layouts (``Plan.linear_ranges``
    and ``Plan.attention_ranges`` of each rank), the attention layout in one pass over the
    spans: asking each rank in turn walks every document once per rank, about a second per
    plan at 1024 GPUs and 10^4 documents, on every rank, every micro-batch."""
    attention: Layout = [[] for _ in range(plan.world_size)]
    for seq in plan.sequences:
        seq_id = seq.id
        for span in seq.attention:
            attention[span.rank].append(TokenRange(seq_id, span.start, span.end))
    return [list(ranges) for ranges in plan.linear], attention


def linear_to_attention_layout(plan: Plan, rank: int) -> RemapLayout:
    """Rank's side of the move from the plan's linear layout to its attention layout."""
    linear, attention = plan_layouts(plan)
    return remap_between(linear, attention, rank)


def attention_to_linear_layout(plan: Plan, rank: int) -> RemapLayout:
    """Rank's side of the move from the plan's attention layout back to its linear layout."""
    linear, attention = plan_layouts(plan)
    return remap_between(attention, linear, rank)


def remap_pair(
    plan: Plan, rank: int, layouts: tuple[Layout, Layout] | None = None
) -> tuple[RemapLayout, RemapLayout]:
    """``(linear_to_attention_layout, attention_to_linear_layout)`` of ``rank``, the layouts
    and who holds each range worked out once for both (every rank, every micro-batch);
    ``layouts``: ``plan_layouts(plan)``, where the caller has them already."""
    linear, attention = layouts or plan_layouts(plan)
    if not 0 <= rank < len(linear):
        raise ValueError(f"rank {rank} outside 0..{len(linear) - 1}")
    # Who holds the documents this rank holds, and no others: at a thousand GPUs the rest is
    # most of the plan.
    seqs = {r.seq for r in linear[rank]} | {r.seq for r in attention[rank]}
    of_linear, of_attention = _owners(linear, seqs), _owners(attention, seqs)
    return (
        _remap(linear, attention, rank, of_linear, of_attention),
        _remap(attention, linear, rank, of_attention, of_linear),
    )
