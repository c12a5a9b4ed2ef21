"""The planner's last resort under tight capacity: every GPU filled to the same token count.

Placement (``placement.py``) can run out of room when a batch nearly fills the cluster: whole
documents and rings over whole nodes leave gaps no remaining document fits. The layout here fits
every batch that fits the cluster, ``ceil(tokens / world)`` tokens per GPU:

- the ``wide`` longest documents run as rings over every GPU, each GPU holding an equal share of
  each as zigzag chunks (the shares' remainders rotate over the GPUs, so no GPU holds more than
  one token above another);
- the other documents, longest first or dealt longest first to the GPU with the fewest tokens
  so far (which evens both tokens and quadratic work), are laid end to end in that order over
  what room each GPU has left; a document that does not end on its GPU continues on the next
  ones, a ring over those GPUs with each holding its tokens as zigzag chunks.

``partition.py`` tries a few values of ``wide``, each with both orders, and keeps the fastest by
the simulator's step time; ``docs/DESIGN.md`` ("Tight capacity") has the reasoning.
"""

from __future__ import annotations

import heapq

import numpy as np

from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import Placement
from megatron_zeppelin.planner.plan.plan import SequencePlan, Span, Tier
from megatron_zeppelin.planner.search.candidate import Candidate

__all__ = ["spread_evenly", "wide_choices", "zigzag_pieces"]


def wide_choices(array: np.ndarray, world: int) -> list[int]:
    """How many of the longest documents to try as rings over every GPU: none, then powers of
    two up to the documents longer than a GPU's share of the batch."""
    share = -(-int(array.sum()) // world)
    long = int((array > share // 2).sum())
    choices, wide = [0], 1
    while wide <= long:
        choices.append(wide)
        wide *= 2
    if long and choices[-1] != long:
        choices.append(long)
    return choices


def spread_evenly(array: np.ndarray, loads: Loads, wide: int = 0, deal: bool = True) -> Candidate:
    """The layout of the module docstring, its ``wide`` longest documents over every GPU; with
    ``deal=False`` the others are laid end to end longest first instead of dealt. ``loads`` must
    be fresh: its token counts are filled in here."""
    topology = loads.topology
    world = topology.world_size
    per_rank = -(-int(array.sum()) // world)
    assert per_rank <= loads.capacity, "plan_batch checks the batch fits the cluster"
    order = np.lexsort((np.arange(len(array)), -array)).tolist()
    pieces: list[list[tuple[int, int]]] = [[] for _ in array]
    offset = 0
    for doc in order[:wide]:
        length = int(array[doc])
        base, extra = divmod(length, world)
        for rank in range(world):
            take = base + (1 if (rank - offset) % world < extra else 0)
            if take:
                pieces[doc].append((rank, take))
                loads.tokens[rank] += take
        offset = (offset + extra) % world
    rest = _dealt(array, order[wide:], world) if deal else order[wide:]
    _lay_end_to_end(array, rest, loads, per_rank, pieces)
    placements: list[Placement] = []
    sequences: list[SequencePlan] = []
    for doc, length in enumerate(array.tolist()):
        ring = tuple(rank for rank, _ in pieces[doc])
        tier = Tier.of_ring(ring, topology.gpus_per_node)
        placements.append(Placement(tier, ring))
        spans = tuple(zigzag_pieces(length, pieces[doc]))
        sequences.append(SequencePlan(doc, length, tier, ring, spans))
    candidate = Candidate(placements, loads, 0, 0, {})
    candidate.sequences = tuple(sequences)
    return candidate


def _dealt(array: np.ndarray, docs: list[int], world: int) -> list[int]:
    """``docs`` (longest first) dealt to the GPU with the fewest tokens so far, returned GPU by
    GPU: the order in which they are laid end to end."""
    heap = [(0, rank) for rank in range(world)]
    hands: list[list[int]] = [[] for _ in range(world)]
    for doc in docs:
        tokens, rank = heap[0]
        hands[rank].append(doc)
        heapq.heapreplace(heap, (tokens + int(array[doc]), rank))
    return [doc for hand in hands for doc in hand]


def _lay_end_to_end(
    array: np.ndarray,
    docs: list[int],
    loads: Loads,
    per_rank: int,
    pieces: list[list[tuple[int, int]]],
) -> None:
    """``docs`` laid end to end over the ranks in order, each rank filled to ``per_rank``
    tokens (counting what it already holds); appends each document's ``(rank, tokens)``."""
    world = loads.topology.world_size
    rank = 0
    room = per_rank - loads.tokens[0]
    for doc in docs:
        length, pos = int(array[doc]), 0
        while pos < length:
            while room <= 0 and rank + 1 < world:
                rank += 1
                room = per_rank - loads.tokens[rank]
            take = min(length - pos, room) if rank + 1 < world else length - pos
            pieces[doc].append((rank, take))
            loads.tokens[rank] += take
            pos, room = pos + take, room - take


def zigzag_pieces(length: int, pieces: list[tuple[int, int]]) -> list[Span]:
    """A document's spans where the ``i``-th rank of its ring holds ``take_i`` tokens: half of
    them from the front and half from the back, as zigzag chunks, so every rank's causal work
    is about the same (contiguous pieces would leave the last rank attending to the whole
    document)."""
    front, back, spans = 0, length, []
    for rank, take in pieces:
        head, tail = take - take // 2, take // 2
        if head:
            spans.append(Span(rank, front, front + head))
        if tail:
            spans.append(Span(rank, back - tail, back))
        front, back = front + head, back - tail
    assert front == back, "the pieces cover the document"
    return spans
