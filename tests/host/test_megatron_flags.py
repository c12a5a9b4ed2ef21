"""Megatron's real parser (megatron-core 0.19) against the registry of answers
(``megatron.coverage``): every flag of the covered argument groups has one, each answer names a
flag Megatron has (as its first long option) and reads the attribute Megatron stores it in, the
runs Megatron validates are refused only for what they set, and every refused flag set through
the parser stops the run naming it. In this process; nothing is launched.

Tier: host.
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings

import pytest
from cpu_adapter import validation_on_cpu

from megatron_zeppelin import pretrain_gpt
from megatron_zeppelin.megatron import coverage, hooks

pytestmark = pytest.mark.host

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 8 --train-iters 1 "
    "--eval-iters 0 --eval-interval 10 --lr 1e-3 --vocab-size 128 --attention-dropout 0 "
    "--tokenizer-type NullTokenizer --distributed-backend gloo --data-path unused "
    "--zeppelin --zeppelin-topology custom --zeppelin-nodes 1"
).split()
# A value each refused flag is refused with, where the flag alone (a switch) or "2" is not one.
REFUSED_VALUES = {
    "--kv-channels": ["32"],
    "--moe-aux-loss-coeff": ["0.01"],
    "--softmax-type": ["learnable"],
    "--window-size": ["64,0"],
    "--split": ["998,1,1"],
    "--rope-type": ["yarn"],
    "--cuda-graph-impl": ["local"],
    "--fp8-format": ["hybrid"],
    "--fp4-format": ["e2m1"],
    "--rampup-batch-size": ["16", "16", "1000"],
    "--use-tp-pp-dp-mapping": ["--pipeline-model-parallel-size", "2"],  # refused with stages
    "--experimental-attention-variant": ["gated_delta_net"],
    "--eval-iters": ["10"],
}
# Refused flags this test cannot set through the parser alone: the weight shards' checks read
# what validation derives from them (the runs Megatron validates, below, cover those), and
# --yaml-cfg makes the parser read a YAML file instead of the command line.
NOT_PARSED = {
    "--tensor-parallel-num-weight-shards",
    "--expert-tensor-parallel-num-weight-shards",
    "--yaml-cfg",
}


@functools.cache
def _parser(*, zeppelin: bool = False) -> argparse.ArgumentParser:
    """Megatron's parser (as ``parse_args`` builds it), with the plugin's flags or without;
    built once: parsing does not change it."""
    from megatron.training.arguments import add_megatron_arguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return hooks.extra_args_provider(parser) if zeppelin else parser


def _covered_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action
        for group in parser._action_groups
        if group.title in coverage.COVERED_GROUPS
        for action in group._group_actions
    ]


def test_every_flag_of_the_covered_groups_has_an_answer() -> None:
    parser = _parser()
    titles = {group.title for group in parser._action_groups}
    assert set(coverage.COVERED_GROUPS) <= titles, set(coverage.COVERED_GROUPS) - titles
    missing = [
        a.option_strings
        for a in _covered_actions(parser)
        if not any(coverage.answer_of(o) for o in a.option_strings)
    ]
    assert not missing, f"Megatron flags without an answer in megatron/coverage/: {missing}"


def test_every_answer_names_a_megatron_flag_and_reads_its_attribute() -> None:
    actions = {o: a for a in _parser()._actions for o in a.option_strings}
    for answer in coverage.ANSWERS:
        action = actions.get(answer.flag)
        assert action is not None, f"{answer.flag} is not a Megatron flag"
        first = next(o for o in action.option_strings if o.startswith("--"))
        assert answer.flag == first, (answer.flag, action.option_strings)
        if answer.kind == coverage.REFUSED or answer.check is not None:  # it reads the value
            assert answer.attribute == action.dest, (answer.flag, answer.attribute, action.dest)


def _validated(argv: list[str], monkeypatch, world_size: int = 1) -> argparse.Namespace:
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with validation_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = parse_args(hooks.extra_args_provider)
        validate_args(args, {})
    return args


@pytest.mark.parametrize(
    ("extra", "world_size"),
    [
        ("", 1),
        ("--tensor-model-parallel-size 2 --sequence-parallel --bf16 --recompute-activations", 8),
        (
            "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 "
            "--moe-token-dispatcher-type alltoall --tensor-model-parallel-size 2 "
            "--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce",
            8,
        ),
    ],
    ids=["dense", "tp2-bf16", "moe-ep2-tp2"],
)
def test_runs_megatron_validates_meet_no_refusal(extra, world_size, monkeypatch) -> None:
    """Megatron fills in defaults while it validates (a split, weight shards, expert tensor
    parallelism): none of them may trip a refusal."""
    args = _validated([*BASE, *extra.split()], monkeypatch, world_size)
    assert coverage.first_refusal(args) is None


@pytest.mark.parametrize(
    "answer",
    [a for a in coverage.ANSWERS if a.kind == coverage.REFUSED and a.flag not in NOT_PARSED],
    ids=lambda a: a.flag,
)
def test_each_refused_flag_set_through_megatrons_parser_is_refused(answer) -> None:
    action = next(a for a in _parser()._actions if answer.flag in a.option_strings)
    values = REFUSED_VALUES.get(answer.flag)
    if values is None:
        values = [] if action.nargs == 0 else ["2"]
    args = _parser(zeppelin=True).parse_args([*BASE, answer.flag, *values])
    refusal = answer.refusal(args)
    assert refusal and refusal.startswith(answer.flag) and "\n" not in refusal, refusal
    assert coverage.first_refusal(args) is not None


@pytest.mark.parametrize(
    "flags",
    [
        ["--multi-latent-attention"],
        ["--mtp-num-layers", "1", "--position-embedding-type", "rope"],
        ["--moe-expert-capacity-factor", "1.0", "--num-experts", "4"],
    ],
    ids=["mla", "mtp", "moe-token-dropping"],
)
def test_the_entry_point_refuses_in_one_line_with_exit_code_2(flags, monkeypatch, capsys) -> None:
    from megatron.core.datasets import utils
    from megatron.training import global_vars

    argv = [*BASE, "--global-batch-size", "1", *flags]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(utils, "compile_helpers", utils.compile_helpers)
    try:
        with pytest.raises(SystemExit) as exited, validation_on_cpu():
            pretrain_gpt.main()
    finally:
        global_vars.unset_global_variables()
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"megatron_zeppelin.pretrain_gpt: error: {flags[0]}"), errors
