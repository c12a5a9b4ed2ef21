"""``python -m megatron_zeppelin.pretrain_gpt`` hands Megatron-LM the hooks in the calling
convention of the installed release, and covers what megatron-core's wheel lacks.

core_v0.16.1's ``megatron.training`` is not installed here (megatron-core 0.16.1 does not ship
it), so its ``pretrain()`` is a stand-in shaped from that release's
``megatron/training/training.py``: the same parameters in the same order, and what it does with
the ones the entry point passes (``initialize_megatron`` parses ``sys.argv`` with Megatron's
parser extended by ``extra_args_provider``; ``validate_args`` fills every argument left at None
from ``args_defaults``; the data builder reads ``is_distributed`` off the datasets provider).
megatron-core 0.19's real ``pretrain()`` runs in the host tier (``tests/host/``).

Tier: pure (stand-in modules in ``sys.modules``; no process group).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import types

import pytest

from megatron_zeppelin import pretrain_gpt
from megatron_zeppelin.megatron import hooks

pytestmark = pytest.mark.pure


def pretrain_core_v0_16_1(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults={},  # noqa: B006 (the release's own default)
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    non_loss_data_func=None,
    store=None,
    inprocess_call_wrapper=None,
):
    """Stand-in: core_v0.16.1's ``pretrain`` signature, parsing as its initialization does."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--tokenizer-type", default=None)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_args(sys.argv[1:])
    for key, value in args_defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    CALLS.append(
        dict(
            datasets=train_valid_test_dataset_provider,
            model=model_provider,
            model_type=model_type,
            step=forward_step_func,
            args=args,
            distributed=getattr(train_valid_test_dataset_provider, "is_distributed", False),
        )
    )


def pretrain_megatron_core_0_19(
    cfg_container,
    train_valid_test_dataset_provider,
    model_type,
    forward_step_func,
    model_provider=None,
    process_non_loss_data_func=None,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    non_loss_data_func=None,
    store=None,
    inprocess_call_wrapper=None,
    p2p_communicator=None,
    pg_collection=None,
    skip_model_parallel_init=False,
):
    """The parameters of megatron-core 0.19.2's ``pretrain`` (``megatron/training/training.py``)."""


CALLS: list[dict] = []


@pytest.fixture
def core_v0_16_1(monkeypatch):
    """``megatron.training`` of core_v0.16.1, as the stand-in above; yields its recorded calls."""
    from megatron.core.datasets import utils as dataset_utils

    training = types.ModuleType("megatron.training")
    training.pretrain = pretrain_core_v0_16_1
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    # The entry point may swap Megatron's helper compilation for the shipped helper: undo it.
    monkeypatch.setattr(dataset_utils, "compile_helpers", dataset_utils.compile_helpers)
    monkeypatch.setattr(
        hooks.train_valid_test_datasets_provider, "is_distributed", False, raising=False
    )
    CALLS.clear()
    yield CALLS


def test_each_release_is_recognised_by_its_pretrain_signature() -> None:
    assert pretrain_gpt.calling_convention(pretrain_core_v0_16_1) == pretrain_gpt.PARSES_ARGS
    assert (
        pretrain_gpt.calling_convention(pretrain_megatron_core_0_19) == pretrain_gpt.TAKES_CONTAINER
    )
    with pytest.raises(SystemExit, match="0.16.1 or 0.19"):
        pretrain_gpt.calling_convention(lambda *args, **kwargs: None)


def test_stand_in_has_the_parameters_of_core_v0_16_1() -> None:
    """The parameter list read from core_v0.16.1's megatron/training/training.py."""
    assert list(inspect.signature(pretrain_core_v0_16_1).parameters) == [
        "train_valid_test_dataset_provider",
        "model_provider",
        "model_type",
        "forward_step_func",
        "process_non_loss_data_func",
        "extra_args_provider",
        "args_defaults",
        "get_embedding_ranks",
        "get_position_embedding_ranks",
        "non_loss_data_func",
        "store",
        "inprocess_call_wrapper",
    ]


def test_pretrain_gpt_hands_core_v0_16_1_the_hooks(core_v0_16_1, monkeypatch) -> None:
    from megatron.core.enums import ModelType

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--zeppelin", "--micro-batch-size", "1"])
    assert pretrain_gpt.main() == 0
    (call,) = core_v0_16_1
    assert (call["datasets"], call["model"], call["step"]) == (
        hooks.train_valid_test_datasets_provider,
        hooks.model_provider,
        hooks.forward_step,
    )
    assert call["model_type"] == ModelType.encoder_or_decoder
    assert call["distributed"]  # every rank builds the marker dataset
    # The Zeppelin flags were added to Megatron's parser, the upstream defaults applied.
    assert call["args"].zeppelin and call["args"].zeppelin_topology == "auto"
    assert call["args"].tokenizer_type == "GPT2BPETokenizer"


def test_pretrain_gpt_runs_zeppelin_only(core_v0_16_1, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    with pytest.raises(SystemExit, match="--zeppelin"):
        pretrain_gpt.main()
    assert not core_v0_16_1


# --- what megatron-core's wheel lacks --------------------------------------------------------


def test_the_wheels_compiled_dataset_helper_replaces_make(monkeypatch, tmp_path) -> None:
    """megatron-core wheels ship ``helpers_cpp`` built but no Makefile, so Megatron's start-up
    ``make`` fails; a source checkout (Makefile present) still compiles as upstream does."""
    import megatron.core.datasets as datasets
    from megatron.core.datasets import utils

    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)
    upstream = utils.compile_helpers
    (tmp_path / "Makefile").write_text("all:\n")
    monkeypatch.setattr(datasets, "__file__", str(tmp_path / "__init__.py"))
    assert not pretrain_gpt.use_shipped_dataset_helpers()
    assert utils.compile_helpers is upstream
    monkeypatch.undo()

    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)
    monkeypatch.setattr(datasets, "__file__", str(tmp_path / "no-makefile" / "__init__.py"))
    assert pretrain_gpt.use_shipped_dataset_helpers()  # helpers_cpp imports from the wheel
    assert utils.compile_helpers is not upstream
    utils.compile_helpers()  # runs no make


def test_saving_without_psutil_is_refused_before_training(monkeypatch) -> None:
    pretrain_gpt.require_checkpoint_packages(argparse.Namespace(save=None))
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    pretrain_gpt.require_checkpoint_packages(argparse.Namespace(save=None))
    with pytest.raises(SystemExit, match="pip install psutil"):
        pretrain_gpt.require_checkpoint_packages(argparse.Namespace(save="/ckpt"))
