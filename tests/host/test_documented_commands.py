"""Every command users are given starts under Megatron-LM's real argument handling.

Each command (every training command of the README and the docs, read from the files; every
shipped model x cluster config, expanded by ``scripts/slurm/zeppelin_env.sh`` as the Slurm
scripts expand it) goes through what ``megatron_zeppelin.pretrain_gpt`` runs before training:
Megatron's ``parse_args(extra_args_provider=...)`` and ``validate_args``, the plugin's start-up
checks, and Megatron's count of train/valid/test samples (where a missing ``--eval-interval``
fails with a ``TypeError`` at ``train_iters // eval_interval``). Each passes, or is refused with
the message the docs give for it.

Tier: host (megatron-core 0.19's ``megatron.training``, in process; ``validate_args`` asks for
the GPU architecture with TP > 1, which ``cpu_adapter.validation_on_cpu`` answers).
"""

from __future__ import annotations

import sys

import pytest
from cpu_adapter import validation_on_cpu
from launch_commands import Command, documented_commands, shipped_configs, slurm_command

pytestmark = pytest.mark.host

NODES = 4  # the allocation the Slurm examples use


def start_up(command: Command, monkeypatch: pytest.MonkeyPatch):
    """What the entry point does with ``command`` before Megatron initializes; returns args."""
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.training import get_train_valid_test_num_samples

    from megatron_zeppelin import pretrain_gpt
    from megatron_zeppelin.megatron import hooks

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *command.argv])
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
def test_every_documented_command_starts(command: Command, monkeypatch, capsys) -> None:
    if "--help" in command.argv:
        with pytest.raises(SystemExit) as exit_info:
            start_up(command, monkeypatch)
        assert exit_info.value.code == 0
        assert "--zeppelin-topology" in capsys.readouterr().out
        return
    args = start_up(command, monkeypatch)
    # Switched by the plugin's checks: the per-token loss on, Megatron's fused RoPE off.
    assert args.zeppelin and args.calculate_per_token_loss and not args.apply_rope_fusion


@pytest.mark.parametrize(("model", "cluster"), shipped_configs())
def test_every_shipped_config_starts_as_the_slurm_scripts_launch_it(
    model: str, cluster: str, monkeypatch
) -> None:
    command = slurm_command(model, cluster, NODES)
    args = start_up(command, monkeypatch)
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
    "--pipeline-model-parallel-size": ["--pipeline-model-parallel-size", "2"],
    # 16 ranks of 8-GPU nodes: a TP of 16 does not divide a node.
    "--tensor-model-parallel-size": ["--tensor-model-parallel-size", "16"],
    "--attention-dropout": ["--attention-dropout", "0.1"],
    "--micro-batch-size": ["--micro-batch-size", "2", "--global-batch-size", "64"],
    "--global-batch-size": ["--global-batch-size", "12"],
    "--position-embedding-type": ["--position-embedding-type", "relative"],
    "--rotary-interleaved": ["--rotary-interleaved"],
    "--use-rope-scaling": ["--use-rope-scaling"],
    "--rampup-batch-size": ["--rampup-batch-size", "16", "16", "1000"],
    "--eval-iters": ["--eval-iters", "10"],
    # Megatron's default (None) cannot be written; 0 is as missing (train_iters // 0).
    "--eval-interval": ["--eval-interval", "0"],
}


@pytest.mark.parametrize("flag", sorted(VIOLATIONS))
def test_documented_constraints_are_refused_naming_the_flag(flag: str, monkeypatch) -> None:
    base = next(c for c in documented_commands() if c.source.startswith("docs/MEGATRON.md"))
    # As the Slurm scripts launch it: Megatron asks for this before any Zeppelin check with TP > 1.
    env = (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)
    command = Command(base.source, (*base.argv, *VIOLATIONS[flag]), base.world_size, env)
    with pytest.raises((ValueError, AssertionError, SystemExit)) as refused:
        start_up(command, monkeypatch)
    words = flag.lstrip("-").split("-")
    message = str(refused.value).lower().replace("_", "-")
    assert flag in message or " ".join(words) in message.replace("-", " "), message
