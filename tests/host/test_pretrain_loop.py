"""``python -m megatron_zeppelin.pretrain_gpt`` runs Megatron-LM's real ``pretrain()``
(megatron-core 0.19) on 4 gloo processes emulating 2 nodes x 2 GPUs, and trains exactly as one
process does.

A tiny GPT (2 layers, hidden 64, dropout 0, weights drawn on CPU from the seed, so every
tensor-parallel size starts from the same model) trains a few iterations on a blend of two
datasets written by ``zeppelin make-dataset`` (``conftest.py``; ``--data-path 0.3 A 0.7 B
--split 8,1,1``), and evaluates every 2 iterations, after training and on the test split. Every
run's sampler sees the same micro-batch budget (4 x 64 tokens), so every run trains and
evaluates the same global batches of the same documents:

* one process (the reference): every document whole on the one rank;
* TP 1 on 4 ranks, 64 tokens per GPU: a node holds 128 tokens, so longer documents ring across
  nodes, and some micro-batches hold a single document (fewer documents than ranks);
* TP 2 with sequence parallelism on 4 ranks: 2 Zeppelin ranks of 128 tokens, one per node.

Every iteration's loss, and every validation and test loss Megatron prints, must be finite and
equal the reference's within 1e-5. The TP 1 run saves a checkpoint at iteration 2 (what a run
killed after iteration 2 leaves on disk); new processes ``--load`` it, and their iterations 3 and
4, and the evaluations after them, must equal the uninterrupted run's: the sampler state saved
beside the checkpoint covers both datasets of the blend, and the validation stream continues
where Megatron's count of consumed validation samples says.

Tier: host. The processes run through ``run_on_cpu.py`` (the test-only ``cpu_adapter``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launch import Run, finite, launch

pytestmark = pytest.mark.host

# The model's vocabulary pads to 256 at TP 1 and TP 2 alike, in 0.19 (NullTokenizer: 200 ids) and
# core_v0.16.1 (201: it adds an end-of-document id), so every run builds the same model.
MODEL_VOCAB = 200
CAPACITY = 64  # tokens per GPU in the TP 1 run: 4 GPUs hold a 256-token micro-batch
ITERATIONS = 4
SAVE_AT = 2
TIMEOUT_S = 420.0
TOLERANCE = 1e-5
EVAL_INTERVAL = 2

MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --swiglu "
    "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
    f"--vocab-size {MODEL_VOCAB} --make-vocab-size-divisible-by 128 --tokenizer-type NullTokenizer "
    "--seq-length 256 --max-position-embeddings 1024 --use-cpu-initialization --seed 1234"
).split()
TRAINING = (
    f"--micro-batch-size 1 --train-iters {ITERATIONS} --lr 1e-3 --clip-grad 1.0 "
    f"--eval-iters 1 --eval-interval {EVAL_INTERVAL} --split 8,1,1 --log-interval 1"
).split()
# What Megatron evaluates in a run of 4 iterations: during training, then after it.
EVALUATIONS = ["iteration 2", "iteration 4", "iteration 4 on validation set"]
TEST = "iteration 4 on test set"
# Megatron on CPU: no Apex / TransformerEngine kernels, gloo, no loader workers (see cpu_adapter).
ON_CPU = (
    "--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm "
    "--distributed-backend gloo --num-workers 0"
).split()
ZEPPELIN = (
    "--zeppelin --zeppelin-kernel torch --zeppelin-topology custom --zeppelin-nodes {nodes} "
    "--zeppelin-capacity {capacity} --zeppelin-max-document-length 256 --zeppelin-log-plan-every 1"
)
# A plan line: "zeppelin micro-batch step 3: plan e33f95bd 1 docs (local 0, intra 0, inter 1); ..."
PLAN = re.compile(r"zeppelin micro-batch step \d+: plan \w+ (\d+) docs \(.*?inter (\d+)\)")
# "zeppelin planning: 8 plans taken, 6 made here (ahead included) in 0.29 s, the others
# received; training waited 0.04 s for plans; planner ..." (rank 0 plans node 0's turn)
PLANNING = re.compile(
    r"zeppelin planning: (\d+) plans taken, \d+ made here \(ahead included\) in [\d.]+ s, the "
    r"others received; training waited [\d.]+ s for plans; planner processes started in [\d.]+ s"
)


def _args(*, ranks: int, tp: int, nodes: int, capacity: int, data: str, extra=()) -> list[str]:
    zeppelin_ranks = ranks // tp
    global_batch = 2 * zeppelin_ranks  # two micro-batches per step on every run
    return [
        *MODEL,
        *TRAINING,
        *ON_CPU,
        "--data-path",
        *data.split(),
        "--global-batch-size",
        str(global_batch),
        "--tensor-model-parallel-size",
        str(tp),
        *ZEPPELIN.format(nodes=nodes, capacity=capacity).split(),
        *extra,
    ]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pretrain")


def _trained(run: Run) -> dict[int, float]:
    assert run.returncode == 0, run.tail()
    assert finite(run.losses), run.tail()
    return run.losses


def _evaluated(run: Run) -> dict[str, float]:
    """The validation and test losses Megatron printed: every evaluation, each finite."""
    assert run.returncode == 0, run.tail()
    assert sorted(run.evaluations) == sorted([*EVALUATIONS, TEST]), run.tail()
    assert finite(run.evaluations), run.tail()
    return run.evaluations


@pytest.fixture(scope="module")
def reference_run(work: Path, dataset: str) -> Run:
    args = _args(ranks=1, tp=1, nodes=1, capacity=4 * CAPACITY, data=dataset)
    return launch(args, world_size=1, log_dir=work / "one", timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def reference(reference_run: Run) -> dict[int, float]:
    losses = _trained(reference_run)
    assert sorted(losses) == list(range(1, ITERATIONS + 1))
    return losses


@pytest.fixture(scope="module")
def tp1_run(work: Path, dataset: str) -> Run:
    save = ["--save", str(work / "checkpoints"), "--save-interval", str(SAVE_AT)]
    args = _args(ranks=4, tp=1, nodes=2, capacity=CAPACITY, data=dataset, extra=save)
    return launch(args, world_size=4, log_dir=work / "tp1", timeout_s=TIMEOUT_S)


def _assert_close(losses: dict, expected: dict) -> None:
    assert sorted(losses) == sorted(expected), (losses, expected)
    for iteration, loss in expected.items():
        assert abs(losses[iteration] - loss) <= TOLERANCE, (iteration, losses, expected)


def _startup_summary(run: Run) -> list[str]:
    """Rank 0's start-up summary: node shape, cost-model source, kernel (one line each)."""
    lines = [line for line in run.outputs[0].splitlines() if line.startswith("zeppelin: ")]
    assert len(lines) >= 3, run.tail()
    return lines


