"""Plans made by one rank per node and received by every rank, ahead of training
(``--zeppelin-share-plans``, the default with planner processes).

``SharedPlanner`` is the feed's planner (``submit``, ``wait_ready``, ``close``, as
``plan_workers.PlannerProcesses``) where plans are shared (``comm/plan_share.py``). The
micro-batches are numbered as they are submitted, the same on every rank (every rank draws the
same steps, ``feed.py``); the ``i``-th is planned by ``PlanShare.owner(i)``, the first rank of
one node, in its planner processes, which hand back the plan's bytes (``plan_wire.encode``). A
thread of every rank then exchanges the micro-batches in order: the owner broadcasts the bytes,
every rank (the owner too) decodes them in that thread (``plan_wire.decode``, which checks them)
and resolves the micro-batch's future. Only the ranks that plan run planner processes, so a node
spends one planner's CPU, not one per GPU, and the cluster plans as many micro-batches at once
as it has nodes.

Every rank executes the plan its owner made, which is the plan it would have made itself
(planning is deterministic: ``tests/test_plan_share.py`` trains both ways). Where the owner's
planning fails, every rank raises the same exception (a planner process that died: a
``RuntimeError`` naming it and its rank); where the owner does not send at all, every rank
raises ``comm.plan_share.PlanShareError`` at the plan group's timeout. A micro-batch the feed
gives up (closing, or resuming the sampler) is still exchanged, as ``DROPPED``, so the ranks
stay in step without waiting for its plan.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from megatron_zeppelin.comm.plan_share import DROPPED, ERROR, PLAN, PlanShare, PlanShareError
from megatron_zeppelin.megatron.plans.plan_workers import PlannerProcesses, PlanRecipe, picklable
from megatron_zeppelin.planner.plan import plan_wire

__all__ = ["SharedPlanner"]

_CLOSE_WAIT_S = 60.0
"""How long ``close`` waits for the micro-batches still queued to be exchanged (each one a
broadcast of a few bytes once planning stops: far less, unless a peer is gone)."""


class SharedPlanner:
    """Plans of this rank's Zeppelin world, one rank per node planning (module docstring);
    ``workers`` planner processes on each planning rank, ``on_seconds`` called with each plan's
    planning time on the rank that made it."""

    def __init__(
        self,
        recipe: PlanRecipe,
        workers: int,
        share: PlanShare,
        on_seconds: Callable[[float], None],
    ) -> None:
        self._share = share
        self._local: PlannerProcesses | None = None
        if share.rank in share.planners:
            self._local = PlannerProcesses(recipe, workers, on_seconds, raw=True)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._count = 0
        self._thread = threading.Thread(target=self._run, name="zeppelin-plan-share", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        """This rank's planner processes (none on a rank that does not plan)."""
        return self._local.pids if self._local is not None else []

    def submit(self, lengths: list[int]) -> Future:
        """The next micro-batch's plan, planned here if this rank owns it."""
        index, self._count = self._count, self._count + 1
        mine = None
        if self._share.owner(index) == self._share.rank:
            assert self._local is not None, "an owner is a planning rank"
            mine = self._local.submit(lengths)
        future: Future = Future()
        self._jobs.put((index, mine, future))
        return future

    def wait_ready(self) -> None:
        if self._local is not None:
            self._local.wait_ready()

    def close(self) -> None:
        """Stop planning; the micro-batches still queued are exchanged (as ``DROPPED`` where
        given up) so that every rank's broadcasts pair up, then the thread ends."""
        self._jobs.put(None)
        if self._local is not None:
            self._local.close()
        self._thread.join(_CLOSE_WAIT_S)

    def _run(self) -> None:
        failed: PlanShareError | None = None
        while (job := self._jobs.get()) is not None:
            index, mine, future = job
            if failed is not None:  # the ranks are out of step: every later plan fails alike
                _resolve(future, failed)
                continue
            try:
                kind, payload = self._share.exchange(index, *self._outgoing(mine, future))
                _deliver(future, kind, payload, index, self._share.owner(index))
            except PlanShareError as exc:
                failed = exc
                _resolve(future, exc)
            except Exception as exc:  # noqa: BLE001 - handed to the training thread
                _resolve(future, exc)

    def _outgoing(self, mine: Future | None, future: Future) -> tuple[int, bytes]:
        """What this rank sends for a micro-batch: nothing unless it owns it; the plan's
        bytes, or the planner's exception (a planner process that died named with this rank),
        or ``DROPPED`` where the feed gave the micro-batch up."""
        if mine is None:
            return DROPPED, b""
        if future.cancelled():
            mine.cancel()
            return DROPPED, b""
        try:
            blob = mine.result()
        except Exception as exc:  # noqa: BLE001 - every rank raises it
            if future.cancelled():
                return DROPPED, b""
            if type(exc) is RuntimeError:  # a planner process that died or was closed
                exc = RuntimeError(f"on Zeppelin rank {self._share.rank}, {exc}")
            return ERROR, pickle.dumps(picklable(exc), protocol=pickle.HIGHEST_PROTOCOL)
        return PLAN, blob


def _deliver(future: Future, kind: int, payload: bytes, index: int, owner: int) -> None:
    """Resolve a micro-batch's future from what its owner sent."""
    if future.cancelled():
        return
    if kind == PLAN:
        _resolve(future, plan_wire.decode(payload), result=True)
    elif kind == ERROR:
        _resolve(future, pickle.loads(payload))
    else:
        _resolve(
            future,
            RuntimeError(
                f"Zeppelin rank {owner} gave up planning micro-batch {index} that this rank "
                "still wanted: the ranks disagree on the micro-batches they train"
            ),
        )


def _resolve(future: Future, value: Any, *, result: bool = False) -> None:
    try:
        if result:
            future.set_result(value)
        else:
            future.set_exception(value)
    except InvalidStateError:  # cancelled by the training thread meanwhile
        pass
