"""N ranks as N threads of one process: a ring transport and a runner for fast tests.

``ThreadExchanger`` implements the engine's exchanger protocol (``comm.protocol.Exchanger``)
with in-process mailboxes instead of torch.distributed, so ring-attention tests run N ranks in
one process without starting processes. It behaves like the real transport where a test can
tell: payloads are checked by the same function (``comm.protocol.check_payload``), the receiver
gets its own copy, ``wait`` twice raises, a missing message times out with ``ZeppelinCommError``
naming the tag, and with routing on a routed message is cut into the same legs as the real
transport cuts it (``planner.plan.schedule.message_legs``) and glued back together (so a test sees
that routing leaves results unchanged). ``counters`` (a ``LinkCounters``) counts every hop the
real transport would make.

``run_ranks(fn, world_size)`` runs ``fn(rank, exchanger)`` on one thread per rank and returns
the results by rank; a rank that raises stops the others and the error names the rank; ranks
still running after ``timeout_s`` fail the call instead of hanging it.

Each rank's thread runs its backward itself (``torch.autograd.set_multithreading_enabled(False)``).
By default PyTorch's autograd engine runs the backward of CUDA tensors on one worker thread per
device, for every thread that calls ``backward``: thread-ranks on one GPU then queue their ring
backwards on that one thread, the first blocks waiting for a gradient another rank has not sent
(its backward is queued behind), and every rank hangs. Processes with a GPU each (the NCCL
path) never share a device's worker, and CPU backwards run on the calling thread anyway.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from megatron_zeppelin.comm.counters import LinkCounters
from megatron_zeppelin.comm.protocol import ZeppelinCommError, check_payload
from megatron_zeppelin.planner.plan.plan import Plan, Route
from megatron_zeppelin.planner.plan.schedule import Leg, Message, message_legs

__all__ = ["ThreadExchanger", "ThreadHub", "run_ranks"]

T = TypeVar("T")
_POLL_S = 0.05


class ThreadHub:
    """Mailboxes shared by the ranks of one run: one FIFO queue per (tag, src, dst, part)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.aborted = threading.Event()
        self._boxes: dict[tuple, queue.Queue] = defaultdict(queue.Queue)
        self._lock = threading.Lock()

    def box(self, key: tuple) -> queue.Queue:
        with self._lock:
            return self._boxes[key]


class ThreadPending:
    """One ``start``'s receipts; ``wait`` once."""

    def __init__(
        self,
        exchanger: ThreadExchanger,
        expected: list[tuple[Message, int]],
        device: torch.device,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        tag: str,
    ) -> None:
        self._ex = exchanger
        self._expected = expected  # (message, number of legs) for each message to this rank
        self._device = device
        self._row_shape = row_shape
        self._dtype = dtype
        self.tag = tag
        self._done = False

    def wait(self) -> dict[tuple[int, int], torch.Tensor]:
        if self._done:
            raise ZeppelinCommError(f"exchange {self.tag!r}: wait() called twice")
        self._done = True
        ex = self._ex
        deadline = time.monotonic() + ex.timeout_s
        received = {}
        for msg, num_parts in self._expected:
            parts = []
            for part in range(num_parts):
                box = ex.hub.box((self.tag, msg.src, msg.dst, part))
                while True:
                    if ex.hub.aborted.is_set():
                        raise ZeppelinCommError(f"exchange {self.tag!r}: another rank failed")
                    try:
                        parts.append(box.get(timeout=_POLL_S))
                        break
                    except queue.Empty:
                        if time.monotonic() > deadline:
                            raise ZeppelinCommError(
                                f"exchange {self.tag!r} timed out on rank {ex.rank} waiting for "
                                f"{msg.src}->{msg.dst} after {ex.timeout_s:g} s"
                            ) from None
            if not parts:
                tensor = torch.empty((0, *self._row_shape), dtype=self._dtype, device=self._device)
            else:
                tensor = torch.cat(parts) if len(parts) != 1 else parts[0]
            expected = (msg.num_tokens, *self._row_shape)
            assert tuple(tensor.shape) == expected, (self.tag, tuple(tensor.shape), expected)
            received[(msg.src, msg.dst)] = tensor
        return received


