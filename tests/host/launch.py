"""Launch ``python -m megatron_zeppelin.pretrain_gpt`` (or another entry point, such as the
test-only ``megatron_reference``) on N local gloo processes, as torchrun would (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), through the test-only CPU
adapter, and read back what Megatron logged; ``launch_jobs`` runs several such launches from
one import of torch and Megatron."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
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
    """One launch of ``launch_jobs``: ``megatron_zeppelin.pretrain_gpt ARGS`` on ``world_size``
    processes, logs in ``log_dir``; with ``grad_dir`` every rank writes each iteration's
    gradients there (``grad_dump.py``); ``env``: more variables (``init_by_name.py``)."""

    args: list[str]
    world_size: int
    log_dir: Path
    grad_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

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


def _run(command: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float) -> int:
    """Run the launcher in its own session; kill it and all it started when the time runs out,
    so a hang fails the test instead of stalling it. Its output goes to ``cwd/launcher.log``."""
    with open(cwd / "launcher.log", "w") as out:
        proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -signal.SIGKILL
    finally:
        # Whatever the ranks left behind (Megatron's checkpoint writers, worker pools) goes too:
        # orphans would outlive the test holding half a GB each.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _read(log_dir: Path, world_size: int, returncode: int, launcher: str) -> Run:
    logs = [log_dir / f"rank{r}.log" for r in range(world_size)]
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
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, str(HERE / "run_on_cpu.py"), "--ranks", str(world_size),
        "--log-dir", str(log_dir), "-m", module, *args,
    ]  # fmt: skip
    job = Job(args, world_size, log_dir, grad_dir)
    env = {**_environment(), **job.environment()}
    returncode = _run(command, cwd=log_dir, env=env, timeout_s=timeout_s)
    return _read(log_dir, world_size, returncode, (log_dir / "launcher.log").read_text())


def launch_jobs(jobs: list[Job], *, work_dir: Path, timeout_s: float) -> list[Run]:
    """Run ``jobs`` one after the other from one launcher (``run_on_cpu.py --jobs``), which
    imports torch and Megatron once for all of them: on two cores that import is most of a
    small launch. ``timeout_s`` bounds them all together; a job the time cut short reports
    ``-SIGKILL``."""
    work_dir.mkdir(parents=True, exist_ok=True)
    plan = []
    for job in jobs:
        job.log_dir.mkdir(parents=True, exist_ok=True)
        (job.log_dir / "exit_status").unlink(missing_ok=True)
        plan.append(
            {
                "ranks": job.world_size,
                "log_dir": str(job.log_dir),
                "module": "megatron_zeppelin.pretrain_gpt",
                "argv": job.args,
                "env": job.environment(),
            }
        )
    (work_dir / "jobs.json").write_text(json.dumps(plan))
    command = [sys.executable, str(HERE / "run_on_cpu.py"), "--jobs", str(work_dir / "jobs.json")]
    _run(command, cwd=work_dir, env=_environment(), timeout_s=timeout_s)
    launcher = (work_dir / "launcher.log").read_text()
    runs = []
    for job in jobs:
        status = job.log_dir / "exit_status"
        code = int(status.read_text()) if status.exists() else -signal.SIGKILL
        runs.append(_read(job.log_dir, job.world_size, code, launcher))
    return runs


def finite(losses: dict[int, float]) -> bool:
    return bool(losses) and all(math.isfinite(v) for v in losses.values())
