"""The planner's search: candidate placements of a batch, kept by the simulator's step time.

It starts from the batch's least load (``least_load.py``), under which no placement ends in the
planner's pricing. Where the long documents' rings set it (more than ``_RING_BOUND`` above the
GPUs' mean work), the pool placement with rings sized to it is placed first, and a placement
whose busiest GPU ends within ``_CLOSE`` of it ends the search, kept with ``Loads``' prediction
(``_settle``): no other could be faster by more than ``Loads`` and the simulator differ by.

Otherwise, or where none comes that close, the staged placements are placed variant by variant
(``staged.py``: balancing attention + linear or attention alone, rings packed or wide, more
in-node rings while the busiest GPU stays above the mean, every ring flat). Where no placement
so far is predicted even enough, the placements over the GPUs as one pool are candidates too
(``pool.place_pool``: rings sized to the pool's target on any GPUs, across nodes over part of a
node's GPUs where that fits best, in each order of ``pool.pool_orders``, then each of its
retries where those pack unevenly), each refined by moving whole documents and rings off its
busiest GPU (``refine.refine``); where every document is a ring (the pool's ring orders), the
placement with uneven ring shares is a candidate beside them (``shares.place_shares``:
documents laid end to end along each node's GPUs).

Placements are built with ``Loads``' per-document predictions; the staged ones predicted within
``_SHORTLIST`` of the best, and the best few pool ones predicted within it of the best staged
one, are timed with the simulator's own functions (``simulator.attention_seconds``,
``steptime.layer_seconds``), the pool's first, less those predicted too far above one timed
already to matter (``_UNDERCUT``), and the fastest is kept; the plan's
``meta["predicted_step_s"]`` is then what ``simulate`` reports for it (``meta["timed_by"] ==
"simulator"``). The fastest timed staged placement and the fastest timed pool placement are then
each refined again on the simulator's per-GPU figures (which see rings across nodes sharing a
node's NICs wait on each other) and timed once more (``_retime``), the staged one unless it is
timed more than ``_RETIME_BEHIND`` above the pool one; the fastest of all stays. A lone
candidate keeps ``Loads``' prediction (``"planner estimate"``): there is nothing to choose, and
timing a thousand-GPU plan costs as much as placing it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import CapacityError, TierChoice
from megatron_zeppelin.planner.place.pool import (
    RING_ORDERS,
    PoolBatch,
    PoolGoal,
    PoolOrder,
    early_count,
    place_pool,
    pool_batch,
    pool_goal,
    pool_orders,
)
from megatron_zeppelin.planner.place.refine import refine
from megatron_zeppelin.planner.place.shares import place_shares
from megatron_zeppelin.planner.place.tiers import TierRules, assign_tiers
from megatron_zeppelin.planner.plan.linear_layout import price_linear_layouts
from megatron_zeppelin.planner.search.candidate import Candidate, distinct, priced
from megatron_zeppelin.planner.search.staged import staged_candidates

__all__ = ["Candidate", "search"]

_SHORTLIST = 1.05
"""Placements predicted within this factor of the best are timed by the simulator..."""
_MAX_TIMED = 2
"""... the best predicted few of them."""
_MAX_POOL_TIMED = 3
"""The pool placements timed beside them: the best predicted few of those within
``_SHORTLIST`` of the best staged one. A pool order's rings sharing a node's NICs may run a few
percent slower than ``Loads`` predicts, so more than one is timed; over the benchmark batches
(``scripts/plan_digests.py``) timing the best three kept every step within 1e-4 of timing all
of them, where the best two lost 3% on one batch."""
_POOL_GAIN = 1.03
"""The pool placement is tried only where it could end more than this factor below the best
placement so far: its busiest GPU is at least the batch's least load
(``least_load.least_load``), and where that is this close the staged placement's packing leaves
nothing worth its planning time."""
_POOL_STOP = 1.15
"""The pool's orders stop at one predicted this far above the best placement so far."""
_POOL_EVEN = 1.04
"""The pool's retries (``pool.POOL_RETRIES``) are placed only where no pool placement so far
is predicted within this factor of its GPUs' mean."""
_POOL_PACKED = 1.3
"""... and only where one is within this factor: further above, one ring's share sets the
busiest GPU, which resizing the others does not change."""
_RETIME_SWAPS = 4096
"""About how many local documents ``_retime``'s swaps weigh per change: the least loaded GPUs
holding that many on average (every GPU where documents are few per GPU)..."""
_RETIME_WEIGHED = 1 << 20
"""... and over all its changes: ``_retime`` makes at most this many over the swaps it weighs
per change."""
_UNDERCUT = 0.96
"""The simulator has timed a shortlisted candidate at most this far below ``Loads``'
prediction (over the benchmark batches, ``scripts/plan_digests.py``: 0.976 at the least, of
776 timings): a candidate predicted more than this far above one timed already is not timed
(``_timed``)."""
_RETIME_BEHIND = 1.15
"""The fastest timed staged placement is not refined again (``_retime``) where it is timed this
far above the fastest timed pool placement. Over the benchmark batches
(``scripts/plan_digests.py``) that refinement turned a staged placement timed 7.6% behind into
one 1.8% ahead, and no wider gap: with the staged placement left as it is from 10% behind,
every step stays as it was."""
_CLOSE = 1.025
"""Where the long documents' rings set the step (``_RING_BOUND``), a placement whose busiest
GPU is within this factor of the batch's least load (``least_load.least_load``, under which no
placement ends) ends the search: no other could be faster by more than ``Loads`` and the
simulator differ by."""
_RING_BOUND = 1.1
"""A batch whose least load is this far above its GPUs' mean work is set by its long
documents' rings, not by how the others pack: the pool with rings sized to the least load goes
first, and a placement within ``_CLOSE`` of it ends the search."""
_TIGHT = 0.985
"""That first pool placement sizes its rings to this share of the least load (its members may
end ``ring_options.TOLERANCE`` above what they are sized to)."""


