"""Every command users are given starts under Megatron-LM's real argument handling.

Each command (every training command of the README and the docs, read from the files; every
shipped model x cluster config, expanded by ``scripts/slurm/zeppelin_env.sh`` as the Slurm
scripts expand it) goes through what ``megatron_zeppelin.pretrain_gpt`` runs before training:
Megatron's ``parse_args(extra_args_provider=...)`` and ``validate_args``, the plugin's start-up
checks, and Megatron's count of train/valid/test samples (where a missing ``--eval-interval``
fails with a ``TypeError`` at ``train_iters // eval_interval``). Each passes, or is refused with
the message the docs give for it. The datasets the commands name live on a cluster: here each is
a small local dataset of as many documents as a corpus needs for Megatron's splits to hold some
(the start-up checks read its header).

Tier: host (megatron-core 0.19's ``megatron.training``, in process; ``validate_args`` asks for
the GPU architecture with TP > 1, which ``cpu_adapter.validation_on_cpu`` answers).
"""

from __future__ import annotations

import re
import sys

import pytest
from cpu_adapter import validation_on_cpu
from launch_commands import Command, documented_commands, shipped_configs, slurm_command

pytestmark = pytest.mark.host

NODES = 4  # the allocation the Slurm examples use


DATA_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """The local stand-in for every dataset a command names: 1000 short documents."""
    from megatron_zeppelin.job.synthetic import write_synthetic_dataset

    prefix = str(tmp_path_factory.mktemp("corpus") / "corpus_text_document")
    write_synthetic_dataset(prefix, lengths=[8] * 1000, vocab_size=1000)
    return prefix


def _on_local_data(argv: tuple[str, ...], prefix: str) -> list[str]:
    """``argv`` with every dataset prefix after a data flag replaced by ``prefix`` (weights
    kept)."""
    words, in_data = [], False
    for word in argv:
        if word.startswith("--"):
            in_data = word in DATA_FLAGS
        elif in_data and not re.fullmatch(r"[0-9.eE+-]+", word):
            word = prefix
        words.append(word)
    return words


def start_up(command: Command, monkeypatch: pytest.MonkeyPatch, corpus: str):
    """What the entry point does with ``command`` before Megatron initializes; returns args."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.training import get_train_valid_test_num_samples

    from megatron_zeppelin import pretrain_gpt
    from megatron_zeppelin.megatron import hooks

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *_on_local_data(command.argv, corpus)])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(command.world_size))
    for name, value in command.env:
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    with validation_on_cpu():
        args = parse_args(hooks.extra_args_provider)
        validate_args(args, dict(pretrain_gpt.ARGS_DEFAULTS))
    pretrain_gpt.check_plugin_args(args)
    global_vars.set_args(args)
    num_samples = get_train_valid_test_num_samples()
    assert num_samples[0] == args.train_iters * args.global_batch_size
    return args


@pytest.mark.parametrize("command", documented_commands(), ids=lambda c: c.source)
def test_every_documented_command_starts(
    command: Command, monkeypatch, capsys, corpus: str
) -> None:
    if "--help" in command.argv:
        with pytest.raises(SystemExit) as exit_info:
            start_up(command, monkeypatch, corpus)
        assert exit_info.value.code == 0
        assert "--zeppelin-topology" in capsys.readouterr().out
        return
    args = start_up(command, monkeypatch, corpus)
    # Switched by the plugin's checks: the per-token loss on, Megatron's fused RoPE off.
    assert args.zeppelin and args.calculate_per_token_loss and not args.apply_rope_fusion


@pytest.mark.parametrize(("model", "cluster"), shipped_configs())
def test_every_shipped_config_starts_as_the_slurm_scripts_launch_it(
    model: str, cluster: str, monkeypatch, corpus: str
) -> None:
    command = slurm_command(model, cluster, NODES)
    args = start_up(command, monkeypatch, corpus)
    assert args.zeppelin_topology == cluster
    assert args.world_size == NODES * 8


def test_the_docs_list_commands_to_check() -> None:
    """The extraction finds the commands the docs are known to hold (so an empty list, from a
    changed format, cannot pass the tests above)."""
    sources = {c.source.split(":")[0] for c in documented_commands()}
    assert {"docs/MEGATRON.md", "scripts/slurm/README.md"} <= sources


# --- refusals through the whole start-up: a documented command and one refused value ----------
# (every refused flag of megatron/coverage/ is refused through Megatron's parser in
# tests/host/test_megatron_flags.py; these go through parsing, validation and the plugin's checks)

# A value each of these constraints refuses, added to a command that starts.
VIOLATIONS = {
    "--context-parallel-size": ["--context-parallel-size", "2"],
    "--use-tp-pp-dp-mapping": ["--pipeline-model-parallel-size", "2", "--use-tp-pp-dp-mapping"],
    "--moe-token-dispatcher-type": ["--pipeline-model-parallel-size", "2", "--num-experts", "4"],
    # 16 ranks of 8-GPU nodes: a TP of 16 does not divide a node.
    "--tensor-model-parallel-size": ["--tensor-model-parallel-size", "16"],
    "--attention-dropout": ["--attention-dropout", "0.1"],
    "--micro-batch-size": ["--micro-batch-size", "2", "--global-batch-size", "64"],
    "--global-batch-size": ["--global-batch-size", "12"],
    "--position-embedding-type": ["--position-embedding-type", "relative"],
    "--window-size": ["--window-size", "64,4"],
    "--rampup-batch-size": ["--rampup-batch-size", "16", "16", "1000"],
    "--eval-micro-batch-size": ["--eval-micro-batch-size", "2"],
    "--eval-global-batch-size": ["--eval-global-batch-size", "12"],
    "--multiple-validation-sets": ["--multiple-validation-sets"],
    "--split": ["--split", "0,0,0"],
    # A weight without its prefix is read as a prefix: no such dataset, with a hint.
    "--data-path": ["--data-path", "0.5"],
    "--dataloader-type": ["--dataloader-type", "external"],
    # Megatron's default (None) cannot be written; 0 is as missing (train_iters // 0).
    "--eval-interval": ["--eval-interval", "0"],
}


@pytest.mark.parametrize("flag", sorted(VIOLATIONS))
def test_documented_constraints_are_refused_naming_the_flag(
    flag: str, monkeypatch, corpus: str
) -> None:
    base = next(c for c in documented_commands() if c.source.startswith("docs/MEGATRON.md"))
    # As the Slurm scripts launch it: Megatron asks for this before any Zeppelin check with TP > 1.
    env = (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)
    command = Command(base.source, (*base.argv, *VIOLATIONS[flag]), base.world_size, env)
    with pytest.raises((ValueError, AssertionError, SystemExit)) as refused:
        start_up(command, monkeypatch, corpus)
    words = flag.lstrip("-").split("-")
    message = str(refused.value).lower().replace("_", "-")
    assert flag in message or " ".join(words) in message.replace("-", " "), message
