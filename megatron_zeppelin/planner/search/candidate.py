"""One candidate placement of a batch, as the search compares them (``search.py``).

A ``Candidate`` holds a placement (every document's tier and ring), the ``Loads`` it was placed
on, and its layer time under each allowed linear layout: ``Loads``' prediction, and the
simulator's once built and timed (``build``, ``simulate``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import Placement
from megatron_zeppelin.planner.place.schemes import choose_schemes
from megatron_zeppelin.planner.plan.linear_layout import fastest, price_linear_layouts
from megatron_zeppelin.planner.plan.plan import Plan, Route, SequencePlan, Tier, zigzag_sequences
from megatron_zeppelin.planner.plan.routing import build_routes
from megatron_zeppelin.planner.plan.schedule import routes_by_edge
from megatron_zeppelin.planner.simulate.simulator import attention_seconds

__all__ = ["Candidate", "distinct", "priced", "spans_nodes"]

_EVEN_ENOUGH = 1.01
"""A placement predicted within this factor of its GPUs' mean work needs no more rings."""


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
    """Refined again on the simulator's per-GPU figures (``search._retime``)."""
    near_least_load: bool = False
    """Kept for ending close to the batch's least load (``search._settle``)."""
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
    def predicted_s(self) -> float:
        """``Loads``' layer time under the best layout it priced."""
        return min(self.predicted.values())

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
        return self.predicted_s <= (factor or _EVEN_ENOUGH) * self.mean_seconds

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
        under every layout (``staged._place`` prices only those that can win)."""
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
            "predicted_layer_s": self.predicted_s,
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


def priced(
    placements: list[Placement],
    loads: Loads,
    promotions: int,
    layouts: tuple[str, ...],
    **kinds: bool,
) -> Candidate:
    """A placement of the pool or of shares, priced from its ``loads`` under every layout that
    can beat the attention layout (``price_linear_layouts``' ``prune``: the best time and its
    layout are the same; a candidate kept unsimulated is priced under all, ``keep_estimate``)."""
    attention_s = np.add(loads.attention, loads.exposed).tolist()
    predicted = price_linear_layouts(
        loads.tokens, attention_s, loads.topology, loads.cost_model, layouts, prune=True
    )
    return Candidate(placements, loads, promotions, 0, predicted, **kinds)


def distinct(found: list[Candidate]) -> list[Candidate]:
    """The candidates less those that repeat an earlier placement (another variant may land on
    the same one). Placements alike hold alike tokens on every GPU, so a candidate is compared
    document by document (``_key``: ten thousand documents at a thousand GPUs) only with those
    kept before it whose GPUs hold the tokens its GPUs hold."""
    kept: dict[tuple[int, ...], list[Candidate]] = {}
    out = []
    for candidate in found:
        same_tokens = kept.setdefault(tuple(candidate.loads.tokens), [])
        if same_tokens and _key(candidate) in {_key(c) for c in same_tokens}:
            continue  # it repeats an earlier placement
        same_tokens.append(candidate)
        out.append(candidate)
    return out


def _key(candidate: Candidate) -> tuple:
    """Every document's tier, ring and tokens: what makes two placements the same."""
    return tuple((p.tier, p.ring, p.tokens) for p in candidate.placements)


def spans_nodes(found: list[Candidate]) -> bool:
    return any(p.tier == Tier.INTER for c in found for p in c.placements)
