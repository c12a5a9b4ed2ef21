"""A plan's invariants (``Plan.validate``): every document's attention spans partition it over
its ring, whose tier and scheme they match; the linear ranges partition every document; routes
join nodes through proxies on them; no rank is over its capacity in either layout. Each check
raises ``ValueError`` naming the first fault.

Plans of 10^4 documents on 10^3 GPUs are checked every micro-batch: one pass over the records,
with a short path for a document whole on one GPU (most of a batch), and arrays for the linear
layout's partition. (Reading the records into arrays first took as long as the pass: at 10^4
records, making the arrays from Python objects costs what the loop does.)
"""

from __future__ import annotations

import numpy as np

from megatron_zeppelin.planner.plan.plan_parts import (
    Route,
    Scheme,
    SequencePlan,
    Span,
    Tier,
    TokenRange,
    node_chunks,
    node_grid,
    zigzag_bounds,
)
from megatron_zeppelin.topology.model import Topology


def _check_two_d(seq: SequencePlan, topology: Topology) -> None:
    """A 2-D document's grid and token layout (see ``SequencePlan.scheme``)."""
    if len(seq.ring) < 2:
        raise ValueError(f"sequence {seq.id}: a 2-D document needs a ring of at least 2 ranks")
    try:
        grid = node_grid(seq.ring, topology)
    except ValueError as exc:
        raise ValueError(f"sequence {seq.id}: {exc}") from None
    n = len(grid)
    bounds = zigzag_bounds(seq.length, n)  # node i holds chunks i and 2n-1-i
    row_of = {rank: i for i, row in enumerate(grid) for rank in row}
    for span in seq.attention:
        i = row_of[span.rank]
        (a, b), (c, d) = bounds[i], bounds[2 * n - 1 - i]
        if not (a <= span.start and span.end <= b or c <= span.start and span.end <= d):
            chunks = node_chunks(seq.length, n, i)
            raise ValueError(
                f"sequence {seq.id}: span [{span.start}, {span.end}) on rank {span.rank} lies "
                f"outside its node's chunks {chunks}"
            )


def _span_start(span: Span) -> int:
    return span.start


def check_attention(
    sequences: tuple[SequencePlan, ...], topology: Topology
) -> tuple[dict[int, int], list[int]]:
    """Every document's spans partition it over its ring, whose tier it names. Returns the
    lengths by id and the attention tokens per rank."""
    world = topology.world_size
    lengths: dict[int, int] = {}
    attention_tokens = [0] * world
    local, ring_scheme = Tier.LOCAL, Scheme.RING
    for seq in sequences:
        if seq.length < 1:
            raise ValueError(f"sequence {seq.id} has length {seq.length}; lengths must be >= 1")
        lengths[seq.id] = seq.length
        ring, spans = seq.ring, seq.attention
        # Fast path for the common case, a whole document on one GPU (the checks of
        # ``_check_ring`` reduce to these).
        if len(ring) == 1 and len(spans) == 1 and seq.tier == local and seq.scheme == ring_scheme:
            span, rank = spans[0], ring[0]
            if (
                span.rank == rank
                and span.start == 0
                and span.end == seq.length
                and (0 <= rank < world)
            ):
                attention_tokens[rank] += seq.length
                continue
        _check_ring(seq, topology, attention_tokens)
    return lengths, attention_tokens


def _check_ring(seq: SequencePlan, topology: Topology, attention_tokens: list[int]) -> None:
    world = topology.world_size
    ring = seq.ring
    ring_set = set(ring)
    if not ring or len(ring_set) != len(ring):
        raise ValueError(f"sequence {seq.id}: its ring must list distinct ranks")
    if min(ring) < 0 or max(ring) >= world:
        rank = next(r for r in ring if not 0 <= r < world)
        raise ValueError(f"sequence {seq.id}: rank {rank} outside 0..{world - 1}")
    spans = seq.attention
    if len(spans) > 1:
        spans = sorted(spans, key=_span_start)
    pos = 0
    for span in spans:
        if span.rank not in ring_set:
            raise ValueError(
                f"sequence {seq.id}: span on rank {span.rank} outside its ring {seq.ring}"
            )
        if span.start != pos or span.end <= span.start:
            raise ValueError(
                f"sequence {seq.id}: attention spans must partition [0, {seq.length}) "
                f"with non-empty ranges (gap or overlap at token {pos})"
            )
        pos = span.end
        attention_tokens[span.rank] += span.end - span.start
    if pos != seq.length:
        raise ValueError(
            f"sequence {seq.id}: attention spans cover [0, {pos}) of [0, {seq.length})"
        )
    expected = Tier.of_ring(ring, topology.gpus_per_node)
    if seq.tier != expected:  # Tier is a str enum: "local" == Tier.LOCAL
        raise ValueError(f"sequence {seq.id}: tier {seq.tier} but its ring is {expected}")
    if seq.scheme != Scheme.RING:
        _check_two_d(seq, topology)


