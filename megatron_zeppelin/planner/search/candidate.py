"""One candidate placement of a batch, as the search compares them (``search.py``).

A ``Candidate`` holds a placement (every document's tier and ring), the ``Loads`` it was placed
on, and its layer time under each allowed linear layout: ``Loads``' prediction, and the
simulator's once built and timed (``build``, ``simulate``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress
from operator import attrgetter, itemgetter

import numpy as np

from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import Placement
from megatron_zeppelin.planner.place.schemes import choose_schemes
from megatron_zeppelin.planner.plan.linear_layout import fastest, price_linear_layouts
from megatron_zeppelin.planner.plan.phases import Local
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
    """Every document's sequence, where laid out beforehand (``spread.py``); else
    ``all_sequences`` builds them for the candidate kept."""
    split: tuple[SequencePlan, ...] = ()
    """The sequences of the documents over rings (``build``), in order: all the simulator needs
    of a candidate besides its whole documents' ranks and lengths."""
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
    _array: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64), repr=False)
    """The batch's lengths (``build``'s)."""
    _layouts: tuple[str, ...] = field(default=(), repr=False)
    """The layouts ``simulate`` was asked to price."""

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
        """The documents placed over more than one GPU, in order (the placement is final)."""
        return np.flatnonzero(~self._whole_docs).tolist()

    def build(self, array: np.ndarray, routing: bool) -> None:
        """The sequences of the documents over rings (zigzag over each ring, with its members'
        tokens where uneven), unless every document's is given, and the routes. The whole
        documents' records are built only for the candidate kept (``all_sequences``): at ten
        thousand documents on a thousand GPUs, building them for every candidate timed cost
        more than timing it."""
        self._array = array
        if self.sequences:
            parts = self.sequences
        elif self.split:
            parts = self.split
        else:
            docs = self.split_docs
            rings = [self.placements[d].ring for d in docs]
            tiers = [self.placements[d].tier for d in docs]
            tokens = [self.placements[d].tokens for d in docs]
            shares = {i: t for i, t in enumerate(tokens) if t}
            parts = zigzag_sequences(array[docs].tolist(), rings, tiers, shares, ids=docs)
        topology = self.loads.topology
        if self.loads.two_d is not None:  # before routing and the linear layout read the rings
            parts = choose_schemes(parts, topology, self.loads.cost_model, routing=routing)
        if self.sequences:
            self.sequences = parts
        else:
            self.split = parts
        self.routes = build_routes(parts, topology) if routing else ()

    @cached_property
    def _whole_docs(self) -> np.ndarray:
        """Which documents are whole on one GPU, a ring of one (what ``phases.split_by_layout``
        reads as whole; the placement is final)."""
        sizes = map(len, map(attrgetter("ring"), self.placements))
        return np.fromiter(sizes, dtype=np.int64, count=len(self.placements)) == 1

    def all_sequences(self) -> tuple[SequencePlan, ...]:
        """Every document's sequence (after ``build``): the whole documents' built now, the
        others' as ``build`` made them."""
        if self.sequences:
            return self.sequences
        assert len(self._array) == len(self.placements), "all_sequences asked before build"
        whole = np.flatnonzero(self._whole_docs).tolist()
        rings = [self.placements[d].ring for d in whole]
        tiers = [self.placements[d].tier for d in whole]
        out: list[SequencePlan | None] = [None] * len(self.placements)
        built = zigzag_sequences(self._array[whole].tolist(), rings, tiers, ids=whole)
        deque(map(out.__setitem__, whole, built), maxlen=0)
        deque(map(out.__setitem__, self.split_docs, self.split), maxlen=0)
        return tuple(out)  # type: ignore[arg-type]

    def simulate(self, layouts: tuple[str, ...]) -> None:
        """The simulator's layer time per layout (after ``build``): its attention timeline on
        the attention layout (which is all it reads of a plan), priced under each layout that
        can beat the attention layout (``price_linear_layouts``' ``prune``: the best time and
        its layout are the same; ``every_layout`` prices the rest). The whole documents go to
        it as arrays (``attention_seconds``' ``whole``)."""
        topology, cost = self.loads.topology, self.loads.cost_model
        parts = self.sequences or self.split
        plan = _AttentionView(topology, parts, ((),) * topology.world_size, self.routes)
        whole = None if self.sequences else self._whole()
        compute, exposed = attention_seconds(plan, cost, routes_by_edge(plan), whole=whole)
        self.attention_s = compute + exposed
        self.simulated = price_linear_layouts(
            self.loads.tokens, self.attention_s.tolist(), topology, cost, layouts, prune=True
        )
        self._layouts = layouts

    def every_layout(self) -> dict[str, float]:
        """``simulated`` under every layout ``simulate`` was asked for (the plan kept shows
        them all)."""
        if self.timed and len(self.simulated) < len(self._layouts):
            loads = self.loads
            self.simulated = price_linear_layouts(
                loads.tokens, self.attention_s.tolist(), loads.topology, loads.cost_model,
                self._layouts,
            )  # fmt: skip
        return self.simulated

    def _whole(self) -> Local:
        """The whole documents as ``phases.split_by_layout`` reads them: pass (all 0), rank and
        length, in order."""
        whole = self._whole_docs
        count = int(np.count_nonzero(whole))
        rings = compress(map(attrgetter("ring"), self.placements), whole.tolist())
        ranks = np.fromiter(map(itemgetter(0), rings), dtype=np.int64, count=count)
        lengths = np.ascontiguousarray(self._array[whole], dtype=np.int64)
        return np.zeros(count, dtype=np.int64), ranks, lengths

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
