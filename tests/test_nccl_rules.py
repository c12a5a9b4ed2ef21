"""NCCL's rules that gloo does not enforce, checked on the CPU.

Pure tier: the staged exchange (``comm/pending.py``, the NCCL path) runs against a stand-in of
``torch.distributed`` that records what would be posted and how it is waited on: every rank's
batches follow one communicator order and replay to the end under NCCL's matching rules
(``comm/posting.py``), waits are stream-ordered on NCCL (no host timeout) and bounded on the host
on gloo. The replay check itself is shown rejecting crossed orders, size mismatches and missing
peers. Threads tier: every group ``ZeppelinGroups`` creates is warmed up collectively, in
creation order, and carries the Zeppelin timeout (a one-process gloo world; sub-worlds of
several processes are covered in ``test_comm_exchange.py``).
"""

from __future__ import annotations

import types
from collections import namedtuple
from datetime import timedelta

import pytest
import torch
from test_comm_exchange import ROW_SHAPE, hand_plan, payload_rows

from megatron_zeppelin.comm import pending as pending_module
from megatron_zeppelin.comm.exchange import DistExchanger
from megatron_zeppelin.comm.groups import POSTING_ORDER, ZeppelinGroups
from megatron_zeppelin.comm.posting import Batch, PostedOp, PostingLog, check_posting_order
from megatron_zeppelin.planner.plan.plan import Tier
from megatron_zeppelin.planner.plan.schedule import gradient_schedule, ring_schedule


