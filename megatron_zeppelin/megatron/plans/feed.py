"""The run's micro-batches in training order, each with its plan, planned ahead of training.

Every rank draws the same steps from the sampler, and the plan of a micro-batch depends only on
its lengths (planning is pure and deterministic), so plans can be made early: while micro-batch
``i`` trains, ``i + 1 .. i + ahead`` are planned, drawing the next step from the sampler when the
current one runs out. They are planned by ``workers`` planner processes (``plan_workers.py``:
planning in the training process would hold its interpreter lock, and slow the thread that
launches the step's kernels), or with ``workers=0`` by a background thread of the training
process. With ``share`` (``--zeppelin-share-plans``), only the first rank of every node runs
planner processes, each planning its turn of the micro-batches, and every rank receives each
plan from the rank that made it (``shared_plans.py``); otherwise every rank plans every
micro-batch itself. Both the Megatron hooks and the CPU job take their micro-batches from a
``MicroBatchFeed``.

Rules that keep it safe:

* the sampler is touched only by the training thread; the planners only plan;
* an error in planning is raised by ``next()`` for the micro-batch it belongs to, as the same
  exception the planner raised, so bad input still ends in the same one-line message; a
  planner process that dies fails its micro-batches with an error naming it;
* the planner thread is a daemon blocked on a queue between jobs, and a planner process ends
  when its stdin closes: neither keeps the run alive at exit, and ``close()`` stops both;
* ``state_dict()`` is the sampler's state at the start of the step the next micro-batch belongs
  to (at a step boundary: the state a checkpoint must hold), whatever was drawn ahead.
"""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from megatron_zeppelin.megatron.documents.sampler import DocumentSampler, DocumentSlice, StepBatch
from megatron_zeppelin.megatron.plans.plan_workers import PlannerProcesses, PlanRecipe
from megatron_zeppelin.megatron.plans.shared_plans import SharedPlanner
from megatron_zeppelin.planner.plan.plan import Plan

PlanFn = Callable[[Sequence[int]], Plan]


@dataclass(frozen=True)
class FedMicroBatch:
    """One micro-batch as training takes it."""

    step: StepBatch
    index: int
    """Position of the micro-batch in its step."""
    plan: Plan | None
    """``None`` for a micro-batch without documents."""

    @property
    def slices(self) -> tuple[DocumentSlice, ...]:
        return self.step.micro_batches[self.index]

    @property
    def is_last_of_step(self) -> bool:
        return self.index == len(self.step.micro_batches) - 1


@dataclass
class PlanningStats:
    """Where planning time went (seconds, summed over the run)."""

    num_plans: int = 0
    """Plans taken by training."""
    num_made: int = 0
    """Plans made on this rank, those made ahead included (with plans shared, only its turn of
    them; none on a rank that receives them all)."""
    shared: bool = False
    """Plans come from the first rank of each node (``shared_plans.SharedPlanner``)."""
    planning_s: float = 0.0
    """Spent planning the plans made on this rank, in whichever thread or process."""
    waited_s: float = 0.0
    """Spent by the training thread waiting for a plan (all of it when planning is inline)."""
    startup_s: float = 0.0
    """Spent by the training thread, before its first plan, waiting for the planner processes
    to start (an interpreter and the planner's imports each, once per run)."""
    collections: int = 0
    """Full passes of Python's collector while it ran by itself (``gc.isenabled()``), in any
    thread: every plan brings the training process thousands of new objects, which make the
    collector pass over all of them and everything else, holding the interpreter lock."""
    collection_s: float = 0.0
    longest_collection_s: float = 0.0

    @property
    def hidden_s(self) -> float:
        """Planning that ran while training went on."""
        return max(0.0, self.planning_s - self.waited_s)

    def to_dict(self) -> dict[str, float]:
        return {
            "num_plans": self.num_plans,
            "num_made": self.num_made,
            "shared": self.shared,
            "planning_s": self.planning_s,
            "waited_s": self.waited_s,
            "hidden_s": self.hidden_s,
            "startup_s": self.startup_s,
            "collections": self.collections,
            "collection_s": self.collection_s,
            "longest_collection_s": self.longest_collection_s,
        }


class _CollectorWatch:
    """Times the full passes (generation 2) of Python's collector that it starts by itself,
    into ``stats``, from ``start()`` to ``stop()``. A pass made on request while the collector
    is off (Megatron's ``--manual-gc`` calls ``gc.collect()`` at fixed steps) is not counted."""

    def __init__(self, stats: PlanningStats) -> None:
        self._stats = stats
        self._began: float | None = None

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._began = time.perf_counter() if gc.isenabled() else None
        elif self._began is not None:
            seconds = time.perf_counter() - self._began
            self._began = None
            stats = self._stats
            stats.collections += 1
            stats.collection_s += seconds
            stats.longest_collection_s = max(stats.longest_collection_s, seconds)


class _PlannerThread:
    """One daemon thread planning the jobs it is given, in order; ``on_seconds`` is called with
    each plan's planning time (as ``PlannerProcesses`` does)."""

    def __init__(self, plan_fn: PlanFn, on_seconds: Callable[[float], None]) -> None:
        self._plan_fn = plan_fn
        self._on_seconds = on_seconds
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="zeppelin-planner", daemon=True)
        self._thread.start()

    def submit(self, lengths: list[int]) -> Future:
        future: Future = Future()
        self._jobs.put((future, lengths))
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, lengths = job
            if not future.set_running_or_notify_cancel():
                continue
            start = time.perf_counter()
            try:
                plan = self._plan_fn(lengths)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                future.set_exception(exc)
            else:
                future.set_result(plan)
            finally:
                self._on_seconds(time.perf_counter() - start)

    def close(self) -> None:
        self._jobs.put(None)


