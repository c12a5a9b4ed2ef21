"""The CPU job on the way down: a killed or stalled worker, a killed launcher, Ctrl-C and a
diverging run each end the whole job promptly with one line per failed rank, the first cause
first, tracebacks only in the log file that line names, and a checkpoint that still loads.

Tier: dist (``zeppelin train`` as a separate process: 2 workers on one emulated node, a small
synthetic dataset, a checkpoint every step; faults come from outside, as signals), except the
in-process divergence check (threads: a one-rank gloo group).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_zeppelin import checkpoint

DEADLINE_S = 300.0
"""Generous bounds for slow shared machines: the job used to hang for 30 minutes."""


def _start(tmp_path, *flags: str) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "megatron_zeppelin.cli", "train", "--nproc", "2",
        "--zeppelin-nodes", "1", "--run-dir", str(tmp_path / "run"), "--quiet",
        "--dataset-tokens", "30000", "--tokens-per-step", "1024",
        "--zeppelin-max-document-length", "1024", "--steps", "400",
        "--save", str(tmp_path / "ckpt"), "--save-every", "1", *flags,
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_foreground,
    )


def _foreground() -> None:
    """SIGINT at its default, as in a terminal's foreground job (a background shell ignores it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _workers(pid: int) -> list[int]:
    """The launcher's children, in rank order (it starts them in order)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return sorted(int(p) for p in f.read().split())


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _wait_for_training(tmp_path, proc: subprocess.Popen) -> list[int]:
    """Block until the job has a complete checkpoint of step 1 or later; its workers."""
    latest = tmp_path / "ckpt" / "latest"
    deadline = time.monotonic() + DEADLINE_S
    while not latest.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the job never saved a checkpoint"
        time.sleep(0.2)
    return _workers(proc.pid)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=DEADLINE_S)
    return proc.returncode, out, err


def _assert_quiet(out: str, err: str) -> list[str]:
    """Every stderr line is one of ours; no traceback anywhere. The stderr lines."""
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, out + err
    assert "(its traceback is above)" not in err
    lines = err.strip().splitlines()
    assert lines and all(line.startswith("zeppelin train: ") for line in lines), err
    return lines


def _assert_checkpoint_loads(tmp_path) -> None:
    directory = checkpoint.resolve(str(tmp_path / "ckpt"))
    manifest = checkpoint.verify(directory)
    assert manifest.step >= 1 and manifest.world_size == 2
    assert checkpoint.load_rank_state(directory, 1)["step"] == manifest.step


@pytest.mark.dist
def test_a_killed_worker_is_one_line_and_no_survivor_tracebacks(tmp_path):
    proc = _start(tmp_path)
    workers = _wait_for_training(tmp_path, proc)
    os.kill(workers[1], signal.SIGKILL)
    code, out, err = _finish(proc)
    lines = _assert_quiet(out, err)
    assert code == 1
    assert lines[0] == (
        "zeppelin train: error: rank 1 was killed by SIGKILL (from outside: it left no traceback)"
    ), err
    assert all(_gone(pid) for pid in workers)
    _assert_checkpoint_loads(tmp_path)


@pytest.mark.dist
def test_a_killed_planner_process_is_named_in_one_line(tmp_path):
    proc = _start(tmp_path)
    workers = _wait_for_training(tmp_path, proc)
    # Plans are shared: the node's first rank has the one planner process, rank 1 none.
    planners = [_workers(pid) for pid in workers]
    assert [len(children) for children in planners] == [1, 0], planners
    killed = planners[0][0]
    with open(f"/proc/{killed}/cmdline") as f:
        assert "megatron_zeppelin.megatron.plans.plan_workers" in f.read()
    os.kill(killed, signal.SIGKILL)
    code, out, err = _finish(proc)
    lines = _assert_quiet(out, err)
    assert code == 1
    # Every rank raises it alike (those the launcher did not stop first): one line names them.
    assert lines == [lines[0]], err
    said = "RuntimeError: on Zeppelin rank 0, planner process 0 (pid {}) was killed by signal 9"
    assert any(
        lines[0].startswith(f"zeppelin train: error: {ranks}: {said.format(killed)}")
        for ranks in ("ranks 0, 1", "rank 0", "rank 1")
    ), err
    assert "--zeppelin-plan-workers 0" in lines[0]
    assert all(_gone(pid) for pid in workers)
    _assert_checkpoint_loads(tmp_path)


@pytest.mark.dist
def test_a_stalled_worker_ends_the_job_naming_it_with_step_and_layer(tmp_path):
    proc = _start(tmp_path, "--zeppelin-comm-timeout-s", "10")  # room for a loaded machine
    workers = _wait_for_training(tmp_path, proc)
    os.kill(workers[1], signal.SIGSTOP)
    code, out, err = _finish(proc)
    lines = _assert_quiet(out, err)
    assert code == 1
    assert lines[0].startswith(
        "zeppelin train: error: rank 1 stopped responding: its process was found stopped"
    ), err
    waiting = [line for line in lines if line.startswith("zeppelin train: error: rank 0: ")]
    assert waiting, err
    assert "rank 0 at step " in waiting[0] and "rank 1 stopped responding" in waiting[0]
    assert "last seen at step " in waiting[0] and "(log: " in waiting[0]
    assert all(_gone(pid) for pid in workers)
    _assert_checkpoint_loads(tmp_path)


@pytest.mark.dist
def test_killing_the_launcher_stops_its_workers(tmp_path):
    proc = _start(tmp_path)
    workers = _wait_for_training(tmp_path, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=DEADLINE_S)
    deadline = time.monotonic() + 60.0  # they watch their parent twice a second
    while not all(_gone(pid) for pid in workers):
        assert time.monotonic() < deadline, "workers kept running after their launcher died"
        time.sleep(0.2)
    _assert_checkpoint_loads(tmp_path)


@pytest.mark.dist
def test_ctrl_c_stops_the_job_quietly(tmp_path):
    proc = _start(tmp_path)
    workers = _wait_for_training(tmp_path, proc)
    os.kill(proc.pid, signal.SIGINT)  # what the terminal sends to the launcher
    code, out, err = _finish(proc)
    lines = _assert_quiet(out, err)
    assert code == 130 and lines == ["zeppelin train: interrupted"], err
    assert all(_gone(pid) for pid in workers)
    _assert_checkpoint_loads(tmp_path)


@pytest.mark.dist
def test_a_diverging_job_names_the_step_and_the_log_holding_the_traceback(tmp_path):
    proc = _start(tmp_path, "--lr", "1e30")
    code, out, err = _finish(proc)
    lines = _assert_quiet(out, err)
    assert code == 1
    # Every rank sees the same global loss: one line names the ranks that stopped on it.
    assert lines == [lines[0]], err
    assert lines[0].startswith(("zeppelin train: error: rank ", "zeppelin train: error: ranks ")), (
        err
    )
    assert ": step 1: the loss is" in lines[0], err
    with open(lines[0].rsplit("(log: ", 1)[1].rstrip(")")) as f:
        log = f.read()
    assert "Traceback" in log and "TrainingDiverged" in log
    # Nothing was saved from the diverged step: the last checkpoint is the one before it.
    assert checkpoint.verify(checkpoint.resolve(str(tmp_path / "ckpt"))).step == 1


@pytest.mark.threads
def test_a_non_finite_loss_stops_training_before_the_optimizer_uses_it(tmp_path, one_process_group):
    from megatron_zeppelin.job.synthetic import write_synthetic_dataset
    from megatron_zeppelin.job.train_cpu import build_parser, train
    from megatron_zeppelin.launch.worker import TrainingDiverged

    prefix = str(tmp_path / "docs")
    write_synthetic_dataset(prefix, lengths=[60, 40, 30, 50, 20, 70] * 4, vocab_size=512)
    args = build_parser().parse_args(
        [
            "--run-dir",
            str(tmp_path),
            "--dataset",
            prefix,
            "--quiet",
            "--no-calibration",
            "--steps",
            "4",
            "--tokens-per-step",
            "200",
            "--zeppelin-max-document-length",
            "100",
            "--zeppelin-nodes",
            "1",
            "--lr",
            "1e30",
            "--zeppelin-plan-workers",
            "0",  # this tier starts no process
            "--save",
            str(tmp_path / "ckpt"),
            "--save-every",
            "1",
        ]
    )
    with pytest.raises(TrainingDiverged, match=r"^step 1: the loss is (nan|inf)"):
        train(args)
    assert checkpoint.verify(checkpoint.resolve(str(tmp_path / "ckpt"))).step == 1


FINISHING_WORKER = """
import atexit, os, sys
from megatron_zeppelin.launch.worker import run_worker

def body(watch):
    # Stands for the interpreter's teardown stopping a helper thread inside a store or gloo
    # call, which can abort the process (std::terminate, SIGABRT) after the job is done.
    atexit.register(os.abort)
    print("trained", flush=True)

sys.exit(run_worker(body, comm_timeout_s=30.0))
"""


@pytest.mark.dist
def test_a_finished_worker_exits_0_without_the_interpreter_teardown(tmp_path):
    env = dict(
        os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
    )
    done = subprocess.run(
        [sys.executable, "-c", FINISHING_WORKER],
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "trained\n"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