@dataclass(frozen=True)
class _Batch:
    """What every candidate of one batch is placed from and priced under."""

    array: np.ndarray
    """The documents' lengths."""
    new_loads: Callable[[bool, bool], Loads]
    """Empty loads, by balance mode and whether the 2-D scheme is allowed (``search``)."""
    rules: TierRules
    layouts: tuple[str, ...]
    """The linear layouts allowed."""
    routing: bool
    world: int
    stage_1: TierChoice
    """Stage 1 of the pool and of the first staged placement alike: attention + linear, 2-D
    allowed."""
    pool: PoolBatch | None
    """``pool.pool_batch`` of ``stage_1`` (the pool's target and the batch's least load), where
    the pool may be placed."""

    @property
    def least_load(self) -> float | None:
        return self.pool.least_load if self.pool is not None else None

    def within_reach(self, peak: float) -> bool:
        """Whether a busiest GPU at ``peak`` (``Loads.cost``) is within ``_CLOSE`` of the
        least load."""
        return self.pool is not None and peak <= _CLOSE * self.pool.least_load

    def close_enough(self, candidate: Candidate) -> bool:
        """``within_reach`` of ``candidate``'s busiest GPU (a candidate that balances attention
        alone is priced in other units)."""
        return candidate.balance_linear and self.within_reach(candidate.peak)


def search(
    array: np.ndarray,
    new_loads: Callable[[bool, bool], Loads],
    rules: TierRules,
    layouts: tuple[str, ...],
    *,
    routing: bool,
    pool: bool = True,
) -> tuple[Candidate, list[dict], float | None]:
    """The fastest candidate (module docstring), a summary of every one tried, and the batch's
    least load (``least_load.least_load``; ``None`` where the pool is not placed).
    ``new_loads(balance_linear, two_d)`` gives empty loads to place on (``two_d``: where the
    planner's options allow the 2-D scheme)."""
    stage_loads = new_loads(True, True)
    stage_1 = assign_tiers(array, stage_loads, rules)
    pool = pool and rules.allow_split and rules.auto
    pooled = pool_batch(array, stage_1, new_loads(True, True), rules.chunks[1]) if pool else None
    world = stage_loads.topology.world_size
    batch = _Batch(array, new_loads, rules, layouts, routing, world, stage_1, pooled)
    found: list[Candidate] = []
    first_pool: list[Candidate] = []
    # Where the long documents' rings, not the packing, set the least load, the pool sized to
    # it goes first, and a placement that comes close enough to it ends the search.
    ring_bound = pooled is not None and pooled.least_load > _RING_BOUND * pooled.share
    if ring_bound:
        first = _pool_candidate(batch, PoolOrder(None, _TIGHT), least=True)
        first_pool += [first] if first is not None else []
        found += first_pool
        if first_pool and batch.close_enough(first_pool[0]):
            return _settle(batch, found)
    tiers = {(True, True): stage_1}
    for candidate in staged_candidates(array, new_loads, rules, layouts, tiers, found):
        found.append(candidate)
        if ring_bound and batch.close_enough(candidate):
            return _settle(batch, found)
    staged = distinct([c for c in found if not c.pooled])
    pool_tried = _pool_candidates(batch, staged, first_pool) if pool else first_pool
    return _keep_fastest(batch, staged, pool_tried)


def _settle(batch: _Batch, found: list[Candidate]) -> tuple[Candidate, list[dict], float | None]:
    """``search``'s answer where the last of ``found`` ends within ``_CLOSE`` of the least
    load: it is built and kept with ``Loads``' prediction (``Candidate.keep_estimate``); no
    other placement ends more than that below it, less than ``Loads`` and the simulator differ
    by, so nothing is left to compare."""
    best = found[-1]
    best.near_least_load = True
    best.build(batch.array, batch.routing)
    best.keep_estimate(batch.layouts)
    return best, [c.summary() for c in found], batch.least_load


