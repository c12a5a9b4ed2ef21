"""What every rank computes in every ring phase, and how long each phase's kernel call takes.

Phase ``k`` of a document's ring (``g`` ranks) is what ring position ``i`` computes after ``k``
steps: its query spans against the K/V block of position ``(i - k) mod g``. Phase 0 is a rank's
own block (cut by the causal diagonal); phases ``1 .. g-1`` are blocks received in the ring's
steps, priced on the unmasked curve. A rank's phase ``k`` over all its documents is one varlen
kernel call (``CostModel.attention_call_time``).

Blocks are kept as arrays (one row per query rank and key block) so a plan of thousands of
documents on a thousand GPUs is timed in milliseconds: documents whose spans are the zigzag
chunks of their ring (what every builder makes) are enumerated per ring size at once; any other
layout (a plan file) one document at a time. Each row carries a *pass*: documents of one pass run
concurrently (one kernel call per rank and phase), passes run one after another (Megatron's
dynamic CP runs every document as its own pass).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter, itemgetter

import numpy as np

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.plan.plan import SequencePlan

__all__ = [
    "Blocks",
    "Local",
    "ZigzagRings",
    "attention_blocks",
    "call_key",
    "causal_pairs_array",
    "is_zigzag",
    "phase_seconds",
    "split_by_layout",
    "unique_inverse",
    "zigzag_blocks",
]

_RING, _LENGTH, _RANK = attrgetter("ring"), attrgetter("length"), attrgetter("rank")
_BOUNDS = attrgetter("start", "end")


@dataclass(frozen=True)
class Blocks:
    """One row per (query rank, key block) of a plan's attention: who computes it, in which
    pass and phase, for how many queries and visible (query, key) pairs."""

    pass_id: np.ndarray
    rank: np.ndarray
    phase: np.ndarray
    num_q: np.ndarray
    pairs: np.ndarray
    num_phases: int
    """``max(ring size)``: phases per pass."""


def causal_pairs_array(
    q_start: np.ndarray, q_end: np.ndarray, k_start: np.ndarray, k_end: np.ndarray
) -> np.ndarray:
    """``costmodel.causal_pairs`` elementwise over broadcast int64 arrays."""
    lo = np.maximum(q_start, k_start)
    full_from = np.maximum(lo, k_end - 1)
    n = np.maximum(np.minimum(q_end, full_from) - lo, 0)
    first = lo - k_start + 1
    total = n * first + n * (n - 1) // 2
    total = total + np.maximum(q_end - full_from, 0) * (k_end - k_start)
    valid = (q_end > q_start) & (k_end > k_start) & (lo < q_end)
    return np.where(valid, total, 0)


def is_zigzag(seq: SequencePlan) -> bool:
    """Spans are two per ring position, in ring order (``plan.zigzag_spans``)."""
    spans, ring = seq.attention, tuple(seq.ring)
    if len(spans) != 2 * len(ring):
        return False
    ranks = tuple(map(_RANK, spans))  # read at C level: the planner asks of every ring it times
    return ranks[0::2] == ring and ranks[1::2] == ring


class _Rows:
    """Columns of ``Blocks`` under construction, as lists of arrays."""

    def __init__(self) -> None:
        self.columns: list[list[np.ndarray]] = [[], [], [], [], []]

    def add(self, pass_id, rank, phase, num_q, pairs) -> None:
        values = np.broadcast_arrays(pass_id, rank, phase, num_q, pairs)
        for column, value in zip(self.columns, values):
            column.append(value.reshape(-1))

    def blocks(self, num_phases: int) -> Blocks:
        arrays = [np.concatenate(c) if c else np.zeros(0, dtype=np.int64) for c in self.columns]
        pass_id, rank, phase, num_q, pairs = arrays
        return Blocks(
            pass_id.astype(np.int64),
            rank.astype(np.int64),
            phase.astype(np.int64),
            num_q.astype(np.float64),
            pairs.astype(np.float64),
            num_phases,
        )


@dataclass(frozen=True)
class ZigzagRings:
    """Documents of one ring size ``g`` whose spans are the zigzag chunks of their ring
    (``is_zigzag``), as arrays: what the array timelines read of them."""

    bounds: np.ndarray
    """``(doc, position, 2, 2)``: start and end of chunks ``i`` and ``2g-1-i`` of position ``i``."""
    ring: np.ndarray
    """``(doc, position)``: the ring's ranks."""
    pass_id: np.ndarray
    """``(doc,)``."""

    @property
    def size(self) -> int:
        return self.ring.shape[1]

    @property
    def block_tokens(self) -> np.ndarray:
        """``(doc, position)``: tokens each position holds (its K/V block)."""
        return (self.bounds[..., 1] - self.bounds[..., 0]).sum(axis=2)

    @classmethod
    def of(cls, docs: list[tuple[int, SequencePlan]]) -> ZigzagRings:
        """``(pass, document)`` pairs of one ring size, every one ``is_zigzag``."""
        g = len(docs[0][1].ring)
        bounds = np.asarray(
            [list(map(_BOUNDS, seq.attention)) for _, seq in docs], dtype=np.int64
        ).reshape(len(docs), g, 2, 2)
        rings = np.asarray([seq.ring for _, seq in docs], dtype=np.int64)
        return cls(bounds, rings, np.asarray([p for p, _ in docs], dtype=np.int64))


