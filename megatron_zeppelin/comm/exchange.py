"""Ring-step exchanges over torch.distributed point-to-point, direct or routed over proxy GPUs.

The engine hands ``Exchanger.start`` the GLOBAL list of one ring step's messages (every rank the
same list, in the same order) and this rank's outgoing tensors; transfers run in the background
and ``Pending.wait`` returns what this rank received. Each rank only acts on the messages it sends,
receives or relays.

Routing (plan.routes, DESIGN.md section 3): a message on a routed edge ``a -> b`` is cut along
dim 0 with ``split_by_weights`` into one part per route part, and part ``j`` travels

    hop 1  a -> src_proxy_j        NVLink, skipped when the same GPU
    hop 2  src_proxy_j -> dst_proxy_j   across nodes on the proxies' rail
    hop 3  dst_proxy_j -> b        NVLink, skipped when the same GPU

and ``b`` concatenates the parts in order, so the result is identical to a direct send. How the
hops are posted is ``pending.py``'s business: on gloo every hop is posted by ``start`` and a
proxy forwards as soon as a part lands, without waiting for its own ``wait``; on NCCL the hops
are stages posted by ``wait``.

Ordering is what keeps point-to-point matched: every rank builds its operations by walking the
same global message list, parts and hops in the same order, and all ranks call ``start``/``wait``
in the same program order. Ranks are Zeppelin (plan) ranks throughout; ``ZeppelinGroups``
translates them to global ranks for the transfers, so the exchanger runs on a Zeppelin world
that is a subset of the processes (tensor parallelism).

Shapes: ``payload[(src, dst)]`` is ``(t, *row_shape)``, ``t`` the message's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from megatron_zeppelin.comm.counters import LinkCounters
from megatron_zeppelin.comm.groups import ZeppelinGroups
from megatron_zeppelin.comm.pending import (
    RelayPending,
    StagedPending,
    ZeppelinCommError,
    plan_legs,
)
from megatron_zeppelin.planner.plan import Plan, Route
from megatron_zeppelin.planner.schedule import Message

__all__ = ["DistExchanger", "Exchanger", "Pending", "ZeppelinCommError", "plan_legs"]


class Pending(Protocol):
    def wait(self) -> dict[tuple[int, int], torch.Tensor]: ...


class Exchanger(Protocol):
    rank: int
    world_size: int

    def start(
        self,
        messages: Sequence[Message],
        payload: Mapping[tuple[int, int], torch.Tensor],
        *,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        tag: str,
    ) -> Pending: ...


class DistExchanger:
    """``Exchanger`` over torch.distributed P2P on the groups of ``ZeppelinGroups``.

    Routes come from the plan (``plan=`` or ``set_plan`` per micro-batch); with ``routing=False``
    every message goes direct. ``counters`` (optional) counts every send this rank makes.
    ``overlap``: relay routed parts from a helper thread as soon as they land (``RelayPending``);
    default on for gloo, off (``StagedPending``) for NCCL, where it is refused (``pending.py``
    says why).
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
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if overlap is None:
            overlap = groups.backend == "gloo"
        elif overlap and groups.backend == "nccl":
            raise ValueError(
                "overlap=True needs a backend that matches point-to-point by tag (gloo); NCCL "
                "matches by posting order, so leave overlap unset or False with NCCL"
            )
        self.overlap = bool(overlap)
        self.groups = groups
        self.rank = groups.rank
        self.world_size = groups.world_size
        self.routing = routing
        self.counters = counters
        self.timeout_s = float(timeout_s)
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
        self._routes = {(r.src, r.dst): r for r in plan.routes}
        return self

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
        sends = {(m.src, m.dst): m for m in messages if m.src == self.rank}
        for key in payload:
            if key not in sends:
                raise ZeppelinCommError(
                    f"exchange {tag!r}: payload for {key} but rank {self.rank} sends no such "
                    "message in this step"
                )
        for key, msg in sends.items():
            tensor = payload.get(key)
            expected = (msg.num_tokens, *row_shape)
            if tensor is None:
                if msg.num_tokens:
                    raise ZeppelinCommError(f"exchange {tag!r}: no payload for message {key}")
                continue
            if tuple(tensor.shape) != expected or tensor.dtype != dtype:
                raise ZeppelinCommError(
                    f"exchange {tag!r}: payload {key} is {tuple(tensor.shape)} {tensor.dtype}, "
                    f"the message needs {expected} {dtype}"
                )
            if tensor.device != self.device:
                raise ZeppelinCommError(
                    f"exchange {tag!r}: payload {key} is on {tensor.device}, the exchanger "
                    f"sends from {self.device}"
                )
        if (
            self.routing
            and self.plan is None
            and any(not self.groups.topology.same_node(m.src, m.dst) for m in messages)
        ):
            raise ValueError("routing is on but no plan was given: call set_plan(plan) first")
        legs = plan_legs(messages, self._routes if self.routing else None)
        held = {
            index: payload[(messages[leg.message].src, messages[leg.message].dst)]
            .narrow(0, leg.offset, leg.num_tokens)
            .contiguous()
            for index, leg in enumerate(legs)
            if leg.path[0] == self.rank
        }
        kind = RelayPending if self.overlap else StagedPending
        return kind(self, messages, legs, held, row_shape, dtype, tag)
