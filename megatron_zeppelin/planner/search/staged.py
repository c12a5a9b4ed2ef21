"""The staged placements of a batch, variant by variant, for the search (``search.py``).

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
scheme, the inter-node rings per stage 1, stage 2 for both packings of the same rings, and,
without numba (which places every node of a try in one compiled call), stage 3's nodes: a node
given the same documents on the same loads as in an earlier placement is placed as it was then
(``within_nodes.place_within_nodes``; on batches of few documents per node, where the tries are
many, most nodes of a try).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from megatron_zeppelin.planner.place.loads import Loads, LoadsSnapshot
from megatron_zeppelin.planner.place.placement import (
    CapacityError,
    Placement,
    TierChoice,
    place_across_nodes,
    place_inter_documents,
)
from megatron_zeppelin.planner.place.tiers import TierRules, assign_tiers
from megatron_zeppelin.planner.place.within_nodes import place_within_nodes
from megatron_zeppelin.planner.plan.linear_layout import price_linear_layouts
from megatron_zeppelin.planner.search.candidate import Candidate, spans_nodes

__all__ = ["staged_candidates"]

_MAX_TRIES = 8
"""Placements tried per balance mode."""
_MAX_MISSES = 2
"""More rings are given up after this many placements in a row that predict less than
``_MIN_GAIN`` over the best so far."""
_MIN_GAIN = 0.005
_PLACEMENT_BUDGET = 12_000
"""Documents placed over all tries of one batch: a thousand documents get a dozen tries, ten
thousand the first alone (where they are many per GPU, packing them whole is even)."""
_WORTH_A_REMAP = 1.05
"""Balancing attention alone is tried only where the best placement so far is predicted this
far above its GPUs' mean: the remapping it needs costs a few percent of a layer."""


def staged_candidates(
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
    nodes: dict = {}  # stage 3's nodes placed so far (``place_within_nodes``' ``done``)
    first = True
    for balance_linear, pack, two_d in [*variants, (True, True, False)]:
        staged = [c for c in found if not c.pooled]
        if not two_d and (new_loads(True, True).two_d is None or not spans_nodes(staged)):
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
        found_now = _candidates(array, base, loads, layouts, budget, stage_2, nodes, first=first)
        for candidate in found_now:
            first = False
            yield candidate


def _candidates(
    array: np.ndarray,
    base: TierChoice,
    new_loads: Callable[[], Loads],
    layouts: tuple[str, ...],
    budget: list[int],
    across: dict[tuple[int, ...] | None, _Across],
    nodes: dict,
    *,
    first: bool,
) -> Iterator[Candidate]:
    """Placements with stage 1's rings, then with more in-node rings while that helps: the
    busiest GPU's longest local document, and every longer local document with it (a longer
    document never lands in a lower tier than a shorter one). Only the very first placement may
    fail on capacity (``plan_batch`` then splits less); later ones that run out of room are
    skipped. ``across``: stage 2 of every placement made so far with the same stage 1, by its
    extra rings (``_place``); ``nodes``: stage 3's nodes placed so far, for every placement of
    the batch."""
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
            candidate = _place(
                array, choice, new_loads(), layouts, count, kept, tuple(rings), nodes
            )
        except CapacityError:
            if first and count == 0:
                raise
            candidate = None
        if candidate is not None:
            yield candidate
            predicted = candidate.predicted_s
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
    nodes: dict | None = None,
) -> Candidate:
    """Stages 2 and 3, and the layer time ``Loads`` predicts under each linear layout. Stage 2
    comes from ``across`` where a placement with the same ``rings`` made it already, and its
    inter-node rings where any placement of the same stage 1 did; stage 3's nodes from
    ``nodes`` where placed alike before."""
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
    promotions += place_within_nodes(array, choice, by_node, loads, placements, nodes)
    attention_s = np.add(loads.attention, loads.exposed).tolist()
    predicted = price_linear_layouts(
        loads.tokens, attention_s, loads.topology, loads.cost_model, layouts, prune=True
    )
    return Candidate(placements, loads, promotions, extra, predicted)  # type: ignore[arg-type]
