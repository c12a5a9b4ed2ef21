"""One ring step's transfers in flight: how the hops of routed messages are posted and finished.

``DistExchanger.start`` cuts the step's messages into legs (``step_legs``: each message's
``planner.plan.schedule.message_legs``, a piece of the message on a fixed path of one to three hops)
and hands them to one of two ``Pending`` kinds, with a ``Transport`` record of what they need
from the exchanger (groups, device, counters, timeout, an optional posting log):

* ``RelayPending`` (gloo): everything is posted by ``start``. Every receive this rank will make,
  of every hop, and every first-hop send go out at once; a helper thread forwards what this
  rank relays, each later hop as soon as the hop before it has landed here. A proxy therefore
  relays while it computes: nobody downstream waits for the proxy to call ``wait``. Each
  exchange reserves the same block of point-to-point tags from the groups' counter on every
  rank (``EXCHANGE_TAGS``, in program order), and a hop ``a -> b`` takes the block's tag of its
  place among the legs that cross ``a -> b`` in message order: both ends list those legs alike,
  whatever else each lists (a rank is handed the messages it acts on, not every rank's). So a
  transfer matches its receive whatever order the main thread and the helper threads post in,
  and exchanges in flight together never mix.
* ``StagedPending`` (NCCL, and any backend that matches point-to-point by posting order): the
  hops are stages; stage 0 is posted by ``start``, later stages by ``wait``, each after the
  stage before it. NCCL ignores tags and matches sends and receives by their order on a
  communicator, so a helper thread posting relays while the main thread posts the next
  exchange would interleave nondeterministically and mismatch; relays there wait for ``wait``.
  A stage's operations go out as one batch per communicator, the batches in the one order of
  ``ZeppelinGroups.posting_order`` on every rank (``posting.py`` says why NCCL needs it); with a
  ``PostingLog`` in the transport every batch is recorded for ``posting.check_posting_order``.

Waiting. On gloo a wait blocks the host, bounded by the exchanger's timeout. On NCCL
``Work.wait()`` is stream-ordered: it makes the caller's current CUDA stream wait for the
transfer and returns at once, so the host goes on queueing kernels while the transfer runs.
It is never given a timeout there (a timeout makes it block the host until the transfer ends);
NCCL's watchdog bounds a stuck transfer instead, with the groups' timeout (the same Zeppelin
timeout, set when ``ZeppelinGroups`` creates them). Streams on NCCL: PyTorch runs each
communicator's transfers on that communicator's own stream, which first waits for the current
stream at posting (so a send sees the rows the compute stream wrote), and ``wait`` makes the
current stream wait for it in turn (so a relay's next-hop send, on another communicator, and the
kernels that use the rows come after the receive).

Both raise ``ZeppelinCommError`` naming the exchange's tag when a transfer fails or (gloo) does
not finish within the timeout. Shapes: rows are ``(t, *row_shape)``.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.counters import LinkCounters
from megatron_zeppelin.comm.groups import ZeppelinGroups
from megatron_zeppelin.comm.posting import RECV, SEND, Batch, PostedOp, PostingLog
from megatron_zeppelin.comm.protocol import ZeppelinCommError
from megatron_zeppelin.planner.plan.plan import Route
from megatron_zeppelin.planner.plan.schedule import Leg, Message, message_legs

__all__ = ["RelayPending", "StagedPending", "Transport", "step_legs"]

JOIN_GRACE_S = 1.0
EXCHANGE_TAGS = 1 << 12
"""Point-to-point tags each gloo exchange reserves (``RelayPending``): the most legs that may
cross one pair of ranks in one ring step. Routed parts of the edges between two nodes share a
rail pair, at most a node's GPUs squared of them; far below this. The groups' tag space holds
``TAG_SPACE / EXCHANGE_TAGS`` exchanges before it wraps, far more than are ever in flight."""


@dataclass(frozen=True)
class Transport:
    """What transfers in flight need from their exchanger (built by it at each ``start``)."""

    groups: ZeppelinGroups
    device: torch.device
    counters: LinkCounters | None
    timeout_s: float
    posting_log: PostingLog | None = None

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def host_waits(self) -> bool:
        """Whether a wait blocks the host with a timeout (gloo) or is stream-ordered (NCCL)."""
        return self.groups.backend != "nccl"


def step_legs(
    messages: Sequence[Message], routes: Mapping[tuple[int, int], Route]
) -> list[tuple[int, Leg]]:
    """``(message index, leg)`` of every leg of one step, in message order (pure; the same on
    every rank). ``routes``: by edge; an edge without one goes direct."""
    return [
        (index, leg)
        for index, msg in enumerate(messages)
        for leg in message_legs(msg, routes.get((msg.src, msg.dst)))
    ]


def _hop_tags(
    legs: list[tuple[int, Leg]], base: int, rank: int, tag: str
) -> dict[tuple[int, int], int]:
    """``(leg index, hop) -> point-to-point tag`` of every hop ``rank`` sends or receives: the
    ``n``-th leg to cross ``a -> b`` (in ``legs``' order) takes ``base + n`` for that hop. Its
    two ends count the same legs, each listing every leg that touches it in the order of every
    rank's."""
    crossed: dict[tuple[int, int], int] = defaultdict(int)
    tags = {}
    for index, (_, leg) in enumerate(legs):
        for hop, pair in enumerate(leg.hops):
            if rank in pair:
                place = crossed[pair]
                crossed[pair] = place + 1
                if place >= EXCHANGE_TAGS:
                    raise ZeppelinCommError(
                        f"exchange {tag!r}: more than {EXCHANGE_TAGS} transfers from rank "
                        f"{pair[0]} to rank {pair[1]} in one ring step; the tags of one exchange "
                        "run out (EXCHANGE_TAGS)"
                    )
                tags[(index, hop)] = base + place
    return tags


def _shown(notes: list[str]) -> str:
    return ", ".join(notes[:6]) + (f", ... {len(notes) - 6} more" if len(notes) > 6 else "")


class _Pending:
    """What both kinds share: the legs, the rows held, errors, the final assembly."""

    def __init__(
        self,
        transport: Transport,
        messages: Sequence[Message],
        legs: list[tuple[int, Leg]],
        held: dict[int, torch.Tensor],
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        tag: str,
    ):
        self._tr = transport
        self._messages = list(messages)
        self._legs = legs
        self._held = held  # leg index -> rows this rank holds now (sent or received)
        self._row_shape = row_shape
        self._dtype = dtype
        self.tag = tag
        self._done = False

    def _buffer(self, leg: Leg) -> torch.Tensor:
        return torch.empty(
            (leg.num_tokens, *self._row_shape), dtype=self._dtype, device=self._tr.device
        )

    def _error(self, where: str, exc: BaseException | None) -> ZeppelinCommError:
        cause = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        return ZeppelinCommError(
            f"exchange {self.tag!r} failed on rank {self._tr.rank} while {where}{cause}. "
            "A peer may have died or fallen behind by more than the timeout "
            f"({self._tr.timeout_s:g} s)."
        )

    def _wait_work(self, work: dist.Work, what: str, deadline: float) -> None:
        if not self._tr.host_waits:
            try:  # stream-ordered; NCCL's watchdog bounds it (module docstring)
                work.wait()
            except Exception as exc:
                raise self._error(f"waiting on {what}", exc) from exc
            return
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
        return time.monotonic() + self._tr.timeout_s

    def _assemble(self) -> dict[tuple[int, int], torch.Tensor]:
        """``{(src, this rank): rows}`` for each message this rank receives, parts in order."""
        rank = self._tr.rank
        pieces: dict[int, list[torch.Tensor]] = {}
        for index, (message, leg) in enumerate(self._legs):
            if leg.path[-1] == rank:
                pieces.setdefault(message, []).append(self._held[index])
        received = {}
        for index, msg in enumerate(self._messages):
            if msg.dst != rank:
                continue
            parts = pieces.get(index, [])
            if not parts:
                received[(msg.src, msg.dst)] = torch.empty(
                    (0, *self._row_shape), dtype=self._dtype, device=self._tr.device
                )
            else:
                received[(msg.src, msg.dst)] = parts[0] if len(parts) == 1 else torch.cat(parts)
        self._held = {}
        return received


class StagedPending(_Pending):
    """Hops as stages: stage 0 posted now, later stages by ``wait`` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._num_stages = max((len(leg.path) - 1 for _, leg in self._legs), default=0)
        self._inflight: list[tuple[dist.Work, str]] = []
        self._arrived: dict[int, torch.Tensor] = {}
        if self._num_stages:
            self._post(0)

    def _stage_ops(self, stage: int) -> dict[tuple[str, int], list[tuple[dist.P2POp, PostedOp]]]:
        """This rank's operations of ``stage`` by communicator, each list in leg order."""
        tr = self._tr
        rank = tr.rank
        ops: dict[tuple[str, int], list[tuple[dist.P2POp, PostedOp]]] = {}
        for index, (_, leg) in enumerate(self._legs):
            if stage >= len(leg.hops):
                continue
            a, b = leg.hops[stage]
            if rank == a:
                tensor = self._held[index]
                kind, peer, direction = dist.isend, b, SEND
            elif rank == b:
                tensor = self._arrived[index] = self._buffer(leg)
                kind, peer, direction = dist.irecv, a, RECV
            else:
                continue
            key = tr.groups.link_key(a, b)
            op = dist.P2POp(kind, tensor, tr.groups.global_rank(peer), group=tr.groups.group(key))
            num_bytes = tensor.numel() * tensor.element_size()
            ops.setdefault(key, []).append((op, PostedOp(peer, direction, num_bytes)))
        return ops

    def _post(self, stage: int) -> None:
        tr = self._tr
        ops = self._stage_ops(stage)
        notes = [
            f"{p.direction} {tr.rank}->{p.peer}"
            if p.direction == SEND
            else f"{p.direction} {p.peer}->{tr.rank}"
            for batch in ops.values()
            for _, p in batch
        ]
        what = f"stage {stage} ({_shown(notes)})"
        try:
            # One global communicator order on every rank: never a rank-dependent one.
            for key in sorted(ops, key=tr.groups.posting_order):
                batch = ops[key]
                if tr.counters is not None:
                    for _, p in batch:
                        if p.direction == SEND:
                            tr.counters.record(tr.rank, p.peer, p.num_bytes)
                if tr.posting_log is not None:
                    ops_posted = tuple(p for _, p in batch)
                    tr.posting_log.append(Batch(key, ops_posted, f"{self.tag} stage {stage}"))
                works = dist.batch_isend_irecv([op for op, _ in batch])
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
        tr, rank = self._tr, self._tr.rank
        assert tr.host_waits and tr.posting_log is None, "relays run on gloo only, unrecorded"
        self._deadline = time.monotonic() + tr.timeout_s
        base = tr.groups.reserve_tags(EXCHANGE_TAGS)
        self._tags = _hop_tags(self._legs, base, rank, self.tag)
        self._works: list[tuple[dist.Work, str]] = []
        self._recvs: dict[tuple[int, int], tuple[dist.Work, torch.Tensor, str]] = {}
        # A gloo receive's wait consumes the arrival: waiting twice blocks. The helper thread
        # waits on what it relays, the main thread on the rest.
        self._relayed: set[tuple[int, int]] = set()
        relays: list[tuple[int, int]] = []  # (hop, leg) this rank forwards, in a fixed order
        sends: list[tuple[int, int]] = []
        for index, (_, leg) in enumerate(self._legs):
            for hop, (a, b) in enumerate(leg.hops):
                if rank == b:
                    buffer = self._buffer(leg)
                    what = f"recv {a}->{b} (hop {hop + 1})"
                    work = self._p2p(dist.irecv, buffer, a, b, self._tags[(index, hop)], what)
                    self._recvs[(index, hop)] = (work, buffer, what)
                elif rank == a:
                    (sends if hop == 0 else relays).append((hop, index))
        for hop, index in sends:
            self._send(index, hop, self._held[index])
        self._relay_error: ZeppelinCommError | None = None
        self._thread: threading.Thread | None = None
        if relays:
            self._thread = threading.Thread(
                target=self._relay,
                args=(sorted(relays),),
                daemon=True,
                name=f"zeppelin-relay {self.tag}",
            )
            self._thread.start()

    def _p2p(self, op, tensor: torch.Tensor, a: int, b: int, tag: int, what: str) -> dist.Work:  # noqa: ANN001
        groups = self._tr.groups
        peer = b if op is dist.isend else a
        try:
            work = op(tensor, groups.global_rank(peer), group=groups.link_group(a, b), tag=tag)
        except Exception as exc:  # a peer that died before we posted shows up here
            raise self._error(f"posting {what}", exc) from exc
        assert work is not None, "this rank is in every group it posts on"
        return work

    def _send(self, index: int, hop: int, tensor: torch.Tensor) -> None:
        a, b = self._legs[index][1].hops[hop]
        what = f"send {a}->{b} (hop {hop + 1})"
        work = self._p2p(dist.isend, tensor, a, b, self._tags[(index, hop)], what)
        if self._tr.counters is not None:
            self._tr.counters.record(a, b, tensor.numel() * tensor.element_size())
        self._works.append((work, what))

    def _relay(self, relays: list[tuple[int, int]]) -> None:
        """Helper thread: forward each relayed hop once the hop before it has landed here."""
        try:
            for hop, index in relays:
                work, buffer, what = self._recvs[(index, hop - 1)]
                self._wait_work(work, what, self._deadline)
                self._relayed.add((index, hop - 1))
                self._send(index, hop, buffer)
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
            if hop == len(self._legs[index][1].hops) - 1:
                self._held[index] = buffer
        for work, what in self._works:
            self._wait_work(work, what, deadline)
        return self._assemble()
