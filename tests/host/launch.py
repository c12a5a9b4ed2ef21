"""Launch ``python -m megatron_zeppelin.pretrain_gpt`` (or another entry point, such as the
test-only ``megatron_reference``) on N local gloo processes, as torchrun would (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), through the test-only CPU
adapter, and read back what Megatron logged. Every launch of a test process is forked from one
import of torch and Megatron (``run_on_cpu.py --serve``); ``launch_jobs`` runs several in a row
under one time limit."""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from grad_dump import GRAD_DIR
from init_by_name import INIT_BY_NAME

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Megatron's training_log line: "iteration        3/       4 | ... | lm loss: 4.789168E+00 |"
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([-+0-9.eEnaif]+) \|")
# evaluate_and_print_results: " validation loss at iteration 4 on test set | lm loss value: ..."
VALIDATION = re.compile(r" validation loss at (.+?) \| lm loss value: ([-+0-9.eEnaif]+) \|")
# "> number of parameters on (tensor, gtp_weight_remat, pipeline) model parallel rank (0, 0, 0): 8"
PARAMETERS = re.compile(r"number of parameters on .*? model parallel rank \([\d, ]+\): (\d+)")


@dataclass(frozen=True)
class Run:
    """What one launch printed: every rank's output, and the losses Megatron logged."""

    returncode: int
    outputs: tuple[str, ...]
    launcher: str = ""
    """What the launching process printed (its imports, a rank's exit)."""

    @property
    def losses(self) -> dict[int, float]:
        """Iteration -> ``lm loss``, from the last rank (Megatron's ``print_rank_last``), with
        ``--log-interval 1``.

        Megatron (core_v0.16.1 and 0.19, ``training_log``) prints a run's first iteration
        without resetting its running sums (``should_reset = not is_first_iteration``), so the
        second line shows the mean of the run's first two iterations; undone here."""
        logged = [(int(i), float(v)) for i, v in ITERATION.findall(self.outputs[-1])]
        if len(logged) >= 2:
            (_, first), (second_iteration, mean) = logged[:2]
            logged[1] = (second_iteration, 2 * mean - first)
        return dict(logged)

    @property
    def evaluations(self) -> dict[str, float]:
        """What each evaluation printed (last rank): ``lm loss`` by where Megatron evaluated,
        e.g. ``"iteration 2"`` (during training), ``"iteration 4 on validation set"`` and
        ``"iteration 4 on test set"`` (after it)."""
        return {where: float(v) for where, v in VALIDATION.findall(self.outputs[-1])}

    @property
    def num_parameters(self) -> int:
        """The parameter count Megatron prints for TP rank 0's model (rank 0's output)."""
        found = PARAMETERS.findall(self.outputs[0])
        assert found, self.tail()
        return int(found[0])

    def tail(self, chars: int = 4000) -> str:
        parts = [f"--- launcher ---\n{self.launcher[-chars:]}"]
        parts += [f"--- rank {r} ---\n{out[-chars:]}" for r, out in enumerate(self.outputs)]
        return "\n".join(parts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Job:
    """One launch: ``python -m MODULE ARGS`` (the plugin's entry point unless ``module`` says
    otherwise) on ``world_size`` processes, logs in ``log_dir``; with ``grad_dir`` every rank
    writes each iteration's gradients there (``grad_dump.py``); ``env``: more variables
    (``init_by_name.py``)."""

    args: list[str]
    world_size: int
    log_dir: Path
    grad_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    module: str = "megatron_zeppelin.pretrain_gpt"

    def environment(self) -> dict[str, str]:
        """This job's own variables: its rendezvous port, the probes it asks for."""
        env = {**self.env, "MASTER_PORT": str(_free_port())}
        if self.grad_dir is not None:
            self.grad_dir.mkdir(parents=True, exist_ok=True)
            env[GRAD_DIR] = str(self.grad_dir)
        return env


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    for probe in (GRAD_DIR, INIT_BY_NAME):  # only where a job asks for them
        env.pop(probe, None)
    env.update(
        MASTER_ADDR="127.0.0.1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        CUDA_DEVICE_MAX_CONNECTIONS="1",  # Megatron asks for it with TP > 1, as on a GPU
        OMP_NUM_THREADS="1",
    )
    return env


class _Server:
    """This test process's ``run_on_cpu.py --serve``: torch and Megatron imported once, every
    launch forked from that import (on two cores the import is most of a small launch).
    Started at the first launch, stopped when the test process exits, and started again if it
    ever ended."""

    def __init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="run_on_cpu-", suffix=".log", delete=False)
        command = [sys.executable, str(HERE / "run_on_cpu.py"), "--serve"]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env=_environment(), text=True, start_new_session=True,
        )  # fmt: skip
        atexit.register(self.stop)

    def start(self, request: dict, timeout_s: float) -> int:
        """Send one launch; the pid of its leader (the first launch waits for the import)."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        answer = self.process.stdout.readline() if ready else ""
        if not answer.strip().isdigit():
            self.stop()
            log = Path(self.log.name).read_text() if Path(self.log.name).exists() else ""
            raise RuntimeError(f"run_on_cpu.py --serve gave no launch (its output:)\n{log[-4000:]}")
        return int(answer)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        Path(self.log.name).unlink(missing_ok=True)


_server: _Server | None = None


def _start(job: Job, timeout_s: float) -> int:
    """Start ``job`` on this test process's server; the pid of its leader."""
    global _server
    if _server is None or not _server.alive():
        _server = _Server()
    job.log_dir.mkdir(parents=True, exist_ok=True)
    (job.log_dir / "exit_status").unlink(missing_ok=True)
    request = {
        "ranks": job.world_size,
        "log_dir": str(job.log_dir),
        "cwd": str(job.log_dir),
        "module": job.module,
        "argv": job.args,
        "env": job.environment(),
    }
    return _server.start(request, timeout_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _finish(job: Job, leader: int, deadline: float) -> Run:
    """Wait for ``job`` to end (its leader writes ``exit_status``); past ``deadline`` kill it and
    all it started, so a hang fails the test instead of stalling it (``-SIGKILL``)."""
    status = job.log_dir / "exit_status"
    while not status.exists() and _alive(leader):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader, signal.SIGKILL)
            break
        time.sleep(0.05)
    code = int(status.read_text()) if status.exists() else -signal.SIGKILL
    launcher = job.log_dir / "launcher.log"
    return _read(job, code, launcher.read_text() if launcher.exists() else "")


