"""Every shipped model x cluster config through Megatron-LM's real argument parsing: the hooks
plan the model and the node shape that ``zeppelin plan`` plans for the same preset, and
Megatron's default attention dropout is refused (tier: host, Python 3.12 with megatron-core
0.19's ``megatron.training``; the main suite deselects it, ``scripts/host_tier.sh`` runs it).

The arguments come from the YAML files exactly as the Slurm scripts make them
(``scripts/yaml_to_args.py``), plus what every run adds on its command line (batch sizes,
iterations, tokenizer, data). Run alone with

    bash scripts/host_tier.sh tests/test_host_configs.py

CPU adapter (Megatron's needs only, never the plugin's): ``validate_args`` asks the GPU's
architecture (``megatron.training.arguments.get_device_arch_version``) when TP > 1; there is no
GPU here, so the adapter answers 9, an H100's.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys

import pytest

pytestmark = pytest.mark.host

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = sorted(glob.glob(os.path.join(ROOT, "configs", "models", "*.yaml")))
CLUSTERS = sorted(glob.glob(os.path.join(ROOT, "configs", "clusters", "*.yaml")))
NODES = 4
RUN_FLAGS = [
    "--micro-batch-size", "1", "--global-batch-size", "64", "--train-iters", "10",
    "--lr", "1e-4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
    "--data-path", "/data/corpus", "--eval-iters", "0", "--eval-interval", "1000",
]  # fmt: skip


@pytest.fixture
def megatron_args(monkeypatch):
    """Megatron's ``parse_args`` + ``validate_args`` of YAML files on ``NODES`` x 8 GPUs."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from megatron.training import arguments
    from yaml_to_args import load_flags, to_argv

    from megatron_zeppelin.megatron.hooks import extra_args_provider

    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    world = NODES * 8
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as zeppelin_env.sh sets it

    def parse(*files: str, extra: tuple[str, ...] = ()):
        argv = to_argv(load_flags(list(files))) + RUN_FLAGS + list(extra)
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
        args = arguments.parse_args(extra_args_provider=extra_args_provider)
        arguments.validate_args(args, {})
        args.padded_vocab_size = 32000  # the tokenizer's padding; no cost figure reads it
        return args, world

    yield parse
    sys.path.remove(os.path.join(ROOT, "scripts"))


def _cli_plan_inputs(model: str, preset: str, tp: int, tmp_path):
    from megatron_zeppelin.cli import build_parser
    from megatron_zeppelin.commands.plan import read_cost_model, read_topology

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("1000\n")
    argv = ["--model", model, "--tp", str(tp), "--topology", preset, "--nodes", str(NODES)]
    cli = build_parser("plan").parse_args(["plan", "--lengths", str(lengths), *argv])
    topology = read_topology(cli)
    return cli, topology, read_cost_model(cli, topology)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=os.path.basename)
@pytest.mark.parametrize("model", MODELS, ids=os.path.basename)
def test_hooks_and_the_cli_plan_every_shipped_config_alike(
    model, cluster, megatron_args, tmp_path
) -> None:
    from megatron_zeppelin.commands.plan import planner_options
    from megatron_zeppelin.megatron.args import resolve_topology, validate_megatron_args
    from megatron_zeppelin.megatron.hooks import planner_model
    from megatron_zeppelin.planner.cost.costmodel import CostModel
    from megatron_zeppelin.planner.cost.thresholds import tier_thresholds

    args, world = megatron_args(model, cluster)
    config = validate_megatron_args(args, world_size=world)
    tp = args.tensor_model_parallel_size
    topology = resolve_topology(config, world // tp, tensor_parallel=tp)
    spec = planner_model(args)
    name = os.path.basename(model).removesuffix(".yaml")
    cli, cli_topology, cli_cost = _cli_plan_inputs(name, config.topology, tp, tmp_path)
    # Same Zeppelin node shape: GPUs per node / TP ranks per node, NICs accordingly.
    assert topology == cli_topology
    assert topology.gpus_per_node * tp == 8 and topology.num_nodes == NODES
    # Same model: heads, K/V heads (MHA: no --group-query-attention), bf16, TP.
    assert dataclasses.replace(spec, name=name, vocab_size=0) == dataclasses.replace(
        cli_cost.model, vocab_size=0
    )
    cost = CostModel.default(spec, topology)
    assert tier_thresholds(cost) == tier_thresholds(cli_cost)
    assert config.planner_options(cost) == planner_options(cli, cli_cost)
    if (name, config.topology) == ("llama-7b", "dgx-h100"):
        assert spec.kv_bytes_per_token() == 16384
        assert tier_thresholds(cost) == (4940, 49768)


def test_megatrons_default_attention_dropout_is_refused(megatron_args) -> None:
    from megatron_zeppelin.megatron.args import validate_megatron_args

    args, world = megatron_args(MODELS[0], CLUSTERS[0], extra=("--attention-dropout", "0.1"))
    with pytest.raises(ValueError, match="set --attention-dropout 0"):
        validate_megatron_args(args, world_size=world)


def test_sequence_parallel_configs_pass_the_plugins_checks(megatron_args) -> None:
    from megatron_zeppelin.megatron.args import validate_megatron_args

    sequence_parallel = [m for m in MODELS if "sequence-parallel: true" in open(m).read()]
    assert sequence_parallel, "the shipped configs include sequence-parallel models"
    for model in sequence_parallel:
        args, world = megatron_args(model, CLUSTERS[0])
        assert args.sequence_parallel and args.tensor_model_parallel_size > 1
        assert validate_megatron_args(args, world_size=world).enabled