def _keep_fastest(
    batch: _Batch, staged: list[Candidate], pooled: list[Candidate]
) -> tuple[Candidate, list[dict], float | None]:
    """``search``'s answer from every candidate placed: the staged ones predicted within
    ``_SHORTLIST`` of the best (``_MAX_TIMED`` at most) and the pool ones predicted within it of
    the best staged one (``_MAX_POOL_TIMED`` at most) are built and timed by the simulator where
    they can matter (``_timed``; a lone one keeps ``Loads``' prediction); the fastest timed of
    each kind is refined again on the simulator's figures (``_retime``; the staged one unless
    ``_RETIME_BEHIND`` of the pool one), and the fastest of all is kept."""
    within = _SHORTLIST * min(c.predicted_s for c in staged)
    # The pool's are timed beside the staged shortlist where predicted within it (``Loads``
    # misjudges them by a few percent, not by more).
    shortlist = _best_predicted(staged, within, _MAX_TIMED)
    shortlist += _best_predicted(pooled, within, _MAX_POOL_TIMED)
    if len(shortlist) > 1:
        shortlist = _timed(batch, shortlist)
    else:
        shortlist[0].build(batch.array, batch.routing)
        shortlist[0].keep_estimate(batch.layouts)
    found = staged + pooled
    best = min(shortlist, key=lambda c: c.seconds)
    if best.timed:
        # The fastest of each kind: a staged placement had no refinement pass of its own yet,
        # so it may gain more from this one than a faster pool placement does, unless it is
        # timed too far behind the fastest pool placement to catch up (``_RETIME_BEHIND``).
        fastest = {
            kind: min((c for c in shortlist if c.pooled == kind), key=lambda c: c.seconds)
            for kind in (True, False)
            if any(c.pooled == kind for c in shortlist)
        }
        pool = fastest.get(True)
        for kind, candidate in fastest.items():
            if not kind and pool is not None and candidate.seconds > _RETIME_BEHIND * pool.seconds:
                continue
            retimed = _retime(batch, candidate)
            if retimed is not None:
                found.append(retimed)
                best = min(best, retimed, key=lambda c: c.seconds)
    return best, [c.summary() for c in found], batch.least_load


def _timed(batch: _Batch, shortlist: list[Candidate]) -> list[Candidate]:
    """The candidates of ``shortlist`` built and timed by the simulator, in its order, less
    those whose prediction says they cannot matter: the pool placements are timed first, best
    predicted first, then the others. A candidate is passed over where even ``_UNDERCUT`` of its
    prediction is above a timed one of its kind (it can be neither the fastest nor the fastest
    of its kind, which ``_retime`` refines), and one not of the pool where that is above
    ``_RETIME_BEHIND`` times the fastest timed pool placement."""
    order = sorted(shortlist, key=lambda c: (not c.pooled, c.predicted_s))
    fastest: dict[bool, float] = {}  # the fastest timed so far, by kind (``c.pooled``)
    for candidate in order:
        floor = _UNDERCUT * candidate.predicted_s
        if floor > fastest.get(candidate.pooled, math.inf):
            continue
        if not candidate.pooled and floor > _RETIME_BEHIND * fastest.get(True, math.inf):
            continue
        candidate.build(batch.array, batch.routing)
        candidate.simulate(batch.layouts)
        fastest[candidate.pooled] = min(candidate.seconds, fastest.get(candidate.pooled, math.inf))
    return [c for c in shortlist if c.simulated]


def _best_predicted(candidates: list[Candidate], within: float, count: int) -> list[Candidate]:
    """The ``count`` best predicted of ``candidates`` predicted within ``within``, best first."""
    kept = [c for c in candidates if c.predicted_s <= within]
    return sorted(kept, key=lambda c: c.predicted_s)[:count]