def check_linear(
    linear: tuple[tuple[TokenRange, ...], ...], lengths: dict[int, int], ids: list[int]
) -> list[int]:
    """The linear ranges partition every document. Returns the linear tokens per rank."""
    seqs: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    linear_tokens = [0] * len(linear)
    for rank, ranges in enumerate(linear):
        num = 0
        for r in ranges:
            seq, start, end = r.seq, r.start, r.end
            length = lengths.get(seq)
            if length is None:
                raise ValueError(f"linear layout of rank {rank} names unknown sequence {seq}")
            if not 0 <= start < end <= length:
                raise ValueError(
                    f"linear layout of rank {rank}: range [{start}, {end}) of sequence "
                    f"{seq} is empty or outside [0, {length})"
                )
            seqs.append(seq)
            starts.append(start)
            ends.append(end)
            num += end - start
        linear_tokens[rank] = num
    if not _partition(seqs, starts, ends, lengths):
        _name_the_gap(sorted(zip(seqs, starts, ends)), lengths, ids)
    return linear_tokens


def _partition(
    seqs: list[int], starts: list[int], ends: list[int], lengths: dict[int, int]
) -> bool:
    """Whether the ranges (each inside its document) partition every document of ``lengths``,
    told with arrays: sorted by (document, start, end), each document's ranges run from 0 to
    its length. ``False`` also when the values are not plain integers (``_name_the_gap`` then
    walks them)."""
    seq, start, end = (np.array(values) for values in (seqs, starts, ends))
    if any(a.dtype.kind != "i" for a in (seq, start, end)) or not len(seq):
        return False
    order = np.lexsort((end, start, seq))
    seq, start, end = seq[order], start[order], end[order]
    first = np.ones(len(seq), dtype=bool)
    first[1:] = seq[1:] != seq[:-1]
    last = np.r_[first[1:], True]
    length = np.array(list(map(lengths.__getitem__, seq[last].tolist())))
    return (
        bool((start == np.where(first, 0, np.r_[0, end[:-1]])).all())
        and bool((end[last] == length).all())
        and int(first.sum()) == len(lengths)
    )


def _name_the_gap(
    pieces: list[tuple[int, int, int]], lengths: dict[int, int], ids: list[int]
) -> None:
    """Raise naming the first document the sorted ``pieces`` do not partition."""
    current, pos, num_seen = None, 0, 0
    for seq_id, start, end in pieces:
        if seq_id != current:
            if current is not None and pos != lengths[current]:
                raise ValueError(f"linear layout covers [0, {pos}) of sequence {current}")
            current, pos, num_seen = seq_id, 0, num_seen + 1
        if start != pos:
            raise ValueError(f"linear layout does not partition sequence {seq_id} (token {pos})")
        pos = end
    if current is not None and pos != lengths[current]:
        raise ValueError(f"linear layout covers [0, {pos}) of sequence {current}")
    if num_seen != len(lengths):
        named = {piece[0] for piece in pieces}
        missing = next(i for i in ids if i not in named)
        raise ValueError(f"linear layout covers [0, 0) of sequence {missing}")


def check_routes(routes: tuple[Route, ...], topology: Topology) -> None:
    for route in routes:
        if topology.same_node(route.src, route.dst):
            raise ValueError(f"route {route.src}->{route.dst} does not cross nodes")
        if not route.parts or any(p.weight < 0 for p in route.parts):
            raise ValueError(f"route {route.src}->{route.dst} needs parts with weights >= 0")
        if sum(p.weight for p in route.parts) <= 0:
            raise ValueError(f"route {route.src}->{route.dst} has zero total weight")
        for p in route.parts:
            if not (
                topology.same_node(p.src_proxy, route.src)
                and topology.same_node(p.dst_proxy, route.dst)
            ):
                raise ValueError(
                    f"route {route.src}->{route.dst}: proxies {p.src_proxy}->{p.dst_proxy} "
                    "must sit on the source and destination nodes"
                )
    if len({(r.src, r.dst) for r in routes}) != len(routes):
        raise ValueError("a ring edge is routed twice")


def check_capacity(capacity: int, attention_tokens: list[int], linear_tokens: list[int]) -> None:
    for rank, pair in enumerate(zip(attention_tokens, linear_tokens)):
        for label, n in zip(("attention", "linear"), pair):
            if n > capacity:
                raise ValueError(
                    f"rank {rank} holds {n} tokens in the {label} layout, over its "
                    f"capacity of {capacity}"
                )
