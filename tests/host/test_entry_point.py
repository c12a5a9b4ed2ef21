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


def test_bad_flags_stop_the_entry_point_in_one_line_before_megatron_starts(
    monkeypatch, capsys
) -> None:
    from megatron.core.datasets import utils
    from megatron.training import global_vars

    argv = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 "
        "--train-iters 1 --eval-iters 0 --eval-interval 10 --lr 1e-3 --vocab-size 128 "
        "--tokenizer-type NullTokenizer --distributed-backend gloo --data-path unused "
        "--zeppelin --zeppelin-topology custom --zeppelin-nodes 1"
    ).split()
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
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert errors == [
        "megatron_zeppelin.pretrain_gpt: error: --zeppelin packs each micro-batch's documents "
        "into one row: set --micro-batch-size 1 (got 2); the token budget sets its size"
    ]
