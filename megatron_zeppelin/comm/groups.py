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
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_zeppelin.topology.model import Topology

__all__ = ["ZeppelinGroups"]

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
    ) -> ZeppelinGroups:
        """This process's groups; call on every process, once, after ``init_process_group``.

        ``ranks``: the global ranks of this process's Zeppelin world in Zeppelin-rank order
        (default: every process, in order). Each process passes its own world; the worlds are
        exchanged with one ``all_gather_object`` so every process creates every world's groups.
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
            return cls.create_all(topology, [range(world_size)], backend=backend)
        mine = [int(r) for r in ranks]
        gathered: list[list[int] | None] = [None] * world_size
        dist.all_gather_object(gathered, mine)
        worlds = {tuple(w) for w in gathered if w is not None}
        return cls.create_all(topology, sorted(worlds), backend=backend)

    @classmethod
    def create_all(
        cls, topology: Topology, worlds: Sequence[Sequence[int]], *, backend: str | None = None
    ) -> ZeppelinGroups:
        """Create the groups of every Zeppelin world in ``worlds`` (the same list on every
        process: each world's global ranks in Zeppelin-rank order, every process in exactly
        one) and return this process's view."""
        _require_initialized()
        world_size = dist.get_world_size()
        worlds = [tuple(int(r) for r in w) for w in worlds]
        for w in worlds:
            if len(w) != topology.world_size:
                raise ValueError(
                    f"the topology has {topology.num_nodes} nodes x {topology.gpus_per_node} GPUs"
                    f" = {topology.world_size} ranks but a Zeppelin world has {len(w)} processes "
                    f"({list(w)}): change --nodes/--gpus-per-node, or the data-parallel size, so "
                    "they agree"
                )
        members = sorted(r for w in worlds for r in w)
        if members != list(range(world_size)):
            raise ValueError(
                f"the Zeppelin worlds {[list(w) for w in worlds]} must cover each of the "
                f"{world_size} processes exactly once"
            )
        me = dist.get_rank()
        backend = str(backend or dist.get_backend())
        whole = len(worlds) == 1
        view: ZeppelinGroups | None = None
        # Same order on every process: worlds by first rank; per world its world group, all
        # node groups, then all rail groups.
        for w in sorted(worlds, key=lambda w: min(w)):
            if whole and w == tuple(range(world_size)):
                world_group = dist.group.WORLD
            else:
                world_group = dist.new_group(sorted(w), backend=backend)
            nodes = [_group(topology.ranks_of_node(n), w, me, backend)
                     for n in range(topology.num_nodes)]  # fmt: skip
            rails = [
                _group(
                    [topology.rank_of(n, local) for n in range(topology.num_nodes)], w, me, backend
                )  # fmt: skip
                for local in range(topology.gpus_per_node)
            ]
            if me in w:
                assert world_group is not None
                identity = w == tuple(range(world_size))
                view = cls(topology, w.index(me), world_group, tuple(nodes), tuple(rails),
                           backend, () if identity else w)  # fmt: skip
        assert view is not None, "every process is in one world (checked above)"
        if view.backend == "nccl":
            # NCCL builds a communicator lazily on its first collective, and a batched P2P call
            # that is a group's first must involve all of its ranks; a barrier on our own groups
            # (every member reaches it in the same order) makes the first ring step safe.
            for group in (view.node_group(topology.node_of(view.rank)), view.rail_group(view.rank)):
                dist.barrier(group=group)
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

    def link_group(self, a: int, b: int) -> dist.ProcessGroup:
        """The group a transfer between Zeppelin ranks ``a`` and ``b`` runs on: their node's
        group when they share a node, their rail when they share a local index, else the
        Zeppelin world."""
        topo = self.topology
        if self.rank not in (a, b):
            raise ValueError(f"rank {self.rank} is neither end of the link {a} -> {b}")
        if topo.same_node(a, b):
            return self.node_group(topo.node_of(a))
        if topo.local_of(a) == topo.local_of(b):
            return self.rail_group(a)
        return self.world


def _require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialized: call init_process_group before "
            "ZeppelinGroups.create"
        )


def _group(
    zeppelin_ranks: Sequence[int], world: tuple[int, ...], me: int, backend: str
) -> dist.ProcessGroup | None:
    """``new_group`` of the given Zeppelin ranks of ``world`` (a collective on every process);
    the group if this process is in it, else ``None``."""
    members = [world[r] for r in zeppelin_ranks]
    group = dist.new_group(sorted(members), backend=backend)
    return group if me in members else None