class FakeDist:
    """What ``comm/pending.py`` calls in ``torch.distributed``, recording instead of sending:
    every batch posted (group, ops) and the timeout every wait was given."""

    P2POp = namedtuple("P2POp", "op tensor peer group")

    def __init__(self) -> None:
        self.batches: list[tuple[str, list[tuple[str, int]]]] = []
        self.wait_timeouts: list[timedelta | None] = []

    def isend(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        raise AssertionError("the staged path posts batches only")

    irecv = isend

    def batch_isend_irecv(self, ops):  # noqa: ANN001, ANN201
        assert len({op.group for op in ops}) == 1, "one communicator per batch"
        kinds = [("send" if op.op is self.isend else "recv", op.peer) for op in ops]
        self.batches.append((ops[0].group, kinds))
        return [types.SimpleNamespace(wait=self._wait) for _ in ops]

    def _wait(self, timeout: timedelta | None = None) -> bool:
        self.wait_timeouts.append(timeout)
        return True


def fake_groups(plan, rank: int, backend: str) -> ZeppelinGroups:  # noqa: ANN001
    """``ZeppelinGroups`` whose process groups are their own names."""
    topo = plan.topology
    nodes = tuple(f"node {n}" if topo.node_of(rank) == n else None for n in range(topo.num_nodes))
    rails = tuple(
        f"rail {j}" if topo.local_of(rank) == j else None for j in range(topo.gpus_per_node)
    )
    return ZeppelinGroups(topo, rank, "world 0", nodes, rails, backend)


def run_rank(plan, rank: int, backend: str, monkeypatch) -> tuple[PostingLog, FakeDist]:  # noqa: ANN001
    """Every K/V and gradient step of ``plan``, per tier as the engine posts them, on ``rank``,
    routed (cross-node hops on rails) and direct (cross-rail edges on the world group)."""
    fake = FakeDist()
    monkeypatch.setattr(pending_module, "dist", fake)
    log = PostingLog()
    for routing in (True, False):
        ex = DistExchanger(
            fake_groups(plan, rank, backend),
            plan=plan,
            routing=routing,
            device="cpu",
            overlap=False,
            posting_log=log,
            timeout_s=5.0,
        )
        _run_steps(ex, plan, rank, f"routing={routing}")
    return log, fake


def _run_steps(ex: DistExchanger, plan, rank: int, label: str) -> None:  # noqa: ANN001
    for tier in (Tier.INTER, Tier.INTRA):
        kv = ring_schedule(plan, tiers=(tier,))
        grad = gradient_schedule(plan, tiers=(tier,), kv_steps=kv)
        for kind, steps in (("kv", kv), ("grad", grad)):
            for s, msgs in enumerate(steps):
                payload = {(m.src, m.dst): payload_rows(s, m) for m in msgs if m.src == rank}
                ex.start(
                    msgs,
                    payload,
                    row_shape=ROW_SHAPE,
                    dtype=torch.float64,
                    tag=f"{label} {tier.value} {kind} {s}",
                ).wait()


@pytest.mark.pure
def test_staged_posting_follows_one_order_and_replays_to_the_end(monkeypatch) -> None:
    plan = hand_plan()
    logs = []
    for rank in range(plan.world_size):
        log, fake = run_rank(plan, rank, "nccl", monkeypatch)
        logs.append(log.batches)
        # What the log says was posted is what was posted, batch for batch.
        assert [f"{b.communicator[0]} {b.communicator[1]}" for b in log.batches] == [
            group for group, _ in fake.batches
        ]
        stages: dict[str, list[tuple[str, int]]] = {}
        for batch in log.batches:
            stages.setdefault(batch.what, []).append(batch.communicator)
        for what, communicators in stages.items():
            order = [(POSTING_ORDER.index(kind), index) for kind, index in communicators]
            assert order == sorted(order) and len(set(order)) == len(order), (rank, what)
    kinds = {b.communicator[0] for batches in logs for b in batches}
    assert kinds == {"node", "rail", "world"}, "the hand plan uses every kind of group"
    consistent, note = check_posting_order(logs)
    assert consistent, note


@pytest.mark.pure
def test_replay_rejects_crossed_orders_wrong_sizes_and_missing_peers() -> None:
    node, rail = ("node", 0), ("rail", 1)
    send = lambda peer, n=8: PostedOp(peer, "send", n)  # noqa: E731
    recv = lambda peer, n=8: PostedOp(peer, "recv", n)  # noqa: E731
    # Ranks 0 and 1 share a node and a rail; each posts both batches, in opposite orders.
    crossed = [
        [Batch(node, (send(1),), "a"), Batch(rail, (recv(1),), "a")],
        [Batch(rail, (send(0),), "a"), Batch(node, (recv(0),), "a")],
    ]
    consistent, note = check_posting_order(crossed)
    assert not consistent and "never finish" in note
    same_order = [crossed[0], [crossed[1][1], crossed[1][0]]]
    assert check_posting_order(same_order)[0]
    sizes = [[Batch(node, (send(1, 8),))], [Batch(node, (recv(0, 16),))]]
    consistent, note = check_posting_order(sizes)
    assert not consistent and "8 bytes" in note and "16" in note
    consistent, note = check_posting_order([[Batch(node, (send(1),))], []])
    assert not consistent and "1 sends 0->1" in note
    consistent, note = check_posting_order([[], [Batch(node, (recv(0),))]])
    assert not consistent and "no send" in note
    # A relay: 0 -> 1 on the node, then 1 -> 2 on a rail in the next stage.
    relay = [
        [Batch(node, (send(1),))],
        [Batch(node, (recv(0),)), Batch(rail, (send(2),))],
        [Batch(rail, (recv(1),))],
    ]
    assert check_posting_order(relay)[0]


@pytest.mark.pure
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_waits_are_stream_ordered_on_nccl_and_bounded_on_the_host_on_gloo(
    backend, monkeypatch
) -> None:
    _, fake = run_rank(hand_plan(), 1, backend, monkeypatch)
    assert fake.wait_timeouts, "rank 1 sends and receives in the hand plan"
    if backend == "nccl":  # a timeout would make NCCL's wait block the host
        assert all(t is None for t in fake.wait_timeouts)
    else:
        assert all(
            isinstance(t, timedelta) and t.total_seconds() <= 5.0 for t in fake.wait_timeouts
        )


@pytest.mark.threads
def test_every_group_is_warmed_in_creation_order_and_carries_the_timeout(
    one_process_group, monkeypatch
) -> None:
    import torch.distributed as dist

    from megatron_zeppelin.comm import groups as groups_module
    from megatron_zeppelin.topology.model import Topology

    reduced = []
    real = dist.all_reduce
    monkeypatch.setattr(
        dist,
        "all_reduce",
        lambda t, group=None, **kw: (reduced.append(group), real(t, group=group, **kw))[1],
    )
    view = groups_module.ZeppelinGroups.create(Topology(1, 1, 1), timeout_s=7.0)
    assert reduced == [view.world, view.nodes[0], view.rails[0]]
    assert view.world is not dist.group.WORLD, "the Zeppelin world is a group of its own"
    for group in reduced:
        options = group._get_backend(torch.device("cpu")).options
        assert options._timeout == timedelta(seconds=7)
    with pytest.raises(ValueError, match="positive seconds"):
        groups_module.ZeppelinGroups.create(Topology(1, 1, 1), timeout_s=0.0)
