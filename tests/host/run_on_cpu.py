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

``run_on_cpu.py --jobs FILE`` runs several such launches one after the other from one import
of torch and Megatron (``launch.launch_jobs``): a JSON list of ``{"ranks", "log_dir",
"module", "argv", "env"}``, each job's environment (its ``MASTER_PORT``, the probes) set in its
ranks only.
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


def _run_rank(rank: int, world_size: int, log_dir: str, module: str, argv: list[str]) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv = [module, *argv]
    cpu_adapter.install()
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


def _run_job(ranks: int, log_dir: str, module: str, argv: list[str], env: dict) -> int:
    """Fork ``ranks`` processes running ``module``; the first failing rank's exit status."""
    children = {}
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            os.environ.update(env)
            os._exit(_run_rank(rank, ranks, log_dir, module, argv))
        children[pid] = rank
    return _wait(children)


def _run_jobs(path: str) -> int:
    """Every job of a JSON file (``launch.launch_jobs``), one after the other; each job's exit
    status goes to ``LOG_DIR/exit_status``."""
    with open(path) as f:
        jobs = json.load(f)
    for job in jobs:
        code = _run_job(job["ranks"], job["log_dir"], job["module"], job["argv"], job["env"])
        with open(os.path.join(job["log_dir"], "exit_status"), "w") as f:
            f.write(str(code))
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--jobs"] and len(sys.argv) == 3:
        for name in PRELOAD:
            __import__(name)
        sys.stdout.flush()
        return _run_jobs(sys.argv[2])
    if "-m" not in sys.argv[1:-1]:
        raise SystemExit(
            "usage: run_on_cpu.py --ranks N --log-dir DIR -m MODULE ARGS... | --jobs FILE"
        )
    split = sys.argv.index("-m")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--log-dir", default=".")
    options = parser.parse_args(sys.argv[1:split])
    options.module, argv = sys.argv[split + 1], sys.argv[split + 2 :]
    for name in PRELOAD:
        __import__(name)
    sys.stdout.flush()
    return _run_job(options.ranks, options.log_dir, options.module, argv, {})


if __name__ == "__main__":
    sys.exit(main())
