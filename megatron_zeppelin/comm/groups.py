"""Process groups keyed to the topology, created once at start-up and passed explicitly.

Three kinds, matching the three kinds of link a transfer can use:

* one group per **node**: NVLink traffic (intra-node rings, the first and last hop of a routed
  message, the remapping between layouts inside a node);
* one group per **rail** (the same local GPU index on every node): NIC traffic between proxies,
  so each transfer leaves and enters through the NIC next to its GPUs;
* the **world**: cross-node transfers between GPUs of different rails, and the all-to-all of
  the remapping layer.

``torch.distributed.new_group`` is itself a collective over the whole world: every rank must call
it for every group, even the groups it is not in, in the same order. ``ZeppelinGroups.create``
does exactly that and nothing else touches group creation, so no group is made per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatron_zeppelin.topology.model import Topology

__all__ = ["ZeppelinGroups"]


@dataclass(frozen=True)
class ZeppelinGroups:
    """The groups this rank uses. ``nodes[n]`` / ``rails[j]`` are ``None`` for groups this rank is
    not a member of (torch returns a placeholder for those; we never use them)."""

    topology: Topology
    rank: int
    world: dist.ProcessGroup
    nodes: tuple[dist.ProcessGroup | None, ...]
    rails: tuple[dist.ProcessGroup | None, ...]
    backend: str

    @classmethod
    def create(cls, topology: Topology, *, backend: str | None = None) -> ZeppelinGroups:
        """Create the node and rail groups of ``topology``; call on every rank, once, after
        ``torch.distributed.init_process_group``."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialized: call init_process_group before "
                "ZeppelinGroups.create"
            )
        world_size = dist.get_world_size()
        if topology.world_size != world_size:
            raise ValueError(
                f"the topology has {topology.num_nodes} nodes x {topology.gpus_per_node} GPUs = "
                f"{topology.world_size} ranks but the process group has {world_size}: change "
                "--nodes/--gpus-per-node (or the launcher's process count) so they agree"
            )
        rank = dist.get_rank()
        world = dist.group.WORLD
        assert world is not None
        backend = backend or dist.get_backend()
        nodes: list[dist.ProcessGroup | None] = []
        rails: list[dist.ProcessGroup | None] = []
        # Same order on every rank: all node groups, then all rail groups.
        for node in range(topology.num_nodes):
            ranks = list(topology.ranks_of_node(node))
            group = dist.new_group(ranks, backend=backend)
            nodes.append(group if rank in ranks else None)
        for local in range(topology.gpus_per_node):
            ranks = [topology.rank_of(node, local) for node in range(topology.num_nodes)]
            group = dist.new_group(ranks, backend=backend)
            rails.append(group if rank in ranks else None)
        groups = cls(topology, rank, world, tuple(nodes), tuple(rails), str(backend))
        if groups.backend == "nccl":
            # NCCL builds a communicator lazily on its first collective, and a batched P2P call
            # that is a group's first must involve all of its ranks; a barrier on our own groups
            # (every member reaches it in the same order) makes the first ring step safe.
            for group in (groups.node_group(topology.node_of(rank)), groups.rail_group(rank)):
                dist.barrier(group=group)
        return groups

    @property
    def world_size(self) -> int:
        return self.topology.world_size

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
        """The group a transfer between global ranks ``a`` and ``b`` runs on: their node's group
        when they share a node, their rail when they share a local index, else the world."""
        topo = self.topology
        if self.rank not in (a, b):
            raise ValueError(f"rank {self.rank} is neither end of the link {a} -> {b}")
        if topo.same_node(a, b):
            return self.node_group(topo.node_of(a))
        if topo.local_of(a) == topo.local_of(b):
            return self.rail_group(a)
        return self.world