def _read(job: Job, returncode: int, launcher: str) -> Run:
    logs = [job.log_dir / f"rank{r}.log" for r in range(job.world_size)]
    outputs = tuple(p.read_text() if p.exists() else "" for p in logs)
    return Run(returncode, outputs, launcher)


def launch(
    args: list[str],
    *,
    world_size: int,
    log_dir: Path,
    timeout_s: float,
    grad_dir: Path | None = None,
    module: str = "megatron_zeppelin.pretrain_gpt",
) -> Run:
    """Run ``python -m MODULE ARGS`` on ``world_size`` processes (``run_on_cpu.py``; ``module``
    is the plugin's entry point unless given); kill them all when the time runs out, so a hang
    fails the test instead of stalling it. ``grad_dir``: every rank writes each iteration's
    gradients there (``grad_dump.py``)."""
    (run,) = launch_jobs([Job(args, world_size, log_dir, grad_dir, module=module)], timeout_s)
    return run


def launch_jobs(jobs: list[Job], timeout_s: float) -> list[Run]:
    """Run ``jobs`` one after the other; ``timeout_s`` bounds them all together, and a job the
    time cut short (or never started) reports ``-SIGKILL``."""
    deadline = time.monotonic() + timeout_s
    runs = []
    for job in jobs:
        left = deadline - time.monotonic()
        if left <= 0:
            runs.append(_read(job, -signal.SIGKILL, ""))
            continue
        runs.append(_finish(job, _start(job, left), deadline))
    return runs


def finite(losses: dict[int, float]) -> bool:
    return bool(losses) and all(math.isfinite(v) for v in losses.values())
