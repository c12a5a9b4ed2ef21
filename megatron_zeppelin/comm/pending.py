"""One ring step's transfers in flight: how the hops of routed messages are posted and finished.

``DistExchanger.start`` cuts the step's messages into legs (``plan_legs``: one piece of a message
on a fixed path of one to three hops) and hands them to one of two ``Pending`` kinds:

* ``RelayPending`` (gloo): everything is posted by ``start``. Every receive this rank will make,
  of every hop, and every first-hop send go out at once; a helper thread forwards what this
  rank relays, each later hop as soon as the hop before it has landed here. A proxy therefore
  relays while it computes: nobody downstream waits for the proxy to call ``wait``. Each
  (leg, hop) has its own point-to-point tag, reserved from the groups' counter in program order
  (the same on every rank), so a transfer matches its receive whatever order the main thread
  and the helper threads post in, and exchanges in flight together never mix.
* ``StagedPending`` (NCCL, and any backend that matches point-to-point by posting order): the
  hops are stages; stage 0 is posted by ``start``, later stages by ``wait``, each after the
  stage before it has landed. NCCL ignores tags and matches sends and receives by their order on
  a communicator, so a helper thread posting relays while the main thread posts the next
  exchange would interleave nondeterministically and mismatch; relays there wait for ``wait``.
  (A stream-ordered relay, posting every stage at ``start`` with the relay's sends ordered after
  its receives on the GPU, is the NCCL way to overlap and needs several GPUs to test.)

Both raise ``ZeppelinCommError`` naming the exchange's tag when a transfer fails or does not
finish within the exchanger's timeout. Shapes: rows are ``(t, *row_shape)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_zeppelin.planner.plan import Route, split_by_weights
from megatron_zeppelin.planner.schedule import Message

if TYPE_CHECKING:
    from megatron_zeppelin.comm.exchange import DistExchanger

__all__ = ["RelayPending", "StagedPending", "ZeppelinCommError", "plan_legs"]

MAX_HOPS = 3
JOIN_GRACE_S = 1.0


class ZeppelinCommError(RuntimeError):
    """A ring exchange was misused, timed out or lost a peer. The message names the tag."""


@dataclass(frozen=True)
class Leg:
    """One piece of a message on a fixed path: rows ``[offset, offset + num_tokens)``."""

    message: int
    offset: int
    num_tokens: int
    path: tuple[int, ...]  # Zeppelin ranks visited, consecutive duplicates removed

    @property
    def hops(self) -> list[tuple[int, int]]:
        return list(zip(self.path[:-1], self.path[1:]))


def plan_legs(
    messages: Sequence[Message], routes: Mapping[tuple[int, int], Route] | None
) -> list[Leg]:
    """Every piece of every message with the path it takes (pure; the same on every rank)."""
    legs = []
    for index, msg in enumerate(messages):
        route = routes.get((msg.src, msg.dst)) if routes is not None else None
        if route is None:
            if msg.num_tokens:
                legs.append(Leg(index, 0, msg.num_tokens, (msg.src, msg.dst)))
            continue
        sizes = split_by_weights(msg.num_tokens, [p.weight for p in route.parts])
        offset = 0
        for part, n in zip(route.parts, sizes):
            if n:
                path = [msg.src]
                for rank in (part.src_proxy, part.dst_proxy, msg.dst):
                    if rank != path[-1]:
                        path.append(rank)
                assert len(path) - 1 <= MAX_HOPS
                legs.append(Leg(index, offset, n, tuple(path)))
            offset += n
    return legs


def _shown(notes: list[str]) -> str:
    return ", ".join(notes[:6]) + (f", ... {len(notes) - 6} more" if len(notes) > 6 else "")


class _Pending:
    """What both kinds share: the legs, the rows held, errors, the final assembly."""

    def __init__(self, exchanger: DistExchanger, messages: Sequence[Message], legs: list[Leg],
                 held: dict[int, torch.Tensor], row_shape: tuple[int, ...], dtype: torch.dtype,
                 tag: str):  # fmt: skip
        self._ex = exchanger
        self._messages = list(messages)
        self._legs = legs
        self._held = held  # leg index -> rows this rank holds now (sent or received)
        self._row_shape = row_shape
        self._dtype = dtype
        self.tag = tag
        self._done = False

    def _buffer(self, leg: Leg) -> torch.Tensor:
        return torch.empty((leg.num_tokens, *self._row_shape), dtype=self._dtype,
                           device=self._ex.device)  # fmt: skip

    def _error(self, where: str, exc: BaseException | None) -> ZeppelinCommError:
        cause = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        return ZeppelinCommError(
            f"exchange {self.tag!r} failed on rank {self._ex.rank} while {where}{cause}. "
            "A peer may have died or fallen behind by more than the timeout "
            f"({self._ex.timeout_s:g} s)."
        )

    def _wait_work(self, work: dist.Work, what: str, deadline: float) -> None:
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

    def _begin_wait(self) -> float:
        if self._done:
            raise ZeppelinCommError(f"exchange {self.tag!r}: wait() called twice")
        self._done = True
        return time.monotonic() + self._ex.timeout_s

    def _assemble(self) -> dict[tuple[int, int], torch.Tensor]:
        """``{(src, this rank): rows}`` for each message this rank receives, parts in order."""
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


class StagedPending(_Pending):
    """Hops as stages: stage 0 posted now, later stages by ``wait`` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._num_stages = max((len(leg.path) - 1 for leg in self._legs), default=0)
        self._inflight: list[tuple[dist.Work, str]] = []
        self._arrived: dict[int, torch.Tensor] = {}
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
                group = ex.groups.link_group(a, b)
                op = dist.P2POp(dist.isend, tensor, ex.groups.global_rank(b), group=group)
                if ex.counters is not None:
                    ex.counters.record(a, b, tensor.numel() * tensor.element_size())
                notes.append(f"send {a}->{b}")
            elif rank == b:
                tensor = self._arrived[index] = self._buffer(leg)
                group = ex.groups.link_group(a, b)
                op = dist.P2POp(dist.irecv, tensor, ex.groups.global_rank(a), group=group)
                notes.append(f"recv {a}->{b}")
            else:
                continue
            ops.setdefault(id(group), (group, []))[1].append(op)
        what = f"stage {stage} ({_shown(notes)})"
        try:
            for _, batch in ops.values():
                works = dist.batch_isend_irecv(batch)
                self._inflight.extend((w, what) for w in works)
        except Exception as exc:  # a peer that died before we posted shows up here
            raise self._error(f"posting {what}", exc) from exc

    def wait(self) -> dict[tuple[int, int], torch.Tensor]:
        """Finish every hop; return ``{(src, this rank): rows}`` for each message received."""
        deadline = self._begin_wait()
        for stage in range(self._num_stages):
            if stage:
                self._post(stage)
            for work, what in self._inflight:
                self._wait_work(work, what, deadline)
            self._inflight = []
            self._held.update(self._arrived)
            self._arrived = {}
        return self._assemble()


