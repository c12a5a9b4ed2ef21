"""The planner's search: candidate placements of a batch, kept by the simulator's step time.

A placement can balance two things (``Loads.balance_linear``):

* **attention + linear**: every GPU's attention (with the ring transfers it cannot hide) plus its
  tokens' linear seconds, so the linear modules can run where the attention tokens are and no
  remapping is needed; the layer then takes ``max(linear + attention)``;
* **attention alone**: the attention layout balances attention and the linear layout evens the
  tokens (inside nodes, or over the world), the remapping all-to-alls paid between them; the layer
  takes ``max(linear) + remap + max(attention)``.

Where documents cross nodes and the 2-D scheme is allowed, a placement with every ring flat is a
candidate too: the scheme is chosen per document (``schemes.choose_schemes``), the step is what
decides.

For each, stage 1's rings are placed first; where that leaves the predicted layer above the
GPUs' mean (few documents per GPU cannot be packed evenly whole), the busiest GPU's longest local
document becomes an in-node ring too, with every longer local document, while that helps. Every
placement is priced under every allowed linear layout (``linear_layout.price_linear_layouts``, so
mixtures are covered: a linear layout that moves tokens only inside nodes remaps only where it
pays), less those a bound shows cannot beat the attention layout (its ``prune``).

Placements of one batch share what does not change between them: stage 1 per balance mode and
scheme, the inter-node rings per stage 1, and stage 2 for both packings of the same rings.

Where no placement so far is predicted even enough, the placements over the GPUs as one pool are
candidates too (``pool.place_pool``: rings sized to the mean load on any GPUs, across nodes over
part of a node's GPUs where that fits best, in each order of ``pool.pool_orders``, then each
of its retries where those pack unevenly), each refined by moving whole documents and rings
off its busiest GPU (``refine.refine``); those predicted within ``_SHORTLIST`` of the best staged
one are timed by the simulator beside the staged shortlist, so one is kept only where the
simulator finds it faster. Where every document is a ring (the pool's ring orders), the
placement with uneven ring shares is a candidate beside them (``shares.place_shares``:
documents laid end to end along each node's GPUs).

Placements are built with ``Loads``' per-document predictions; when several are predicted
within ``_SHORTLIST`` of the best, they are timed with the simulator's own functions
(``simulator.attention_seconds``, ``steptime.layer_seconds``) and the fastest is kept; the
plan's ``meta["predicted_step_s"]`` is then what ``simulate`` reports for it
(``meta["timed_by"] == "simulator"``). The kept one is then refined again on the simulator's
per-GPU figures (which see rings across nodes sharing a node's NICs wait on each other) and
timed once more (``_retime``); the faster stays. A lone candidate keeps ``Loads``' prediction
(``"planner estimate"``): there is nothing to choose, and timing a thousand-GPU plan costs as
much as placing it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property, partial

import numpy as np

from megatron_zeppelin.planner.linear_layout import (
    fastest,
    price_linear_layouts,
)
from megatron_zeppelin.planner.loads import Loads, LoadsSnapshot
from megatron_zeppelin.planner.placement import (
    CapacityError,
    Placement,
    TierChoice,
    place_across_nodes,
    place_inter_documents,
    place_within_nodes,
)
from megatron_zeppelin.planner.plan import Plan, Route, SequencePlan, Tier, zigzag_sequences
from megatron_zeppelin.planner.pool import (
    RING_ORDERS,
    PoolBatch,
    PoolGoal,
    PoolOrder,
    place_pool,
    pool_batch,
    pool_goal,
    pool_orders,
)
from megatron_zeppelin.planner.refine import refine
from megatron_zeppelin.planner.routing import build_routes
from megatron_zeppelin.planner.schedule import routes_by_edge
from megatron_zeppelin.planner.schemes import choose_schemes
from megatron_zeppelin.planner.shares import place_shares
from megatron_zeppelin.planner.simulator import attention_seconds
from megatron_zeppelin.planner.tiers import TierRules, assign_tiers

__all__ = ["Candidate", "search"]

_EVEN_ENOUGH = 1.01
"""A placement predicted within this factor of its GPUs' mean work needs no more rings."""
_MAX_TRIES = 8
"""Placements tried per balance mode."""
_MAX_MISSES = 2
"""More rings are given up after this many placements in a row that predict less than
``_MIN_GAIN`` over the best so far."""
_MIN_GAIN = 0.005
_PLACEMENT_BUDGET = 12_000
"""Documents placed over all tries of one batch: a thousand documents get a dozen tries, ten
thousand the first alone (where they are many per GPU, packing them whole is even)."""
_SHORTLIST = 1.05
"""Placements predicted within this factor of the best are timed by the simulator..."""
_MAX_TIMED = 2
"""... the best predicted few of them."""
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
_WORTH_A_REMAP = 1.05
"""Balancing attention alone is tried only where the best placement so far is predicted this
far above its GPUs' mean: the remapping it needs costs a few percent of a layer."""


