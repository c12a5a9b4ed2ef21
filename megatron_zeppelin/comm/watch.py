"""Bounded collectives: a stalled peer ends the job with an error that names it, never a hang.

A gloo collective blocks until its process group's timeout (30 minutes by default) when one peer
stops answering: a process stopped by a signal, a hung kernel, a swapped-out host. ``CommWatch``
bounds every collective the plugin issues by the Zeppelin timeout (``--zeppelin-comm-timeout-s``)
and, when one does not finish in time, says which rank stalled, at which step and layer:

* **Bounded waits.** ``run(what, issue)`` posts the collective asynchronously and waits on it
  with the timeout (gloo). On NCCL the host does not wait (waits stay stream-ordered): the
  process group's timeout, enforced by NCCL's watchdog, is the bound. The groups
  ``comm.groups.ZeppelinGroups`` creates carry it from creation; ``bound_groups`` sets it on the
  groups made elsewhere (the world, Megatron's data- and tensor-parallel groups).
* **A progress board.** Every rank publishes its *position* (its moves so far, step, layer,
  phase, the operation) in the rendezvous store whenever it changes, and a heartbeat every
  ``beat_s``, from a helper thread (the only writer, so a store whose host stalled never blocks
  training). Reading the board needs no collective, so a rank whose collective timed out can
  still ask who is behind: ranks whose heartbeat stopped (stopped, hung, dead), ranks that said
  they failed, and ranks that are alive but behind.

The error is ``CommStallError`` (a ``ZeppelinCommError``); its message reads, for example::

    rank 0 at step 5, layer 1 (forward), remap linear->attention: no answer within 5 s;
    rank 2 stopped responding (no heartbeat for 1.0 s), last seen at step 5, layer 1 (forward),
    remap linear->attention

Ring P2P transfers are bounded by the exchanger's own timeout (``comm.pending``); their errors
carry the exchange and the peer, and ``explain`` adds the board's diagnosis and this rank's
position. A watch is passed explicitly (``ZeppelinPackedSeqParams.watch``, the ``watch=``
argument of ``comm.remap`` and ``megatron.model.loss``); without one those collectives run as
before.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.protocol import ZeppelinCommError

__all__ = ["CommStallError", "CommWatch", "Position", "ProgressBoard", "is_comm_failure"]

BOARD_PREFIX = "zeppelin/progress/"
NO_STORE_ANSWER = (
    "the rendezvous store did not answer, so the stalled rank is unknown (the process hosting "
    "the store may be the one that stalled)"
)
NOBODY_BEHIND = (
    "every rank is alive and as far as this one: the transfer itself failed (the network, or a "
    "peer too slow for --zeppelin-comm-timeout-s inside this step)"
)
STORE_ANSWER_S = 2.0
"""How long a board read, or the last publication at ``close``, waits for the store."""


@dataclass(frozen=True)
class Position:
    """Where a rank is. ``op`` counts its moves (collectives issued and positions marked with
    ``CommWatch.at``): every rank makes the same moves in the same order, so a smaller count is
    a rank behind."""

    op: int = 0
    step: int | None = None
    layer: int | None = None
    phase: str = ""
    what: str = ""

    def describe(self) -> str:
        parts = []
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.layer is not None:
            parts.append(f"layer {self.layer}" + (f" ({self.phase})" if self.phase else ""))
        elif self.phase:
            parts.append(self.phase)
        if self.what:
            parts.append(self.what)
        return ", ".join(parts) or "start-up"


@dataclass(frozen=True)
class Beat:
    """One rank's entry on the board: a heartbeat counter, its state and its position."""

    beat: int
    state: str  # running, done or failed
    position: Position
    note: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "beat": self.beat,
                "state": self.state,
                "note": self.note,
                "position": vars(self.position),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Beat:
        raw = json.loads(text)
        return cls(raw["beat"], raw["state"], Position(**raw["position"]), raw.get("note", ""))


class CommStallError(ZeppelinCommError):
    """A collective or transfer did not finish in time; the message names who stalled."""

    def __init__(
        self,
        message: str,
        *,
        stalled: Sequence[int] = (),
        failed: Sequence[int] = (),
        behind: Sequence[int] = (),
    ):
        super().__init__(message)
        self.stalled = tuple(stalled)
        self.failed = tuple(failed)
        self.behind = tuple(behind)


_COMM_WORDS = re.compile(
    r"gloo|nccl|timed out|connection (closed|reset|refused)|broken pipe|peer", re.IGNORECASE
)


