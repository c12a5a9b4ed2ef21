"""Zeppelin settings: flags generated from the dataclass, contradictions refused, Megatron-argument
validation (tier: pure)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_zeppelin.config import ZeppelinConfig, dest_of, field_docs, flag_of
from megatron_zeppelin.megatron.args import (
    extra_args_provider,
    resolve_topology,
    validate_megatron_args,
    zeppelin_ranks,
    zeppelin_world_size,
)

pytestmark = pytest.mark.pure


def _parser() -> argparse.ArgumentParser:
    return ZeppelinConfig.add_arguments(argparse.ArgumentParser())


def _megatron_args(argv: list[str], **megatron: object) -> argparse.Namespace:
    """What Megatron's parser would give: our flags plus the Megatron fields we read."""
    args = extra_args_provider(argparse.ArgumentParser()).parse_args(argv)
    defaults = dict(
        context_parallel_size=1,
        pipeline_model_parallel_size=1,
        tensor_model_parallel_size=1,
        micro_batch_size=1,
        sequence_parallel=False,
        position_embedding_type="rope",
        rotary_interleaved=False,
        calculate_per_token_loss=False,
    )
    for key, value in {**defaults, **megatron}.items():
        setattr(args, key, value)
    return args


CLUSTER = ["--zeppelin", "--zeppelin-topology", "custom", "--zeppelin-nodes", "2"]


def test_every_field_has_a_flag_with_its_docstring() -> None:
    parser = _parser()
    docs = field_docs()
    by_dest = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(ZeppelinConfig):
        action = by_dest[dest_of(f.name)]
        assert docs[f.name].split(".")[0][:30] in " ".join(action.help.split())
        assert any(o.startswith("--zeppelin") for o in action.option_strings)
    assert flag_of("enabled") == "--zeppelin"
    assert flag_of("routing", negated=True) == "--zeppelin-no-routing"


def test_defaults_round_trip_and_flags_reach_the_config() -> None:
    assert ZeppelinConfig.from_args(_parser().parse_args([])) == ZeppelinConfig()
    args = _parser().parse_args(
        [
            "--zeppelin",
            "--zeppelin-capacity",
            "8192",
            "--zeppelin-no-routing",
            "--zeppelin-intra-threshold",
            "2048",
            "--zeppelin-kernel",
            "torch",
            "--zeppelin-long-documents",
            "truncate",
            "--zeppelin-comm-timeout-s",
            "30",
        ]
    )
    config = ZeppelinConfig.from_args(args)
    assert config.enabled and not config.routing and config.remap
    assert config.capacity == 8192 and config.kernel == "torch"
    assert config.threshold("intra") == 2048 and config.threshold("inter") == "auto"
    assert config.long_documents == "truncate" and config.comm_timeout_s == 30.0


