"""The staged placement's shortcuts give what the plain computation gives: ring sizes that fit,
ring shares over NVLink, cross-node members' exposure, the linear layouts left unpriced, a
node's documents in placement order, stage 2 placed once for both packings, and stage 2's
compiled loop against numpy's heap.

Tier: pure.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from pool_batches import NEEDS_NUMBA, stress_batch

from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost import steptime
from megatron_zeppelin.planner.cost.costmodel import FWD_SHARE, CostModel, LinkCost
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.loops import node_lpt
from megatron_zeppelin.planner.place import placement, within_nodes
from megatron_zeppelin.planner.place.loads import Loads, min_ring
from megatron_zeppelin.planner.place.placement import CapacityError, place_across_nodes
from megatron_zeppelin.planner.place.tiers import TierRules, assign_tiers, chunk_thresholds
from megatron_zeppelin.planner.place.within_nodes import _NodeBatch, place_within_nodes
from megatron_zeppelin.planner.plan import linear_layout
from megatron_zeppelin.planner.plan.linear_layout import LAYOUTS, fastest, price_linear_layouts
from megatron_zeppelin.planner.plan.plan import Tier, zigzag_loads
from megatron_zeppelin.planner.search import staged
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.planner.search.staged import _place
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure


def _plain_min_ring(length: int, capacity: int, start: int, multiple: int) -> int | None:
    """The definition: the smallest multiple of ``multiple``, at least ``start`` and at most
    ``length + multiple``, whose zigzag positions all fit ``capacity``."""
    g = multiple * math.ceil(max(start, 1) / multiple)
    while g <= length + multiple:
        if max(zigzag_loads(length, g)) <= capacity:
            return g
        g += multiple
    return None


@settings(max_examples=examples(300), deadline=None)
@given(
    length=st.integers(1, 200_000),
    per_rank=st.floats(0.2, 3.0),
    start=st.integers(1, 64),
    multiple=st.sampled_from([1, 2, 4, 8]),
)
def test_min_ring_is_the_smallest_ring_that_fits(
    length: int, per_rank: float, start: int, multiple: int
) -> None:
    """Capacities from a fifth of the document to three times it, over rings of 1-64 (a
    tighter capacity only makes the plain search long)."""
    capacity = max(1, round(per_rank * length / start))
    got = min_ring(length, capacity, start=start, multiple=multiple)
    assert got == _plain_min_ring(length, capacity, start, multiple)


def _model() -> tuple:
    topology = get_topology("zeppelin-C", num_nodes=4)
    return topology, CostModel.default(get_model("llama-7b"), topology)


@settings(max_examples=examples(60), deadline=None)
@given(length=st.integers(2, 300_000), ring_size=st.integers(2, 8), links=st.integers(1, 8))
def test_nvlink_ring_share_is_the_zigzag_formula_whatever_the_nics(
    length: int, ring_size: int, links: int
) -> None:
    topology, cost = _model()
    loads = Loads(topology, 1 << 20, cost, num_links=4)
    share = loads.rank_share(length, ring_size, "nvlink", links)
    assert share is loads.rank_share(length, ring_size, "nvlink", 1)  # one entry for any NICs
    compute = loads.ring_seconds(length, ring_size)
    step = compute / ring_size
    kv = cost.kv_bytes(length) / ring_size
    forward = max(0.0, cost.nvlink.time(kv) - FWD_SHARE * step)
    backward = max(0.0, cost.nvlink.time(2 * kv) - (1 - FWD_SHARE) * step)
    assert share.compute_s == pytest.approx(compute, rel=1e-12)
    assert share.exposed_s == pytest.approx((ring_size - 1) * (forward + backward), rel=1e-12)


@pytest.mark.parametrize("offset", [0, 3])
def test_cross_node_members_wait_as_their_edges_say(offset: int) -> None:
    """Members with a ring neighbour on another node wait ``exposed_s``, the others
    ``inner_exposed_s``; every member gets its zigzag tokens and the ring's compute."""
    topology, cost = _model()
    k = topology.gpus_per_node
    loads = Loads(topology, 1 << 20, cost, num_links=topology.nics_per_node)
    ring = tuple(node * k + (offset + t) % k for node in (1, 2, 3) for t in range(k))
    length = 6_000  # short chunks: the transfers show
    loads.add_ring(ring, length, "nic")
    share = loads.rank_share(length, len(ring), "nic", loads.num_links)
    assert share.inner_exposed_s is not None and share.inner_exposed_s < share.exposed_s
    for i, (rank, tokens) in enumerate(zip(ring, zigzag_loads(length, len(ring)))):
        node = rank // k
        crosses = ring[i - 1] // k != node or ring[(i + 1) % len(ring)] // k != node
        assert loads.exposed[rank] == share.exposed_at(crosses)
        assert loads.attention[rank] == share.compute_s
        assert loads.tokens[rank] == tokens
    assert sum(loads.exposed[r] == share.exposed_s for r in ring) == 6  # two per node boundary
    assert all(loads.tokens[r] == 0 for r in topology.ranks_of_node(0))