_SOURCE_TAG = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
"""The ``[.../unbound_buffer.cc:78]`` prefix of a gloo error: where in gloo, not what failed."""


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a transfer that failed (as opposed to bad input or a bug)."""
    if isinstance(exc, ZeppelinCommError):
        return True
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMM_WORDS.search(str(exc)))


class ProgressBoard:
    """Every rank's ``Beat`` in a c10d store (TCPStore, FileStore, ...), one key per rank."""

    def __init__(self, store: dist.Store, world_size: int, answer_s: float = STORE_ANSWER_S):
        self.store = store
        self.world_size = world_size
        self.answer_s = answer_s
        """How long a read waits for the store (its host may be the process that stalled)."""
        self._lock = threading.Lock()

    def publish(self, rank: int, beat: Beat) -> None:
        with self._lock:
            self.store.set(f"{BOARD_PREFIX}{rank}", beat.to_json())

    def read(self) -> dict[int, Beat] | None:
        """Every rank's last entry (ranks that never published are absent); ``None`` when the
        store does not answer within ``answer_s`` or its host is gone."""
        found: dict[int, Beat] = {}
        complete = threading.Event()

        def read_all() -> None:
            try:
                with self._lock:
                    for rank in range(self.world_size):
                        key = f"{BOARD_PREFIX}{rank}"
                        if self.store.check([key]):
                            found[rank] = Beat.from_json(self.store.get(key).decode())
            except Exception:  # noqa: BLE001 - its host is gone (a broken pipe): no answer
                return
            complete.set()

        reader = threading.Thread(target=read_all, daemon=True, name="zeppelin-board-read")
        reader.start()
        reader.join(self.answer_s)
        return found if complete.is_set() else None


