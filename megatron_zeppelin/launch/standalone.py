"""Start N worker processes on this host as ``torchrun --standalone`` does, and end them together:
the launcher of ``zeppelin train``.

The launcher hosts the rendezvous store (a ``TCPStore``, which the workers join as torchrun's
workers join the agent's: ``TORCHELASTIC_USE_AGENT_STORE``) and starts every worker in a session
of its own with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...) and
``ZEPPELIN_LOG_DIR``. Then it watches them:

* every worker exits 0: done;
* one fails (a non-zero exit, a signal), or is found stopped (a ``T`` state in ``/proc``) for
  longer than ``stall_s``: the others get SIGTERM and, ``grace_s`` later, SIGKILL; a stopped
  worker gets SIGKILL at once (SIGTERM would wait for it to be continued);
* the launcher itself is interrupted (Ctrl-C, SIGTERM): the same, and the result says so.

Each worker's stderr goes to its log file (``LOG_DIR/rankNNN.log``; ``verbose`` keeps it on the
terminal), so third-party noise and tracebacks stay out of the way; stdout (rank 0's progress)
stays on the terminal. Workers in sessions of their own do not see the terminal's Ctrl-C: they
watch the launcher instead (``launch.worker``) and stop within a second when it dies.

``launch`` returns a ``LaunchResult``: per rank a ``RankEnd`` (exit code, whether it was found
stopped, whether the launcher ended it, what it reported), and whether it was interrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from megatron_zeppelin.launch.worker import LOG_DIR_ENV, Outcome, log_path, read_outcome

__all__ = ["LaunchResult", "RankEnd", "launch", "process_stopped"]

GRACE_S = 3.0
POLL_S = 0.1


@dataclass
class RankEnd:
    """How one worker ended."""

    rank: int
    pid: int
    exit_code: int | None = None
    """The process's status (negative: the signal that ended it); ``None`` while it runs."""
    ended_at: float | None = None
    """``time.time()`` when the launcher saw it end."""
    stopped: bool = False
    """Found stopped (SIGSTOP, a debugger) while the launcher waited or shut the job down."""
    ended_by_launcher: bool = False
    outcome: Outcome | None = None
    log: str = ""


@dataclass
class LaunchResult:
    ends: list[RankEnd]
    log_dir: str
    interrupted: bool = False
    failures: list[RankEnd] = field(default_factory=list)
    """Ranks that failed on their own (not ended by the launcher), in the order seen."""

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(e.exit_code == 0 for e in self.ends)


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (Linux ``/proc``; ``False`` elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def launch(
    module: str,
    argv: list[str],
    *,
    nproc: int,
    log_dir: str,
    verbose: bool = False,
    env: dict[str, str] | None = None,
    stall_s: float = 600.0,
    grace_s: float = GRACE_S,
) -> LaunchResult:
    """Run ``python -m module *argv`` on ``nproc`` workers and wait (module docstring)."""

    os.makedirs(log_dir, exist_ok=True)
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        nproc,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=max(stall_s, 300.0)),
    )
    procs: list[subprocess.Popen] = []
    result = LaunchResult([], log_dir)
    previous = _on_sigterm_interrupt()
    try:
        for rank in range(nproc):
            proc = _start(module, argv, rank, nproc, store.port, log_dir, verbose, env or {})
            procs.append(proc)
            result.ends.append(RankEnd(rank, proc.pid, log=log_path(log_dir, rank)))
        _watch(procs, result, stall_s)
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        _end_all(procs, result, grace_s)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for end in result.ends:
            end.outcome = read_outcome(log_dir, end.rank)
    return result


def _start(
    module: str,
    argv: list[str],
    rank: int,
    nproc: int,
    port: int,
    log_dir: str,
    verbose: bool,
    extra: dict[str, str],
) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(extra)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            LOG_DIR_ENV: log_dir,
        }
    )
    stderr = None if verbose else open(log_path(log_dir, rank), "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            env=env,
            stdin=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    finally:
        if stderr is not None:
            stderr.close()  # the child holds its own copy


def _watch(procs: list[subprocess.Popen], result: LaunchResult, stall_s: float) -> None:
    """Wait until every worker ended or one failed (exit, signal, stopped too long)."""
    stopped_since: dict[int, float] = {}
    while True:
        running = 0
        for end, proc in zip(result.ends, procs):
            if end.exit_code is not None:
                continue
            code = proc.poll()
            if code is None:
                running += 1
                if process_stopped(proc.pid):
                    since = stopped_since.setdefault(end.rank, time.monotonic())
                    if time.monotonic() - since > stall_s:
                        end.stopped = True
                        result.failures.append(end)
                        return
                else:
                    stopped_since.pop(end.rank, None)
                continue
            end.exit_code, end.ended_at = code, time.time()
            if code != 0:
                result.failures.append(end)
                return
        if not running:
            return
        time.sleep(POLL_S)


def _end_all(procs: list[subprocess.Popen], result: LaunchResult, grace_s: float) -> None:
    """SIGTERM every worker still running (SIGKILL a stopped one), SIGKILL what is left after
    ``grace_s``; record how each ended."""
    live = [(end, proc) for end, proc in zip(result.ends, procs) if proc.poll() is None]
    for end, proc in live:
        end.ended_by_launcher = True
        if process_stopped(proc.pid):
            end.stopped = True
            _signal(proc, signal.SIGKILL)
        else:
            _signal(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for _, proc in live:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL)
            proc.wait()
    for end, proc in zip(result.ends, procs):
        if end.exit_code is None:
            end.exit_code, end.ended_at = proc.wait(), time.time()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _on_sigterm_interrupt():
    """While launching, SIGTERM to the launcher stops the job like Ctrl-C; the old handler."""

    def interrupt(signum, frame):  # noqa: ANN001 - the signal module's signature
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        return None