def _pruned(loads: Loads) -> dict[str, float]:
    """The pricing the search gives each placement (``staged._place``)."""
    attention_s = np.add(loads.attention, loads.exposed).tolist()
    return price_linear_layouts(
        loads.tokens, attention_s, loads.topology, loads.cost_model, LAYOUTS, prune=True
    )


@settings(max_examples=examples(120), deadline=None)
@given(
    seed=st.integers(0, 10_000),
    spread=st.sampled_from([0.0, 0.02, 0.05, 0.3, 1.0]),
    heavy=st.floats(0.05, 0.6),
    balance_linear=st.booleans(),
)
def test_unpriced_layouts_cannot_win(
    seed: int, spread: float, heavy: float, balance_linear: bool
) -> None:
    """``price_linear_layouts(prune=True)`` prices every layout it keeps as the full pricing
    does, and the fastest layout and its time are the full pricing's. Every GPU holds about the
    same tokens (within ``spread``), some (``heavy``) as one document: attention uneven, tokens
    nearly even, where moving tokens may or may not pay."""
    topology, cost = _model()
    loads = Loads(topology, 1 << 20, cost, balance_linear=balance_linear)
    rng = np.random.default_rng(seed)
    for rank in range(topology.world_size):
        total = max(64, int(8192 * (1 + spread * rng.uniform(-1, 1))))
        for _ in range(1 if rng.random() < heavy else 8):
            loads.add_local(rank, total if rng.random() < heavy else total // 8)
    full = price_linear_layouts(
        loads.tokens,
        np.add(loads.attention, loads.exposed).tolist(),
        topology,
        cost,
        LAYOUTS,
    )
    kept = _pruned(loads)
    assert "attention" in kept
    assert all(kept[name] == full[name] for name in kept)
    assert min(kept.values()) == min(full.values())
    assert fastest(kept) == fastest(full)


def test_unpriced_layouts_are_left_out_where_tokens_are_even() -> None:
    """The GPUs with the most attention (one long document) hold a little fewer tokens than
    the others (short documents): evening the tokens cannot pay, and the pruned pricing prices the
    attention layout alone."""
    topology, cost = _model()
    loads = Loads(topology, 1 << 20, cost)
    for rank in range(topology.world_size):
        if rank % 2:
            loads.add_local(rank, 8000)
        else:
            for _ in range(8):
                loads.add_local(rank, 1050)
    assert list(_pruned(loads)) == ["attention"]


def test_the_remappings_least_time_leaves_out_layouts_that_cannot_pay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where a layout's linear seconds alone leave it a chance, the least its remapping can
    take (``steptime.remap_floor``) may still rule it out: on a batch of a few long documents,
    placements the search prices whose evened tokens the pruned pricing leaves out that way;
    the full pricing of each has the attention layout faster, as the bound said."""
    batch = stress_batch("uniform-long", 16, 0.5, 0)
    calls: list[tuple] = []
    original = linear_layout.price_linear_layouts

    def spy(counts, attention_s, topology, cost, candidates=LAYOUTS, *, prune=False):  # noqa: ANN001, ANN202
        calls.append((list(counts), list(attention_s), candidates, prune))
        return original(counts, attention_s, topology, cost, candidates, prune=prune)

    for module in (linear_layout, staged):
        monkeypatch.setattr(module, "price_linear_layouts", spy)
    plan_batch(
        batch.array.tolist(),
        topology=batch.topology,
        cost_model=batch.cost,
        capacity=batch.capacity,
        options=PlannerOptions(pool=False),
    )
    topology, cost = batch.topology, batch.cost
    left_out = 0
    for counts, attention_s, candidates, prune in calls:
        if not prune:
            continue
        full = original(counts, attention_s, topology, cost, candidates)
        kept = original(counts, attention_s, topology, cost, candidates, prune=True)
        attention = np.asarray(attention_s)
        for name in set(full) - set(kept):
            group = topology.gpus_per_node if name == "node" else topology.world_size
            bound = linear_layout._fullest_target_seconds(np.asarray(counts), group, cost)
            by_tokens = bound + max(attention) > linear_layout._NO_WIN * full["attention"]
            if not by_tokens:  # left out for its remapping
                left_out += 1
                assert full[name] > full["attention"]
    assert left_out > 0


@settings(max_examples=examples(60), deadline=None)
@given(
    moves=st.lists(
        st.tuples(st.integers(0, 31), st.integers(0, 31), st.integers(1, 200_000)),
        min_size=1,
        max_size=40,
    )
)
def test_no_remapping_takes_less_than_its_floor(moves: list[tuple[int, int, int]]) -> None:
    """``steptime.remap_floor`` of the most tokens any rank gives or takes is at most what
    ``remap_seconds_of`` prices the moves at, whatever ranks they join (NVLink, NICs, both)."""
    topology, cost = _model()
    moves = [(a, b, n) for a, b, n in moves if a != b] or [(0, 9, 1)]
    src, dst, tokens = (np.asarray(column) for column in zip(*moves))
    gives = np.bincount(src, weights=tokens, minlength=32)
    takes = np.bincount(dst, weights=tokens, minlength=32)
    most = int(max(gives.max(), takes.max()))
    priced = steptime.remap_seconds_of(src, dst, tokens, topology, cost)
    assert steptime.remap_floor(most, cost) <= priced
    assert steptime.remap_floor(0, cost) == 0.0


def test_node_documents_come_rings_first_then_longest_first() -> None:
    """``_NodeBatch`` orders each node's documents as ``_place_node`` places them: its rings,
    then its whole documents, each longest first (ties: the lower index)."""
    topology, cost = _model()
    lengths = np.asarray(sample_lengths("wlbllm", num_tokens=600_000, seed=3), dtype=np.int64)
    lengths[:6] = lengths[6]  # ties
    loads = Loads(topology, 1 << 20, cost)
    rules = _rules(topology, cost)
    choice = assign_tiers(lengths, loads, rules)
    rng = np.random.default_rng(0)
    docs = np.flatnonzero(~choice.inter).tolist()
    by_node = [[] for _ in range(topology.num_nodes)]
    for doc in rng.permutation(docs).tolist():
        by_node[int(rng.integers(topology.num_nodes))].append(doc)
    batch = _NodeBatch(lengths, choice, by_node, loads)
    for node, given_docs in enumerate(by_node):

        def order(doc: int) -> tuple[int, int]:
            return (-int(lengths[doc]), doc)

        rings = sorted((d for d in given_docs if choice.split[d]), key=order)
        whole = sorted((d for d in given_docs if not choice.split[d]), key=order)
        docs = batch.docs(node)
        assert docs.ring_docs == rings and docs.ring_lengths == lengths[rings].tolist()
        assert docs.whole_docs == whole and docs.whole_lengths == lengths[whole].tolist()
        assert docs.whole_seconds == choice.attention[whole].tolist()
    assert any(batch.docs(n).ring_docs for n in range(topology.num_nodes))


def _rules(topology, cost) -> TierRules:
    options = PlannerOptions()
    thresholds = options.resolved_thresholds(cost)
    chunks = chunk_thresholds(thresholds, topology, options.routing)
    return TierRules(True, True, thresholds, chunks)


@pytest.mark.parametrize("distribution", ["wlbllm", "prolong"])
def test_stage_two_placed_once_serves_both_packings(distribution: str) -> None:
    """A placement whose stage 2 comes from another packing's, or whose inter-node rings come
    from a placement with other rings inside nodes, is the placement made from scratch: the
    same rings, the same loads."""
    from dataclasses import replace

    topology, cost = _model()
    capacity = 65_536
    # One document longer than a node holds: an inter-node ring whatever stage 1 says.
    lengths = np.asarray([*sample_lengths(distribution, num_tokens=700_000, seed=1), 600_000])
    rules = _rules(topology, cost)

    def new_loads() -> Loads:
        return Loads(topology, capacity, cost, topology.nics_per_node, two_d=True)

    base = assign_tiers(lengths, new_loads(), rules)
    rings = tuple(np.flatnonzero(base.splittable)[:3].tolist())
    choice = base.with_rings(list(rings))
    across: dict = {}
    packed = _place(lengths, choice, new_loads(), LAYOUTS, len(rings), across, rings)
    assert rings in across
    unpacked = replace(choice, pack=False)
    reused = _place(lengths, unpacked, new_loads(), LAYOUTS, len(rings), across, rings)
    fresh = _place(lengths, unpacked, new_loads(), LAYOUTS, len(rings), {}, rings)
    assert reused.placements == fresh.placements
    assert reused.loads.cost == fresh.loads.cost and reused.loads.tokens == fresh.loads.tokens
    assert reused.predicted == fresh.predicted
    assert len(packed.placements) == len(fresh.placements)
    # More rings inside nodes: the inter-node rings come from ``across``, the rest is new.
    more = tuple(np.flatnonzero(base.splittable)[:9].tolist())
    assert any(p.tier == Tier.INTER for p in fresh.placements)
    assert more not in across
    shared = _place(lengths, base.with_rings(list(more)), new_loads(), LAYOUTS, 9, across, more)
    alone = _place(lengths, base.with_rings(list(more)), new_loads(), LAYOUTS, 9, {}, more)
    assert shared.placements == alone.placements and shared.loads.cost == alone.loads.cost


def test_cross_node_prices_are_cached_apart_with_and_without_the_2d_scheme() -> None:
    """A ring over whole nodes is priced as the faster of the flat ring and the 2-D scheme;
    the pool placement asks for its flat price (``flat=True``) on the same loads. Whichever is
    asked first, each answer is the fresh one."""
    topology = get_topology("zeppelin-C", num_nodes=4)
    cost = CostModel.default(get_model("llama-7b"), topology)
    length, size = 131072, 16

    def fresh(two_d: bool) -> float:
        return Loads(topology, 1 << 20, cost, two_d=two_d).ring_key(length, size, "nic")

    flat, best = fresh(False), fresh(True)
    assert best < flat  # this ring is one the 2-D scheme wins, so the two prices differ
    for first_flat in (True, False):
        loads, answers = Loads(topology, 1 << 20, cost, two_d=True), {}
        for two_d in (False, True) if first_flat else (True, False):
            answers[two_d] = loads.ring_key(length, size, "nic", flat=not two_d)
        assert answers == {False: flat, True: best}


@NEEDS_NUMBA
@pytest.mark.parametrize(
    ("name", "gpus", "capacity", "fill", "seed"),
    [
        ("wikipedia", 64, 16_384, 0.95, 0),
        ("prolong", 64, 16_384, 0.95, 1),
        ("power-law", 32, 32_768, 0.95, 2),
        ("mixture", 64, 32_768, 0.5, 1),
        ("fixed-6000", 16, 8_192, 1.0, 0),
    ],
)
def test_compiled_stage_two_gives_the_nodes_numpy_gives(
    monkeypatch: pytest.MonkeyPatch, name: str, gpus: int, capacity: int, fill: float, seed: int
) -> None:
    """Stage 2 with its compiled loop (``loops/node_lpt.py``) against numpy's heap: every
    document on the same node, the same documents spread over nodes for want of room, the
    same loads to the last bit; on nearly full batches, where most documents find the heap's
    top full, and one (``fixed-6000``: ten documents fill a node) where the last finds no node."""
    batch = stress_batch(name, gpus, fill, seed, capacity)

    def stage_two() -> tuple:
        loads = batch.new_loads()
        choice = assign_tiers(batch.array, loads, batch.rules)
        placements: list = [None] * len(batch.array)
        by_node, promotions = place_across_nodes(batch.array, choice, loads, placements)
        return by_node, promotions, placements, loads

    def read(balance: bool) -> tuple:
        """What the loop reads: every document's work on its node (each a ring of the node's
        GPUs where it may be: its sizes and their prices) and the nodes' shares of the
        inter-node rings placed first."""
        loads = Loads(batch.topology, batch.capacity, batch.cost, balance_linear=balance)
        choice = assign_tiers(batch.array, loads, batch.rules)
        choice = choice.with_rings(np.flatnonzero(choice.splittable).tolist())
        placements: list = [None] * len(batch.array)
        placement.place_inter_documents(batch.array, choice, loads, placements)
        rest = np.arange(len(batch.array))
        k = batch.topology.gpus_per_node
        work = placement._placed_work(batch.array, rest, choice, loads)
        shares = [placement._ring_shares(loads, n, k) for n in range(batch.topology.num_nodes)]
        if node_lpt.compiled():
            busy, held = node_lpt.ring_shares(*placement._arrays(loads), k)
            shares = list(zip(busy.tolist(), held.tolist()))
        return work.tolist(), shares, int(choice.split.sum())

    assert node_lpt.compiled()
    by_node, promotions, placements, loads = stage_two()
    read_compiled = read(True), read(False)
    monkeypatch.setattr(node_lpt, "compiled", lambda: False)
    want_by_node, want_promotions, want_placements, want_loads = stage_two()
    assert read_compiled == (read(True), read(False))
    assert read_compiled[0][2] > 0, "no document is a ring of a node's GPUs"
    assert by_node == want_by_node
    assert (promotions, placements) == (want_promotions, want_placements)
    assert loads.cost == want_loads.cost and loads.tokens == want_loads.tokens
    assert sum(map(len, by_node)) > 0
    if name.startswith("fixed-"):
        assert promotions > 0, "every document found a node: the spreading path untried"


@pytest.mark.parametrize(("distribution", "seed"), [("lognormal", 0), ("long-tail", 0)])
def test_nodes_placed_before_are_placed_as_from_scratch(
    monkeypatch: pytest.MonkeyPatch, distribution: str, seed: int
) -> None:
    """Stage 3 with the nodes of earlier placements at hand (``place_within_nodes``' ``done``,
    shared by the staged tries of a batch, where numba does not place every node in one call)
    places every try as it would from scratch: the same rings, the same loads to the last bit,
    the same predictions; and it does find nodes placed before (a batch of few documents per
    node, its tries a ring apart)."""
    monkeypatch.setattr(within_nodes.node_rings, "compiled", lambda: False)
    topology, cost = _model()
    capacity = 32_768
    lengths = np.asarray(sample_lengths(distribution, num_tokens=400_000, seed=seed))
    rules = _rules(topology, cost)

    def new_loads() -> Loads:
        return Loads(topology, capacity, cost, topology.nics_per_node, two_d=True)

    base = assign_tiers(lengths, new_loads(), rules)
    extra = np.flatnonzero(base.splittable)
    extra = extra[np.lexsort((extra, -lengths[extra]))].tolist()
    assert len(extra) >= 4
    done: dict = {}
    for count in range(4):
        rings = tuple(extra[:count])
        choice = base.with_rings(list(rings))
        shared = _place(lengths, choice, new_loads(), LAYOUTS, count, {}, rings, done)
        alone = _place(lengths, choice, new_loads(), LAYOUTS, count, {}, rings)
        assert shared.placements == alone.placements
        assert shared.loads.cost == alone.loads.cost
        assert shared.loads.attention == alone.loads.attention
        assert shared.loads.exposed == alone.loads.exposed
        assert shared.loads.tokens == alone.loads.tokens
        assert shared.predicted == alone.predicted
    assert len(done) < 4 * topology.num_nodes, "no node was placed as before"


@pytest.mark.parametrize("pack", [True, False])
def test_a_node_is_placed_as_before_only_where_its_documents_and_loads_are(
    monkeypatch: pytest.MonkeyPatch, pack: bool
) -> None:
    """``place_within_nodes``' ``done`` (where numba does not place every node in one call)
    hands back a node placed before only for the same documents on the same loads: a GPU
    already loaded otherwise, or a whole document given to another node, is placed afresh (as
    with nothing at hand); with rings packed to the node's mean load (which both change) and
    without."""
    from dataclasses import replace

    monkeypatch.setattr(within_nodes.node_rings, "compiled", lambda: False)

    topology, cost = _model()
    lengths = np.asarray(sample_lengths("wlbllm", num_tokens=300_000, seed=3), dtype=np.int64)
    choice = assign_tiers(lengths, Loads(topology, 1 << 20, cost), _rules(topology, cost))
    choice = replace(choice, pack=pack)
    rng = np.random.default_rng(1)
    by_node: list[list[int]] = [[] for _ in range(topology.num_nodes)]
    for doc in rng.permutation(np.flatnonzero(~choice.inter)).tolist():
        by_node[int(rng.integers(topology.num_nodes))].append(doc)
    moved = next(d for d in by_node[0] if not choice.split[d])
    elsewhere = [[d for d in docs if d != moved] for docs in by_node]
    elsewhere[1].append(moved)

    def placed(nodes: list[list[int]], done: dict | None, busy: bool) -> tuple:
        loads = Loads(topology, 1 << 20, cost)
        if busy:  # one GPU of node 0 loaded before stage 3
            loads.add_local(1, 5_000)
        placements: list = [None] * len(lengths)
        promotions = place_within_nodes(lengths, choice, nodes, loads, placements, done)
        return placements, promotions, loads.cost, loads.attention, loads.exposed, loads.tokens

    done: dict = {}
    first = placed(by_node, done, busy=False)
    assert len(done) == topology.num_nodes
    assert placed(by_node, done, busy=False) == first and len(done) == topology.num_nodes
    for nodes, busy in ((by_node, True), (elsewhere, False)):
        assert placed(nodes, done, busy) == placed(nodes, None, busy)
    assert len(done) == topology.num_nodes + 1 + 2  # node 0 loaded; nodes 0 and 1 given others


def _node_attempt(
    monkeypatch: pytest.MonkeyPatch, loads: Loads, case: dict, *, compiled: bool
) -> tuple:
    """``_place_node`` of ``case`` on a copy of ``loads``, compiled or in Python: its answer,
    placements, leftovers and loads, or the capacity error it raised."""
    import megatron_zeppelin.planner.place.within_nodes as within

    monkeypatch.setattr(within.node_rings, "compiled", lambda: compiled)
    mine = Loads(
        loads.topology, loads.capacity, loads.cost_model, balance_linear=loads.balance_linear
    )
    for name in ("cost", "attention", "exposed", "tokens"):
        setattr(mine, name, list(getattr(loads, name)))
    placements: list = [None] * case["size"]
    overflow: list[int] | None = [] if case["hand_on"] else None
    try:
        promoted = within._place_node(
            case["docs"], case["ranks"], None, case["smallest"], case["largest"], mine,  # type: ignore[arg-type]
            placements, target=case["target"], by_room=case["by_room"], overflow=overflow,
            local=case["local"],
        )  # fmt: skip
    except within.CapacityError as error:
        return ("full", str(error))
    return (promoted, placements, overflow, mine.cost, mine.attention, mine.exposed, mine.tokens)


@NEEDS_NUMBA
@pytest.mark.parametrize("cluster", ["zeppelin-C", "dgx-h100"])
def test_compiled_stage_three_places_a_node_as_python_does(
    monkeypatch: pytest.MonkeyPatch, cluster: str
) -> None:
    """One node's attempt (``_place_node``) in the compiled loop (``loops/node_rings.py``)
    against Python's, on 300 drawn nodes: GPUs already holding loads and tokens, rings and whole
    documents of any size, packed or not, by load or by room, leftovers handed on or not. The
    same answer every time: the same rings and GPUs, the same loads to the last bit, or the same
    document out of room; and every answer comes up (placed, a ring out of room, a whole
    document out of room, which the compiled loop leaves to Python)."""
    import megatron_zeppelin.planner.place.within_nodes as within

    topology = get_topology(cluster, num_nodes=2)
    cost = CostModel.default(get_model("llama-7b"), topology)
    k, capacity = topology.gpus_per_node, 32_768
    ranks = list(topology.ranks_of_node(1))
    local = [within.local_placement(r) for r in range(topology.world_size)]
    rng = np.random.default_rng(7)
    answers: list[int] = []
    place = within.node_rings.place

    def counted(*args):  # noqa: ANN002, ANN202
        answers.append(place(*args))
        return answers[-1]

    monkeypatch.setattr(within.node_rings, "place", counted)
    for _ in range(300):
        balance_linear, by_room, hand_on = (bool(b) for b in rng.integers(0, 2, 3))
        loads = Loads(topology, capacity, cost, balance_linear=balance_linear)
        for rank in ranks:  # what stage 2's inter-node rings left on the node
            held = int(rng.integers(0, capacity // 2)) if rng.random() < 0.5 else 0
            if held:
                loads.add_local(rank, held)
        lengths = np.concatenate(
            [rng.integers(2, 4 * capacity, int(rng.integers(0, 5))), rng.integers(1, 6000, 12)]
        ).astype(np.int64)
        rings = rng.random(len(lengths)) < 0.3
        rings[lengths > capacity] = True
        order = np.lexsort((np.arange(len(lengths)), -lengths, ~rings))
        ring_docs = [d for d in order.tolist() if rings[d]]
        whole = [d for d in order.tolist() if not rings[d]]
        seconds = [loads.ring_seconds(int(lengths[d]), 1) for d in whole]
        docs = within._NodeDocs(
            ring_docs, lengths[ring_docs].tolist(), whole, lengths[whole].tolist(), seconds
        )
        largest = rng.integers(2, k + 1, len(lengths))
        smallest = int(rng.choice([2, k]))
        target = (
            float(np.mean(loads.cost[ranks[0] :]) + rng.random() * 0.05)
            if rng.random() < 0.5
            else None
        )

        case = dict(
            docs=docs, ranks=ranks, smallest=smallest, largest=largest, target=target,
            by_room=by_room, hand_on=hand_on, local=local, size=len(lengths),
        )  # fmt: skip
        want = _node_attempt(monkeypatch, loads, case, compiled=False)
        assert _node_attempt(monkeypatch, loads, case, compiled=True) == want
    assert set(answers) == {
        within.node_rings.PLACED,
        within.node_rings.FULL,
        within.node_rings.AGAIN,
    }


@NEEDS_NUMBA
def test_compiled_stage_three_places_every_node_as_python_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stage 3 over every node in one compiled call (``node_rings.place_nodes``) against numpy's
    node by node: staged placements of batches tight enough that a node's first attempt runs out
    of room, a later one hands rings on, and a whole document finds no GPU (the node is then
    placed in Python between calls), packed to each node's mean load or not, balancing linear
    seconds or not. The same placements, promotions, loads to the last bit and predictions."""
    seen: set = set()
    place_nodes = within_nodes.node_rings.place_nodes

    def watched(*args):  # noqa: ANN002, ANN202 - node_rings.place_nodes' own
        stop, attempt = place_nodes(*args)
        loads, start, used = args[0], args[8], args[9][2]
        seen.update(("attempt", a) for a in used[start:stop].tolist())
        if stop < len(loads[0]) // args[3]:
            seen.add(("again", attempt))
        return stop, attempt

    def placed(case: tuple, count: int, pack: bool, balance: bool, compiled: bool) -> tuple:
        monkeypatch.setattr(within_nodes.node_rings, "compiled", lambda: compiled)
        monkeypatch.setattr(within_nodes.node_rings, "place_nodes", watched)
        batch = stress_batch(*case)

        def new_loads() -> Loads:
            topology = batch.topology
            return Loads(topology, batch.capacity, batch.cost, topology.nics_per_node,
                         balance_linear=balance, two_d=True)  # fmt: skip

        base = assign_tiers(batch.array, new_loads(), _rules(batch.topology, batch.cost))
        extra = np.flatnonzero(base.splittable)
        rings = tuple(extra[np.lexsort((extra, -batch.array[extra]))][:count].tolist())
        choice = dataclasses.replace(base.with_rings(list(rings)), pack=pack)
        try:
            found = _place(batch.array, choice, new_loads(), LAYOUTS, count, {}, rings)
        except CapacityError as error:
            return (str(error),)
        loads = found.loads
        figures = loads.cost, loads.attention, loads.exposed, loads.tokens
        return found.placements, found.promotions, *figures, found.predicted

    cases = [
        ("lognormal", 16, 0.97, 0, 4_096),
        ("lognormal", 32, 0.97, 0, 4_096),
        ("fixed-2500", 16, 0.9, 0, 8_192),
        ("wikipedia", 32, 0.97, 0, 4_096),
    ]
    placements = 0
    for case in cases:
        for count, pack, balance in ((0, True, True), (2, False, True), (1, True, False)):
            want = placed(case, count, pack, balance, compiled=False)
            assert placed(case, count, pack, balance, compiled=True) == want, (case, count)
            placements += len(want) > 1
    assert placements >= 10, "too few placements found room"
    assert {("attempt", 0), ("attempt", 2), ("again", 0), ("again", 2)} <= seen, seen