class MicroBatchFeed:
    """``next()`` gives the run's micro-batches in order with their plans; see the module
    docstring. ``ahead=0`` plans each micro-batch inside ``next()``; otherwise ``workers``
    planner processes plan ahead (``plan_fn`` must then pickle: a ``PlanRecipe``), on the
    planning ranks of ``share`` where given (``comm.plan_share.PlanShare``), or a background
    thread with ``workers=0``."""

    def __init__(
        self,
        sampler: DocumentSampler,
        plan_fn: PlanFn,
        *,
        ahead: int = 2,
        workers: int = 0,
        share: Any = None,
        planner: _PlannerThread | PlannerProcesses | SharedPlanner | None = None,
    ) -> None:
        if ahead < 0:
            raise ValueError(f"micro-batches planned ahead must be >= 0, got {ahead}")
        if workers < 0:
            raise ValueError(f"planner processes must be >= 0, got {workers}")
        self.sampler = sampler
        self.stats = PlanningStats()
        self._plan_fn = plan_fn
        self._ahead = ahead
        self._stats_lock = threading.Lock()
        self._planner: _PlannerThread | PlannerProcesses | SharedPlanner | None = planner
        self._owns_planner = planner is None
        if planner is None and ahead and workers and share is not None:
            self._planner = SharedPlanner(plan_fn, workers, share, self._add_planning)  # type: ignore[arg-type]
            self.stats.shared = True
        elif planner is None and ahead and workers:
            self._planner = PlannerProcesses(plan_fn, workers, self._add_planning)  # type: ignore[arg-type]
        elif planner is None and ahead:
            self._planner = _PlannerThread(plan_fn, self._add_planning)
        # Planner processes are waited for once, before the first plan (``stats.startup_s``).
        self._starting = isinstance(self._planner, (PlannerProcesses, SharedPlanner))
        self._queue: deque[tuple[StepBatch, int, Future | None]] = deque()
        self._step_states: deque[tuple[StepBatch, dict[str, Any]]] = deque()
        self._collector = _CollectorWatch(self.stats)
        self._collector.start()

    @classmethod
    def for_run(
        cls, sampler: DocumentSampler, recipe: PlanRecipe, share: Any = None
    ) -> MicroBatchFeed:
        """The feed a run's flags ask for: ``--zeppelin-plan-ahead`` micro-batches ahead, in
        ``--zeppelin-plan-workers`` planner processes (``ZeppelinConfig.planner_processes``),
        on the planning ranks of ``share`` (``runtime.create_plan_share``) with
        ``--zeppelin-share-plans``."""
        config = recipe.config
        return cls(
            sampler,
            recipe,
            ahead=config.plan_ahead,
            workers=config.planner_processes,
            share=share if config.share_plans else None,
        )

    @property
    def planner_pids(self) -> list[int]:
        """This rank's planner processes (none with a planner thread, or on a rank that
        receives its plans)."""
        return list(getattr(self._planner, "pids", []))

    def beside(self, sampler: DocumentSampler) -> MicroBatchFeed:
        """A feed over another sampler (evaluation) that plans with this feed's planner, as far
        ahead, its planning time counted here; closing it leaves the planner running."""
        return MicroBatchFeed(sampler, self._plan_fn, ahead=self._ahead, planner=self._planner)

    def _add_planning(self, seconds: float) -> None:
        """A planner's seconds on one plan (the planner thread, or a planner process's reader
        thread, calls this)."""
        with self._stats_lock:
            self.stats.planning_s += seconds
            self.stats.num_made += 1

    def next(self) -> FedMicroBatch:
        """The next micro-batch and its plan (waits for the plan if it is not ready)."""
        self._fill(1 + self._ahead)
        if self._starting:
            start = time.perf_counter()
            self._planner.wait_ready()  # type: ignore[union-attr]
            self.stats.startup_s = time.perf_counter() - start
            self._starting = False
        step, index, future = self._queue.popleft()
        if not self._queue or self._queue[0][0] is not step:
            self._step_states.popleft()  # the step is handed out in full
        lengths = step.lengths(index)
        if not lengths:
            return FedMicroBatch(step, index, None)
        start = time.perf_counter()
        if future is None:
            try:
                plan = self._plan_fn(lengths)
            finally:
                self._add_planning(time.perf_counter() - start)
        else:
            plan = future.result()  # re-raises the planner's own exception
        self.stats.waited_s += time.perf_counter() - start
        self.stats.num_plans += 1
        return FedMicroBatch(step, index, plan)

    def _fill(self, wanted: int) -> None:
        """Draw steps until ``wanted`` micro-batches are queued, submitting their plans."""
        while len(self._queue) < wanted:
            before = self.sampler.state_dict()
            step = self.sampler.next_step()
            self._step_states.append((step, before))
            for index in range(len(step.micro_batches)):
                lengths = step.lengths(index)
                future = self._planner.submit(lengths) if self._planner and lengths else None
                self._queue.append((step, index, future))

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state at the start of the step of the next micro-batch (see the
        module docstring); at a step boundary, what a checkpoint saves."""
        if self._step_states:
            return self._step_states[0][1]
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the sampler from ``state`` and forget what was drawn ahead."""
        for _, _, future in self._queue:
            if future is not None:
                future.cancel()
        self._queue.clear()
        self._step_states.clear()
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        """Stop the planner thread or processes (plans still queued are dropped)."""
        for _, _, future in self._queue:
            if future is not None:
                future.cancel()
        if self._planner is not None and self._owns_planner:
            self._planner.close()
        self._planner = None
        self._collector.stop()
