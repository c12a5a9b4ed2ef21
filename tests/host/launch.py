"""Launch ``python -m megatron_zeppelin.pretrain_gpt`` (or another entry point, such as the
test-only ``megatron_reference``) on N local gloo processes, as torchrun would (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), through the test-only CPU
adapter, and read back what Megatron logged."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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
    env = dict(os.environ)
    env.pop("ZEPPELIN_TEST_GRAD_DIR", None)
    if grad_dir is not None:
        grad_dir.mkdir(parents=True, exist_ok=True)
        env["ZEPPELIN_TEST_GRAD_DIR"] = str(grad_dir)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        CUDA_DEVICE_MAX_CONNECTIONS="1",  # Megatron asks for it with TP > 1, as on a GPU
        OMP_NUM_THREADS="1",
    )
    command = [
        sys.executable, str(HERE / "run_on_cpu.py"), "--ranks", str(world_size),
        "--log-dir", str(log_dir), "-m", module, *args,
    ]  # fmt: skip
    launcher_log = log_dir / "launcher.log"
    with open(launcher_log, "w") as out:
        proc = subprocess.Popen(
            command,
            cwd=log_dir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        returncode = -signal.SIGKILL
    finally:
        # Whatever the ranks left behind (Megatron's checkpoint writers, worker pools) goes too:
        # orphans would outlive the test holding half a GB each.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    logs = [log_dir / f"rank{r}.log" for r in range(world_size)]
    outputs = tuple(p.read_text() if p.exists() else "" for p in logs)
    return Run(returncode, outputs, launcher_log.read_text())


def finite(losses: dict[int, float]) -> bool:
    return bool(losses) and all(math.isfinite(v) for v in losses.values())
