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
(``probes.py``), and writes every gradient after Megatron's ``finalize_model_grads``. The
optimizer is SGD: Adam's first steps move a weight by the learning rate whatever its gradient's
size, so a gradient that is zero up to float32 rounding (sums taken in another order) would
move a weight in one run and not in the other; SGD moves each weight by its gradient.

The three runs share one launcher (``launch.launch_jobs``): torch and Megatron are imported
once. Tier: host.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from launch import Job, Run, finite, launch_jobs
from probes import GRADIENTS, INIT_FROM_NAMES
from test_pretrain_loop import CAPACITY, MODEL, ON_CPU, ZEPPELIN, dataset, work  # noqa: F401

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
        data,
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
        gradients[name].mkdir()
        env = {GRADIENTS: str(gradients[name]), INIT_FROM_NAMES: "1"}
        args = _args(ranks, nodes, capacity, extra, dataset)
        jobs.append(Job(args, ranks, work / f"moe-{name}", env))
    done = launch_jobs(jobs, work_dir=work / "moe", timeout_s=TIMEOUT_S)
    return {name: (run, gradients[name]) for name, run in zip(RUNS, done)}


def _trained(run: Run) -> dict[int, float]:
    assert run.returncode == 0, run.tail()
    assert finite(run.losses) and sorted(run.losses) == list(range(1, ITERATIONS + 1)), run.tail()
    return run.losses


def _gradients(directory: Path, iteration: int) -> dict[int, dict[str, torch.Tensor]]:
    """Rank -> {global name: gradient} of one iteration."""
    found = {}
    for path in sorted(directory.glob(f"rank*-iter{iteration}.pt")):
        rank = int(path.name.split("-")[0][len("rank") :])
        found[rank] = torch.load(path)
    return found


def _assert_trains_as_one_process(runs, name: str) -> dict[int, dict[str, torch.Tensor]]:
    """Losses and every gradient of every iteration equal the reference's; returns the last
    iteration's gradients by rank."""
    (run, grads), (reference, reference_grads) = runs[name], runs["one"]
    expected = _trained(reference)
    losses = _trained(run)
    for iteration, loss in expected.items():
        assert abs(losses[iteration] - loss) <= TOLERANCE, (iteration, losses, expected)
    for iteration in range(1, ITERATIONS + 1):
        (ref,) = _gradients(reference_grads, iteration).values()
        by_rank = _gradients(grads, iteration)
        assert len(by_rank) == 4, sorted(grads.iterdir())
        merged = {}
        for rank_grads in by_rank.values():
            for key, grad in rank_grads.items():
                merged.setdefault(key, grad)
                # A parameter held by several ranks has the same (all-reduced) gradient on each.
                torch.testing.assert_close(grad, merged[key], rtol=0, atol=0, msg=key)
        assert sorted(merged) == sorted(ref), "the runs hold different parameters"
        for key, grad in merged.items():
            error = float((grad - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-30))
            assert error <= TOLERANCE, (iteration, key, error)
    return by_rank


def _summary(run: Run) -> list[str]:
    return [line for line in run.outputs[0].splitlines() if line.startswith("zeppelin: ")]


def test_moe_with_ep1_trains_as_one_process(runs) -> None:
    _assert_trains_as_one_process(runs, "ep1")
    reference_grads = _gradients(runs["one"][1], 1)[0]
    experts = {m.group(1) for key in reference_grads for m in [LOCAL_EXPERT.search(key)] if m}
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
    by_rank = _assert_trains_as_one_process(runs, "ep2")
    # Expert parallelism 2: ranks 0 and 2 hold experts 0 and 1, ranks 1 and 3 experts 2 and 3.
    for rank, grads in by_rank.items():
        held = {int(m.group(1)) for key in grads for m in [LOCAL_EXPERT.search(key)] if m}
        assert held == ({0, 1} if rank % 2 == 0 else {2, 3}), (rank, held)
    summary = _summary(runs["ep2"][0])
    assert any("MoE 4 experts, top-2, EP 2 (alltoall dispatcher" in line for line in summary)