@NEEDS_NUMBA
def test_compiled_stage_three_hands_a_ring_on_and_places_whole_documents_by_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node whose ring finds no room on its GPUs at any size (it is handed on, at the last
    attempt) and whose whole documents then go to the GPU with the most room, not the least
    loaded one: compiled over every node as numpy places it node by node."""
    topology, cost = _model()
    capacity = 1_000
    lengths = np.asarray([5_000, 50, 40], dtype=np.int64)  # a ring, two whole documents
    base = assign_tiers(lengths, Loads(topology, 1 << 20, cost), _rules(topology, cost))
    split = np.asarray([True, False, False])
    choice = dataclasses.replace(base, split=split, inter=~split & split, wanted_nodes={})
    by_node: list[list[int]] = [[0, 1, 2]] + [[] for _ in range(topology.num_nodes - 1)]

    def placed(compiled: bool) -> tuple:
        monkeypatch.setattr(within_nodes.node_rings, "compiled", lambda: compiled)
        loads = Loads(topology, capacity, cost)
        # GPU 0 busy with room, GPU 1 idle and nearly full, the others busy and full.
        for rank, (tokens, seconds) in enumerate([(100, 5.0), (900, 0.0)] + [(950, 9.0)] * 6):
            loads.add_local(rank, tokens, seconds)
        placements: list = [None] * len(lengths)
        promotions = place_within_nodes(lengths, choice, by_node, loads, placements)
        return placements, promotions, loads.cost, loads.attention, loads.exposed, loads.tokens

    want = placed(compiled=False)
    assert want[0][1].ring == (0,) and want[0][2].ring == (0,), "not by room"
    assert want[0][0].ring[0] >= topology.gpus_per_node, "the ring was not handed on"
    assert placed(compiled=True) == want


@NEEDS_NUMBA
@pytest.mark.parametrize("cluster", ["zeppelin-C", "dgx-h100", "slow-nvlink"])
def test_compiled_ring_prices_are_the_loads_own(cluster: str) -> None:
    """The compiled loops price a ring as ``Loads`` does, to the last bit: over NVLink,
    ``rank_share``'s compute and exposed seconds and ``ring_key``, at every size of a node; flat
    across nodes, ``ring_key``, at every size of the world, routed over four NICs or one;
    balancing linear seconds or not, over lengths from a few tokens to a million; with NVLink
    slower than a NIC too; and flat across nodes (``_flat_share``, which ``ring_line.py`` adds
    rings with), ``rank_share``'s compute and both exposed seconds, at a member whose edges
    cross nodes and at one whose do not. And they size the rings as ``zigzag_loads`` and
    ``min_ring`` do."""
    from megatron_zeppelin.planner.loops import ring_prices

    assert ring_prices.compiled()
    inner_waits = 0
    topology = get_topology(cluster.replace("slow-nvlink", "zeppelin-C"), num_nodes=4)
    cost = CostModel.default(get_model("llama-7b"), topology)
    if cluster == "slow-nvlink":  # NVLink, not the NIC, sets a direct or routed edge's time
        cost = dataclasses.replace(cost, nvlink=LinkCost(cost.nic.bytes_per_s / 2, 3e-6))
    lengths = np.random.default_rng(3).integers(2, 1 << 20, 300).tolist() + [2, 3, 17, 1 << 20]
    for balance_linear, links in ((True, 1), (False, 1), (True, 4), (False, 4)):
        loads = Loads(topology, 1 << 20, cost, links, balance_linear=balance_linear)
        terms = loads.ring_terms()
        for length in lengths:
            for g in range(1, topology.gpus_per_node + 1):
                share = loads.rank_share(length, g, "nvlink")
                assert ring_prices._share(length, g, terms) == (share.compute_s, share.exposed_s)
                assert ring_prices._key(length, g, terms) == loads.ring_key(length, g, "nvlink")
                assert ring_prices._most_tokens(length, g) == max(zigzag_loads(length, g))
            for g in range(2, topology.world_size + 1):
                want = loads.ring_key(length, g, "nic", flat=True)
                assert ring_prices._flat_key(length, g, terms) == want, (length, g, links)
                share = loads.rank_share(length, g, "nic", links, flat=True)
                inner = share.exposed_at(False)
                assert ring_prices._flat_share(length, g, terms) == (
                    share.compute_s, share.exposed_s, inner
                ), (length, g, links)  # fmt: skip
                inner_waits += inner > 0
    # A member whose edges stay inside its node waits in some rings (``ring_line`` prices it).
    assert inner_waits > 0
    for length in lengths[:100]:  # the narrowest ring that fits, as ``loads.min_ring`` finds it
        for capacity, start in ((4096, 1), (4096, 3), (65_536, 2), (1 << 20, 8)):
            want = min_ring(length, capacity, start=start)
            assert ring_prices._min_ring(length, capacity, start) == (-1 if want is None else want)
