"""The linear layout: even tokens per GPU, moving as few tokens as possible, same node first.

Linear modules (QKV, projections, MLP, loss) cost the same per token, so every rank should hold
``total // world`` tokens, with the remainder's extra token going to the ranks that already hold
the most (fewer moves). Each rank keeps the first of its attention tokens (in its canonical
attention order) up to its target; the rest form a surplus that fills ranks short of tokens,
first on the same node (NVLink), then on other nodes (NICs). Surplus pieces are handed out in
rank order and cut only where a receiver is full, so ranges stay few and contiguous; a rank's
ranges are listed by (document, start), with touching ranges merged.

The capacity holds automatically: ``ceil(total / world) <= capacity`` whenever the batch fits
the cluster at all.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_zeppelin.planner.plan import SequencePlan, TokenRange
from megatron_zeppelin.topology.model import Topology

Piece = tuple[int, int, int]
"""``(seq, start, end)``: a token range of one document."""


def attention_ranges_by_rank(
    sequences: Sequence[SequencePlan], world_size: int
) -> list[list[Piece]]:
    """Every rank's attention ranges in canonical order (documents by id, spans as listed)."""
    by_rank: list[list[Piece]] = [[] for _ in range(world_size)]
    for seq in sequences:
        for span in seq.attention:
            by_rank[span.rank].append((seq.id, span.start, span.end))
    return by_rank


def _merged(pieces: list[Piece]) -> tuple[TokenRange, ...]:
    pieces.sort()
    out: list[list[int]] = []
    for seq, start, end in pieces:
        if out and out[-1][0] == seq and out[-1][2] == start:
            out[-1][2] = end
        else:
            out.append([seq, start, end])
    return tuple(TokenRange(seq, start, end) for seq, start, end in out)


def _fill(surplus: list[tuple[int, Piece]], needy: list[int], need: list[int], received) -> int:
    """Hand out ``surplus`` pieces (with their holder) to the ranks in ``needy`` in order;
    returns how many tokens moved. Leaves the undelivered pieces in ``surplus``."""
    moved = 0
    left: list[tuple[int, Piece]] = []
    pos = 0
    for holder, (seq, start, end) in surplus:
        while start < end and pos < len(needy):
            rank = needy[pos]
            take = min(end - start, need[rank])
            received[rank].append((seq, start, start + take))
            need[rank] -= take
            moved += take
            start += take
            if need[rank] == 0:
                pos += 1
        if start < end:
            left.append((holder, (seq, start, end)))
    del needy[:pos]
    surplus[:] = left
    return moved


def build_linear_layout(
    by_rank: list[list[Piece]], topology: Topology, *, remap: bool = True
) -> tuple[tuple[tuple[TokenRange, ...], ...], dict[str, int]]:
    """Per-rank linear ranges and the tokens moved (``intra_node``, ``inter_node``)."""
    world = topology.world_size
    if not remap:
        return tuple(_merged(list(p)) for p in by_rank), {"intra_node": 0, "inter_node": 0}
    counts = [sum(end - start for _, start, end in pieces) for pieces in by_rank]
    base, extra = divmod(sum(counts), world)
    target = [base] * world
    for rank in sorted(range(world), key=lambda r: (-counts[r], r))[:extra]:
        target[rank] += 1

    kept: list[list[Piece]] = [[] for _ in range(world)]
    need = [0] * world
    surplus_of_node: list[list[tuple[int, Piece]]] = [[] for _ in range(topology.num_nodes)]
    for rank, pieces in enumerate(by_rank):
        room = target[rank]
        surplus = surplus_of_node[topology.node_of(rank)]
        for seq, start, end in pieces:
            take = min(end - start, room)
            if take > 0:
                kept[rank].append((seq, start, start + take))
                room -= take
            if start + take < end:
                surplus.append((rank, (seq, start + take, end)))
        need[rank] = room

    # Same node first: NVLink moves are cheap, NIC moves are not.
    moved = {"intra_node": 0, "inter_node": 0}
    needy_of_node = [
        [r for r in topology.ranks_of_node(node) if need[r] > 0]
        for node in range(topology.num_nodes)
    ]
    for node in range(topology.num_nodes):
        moved["intra_node"] += _fill(surplus_of_node[node], needy_of_node[node], need, kept)
    leftover = [item for surplus in surplus_of_node for item in surplus]
    needy = [r for needy_ranks in needy_of_node for r in needy_ranks]
    moved["inter_node"] += _fill(leftover, needy, need, kept)
    assert not leftover and not needy and not any(need), "linear layout lost tokens"
    return tuple(_merged(pieces) for pieces in kept), moved