class ThreadExchanger:
    """The exchanger of one thread-rank; see the module docstring."""

    def __init__(
        self,
        hub: ThreadHub,
        rank: int,
        *,
        plan: Plan | None = None,
        routing: bool = True,
        counters: LinkCounters | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if not 0 <= rank < hub.world_size:
            raise ValueError(f"rank {rank} outside 0..{hub.world_size - 1}")
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self.routing = routing
        self.counters = counters
        self.timeout_s = timeout_s
        self.plan: Plan | None = None
        self._routes: dict[tuple[int, int], Route] = {}
        if plan is not None:
            self.set_plan(plan)

    def set_plan(self, plan: Plan) -> ThreadExchanger:
        """Use ``plan``'s routes from now on; returns ``self``."""
        if plan.world_size != self.world_size:
            raise ValueError(f"plan for {plan.world_size} ranks, exchanger for {self.world_size}")
        self.plan = plan
        self._routes = plan.route_index
        return self

    def for_plan(self, plan: Plan) -> ThreadExchanger:
        """A view of this exchanger bound to ``plan``'s routes (sharing its groups and
        counters); the exchanger itself keeps its own. Several micro-batches may be in flight at
        once (a pipeline schedule runs forwards ahead of their backwards), each sending along
        its own plan's routes."""
        return copy.copy(self).set_plan(plan)

    def _legs(self, msg: Message) -> tuple[Leg, ...]:
        route = self._routes.get((msg.src, msg.dst)) if self.routing else None
        return message_legs(msg, route)

    def start(
        self,
        messages: Sequence[Message],
        payload: Mapping[tuple[int, int], torch.Tensor],
        *,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        tag: str,
    ) -> ThreadPending:
        """Deliver this rank's sends of one ring step; see ``comm.protocol.Exchanger``."""
        row_shape = tuple(int(d) for d in row_shape)
        sends = check_payload(
            messages, payload, rank=self.rank, row_shape=row_shape, dtype=dtype, tag=tag
        )
        device = torch.device("cpu")
        for key, msg in sends.items():
            tensor = payload.get(key)
            if tensor is None:
                continue
            device = tensor.device
            for index, leg in enumerate(self._legs(msg)):
                rows = tensor[leg.offset : leg.offset + leg.num_tokens].clone()
                if self.counters is not None:
                    for a, b in leg.hops:
                        self.counters.record(a, b, rows.numel() * rows.element_size())
                self.hub.box((tag, msg.src, msg.dst, index)).put(rows)
        expected = [(m, len(self._legs(m))) for m in messages if m.dst == self.rank]
        return ThreadPending(self, expected, device, row_shape, dtype, tag)


def run_ranks(
    fn: Callable[[int, ThreadExchanger], T],
    world_size: int,
    *,
    plan: Plan | None = None,
    routing: bool = True,
    counters: Sequence[Any] | None = None,
    timeout_s: float = 60.0,
) -> list[T]:
    """Run ``fn(rank, exchanger)`` for every rank on its own thread; results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    hub = ThreadHub(world_size)
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        exchanger = ThreadExchanger(
            hub,
            rank,
            plan=plan,
            routing=routing,
            timeout_s=timeout_s,
            counters=counters[rank] if counters is not None else None,
        )
        try:
            with torch.autograd.set_multithreading_enabled(False):
                results[rank] = fn(rank, exchanger)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = exc
            hub.aborted.set()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        hub.aborted.set()
        alive = [r for r, t in enumerate(threads) if t.is_alive()]
        raise TimeoutError(f"ranks {alive} still running after {timeout_s:g} s")
    if errors:
        # The first rank to fail is the cause; the others stopped because of it.
        rank = min(errors, key=lambda r: isinstance(errors[r], ZeppelinCommError))
        raise RuntimeError(f"rank {rank} failed: {errors[rank]!r}") from errors[rank]
    return results