def _retime(batch: _Batch, best: Candidate) -> Candidate | None:
    """``best`` (timed by the simulator) refined again on the simulator's per-GPU attention
    seconds: ``Loads`` prices each ring alone, the simulator also sees rings that share a node's
    NICs wait on each other, and a staged placement gets no other refinement. Each GPU's load
    becomes its simulated attention plus its linear seconds, ``refine.refine`` moves and swaps
    whole documents off the busiest GPUs (swaps with many GPUs, not only the lightest few; for
    a pool placement, with the pool's goal, rings too), and the result is timed by the
    simulator. ``None`` where nothing could move."""
    array, old = batch.array, best.loads
    world = old.topology.world_size
    loads = batch.new_loads(old.balance_linear, old.two_d is not None)
    loads.restore(old.snapshot(range(world)))
    # What the simulator found beyond the prediction, as transfers the GPU does not hide.
    excess = np.asarray(best.attention_s) - np.add(old.attention, old.exposed)
    for rank, extra in enumerate(excess.tolist()):
        loads.exposed[rank] += extra
        loads.cost[rank] += extra
    placements = list(best.placements)
    light = min(world, max(_RETIME_SWAPS * world // len(array), 1))
    rounds = max(_RETIME_WEIGHED // (light * len(array) // world + 1), 1)
    goal: PoolGoal | None = pool_goal(array, old, batch.rules.chunks[1]) if best.pooled else None
    if not refine(array, placements, loads, batch.stage_1.attention, rounds, goal, light=light):
        return None
    attention_s = np.add(loads.attention, loads.exposed).tolist()
    prices = price_linear_layouts(
        loads.tokens, attention_s, loads.topology, loads.cost_model, batch.layouts
    )
    retimed = Candidate(
        placements,
        loads,
        best.promotions,
        best.extra_rings,
        prices,
        pooled=best.pooled,
        shared=best.shared,
        retimed=True,
    )
    retimed.build(array, batch.routing)
    retimed.simulate(batch.layouts)
    return retimed


def _pool_candidates(
    batch: _Batch, found: list[Candidate], first: list[Candidate]
) -> list[Candidate]:
    """The placements over the GPUs as one pool (``pool.place_pool``, in each order of
    ``pool.pool_orders``), where no candidate so far (``found``) is even enough; an order that
    runs out of room is left out; where every document is a ring, the placement with uneven
    ring shares too (``shares.place_shares``). ``first``: the first pool placement where placed
    already (kept whatever the others)."""
    assert batch.pool is not None, "the pool is placed only where ``search`` made its batch"
    if any(c.even_enough() for c in found):
        return first
    staged = min(c.predicted_s for c in found)
    if batch.pool.least_load * _POOL_GAIN >= staged:
        return first  # no placement ends far enough below the staged ones (``least_load.py``)
    orders, retries = pool_orders(batch.array, batch.new_loads(True, True), batch.pool)
    out: list[Candidate] = list(first)
    placed = set()
    for order in _pool_orders(out, orders, retries):
        # Orders that differ in ``first`` alone but place as many documents before the rings
        # place alike: the repeat is not placed again (``distinct`` would drop it).
        alike = (early_count(batch.pool, order.first), order.scale, order.cross)
        if alike in placed:
            continue
        placed.add(alike)
        candidate = _pool_candidate(batch, order)
        if candidate is None:
            continue  # the order runs out of room
        out.append(candidate)
        if candidate.predicted_s > _POOL_STOP * staged:
            break  # the orders pack alike: one this far behind says the others will be too
    if orders == RING_ORDERS or len(batch.array) <= batch.world:
        # Every document a ring, or no more documents than GPUs: rings of whole GPUs pack
        # unevenly, uneven shares may not.
        loads = batch.new_loads(True, False)  # flat rings: a share of a ring is not a 2-D grid
        placements = place_shares(batch.array, loads)
        if placements is not None:
            out.append(priced(placements, loads, 0, batch.layouts, shared=True))
    return distinct(out)


def _pool_candidate(batch: _Batch, order: PoolOrder, *, least: bool = False) -> Candidate | None:
    """The pool placement in ``order`` (with ``least``, rings sized to the batch's least load
    instead of the pool's target), refined (``refine.refine``) unless ``least`` and it ends
    within ``_CLOSE`` of that load already; ``None`` where it runs out of room."""
    assert batch.pool is not None, "the pool is placed only where ``search`` made its batch"
    array, chunk = batch.array, batch.rules.chunks[1]
    loads = batch.new_loads(True, True)
    first, scale, cross = order
    try:
        placements, promotions = place_pool(
            array, batch.stage_1, loads, chunk, first, scale, batch.pool, cross, least=least
        )
    except CapacityError:
        return None
    if not least or not batch.within_reach(max(loads.cost)):
        goal = pool_goal(array, loads, chunk)
        refine(array, placements, loads, batch.stage_1.attention, batch.world, goal)
    return priced(placements, loads, promotions, batch.layouts, pooled=True)


def _pool_orders(
    out: list[Candidate], orders: tuple[PoolOrder, ...], retries: tuple[PoolOrder, ...]
) -> Iterator[PoolOrder]:
    """``orders`` (``pool.pool_orders``), then ``retries`` where no pool placement so far is
    predicted within ``_POOL_EVEN`` of its GPUs' mean but one is within ``_POOL_PACKED``
    (``out``: the placements so far, appended by the caller)."""
    yield from orders
    if out and not any(c.even_enough(_POOL_EVEN) for c in out):
        if any(c.even_enough(_POOL_PACKED) for c in out):
            yield from retries
