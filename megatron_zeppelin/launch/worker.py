"""How a worker of the CPU job starts and ends: a bounded start-up, an eye on its launcher, and
one outcome per rank instead of a traceback per rank.

* **Start-up.** The gloo process group starts with ``start_timeout_s`` (processes finish
  importing unevenly); the job's collectives then go through a ``comm.watch.CommWatch`` bounded
  by ``--zeppelin-comm-timeout-s``, whose heartbeat publishes this rank's progress.
* **The launcher.** A helper thread watches the parent process; when it is gone (SIGKILL
  included) the worker stops within a second instead of training on for the process group's
  timeout. SIGTERM and SIGINT end a worker at once and quietly (their default action): the
  launcher stops a job with SIGTERM, and the terminal's Ctrl-C reaches only the launcher.
* **The end.** 0 when the job finished: the worker closes its heartbeat and the process group,
  then leaves through ``os._exit`` too, since the interpreter's own teardown would stop the
  helper threads (heartbeat, launcher watch, planner) wherever they are, inside a store or
  gloo call included, and that can abort a worker whose job is done. Otherwise the worker
  classifies what stopped it (bad input, a stalled or lost peer, a diverged run, a bug), writes
  the full traceback to its log file (``$ZEPPELIN_LOG_DIR/rankNNN.log``) and one ``Outcome``
  (``rankNNN.json``) for the launcher to report as one line, and leaves without tearing the
  process group down (a collective stuck on a stalled peer would hold that up). Under plain
  torchrun (no log directory) the first worker to fail prints the line itself.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.watch import CommWatch, is_comm_failure
from megatron_zeppelin.fileio import atomic_write_text

LOG_DIR_ENV = "ZEPPELIN_LOG_DIR"
"""Set by the launcher: where each rank leaves its log and its outcome."""
USER_ERROR_EXIT = 2
"""Exit status of a worker stopped by bad input (the message says what to change)."""
FAILURE_EXIT = 1
PARENT_POLL_S = 0.5


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite; the message names the step."""


def check_finite(step: int, loss: float, params: Iterable[torch.nn.Parameter]) -> None:
    """Raise ``TrainingDiverged`` before the optimizer takes a step from a non-finite loss or
    gradient (the loss is global; the gradients are this rank's, summed over its peers)."""
    norms = [p.grad.norm() for p in params if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
    if not (math.isfinite(loss) and math.isfinite(norm)):
        raise TrainingDiverged(
            f"step {step}: the loss is {loss:g} and the gradient norm {norm:g}: training stopped "
            "before the optimizer used them; lower --lr (or check the data) and resume from the "
            "last checkpoint"
        )


@dataclass(frozen=True)
class Outcome:
    """Why a rank stopped, in one line. ``kind``: input, comm, diverged, launcher or bug."""

    rank: int
    kind: str
    message: str
    exit_code: int
    time: float
    log: str | None = None


def log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank:03d}.log")


def outcome_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank:03d}.json")


def read_outcome(log_dir: str, rank: int) -> Outcome | None:
    try:
        with open(outcome_path(log_dir, rank)) as f:
            return Outcome(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def start_timeout_s(comm_timeout_s: float) -> float:
    """Bound of the start-up rendezvous: processes start unevenly, so never below two minutes."""
    return max(comm_timeout_s, 120.0)


def run_worker(
    body: Callable[[CommWatch], object], *, comm_timeout_s: float, backend: str = "gloo"
) -> int:
    """Run ``body(watch)`` as one rank of the job (see the module docstring). Never returns: the
    worker leaves through ``os._exit`` with its exit status, after reporting a failure."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    rank = int(os.environ.get("RANK", "0"))
    _watch_parent(rank)
    watch = None
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=start_timeout_s(comm_timeout_s)))
        watch = CommWatch.for_process_group(comm_timeout_s).start()
        body(watch)
    except BaseException as exc:  # noqa: BLE001 - every way out is reported, then we leave
        _leave(report_failure(exc, rank, watch))
    watch.close()
    dist.destroy_process_group()
    _leave(0)
    return 0  # not reached


def report_failure(exc: BaseException, rank: int, watch: CommWatch | None) -> int:
    """Report why this rank stops (module docstring: an outcome for the launcher, else one line
    from the first rank to fail); its exit status."""
    if is_comm_failure(exc) and watch is not None:
        exc = watch.explain(exc)  # names the rank that stalled, with this rank's step and layer
    kind, code = _classify(exc)
    message = " ".join(str(exc).split()) or type(exc).__name__
    if kind == "bug":
        message = f"{type(exc).__name__}: {message}"
    if watch is not None:  # peers diagnosing their own timeout read this note
        watch.close("failed", note="it lost a peer too" if kind == "comm" else message[:200])
    log_dir = os.environ.get(LOG_DIR_ENV)
    if log_dir is None:
        _print_once(kind, message, exc)
        return code
    log = log_path(log_dir, rank)
    with open(log, "a") as f:
        f.write(f"--- rank {rank} stopped ({kind}) ---\n")
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=f)
    outcome = Outcome(rank, kind, message, code, time.time(), log)
    atomic_write_text(outcome_path(log_dir, rank), json.dumps(asdict(outcome)))
    return code


def _classify(exc: BaseException) -> tuple[str, int]:
    if isinstance(exc, TrainingDiverged):
        return "diverged", FAILURE_EXIT
    if is_comm_failure(exc):
        return "comm", FAILURE_EXIT
    if isinstance(exc, ValueError):
        return "input", USER_ERROR_EXIT
    return "bug", FAILURE_EXIT


def _print_once(kind: str, message: str, exc: BaseException) -> None:
    """Without a launcher of ours: the first rank to fail prints the line (it claims the report
    in the process group's store; rank 0 when there is no store), a bug its traceback too."""
    first = os.environ.get("RANK", "0") == "0"
    if dist.is_initialized():
        try:
            store = dist.distributed_c10d._get_default_store()
            first = store.add("zeppelin/error_reports", 1) == 1
        except Exception:  # noqa: BLE001 - no store to ask: rank 0 speaks
            pass
    if not first:
        return
    if kind == "bug":
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(f"zeppelin train: error: {message}", file=sys.stderr, flush=True)


def _leave(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _watch_parent(rank: int) -> None:
    """Stop this worker within ``PARENT_POLL_S`` once its launcher is gone (it is re-parented)."""
    parent = os.getppid()
    if parent <= 1:
        return  # started without a launcher to watch

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        message = f"rank {rank}: the launcher (pid {parent}) is gone; stopping"
        log_dir = os.environ.get(LOG_DIR_ENV)
        try:
            if log_dir is not None:
                outcome = Outcome(rank, "launcher", message, FAILURE_EXIT, time.time())
                atomic_write_text(outcome_path(log_dir, rank), json.dumps(asdict(outcome)))
            print(message, file=sys.stderr, flush=True)
        finally:
            os._exit(FAILURE_EXIT)

    threading.Thread(target=watch, daemon=True, name="zeppelin-parent-watch").start()
