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

and ``b`` concatenates the parts in order, so the result is identical to a direct send. A proxy
can forward only what it has received, so the hops are *stages*: stage 0 (every leg's first hop)
is posted by ``start``, later stages by ``wait``, each after the stage before it has landed.

Ordering is what keeps point-to-point matched: every rank builds its operations by walking the
same global message list, parts and hops in the same order, and all ranks call ``start``/``wait``
in the same program order, so on every pair of ranks the sends and receives line up (gloo and
NCCL both match in posting order). Within a stage the operations are batched per process group
(``batch_isend_irecv``), which NCCL needs so two ranks sending to each other do not deadlock.

Shapes: ``payload[(src, dst)]`` is ``(t, *row_shape)``, ``t`` the message's tokens.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.counters import LinkCounters
from megatron_zeppelin.comm.groups import ZeppelinGroups
from megatron_zeppelin.planner.plan import Plan, Route, split_by_weights
from megatron_zeppelin.planner.schedule import Message

__all__ = ["DistExchanger", "Exchanger", "Pending", "ZeppelinCommError"]


class ZeppelinCommError(RuntimeError):
    """A ring exchange was misused, timed out or lost a peer. The message names the tag."""


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


@dataclass(frozen=True)
class _Leg:
    """One piece of a message on a fixed path: rows ``[offset, offset + num_tokens)``."""

    message: int
    offset: int
    num_tokens: int
    path: tuple[int, ...]  # ranks visited, consecutive duplicates removed

    @property
    def hops(self) -> list[tuple[int, int]]:
        return list(zip(self.path[:-1], self.path[1:]))


def plan_legs(
    messages: Sequence[Message], routes: Mapping[tuple[int, int], Route] | None
) -> list[_Leg]:
    """Every piece of every message with the path it takes (pure; the same on every rank)."""
    legs = []
    for index, msg in enumerate(messages):
        route = routes.get((msg.src, msg.dst)) if routes is not None else None
        if route is None:
            if msg.num_tokens:
                legs.append(_Leg(index, 0, msg.num_tokens, (msg.src, msg.dst)))
            continue
        sizes = split_by_weights(msg.num_tokens, [p.weight for p in route.parts])
        offset = 0
        for part, n in zip(route.parts, sizes):
            if n:
                path = [msg.src]
                for rank in (part.src_proxy, part.dst_proxy, msg.dst):
                    if rank != path[-1]:
                        path.append(rank)
                legs.append(_Leg(index, offset, n, tuple(path)))
            offset += n
    return legs


class DistPending:
    """The in-flight exchange of one ``start`` call; ``wait`` once."""

    def __init__(self, exchanger: DistExchanger, messages: Sequence[Message], legs: list[_Leg],
                 held: dict[int, torch.Tensor], row_shape: tuple[int, ...], dtype: torch.dtype,
                 tag: str):  # fmt: skip
        self._ex = exchanger
        self._messages = list(messages)
        self._legs = legs
        self._held = held  # leg index -> rows this rank holds now (sent or received)
        self._row_shape = row_shape
        self._dtype = dtype
        self.tag = tag
        self._num_stages = max((len(leg.path) - 1 for leg in legs), default=0)
        self._inflight: list[tuple[dist.Work, str]] = []
        self._arrived: dict[int, torch.Tensor] = {}
        self._done = False
        if self._num_stages:
            self._post(0)

    def _post(self, stage: int) -> None:
        ex = self._ex
        rank = ex.rank
        ops: dict[int, tuple[dist.ProcessGroup, list[dist.P2POp]]] = {}
        notes: list[str] = []
        for index, leg in enumerate(self._legs):
            hops = leg.hops
            if stage >= len(hops):
                continue
            a, b = hops[stage]
            if rank == a:
                tensor = self._held[index]
                op = dist.P2POp(dist.isend, tensor, b, group=ex.groups.link_group(a, b))
                if ex.counters is not None:
                    ex.counters.record(a, b, tensor.numel() * tensor.element_size())
                notes.append(f"send {a}->{b}")
            elif rank == b:
                tensor = torch.empty((leg.num_tokens, *self._row_shape), dtype=self._dtype,
                                     device=ex.device)  # fmt: skip
                self._arrived[index] = tensor
                op = dist.P2POp(dist.irecv, tensor, a, group=ex.groups.link_group(a, b))
                notes.append(f"recv {a}->{b}")
            else:
                continue
            group = op.group
            ops.setdefault(id(group), (group, []))[1].append(op)
        shown = ", ".join(notes[:6]) + (f", ... {len(notes) - 6} more" if len(notes) > 6 else "")
        what = f"stage {stage} ({shown})"
        try:
            for _, batch in ops.values():
                works = dist.batch_isend_irecv(batch)
                self._inflight.extend((w, what) for w in works)
        except Exception as exc:  # a peer that died before we posted shows up here
            raise self._error(f"posting {what}", exc) from exc

    def _error(self, where: str, exc: BaseException | None) -> ZeppelinCommError:
        cause = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        return ZeppelinCommError(
            f"exchange {self.tag!r} failed on rank {self._ex.rank} while {where}{cause}. "
            "A peer may have died or fallen behind by more than the timeout "
            f"({self._ex.timeout_s:g} s)."
        )

    def _drain(self, deadline: float) -> None:
        for work, what in self._inflight:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(f"waiting on {what}", TimeoutError("timed out"))
            try:
                # timedelta(0) means "no timeout" to torch: never pass it.
                ok = work.wait(timeout=timedelta(seconds=max(left, 1e-3)))
            except Exception as exc:
                raise self._error(f"waiting on {what}", exc) from exc
            if ok is False:
                raise self._error(f"waiting on {what}", TimeoutError("timed out"))
        self._inflight = []

    def wait(self) -> dict[tuple[int, int], torch.Tensor]:
        """Finish every hop; return ``{(src, this rank): rows}`` for each message received."""
        if self._done:
            raise ZeppelinCommError(f"exchange {self.tag!r}: wait() called twice")
        self._done = True
        deadline = time.monotonic() + self._ex.timeout_s
        for stage in range(self._num_stages):
            if stage:
                self._post(stage)
            self._drain(deadline)
            self._held.update(self._arrived)
            self._arrived = {}
        rank = self._ex.rank
        pieces: dict[int, list[torch.Tensor]] = {}
        for index, leg in enumerate(self._legs):
            if leg.path[-1] == rank:
                pieces.setdefault(leg.message, []).append(self._held[index])
        received = {}
        for index, msg in enumerate(self._messages):
            if msg.dst != rank:
                continue
            parts = pieces.get(index, [])
            if not parts:
                received[(msg.src, msg.dst)] = torch.empty(
                    (0, *self._row_shape), dtype=self._dtype, device=self._ex.device
                )
            else:
                received[(msg.src, msg.dst)] = parts[0] if len(parts) == 1 else torch.cat(parts)
        self._held = {}
        return received


class DistExchanger:
    """``Exchanger`` over torch.distributed P2P on the groups of ``ZeppelinGroups``.

    Routes come from the plan (``plan=`` or ``set_plan`` per micro-batch); with ``routing=False``
    every message goes direct. ``counters`` (optional) counts every send this rank makes.
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
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
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

    with_plan = set_plan

    def start(
        self,
        messages: Sequence[Message],
        payload: Mapping[tuple[int, int], torch.Tensor],
        *,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        tag: str,
    ) -> DistPending:
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
        return DistPending(self, messages, legs, held, row_shape, dtype, tag)
