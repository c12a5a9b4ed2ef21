"""The linear layout: where linear modules (QKV, projections, MLP, loss) run, chosen by cost.

Linear modules cost the same per token, so a rank holding more tokens than its peers in the
attention layout is slow in its linear modules too. Moving tokens evens that out, but the move
is an all-to-all before and after attention (``steptime.remap_seconds``), and it turns every
layer into ``max(linear) + all-to-alls + max(attention)`` instead of ``max(linear + attention)``:
the two maxima need not fall on the same rank (``steptime.layer_seconds``). Three layouts are
candidates:

* ``attention``: the attention layout itself; nothing moves;
* ``node``: tokens even inside every node (NVLink moves only);
* ``even``: tokens even over the world (``total // world`` per rank), same node first.

``choose_linear_layout`` predicts one layer under each with the cost model and keeps the fastest
(ties go to the one that moves less). Its property: the chosen layout's predicted layer time is
no more than the other candidates'.

Balancing (``node`` and ``even``) keeps every token that can stay where it is: each rank keeps the
first of its attention tokens (in canonical attention order) up to its target, the remainder's
extra token going to the ranks that already hold the most (fewer moves); the rest form a surplus
that fills ranks short of tokens, same node first. Surplus pieces are handed out in rank order
and cut only where a receiver is full, so ranges stay few and contiguous; a rank's ranges are
listed by (document, start), with touching ranges merged. The capacity holds automatically:
a target never exceeds the largest attention count of its group.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.steptime import layer_seconds, remap_floor, remap_seconds_of
from megatron_zeppelin.planner.plan.plan import SequencePlan, TokenRange
from megatron_zeppelin.topology.model import Topology

Piece = tuple[int, int, int]
"""``(seq, start, end)``: a token range of one document."""
Moves = dict[tuple[int, int], int]
"""``(attention holder, linear holder)`` -> tokens moved between them (``steptime.Moves``)."""

LAYOUTS = ("attention", "node", "even")
Layout = tuple[tuple[TokenRange, ...], ...]


def attention_ranges_by_rank(
    sequences: Sequence[SequencePlan], world_size: int
) -> list[list[Piece]]:
    """Every rank's attention ranges in canonical order (documents by id, spans as listed)."""
    by_rank: list[list[Piece]] = [[] for _ in range(world_size)]
    for seq in sequences:
        for span in seq.attention:
            by_rank[span.rank].append((seq.id, span.start, span.end))
    return by_rank


def attention_layout(sequences: Sequence[SequencePlan], world_size: int) -> Layout:
    """``build_linear_layout(attention_ranges_by_rank(sequences), ..., "attention")`` in one
    pass over the spans, merging as it goes, where every rank meets its pieces in (document,
    start) order without overlaps (as builders list them); otherwise by sorting."""
    layout: list[list[TokenRange]] = [[] for _ in range(world_size)]
    for seq in sequences:
        seq_id = seq.id
        for span in seq.attention:
            start, end = span.start, span.end
            ranges = layout[span.rank]
            if ranges:
                last = ranges[-1]
                if last.seq == seq_id and start == last.end:
                    ranges[-1] = TokenRange(seq_id, last.start, end)
                    continue
                if last.seq > seq_id or (last.seq == seq_id and start < last.end):
                    return _merged(attention_ranges_by_rank(sequences, world_size))
            ranges.append(TokenRange(seq_id, start, end))
    return tuple(map(tuple, layout))


def _merged(by_rank: list[list[Piece]]) -> Layout:
    """Every rank's pieces sorted by (document, start, end), touching ranges of one document
    merged (rare: most pieces are a document's whole share of the rank)."""
    layout = []
    for pieces in by_rank:
        pieces.sort()
        out: list[TokenRange] = []
        last_seq = last_end = -1
        for seq, start, end in pieces:
            if seq == last_seq and start == last_end:
                out[-1] = TokenRange(seq, out[-1].start, end)
            else:
                out.append(TokenRange(seq, start, end))
            last_seq, last_end = seq, end
        layout.append(tuple(out))
    return tuple(layout)


def _fill(
    surplus: list[tuple[int, Piece]],
    needy: list[int],
    need: list[int],
    received: list[list[Piece]],
    moves: Moves,
) -> None:
    """Hand out ``surplus`` pieces (with their holder) to the ranks in ``needy`` in order,
    recording ``moves``. Leaves the undelivered pieces in ``surplus``."""
    left: list[tuple[int, Piece]] = []
    pos = 0
    for holder, (seq, start, end) in surplus:
        while start < end and pos < len(needy):
            rank = needy[pos]
            take = min(end - start, need[rank])
            received[rank].append((seq, start, start + take))
            moves[(holder, rank)] = moves.get((holder, rank), 0) + take
            need[rank] -= take
            start += take
            if need[rank] == 0:
                pos += 1
        if start < end:
            left.append((holder, (seq, start, end)))
    del needy[:pos]
    surplus[:] = left