@dataclass
class Candidate:
    """One placement of the batch and its layer time under each allowed linear layout."""

    placements: list[Placement]
    loads: Loads
    promotions: int
    extra_rings: int
    predicted: dict[str, float]
    """``Loads``' prediction of the layer time per linear layout."""
    simulated: dict[str, float] = field(default_factory=dict)
    """The simulator's, for candidates on the shortlist."""
    sequences: tuple[SequencePlan, ...] = ()
    routes: tuple[Route, ...] = ()
    attention_s: np.ndarray | None = None
    """Attention seconds per rank (compute plus exposed transfers)."""
    timed: bool = True
    """Whether ``simulated`` comes from the simulator (else from ``Loads``)."""
    pooled: bool = False
    """Placed over the GPUs as one pool (``pool.py``), not node by node."""
    shared: bool = False
    """Laid along the GPUs with uneven ring shares (``shares.py``)."""
    retimed: bool = False
    """Refined again on the simulator's per-GPU figures (``_retime``)."""
    near_least_load: bool = False
    """Kept for ending within ``_CLOSE`` of the batch's least load (``_settle``)."""
    settled_by_factor: dict[float, bool] = field(default_factory=dict, repr=False)
    """``settled``'s answers so far."""

    @property
    def balance_linear(self) -> bool:
        return self.loads.balance_linear

    @property
    def balance(self) -> str:
        return "attention+linear" if self.loads.balance_linear else "attention"

    @property
    def rings(self) -> str:
        """``"2-D where faster"`` or ``"flat"``: how documents across nodes may run."""
        return "flat" if self.loads.two_d is None else "2-D where faster"

    @property
    def placement(self) -> str:
        """``"staged"``, ``"pool"`` or ``"shares"``: which placement made it."""
        return "shares" if self.shared else "pool" if self.pooled else "staged"

    @property
    def seconds(self) -> float:
        """The simulator's layer time under the best layout (after ``simulate``)."""
        return min(self.simulated.values())

    @property
    def layout(self) -> str:
        return fastest(self.simulated)

    @cached_property
    def mean_seconds(self) -> float:
        """The GPUs' mean predicted attention plus linear seconds (the placement is final)."""
        attention = np.add(self.loads.attention, self.loads.exposed)
        linear = self.loads.cost_model.linear_times(np.asarray(self.loads.tokens, dtype=float))
        return float((attention + linear).mean())

    @property
    def peak(self) -> float:
        """The busiest GPU's ``Loads.cost`` (what the least load is in)."""
        return max(self.loads.cost)

    def even_enough(self, factor: float = 0.0) -> bool:
        """Predicted within ``factor`` (default ``_EVEN_ENOUGH``) of the GPUs' mean attention
        plus linear seconds."""
        return min(self.predicted.values()) <= (factor or _EVEN_ENOUGH) * self.mean_seconds

    def settled(self, array: np.ndarray, factor: float = 0.0) -> bool:
        """``_settled`` once per factor: the search asks again for every variant it tries
        (``array`` is the batch, the same for every call)."""
        if factor not in self.settled_by_factor:
            self.settled_by_factor[factor] = self._settled(array, factor)
        return self.settled_by_factor[factor]

    def _settled(self, array: np.ndarray, factor: float) -> bool:
        """No other placement is worth trying: this one is ``even_enough(factor)``, or one
        document's share of the busiest GPU already exceeds the mean load (its ring, not the
        packing of the others, sets the step)."""
        if self.even_enough(factor):
            return True
        loads = self.loads
        busiest = int(np.argmax(loads.cost))
        mean = float(np.mean(loads.cost))
        for doc, placement in self.rings_on(busiest):
            link = "nvlink" if placement.tier == Tier.INTRA else "nic"
            if loads.ring_key(int(array[doc]), len(placement.ring), link) >= mean:  # type: ignore[arg-type]
                return True
        return False

    def rings_on(self, rank: int) -> Iterator[tuple[int, Placement]]:
        """The split documents with a share on ``rank``."""
        for doc in self.split_docs:
            placement = self.placements[doc]
            if rank in placement.ring:
                yield doc, placement

    @cached_property
    def split_docs(self) -> list[int]:
        """The documents placed over more than one GPU (the placement is final)."""
        return [doc for doc, p in enumerate(self.placements) if p.tier != Tier.LOCAL]

    def build(self, array: np.ndarray, routing: bool) -> None:
        """The plan's sequences (zigzag over each ring, with its members' tokens where uneven,
        unless given) and routes."""
        if not self.sequences:
            rings = [p.ring for p in self.placements]
            tiers = [p.tier for p in self.placements]
            shares = {d: p.tokens for d, p in enumerate(self.placements) if p.tokens}
            self.sequences = zigzag_sequences(array.tolist(), rings, tiers, shares)
        topology = self.loads.topology
        if self.loads.two_d is not None:  # before routing and the linear layout read the rings
            self.sequences = choose_schemes(
                self.sequences, topology, self.loads.cost_model, routing=routing
            )
        self.routes = build_routes(self.sequences, topology) if routing else ()

    def simulate(self, layouts: tuple[str, ...]) -> None:
        """The simulator's layer time per layout (after ``build``): its attention timeline on
        the attention layout (which is all it reads of a plan), priced under every layout."""
        topology, cost = self.loads.topology, self.loads.cost_model
        plan = _AttentionView(topology, self.sequences, ((),) * topology.world_size, self.routes)
        compute, exposed = attention_seconds(plan, cost, routes_by_edge(plan))
        self.attention_s = compute + exposed
        self.simulated = price_linear_layouts(
            self.loads.tokens, self.attention_s.tolist(), topology, cost, layouts
        )

    def keep_estimate(self, layouts: tuple[str, ...]) -> None:
        """Take ``Loads``' prediction as the layer time (nothing left to compare it with),
        under every layout (``_place`` prices only those that can win)."""
        self.attention_s = np.add(self.loads.attention, self.loads.exposed)
        self.simulated = dict(self.predicted)
        if len(self.simulated) < len(layouts):
            loads = self.loads
            self.simulated = price_linear_layouts(
                loads.tokens, self.attention_s.tolist(), loads.topology, loads.cost_model, layouts
            )
        self.timed = False

    def summary(self) -> dict:
        out = {
            "placement": self.placement,
            "balance": self.balance,
            "rings": self.rings,
            "extra_rings": self.extra_rings,
            "predicted_layer_s": min(self.predicted.values()),
        }
        if self.retimed:
            out["retimed"] = True
        if self.near_least_load:
            out["near_least_load"] = True
        if self.simulated and self.timed:
            out.update(layout=self.layout, simulated_layer_s=self.seconds)
        return out


