"""A gloo harness: run a function on N CPU processes that form one process group.

``run_distributed(fn, world_size, timeout_s=...)`` starts ``world_size`` fresh Python processes
(forked from a clean fork server, so no state leaks from the parent), joins them into a gloo
process group over a ``FileStore`` in a temporary directory, calls ``fn(rank, world_size,
*args)`` on each and returns the list of results by rank. A rank that raises makes the parent
raise ``DistributedRunError`` naming that rank with its traceback; ranks still running when
``timeout_s`` has passed are killed, so a hang fails instead of stalling a test suite.

Faults end a run early, and the error names the first cause first: a rank that died without a
result (killed by a signal, say) or stopped responding (no heartbeat for ``comm_timeout_s``: its
process stopped or hung) stops the run at once, before the ranks that were waiting on it. With
``comm_timeout_s`` the ranks' process group uses it as its timeout after start-up, so a
collective on a stalled peer ends after that long instead of the whole run's time.
``DistributedRunError.summary`` is the error in one line.

Results come back through pickle files rather than a multiprocessing queue: a queue would share
tensors through file descriptors that vanish when the child exits.

``fn`` must be importable by name from a fresh interpreter (a module-level function).
"""

from __future__ import annotations

import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_zeppelin.launch.standalone import process_stopped

__all__ = ["DistributedRunError", "run_distributed", "whole_run_timeout"]

FAILURE_GRACE_S = 3.0
BEAT_S = 0.25
"""How often a rank touches its heartbeat file."""