def _targets(counts: Sequence[int], group_size: int) -> list[int]:
    """Even tokens per rank inside every group of ``group_size`` consecutive ranks; the
    remainder goes to the biggest holders (ties: the lower rank)."""
    held = np.asarray(counts, dtype=np.int64).reshape(-1, group_size)
    base, extra = np.divmod(held.sum(axis=1), group_size)
    order = np.argsort(-held, axis=1, kind="stable")  # biggest first, lower rank on ties
    place = np.empty_like(order)
    np.put_along_axis(place, order, np.arange(group_size)[None, :], axis=1)
    return (base[:, None] + (place < extra[:, None])).reshape(-1).tolist()


def balanced_layout(
    by_rank: list[list[Piece]], topology: Topology, *, scope: str = "even"
) -> tuple[Layout, Moves]:
    """Tokens even over the world (``scope="even"``) or inside every node (``"node"``), moving
    as few as possible, same node first (module docstring). Returns the layout and its moves."""
    if scope not in ("even", "node"):
        raise ValueError(f"scope must be 'even' or 'node', got {scope!r}")
    world, num_nodes = topology.world_size, topology.num_nodes
    counts = [sum(end - start for _, start, end in pieces) for pieces in by_rank]
    nodes = [list(topology.ranks_of_node(n)) for n in range(num_nodes)]
    target = _targets(counts, topology.gpus_per_node if scope == "node" else world)

    kept: list[list[Piece]] = [[] for _ in range(world)]
    need = [0] * world
    surplus_of_node: list[list[tuple[int, Piece]]] = [[] for _ in range(num_nodes)]
    for rank, pieces in enumerate(by_rank):
        if counts[rank] <= target[rank]:  # keeps everything: no cutting needed
            kept[rank].extend(pieces)
            need[rank] = target[rank] - counts[rank]
            continue
        room = target[rank]
        surplus = surplus_of_node[topology.node_of(rank)]
        for seq, start, end in pieces:
            take = min(end - start, room)
            if take > 0:
                kept[rank].append((seq, start, start + take))
                room -= take
            if start + take < end:
                surplus.append((rank, (seq, start + take, end)))

    # Same node first: NVLink moves are cheap, NIC moves are not.
    moves: Moves = {}
    needy_of_node = [[r for r in ranks if need[r] > 0] for ranks in nodes]
    for node in range(num_nodes):
        _fill(surplus_of_node[node], needy_of_node[node], need, kept, moves)
    leftover = [item for surplus in surplus_of_node for item in surplus]
    needy = [r for needy_ranks in needy_of_node for r in needy_ranks]
    _fill(leftover, needy, need, kept, moves)
    assert not leftover and not needy and not any(need), "linear layout lost tokens"
    return _merged(kept), moves


def _count_moves(counts: list[int], target: list[int], topology: Topology) -> Moves:
    """The moves ``balanced_layout`` makes, from token counts alone (``_move_arrays``)."""
    src, dst, tokens = _move_arrays(counts, target, topology)
    return dict(zip(zip(src.tolist(), dst.tolist()), tokens.tolist()))