class RelayPending(_Pending):
    """Every hop posted now, relays forwarded by a helper thread (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        ex, rank = self._ex, self._ex.rank
        self._deadline = time.monotonic() + ex.timeout_s
        base = ex.groups.reserve_tags(MAX_HOPS * len(self._legs))
        self._works: list[tuple[dist.Work, str]] = []
        self._recvs: dict[tuple[int, int], tuple[dist.Work, torch.Tensor, str]] = {}
        # A gloo receive's wait consumes the arrival: waiting twice blocks. The helper thread
        # waits on what it relays, the main thread on the rest.
        self._relayed: set[tuple[int, int]] = set()
        relays: list[tuple[int, int]] = []  # (hop, leg) this rank forwards, in a fixed order
        sends: list[tuple[int, int]] = []
        for index, leg in enumerate(self._legs):
            for hop, (a, b) in enumerate(leg.hops):
                if rank == b:
                    buffer = self._buffer(leg)
                    what = f"recv {a}->{b} (hop {hop + 1})"
                    work = self._p2p(dist.irecv, buffer, a, b, base + MAX_HOPS * index + hop,
                                     what)  # fmt: skip
                    self._recvs[(index, hop)] = (work, buffer, what)
                elif rank == a:
                    (sends if hop == 0 else relays).append((hop, index))
        for hop, index in sends:
            self._send(index, hop, self._held[index], base)
        self._relay_error: ZeppelinCommError | None = None
        self._thread: threading.Thread | None = None
        if relays:
            self._thread = threading.Thread(
                target=self._relay, args=(sorted(relays), base), daemon=True,
                name=f"zeppelin-relay {self.tag}",
            )  # fmt: skip
            self._thread.start()

    def _p2p(self, op, tensor: torch.Tensor, a: int, b: int, tag: int, what: str) -> dist.Work:  # noqa: ANN001
        ex = self._ex
        peer = b if op is dist.isend else a
        try:
            work = op(tensor, ex.groups.global_rank(peer), group=ex.groups.link_group(a, b),
                      tag=tag)  # fmt: skip
        except Exception as exc:  # a peer that died before we posted shows up here
            raise self._error(f"posting {what}", exc) from exc
        assert work is not None, "this rank is in every group it posts on"
        return work

    def _send(self, index: int, hop: int, tensor: torch.Tensor, base: int) -> None:
        a, b = self._legs[index].hops[hop]
        what = f"send {a}->{b} (hop {hop + 1})"
        work = self._p2p(dist.isend, tensor, a, b, base + MAX_HOPS * index + hop, what)
        if self._ex.counters is not None:
            self._ex.counters.record(a, b, tensor.numel() * tensor.element_size())
        self._works.append((work, what))

    def _relay(self, relays: list[tuple[int, int]], base: int) -> None:
        """Helper thread: forward each relayed hop once the hop before it has landed here."""
        try:
            for hop, index in relays:
                work, buffer, what = self._recvs[(index, hop - 1)]
                self._wait_work(work, what, self._deadline)
                self._relayed.add((index, hop - 1))
                self._send(index, hop, buffer, base)
        except ZeppelinCommError as exc:
            self._relay_error = exc
        except Exception as exc:  # noqa: BLE001 - surfaced by wait() on the main thread
            self._relay_error = self._error("relaying", exc)

    def wait(self) -> dict[tuple[int, int], torch.Tensor]:
        """Finish every hop; return ``{(src, this rank): rows}`` for each message received."""
        deadline = self._begin_wait()
        if self._thread is not None:
            # The thread's own deadline (from start) comes first; the grace lets it report
            # which transfer it was waiting on rather than a bare timeout.
            self._thread.join(timeout=max(deadline - time.monotonic(), 0.0) + JOIN_GRACE_S)
            if self._thread.is_alive():
                raise self._error("relaying to the next hop", TimeoutError("timed out"))
            if self._relay_error is not None:
                raise self._relay_error
        for (index, hop), (work, buffer, what) in self._recvs.items():
            if (index, hop) not in self._relayed:
                self._wait_work(work, what, deadline)
            if hop == len(self._legs[index].hops) - 1:
                self._held[index] = buffer
        for work, what in self._works:
            self._wait_work(work, what, deadline)
        return self._assemble()