class DistributedRunError(RuntimeError):
    """A rank of ``run_distributed`` failed, died or overran its time. ``summary``: one line
    naming the first cause; the message adds every rank's traceback."""

    def __init__(self, message: str, rank: int | None = None, *, summary: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.summary = summary or message.splitlines()[0]

    def write_log(self, prefix: str) -> str:
        """Write every rank's story (tracebacks included) to a new file; its path."""
        fd, path = tempfile.mkstemp(prefix=f"{prefix}-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(str(self) + "\n")
        return path


def whole_run_timeout(comm_timeout_s: float) -> float:
    """A bound for a whole run whose operations are each bounded by ``comm_timeout_s``: start-up
    and many operations, so only a run that never ends meets it."""
    return max(10 * comm_timeout_s, 300.0)


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    result_dir: str,
    timeout_s: float,
    comm_timeout_s: float | None,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    outcome: dict[str, Any]
    _beat(os.path.join(result_dir, f"rank{rank}.beat"))
    try:
        # Several gloo processes on two cores: one intra-op thread each keeps them from fighting.

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend="gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        if comm_timeout_s is not None:  # start-up is over: collectives get the shorter bound
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=comm_timeout_s))
        outcome = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which re-raises
        # When it failed: the first rank to raise is the likeliest cause (the clock is the
        # machine's, the same for every process on it).
        outcome = {
            "ok": False,
            "error": repr(exc),
            "traceback": traceback.format_exc(),
            "at": time.monotonic(),
        }
    path = os.path.join(result_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(path + ".tmp", path)  # the parent never reads a half-written file
    if not outcome["ok"]:
        open(os.path.join(result_dir, f"rank{rank}.failed"), "w").close()
        # No teardown: a collective stuck on a stalled peer would hold destroy_process_group
        # until the group's timeout.
        os._exit(1)
    dist.destroy_process_group()


def _beat(path: str) -> None:
    """Touch ``path`` every ``BEAT_S`` from a helper thread: the parent's sign of life."""

    def beat() -> None:
        while True:
            with open(path, "w"):
                pass
            time.sleep(BEAT_S)

    threading.Thread(target=beat, daemon=True, name="harness-heartbeat").start()


@dataclass
class _Watch:
    """What the parent learns while it waits: who died, who stopped responding."""

    dead: dict[int, int] = field(default_factory=dict)
    """Rank -> exit code of a rank that ended without leaving a result."""
    silent: list[int] = field(default_factory=list)
    """Ranks whose heartbeat stopped for longer than the stall bound."""
    stopped: list[int] = field(default_factory=list)
    """Ranks found stopped by a signal when the run ended."""
    stopped_since: dict[int, float] = field(default_factory=dict)


def _failed(result_dir: str, world_size: int) -> bool:
    return any(
        os.path.exists(os.path.join(result_dir, f"rank{r}.failed")) for r in range(world_size)
    )


def _check(procs: list, result_dir: str, stall_s: float, seen: _Watch) -> bool:
    """Note dead and silent ranks; whether any rank failed, died or went silent."""
    now = time.time()
    for rank, p in enumerate(procs):
        has_result = os.path.exists(os.path.join(result_dir, f"rank{rank}.pkl"))
        if not p.is_alive() and not has_result and rank not in seen.dead:
            seen.dead[rank] = p.exitcode
        if not p.is_alive() or has_result or rank in seen.silent:
            continue
        beat = os.path.join(result_dir, f"rank{rank}.beat")
        if process_stopped(p.pid):  # stopped before its heartbeat began, say
            since = seen.stopped_since.setdefault(rank, now)
        else:
            seen.stopped_since.pop(rank, None)
            since = os.path.getmtime(beat) if os.path.exists(beat) else now
        if now - since > stall_s:
            seen.silent.append(rank)
    return bool(seen.dead or seen.silent) or _failed(result_dir, len(procs))


def _join(procs: list, result_dir: str, *, deadline: float, stall_s: float) -> _Watch:
    """Wait for every process until ``deadline``; once a rank has failed, died or gone silent,
    give the others only ``FAILURE_GRACE_S`` (they are most likely blocked on it)."""
    seen = _Watch()
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
        if _check(procs, result_dir, stall_s, seen):
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            if all(not p.is_alive() or process_stopped(p.pid) for p in procs):
                break  # nobody left who could still report
    seen.stopped = [r for r, p in enumerate(procs) if p.is_alive() and process_stopped(p.pid)]
    return seen


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"died without a result (exit code {code})"


_PRELOAD = ["megatron_zeppelin.launch.preload", "megatron_zeppelin.launch.ranks"]
"""What the fork server imports once (``launch/preload.py``)."""


def _context():  # noqa: ANN202
    """Processes forked from a clean server that has already imported torch: each rank starts
    in well under a second instead of importing torch anew, and still inherits nothing from the
    caller (the server never ran the caller's code)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout_s: float,
    comm_timeout_s: float | None = None,
    args: Sequence[Any] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return the results.

    ``timeout_s`` bounds the whole run, start-up (a few seconds to import torch) included, and is
    the process group's timeout unless ``comm_timeout_s`` is given (module docstring); a rank
    whose heartbeat stops for ``comm_timeout_s`` (default ``timeout_s``) ends the run.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if comm_timeout_s is not None and not comm_timeout_s > 0:
        raise ValueError(f"comm_timeout_s must be positive, got {comm_timeout_s}")
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="zeppelin-dist-") as tmp:
        store_path = os.path.join(tmp, "store")
        common = (store_path, tmp, timeout_s, comm_timeout_s, fn, tuple(args))
        procs = [
            ctx.Process(target=_worker, args=(rank, world_size, *common), daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        seen = _join(
            procs, tmp, deadline=time.monotonic() + timeout_s, stall_s=comm_timeout_s or timeout_s
        )
        stragglers = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes: list[dict[str, Any] | None] = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes.append(pickle.load(f))
            else:
                outcomes.append(None)
    _raise_first_cause(
        outcomes, seen, stragglers, world_size, timeout_s, comm_timeout_s or timeout_s
    )
    for rank, outcome in enumerate(outcomes):
        if outcome is None:
            raise DistributedRunError(
                f"rank {rank} of {world_size} {_exit_text(procs[rank].exitcode)}", rank
            )
    return [outcome["value"] for outcome in outcomes]  # type: ignore[index]


def _raise_first_cause(
    outcomes: list,
    seen: _Watch,
    stragglers: list[int],
    world_size: int,
    timeout_s: float,
    stall_s: float,
) -> None:
    """Raise ``DistributedRunError`` if the run failed: ranks that died or went silent first
    (the cause), then ranks that raised, the first to raise first (the others often fail
    because it did: a peer gone mid-handshake), then ranks that overran."""
    causes = [(r, f"rank {r} of {world_size} {_exit_text(code)}") for r, code in seen.dead.items()]
    causes += [
        (r, f"rank {r} of {world_size} was found stopped (SIGSTOP or a debugger) and was killed")
        for r in seen.stopped
        if r not in seen.dead
    ]
    causes += [
        (
            r,
            f"rank {r} of {world_size} stopped responding (no heartbeat for {stall_s:g} s: its "
            "process stopped or hung) and was killed",
        )
        for r in seen.silent
        if r not in seen.dead and r not in seen.stopped
    ]
    failed = [
        (rank, outcome) for rank, outcome in enumerate(outcomes) if outcome and not outcome["ok"]
    ]
    failed.sort(key=lambda item: item[1]["at"])  # stable: ties keep rank order
    raised = [
        (rank, f"rank {rank} of {world_size} raised {outcome['error']}", outcome["traceback"])
        for rank, outcome in failed
    ]
    if not causes and not raised:
        if stragglers:
            raise DistributedRunError(
                f"ranks {stragglers} of {world_size} were still running after {timeout_s:.0f} s "
                "and were killed (a hang or a missing peer)",
                stragglers[0],
            )
        return
    first_rank, summary = causes[0] if causes else raised[0][:2]
    details = [text for _, text in causes] + [f"{text}\n{tb}" for _, text, tb in raised]
    raise DistributedRunError("\n".join(details), first_rank, summary=" ".join(summary.split()))