class _AttentionView(Plan):
    """A candidate's attention layout and routes as a ``Plan`` for the simulator's attention
    timeline, which reads nothing else: no linear layout, and no validation (the plan that is
    kept is built and validated whole by ``partition``; the others are dropped)."""

    __hash__ = object.__hash__  # a view is built once: hashing its every span is wasted

    def validate(self) -> None:
        pass


def search(
    array: np.ndarray,
    new_loads: Callable[[bool, bool], Loads],
    rules: TierRules,
    layouts: tuple[str, ...],
    *,
    routing: bool,
    pool: bool = True,
) -> tuple[Candidate, list[dict], float]:
    """The fastest candidate (module docstring), a summary of every one tried, and the batch's
    least load (``least_load.least_load``). ``new_loads(balance_linear, two_d)`` gives empty loads
    to place on (``two_d``: where the planner's options allow the 2-D scheme)."""
    # Stage 1 of the pool and of the first staged placement alike: attention + linear, 2-D
    # allowed; and the batch's least load, under which no placement ends.
    tiers = {(True, True): assign_tiers(array, new_loads(True, True), rules)}
    stage_1 = tiers[(True, True)]
    batch = pool_batch(array, stage_1, new_loads(True, True), rules.chunks[1])
    pool = pool and rules.allow_split and rules.auto
    found: list[Candidate] = []
    first_pool: list[Candidate] = []  # the pool's first order, where placed

    def close_enough(candidate: Candidate | None) -> bool:
        """Within ``_CLOSE`` of the least load (``found`` then ends with it)."""
        if candidate is None or not candidate.balance_linear:
            return False
        return candidate.peak <= _CLOSE * batch.least_load

    # Where the long documents' rings, not the packing, set the least load, the pool sized to
    # it goes first, and a placement that comes close enough to it ends the search.
    ring_bound = pool and batch.least_load > _RING_BOUND * batch.share
    if ring_bound:
        order = PoolOrder(None, _TIGHT)
        candidate = _pool_candidate(
            array, stage_1, new_loads, batch, rules, layouts, order, least=True
        )
        first_pool += [candidate] if candidate is not None else []
        found += first_pool
        if first_pool and close_enough(first_pool[0]):
            return (*_settle(found, array, routing, layouts), batch.least_load)
    for candidate in _staged(array, new_loads, rules, layouts, tiers, found):
        found.append(candidate)
        if ring_bound and close_enough(candidate):
            return (*_settle(found, array, routing, layouts), batch.least_load)
    staged = _distinct([c for c in found if not c.pooled])
    best_prediction = min(min(c.predicted.values()) for c in staged)
    shortlist = sorted(
        (c for c in staged if min(c.predicted.values()) <= _SHORTLIST * best_prediction),
        key=lambda c: min(c.predicted.values()),
    )[:_MAX_TIMED]
    pooled = first_pool
    if pool:
        pooled = _pool_candidates(array, stage_1, new_loads, batch, rules, layouts, staged, pooled)
    found = staged + pooled
    # Timed beside the staged shortlist where predicted within it (``Loads`` misjudges them
    # by a few percent, not by more).
    shortlist += [c for c in pooled if min(c.predicted.values()) <= _SHORTLIST * best_prediction]
    for candidate in shortlist:
        candidate.build(array, routing)
        if len(shortlist) > 1:
            candidate.simulate(layouts)
        else:
            candidate.keep_estimate(layouts)
    best = min(shortlist, key=lambda c: c.seconds)
    if best.timed:
        # The fastest of each kind: a staged placement had no refinement pass of its own yet,
        # so it may gain more from this one than a faster pool placement does.
        for kind in (True, False):
            timed = [c for c in shortlist if c.pooled == kind]
            if not timed:
                continue
            fastest_of_kind = min(timed, key=lambda c: c.seconds)
            goal = pool_goal(array, fastest_of_kind.loads, rules.chunks[1]) if kind else None
            retimed = _retime(
                array, fastest_of_kind, stage_1.attention, new_loads, routing, layouts, goal
            )
            if retimed is not None:
                found.append(retimed)
                best = min(best, retimed, key=lambda c: c.seconds)
    return best, [c.summary() for c in found], batch.least_load


