"""Per-tier timings of the ring engine: compute, communication, and the communication it exposes.

The engine (``ring.py``) marks events, when it is given a ``RingTimer``, at five points:

* ``posted``: right after an exchange is started (on CUDA the transfer's NCCL stream waits for
  the current stream from here, so the transfer may begin);
* ``waiting`` and ``landed``: right before and after its ``wait`` (on CUDA the current stream
  waits there for the NCCL stream: ``landed`` completes when the rows have arrived);
* ``compute`` start and end: around the kernel calls of one tier at one ring step (tier
  ``own`` for compute 0: local documents and each ring document's own block; the 2-D scheme's
  column rings as ``2d own`` and ``2d inter``, its head all-to-all untimed).

Per tier: **compute** is the sum of the kernel spans; **communication** the sum of
``posted -> landed`` (from when a transfer could start until its rows were usable); **exposed**
the sum of ``waiting -> landed``, the time the compute stream (or, on gloo, the host) stood still
for a transfer. Perfect overlap has exposed 0 and communication up to the compute it hid behind.

Events are recorded on the current stream: on CUDA ``torch.cuda.Event(enable_timing=True)``
(``cuda_events``), elsewhere ``HostEvent`` (the host clock, meaningful where waits block the
host, as on gloo). Any object with ``record()`` and ``elapsed_time(later) -> ms`` will do (tests
pass a fake clock). ``summary`` synchronizes the events it reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = ["HostEvent", "RingTimer", "cuda_events", "host_events"]


class Event(Protocol):
    def record(self) -> None: ...

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds from this event to ``end``."""
        ...


class HostEvent:
    """An event on the host clock with ``torch.cuda.Event``'s two methods."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.seconds: float | None = None

    def record(self) -> None:
        self.seconds = self._clock()

    def elapsed_time(self, end: HostEvent) -> float:
        assert self.seconds is not None and end.seconds is not None, "event never recorded"
        return 1000.0 * (end.seconds - self.seconds)

    def synchronize(self) -> None:
        pass


def host_events() -> HostEvent:
    return HostEvent()


def cuda_events() -> Event:
    return torch.cuda.Event(enable_timing=True)


@dataclass
class _Transfer:
    tier: str
    posted: Any
    waiting: Any = None
    landed: Any = None


@dataclass
class RingTimer:
    """Events of one engine run (or several: sums accumulate until ``reset``)."""

    make_event: Callable[[], Any] = host_events
    _transfers: list[_Transfer] = field(default_factory=list)
    _in_flight: dict[int, _Transfer] = field(default_factory=dict)
    _computes: list[tuple[str, Any, Any]] = field(default_factory=list)

    def _event(self) -> Any:
        event = self.make_event()
        event.record()
        return event

    def posted(self, pending: object, tier: str) -> None:
        transfer = _Transfer(tier, self._event())
        self._transfers.append(transfer)
        self._in_flight[id(pending)] = transfer

    def waiting(self, pending: object) -> None:
        self._in_flight[id(pending)].waiting = self._event()

    def landed(self, pending: object) -> None:
        self._in_flight.pop(id(pending)).landed = self._event()

    @contextmanager
    def compute(self, tier: str) -> Iterator[None]:
        start = self._event()
        yield
        self._computes.append((tier, start, self._event()))

    def reset(self) -> None:
        self._transfers, self._in_flight, self._computes = [], {}, []

    def summary(self) -> dict[str, dict[str, float]]:
        """Per tier, ``compute_ms``, ``comm_ms``, ``exposed_ms`` and ``steps`` (transfers)."""
        assert not self._in_flight, "a transfer was never waited on"
        for event in [e for _, a, b in self._computes for e in (a, b)] + [
            e for t in self._transfers for e in (t.posted, t.waiting, t.landed)
        ]:
            sync = getattr(event, "synchronize", None)
            if sync is not None:
                sync()
        out: dict[str, dict[str, float]] = {}

        def entry(tier: str) -> dict[str, float]:
            return out.setdefault(
                tier, {"compute_ms": 0.0, "comm_ms": 0.0, "exposed_ms": 0.0, "steps": 0}
            )

        for tier, start, end in self._computes:
            entry(tier)["compute_ms"] += start.elapsed_time(end)
        for t in self._transfers:
            e = entry(t.tier)
            e["comm_ms"] += t.posted.elapsed_time(t.landed)
            e["exposed_ms"] += t.waiting.elapsed_time(t.landed)
            e["steps"] += 1
        return out
