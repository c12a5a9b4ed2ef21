"""Ring-step exchanges over torch.distributed point-to-point, direct or routed over proxy GPUs.

``DistExchanger`` implements ``comm.protocol.Exchanger``: the engine hands ``start`` the
messages of one ring step this rank sends, receives or relays (in the order of every rank's;
the whole list works alike) and this rank's outgoing tensors; transfers run in the background
and ``Pending.wait`` returns what this rank received. Each rank only acts on the messages it
sends, receives or relays.

Routing (plan.routes, chosen by ``planner/plan/routing.py``; docs/DESIGN.md, "Routing over every
NIC"): a message on a routed edge ``a -> b`` is cut along dim 0 into one part per route part
(``planner.plan.schedule.message_legs``), and part ``j`` travels

    hop 1  a -> src_proxy_j        NVLink, skipped when the same GPU
    hop 2  src_proxy_j -> dst_proxy_j   across nodes on the proxies' rail
    hop 3  dst_proxy_j -> b        NVLink, skipped when the same GPU

and ``b`` concatenates the parts in order, so the result is identical to a direct send. How the
hops are posted is ``pending.py``'s business: on gloo every hop is posted by ``start`` and a
proxy forwards as soon as a part lands, without waiting for its own ``wait``; on NCCL the hops
are stages posted by ``wait``, every rank posting its batches in one communicator order, and
waits are stream-ordered.

Streams (CUDA): ``start`` and ``wait`` are called on the engine's current stream, the one its
kernels run on. Each communicator's transfers run on that communicator's own NCCL stream, which
waits for the current stream when they are posted; ``wait`` makes the current stream wait for
them. So the kernels of one ring step overlap the next step's transfers, and a kernel that reads
received rows runs after they land, without the host ever blocking on a transfer.

Ordering is what keeps point-to-point matched: every rank builds its operations by walking its
messages in the order of every rank's, parts and hops in the same order (the two ends of a hop
list the legs that cross it alike), and all ranks call ``start``/``wait`` in the same program
order. Ranks are Zeppelin (plan) ranks throughout; ``ZeppelinGroups``
translates them to global ranks for the transfers, so the exchanger runs on a Zeppelin world
that is a subset of the processes (tensor parallelism).

Shapes: ``payload[(src, dst)]`` is ``(t, *row_shape)``, ``t`` the message's tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch

from megatron_zeppelin.comm.counters import LinkCounters
from megatron_zeppelin.comm.groups import ZeppelinGroups
from megatron_zeppelin.comm.pending import RelayPending, StagedPending, Transport, step_legs
from megatron_zeppelin.comm.posting import PostingLog
from megatron_zeppelin.comm.protocol import (
    Exchanger,
    Pending,
    ZeppelinCommError,
    check_payload,
)
from megatron_zeppelin.planner.plan.plan import Plan, Route
from megatron_zeppelin.planner.plan.schedule import Message

__all__ = ["DistExchanger", "Exchanger", "Pending", "ZeppelinCommError"]


class DistExchanger:
    """``Exchanger`` over torch.distributed P2P on the groups of ``ZeppelinGroups``.

    Routes come from the plan (``plan=``, ``set_plan``, or a view per micro-batch from
    ``for_plan``, what the attention engine takes); with ``routing=False``
    every message goes direct. ``counters`` (optional) counts every send this rank makes.
    ``overlap``: relay routed parts from a helper thread as soon as they land (``RelayPending``);
    default on for gloo, off (``StagedPending``) for NCCL, where it is refused (``pending.py``
    says why). ``posting_log`` (staged posting only) records every batch this rank posts, for
    ``comm.posting.check_posting_order``.
    """

    def __init__(
        self,
        groups: ZeppelinGroups,
        *,
        plan: Plan | None = None,
        routing: bool = True,
        counters: LinkCounters | None = None,
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
        overlap: bool | None = None,
        posting_log: PostingLog | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if overlap is None:
            overlap = groups.backend == "gloo" and posting_log is None
        elif overlap and groups.backend == "nccl":
            raise ValueError(
                "overlap=True needs a backend that matches point-to-point by tag (gloo); NCCL "
                "matches by posting order, so leave overlap unset or False with NCCL"
            )
        if overlap and posting_log is not None:
            raise ValueError(
                "a posting log records staged posting (the NCCL discipline); relays posted from "
                "helper threads have no fixed order: pass overlap=False with posting_log"
            )
        self.overlap = bool(overlap)
        self.groups = groups
        self.rank = groups.rank
        self.world_size = groups.world_size
        self.routing = routing
        self.counters = counters
        self.timeout_s = float(timeout_s)
        self.posting_log = posting_log
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if groups.backend == "nccl"
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        self.plan: Plan | None = None
        self._routes: dict[tuple[int, int], Route] = {}
        if plan is not None:
            self.set_plan(plan)

    def set_plan(self, plan: Plan) -> DistExchanger:
        """Use ``plan``'s routes from now on (call once per micro-batch); returns ``self``."""
        if plan.topology.world_size != self.world_size:
            raise ValueError(
                f"the plan is for {plan.topology.world_size} ranks but this exchanger runs on "
                f"{self.world_size}: plan with the topology the processes were started with"
            )
        self.plan = plan
        self._routes = plan.route_index
        return self

    def for_plan(self, plan: Plan) -> DistExchanger:
        """A view of this exchanger bound to ``plan``'s routes (sharing its groups and
        counters); the exchanger itself keeps its own. Several micro-batches may be in flight at
        once (a pipeline schedule runs forwards ahead of their backwards), each sending along
        its own plan's routes."""
        return copy.copy(self).set_plan(plan)

    def start(
        self,
        messages: Sequence[Message],
        payload: Mapping[tuple[int, int], torch.Tensor],
        *,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        tag: str,
    ) -> RelayPending | StagedPending:
        """Post this rank's part of one ring step; see the module docstring."""
        row_shape = tuple(int(d) for d in row_shape)
        check_payload(
            messages,
            payload,
            rank=self.rank,
            row_shape=row_shape,
            dtype=dtype,
            tag=tag,
            device=self.device,
        )
        if (
            self.routing
            and self.plan is None
            and any(not self.groups.topology.same_node(m.src, m.dst) for m in messages)
        ):
            raise ValueError("routing is on but no plan was given: call set_plan(plan) first")
        legs = step_legs(messages, self._routes if self.routing else {})
        held = {
            index: payload[(messages[message].src, messages[message].dst)]
            .narrow(0, leg.offset, leg.num_tokens)
            .contiguous()
            for index, (message, leg) in enumerate(legs)
            if leg.path[0] == self.rank
        }
        transport = Transport(
            self.groups, self.device, self.counters, self.timeout_s, self.posting_log
        )
        kind = RelayPending if self.overlap else StagedPending
        return kind(transport, messages, legs, held, row_shape, dtype, tag)
