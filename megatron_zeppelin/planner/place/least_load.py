"""The batch's least load: the least load every GPU could end at, in the planner's pricing.

A load ``T`` is *feasible* when every document has a placement whose members each carry at most
``T`` (whole on one GPU, or a ring of ``ring_options.options``, its busiest member at
``Loads.ring_key``), and the batch's work, every document at the least work of such placements,
fits the GPUs: at most ``world * T``. A ring does more work than its document whole (its chunks
compute less efficiently, its transfers may not hide), the more so the wider it is: the lower
``T``, the wider the long documents' rings and the more work there is to share out. The least
load is the least feasible ``T``.

The options are the pool's, and rings over whole nodes whatever their pieces (the staged
placement's rings across nodes), so no placement of the search has its busiest GPU below it: a
ring's work counts each member at the least any member carries
(``ring_options.least_member_load``), so no placement does less
(short of a cost model whose kernels run faster on split documents than whole: the bound takes
a document's whole work as the least it can do). The search uses it twice (``search.py``): the
pool is not tried where the staged placement is already within reach of it, and where the long
documents' rings set it (well above the mean work), the pool sized to it goes first and a
placement within a few percent of it ends the search.

A batch whose longest documents need many nodes each (a few documents of 100K tokens or more on
a thousand GPUs) is where this matters: each ring alone would end soonest on a dozen or more
nodes, together they want more nodes than there are, and the least load says how wide each can
be.

How it is computed, without pricing every ring: documents of at most a GPU's share of the work
stay whole at any feasible ``T`` (which is at least that share). The others, heaviest first, are
priced from the narrowest ring that may carry the bound so far (a ring does at least the
document's whole work, so narrower ones carry more) up to the first that does; the bound starts
at the share and rises to a document's least per-member load where it has none below it. The
bound and every document at its least work within it give a load the answer cannot exceed, so
the rings narrower than those priced are priced only down to the narrowest that may carry that.
Each document's least work is then a step function of ``T``, and one sweep over all their steps
finds the least ``T`` at which the work fits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.ring_options import (
    PoolGoal,
    least_member_load,
    narrowest,
    options,
    price,
)

__all__ = ["least_load"]

_PAST_BEST = 4
"""Node counts priced past the least per-member load of a ring over whole nodes before the scan
of a document that never gets within the bound stops (wider rings only carry more)."""


def least_load(
    array: np.ndarray,
    balanced: np.ndarray,
    loads: Loads,
    *,
    nic_chunk: int,
    member_tokens: int,
) -> float:
    """The batch's least load (module docstring). ``balanced``: each document's work whole
    (attention plus the linear seconds ``loads`` balances); ``loads``: empty loads pricing the
    rings as the pool places them; ``nic_chunk`` and ``member_tokens`` as in ``PoolGoal``."""
    world = loads.topology.world_size
    rest = float(balanced.sum())
    share = rest / world
    heavy = np.flatnonzero((balanced > share) | (array > loads.capacity))
    heavy = heavy[np.lexsort((heavy, -balanced[heavy]))].tolist()
    goal = PoolGoal(0.0, 0, nic_chunk, member_tokens)
    bound = share
    tables: list[tuple[int, float, _Table]] = []
    for doc in heavy:
        length, whole = int(array[doc]), float(balanced[doc])
        rest -= whole  # counted at its least work instead
        table = _placements(length, whole, loads, goal, bound)
        if table.priced:  # else it fits nowhere: the placement itself says so
            bound = max(bound, min(key for key, _ in table.priced))
            tables.append((length, whole, table))
    # Every document at its least work within the bound fits the GPUs at this load, so the
    # least load is no higher: placements that carry more than it play no part.
    within = sum(min(w for key, w in t.priced if key <= bound) for _, _, t in tables)
    upper = max(bound, (rest + within) / world)
    steps: list[tuple[float, int, float]] = []  # (load, document, its least work from there)
    for index, (length, whole, table) in enumerate(tables):
        least = math.inf
        for key, work in sorted(table.priced + table.narrower(length, whole, loads, goal, upper)):
            if work < least:
                steps.append((key, index, work))
                least = work
    return _sweep(sorted(steps), len(tables), rest, world, share)


@dataclass
class _Table:
    """A document's placements priced so far: ``(busiest member's load, work)`` each, its
    rings from ``first`` GPUs on."""

    priced: list[tuple[float, float]]
    first: int

    def narrower(
        self, length: int, whole: float, loads: Loads, goal: PoolGoal, upper: float
    ) -> list[tuple[float, float]]:
        """The rings narrower than ``first`` whose members may carry at most ``upper``."""
        out: list[tuple[float, float]] = []
        for size in _sizes(length, loads, goal, _fewest(length, whole, loads, goal, upper)):
            if size >= self.first:
                break
            out += _priced(length, size, loads, goal)
        return out


def _fewest(length: int, whole: float, loads: Loads, goal: PoolGoal, most: float) -> int:
    """The narrowest ring whose members may carry at most ``most``: a ring does at least the
    document's whole work (its chunks compute no more efficiently), so narrower ones carry
    more; and its members take at most ``goal.member_tokens`` tokens (``PoolGoal``)."""
    low = narrowest(length, loads, goal.member_tokens)
    return max(low, math.floor(whole / most)) if most > 0 else low


def _sizes(length: int, loads: Loads, goal: PoolGoal, start: int) -> Iterator[int]:
    """Ring sizes from ``start`` up that may have a placement (``ring_options.options``): any
    up to the largest flat ring whose pieces hide a NIC transfer, whole nodes past it."""
    k, world = loads.topology.gpus_per_node, loads.topology.world_size
    flat_top = max(k, length // max(1, goal.nic_chunk))
    size = start if start <= flat_top else -(-start // k) * k
    while size <= world:
        yield size
        size = size + 1 if size < flat_top else (size // k + 1) * k


def _placements(length: int, whole: float, loads: Loads, goal: PoolGoal, stop: float) -> _Table:
    """The document whole (its work ``whole``) where it fits a GPU, then its rings by size
    upward, from the narrowest that may carry ``stop`` (``_fewest``), until one carries at most
    ``stop`` (where none does, the narrower ones too). A ring's work counts every member at the
    least it may carry (``ring_options.least_member_load``), so that no placement does less.
    Past the largest flat ring whose pieces hide a NIC transfer only whole nodes are priced, and
    no further than ``_PAST_BEST`` node counts past the least load they reach. A ring over whole
    nodes (the 2-D scheme) may do less work than a flat ring of fewer GPUs: where one of those
    ends the scan, whole nodes are priced on until one carries at most ``stop`` or does more
    work."""
    k = loads.topology.gpus_per_node
    out: list[tuple[float, float]] = []
    first = _fewest(length, whole, loads, goal, stop)
    if length <= loads.capacity:
        out.append((whole, whole))
        if whole <= stop:
            return _Table(out, 2)
    if length < 2:
        return _Table(out, first)
    least, since_least, size = math.inf, 0, first
    for size in _sizes(length, loads, goal, first):
        priced = _priced(length, size, loads, goal)
        out += priced
        if priced and min(priced)[0] < least:
            least, since_least = min(priced)[0], 0
        elif size >= max(k, length // max(1, goal.nic_chunk)):
            since_least += 1  # whole nodes past the least load they reach
        if least <= stop or since_least > _PAST_BEST:
            break
    if least > stop:
        # Nothing carries ``stop``: the document's least load may lie among the narrower rings
        # too (the widest it may take can be narrower than ``first``).
        low = _fewest(length, whole, loads, goal, 0.0)
        for narrower in _sizes(length, loads, goal, low):
            if narrower >= first:
                break
            out += _priced(length, narrower, loads, goal)
        return _Table(out, low)
    if loads.two_d is None or loads.topology.num_nodes < 2:
        return _Table(out, first)
    fewest = min(work for key, work in out if key <= stop)
    for nodes in range(max(2, -(-size // k)), loads.topology.num_nodes + 1):
        whole_nodes = _priced(length, nodes * k, loads, goal, where="whole")
        out += whole_nodes
        if any(key <= stop or work >= fewest for key, work in whole_nodes):
            break
    return _Table(out, first)


def _priced(
    length: int, size: int, loads: Loads, goal: PoolGoal, where: str | None = None
) -> list[tuple[float, float]]:
    """``(busiest member's load, work)`` of each placement of a ring of ``size`` (or only the
    one at ``where``): the pool's options (``ring_options.options``), and over whole nodes
    whatever the length of the pieces, as the staged placement's rings across nodes go (flat,
    or 2-D where faster): the least load bounds every candidate of the search, not only the
    pool's."""
    k = loads.topology.gpus_per_node
    found = {at: key for key, at in options(length, size, loads, goal, wide=True)}
    if size % k == 0 and size > k and "whole" not in found:
        found["whole"] = price(length, size, loads, two_d=True)
    return [
        (key, size * least_member_load(length, size, loads, at))
        for at, key in found.items()
        if where in (None, at)
    ]


def _sweep(
    steps: list[tuple[float, int, float]], num_docs: int, rest: float, world: int, floor: float
) -> float:
    """The least ``T`` at which every document has a placement within ``T`` and the work fits
    ``world * T``: ``steps`` (sorted) say from which load on each document's least work is
    what; ``rest`` is the work of the documents without steps; ``floor`` a least answer."""
    work = [math.inf] * num_docs
    missing, total = num_docs, rest
    i = 0
    while i < len(steps):
        load = steps[i][0]
        while i < len(steps) and steps[i][0] <= load:  # every step at this load
            _, doc, least = steps[i]
            missing -= work[doc] == math.inf
            total += least - (0.0 if work[doc] == math.inf else work[doc])
            work[doc] = least
            i += 1
        if missing:
            continue
        # Up to the next step every document's least work stays what it is now.
        answer = max(load, floor, total / world)
        if i == len(steps) or answer < steps[i][0]:
            return answer
    return max(floor, rest / world)  # no document needs more than its whole work