def test_tp1_on_two_emulated_nodes_trains_as_one_process(tp1_run: Run, reference) -> None:
    _assert_close(_trained(tp1_run), reference)
    plans = [(int(docs), int(inter)) for docs, inter in PLAN.findall(tp1_run.outputs[0])]
    assert any(inter > 0 for _, inter in plans), "no document rang across nodes"
    assert any(docs < 4 for docs, _ in plans), "no micro-batch had fewer documents than ranks"
    shape, cost_model, kernel = _startup_summary(tp1_run)[:3]
    assert shape.startswith("zeppelin: node shape 2 nodes x 2 Zeppelin ranks")
    assert cost_model.startswith("zeppelin: cost model 2 layers, 4 heads, 4 K/V heads, fp32, TP 1")
    assert kernel == "zeppelin: attention kernel torch (requested with --zeppelin-kernel)"
    # Megatron's own loop plans ahead in a planner process on the first rank of each node,
    # the others receiving the plans, and says how it went.
    assert _startup_summary(tp1_run)[3] == (
        "zeppelin: planning 6 micro-batches ahead in 1 planner process on the first rank of "
        "each node, each plan sent to every rank"
    )
    # Without Megatron's --manual-gc the start-up says what Python's collector will do.
    assert "--manual-gc makes them at fixed steps" in _startup_summary(tp1_run)[4]
    plans = [int(n) for n in PLANNING.findall(tp1_run.outputs[0])]
    assert plans and plans == sorted(plans) and plans[-1] > 1, tp1_run.tail()
    # Every planning line has the shared form: one per micro-batch logged.
    assert len(plans) == len(re.findall("zeppelin planning: ", tp1_run.outputs[0]))


def test_validation_and_test_losses_equal_the_one_process_values(
    tp1_run: Run, reference_run: Run
) -> None:
    # The same held-out documents (Megatron's split of each dataset of the blend), evaluated
    # forward only over 4 ranks: the per-token loss over all their tokens, as one process has it.
    _assert_close(_evaluated(tp1_run), _evaluated(reference_run))


def test_tp2_with_sequence_parallelism_trains_as_one_process(
    work, dataset, reference, reference_run
) -> None:
    # With --manual-gc, as docs/MEGATRON.md runs it: Megatron turns the collector off itself.
    args = _args(
        ranks=4,
        tp=2,
        nodes=2,
        capacity=2 * CAPACITY,
        data=dataset,
        extra=["--sequence-parallel", "--manual-gc"],
    )
    run = launch(args, world_size=4, log_dir=work / "tp2-sp", timeout_s=TIMEOUT_S)
    _assert_close(_trained(run), reference)
    _assert_close(_evaluated(run), _evaluated(reference_run))
    assert not any("collector" in line for line in _startup_summary(run)), run.tail()
    shape, cost_model = _startup_summary(run)[:2]
    assert shape.startswith("zeppelin: node shape 2 nodes x 1 Zeppelin ranks")
    assert "2 GPUs per node / TP 2" in shape
    assert ", TP 2: " in cost_model


def test_resuming_from_a_checkpoint_continues_the_uninterrupted_run(
    work: Path, dataset: str, tp1_run: Run
) -> None:
    uninterrupted = _trained(tp1_run)
    load = ["--load", str(work / "checkpoints"), "--ckpt-step", str(SAVE_AT)]
    args = _args(ranks=4, tp=1, nodes=2, capacity=CAPACITY, data=dataset, extra=load)
    run = launch(args, world_size=4, log_dir=work / "resumed", timeout_s=TIMEOUT_S)
    _assert_close(_trained(run), {i: v for i, v in uninterrupted.items() if i > SAVE_AT})
    # Restored from the state saved beside the checkpoint (both datasets' places), not replayed.
    assert f"zeppelin: sampler restored at iteration {SAVE_AT}" in run.outputs[0], run.tail()
    # Evaluations after the resume continue the validation stream where it stood.
    later = {k: v for k, v in _evaluated(tp1_run).items() if k != f"iteration {SAVE_AT}"}
    _assert_close(run.evaluations, later)
    assert finite(run.evaluations)
