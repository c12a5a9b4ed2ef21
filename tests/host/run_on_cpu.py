"""``python tests/host/run_on_cpu.py --ranks N --log-dir DIR -m MODULE ARGS...``: what torchrun
does on one node for ``python -m MODULE ARGS...``, on CPU, with the test-only adapter installed
in every rank (``cpu_adapter.py`` says what it changes and why), and the test-only probes the
environment asks for: the gradient dump of ``grad_dump.py`` (``ZEPPELIN_TEST_GRAD_DIR``), weights
drawn by name (``init_by_name.py``, ``ZEPPELIN_TEST_INIT_BY_NAME``).

Every rank runs MODULE as ``__main__`` exactly as ``python -m`` does, with ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE`` set, its output in ``DIR/rankR.log``. The ranks are forked
from one process that has already imported torch and Megatron: on two cores, importing them once
instead of once per rank saves most of a launch's start-up. Nothing distributed exists before
the fork; each rank creates its process group itself, as a launched process would. The exit
status is the first failing rank's; the others are then stopped.

``run_on_cpu.py --serve`` imports torch and Megatron once and then runs every launch a test
process asks for (``launch.py``), each forked afresh from that import: one JSON object a line on
stdin, ``{"ranks", "log_dir", "module", "argv", "env", "cwd"}``. For each it forks a leader in a
session of its own (so the client can stop the launch and all it started with one signal), that
answers its pid on stdout, writes what it prints to ``LOG_DIR/launcher.log``, runs the launch
with the job's environment (its ``MASTER_PORT``, the probes) and writes its exit status to
``LOG_DIR/exit_status``; nothing of one launch reaches the next. It ends when stdin closes.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import signal
import sys

import cpu_adapter  # next to this file: sys.path[0]
import grad_dump
import init_by_name

# Imported once before forking (what every rank imports first anyway).
PRELOAD = ("torch", "megatron.training.training", "megatron_zeppelin.megatron.hooks")


def _checkpoint_queue_forked() -> None:
    """Megatron's checkpoint writer keeps its results in a queue held by a multiprocessing
    Manager process, started at the first save with ``spawn``
    (``dist_checkpointing.strategies.filesystem_async.get_write_results_queue``): a fresh
    interpreter that imports the rank's main module, torch and Megatron, again, 15 to 25 s per
    rank on two busy cores. Here it is forked from the rank instead, as Megatron's own
    persistent checkpoint worker asks for it (``init_persistent_async_worker``:
    ``get_write_results_queue(mp_mode="fork")``): the same queue, the same files written."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    spawned = filesystem_async.get_write_results_queue

    def forked(mp_mode: str = "spawn"):  # noqa: ANN202 (Megatron's queue proxy)
        return spawned(mp_mode="fork")  # whichever method the caller named

    filesystem_async.get_write_results_queue = forked


def _run_rank(rank: int, world_size: int, log_dir: str, module: str, argv: list[str]) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv = [module, *argv]
    cpu_adapter.install()
    _checkpoint_queue_forked()
    grad_dump.install()  # only where ZEPPELIN_TEST_GRAD_DIR is set
    init_by_name.install()  # only where ZEPPELIN_TEST_INIT_BY_NAME is set
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _wait(children: dict[int, int]) -> int:
    """Wait for every rank; on the first failure stop the others. Returns that rank's code."""
    status = 0
    while children:
        pid, raw = os.wait()
        children.pop(pid, None)
        code = os.waitstatus_to_exitcode(raw)
        if code and not status:
            status = code
            for other in children:
                os.kill(other, signal.SIGKILL)
    return status


def _run_job(ranks: int, log_dir: str, module: str, argv: list[str]) -> int:
    """Fork ``ranks`` processes running ``module``; the first failing rank's exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            os._exit(_run_rank(rank, ranks, log_dir, module, argv))
        children[pid] = rank
    return _wait(children)


def _lead(job: dict) -> None:
    """A launch of ``--serve``, in the forked leader: never returns."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's, not the ranks'
        launcher = os.path.join(job["log_dir"], "launcher.log")
        log = os.open(launcher, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(job["cwd"])
        os.environ.update(job["env"])
        code = _run_job(job["ranks"], job["log_dir"], job["module"], job["argv"])
        status = os.path.join(job["log_dir"], "exit_status")
        with open(status + ".part", "w") as f:
            f.write(str(code))
        os.replace(status + ".part", status)
    finally:
        # Whatever the ranks left behind (Megatron's checkpoint queue, planner processes) goes
        # with the leader: they would outlive the launch holding memory.
        sys.stdout.flush()
        sys.stderr.flush()
        if os.getpgid(0) == os.getpid():  # never the server's group
            os.killpg(0, signal.SIGKILL)
        os._exit(code)


def _serve() -> int:
    """``--serve`` (the module docstring): one launch per line of stdin until it closes."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # leaders are reaped as they end
    for line in iter(sys.stdin.readline, ""):
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _lead(job)
        print(pid, flush=True)
    return 0


def main() -> int:
    if sys.argv[1:] == ["--serve"]:
        for name in PRELOAD:
            __import__(name)
        return _serve()
    if "-m" not in sys.argv[1:-1]:
        raise SystemExit("usage: run_on_cpu.py --ranks N --log-dir DIR -m MODULE ARGS... | --serve")
    split = sys.argv.index("-m")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--log-dir", default=".")
    options = parser.parse_args(sys.argv[1:split])
    options.module, argv = sys.argv[split + 1], sys.argv[split + 2 :]
    for name in PRELOAD:
        __import__(name)
    return _run_job(options.ranks, options.log_dir, options.module, argv)


if __name__ == "__main__":
    sys.exit(main())