def _move_arrays(
    counts: list[int], target: list[int], topology: Topology
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The moves ``balanced_layout`` makes, from token counts alone, as (holder, receiver,
    tokens) arrays, every pair once: surplus is handed out in holder order to needy ranks in
    rank order, same node first, exactly as ``_fill`` does (``_match`` on every node's streams
    at once, then on what is left over, which pairs ranks of different nodes only)."""
    k = topology.gpus_per_node
    diff = np.asarray(counts, dtype=np.int64) - np.asarray(target, dtype=np.int64)
    surplus, need = np.maximum(diff, 0), np.maximum(-diff, 0)
    # Node n's two streams start at one offset, past the end of node n-1's longer one.
    longer = np.maximum(surplus.reshape(-1, k).sum(axis=1), need.reshape(-1, k).sum(axis=1))
    first = _match(surplus, need, np.repeat(np.cumsum(longer) - longer, k))
    # Every node has surplus or need left, not both: what is left goes across nodes, in order.
    surplus -= np.bincount(first[0], weights=first[2], minlength=len(diff)).astype(np.int64)
    need -= np.bincount(first[1], weights=first[2], minlength=len(diff)).astype(np.int64)
    second = _match(surplus, need, np.zeros(len(diff), dtype=np.int64))
    src, dst, tokens = (np.concatenate(pair) for pair in zip(first, second))
    return src, dst, tokens


def _match(
    give: np.ndarray, take: np.ndarray, offset: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two pointers over the ranks in order, as arrays: every group of ranks with one
    ``offset`` lays its ``give`` tokens end to end from that offset, and its ``take`` tokens
    likewise; a giver's tokens go to the takers they overlap. Returns (giver, taker, tokens)
    of every pair that moves tokens."""

    def stretches(amount: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        before = np.cumsum(amount) - amount
        group = np.flatnonzero(np.r_[True, offset[1:] != offset[:-1]])
        start = offset + before - np.repeat(before[group], np.diff(np.r_[group, len(offset)]))
        ranks = np.flatnonzero(amount > 0)
        return ranks, start[ranks], start[ranks] + amount[ranks]

    giver, a, b = stretches(give)
    taker, c, d = stretches(take)
    lo = np.unique(np.concatenate([a, b, c, d]))[:-1]  # where a (giver, taker) piece may start
    i = np.searchsorted(a, lo, side="right") - 1
    j = np.searchsorted(c, lo, side="right") - 1
    ok = (i >= 0) & (j >= 0)
    i, j, lo = i[ok], j[ok], lo[ok]
    ok = (lo < b[i]) & (lo < d[j])
    i, j, lo = i[ok], j[ok], lo[ok]
    return giver[i], taker[j], np.minimum(b[i], d[j]) - lo


def moved_tokens(moves: Moves, topology: Topology) -> dict[str, int]:
    """Tokens moved inside nodes and between nodes."""
    out = {"intra_node": 0, "inter_node": 0}
    for (a, b), n in moves.items():
        out["intra_node" if topology.same_node(a, b) else "inter_node"] += n
    return out


def price_linear_layouts(
    counts: Sequence[int],
    attention_s: Sequence[float],
    topology: Topology,
    cost_model: CostModel,
    candidates: Sequence[str] = LAYOUTS,
    *,
    prune: bool = False,
) -> dict[str, float]:
    """Every candidate layout's predicted layer time (``steptime.layer_seconds``), from each
    rank's attention tokens and attention seconds (compute plus unhidden transfers) alone.
    With ``prune`` (and the attention layout among them), a layout that moves tokens is left
    out where it cannot beat the attention layout: it takes at least ``max(attention)`` plus
    the linear seconds of its busiest rank's target, ``ceil(tokens / ranks)`` of the fullest
    group, plus the least its remapping can take with one rank giving or taking as many tokens
    as the most any does (``steptime.remap_floor``). The best time, and the layout that has it,
    stay the same."""
    unknown = [c for c in candidates if c not in LAYOUTS]
    if unknown or not candidates:
        raise ValueError(f"linear layouts must be among {LAYOUTS}, got {list(candidates)}")
    world = topology.world_size
    held = np.asarray(counts, dtype=np.int64)
    attention = np.asarray(attention_s, dtype=np.float64)
    busiest = float(attention.max())
    predicted: dict[str, float] = {}
    for name in sorted(candidates, key=LAYOUTS.index):  # least moving first: wins ties
        group = topology.gpus_per_node if name == "node" else world
        if name == "attention":
            tokens, remap_s = counts, 0.0
        else:
            bar = _NO_WIN * predicted["attention"] if prune and "attention" in predicted else None
            if bar is not None:
                linear_s = _fullest_target_seconds(held, group, cost_model)
                if linear_s + busiest > bar:
                    continue  # its tokens alone rule it out
            tokens = _targets(counts, group)
            if bar is not None:
                most = int(np.abs(held - np.asarray(tokens)).max())
                if linear_s + remap_floor(most, cost_model) + busiest > bar:
                    continue  # and with the least its remapping can take
            src, dst, moved = _move_arrays(list(counts), tokens, topology)
            remap_s = remap_seconds_of(src, dst, moved, topology, cost_model)
        linear = cost_model.linear_times(np.asarray(tokens, dtype=np.float64))
        predicted[name] = layer_seconds(linear, attention, remap_s)
    return predicted


_NO_WIN = 1.0 + 1e-12
"""A bound this far above the attention layout's time rules a layout out, rounding aside."""


def _fullest_target_seconds(held: np.ndarray, group: int, cost_model: CostModel) -> float:
    """The linear seconds of the busiest rank of a layout evening ``held`` tokens over groups of
    ``group`` ranks: ``ceil(tokens / group)`` of the fullest group (``price_linear_layouts``'
    ``prune``)."""
    fullest = int(held.reshape(-1, group).sum(axis=1).max())
    return float(cost_model.linear_times(np.asarray([-(-fullest // group)]))[0])


def fastest(predicted: dict[str, float]) -> str:
    """The layout of least predicted time; ties go to the one that moves less."""
    return min(predicted, key=lambda name: (predicted[name], LAYOUTS.index(name)))


def choose_linear_layout(
    by_rank: list[list[Piece]],
    topology: Topology,
    cost_model: CostModel,
    attention_s: Sequence[float],
    *,
    candidates: Sequence[str] = LAYOUTS,
) -> tuple[Layout, Moves, str, dict[str, float]]:
    """The candidate layout (module docstring) with the least predicted layer time, given each
    rank's predicted attention seconds. Returns the layout, its moves, its name and every
    candidate's predicted seconds. Candidates are priced from token counts alone; only the
    winner's ranges are built."""
    counts = [sum(end - start for _, start, end in pieces) for pieces in by_rank]
    predicted = price_linear_layouts(counts, attention_s, topology, cost_model, candidates)
    name = fastest(predicted)
    return build_linear_layout(by_rank, topology, name) + (name, predicted)


def build_linear_layout(
    by_rank: list[list[Piece]], topology: Topology, name: str
) -> tuple[Layout, Moves]:
    """The ranges (and moves) of layout ``name``."""
    if name == "attention":
        return _merged([list(p) for p in by_rank]), {}
    return balanced_layout(by_rank, topology, scope=name)