def _staged(
    array: np.ndarray,
    new_loads: Callable[[bool, bool], Loads],
    rules: TierRules,
    layouts: tuple[str, ...],
    tiers: dict[tuple[bool, bool], TierChoice],
    found: list[Candidate],
) -> Iterator[Candidate]:
    """The staged placements, variant by variant (module docstring): balancing attention +
    linear, then attention alone, each with both packings, then every ring flat; a variant is
    skipped where the candidates so far (``found``, which the caller extends) say it cannot
    win. ``tiers``: stage 1 per balance mode and scheme, so far."""
    budget = [max(_PLACEMENT_BUDGET, len(array))]  # documents placed over all tries
    modes = (True, False) if set(layouts) - {"attention"} else (True,)
    variants = [(mode, pack, True) for mode in modes for pack in (True, False)]
    # Per balance mode and scheme: each stage 2 (by its rings), the same for both packings
    # (``pack`` sizes the rings inside nodes, in stage 3).
    across: dict[tuple[bool, bool], dict[tuple[int, ...] | None, _Across]] = {}
    first = True
    for balance_linear, pack, two_d in [*variants, (True, True, False)]:
        staged = [c for c in found if not c.pooled]
        if not two_d and (new_loads(True, True).two_d is None or not _spans_nodes(staged)):
            break  # the 2-D scheme is off, or no document crosses nodes: nothing to compare
        if not balance_linear and any(c.settled(array, _WORTH_A_REMAP) for c in staged):
            continue  # balancing attention alone cannot win back its remapping here
        if not pack and any(c.settled(array) for c in staged if c.balance_linear == balance_linear):
            continue
        if budget[0] < len(array):
            break
        loads = partial(new_loads, balance_linear, two_d)
        family = (balance_linear, two_d)
        if family not in tiers:
            tiers[family] = assign_tiers(array, loads(), rules)
        base = replace(tiers[family], pack=pack)
        stage_2 = across.setdefault(family, {})
        for candidate in _candidates(array, base, loads, layouts, budget, stage_2, first=first):
            first = False
            yield candidate


