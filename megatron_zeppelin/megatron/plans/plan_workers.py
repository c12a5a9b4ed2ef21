"""Plans made ahead in worker processes, so that planning never holds the training process's GIL.

A planner thread inside the training process (``feed.py`` with ``workers=0``) shares the
interpreter lock with the thread that launches the step's kernels. Every PyTorch operator
releases the lock while it runs and must take it back afterwards; with a planner thread busy in
Python, taking it back waits for the planner to reach its switch interval (5 ms). A stream of
small operators then runs several times slower for as long as a plan is being made
(``scripts/bench_plan_ahead.py``; docs/BENCHMARKS.md, "Planning ahead"). Worker processes plan
in their own interpreters: the training process only sends the lengths and decodes the plan.

Protocol (``python -m megatron_zeppelin.megatron.plans.plan_workers``, one per worker): the parent
writes pickles to the worker's stdin, first the ``PlanRecipe`` and then one list of lengths per
micro-batch; the worker answers ``"ready"`` once it has read the recipe (its imports done, and
the planner's compiled loops built where numba is installed: ``planner/loops/jit.py``), then
each micro-batch on its stdout, in order, with ``(plan's bytes, None, seconds)`` or
``(None, exception, seconds)``, the plan in its wire form (``planner/plan/plan_wire.py``); the
training process decodes the plan (or, sharing plans, hands the bytes on as they are:
``shared_plans.py``). The worker writes nothing else there (its
``print`` goes to stderr), plans one micro-batch at a time, and exits when its stdin closes:
when the training process closes the feed, or dies.

Planning is pure and deterministic: a worker's plan equals the one the training process would
make (``tests/test_plan_workers.py``), so every rank still plans the same plan without talking
to the others.
"""

from __future__ import annotations

import collections
import os
import pickle
import queue
import signal
import site
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_zeppelin.config import ZeppelinConfig, flag_of
from megatron_zeppelin.megatron.plans.reuse import RecentPlans
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.plan import plan_wire
from megatron_zeppelin.planner.plan.plan import Plan
from megatron_zeppelin.planner.search import partition
from megatron_zeppelin.topology.model import Topology

