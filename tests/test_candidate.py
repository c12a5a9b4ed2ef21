"""A candidate placement built and timed without a record per whole document
(``search/candidate.py``) against the same placement built whole, as the kept plan is.

Tier: pure.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.place.loads import Loads
from megatron_zeppelin.planner.place.placement import Placement
from megatron_zeppelin.planner.place.schemes import choose_schemes
from megatron_zeppelin.planner.plan.linear_layout import LAYOUTS, fastest, price_linear_layouts
from megatron_zeppelin.planner.plan.plan import Scheme, Tier, zigzag_sequences
from megatron_zeppelin.planner.plan.routing import build_routes
from megatron_zeppelin.planner.plan.schedule import routes_by_edge
from megatron_zeppelin.planner.search.candidate import Candidate, _AttentionView
from megatron_zeppelin.planner.simulate.simulator import attention_seconds
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure


def _placed(lengths: list[int], two_d: bool) -> tuple[Candidate, np.ndarray]:
    """Whole documents on several GPUs (some on the same one, between rings in document order),
    a ring inside a node, a flat ring over part of two nodes, one over three whole nodes (the
    2-D scheme's, where the cost model prefers it), and a ring of uneven shares."""
    topology = get_topology("dgx-h100", num_nodes=4)
    cost = CostModel.default(get_model("llama-7b"), topology)
    loads = Loads(topology, 1 << 20, cost, topology.nics_per_node, two_d=two_d)
    k = topology.gpus_per_node
    rings = {
        2: Placement(Tier.INTRA, (8, 9, 10, 11)),
        5: Placement(Tier.INTER, (4, 5, 6, 7, 24, 25, 26, 27)),
        7: Placement(Tier.INTER, tuple(range(k, 4 * k))),
        9: Placement(Tier.INTRA, (12, 13, 14), tokens=(3_000, 5_000, 4_000)),
    }
    placements = []
    for doc, length in enumerate(lengths):
        placement = rings.get(doc) or Placement(Tier.LOCAL, ((doc * 5) % 12,))
        placements.append(placement)
        if placement.tokens:
            loads.add_shares(placement.ring, length, placement.tokens)
        elif len(placement.ring) == 1:
            loads.add_local(placement.ring[0], length)
        else:
            link = "nic" if placement.tier == Tier.INTER else "nvlink"
            loads.add_ring(placement.ring, length, link)
    return Candidate(placements, loads, 0, 0, {"attention": max(loads.cost)}), np.asarray(lengths)


@pytest.mark.parametrize("two_d", [False, True])
def test_a_candidate_times_as_its_whole_plan_would(two_d: bool) -> None:
    """Built with only its rings' records and timed with its whole documents as arrays
    (``attention_seconds``' ``whole``), a candidate gets every GPU's attention seconds to the
    last bit as the plan of every document's record gets them, and ``all_sequences`` gives
    that plan's records: the documents in order, each ring's scheme as the cost model chose."""
    lengths = [900, 4_000, 60_000, 700, 1_500, 90_000, 2_000, 700_000, 300, 12_000, 5_000]
    candidate, array = _placed(lengths, two_d)
    candidate.build(array, True)
    candidate.simulate(("attention",))
    assert [s.id for s in candidate.split] == [2, 5, 7, 9]  # records of the rings alone

    topology, cost = candidate.loads.topology, candidate.loads.cost_model
    placements = candidate.placements
    whole = zigzag_sequences(
        array.tolist(),
        [p.ring for p in placements],
        [p.tier for p in placements],
        {d: p.tokens for d, p in enumerate(placements) if p.tokens},
    )
    if two_d:
        whole = choose_schemes(whole, topology, cost, routing=True)
    assert candidate.all_sequences() == whole
    schemes = [s.scheme for s in whole]
    assert schemes.count(Scheme.TWO_D) == (1 if two_d else 0)  # the 2-D scheme comes up
    routes = build_routes(whole, topology)
    assert candidate.routes == routes
    view = _AttentionView(topology, whole, ((),) * topology.world_size, routes)
    compute, exposed = attention_seconds(view, cost, routes_by_edge(view))
    assert (compute + exposed).tolist() == candidate.attention_s.tolist()


def test_a_timed_candidate_prices_every_layout_for_the_plan_kept() -> None:
    """``simulate`` prices only the layouts that can beat the attention layout; the best time
    and layout are those of every layout priced, and ``every_layout`` (what the plan kept
    shows) gives them all, as pricing them all at once does."""
    topology = get_topology("dgx-h100", num_nodes=2)
    cost = CostModel.default(get_model("llama-7b"), topology)
    # The GPU of most attention holding fewest tokens: no layout that moves tokens can win.
    # Then a long document on a GPU of as many tokens as the rest: one may.
    for first, rest, pruned in ((30_000, [4_000] * 8, True), (30_000, [2_000], False)):
        lengths = [first] + rest * 15
        ranks = [0] + [1 + i // len(rest) for i in range(15 * len(rest))]
        loads = Loads(topology, 1 << 16, cost)
        for rank, length in zip(ranks, lengths):
            loads.add_local(rank, length)
        placements = [Placement(Tier.LOCAL, (rank,)) for rank in ranks]
        candidate = Candidate(placements, loads, 0, 0, {"attention": max(loads.cost)})
        candidate.build(np.asarray(lengths), True)
        candidate.simulate(LAYOUTS)
        every = price_linear_layouts(
            loads.tokens, candidate.attention_s.tolist(), topology, cost, LAYOUTS
        )
        assert (len(candidate.simulated) < len(LAYOUTS)) == pruned
        assert candidate.seconds == min(every.values()) and candidate.layout == fastest(every)
        assert candidate.every_layout() == every