def _settle(
    found: list[Candidate], array: np.ndarray, routing: bool, layouts: tuple[str, ...]
) -> tuple[Candidate, list[dict]]:
    """The last of ``found``, a placement within ``_CLOSE`` of the batch's least load, built and
    kept with ``Loads``' prediction (``Candidate.keep_estimate``): no other placement ends more
    than that below it, less than ``Loads`` and the simulator differ by, so nothing is left to
    compare; and a summary of every candidate tried."""
    best = found[-1]
    best.near_least_load = True
    best.build(array, routing)
    best.keep_estimate(layouts)
    return best, [c.summary() for c in found]


def _retime(
    array: np.ndarray,
    best: Candidate,
    attention: np.ndarray,
    new_loads: Callable[[bool, bool], Loads],
    routing: bool,
    layouts: tuple[str, ...],
    goal: PoolGoal | None,
) -> Candidate | None:
    """``best`` (timed by the simulator) refined again on the simulator's per-GPU attention
    seconds: ``Loads`` prices each ring alone, the simulator also sees rings that share a node's
    NICs wait on each other, and a staged placement gets no other refinement. Each GPU's load
    becomes its simulated attention plus its linear seconds, ``refine.refine`` moves and swaps
    whole documents off the busiest GPUs (swaps with many GPUs, not only the lightest few; with
    ``goal``, a pool placement's, rings too), and the result is timed by the simulator. ``None``
    where nothing could move."""
    old = best.loads
    world = old.topology.world_size
    loads = new_loads(old.balance_linear, old.two_d is not None)
    loads.restore(old.snapshot(range(world)))
    # What the simulator found beyond the prediction, as transfers the GPU does not hide.
    excess = np.asarray(best.attention_s) - np.add(old.attention, old.exposed)
    for rank, extra in enumerate(excess.tolist()):
        loads.exposed[rank] += extra
        loads.cost[rank] += extra
    placements = list(best.placements)
    light = min(world, max(_RETIME_SWAPS * world // len(array), 1))
    rounds = max(_RETIME_WEIGHED // (light * len(array) // world + 1), 1)
    if not refine(array, placements, loads, attention, rounds, goal, light=light):
        return None
    attention_s = np.add(loads.attention, loads.exposed).tolist()
    prices = price_linear_layouts(
        loads.tokens, attention_s, loads.topology, loads.cost_model, layouts
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
    retimed.build(array, routing)
    retimed.simulate(layouts)
    return retimed


def _pool_candidates(
    array: np.ndarray,
    choice: TierChoice,
    new_loads: Callable[[bool, bool], Loads],
    batch: PoolBatch,
    rules: TierRules,
    layouts: tuple[str, ...],
    found: list[Candidate],
    first: list[Candidate],
) -> list[Candidate]:
    """The placements over the GPUs as one pool (``pool.place_pool``, in each order of
    ``pool.pool_orders``), where no candidate so far is even enough and splitting is allowed; an
    order that runs out of room is left out; where every document is a ring, the placement with
    uneven ring shares too (``shares.place_shares``). ``choice``: stage 1 on loads that balance
    attention + linear with the 2-D scheme where allowed (the search's, which the pool shares);
    ``batch``: ``pool.pool_batch`` of it; ``first``: the first order's candidate where placed
    already (kept whatever the others)."""
    if any(c.even_enough() for c in found):
        return first
    staged = min(min(c.predicted.values()) for c in found)
    if batch.least_load * _POOL_GAIN >= staged:
        return first  # no placement ends far enough below the staged ones (``least_load.py``)
    orders, retries = pool_orders(array, new_loads(True, True), batch)
    out: list[Candidate] = list(first)
    for order in _pool_orders(out, orders, retries):
        candidate = _pool_candidate(array, choice, new_loads, batch, rules, layouts, order)
        if candidate is None:
            continue  # the order runs out of room
        out.append(candidate)
        if min(candidate.predicted.values()) > _POOL_STOP * staged:
            break  # the orders pack alike: one this far behind says the others will be too
    if orders == RING_ORDERS or len(array) <= new_loads(True, True).topology.world_size:
        # Every document a ring, or no more documents than GPUs: rings of whole GPUs pack
        # unevenly, uneven shares may not.
        loads = new_loads(True, False)  # flat rings: a share of a ring is not a 2-D grid
        placements = place_shares(array, loads)
        if placements is not None:
            out.append(_candidate(placements, loads, 0, layouts, shared=True))
    return _distinct(out)


def _pool_candidate(
    array: np.ndarray,
    choice: TierChoice,
    new_loads: Callable[[bool, bool], Loads],
    batch: PoolBatch,
    rules: TierRules,
    layouts: tuple[str, ...],
    order: PoolOrder,
    *,
    least: bool = False,
) -> Candidate | None:
    """The pool placement in ``order`` (with ``least``, rings sized to the batch's least load
    instead of its target), refined (``refine.refine``) unless ``least`` and it ends within
    ``_CLOSE`` of that load already; ``None`` where it runs out of room."""
    loads = new_loads(True, True)
    first, scale, cross = order
    try:
        placements, promotions = place_pool(
            array, choice, loads, rules.chunks[1], first, scale, batch, cross, least=least
        )
    except CapacityError:
        return None
    if not least or max(loads.cost) > _CLOSE * batch.least_load:
        goal = pool_goal(array, loads, rules.chunks[1])
        refine(array, placements, loads, choice.attention, loads.topology.world_size, goal)
    return _candidate(placements, loads, promotions, layouts, pooled=True)


def _candidate(
    placements: list[Placement],
    loads: Loads,
    promotions: int,
    layouts: tuple[str, ...],
    **kinds: bool,
) -> Candidate:
    """A placement of the pool or of shares, priced under every layout from its ``loads``."""
    attention_s = np.add(loads.attention, loads.exposed).tolist()
    predicted = price_linear_layouts(
        loads.tokens, attention_s, loads.topology, loads.cost_model, layouts
    )
    return Candidate(placements, loads, promotions, 0, predicted, **kinds)


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


def _distinct(found: list[Candidate]) -> list[Candidate]:
    """The candidates less those that repeat an earlier placement (another variant may land on
    the same one)."""
    seen, out = set(), []
    for candidate in found:
        key = tuple((p.tier, p.ring, p.tokens) for p in candidate.placements)
        if key not in seen:
            seen.add(key)
            out.append(candidate)
    return out


def _spans_nodes(found: list[Candidate]) -> bool:
    return any(p.tier == Tier.INTER for c in found for p in c.placements)


def _candidates(
    array: np.ndarray,
    base: TierChoice,
    new_loads: Callable[[], Loads],
    layouts: tuple[str, ...],
    budget: list[int],
    across: dict[tuple[int, ...] | None, _Across],
    *,
    first: bool,
) -> Iterator[Candidate]:
    """Placements with stage 1's rings, then with more in-node rings while that helps: the
    busiest GPU's longest local document, and every longer local document with it (a longer
    document never lands in a lower tier than a shorter one). Only the very first placement may
    fail on capacity (``plan_batch`` then splits less); later ones that run out of room are
    skipped. ``across``: stage 2 of every placement made so far with the same stage 1, by its
    extra rings (``_place``)."""
    extra = np.flatnonzero(base.splittable)
    extra = extra[np.lexsort((extra, -array[extra]))]  # longest first
    # Rings aimed at the busiest GPU: more of them than GPUs no longer are.
    limit = new_loads().topology.world_size
    count, best, misses = 0, math.inf, 0
    for _ in range(_MAX_TRIES):
        if budget[0] < len(array):
            return
        budget[0] -= len(array)
        try:
            rings = extra[:count].tolist()
            choice = base.with_rings(rings)
            # The last try's stage 2 serves no other: kept aside, not in ``across``.
            kept = across if budget[0] >= len(array) else dict(across)
            candidate = _place(array, choice, new_loads(), layouts, count, kept, tuple(rings))
        except CapacityError:
            if first and count == 0:
                raise
            candidate = None
        if candidate is not None:
            yield candidate
            predicted = min(candidate.predicted.values())
            misses = misses + 1 if predicted >= best * (1 - _MIN_GAIN) else 0
            if candidate.settled(array) or misses == _MAX_MISSES:
                return
            best = min(best, predicted)
            wanted = _busiest_local(candidate, array, extra, count)
            if wanted is None:
                return  # the busiest GPU holds nothing more rings could take from it
        else:
            wanted = count + 1
        if wanted > len(extra) or wanted > limit:
            return
        count = wanted


def _busiest_local(
    candidate: Candidate, array: np.ndarray, extra: np.ndarray, count: int
) -> int | None:
    """How many of ``extra`` (longest first) must become rings for the busiest GPU's longest
    document that may still become a ring to be one; ``None`` when it holds none."""
    loads = candidate.loads
    busiest = int(np.argmax(loads.cost))
    placements, alone = candidate.placements, (busiest,)
    # ``extra`` is longest first: the first one found is the longest.
    doc = next((d for d in extra[count:].tolist() if placements[d].ring == alone), None)
    if doc is None:
        return None
    return max(count + 1, int(np.searchsorted(-array[extra], -int(array[doc]), side="right")))


@dataclass(frozen=True)
class _Across:
    """Stage 2 of a placement, to place stage 3 again from (``pack`` plays no part in it), or
    its inter-node rings alone (``by_node`` empty)."""

    by_node: list[list[int]]
    placements: list[Placement | None]
    promotions: int
    loads: LoadsSnapshot


def _place(
    array: np.ndarray,
    choice: TierChoice,
    loads: Loads,
    layouts: tuple[str, ...],
    extra: int,
    across: dict[tuple[int, ...] | None, _Across],
    rings: tuple[int, ...],
) -> Candidate:
    """Stages 2 and 3, and the layer time ``Loads`` predicts under each linear layout. Stage 2
    comes from ``across`` where a placement with the same ``rings`` made it already, and its
    inter-node rings where any placement of the same stage 1 did."""
    done, everyone = across.get(rings), range(loads.topology.world_size)
    if done is None:
        # The inter-node rings come first and alike whatever the rings inside nodes: placed
        # once per stage 1 (``None`` in ``across``).
        inter = across.get(None)
        if inter is None:
            placements: list[Placement | None] = [None] * len(array)
            place_inter_documents(array, choice, loads, placements)
            across[None] = _Across([], list(placements), 0, loads.snapshot(everyone))
        else:
            placements = list(inter.placements)
            loads.restore(inter.loads)
        by_node, promotions = place_across_nodes(
            array, choice, loads, placements, inter_placed=True
        )
        across[rings] = _Across(by_node, list(placements), promotions, loads.snapshot(everyone))
    else:
        by_node, placements, promotions = done.by_node, list(done.placements), done.promotions
        loads.restore(done.loads)
    promotions += place_within_nodes(array, choice, by_node, loads, placements)
    attention_s = np.add(loads.attention, loads.exposed).tolist()
    predicted = price_linear_layouts(
        loads.tokens, attention_s, loads.topology, loads.cost_model, layouts, prune=True
    )
    return Candidate(placements, loads, promotions, extra, predicted)  # type: ignore[arg-type]