Local = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Documents whole on one rank: ``(pass, rank, length)`` arrays."""


def split_by_layout(
    sequences: Sequence[SequencePlan], pass_ids: Sequence[int] | None = None
) -> tuple[Local, list[ZigzagRings], list[tuple[int, SequencePlan]]]:
    """``sequences`` as their local documents, their zigzag rings per ring size (in order of
    first appearance) and the documents of any other layout ``(pass, document)``. Most
    documents are local: they are read with C-level maps, the rings one by one."""
    rings = list(map(_RING, sequences))
    sizes = np.fromiter(map(len, rings), dtype=np.int64, count=len(rings))
    lengths = np.fromiter(map(_LENGTH, sequences), dtype=np.int64, count=len(rings))
    passes = np.zeros(len(rings), dtype=np.int64) if pass_ids is None else np.asarray(pass_ids)
    is_local = sizes == 1  # every query sees every earlier key on the same rank
    ranks = np.fromiter(map(itemgetter(0), compress(rings, is_local.tolist())), dtype=np.int64)
    local = (passes[is_local].astype(np.int64), ranks, lengths[is_local])
    zigzag: dict[int, list[tuple[int, SequencePlan]]] = defaultdict(list)
    other: list[tuple[int, SequencePlan]] = []
    for i in np.flatnonzero(~is_local).tolist():
        seq, pass_id = sequences[i], int(passes[i])
        if is_zigzag(seq):
            zigzag[len(seq.ring)].append((pass_id, seq))
        else:
            other.append((pass_id, seq))
    return local, [ZigzagRings.of(docs) for docs in zigzag.values()], other


def attention_blocks(
    sequences: Sequence[SequencePlan], pass_ids: Sequence[int] | None = None
) -> Blocks:
    """Every block of ``sequences`` (module docstring); ``pass_ids[i]`` is the pass of
    ``sequences[i]`` (default: one pass for all)."""
    local, zigzag, other = split_by_layout(sequences, pass_ids)
    num_phases = max(map(len, map(_RING, sequences)), default=1)
    return zigzag_blocks(zigzag, num_phases, local=local, other=other)


def zigzag_blocks(
    zigzag: list[ZigzagRings],
    num_phases: int,
    *,
    local: Local | None = None,
    other: list[tuple[int, SequencePlan]] = (),  # type: ignore[assignment]
) -> Blocks:
    """The blocks of ``split_by_layout``'s three kinds: local documents first, then the zigzag
    rings in the order given, then the others (rows in this order, so sums come out alike)."""
    rows = _Rows()
    for pass_id, seq in other:
        _add_any(rows, pass_id, seq)
    if local is not None and len(local[0]):
        pass_id, rank, length = local
        rows.add(pass_id, rank, 0, length, length * (length + 1) // 2)
    for group in zigzag:
        _add_zigzag(rows, group)
    return rows.blocks(num_phases)


def _add_zigzag(rows: _Rows, group: ZigzagRings) -> None:
    """Documents of one ring size ``g`` with zigzag spans, all at once: pairs of every query
    position against every key position from the (doc, position, chunk) span bounds."""
    g, starts, ends = group.size, group.bounds[..., 0], group.bounds[..., 1]
    q_s, q_e = starts[:, :, :, None, None], ends[:, :, :, None, None]
    k_s, k_e = starts[:, None, None, :, :], ends[:, None, None, :, :]
    pairs = causal_pairs_array(q_s, q_e, k_s, k_e).sum(axis=(2, 4))  # (doc, q pos, k pos)
    num_q = (ends - starts).sum(axis=2)  # (doc, position)
    positions = np.arange(g)
    phase = (positions[:, None] - positions[None, :]) % g  # query i, key j: phase (i - j) mod g
    shape = pairs.shape
    rows.add(
        np.broadcast_to(group.pass_id[:, None, None], shape),
        np.broadcast_to(group.ring[:, :, None], shape),
        np.broadcast_to(phase[None], shape),
        np.broadcast_to(num_q[:, :, None], shape),
        pairs,
    )


def _add_any(rows: _Rows, pass_id: int, seq: SequencePlan) -> None:
    """A document with any spans: pairs of every span against every span, summed per ring
    position."""
    g = len(seq.ring)
    position = {rank: i for i, rank in enumerate(seq.ring)}
    pos = np.asarray([position[s.rank] for s in seq.attention], dtype=np.int64)
    starts = np.asarray([s.start for s in seq.attention], dtype=np.int64)
    ends = np.asarray([s.end for s in seq.attention], dtype=np.int64)
    span_pairs = causal_pairs_array(starts[:, None], ends[:, None], starts[None], ends[None])
    pairs = np.zeros((g, g), dtype=np.int64)
    np.add.at(pairs, (pos[:, None], pos[None, :]), span_pairs)
    num_q = np.bincount(pos, weights=ends - starts, minlength=g)
    positions = np.arange(g)
    phase = (positions[:, None] - positions[None, :]) % g
    keep = np.broadcast_to(num_q[:, None] > 0, (g, g))
    ring = np.broadcast_to(np.asarray(seq.ring)[:, None], (g, g))
    q = np.broadcast_to(num_q[:, None], (g, g))
    rows.add(np.full(int(keep.sum()), pass_id), ring[keep], phase[keep], q[keep], pairs[keep])


def phase_seconds(
    blocks: Blocks, cost: CostModel, world_size: int, *, merge_ring_phases: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Seconds of every (pass, rank, phase) kernel call: each block at the rate of its own query
    count in a call of all the call's queries, the call overhead once, phase 0 on the diagonal
    curve. ``merge_ring_phases``: phases ``1..`` form one call (all-gather attention).

    Returns ``(pass_id, rank, phase, seconds)`` of every call that computes anything, sorted by
    ``call_key``."""
    keep = (blocks.pairs > 0) & (blocks.num_q > 0)
    phase = blocks.phase[keep]
    if merge_ring_phases:
        phase = np.minimum(phase, 1)
    num_phases = blocks.num_phases
    key = call_key(blocks.pass_id[keep], blocks.rank[keep], phase, world_size, num_phases)
    calls, inverse = unique_inverse(key)
    num_q, pairs = blocks.num_q[keep], blocks.pairs[keep]
    call_tokens = np.bincount(inverse, weights=num_q, minlength=len(calls))
    diagonal = phase == 0
    flops = pairs * cost.model.attn_flops_per_pair()
    seconds_of_block = np.empty(len(pairs))
    for mask, curve in ((diagonal, cost.diagonal), (~diagonal, cost.attention)):
        seconds_of_block[mask] = curve.busy_seconds(
            flops[mask], num_q[mask], call_tokens[inverse[mask]]
        )
    seconds = np.bincount(inverse, weights=seconds_of_block, minlength=len(calls))
    call_phase = calls % num_phases
    overhead = np.where(call_phase == 0, cost.diagonal.overhead_s, cost.attention.overhead_s)
    pass_rank = calls // num_phases
    return pass_rank // world_size, pass_rank % world_size, call_phase, seconds + overhead


def unique_inverse(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` of non-negative integer keys, by a table over
    their range where that is small beside their number (no sort: the timelines index every
    call and port this way)."""
    top = int(keys.max()) + 1 if len(keys) else 0
    if top > 16 * len(keys) + 65536:
        return np.unique(keys, return_inverse=True)
    present = np.zeros(top, dtype=bool)
    present[keys] = True
    index = np.cumsum(present) - 1
    return np.flatnonzero(present), index[keys]


def call_key(
    pass_id: np.ndarray, rank: np.ndarray, phase: np.ndarray, world_size: int, num_phases: int
) -> np.ndarray:
    """One integer per (pass, rank, phase): the order of ``phase_seconds``'s calls."""
    return (pass_id * world_size + rank) * num_phases + phase