def test_choices_are_enforced_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--zeppelin-kernel", "cuda-magic"])


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(intra_threshold="4096", inter_threshold="1024"), "below"),
        (dict(intra_threshold="many"), "token count"),
        (dict(inter_threshold="-3"), "positive"),
        (dict(capacity=0), "positive integer"),
        (dict(log_plan_every=-1), ">= 0"),
        (dict(comm_timeout_s=0.0), "positive"),
        (dict(kernel="cuda"), "one of"),
        (dict(topology="custom"), "--zeppelin-nodes"),
        (dict(gpus_per_node=2, nics_per_node=4), "exceeds"),
        (dict(intra_threshold="off", inter_threshold="off", capacity=4096), "max-document-length"),
        (
            dict(
                intra_threshold="off",
                inter_threshold="off",
                capacity=4096,
                max_document_length=8192,
            ),
            "smaller than the longest document",
        ),
    ],
)
def test_contradictions_are_refused(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(ZeppelinConfig(), **changes).validate()


def test_capacity_holding_the_longest_document_is_fine_without_splitting() -> None:
    config = ZeppelinConfig(
        intra_threshold="off", inter_threshold="off", capacity=8192, max_document_length=8192
    )
    assert config.validate() is config


def test_megatron_validation_accepts_a_matching_setup_and_turns_on_per_token_loss() -> None:
    args = _megatron_args(CLUSTER)
    config = validate_megatron_args(args, world_size=4)
    assert config.enabled and args.calculate_per_token_loss is True


def test_without_zeppelin_nothing_is_checked_or_changed() -> None:
    args = _megatron_args([], context_parallel_size=4)
    assert not validate_megatron_args(args, world_size=3).enabled
    assert args.calculate_per_token_loss is False


@pytest.mark.parametrize(
    "megatron,world,match",
    [
        (dict(context_parallel_size=2), 4, "--context-parallel-size 1"),
        (dict(pipeline_model_parallel_size=3), 4, "does not divide the 4 processes"),
        (
            dict(pipeline_model_parallel_size=2, use_tp_pp_dp_mapping=True),
            4,
            "drop --use-tp-pp-dp-mapping",
        ),
        (
            # Megatron's default dispatcher, as its parser sets it
            dict(
                pipeline_model_parallel_size=2, num_experts=4, moe_token_dispatcher_type="allgather"
            ),
            4,
            "--moe-token-dispatcher-type alltoall",
        ),
        (dict(micro_batch_size=4), 4, "--micro-batch-size 1"),
        (dict(attention_dropout=0.1), 4, "--attention-dropout 0"),
        (dict(tensor_model_parallel_size=3), 4, "does not divide"),
        (dict(position_embedding_type="yarn"), 4, "position-embedding-type"),
        (dict(), 5, "do not split evenly"),
    ],
)
def test_megatron_validation_refuses(megatron: dict, world: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_megatron_args(_megatron_args(CLUSTER, **megatron), world_size=world)


def test_topology_must_match_the_data_parallel_size() -> None:
    argv = CLUSTER + ["--zeppelin-gpus-per-node", "4"]
    with pytest.raises(ValueError, match="number of processes"):
        validate_megatron_args(_megatron_args(argv), world_size=4)  # 2 x 4 != 4
    # With TP 2, 16 processes on 2 nodes of 8 GPUs are 8 Zeppelin ranks: 2 nodes x 4.
    argv = CLUSTER + ["--zeppelin-gpus-per-node", "8"]
    config = validate_megatron_args(
        _megatron_args(argv, tensor_model_parallel_size=2), world_size=16
    )
    topology = resolve_topology(config, 8, tensor_parallel=2)
    assert topology.world_size == 8 and topology.gpus_per_node == 4


def test_presets_and_capacity_contradiction_through_megatron_flags() -> None:
    argv = ["--zeppelin", "--zeppelin-topology", "dgx-h100", "--zeppelin-nodes", "2"]
    config = validate_megatron_args(_megatron_args(argv), world_size=16)
    assert resolve_topology(config, 16).gpus_per_node == 8
    bad = CLUSTER + ["--zeppelin-intra-threshold", "off", "--zeppelin-inter-threshold", "off"]
    bad += ["--zeppelin-capacity", "1024", "--zeppelin-max-document-length", "4096"]
    with pytest.raises(ValueError, match="smaller than the longest document"):
        validate_megatron_args(_megatron_args(bad), world_size=4)


def test_pipeline_parallelism_runs_a_zeppelin_world_per_stage() -> None:
    # 8 processes, PP 2 on 2 nodes of 4 GPUs: each stage's 4 data-parallel ranks fill a node.
    args = _megatron_args(CLUSTER, pipeline_model_parallel_size=2)
    config = validate_megatron_args(args, world_size=8)
    assert zeppelin_world_size(8, 1, 2) == 4
    topology = resolve_topology(config, 4, pipeline_parallel=2)
    assert (topology.num_nodes, topology.gpus_per_node) == (1, 4)
    # TP 2 x PP 2 x DP 2: the stage's Zeppelin worlds, Megatron's rank order (TP fastest).
    assert zeppelin_ranks(8, 2, 0, pipeline_parallel=2, pp_rank=0) == [0, 2]
    assert zeppelin_ranks(8, 2, 1, pipeline_parallel=2, pp_rank=1) == [5, 7]
    every = sorted(
        r
        for pp in range(2)
        for tp in range(2)
        for r in zeppelin_ranks(8, 2, tp, pipeline_parallel=2, pp_rank=pp)
    )
    assert every == list(range(8))
    with pytest.raises(ValueError, match="pipeline stage 2 outside"):
        zeppelin_ranks(8, 2, 0, pipeline_parallel=2, pp_rank=2)


def test_zeppelin_worlds_are_the_data_parallel_ranks_of_one_tp_index() -> None:
    assert zeppelin_world_size(8, 2) == 4
    assert zeppelin_ranks(8, 2, 0) == [0, 2, 4, 6]
    assert zeppelin_ranks(8, 2, 1) == [1, 3, 5, 7]
    every = sorted(r for tp in range(4) for r in zeppelin_ranks(8, 4, tp))
    assert every == list(range(8))
    with pytest.raises(ValueError):
        zeppelin_ranks(8, 2, 2)


def test_cost_model_file_is_accepted_under_both_flag_names() -> None:
    parser = ZeppelinConfig.add_arguments(argparse.ArgumentParser())
    for flag in ("--zeppelin-cost-model", "--zeppelin-calibration"):
        args = parser.parse_args(["--zeppelin", flag, "measured.json"])
        assert ZeppelinConfig.from_args(args).calibration == "measured.json"
