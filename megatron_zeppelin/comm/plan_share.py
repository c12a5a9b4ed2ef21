"""Plans made once and handed to every rank: one rank plans a micro-batch, the others receive it.

Every rank of a Zeppelin world executes the same plan. Computing it on every rank from the same
lengths costs a node as many cores as it has GPUs for one answer, and leaves each rank's planner
alone to keep up with the steps. Instead one rank per node plans (``planners``: the first
Zeppelin rank of every node), the micro-batches dealt out to them in turn (``owner``), so a
cluster of ``n`` nodes plans ``n`` micro-batches at once, and each plan reaches the other ranks as
bytes (the plan's wire form: integer columns in one buffer, ``planner/plan/plan_wire.py``)
broadcast on a gloo group of its own. The group is created once at start-up for every Zeppelin
world (``new_group`` is a collective over every process) and carries the Zeppelin timeout.

Per micro-batch (``exchange``): the planning rank broadcasts a header ``(kind, size)``, then the
payload. Kinds: ``PLAN`` (the plan's bytes), ``ERROR`` (the planner's exception, pickled:
every rank raises the same one), ``DROPPED`` (no plan: the micro-batch was given up, when the
feed closes or the sampler is resumed). Every rank exchanges the same micro-batches in the same
order from one thread (``megatron/plans/feed.py`` draws them alike everywhere), so the broadcasts
pair up. A planning rank that never sends (its process died) ends the others' wait at the group's
timeout with a ``PlanShareError`` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.protocol import ZeppelinCommError
from megatron_zeppelin.topology.model import Topology

__all__ = ["DROPPED", "ERROR", "PLAN", "PlanShare", "PlanShareError"]

PLAN, ERROR, DROPPED = 0, 1, 2
"""Kinds of message ``exchange`` carries (module docstring)."""


class PlanShareError(ZeppelinCommError):
    """A plan did not arrive: the rank that was to send it did not, within the timeout."""


class PlanShare:
    """This process's end of its Zeppelin world's plan group (module docstring)."""

    def __init__(
        self, group: dist.ProcessGroup, ranks: Sequence[int], rank: int, topology: Topology
    ) -> None:
        self._group = group
        self._ranks = tuple(ranks)
        self.rank = rank
        """This process's Zeppelin rank."""
        k = topology.gpus_per_node
        self.planners = tuple(range(0, topology.world_size, k))
        """The Zeppelin ranks that plan: the first of every node."""

    @classmethod
    def create(
        cls,
        topology: Topology,
        worlds: Sequence[Sequence[int]],
        *,
        timeout_s: float,
    ) -> PlanShare:
        """This process's plan group; every process calls it once, with the same ``worlds``
        (each Zeppelin world's global ranks in Zeppelin-rank order, every process in one)."""
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: plans cannot be shared")
        me, mine = dist.get_rank(), None
        timeout = timedelta(seconds=timeout_s)
        for world in sorted((tuple(int(r) for r in w) for w in worlds), key=min):
            group = dist.new_group(list(world), backend="gloo", timeout=timeout)
            if me in world:
                mine = cls(group, world, world.index(me), topology)
        if mine is None:
            raise ValueError(f"process {me} is in none of the Zeppelin worlds {list(worlds)}")
        return mine

    def owner(self, index: int) -> int:
        """The Zeppelin rank that plans the ``index``-th micro-batch (counted from the feed's
        start, non-empty ones only)."""
        return self.planners[index % len(self.planners)]

    def exchange(self, index: int, kind: int = DROPPED, payload: bytes = b"") -> tuple[int, bytes]:
        """The ``index``-th micro-batch's message, from its owner to every rank (a collective
        of the world's plan group): the owner passes ``kind`` and ``payload``; every rank gets
        ``(kind, payload)`` back."""
        owner = self.owner(index)
        src = self._ranks[owner]
        mine = owner == self.rank
        header = torch.tensor([kind, len(payload)] if mine else [0, 0], dtype=torch.int64)
        try:
            dist.broadcast(header, src=src, group=self._group)
            kind, size = (int(x) for x in header.tolist())
            if size:
                body = (
                    torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                    if mine
                    else torch.empty(size, dtype=torch.uint8)
                )
                dist.broadcast(body, src=src, group=self._group)
        except RuntimeError as exc:  # gloo's timeout or a lost peer
            raise PlanShareError(
                f"the plan of micro-batch {index} was to come from Zeppelin rank {owner} "
                f"(process {src}), which did not send it: {' '.join(str(exc).split())[:300]}"
            ) from None
        return kind, payload if mine or not size else body.numpy().tobytes()
