"""Ring exchanges, routing over proxies, byte counters, timeouts and the gloo harness.

Tier: processes (gloo, 2 to 4 ranks on CPU via ``launch.ranks.run_distributed``), plus pure checks
of how messages are cut into legs and of the backward's gradient schedule. Zeppelin worlds that
are a subset or a permutation of the processes (tensor parallelism) run the same exchanges; a
proxy relays while it sleeps before its own ``wait``. Plans are built by hand here so the
exchanger is tested apart from the planner: 2 nodes x 2 GPUs, one NIC per GPU, documents spanning
both nodes (rings that cross nodes between different local indices, so routed parts take all
three hops), documents in one node, a local one, and one shorter than its ring's 2g chunks (empty
blocks).
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import torch.distributed as dist

from megatron_zeppelin.comm.counters import LinkCounters, comparable
from megatron_zeppelin.comm.exchange import DistExchanger, ZeppelinCommError
from megatron_zeppelin.comm.groups import ZeppelinGroups
from megatron_zeppelin.comm.pending import step_legs
from megatron_zeppelin.launch.ranks import DistributedRunError, run_distributed
from megatron_zeppelin.planner.plan.plan import (
    Plan,
    Route,
    RoutePart,
    SequencePlan,
    Tier,
    TokenRange,
    zigzag_spans,
)
from megatron_zeppelin.planner.plan.schedule import (
    Message,
    Segment,
    block_tokens,
    gradient_schedule,
    link_bytes,
    ring_schedule,
    training_link_bytes,
)
from megatron_zeppelin.topology.model import Topology

ROW_SHAPE = (2, 3)
TIMEOUT_S = 60.0


def balanced_linear(lengths: list[int], world: int) -> list[list[TokenRange]]:
    """Concatenate the documents and cut the stream into ``world`` near-equal pieces."""
    total = sum(lengths)
    cuts = [round(r * total / world) for r in range(world + 1)]
    linear: list[list[TokenRange]] = [[] for _ in range(world)]
    pos = 0
    for seq, length in enumerate(lengths):
        for rank in range(world):
            lo, hi = max(cuts[rank], pos), min(cuts[rank + 1], pos + length)
            if hi > lo:
                linear[rank].append(TokenRange(seq, lo - pos, hi - pos))
        pos += length
    return linear


def hand_plan() -> Plan:
    topo = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2)
    docs = [  # (length, ring)
        (23, (0, 1, 2, 3)),  # spans both nodes; edges 1->2 and 3->0 cross rails
        (9, (2, 0)),  # two nodes, one rail
        (7, (0, 1)),  # one node
        (5, (3, 2)),
        (1, (3,)),  # local, one token
        (3, (0, 1, 2, 3)),  # shorter than 2g = 8 chunks: some blocks are empty
    ]
    sequences = []
    for seq, (length, ring) in enumerate(docs):
        nodes = {topo.node_of(r) for r in ring}
        tier = Tier.LOCAL if len(ring) == 1 else Tier.INTRA if len(nodes) == 1 else Tier.INTER
        sequences.append(SequencePlan(seq, length, tier, ring, zigzag_spans(length, ring)))
    routes = (
        Route(1, 2, (RoutePart(1, 3, 2), RoutePart(0, 2, 1))),
        Route(3, 0, (RoutePart(3, 1, 1), RoutePart(2, 0, 1))),
        Route(0, 2, (RoutePart(1, 3, 1), RoutePart(0, 2, 3))),  # part 0 takes all three hops
        Route(2, 0, (RoutePart(2, 0, 1), RoutePart(3, 1, 0))),  # zero weight: never used
    )
    linear = balanced_linear([d[0] for d in docs], topo.world_size)
    return Plan(topology=topo, sequences=tuple(sequences), linear=linear, routes=routes)


def payload_rows(step: int, msg: Message) -> torch.Tensor:
    """Rows that identify their step, edge and row index, so a misrouted row shows."""
    rows = torch.arange(msg.num_tokens * 6, dtype=torch.float64).reshape(msg.num_tokens, *ROW_SHAPE)
    return rows + 1000.0 * step + 100.0 * msg.src + 10.0 * msg.dst


# --- pure -----------------------------------------------------------------------------------


@pytest.mark.pure
def test_legs_cover_every_message_row_once_and_skip_same_gpu_hops():
    plan = hand_plan()
    routes = {(r.src, r.dst): r for r in plan.routes}
    for step in ring_schedule(plan):
        legs = step_legs(step, routes)
        for index, msg in enumerate(step):
            mine = [leg for message, leg in legs if message == index]
            covered = sorted((leg.offset, leg.offset + leg.num_tokens) for leg in mine)
            pos = 0
            for lo, hi in covered:
                assert lo == pos and hi > lo
                pos = hi
            assert pos == msg.num_tokens
            for leg in mine:
                assert leg.path[0] == msg.src and leg.path[-1] == msg.dst
                assert all(a != b for a, b in leg.hops)
                crossings = [h for h in leg.hops if not plan.topology.same_node(*h)]
                assert len(crossings) == (0 if plan.topology.same_node(msg.src, msg.dst) else 1)


@pytest.mark.pure
def test_counters_classify_like_the_prediction():
    topo = Topology(num_nodes=2, gpus_per_node=4, nics_per_node=2)
    counters = LinkCounters(topo)
    counters.record(0, 3, 10)
    counters.record(3, 5, 7)  # GPU 3 sits next to NIC 1 of node 0
    counters.record(6, 1, 5)
    assert counters.to_dict() == {"nvlink": 10, "nic": 12, "nic:0.1": 7, "nic:1.1": 5}
    assert comparable({"nvlink": 0, "nic": 0, "nic:0.0": 0}) == {"nvlink": 0, "nic": 0}
    with pytest.raises(ValueError, match="unknown link class"):
        counters.add({"pcie": 1})


@pytest.mark.pure
def test_gradient_schedule_brings_every_block_gradient_home_along_the_ring():
    plan = hand_plan()
    sizes = block_tokens(plan)
    kv, grad = ring_schedule(plan), gradient_schedule(plan)
    assert [[(m.src, m.dst) for m in step] for step in grad] == [
        [(m.src, m.dst) for m in step] for step in kv
    ]
    for seq in (s for s in plan.sequences if s.ring_size > 1):
        g, ring = seq.ring_size, seq.ring
        for i, origin in enumerate(ring):
            # The gradient of origin's block starts one position on (compute 1 there) and
            # makes g - 1 hops forward, the last one reaching origin, with the block's size.
            hops = [
                (m.src, m.dst, seg.num_tokens)
                for step in grad
                for m in step
                for seg in m.segments
                if (seg.seq, seg.origin) == (seq.id, origin)
            ]
            path = [ring[(i + 1 + h) % g] for h in range(g)]
            assert [(a, b) for a, b, _ in hops] == list(zip(path[:-1], path[1:]))
            assert {n for _, _, n in hops} <= {sizes.get((seq.id, origin), 0)}


@pytest.mark.pure
def test_training_bytes_are_kv_twice_plus_gradients_per_link_class():
    plan = hand_plan()
    for routing in (False, True):
        kv = link_bytes(plan, ring_schedule(plan), bytes_per_token=8, routing=routing)
        grad = link_bytes(plan, gradient_schedule(plan), bytes_per_token=16, routing=routing)
        both = training_link_bytes(
            plan, kv_bytes_per_token=8, grad_bytes_per_token=16, routing=routing
        )
        keys = set(kv) | set(grad) | set(both)
        assert {k: both.get(k, 0) for k in keys} == {
            k: 2 * kv.get(k, 0) + grad.get(k, 0) for k in keys
        }
    with pytest.raises(ValueError, match="non-negative"):
        training_link_bytes(plan, kv_bytes_per_token=-1, grad_bytes_per_token=0, routing=False)


# --- processes ------------------------------------------------------------------------------


def _exchange_worker(rank: int, world_size: int) -> dict:
    plan = hand_plan()
    groups = ZeppelinGroups.create(plan.topology)
    steps = ring_schedule(plan)
    # Every rank handed every rank's messages, then only those it sends, receives or relays
    # (what the engine hands it): ranks 1 and 3 relay edge 0 -> 2 of a ring they are not on.
    views = ring_schedule(plan, rank=rank)
    measured = {}
    for kind, routing in itertools.product(("every", "own"), (False, True)):
        counters = LinkCounters(plan.topology)
        ex = DistExchanger(groups, plan=plan, routing=routing, counters=counters, timeout_s=30)
        for s, msgs in enumerate(steps if kind == "every" else views):
            payload = {(m.src, m.dst): payload_rows(s, m) for m in msgs if m.src == rank}
            pending = ex.start(
                msgs, payload, row_shape=ROW_SHAPE, dtype=torch.float64, tag=f"step {s}"
            )
            got = pending.wait()
            assert set(got) == {(m.src, m.dst) for m in steps[s] if m.dst == rank}
            for m in steps[s]:
                if m.dst == rank:
                    assert torch.equal(got[(m.src, m.dst)], payload_rows(s, m)), (routing, s, m)
            with pytest.raises(ZeppelinCommError, match="called twice"):
                pending.wait()
        measured[(kind, routing)] = counters.all_reduce()

    # Inter- and intra-node queues in flight together, waited in the reverse order.
    ex = DistExchanger(groups, plan=plan, routing=True, timeout_s=30)
    inter = ring_schedule(plan, tiers=(Tier.INTER,))[0]
    intra = ring_schedule(plan, tiers=(Tier.INTRA,))[0]
    pending = [
        ex.start(
            msgs,
            {(m.src, m.dst): payload_rows(k, m) for m in msgs if m.src == rank},
            row_shape=ROW_SHAPE,
            dtype=torch.float64,
            tag=tag,
        )
        for k, (msgs, tag) in enumerate(((inter, "inter"), (intra, "intra")))
    ]
    for k in (1, 0):
        got = pending[k].wait()
        for (src, dst), rows in got.items():
            msg = next(m for m in (inter, intra)[k] if (m.src, m.dst) == (src, dst))
            assert torch.equal(rows, payload_rows(k, msg))

    # Misuse is reported before anything is posted, so every rank can check it alone.
    msgs = steps[0]
    mine = [m for m in msgs if m.src == rank and m.num_tokens]
    if mine:
        m = mine[0]
        bad = {(m.src, m.dst): payload_rows(0, m).float()}
        with pytest.raises(ZeppelinCommError, match="the message needs"):
            ex.start(msgs, bad, row_shape=ROW_SHAPE, dtype=torch.float64, tag="bad dtype")
        with pytest.raises(ZeppelinCommError, match="no payload"):
            ex.start(msgs, {}, row_shape=ROW_SHAPE, dtype=torch.float64, tag="missing")
    with pytest.raises(ZeppelinCommError, match="sends no such message"):
        ex.start(msgs, {(rank, rank): torch.zeros(1)}, row_shape=(), dtype=torch.float32, tag="x")
    return measured


@pytest.mark.dist
def test_exchange_routed_and_direct_deliver_the_same_rows_and_count_the_predicted_bytes():
    plan = hand_plan()
    results = run_distributed(_exchange_worker, plan.world_size, timeout_s=TIMEOUT_S)
    steps = ring_schedule(plan)
    bytes_per_token = 6 * 8
    for routing in (False, True):
        predicted = comparable(
            link_bytes(plan, steps, bytes_per_token=bytes_per_token, routing=routing)
        )
        for measured in results:
            assert measured[("every", routing)] == predicted
            assert measured[("own", routing)] == predicted
    direct, routed = results[0][("every", False)], results[0][("every", True)]
    assert routed["nic"] == direct["nic"]  # routing moves NIC bytes, it never adds any
    assert routed["nvlink"] > direct["nvlink"]
    # Direct sends use only the senders' NICs; routing spreads them over every NIC of both nodes.
    nics = [f"nic:{n}.{k}" for n in range(2) for k in range(2)]
    assert all(routed.get(key, 0) > 0 for key in nics)


def _failure_worker(rank: int, world_size: int) -> dict:
    topo = Topology(num_nodes=2, gpus_per_node=1, nics_per_node=1)
    ring = (0, 1)
    seq = SequencePlan(0, 8, Tier.INTER, ring, zigzag_spans(8, ring))
    plan = Plan(topology=topo, sequences=(seq,), linear=balanced_linear([8], 2))
    groups = ZeppelinGroups.create(topo)
    if rank == 1:
        time.sleep(3.0)  # never sends; then leaves, which closes its connections
        return {}
    msg = Message(1, 0, (Segment(0, 1, 4),))
    out = {}
    ex = DistExchanger(groups, plan=plan, routing=False, timeout_s=1.0)
    for tag in ("fwd step 0 (slow peer)", "fwd step 1 (dead peer)"):
        t0 = time.monotonic()
        try:
            ex.start([msg], {}, row_shape=(3,), dtype=torch.float32, tag=tag).wait()
            out[tag] = None
        except ZeppelinCommError as exc:
            out[tag] = (str(exc), time.monotonic() - t0)
        ex.timeout_s = 20.0  # the dead peer must be noticed long before this
    return out


@pytest.mark.dist
def test_slow_or_dead_peer_raises_an_error_naming_the_tag_within_the_timeout():
    out = run_distributed(_failure_worker, 2, timeout_s=TIMEOUT_S)[0]
    message, elapsed = out["fwd step 0 (slow peer)"]
    assert "fwd step 0 (slow peer)" in message and "recv 1->0" in message
    assert elapsed < 5.0
    message, elapsed = out["fwd step 1 (dead peer)"]
    assert "fwd step 1 (dead peer)" in message
    assert elapsed < 15.0


def _world_mismatch_worker(rank: int, world_size: int) -> str:
    if rank == 1:
        raise KeyError("rank one fails on purpose")
    with pytest.raises(ValueError, match="process group has 2"):
        ZeppelinGroups.create(Topology(num_nodes=2, gpus_per_node=2, nics_per_node=1))
    time.sleep(60)  # a straggler: the harness must kill it soon after rank 1 failed
    return "unreachable"


@pytest.mark.dist
def test_harness_names_the_failing_rank_and_kills_stragglers():
    t0 = time.monotonic()
    with pytest.raises(DistributedRunError, match="rank 1 of 2 raised KeyError") as info:
        run_distributed(_world_mismatch_worker, 2, timeout_s=TIMEOUT_S)
    assert info.value.rank == 1
    assert time.monotonic() - t0 < 30.0


@pytest.mark.pure
def test_the_harness_names_the_first_rank_to_raise_not_the_lowest():
    """A rank that raises and exits can make a peer raise too (its connection closed mid-
    handshake): the harness names the first to raise, whatever their order by rank."""
    from megatron_zeppelin.launch.ranks import _raise_first_cause, _Watch

    closed = "RuntimeError('Gloo connectFullMesh failed: Connection closed by peer')"
    outcomes = [
        {"ok": False, "error": closed, "traceback": "", "at": 2.0},
        {"ok": False, "error": "KeyError('rank one fails on purpose')", "traceback": "", "at": 1.0},
    ]
    with pytest.raises(DistributedRunError) as info:
        _raise_first_cause(outcomes, _Watch(), [], 2, 60.0, 30.0)
    assert info.value.rank == 1
    assert str(info.value).index("rank 1 of 2") < str(info.value).index("rank 0 of 2")


# --- sub-worlds: Zeppelin ranks that are not the global ranks --------------------------------
PERMUTED = (2, 0, 3, 1)  # Zeppelin rank z runs on global rank PERMUTED[z]
HALVES = ((0, 2), (3, 1))  # two Zeppelin worlds of 2, as tensor parallelism 2 makes them


def _small_plan() -> Plan:
    """2 nodes x 1 GPU: one document across the nodes, one local."""
    topo = Topology(num_nodes=2, gpus_per_node=1, nics_per_node=1)
    sequences = (
        SequencePlan(0, 11, Tier.INTER, (0, 1), zigzag_spans(11, (0, 1))),
        SequencePlan(1, 3, Tier.LOCAL, (1,), zigzag_spans(3, (1,))),
    )
    return Plan(topology=topo, sequences=sequences, linear=balanced_linear([11, 3], 2))


def _run_steps(ex: DistExchanger, plan: Plan, rank: int) -> None:
    for s, msgs in enumerate(ring_schedule(plan)):
        payload = {(m.src, m.dst): payload_rows(s, m) for m in msgs if m.src == rank}
        got = ex.start(
            msgs, payload, row_shape=ROW_SHAPE, dtype=torch.float64, tag=f"step {s}"
        ).wait()
        for m in msgs:
            if m.dst == rank:
                assert torch.equal(got[(m.src, m.dst)], payload_rows(s, m)), (s, m)


def _subworld_worker(rank: int, world_size: int) -> dict:
    out: dict = {}
    # One Zeppelin world over every process, in another order: the routed hand plan.
    plan = hand_plan()
    groups = ZeppelinGroups.create(plan.topology, ranks=PERMUTED)
    assert groups.global_rank(groups.rank) == rank and groups.rank == PERMUTED.index(rank)
    for routing in (False, True):
        counters = LinkCounters(plan.topology)
        ex = DistExchanger(groups, plan=plan, routing=routing, counters=counters, timeout_s=30)
        _run_steps(ex, plan, groups.rank)
        out[("permuted", routing)] = counters.all_reduce(groups.world)
    # Two Zeppelin worlds of two processes each, exchanging at the same time.
    small = _small_plan()
    mine = next(w for w in HALVES if rank in w)
    reduced, real = [], dist.all_reduce
    dist.all_reduce = lambda t, group=None, **kw: (
        reduced.append(group),
        real(t, group=group, **kw),
    )[1]  # noqa: E501
    try:
        groups = ZeppelinGroups.create(small.topology, ranks=mine, timeout_s=30)
    finally:
        dist.all_reduce = real
    assert groups.global_ranks == mine and groups.rank == mine.index(rank)
    # Warmed at creation, in creation order: the sub-world's own group, its node, its rail.
    mine_groups = [groups.world, *(g for g in groups.nodes if g), *(g for g in groups.rails if g)]
    out["warmed"] = len(reduced) == 3 and all(a is b for a, b in zip(reduced, mine_groups))
    counters = LinkCounters(small.topology)
    ex = DistExchanger(groups, plan=small, routing=True, counters=counters, timeout_s=30)
    _run_steps(ex, small, groups.rank)
    out["halves"] = counters.all_reduce(groups.world)
    with pytest.raises(ValueError, match="Zeppelin world has 2 processes"):
        ZeppelinGroups.create_all(plan.topology, HALVES)
    return out


def _subworld_and_relay_worker(rank: int, world_size: int) -> dict:
    """Both scenarios in one spawn (start-up is most of a small test's time)."""
    return {
        "subworld": _subworld_worker(rank, world_size),
        "relay": _relay_worker(rank, world_size),
    }


@pytest.fixture(scope="module")
def subworld_and_relay() -> list[dict]:
    return run_distributed(_subworld_and_relay_worker, 4, timeout_s=TIMEOUT_S)


@pytest.mark.dist
def test_zeppelin_worlds_on_a_subset_or_permutation_of_the_processes(subworld_and_relay):
    results = [r["subworld"] for r in subworld_and_relay]
    plan, small = hand_plan(), _small_plan()
    for routing in (False, True):
        predicted = comparable(
            link_bytes(plan, ring_schedule(plan), bytes_per_token=6 * 8, routing=routing)
        )
        assert all(r[("permuted", routing)] == predicted for r in results)
    predicted = comparable(
        link_bytes(small, ring_schedule(small), bytes_per_token=6 * 8, routing=True)
    )
    # Each world's counters sum that world's sends only, not the other world's.
    assert predicted["nic"] > 0 and all(r["halves"] == predicted for r in results)
    # Every group of a sub-world (tensor parallelism) is warmed up collectively at creation.
    assert all(r["warmed"] for r in results)


# --- overlapped relays ------------------------------------------------------------------------
PROXY_SLEEP_S = 2.0


def _relay_worker(rank: int, world_size: int) -> dict:
    """Message 0 -> 2 on the routed edge (0, 2): part 0 goes 0 -> 1 -> 3 -> 2, so ranks 1 and
    3 relay; they sleep before their own ``wait``."""
    plan = hand_plan()
    groups = ZeppelinGroups.create(plan.topology)
    msg = Message(0, 2, (Segment(0, 0, 8),))
    payload = {(0, 2): payload_rows(0, msg)} if rank == 0 else {}
    out: dict = {}
    for overlap in (True, False):
        counters = LinkCounters(plan.topology)
        ex = DistExchanger(
            groups, plan=plan, routing=True, counters=counters, timeout_s=30, overlap=overlap
        )
        t0 = time.monotonic()
        pending = ex.start(
            [msg], payload, row_shape=ROW_SHAPE, dtype=torch.float64, tag=f"relay overlap={overlap}"
        )
        if rank in (1, 3):
            time.sleep(PROXY_SLEEP_S)
            out[("relayed before wait", overlap)] = counters.to_dict()
        got = pending.wait()
        out[("wait returned after", overlap)] = time.monotonic() - t0
        if rank == 2:
            assert torch.equal(got[(0, 2)], payload_rows(0, msg))
        dist.barrier()
    # A relay whose input never comes: the proxy's wait names the tag within the timeout.
    ex = DistExchanger(groups, plan=plan, routing=True, timeout_s=1.0)
    if rank == 0:
        time.sleep(2.5)  # never starts the exchange
        return out
    t0 = time.monotonic()
    try:
        ex.start([msg], {}, row_shape=ROW_SHAPE, dtype=torch.float64, tag="lost input").wait()
        out["lost input"] = None
    except ZeppelinCommError as exc:
        out["lost input"] = (str(exc), time.monotonic() - t0)
    return out


@pytest.mark.dist
def test_a_proxy_relays_before_it_calls_wait(subworld_and_relay):
    results = [r["relay"] for r in subworld_and_relay]
    # Overlapped: the destination has its rows while both proxies still sleep.
    assert results[2][("wait returned after", True)] < PROXY_SLEEP_S / 2
    for proxy in (1, 3):
        relayed = results[proxy][("relayed before wait", True)]
        assert relayed["nvlink" if proxy == 3 else "nic"] > 0, relayed
    # Staged (the NCCL way): the destination waits for the proxies' own wait.
    assert results[2][("wait returned after", False)] >= PROXY_SLEEP_S * 0.9
    assert results[1][("relayed before wait", False)] == {"nvlink": 0, "nic": 0}
    message, elapsed = results[1]["lost input"]
    assert "'lost input'" in message and "recv 0->1" in message
    assert elapsed < 5.0
