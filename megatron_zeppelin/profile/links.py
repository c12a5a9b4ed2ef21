"""Measured bandwidth and latency of the links a plan uses: in a node and across nodes, per rail.

Runs collectively on every rank of an initialized ``torch.distributed`` world laid out as the
given ``Topology`` (rank ``r`` on node ``r // gpus_per_node``): under torchrun on a cluster, or on
one CPU host as gloo processes emulating several nodes. Every rank walks the same list of
measurements in the same order; ranks not involved in one wait at the barrier that closes it, so
each figure is measured on an otherwise quiet fabric.

* **point to point**: a ping-pong between two ranks, half the round trip per message size. The
  intra-node pair is local GPUs 0 and 1 of node 0 (``nvlink``); across nodes, local GPU ``j`` of
  nodes 0 and 1 for every rail ``j`` (``nic``, the path a routed ring part takes).
* **all-to-all**: ``all_to_all_single`` over one node's ranks and over the world, the collective
  the remapping layer runs; ``num_bytes`` is what one rank sends in total.

Only rank 0's view is returned complete: the timings are gathered there with
``all_gather_object`` so every rank returns the same list.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_zeppelin.profile.timing import DEFAULT_TIMING, TimingOptions, synchronize
from megatron_zeppelin.topology.model import Topology

DEFAULT_CPU_SIZES = (4 << 10, 32 << 10, 256 << 10, 2 << 20)
DEFAULT_GPU_SIZES = (64 << 10, 1 << 20, 8 << 20, 64 << 20, 256 << 20)


@dataclass(frozen=True)
class LinkPoint:
    """One measured message size on one link."""

    kind: str
    """``nvlink`` (P2P inside a node), ``nic`` (P2P across nodes), ``a2a-node`` or
    ``a2a-world`` (all-to-all)."""
    num_bytes: int
    seconds: float
    src: int = -1
    dst: int = -1
    rail: int = -1
    """Local GPU index of both ends for ``nic`` points; -1 elsewhere."""


def link_pairs(topology: Topology) -> list[tuple[str, int, int, int]]:
    """``(kind, src, dst, rail)`` of every P2P pair measured on ``topology``."""
    pairs = []
    if topology.gpus_per_node > 1:
        pairs.append(("nvlink", 0, 1, -1))
    if topology.num_nodes > 1:
        for rail in range(topology.gpus_per_node):
            pairs.append(("nic", topology.rank_of(0, rail), topology.rank_of(1, rail), rail))
    return pairs


def measure_links(
    topology: Topology,
    *,
    sizes: Sequence[int] = DEFAULT_CPU_SIZES,
    device: torch.device,
    timing: TimingOptions = DEFAULT_TIMING,
    all_to_all: bool = True,
) -> list[LinkPoint]:
    """Measure every link of ``topology`` (see the module docstring); call on every rank."""
    if not dist.is_initialized():
        raise ValueError(
            "measuring links needs an initialized torch.distributed world: run under torchrun, "
            "or let `zeppelin profile --emulate NODESxGPUS` start gloo processes"
        )
    world = dist.get_world_size()
    if world != topology.world_size:
        raise ValueError(
            f"the distributed world has {world} ranks but the topology has "
            f"{topology.world_size} GPUs ({topology.num_nodes} nodes x {topology.gpus_per_node})"
        )
    if not sizes or any(s < 4 for s in sizes):
        raise ValueError(f"message sizes must be given and >= 4 bytes, got {list(sizes)}")
    rank = dist.get_rank()
    mine: list[LinkPoint] = []
    for kind, src, dst, rail in link_pairs(topology):
        for num_bytes in sizes:
            seconds = _ping_pong(rank, src, dst, num_bytes, device=device, timing=timing)
            if rank == src:
                mine.append(LinkPoint(kind, num_bytes, seconds, src, dst, rail))
            dist.barrier()
    if all_to_all and world > 1:
        # new_group is collective: every rank creates every node's group, in the same order.
        node_groups = [
            dist.new_group(list(topology.ranks_of_node(n))) for n in range(topology.num_nodes)
        ]
        scopes = [("a2a-world", None, world)]
        if topology.gpus_per_node > 1:
            node = topology.node_of(rank)
            scopes.insert(0, ("a2a-node", node_groups[node], topology.gpus_per_node))
        for kind, group, group_size in scopes:
            for num_bytes in sizes:
                seconds = _all_to_all(num_bytes, group, group_size, device=device, timing=timing)
                if rank == 0:
                    mine.append(LinkPoint(kind, num_bytes, seconds))
                dist.barrier()
    gathered: list[list[LinkPoint]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, mine)
    return [p for per_rank in gathered for p in per_rank]


def _ping_pong(
    rank: int, src: int, dst: int, num_bytes: int, *, device: torch.device, timing: TimingOptions
) -> float:
    """One-way seconds of a ``num_bytes`` message ``src -> dst`` (half a round trip); 0 on
    ranks other than ``src``."""
    if rank not in (src, dst):
        return 0.0
    buf = torch.zeros(num_bytes // 4, dtype=torch.float32, device=device)
    peer = dst if rank == src else src
    samples = []
    for i in range(timing.warmup + timing.repeats):
        synchronize(device)
        begin = time.perf_counter()
        if rank == src:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        synchronize(device)
        if i >= timing.warmup:
            samples.append((time.perf_counter() - begin) / 2)
    return statistics.median(samples)


def _all_to_all(
    num_bytes: int,
    group: dist.ProcessGroup | None,
    group_size: int,
    *,
    device: torch.device,
    timing: TimingOptions,
) -> float:
    """Seconds of one ``all_to_all_single`` where every rank sends ``num_bytes`` in total."""
    per_peer = max(1, num_bytes // 4 // group_size)
    send = torch.zeros(per_peer * group_size, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    samples = []
    for i in range(timing.warmup + timing.repeats):
        dist.barrier(group=group)  # start together, or the first rank waits for the last
        synchronize(device)
        begin = time.perf_counter()
        dist.all_to_all_single(recv, send, group=group)
        synchronize(device)
        if i >= timing.warmup:
            samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def points_of(points: Sequence[LinkPoint], kind: str) -> list[tuple[int, float]]:
    """``(num_bytes, seconds)`` of one kind, the median over pairs (rails) per size."""
    by_size: dict[int, list[float]] = {}
    for p in points:
        if p.kind == kind:
            by_size.setdefault(p.num_bytes, []).append(p.seconds)
    return [(n, statistics.median(ts)) for n, ts in sorted(by_size.items())]
