"""A stalled peer never hangs a job: every collective the plugin issues is bounded by the
Zeppelin timeout, and the error names the rank that stalled with the step and the layer.

Tier: dist. Each trial is a fresh gloo world of 3 processes running what a training step runs
(the remap all-to-all of two layers, forward and backward, then the gradient all-reduce) in a
loop; one rank stops itself with SIGSTOP at a random moment, so the stop lands inside an
all-to-all, inside an all-reduce or between them (never inside a write to the progress board,
whose ``FileStore`` lock a stopped writer would keep: ``_stop_outside_board_writes``). Before
these bounds, 3 trials in 7 hung in the all-to-all until the process group's 30-minute timeout;
8 trials miss such a rate with probability (4/7)^8, about 1%. The harness's own bound is kept
far above the watch's, so a run that ends early ended through the watch.
"""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest
import torch
from test_comm_exchange import balanced_linear

from megatron_zeppelin.launch.ranks import DistributedRunError, run_distributed
from megatron_zeppelin.planner.plan.plan import Plan, SequencePlan, Tier, zigzag_spans
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.dist

WATCH_TIMEOUT_S = 2.0
HARNESS_TIMEOUT_S = 120.0  # start-up included; a hang would show as "still running after"
STALLED = 1
TRIALS = 8


def three_rank_plan() -> Plan:
    """Local documents on every rank and a token-balanced linear layout: the remap moves rows."""
    topo = Topology(num_nodes=1, gpus_per_node=3, nics_per_node=1)
    docs = [(30, 0), (6, 0), (12, 1), (20, 2), (2, 2)]
    sequences = tuple(
        SequencePlan(seq, length, Tier.LOCAL, (rank,), zigzag_spans(length, (rank,)))
        for seq, (length, rank) in enumerate(docs)
    )
    return Plan(topology=topo, sequences=sequences, linear=balanced_linear([d[0] for d in docs], 3))


def _stop_outside_board_writes(watch) -> None:  # noqa: ANN001
    """SIGSTOP this process, but not inside a write to the progress board: the harness's
    ``FileStore`` holds its file's lock during a write, so a process stopped there would block
    every other rank's read of the board (torchrun's ``TCPStore`` has no such lock; its host is
    not a worker). The board's own lock keeps the heartbeat thread out of the store meanwhile."""
    with watch.board._lock:
        os.kill(os.getpid(), signal.SIGSTOP)


def _stall_worker(rank: int, world_size: int, seed: int) -> str:
    from megatron_zeppelin.comm.remap import attention_to_linear, linear_to_attention
    from megatron_zeppelin.comm.watch import CommWatch
    from megatron_zeppelin.megatron.model.loss import finish_gradients

    watch = CommWatch.for_process_group(WATCH_TIMEOUT_S).start()
    plan = three_rank_plan()
    rows = plan.num_linear_tokens(rank)
    param = torch.nn.Parameter(torch.zeros(256))
    for step in range(100_000):
        if rank == STALLED and step == 1:
            # Timed from the end of the first step, whose first calls (imports, allocations)
            # can take longer than the delay on a loaded machine: a stop there would find the
            # rank at its step but in no layer yet.
            delay = random.Random(seed).uniform(0.05, 0.6)
            threading.Timer(delay, _stop_outside_board_writes, (watch,)).start()
        watch.at(step=step)
        for layer in (1, 2):
            x = torch.randn(rows, 16, requires_grad=True)
            y = linear_to_attention(x, plan, rank, None, watch=watch, layer=layer)
            attention_to_linear(y, plan, rank, None, watch=watch, layer=layer).sum().backward()
        param.grad = torch.ones_like(param)
        finish_gradients([param], 1, None, watch=watch)
    return "never stalled"


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_stalled_rank_is_named_with_its_step_and_layer(trial: int) -> None:
    with pytest.raises(DistributedRunError) as info:
        run_distributed(
            _stall_worker,
            3,
            timeout_s=HARNESS_TIMEOUT_S,
            comm_timeout_s=HARNESS_TIMEOUT_S,
            args=(trial,),
        )
    error = info.value
    text = str(error)
    assert "still running after" not in text, text  # the watch ended it, not the harness
    # The first cause: the stopped rank; then every other rank's bounded wait, naming it.
    assert error.rank == STALLED, text
    assert "was found stopped" in error.summary, error.summary
    survivors = [r for r in range(3) if r != STALLED]
    for rank in survivors:
        line = next(line for line in text.splitlines() if line.startswith(f"rank {rank} of 3"))
        assert "CommStallError" in line, line
        assert f"rank {STALLED} stopped responding" in line, line
        assert f"rank {rank} at step " in line, line
        # Where the stalled rank was: its step, and its layer when it was inside one.
        seen = line.split("last seen at ", 1)[1]
        assert seen.startswith("step "), line
        assert "layer " in seen or "all-reduce" in seen, line


# --- the harness that zeppelin verify and zeppelin check run on --------------------------------
def _killed_peer_worker(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))  # waits on the dead peer until gloo notices


def test_the_harness_names_a_killed_rank_before_the_ranks_it_took_down() -> None:
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_killed_peer_worker, 2, timeout_s=HARNESS_TIMEOUT_S, comm_timeout_s=10.0)
    assert info.value.rank == 1
    assert info.value.summary == "rank 1 of 2 was killed by SIGKILL", str(info.value)


def _stopped_peer_worker(rank: int, world_size: int) -> None:
    import time

    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(HARNESS_TIMEOUT_S)  # nobody waits on the stopped rank: only the harness sees it


def test_the_harness_names_a_stopped_rank_nobody_waits_on() -> None:
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_stopped_peer_worker, 2, timeout_s=HARNESS_TIMEOUT_S, comm_timeout_s=3.0)
    assert info.value.rank == 1
    assert "rank 1 of 2 was found stopped" in info.value.summary
    assert "still running after" not in str(info.value)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return sorted(int(p) for p in f.read().split())


def _spawned_workers(pid: int) -> list[int]:
    """The rank processes a command started, in start (rank) order: the children of its
    multiprocessing fork server (``launch.ranks``), or its spawned children."""
    found = []
    for child in _children(pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"forkserver" in cmdline:
            found.extend(_children(child))
        elif b"spawn_main" in cmdline:
            found.append(child)
    return found


def test_zeppelin_verify_names_a_stopped_rank_in_one_line(tmp_path) -> None:
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_zeppelin.cli",
            "verify",
            "--timeout",
            "5",
            "--tokens",  # enough that the ranks still work 2 s after they start (4096 did not)
            "16384",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + HARNESS_TIMEOUT_S
    while len(workers := _spawned_workers(proc.pid)) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    time.sleep(2.0)
    while True:  # listed again: a process listed 2 s ago may be gone (CI failed once on it)
        workers = _spawned_workers(proc.pid)
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        try:
            os.kill(workers[STALLED], signal.SIGSTOP)
            break
        except (IndexError, ProcessLookupError):
            time.sleep(0.1)
    out, err = proc.communicate(timeout=HARNESS_TIMEOUT_S)
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"zeppelin verify: error: rank {STALLED} of 4 "), err
    assert "stopped" in lines[0] and "Traceback" not in out + err
    with open(lines[0].rsplit(": ", 1)[1].rstrip(")")) as f:
        assert f"rank {STALLED} of 4" in f.read()
