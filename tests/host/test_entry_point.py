"""``megatron_zeppelin.pretrain_gpt`` against megatron-core 0.19's real ``megatron.training``:
the calling convention it picks, what it does about the wheel's gaps, and bad flags refused in
one line before Megatron initializes (in this process: nothing distributed starts before the
refusal). Training through it: ``test_pretrain_loop.py``.

Tier: host.
"""

from __future__ import annotations

import inspect
import sys

import pytest

from megatron_zeppelin import pretrain_gpt

pytestmark = pytest.mark.host


def test_megatron_core_0_19_is_called_with_a_config_container() -> None:
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    assert pretrain_gpt.calling_convention(pretrain) == pretrain_gpt.TAKES_CONTAINER
    # The calls the entry point makes bind to the release's signatures.
    inspect.signature(parse_and_validate_args).bind(
        extra_args_provider=None, args_defaults=pretrain_gpt.ARGS_DEFAULTS
    )
    inspect.signature(pretrain_cfg_container_from_args).bind(None)
    inspect.signature(pretrain).bind(None, None, None, None, model_provider=None)


def test_the_wheel_ships_the_dataset_helper_but_no_makefile(monkeypatch) -> None:
    """Megatron's start-up runs ``make`` in megatron/core/datasets; the wheel has no Makefile
    there, so the entry point uses the compiled helper the wheel ships."""
    from megatron.core.datasets import helpers_cpp, utils

    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)
    assert pretrain_gpt.use_shipped_dataset_helpers()
    utils.compile_helpers()  # what _compile_dependencies calls: no make, no exit
    assert hasattr(helpers_cpp, "build_sample_idx_int64")


FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size {micro_batch} --global-batch-size 2 "
    "--train-iters 1 --eval-iters 0 --eval-interval 10 --lr 1e-3 --vocab-size 128 "
    "--attention-dropout 0 --tokenizer-type NullTokenizer --distributed-backend gloo "
    "--data-path {data} "
    "--zeppelin --zeppelin-topology custom --zeppelin-nodes 1"
)


def _errors_of_main(argv: list[str], monkeypatch, capsys) -> list[str]:
    """Run the entry point on ``argv``; it must exit with code 2; returns what it printed on
    stderr, line by line."""
    from megatron.core.datasets import utils
    from megatron.training import global_vars

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)
    try:
        with pytest.raises(SystemExit) as exited:
            pretrain_gpt.main()
    finally:
        global_vars.unset_global_variables()  # what parse_and_validate_args set
    assert exited.value.code == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_bad_flags_stop_the_entry_point_in_one_line_before_megatron_starts(
    monkeypatch, capsys
) -> None:
    argv = FLAGS.format(micro_batch=2, data="unused").split()
    assert _errors_of_main(argv, monkeypatch, capsys) == [
        "megatron_zeppelin.pretrain_gpt: error: --zeppelin packs each micro-batch's documents "
        "into one row: set --micro-batch-size 1 (got 2); the token budget sets its size"
    ]


@pytest.mark.parametrize(
    ("blend", "error"),
    [
        ("0.3 {a} 0.7 {a}-missing", "--data-path: dataset file {a}-missing.idx does not exist"),
        ("0.3 {a} -1 {a}", "--data-path: weights 0.3 -1 must be non-negative numbers"),
        ("{a} {wide}", "the datasets store tokens as different dtypes"),
    ],
)
def test_a_bad_blend_stops_the_entry_point_in_one_line(
    blend: str, error: str, tmp_path, monkeypatch, capsys
) -> None:
    from megatron_zeppelin.job.synthetic import write_synthetic_dataset

    a, wide = str(tmp_path / "a"), str(tmp_path / "wide")
    write_synthetic_dataset(a, lengths=[30] * 200, vocab_size=128)
    write_synthetic_dataset(wide, lengths=[30] * 200, vocab_size=70000)  # int32 tokens
    argv = FLAGS.format(micro_batch=1, data=blend.format(a=a, wide=wide)).split()
    (line,) = _errors_of_main(argv, monkeypatch, capsys)
    assert line.startswith("megatron_zeppelin.pretrain_gpt: error: " + error.format(a=a)), line
