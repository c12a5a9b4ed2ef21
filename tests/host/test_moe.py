"""Mixture of experts with Zeppelin under megatron-core 0.19's real ``pretrain()``: the losses and
every gradient of every iteration equal the same global batches trained in one process.

The model of ``test_pretrain_loop.py`` with 4 experts in each layer (top-2, expert FFN 96, a
shared expert of 64, dropless, no auxiliary loss) trains 3 iterations on the same dataset:

* one process (the reference): every document whole on the one rank;
* 4 ranks, expert parallelism 1, Megatron's default all-gather dispatcher, every layer
  recomputed in the backward (``--recompute-granularity full``);
* 4 ranks, expert parallelism 2 (each rank holds 2 of the 4 experts of each layer and the
  all-to-all dispatcher sends tokens to them), core attention recomputed in the backward
  (``--recompute-granularity selective``: its remaps and rings run again).

Megatron draws expert weights per expert-parallel rank, so runs of different expert parallelism
would start from different models: every run draws each weight from its global name instead
(``init_by_name.py``), and writes every gradient after Megatron's ``finalize_model_grads``
(``grad_dump.py``). The
optimizer is SGD: Adam's first steps move a weight by the learning rate whatever its gradient's
size, so a gradient that is zero up to float32 rounding (sums taken in another order) would
move a weight in one run and not in the other; SGD moves each weight by its gradient.

The three runs go one after the other under one time limit (``launch.launch_jobs``). Tier: host.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from grad_dump import load_gradients
from init_by_name import INIT_BY_NAME
from launch import Job, Run, finite, launch_jobs
from test_pretrain_loop import CAPACITY, MODEL, ON_CPU, ZEPPELIN, work  # noqa: F401

pytestmark = pytest.mark.host

ITERATIONS = 3
TOLERANCE = 1e-5
TIMEOUT_S = 600.0
EXPERTS = 4
MOE = (
    f"--num-experts {EXPERTS} --moe-router-topk 2 --moe-ffn-hidden-size 96 "
    "--moe-shared-expert-intermediate-size 64"
).split()
TRAINING = (
    f"--micro-batch-size 1 --train-iters {ITERATIONS} --optimizer sgd --lr 0.1 --clip-grad 1.0 "
    "--eval-iters 0 --eval-interval 1000 --log-interval 1"
).split()
FULL_RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
RUNS = {
    # name: (ranks, nodes, capacity per GPU, extra flags)
    "one": (1, 1, 4 * CAPACITY, ""),
    "ep1": (4, 2, CAPACITY, FULL_RECOMPUTE),
    "ep2": (
        4,
        2,
        CAPACITY,
        "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
        "--recompute-granularity selective",
    ),
}
LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def _args(ranks: int, nodes: int, capacity: int, extra: str, data: str) -> list[str]:
    return [
        *MODEL,
        *MOE,
        *TRAINING,
        *ON_CPU,
        "--data-path",
        *data.split(),
        "--global-batch-size",
        str(2 * ranks),  # two micro-batches per step on every run
        *ZEPPELIN.format(nodes=nodes, capacity=capacity).split(),
        *extra.split(),
    ]


@pytest.fixture(scope="module")
def runs(work: Path, dataset: str) -> dict[str, tuple[Run, Path]]:  # noqa: F811
    jobs, gradients = [], {}
    for name, (ranks, nodes, capacity, extra) in RUNS.items():
        gradients[name] = work / f"moe-{name}-gradients"
        args = _args(ranks, nodes, capacity, extra, dataset)
        env = {INIT_BY_NAME: "1"}
        jobs.append(Job(args, ranks, work / f"moe-{name}", gradients[name], env))
    done = launch_jobs(jobs, TIMEOUT_S)
    return {name: (run, gradients[name]) for name, run in zip(RUNS, done)}


def _trained(run: Run) -> dict[int, float]:
    assert run.returncode == 0, run.tail()
    assert finite(run.losses) and sorted(run.losses) == list(range(1, ITERATIONS + 1)), run.tail()
    return run.losses


def _held(directory: Path, iteration: int) -> dict[int, set[str]]:
    """Rank -> the names of the parameters it holds, in the whole model (``grad_dump.py``)."""
    found = {}
    for path in sorted(directory.glob(f"rank*-iter{iteration}.pt")):
        rank = int(path.name.split("-")[0][len("rank") :])
        found[rank] = set(torch.load(path)["grads"])
    return found


def _assert_trains_as_one_process(runs, name: str) -> None:
    """Losses and every gradient of every iteration equal the reference's."""
    (run, grads), (reference, reference_grads) = runs[name], runs["one"]
    expected = _trained(reference)
    losses = _trained(run)
    for iteration, loss in expected.items():
        assert abs(losses[iteration] - loss) <= TOLERANCE, (iteration, losses, expected)
    for iteration in range(1, ITERATIONS + 1):
        ref = load_gradients(str(reference_grads), iteration, gated=True)
        got = load_gradients(str(grads), iteration, gated=True)
        assert sorted(got) == sorted(ref), "the runs hold different parameters"
        for key, grad in got.items():
            error = float((grad - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-30))
            assert error <= TOLERANCE, (iteration, key, error)


def _summary(run: Run) -> list[str]:
    return [line for line in run.outputs[0].splitlines() if line.startswith("zeppelin: ")]


def test_moe_with_ep1_trains_as_one_process(runs) -> None:
    _assert_trains_as_one_process(runs, "ep1")
    (reference_names,) = _held(runs["one"][1], 1).values()
    experts = {m.group(1) for key in reference_names for m in [LOCAL_EXPERT.search(key)] if m}
    assert experts == {str(e) for e in range(EXPERTS)}, "the reference has no experts"
    summary = _summary(runs["ep1"][0])
    assert any(
        line.startswith(
            "zeppelin: MoE 4 experts, top-2, EP 1 (allgather dispatcher, dropless) in 2 of 2 "
            "layers; the cost model prices each token's router, 2 expert FFNs of 96 and a "
            "shared FFN of 64"
        )
        for line in summary
    ), summary


def test_moe_with_ep2_trains_as_one_process(runs) -> None:
    _assert_trains_as_one_process(runs, "ep2")
    # Expert parallelism 2: ranks 0 and 2 hold experts 0 and 1, ranks 1 and 3 experts 2 and 3.
    by_rank = _held(runs["ep2"][1], ITERATIONS)
    assert sorted(by_rank) == [0, 1, 2, 3]
    for rank, names in by_rank.items():
        held = {int(m.group(1)) for key in names for m in [LOCAL_EXPERT.search(key)] if m}
        assert held == ({0, 1} if rank % 2 == 0 else {2, 3}), (rank, held)
    summary = _summary(runs["ep2"][0])
    assert any("MoE 4 experts, top-2, EP 2 (alltoall dispatcher" in line for line in summary)
