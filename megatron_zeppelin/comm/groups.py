"""Process groups keyed to the topology, created once at start-up and passed explicitly.

Three kinds, matching the three kinds of link a transfer can use:

* one group per **node**: NVLink traffic (intra-node rings, the first and last hop of a routed
  message, the remapping between layouts inside a node);
* one group per **rail** (the same local GPU index on every node): NIC traffic between proxies,
  so each transfer leaves and enters through the NIC next to its GPUs;
* the **world** of the Zeppelin ranks: cross-node transfers between GPUs of different rails.

Sub-worlds. With Megatron tensor parallelism the Zeppelin ranks are the data-parallel ranks of
one TP index, so the processes form several *Zeppelin worlds*, each with its own copy of the
topology. A Zeppelin world is given by the global ranks of its members in Zeppelin-rank order;
plan ranks (what the planner, the schedule and the counters speak) are Zeppelin ranks, and
``global_rank`` translates them for point-to-point calls.

``torch.distributed.new_group`` is itself a collective over the whole default group: every
process must call it for every group, even the groups it is not in, in the same order. So the
groups of EVERY Zeppelin world are created by every process, worlds in ascending order of their
first global rank, and for each world its world group (sub-worlds only), node groups, then rail
groups. ``create_all`` takes the list of worlds; ``create(..., ranks=)`` takes only this
process's world and learns the others with one ``all_gather_object``. Nothing else touches group
creation, so no group is made per batch.

Every group the plugin creates carries the Zeppelin timeout (``timeout_s``, from
``--zeppelin-comm-timeout-s``): on NCCL that is the watchdog's bound on a stuck transfer, since
waits there are stream-ordered and never block the host (``pending.py``). The Zeppelin world is a
group of its own for the same reason, even when it spans every process.

Warm-up. NCCL builds a communicator on its first operation, and PyTorch leaves a batched
point-to-point call that is a communicator's first, among only some of its ranks, undefined. So
right after creation every process runs one small all-reduce on every group it is a member of,
in creation order (the same on every process, so the earliest group not yet warmed always has
all of its members waiting in it): world groups of sub-worlds (tensor parallelism), node groups
and rail groups alike.

Posting order. ``posting_order`` sorts the groups a stage's batches use into one order (node
groups by node, rail groups by local index, then the world), the same on every rank, so batches
on several communicators never wait on each other crosswise (``posting.py`` explains why NCCL
needs it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_zeppelin.topology.model import Topology

__all__ = ["POSTING_ORDER", "ZeppelinGroups"]

POSTING_ORDER = ("node", "rail", "world")
"""Kinds of group in the order every rank posts a stage's batches on them."""

TAG_SPACE = 1 << 30
"""Point-to-point tags handed out by ``ZeppelinGroups.reserve_tags`` wrap below this (gloo takes
a non-negative 32-bit tag; far more than any number of exchanges in flight at once)."""