__all__ = ["PlanRecipe", "PlannerProcesses", "picklable"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def _site_packages() -> set[str]:
    """Where installed packages live: put first on a worker's path, such a directory would put
    every installed package before the standard library."""
    # An environment whose ``site`` lacks these (old virtualenvs) puts the root first.
    places = [*getattr(site, "getsitepackages", list)(), site.getusersitepackages()]
    return {str(Path(p).resolve()) for p in places}


@dataclass(frozen=True)
class PlanRecipe:
    """Everything a micro-batch's plan depends on besides its lengths; picklable, so a worker
    process plans exactly what the training process would. ``options``: the planner's
    (``config.planner_options``, made once per run), or ``None`` to derive them per plan."""

    topology: Topology
    cost_model: CostModel
    config: ZeppelinConfig
    options: Any = None
    recent: RecentPlans = field(default_factory=RecentPlans, compare=False, repr=False)
    """Plans of the last few length lists, handed out again where they repeat (``reuse.py``)."""

    def __call__(self, lengths: Sequence[int]) -> Plan:
        """The micro-batch's plan; every rank computes the same one from the same lengths."""
        return self.recent.plan(lengths, self._plan)

    def _plan(self, lengths: list[int]) -> Plan:
        config, options = self.config, self.options
        if options is None:
            options = config.planner_options(self.cost_model)
        # No capacity given: no limit, i.e. room for the whole micro-batch (with slack) on any GPU.
        capacity = config.capacity if config.capacity is not None else 2 * sum(lengths)
        return partition.plan_batch(  # through the module: tests stand in for the planner
            lengths,
            topology=self.topology,
            cost_model=self.cost_model,
            capacity=capacity,
            options=options,
        )


class _Worker:
    """One planner process, the futures of the micro-batches sent to it (answered in order),
    and the thread that reads its answers."""

    def __init__(
        self,
        recipe: PlanRecipe,
        index: int,
        on_seconds: Callable[[float], None],
        *,
        raw: bool = False,
    ) -> None:
        env = dict(os.environ)
        # The worker imports this package from where the training process did (a checkout it
        # was started from, or a path it was given; an installed package is found anyway), and
        # keeps its numpy to one thread (eight ranks of a node each have a worker).
        if _PACKAGE_ROOT not in _site_packages():
            path = [_PACKAGE_ROOT, env.get("PYTHONPATH")]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.index = index
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megatron_zeppelin.megatron.plans.plan_workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.pending: collections.deque[Future] = collections.deque()
        self._lock = threading.Lock()  # a send and the reader's "died" verdict do not interleave
        self._dead: str | None = None
        self._closing = False
        self.ready = threading.Event()  # set once the worker can plan, or has died
        self._on_seconds = on_seconds
        self._raw = raw
        self._send(recipe)
        self._reader = threading.Thread(
            target=self._read, name=f"zeppelin-planner-reader-{index}", daemon=True
        )
        self._reader.start()

    def submit(self, lengths: list[int]) -> Future:
        future: Future = Future()
        with self._lock:
            if self._dead is None:
                self.pending.append(future)
                if self._send(lengths):
                    return future
                self.pending.pop()
            future.set_exception(RuntimeError(self._dead))
        return future

    def _send(self, message: Any) -> bool:
        try:
            pickle.dump(message, self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.process.stdin.flush()  # type: ignore[union-attr]
            return True
        except (BrokenPipeError, OSError, ValueError):
            self._dead = self._death()
            return False

    def _read(self) -> None:
        stream = self.process.stdout
        try:
            ready = pickle.load(stream) == "ready"  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - the worker died while starting
            ready = False
        self.ready.set()
        while ready:
            try:
                blob, error, seconds = pickle.load(stream)  # type: ignore[arg-type]
            except Exception:  # noqa: BLE001 - end of stream, or a worker killed mid-answer
                break
            self._on_seconds(seconds)
            future = self.pending.popleft()
            if future.cancelled():
                continue
            if error is None and not self._raw:
                try:
                    blob = plan_wire.decode(blob)
                except ValueError as exc:  # a payload cut short: fails its micro-batch
                    error = exc
            try:
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(blob)
            except InvalidStateError:  # cancelled by the training thread meanwhile
                pass
        with self._lock:
            self._dead = self._death()
            while self.pending:
                future = self.pending.popleft()
                if not future.done():
                    future.set_exception(RuntimeError(self._dead))

    def _death(self) -> str:
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if self._closing:
            return "the planner processes were closed"
        if code is None:
            how = "stopped answering"
        elif code == -signal.SIGKILL:
            how = "was killed by signal 9 (out of memory?)"
        elif code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code} (its error is on this process's stderr)"
        return (
            f"planner process {self.index} (pid {self.process.pid}) {how} while micro-batches "
            f"were being planned in it; plan in the training process with "
            f"{flag_of('plan_workers')} 0"
        )

    def close(self) -> None:
        self._closing = True
        try:
            self.process.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        if self.process.poll() is None:
            self.process.terminate()  # a plan in progress is not waited for: it is dropped
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class PlannerProcesses:
    """``workers`` planner processes; ``submit(lengths)`` gives a ``Future`` of the plan (with
    ``raw``, of its bytes, ``plan_wire.encode``), raising the planner's own exception where
    planning fails, or a ``RuntimeError`` naming the process where a worker dies. Micro-batches
    go to the workers in turn; ``on_seconds`` is called (from a reader thread) with each plan's
    planning time."""

    def __init__(
        self,
        recipe: PlanRecipe,
        workers: int,
        on_seconds: Callable[[float], None],
        *,
        raw: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"planner processes must be >= 1, got {workers}")
        try:
            pickle.dumps(recipe)  # here, not in a worker's pipe
        except Exception as exc:  # noqa: BLE001 - any reason pickle gives
            raise TypeError(
                f"planner processes plan from a picklable recipe (a PlanRecipe), not "
                f"{recipe!r} ({exc}); plan in a thread instead (workers=0)"
            ) from None
        self._workers = [_Worker(recipe, i, on_seconds, raw=raw) for i in range(workers)]
        self._next = 0

    def submit(self, lengths: list[int]) -> Future:
        worker = self._workers[self._next]
        self._next = (self._next + 1) % len(self._workers)
        return worker.submit(lengths)

    def wait_ready(self) -> None:
        """Until every worker can plan (or has died: its micro-batches then fail)."""
        for worker in self._workers:
            worker.ready.wait()

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        for worker in self._workers:
            worker.close()


def _serve(inbox: Any, outbox: Any) -> None:
    """The worker's loop (module docstring): a thread drains stdin into a queue, so the
    training process never blocks on a full pipe while a plan is being made."""
    jobs: queue.SimpleQueue = queue.SimpleQueue()

    def drain() -> None:
        while True:
            try:
                jobs.put(pickle.load(inbox))
            except EOFError:  # stdin closed: the training process is done
                jobs.put(None)
                return
            except Exception as exc:  # noqa: BLE001 - raised by the loop below, exit code 1
                jobs.put(exc)
                return

    def next_job() -> Any:
        job = jobs.get()
        if isinstance(job, Exception):
            raise job
        return job

    threading.Thread(target=drain, daemon=True).start()
    recipe = next_job()
    if recipe is None:
        return
    partition.warm()  # the planner's compiled loops, where numba is, before the first plan
    pickle.dump("ready", outbox)
    outbox.flush()
    while (lengths := next_job()) is not None:
        start = time.perf_counter()
        try:
            blob = plan_wire.encode(recipe(lengths))
            answer = (blob, None, time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - handed to the training process
            answer = (None, picklable(exc), time.perf_counter() - start)
        pickle.dump(answer, outbox, protocol=pickle.HIGHEST_PROTOCOL)
        outbox.flush()


def picklable(exc: BaseException) -> BaseException:
    """``exc`` where it survives a round trip through pickle, else a ``RuntimeError`` with its
    type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def main() -> None:
    # Ctrl-C reaches the whole process group: the training process decides, the worker ends
    # with its stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    outbox = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nothing else may write the answers
    sys.stdout = sys.stderr
    _serve(sys.stdin.buffer, outbox)


if __name__ == "__main__":
    main()
