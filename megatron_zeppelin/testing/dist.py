"""A gloo harness: run a function on N CPU processes that form one process group.

``run_distributed(fn, world_size, timeout_s=...)`` starts ``world_size`` fresh Python processes
(spawn, so no state leaks from the parent), joins them into a gloo process group over a
``FileStore`` in a temporary directory, calls ``fn(rank, world_size, *args)`` on each and returns
the list of results by rank. A rank that raises makes the parent raise ``DistributedRunError``
naming that rank with its traceback; ranks still running when ``timeout_s`` has passed are killed,
so a hang fails instead of stalling a test suite.

Results come back through pickle files rather than a multiprocessing queue: a queue would share
tensors through file descriptors that vanish when the child exits.

``fn`` must be importable by name from a fresh interpreter (a module-level function).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistributedRunError", "run_distributed"]

FAILURE_GRACE_S = 3.0


class DistributedRunError(RuntimeError):
    """A rank of ``run_distributed`` failed, died or overran its time."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    result_dir: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    outcome: dict[str, Any]
    try:
        # Several gloo processes on two cores: one intra-op thread each keeps them from fighting.
        import torch

        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend="gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            outcome = {"ok": True, "value": fn(rank, world_size, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which re-raises
        outcome = {"ok": False, "error": repr(exc), "traceback": traceback.format_exc()}
    path = os.path.join(result_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(path + ".tmp", path)  # the parent never reads a half-written file
    if not outcome["ok"]:
        open(os.path.join(result_dir, f"rank{rank}.failed"), "w").close()


def _failed(result_dir: str, world_size: int) -> bool:
    return any(
        os.path.exists(os.path.join(result_dir, f"rank{r}.failed")) for r in range(world_size)
    )


def _join(procs: list, result_dir: str, *, deadline: float) -> None:
    """Wait for every process until ``deadline``; once a rank has failed, give the others only
    ``FAILURE_GRACE_S`` (they are most likely blocked on the failed one)."""
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
        if _failed(result_dir, len(procs)):
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout_s: float,
    args: Sequence[Any] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return the results.

    ``timeout_s`` bounds the whole run, start-up (a few seconds to import torch) included; it is
    also the process group's timeout.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="zeppelin-dist-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, store_path, tmp, timeout_s, fn, tuple(args)),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        _join(procs, tmp, deadline=time.monotonic() + timeout_s)
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
    for rank, outcome in enumerate(outcomes):
        if outcome is not None and not outcome["ok"]:
            raise DistributedRunError(
                f"rank {rank} of {world_size} raised {outcome['error']}\n{outcome['traceback']}",
                rank,
            )
    if stragglers:
        raise DistributedRunError(
            f"ranks {stragglers} of {world_size} were still running after {timeout_s:.0f} s "
            "and were killed (a hang or a missing peer)",
            stragglers[0],
        )
    for rank, outcome in enumerate(outcomes):
        if outcome is None:
            code = procs[rank].exitcode
            raise DistributedRunError(
                f"rank {rank} of {world_size} died without a result (exit code {code})", rank
            )
    return [outcome["value"] for outcome in outcomes]  # type: ignore[index]