class _TagCounter:
    """Tags of point-to-point transfers, handed out in program order (the same on every rank
    of a Zeppelin world as long as every rank starts the same exchanges in the same order)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._base = 0

    def reserve(self, num_tags: int) -> int:
        with self._lock:
            base = self._base
            self._base = (self._base + num_tags) % TAG_SPACE
            if base + num_tags > TAG_SPACE:  # never split a block across the wrap
                base, self._base = 0, num_tags
            return base


@dataclass(frozen=True)
class ZeppelinGroups:
    """The groups this process uses, in one Zeppelin world. ``rank`` is the Zeppelin (plan)
    rank; ``nodes[n]`` / ``rails[j]`` are ``None`` for groups this rank is not a member of
    (torch returns a placeholder for those; we never use them)."""

    topology: Topology
    rank: int
    world: dist.ProcessGroup
    nodes: tuple[dist.ProcessGroup | None, ...]
    rails: tuple[dist.ProcessGroup | None, ...]
    backend: str
    global_ranks: tuple[int, ...] = ()
    """Global rank of each Zeppelin rank (empty: the identity, the whole world)."""
    _tags: _TagCounter = field(default_factory=_TagCounter, compare=False, repr=False)

    @classmethod
    def create(
        cls,
        topology: Topology,
        *,
        backend: str | None = None,
        ranks: Sequence[int] | None = None,
        timeout_s: float | None = None,
    ) -> ZeppelinGroups:
        """This process's groups; call on every process, once, after ``init_process_group``.

        ``ranks``: the global ranks of this process's Zeppelin world in Zeppelin-rank order
        (default: every process, in order). Each process passes its own world; the worlds are
        exchanged with one ``all_gather_object`` so every process creates every world's groups.
        ``timeout_s``: the groups' timeout (default: torch's); see the module docstring.
        """
        _require_initialized()
        world_size = dist.get_world_size()
        if ranks is None or list(ranks) == list(range(world_size)):
            if topology.world_size != world_size:
                raise ValueError(
                    f"the topology has {topology.num_nodes} nodes x {topology.gpus_per_node} GPUs"
                    f" = {topology.world_size} ranks but the process group has {world_size}: "
                    "change --nodes/--gpus-per-node (or the launcher's process count) so they "
                    "agree"
                )
            return cls.create_all(
                topology, [range(world_size)], backend=backend, timeout_s=timeout_s
            )
        mine = [int(r) for r in ranks]
        gathered: list[list[int] | None] = [None] * world_size
        dist.all_gather_object(gathered, mine)
        worlds = {tuple(w) for w in gathered if w is not None}
        return cls.create_all(topology, sorted(worlds), backend=backend, timeout_s=timeout_s)

    @classmethod
    def create_all(
        cls,
        topology: Topology,
        worlds: Sequence[Sequence[int]],
        *,
        backend: str | None = None,
        timeout_s: float | None = None,
    ) -> ZeppelinGroups:
        """Create the groups of every Zeppelin world in ``worlds`` (the same list on every
        process: each world's global ranks in Zeppelin-rank order, every process in exactly
        one), warm up this process's groups and return its view."""
        _require_initialized()
        worlds = [tuple(int(r) for r in w) for w in worlds]
        _check_worlds(topology, worlds, dist.get_world_size())
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"the groups' timeout must be positive seconds, got {timeout_s}")
        me = dist.get_rank()
        make = _GroupMaker(str(backend or dist.get_backend()), timeout_s, me)
        view: ZeppelinGroups | None = None
        # Same order on every process: worlds by first rank; per world its world group, all
        # node groups, then all rail groups.
        for w in sorted(worlds, key=lambda w: min(w)):
            world_group = make(list(w))
            nodes = [
                make([w[r] for r in topology.ranks_of_node(n)]) for n in range(topology.num_nodes)
            ]
            rails = [
                make([w[topology.rank_of(n, local)] for n in range(topology.num_nodes)])
                for local in range(topology.gpus_per_node)
            ]
            if me in w:
                assert world_group is not None
                identity = w == tuple(range(dist.get_world_size()))
                view = cls(
                    topology,
                    w.index(me),
                    world_group,
                    tuple(nodes),
                    tuple(rails),
                    make.backend,
                    () if identity else w,
                )
        assert view is not None, "every process is in one world (checked above)"
        warm_up(make.mine, make.backend)
        return view

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def global_rank(self, rank: int) -> int:
        """The global (process-group) rank of Zeppelin rank ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Zeppelin rank {rank} is outside 0..{self.world_size - 1}")
        return self.global_ranks[rank] if self.global_ranks else rank

    def reserve_tags(self, num_tags: int) -> int:
        """First of ``num_tags`` consecutive point-to-point tags for one exchange."""
        return self._tags.reserve(num_tags)

    def node_group(self, node: int) -> dist.ProcessGroup:
        group = self.nodes[node]
        if group is None:
            raise ValueError(f"rank {self.rank} is not on node {node}; it cannot use that group")
        return group

    def rail_group(self, rank: int) -> dist.ProcessGroup:
        """The rail group of ``rank``'s local index (this rank must be on the same rail)."""
        group = self.rails[self.topology.local_of(rank)]
        if group is None:
            raise ValueError(f"rank {self.rank} is not on the rail of rank {rank}")
        return group

    def link_key(self, a: int, b: int) -> tuple[str, int]:
        """The group a transfer between Zeppelin ranks ``a`` and ``b`` runs on: ``("node", n)``
        when they share node ``n``, ``("rail", j)`` when they share local index ``j``, else
        ``("world", 0)``, the Zeppelin world."""
        topo = self.topology
        if self.rank not in (a, b):
            raise ValueError(f"rank {self.rank} is neither end of the link {a} -> {b}")
        if topo.same_node(a, b):
            return ("node", topo.node_of(a))
        if topo.local_of(a) == topo.local_of(b):
            return ("rail", topo.local_of(a))
        return ("world", 0)

    def group(self, key: tuple[str, int]) -> dist.ProcessGroup:
        """The process group of a ``link_key``."""
        kind, index = key
        if kind == "node":
            return self.node_group(index)
        if kind == "rail":
            group = self.rails[index]
            if group is None:
                raise ValueError(f"rank {self.rank} is not on rail {index}")
            return group
        if kind == "world":
            return self.world
        raise ValueError(f"unknown kind of group {kind!r}; one of {POSTING_ORDER}")

    def link_group(self, a: int, b: int) -> dist.ProcessGroup:
        """The process group of ``link_key(a, b)``."""
        return self.group(self.link_key(a, b))

    @staticmethod
    def posting_order(key: tuple[str, int]) -> tuple[int, int]:
        """Sort key of a ``link_key``: the order every rank posts a stage's batches in."""
        return POSTING_ORDER.index(key[0]), key[1]


def _check_worlds(topology: Topology, worlds: list[tuple[int, ...]], world_size: int) -> None:
    for w in worlds:
        if len(w) != topology.world_size:
            raise ValueError(
                f"the topology has {topology.num_nodes} nodes x {topology.gpus_per_node} GPUs"
                f" = {topology.world_size} ranks but a Zeppelin world has {len(w)} processes "
                f"({list(w)}): change --nodes/--gpus-per-node, or the data-parallel size, so "
                "they agree"
            )
    if sorted(r for w in worlds for r in w) != list(range(world_size)):
        raise ValueError(
            f"the Zeppelin worlds {[list(w) for w in worlds]} must cover each of the "
            f"{world_size} processes exactly once"
        )


class _GroupMaker:
    """``new_group`` with the plugin's backend and timeout (a collective on every process);
    returns the group if this process is in it, else ``None``, and keeps this process's groups
    in creation order in ``mine``."""

    def __init__(self, backend: str, timeout_s: float | None, me: int) -> None:
        self.backend, self.me = backend, me
        self.timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        self.mine: list[dist.ProcessGroup] = []

    def __call__(self, members: list[int]) -> dist.ProcessGroup | None:
        kwargs = {} if self.timeout is None else {"timeout": self.timeout}
        group = dist.new_group(sorted(members), backend=self.backend, **kwargs)
        if self.me not in members:
            return None
        self.mine.append(group)
        return group


def warm_up(groups: Sequence[dist.ProcessGroup], backend: str) -> None:
    """One small all-reduce on each of ``groups``, in order (see the module docstring); on
    NCCL the tensor lives on this process's current GPU."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    for group in groups:
        dist.all_reduce(torch.zeros(1, device=device), group=group)


def _require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialized: call init_process_group before "
            "ZeppelinGroups.create"
        )
