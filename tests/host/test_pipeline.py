"""Pipeline parallelism with Zeppelin under megatron-core 0.19's real ``pretrain()``: 1F1B and
interleaved schedules, tensor and sequence parallelism inside the stages, validation and test
through every stage, and a pipeline checkpoint resumed on a blend of two datasets; every loss
and every gradient equal to one process's.

A 4-layer GPT (otherwise the model of ``test_pretrain_loop.py``) on the same blend of two
datasets (``--data-path 0.3 A 0.7 B --split 8,1,1``), evaluated at iteration 4 and after
training. Megatron
draws a stage's weights from a seed of its own (``seed + 100 x stage``), so a pipeline run
starts from another model than one process does; every pipeline run here therefore starts from
a checkpoint, and is compared from there on:

* ``reference``: one process, every document whole on the one rank; saves at iteration 2;
* ``one_f_one_b``: PP 2 x DP 2 on 4 ranks emulating 4 nodes of one GPU (each stage's Zeppelin
  world is 2 nodes, so long documents ring across nodes), Megatron's 1F1B schedule (the first
  stage runs the second micro-batch's forward before the first one's backward); loads the
  reference's iteration 2 and saves at iteration 3;
* ``interleaved``: the same ranks with 2 virtual stages (``--num-layers-per-virtual-pipeline-
  stage 1``: stage 0 holds layers 0 and 2), resuming the 1F1B run's iteration-3 checkpoint;
* ``with_tp``: PP 2 x TP 2 with sequence parallelism (one Zeppelin rank per stage), from the
  reference's iteration 2.

Every run sees the same micro-batch budget (256 tokens) and two micro-batches per step, so all
train the same global batches. Losses within 1e-5 of the reference's, every parameter's gradient
(as the optimizer gets it, dumped by ``grad_dump.py``) within 1e-5 of the reference's, and
every validation and test loss Megatron prints after the resume within 1e-5 of the reference's
(the validation stream continues where the checkpoint's count of consumed validation samples
says). The LR is
constant and ``--override-opt_param-scheduler`` lets a run of another global batch size load
the scheduler (it counts samples).

Tier: host. Time: four launches, one of them a single process.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from grad_dump import load_gradients
from launch import Run, finite, launch

pytestmark = pytest.mark.host

ITERATIONS = 5
REFERENCE_SAVE = 2
PIPELINE_SAVE = 3
TIMEOUT_S = 420.0
TOLERANCE = 1e-5
MICRO_BATCH_TOKENS = 256
# The first evaluation comes after every checkpoint a run here loads: a resumed run places its
# validation stream by Megatron's count of consumed validation samples, which counts samples of
# the global batch size of the run that saved (one process's is half a pipeline run's here).
EVAL_INTERVAL = 4
MODEL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --swiglu "
    "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
    "--vocab-size 200 --make-vocab-size-divisible-by 128 --tokenizer-type NullTokenizer "
    "--seq-length 256 --max-position-embeddings 1024 --use-cpu-initialization --seed 1234"
).split()
TRAINING = (
    f"--micro-batch-size 1 --train-iters {ITERATIONS} --lr 1e-3 --lr-decay-style constant "
    f"--clip-grad 1.0 --eval-iters 1 --eval-interval {EVAL_INTERVAL} --split 8,1,1 "
    "--log-interval 1"
).split()
ON_CPU = (
    "--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm "
    "--distributed-backend gloo --num-workers 0"
).split()
ZEPPELIN = (
    "--zeppelin --zeppelin-kernel torch --zeppelin-topology custom --zeppelin-nodes {nodes} "
    "--zeppelin-capacity {capacity} --zeppelin-max-document-length 256 --zeppelin-log-plan-every 1"
)
PLAN = re.compile(r"zeppelin micro-batch step \d+: plan (\w+) (\d+) docs \(.*?inter (\d+)\)")


def _args(*, data: str, dp: int, nodes: int, extra: list[str]) -> list[str]:
    capacity = MICRO_BATCH_TOKENS // dp  # every run's micro-batch holds 256 tokens
    return [
        *MODEL,
        *TRAINING,
        *ON_CPU,
        "--data-path",
        *data.split(),
        "--global-batch-size",
        str(2 * dp),  # two micro-batches per step
        *ZEPPELIN.format(nodes=nodes, capacity=capacity).split(),
        *extra,
    ]


def _resume(directory: Path, iteration: int) -> list[str]:
    return [
        "--load",
        str(directory),
        "--ckpt-step",
        str(iteration),
        "--override-opt_param-scheduler",
    ]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


def _trained(run: Run) -> dict[int, float]:
    assert run.returncode == 0, run.tail()
    assert finite(run.losses), run.tail()
    return run.losses


@pytest.fixture(scope="module")
def reference_run(work: Path, dataset: str) -> Run:
    save = ["--save", str(work / "one" / "ckpt"), "--save-interval", str(REFERENCE_SAVE)]
    args = _args(data=dataset, dp=1, nodes=1, extra=save)
    return launch(
        args,
        world_size=1,
        log_dir=work / "one",
        timeout_s=TIMEOUT_S,
        grad_dir=work / "one" / "grads",
    )


@pytest.fixture(scope="module")
def reference(reference_run: Run) -> dict[int, float]:
    losses = _trained(reference_run)
    assert sorted(losses) == list(range(1, ITERATIONS + 1))
    return losses


def _assert_same_evaluations(run: Run, reference_run: Run, first: int) -> None:
    """Every validation and test loss ``run`` printed equals the reference's at the same
    place; ``run`` evaluated at every evaluation interval from ``first`` on and after training."""
    assert run.returncode == 0, run.tail()
    after = [f"iteration {ITERATIONS} on validation set", f"iteration {ITERATIONS} on test set"]
    during = [f"iteration {i}" for i in range(first, ITERATIONS + 1) if i % EVAL_INTERVAL == 0]
    assert sorted(run.evaluations) == sorted(during + after), run.tail()
    assert finite(run.evaluations), run.tail()
    for where, loss in run.evaluations.items():
        expected = reference_run.evaluations[where]
        assert abs(loss - expected) <= TOLERANCE, (where, run.evaluations, expected)


@pytest.fixture(scope="module")
def one_f_one_b(work: Path, dataset: str, reference) -> Run:
    extra = ["--pipeline-model-parallel-size", "2", "--no-load-rng"]
    extra += _resume(work / "one" / "ckpt", REFERENCE_SAVE)
    extra += ["--save", str(work / "1f1b" / "ckpt"), "--save-interval", str(PIPELINE_SAVE)]
    args = _args(data=dataset, dp=2, nodes=4, extra=extra)
    return launch(
        args,
        world_size=4,
        log_dir=work / "1f1b",
        timeout_s=TIMEOUT_S,
        grad_dir=work / "1f1b" / "grads",
    )


def _assert_close(losses: dict[int, float], expected: dict[int, float], first: int) -> None:
    expected = {i: v for i, v in expected.items() if i >= first}
    assert sorted(losses) == sorted(expected), (losses, expected)
    for iteration, loss in expected.items():
        assert abs(losses[iteration] - loss) <= TOLERANCE, (iteration, losses, expected)


def _assert_same_gradients(work: Path, run: str, iterations: range) -> None:
    for iteration in iterations:
        expected = load_gradients(str(work / "one" / "grads"), iteration, gated=True)
        got = load_gradients(str(work / run / "grads"), iteration, gated=True)
        assert sorted(got) == sorted(expected) and len(expected) == 4 * 6 + 3, sorted(got)
        for name, grad in expected.items():
            assert got[name].shape == grad.shape, name
            error = float((got[name] - grad).abs().max())
            assert error <= TOLERANCE, (iteration, name, error)
        assert any(float(g.abs().max()) > 100 * TOLERANCE for g in expected.values())


def _summary(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("zeppelin: cost model")]


def test_1f1b_stages_train_as_one_process(
    work: Path, reference, reference_run: Run, one_f_one_b: Run
) -> None:
    _assert_close(_trained(one_f_one_b), reference, first=REFERENCE_SAVE + 1)
    _assert_same_evaluations(one_f_one_b, reference_run, first=REFERENCE_SAVE + 1)
    _assert_same_gradients(work, "1f1b", range(REFERENCE_SAVE + 1, ITERATIONS + 1))
    # The first rank of each stage names its stage, and logs every plan: both stages run the
    # same plans (digests), documents ring across the stage's two nodes.
    first, last = one_f_one_b.outputs[0], one_f_one_b.outputs[2]
    (summary,) = _summary(first)
    assert "2 layers (PP stage 0 of 2, layers 0-1, embedding)" in summary
    (summary,) = _summary(last)
    assert "2 layers (PP stage 1 of 2, layers 2-3, output layer and loss)" in summary
    plans = PLAN.findall(first)
    assert len(plans) == 2 * (ITERATIONS - REFERENCE_SAVE), one_f_one_b.tail()
    assert plans == PLAN.findall(last)
    assert any(int(inter) for _, _, inter in plans), "no document rang across nodes"
    assert not PLAN.findall(one_f_one_b.outputs[1]), "one rank per stage logs the plans"


def test_interleaved_stages_resume_the_pipeline_checkpoint(
    work, dataset, reference, reference_run, one_f_one_b
) -> None:
    extra = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    extra += _resume(work / "1f1b" / "ckpt", PIPELINE_SAVE)
    args = _args(data=dataset, dp=2, nodes=4, extra=extra)
    run = launch(
        args, world_size=4, log_dir=work / "vp", timeout_s=TIMEOUT_S, grad_dir=work / "vp" / "grads"
    )
    # The uninterrupted 1F1B run and one process from here on alike.
    _assert_close(_trained(run), _trained(one_f_one_b), first=PIPELINE_SAVE + 1)
    _assert_close(run.losses, reference, first=PIPELINE_SAVE + 1)
    _assert_same_gradients(work, "vp", range(PIPELINE_SAVE + 1, ITERATIONS + 1))
    _assert_same_evaluations(run, reference_run, first=PIPELINE_SAVE + 1)
    # Restored from the state saved beside the pipeline checkpoint (both datasets' places).
    assert f"zeppelin: sampler restored at iteration {PIPELINE_SAVE}" in run.outputs[0]
    assert "(PP stage 0 of 2, layers 0, 2, embedding)" in _summary(run.outputs[0])[0]
    assert "(PP stage 1 of 2, layers 1, 3, output layer and loss)" in _summary(run.outputs[2])[0]


def test_tensor_and_sequence_parallelism_inside_pipeline_stages(
    work, dataset, reference, reference_run
) -> None:
    extra = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    extra += [
        "--sequence-parallel",
        "--no-load-rng",
        *_resume(work / "one" / "ckpt", REFERENCE_SAVE),
    ]
    args = _args(data=dataset, dp=1, nodes=1, extra=extra)
    run = launch(
        args, world_size=4, log_dir=work / "tp", timeout_s=TIMEOUT_S, grad_dir=work / "tp" / "grads"
    )
    _assert_close(_trained(run), reference, first=REFERENCE_SAVE + 1)
    _assert_same_gradients(work, "tp", range(REFERENCE_SAVE + 1, ITERATIONS + 1))
    _assert_same_evaluations(run, reference_run, first=REFERENCE_SAVE + 1)
    assert "TP 2" in _summary(run.outputs[0])[0]


def _parsed(argv: list[str], world_size: int, monkeypatch):
    """Megatron's ``parse_args`` and ``validate_args`` of ``argv`` and the plugin's start-up
    checks, in this process (what ``pretrain_gpt`` runs before Megatron initializes)."""
    from cpu_adapter import validation_on_cpu
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args

    from megatron_zeppelin import pretrain_gpt
    from megatron_zeppelin.megatron import hooks

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    with validation_on_cpu():
        args = parse_args(hooks.extra_args_provider)
        validate_args(args, dict(pretrain_gpt.ARGS_DEFAULTS))
    pretrain_gpt.check_plugin_args(args)
    return args


@pytest.mark.parametrize(
    ("flags", "stages"),
    [
        ([], [(0, 1), (2, 3)]),
        (["--num-layers-per-virtual-pipeline-stage", "1"], [(0, 2), (1, 3)]),
        (["--num-virtual-stages-per-pipeline-rank", "2"], [(0, 2), (1, 3)]),
        (["--decoder-last-pipeline-num-layers", "1"], [(0, 1, 2), (3,)]),
    ],
)
def test_a_stage_plans_with_the_layers_megatron_builds_on_it(
    flags, stages, dataset, monkeypatch
) -> None:
    from megatron_zeppelin.megatron import hooks

    argv = _args(data=dataset, dp=2, nodes=4, extra=["--pipeline-model-parallel-size", "2"])
    args = _parsed(argv + flags, 4, monkeypatch)
    args.padded_vocab_size = 256  # what Megatron's tokenizer set-up pads --vocab-size 200 to
    specs = [hooks.planner_model(args, pp_rank=stage) for stage in range(2)]
    for stage, (spec, layers) in enumerate(zip(specs, stages, strict=True)):
        assert spec.pipeline.layers == layers and spec.num_layers == len(layers)
        assert spec.pipeline.embedding == (stage == 0)
        assert (spec.output_flops_per_token() > 0) == (stage == 1)
    # The stages' work adds up to the whole model's: every layer once, one output layer.
    per_layer = specs[0].linear_flops_per_token()
    total = sum(s.stage_flops_per_token() for s in specs)
    assert total == pytest.approx(4 * per_layer + specs[1].output_flops_per_token())