class CommWatch:
    """This rank's bounded collectives and its place on the progress board (module docstring).

    ``store`` ``None``: no board (errors then name no rank). ``start`` begins the heartbeat
    (every ``beat_s``, and at once when the position changes) and ``close`` ends it; without a
    heartbeat nothing is published and the diagnosis names only ranks that said they failed.
    A diagnosis reads the board twice, ``settle_s`` apart; each read, and the last publication
    at ``close``, waits for the store at most ``store_answer_s``.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        store: dist.Store | None = None,
        backend: str = "gloo",
        beat_s: float | None = None,
        settle_s: float | None = None,
        store_answer_s: float = STORE_ANSWER_S,
    ):
        if not timeout_s > 0:
            raise ValueError(f"the communication timeout must be positive, got {timeout_s}")
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.backend = backend
        self.beat_s = beat_s if beat_s is not None else min(max(timeout_s / 10, 0.2), 2.0)
        self.settle_s = settle_s if settle_s is not None else max(3 * self.beat_s, 1.0)
        """How long a diagnosis watches the heartbeats before calling a rank stopped (several
        beats, and at least a second by default so a busy host's late beat is not a stop)."""
        self.board = ProgressBoard(store, world_size, store_answer_s) if store is not None else None
        self.position = Position()
        self._beat = 0
        self._state = "running"
        self._note = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_process_group(cls, timeout_s: float, **kwargs: Any) -> CommWatch:
        """A watch over the default process group, its board in the group's store."""
        store = dist.distributed_c10d._get_default_store()
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            timeout_s=timeout_s,
            store=store,
            backend=str(dist.get_backend()),
            **kwargs,
        )

    # --- position and heartbeat --------------------------------------------------------------
    def at(self, **fields: Any) -> None:
        """Mark this rank's position (``step``, ``layer``, ``phase``, ``what``): one move. Call
        it at the same places on every rank."""
        with self._lock:
            fields.setdefault("op", self.position.op + 1)
            self.position = replace(self.position, **fields)
        self._wake.set()

    def start(self) -> CommWatch:
        """Start the heartbeat thread, the only one that writes to the board (so a store whose
        host stalled never blocks training); idempotent, returns ``self``."""
        if self._thread is None and self.board is not None:
            self._thread = threading.Thread(
                target=self._beat_loop, daemon=True, name="zeppelin-heartbeat"
            )
            self._thread.start()
        return self

    def close(self, state: str = "done", note: str = "") -> None:
        """Leave a last entry (``done``, or ``failed`` with a one-line note) and stop the
        heartbeat; waits for the store at most the board's ``answer_s``."""
        with self._lock:
            self._state, self._note = state, note
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self.board is not None:
            self._thread.join(self.board.answer_s)

    def _beat_loop(self) -> None:
        while True:
            self._wake.wait(self.beat_s)
            self._wake.clear()
            self._publish()
            if self._stop.is_set():
                return

    def _publish(self) -> None:
        assert self.board is not None
        with self._lock:
            self._beat += 1
            beat = Beat(self._beat, self._state, self.position, self._note)
        try:
            self.board.publish(self.rank, beat)
        except Exception:  # noqa: BLE001 - the board is diagnostic: never fail the job over it
            pass

    # --- bounded collectives -----------------------------------------------------------------
    def run(
        self,
        what: str,
        issue: Callable[[bool], Any],
        *,
        layer: int | None = None,
        phase: str = "",
        timeout_s: float | None = None,
        cuda: bool = False,
    ) -> None:
        """Run one collective: ``issue(async_op)`` posts it (``dist.<op>(..., async_op=...)``).
        ``cuda``: its tensors are on a GPU, so with a backend that sends CUDA tensors through
        NCCL (``nccl``, or ``cpu:gloo,cuda:nccl``) the wait stays stream-ordered."""
        with self._lock:
            self.position = replace(
                self.position, op=self.position.op + 1, layer=layer, phase=phase, what=what
            )
        self._wake.set()
        if self.backend == "nccl" or (cuda and "cuda:nccl" in self.backend):
            issue(False)  # stream-ordered; NCCL's watchdog enforces the group's timeout
            return
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            work = issue(True)
            ok = work.wait(timeout=timedelta(seconds=limit))
        except (ValueError, TypeError):
            raise  # bad arguments, not a stall
        except Exception as exc:
            raise self.explain(exc, limit_s=limit) from exc
        if ok is False:
            raise self.explain(None, limit_s=limit)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        *,
        what: str,
        op: Any = None,
    ) -> None:
        op = dist.ReduceOp.SUM if op is None else op
        self.run(
            what,
            lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a),
            cuda=tensor.is_cuda,
        )

    def all_gather(
        self,
        outputs: list[torch.Tensor],
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        *,
        what: str,
    ) -> None:
        self.run(
            what,
            lambda a: dist.all_gather(outputs, tensor, group=group, async_op=a),
            cuda=tensor.is_cuda,
        )

    def barrier(
        self, group: dist.ProcessGroup | None = None, *, what: str, timeout_s: float | None = None
    ) -> None:
        self.run(what, lambda a: dist.barrier(group=group, async_op=a), timeout_s=timeout_s)

    def bound_groups(self, groups: Sequence[dist.ProcessGroup | None]) -> None:
        """Make ``timeout_s`` the process-group timeout of ``groups`` (``None``: the world), so
        collectives issued by code that does not go through the watch (Megatron's own
        tensor-parallel reductions) end in time too; on NCCL this is the watchdog's bound."""
        setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if setter is None:
            return
        for group in groups:
            try:
                setter(timedelta(seconds=self.timeout_s), group)
            except (ValueError, RuntimeError, AssertionError):
                pass  # not a member, or a backend that cannot change it: the default stays

    # --- diagnosis ---------------------------------------------------------------------------
    def explain(self, exc: BaseException | None, *, limit_s: float | None = None) -> CommStallError:
        """A ``CommStallError`` for a transfer that failed or timed out at this rank's position,
        naming the ranks that stopped responding, failed or fell behind."""
        if isinstance(exc, CommStallError):
            return exc
        limit = self.timeout_s if limit_s is None else limit_s
        here = self.position
        text = _SOURCE_TAG.sub("", " ".join(str(exc).split())) if exc is not None else ""
        if exc is None or (not isinstance(exc, ZeppelinCommError) and "timed out" in text.lower()):
            cause = f"no answer within {limit:g} s"  # gloo's own words add nothing
        else:
            cause = text if isinstance(exc, ZeppelinCommError) else f"{type(exc).__name__}: {text}"
        head = f"rank {self.rank} at {here.describe()}: {cause}"
        verdict, stalled, failed, behind = self._diagnose(here)
        return CommStallError(f"{head}; {verdict}", stalled=stalled, failed=failed, behind=behind)

    def _diagnose(self, here: Position) -> tuple[str, list[int], list[int], list[int]]:
        if self.board is None:
            return "no progress board to tell which peer stalled", [], [], []
        first = self.board.read()
        time.sleep(self.settle_s)
        second = self.board.read()
        if first is None or second is None:
            return NO_STORE_ANSWER, [], [], []
        others = [r for r in range(self.world_size) if r != self.rank]
        failed = [r for r in others if r in second and second[r].state == "failed"]
        # Heartbeats tell a stopped rank from a waiting one only when every rank beats.
        beating = self._thread is not None
        stalled = [
            r
            for r in others
            if beating
            and r not in failed
            and (
                r not in second
                or (second[r].state == "running" and r in first and second[r].beat == first[r].beat)
            )
        ]
        behind = [
            r
            for r in others
            if r in second
            and r not in failed
            and r not in stalled
            and second[r].position.op < here.op
        ]
        parts = []
        for r in stalled:
            seen = f", last seen at {second[r].position.describe()}" if r in second else ""
            parts.append(
                f"rank {r} stopped responding (no heartbeat for {self.settle_s:.1f} s){seen}"
            )
        for r in failed:
            parts.append(f"rank {r} failed ({second[r].note or 'see its log'})")
        for r in behind:
            parts.append(
                f"rank {r} is alive but behind, at {second[r].position.describe()} (too "
                "slow for --zeppelin-comm-timeout-s, or stuck there)"
            )
        if not parts:
            return NOBODY_BEHIND, [], [], []
        return "; ".join(parts), stalled, failed, behind
