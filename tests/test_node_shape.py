"""Zeppelin's node shape under tensor parallelism, derived from the physical node, and the
start-up summary that shows it (tier: pure)."""

from __future__ import annotations

import argparse

import pytest

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.megatron.args import resolve_topology, zeppelin_node
from megatron_zeppelin.megatron.report import (
    KernelChoice,
    chosen_kernel,
    cost_model_line,
    node_shape_line,
    planning_line,
    startup_lines,
)
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure


def test_tp_packs_a_zeppelin_rank_onto_tp_neighbouring_gpus_of_one_node() -> None:
    dgx = get_topology("dgx-h100", num_nodes=4)
    shape = zeppelin_node(dgx, 2)
    # 8 GPUs / TP 2: four Zeppelin ranks per node, each through its own GPU's NIC at full rate.
    assert (shape.num_nodes, shape.gpus_per_node, shape.nics_per_node) == (4, 4, 4)
    assert shape.nic_of_gpu == (0, 1, 2, 3) and shape.nic_gbit == dgx.nic_gbit
    # Cluster A: one NIC per pair of GPUs, so the two TP worlds share every NIC.
    a = get_topology("zeppelin-A", num_nodes=2)
    shape = zeppelin_node(a, 2)
    assert (shape.gpus_per_node, shape.nics_per_node) == (4, 4)
    assert shape.nic_gbit == a.nic_gbit / 2
    # TP 4 on cluster A: two ranks per node, each pair of worlds on one NIC.
    shape = zeppelin_node(a, 4)
    assert (shape.gpus_per_node, shape.nics_per_node, shape.nic_gbit) == (2, 2, a.nic_gbit / 2)
    assert zeppelin_node(dgx, 1) is dgx
    assert zeppelin_node(dgx, 8).gpus_per_node == 1


@pytest.mark.parametrize("tp", [3, 16])
def test_a_tp_that_does_not_divide_the_node_is_refused(tp: int) -> None:
    with pytest.raises(ValueError, match=f"--tensor-model-parallel-size {tp} does not divide"):
        zeppelin_node(get_topology("dgx-h100", num_nodes=1), tp)


def test_a_nic_map_that_differs_between_tp_worlds_is_refused() -> None:
    odd = Topology(num_nodes=1, gpus_per_node=4, nics_per_node=2, nic_of_gpu=(0, 1, 1, 1))
    with pytest.raises(ValueError, match="different NIC layouts"):
        zeppelin_node(odd, 2)


@pytest.mark.parametrize("topology", ["dgx-h100", "zeppelin-A", "custom"])
def test_presets_yaml_and_custom_nodes_count_physical_gpus(topology: str, tmp_path) -> None:
    # 4 nodes x 8 GPUs with TP 2: 16 Zeppelin ranks, 4 per node, never 8 per "node".
    extra = {"gpus_per_node": 8} if topology == "custom" else {}
    config = ZeppelinConfig(enabled=True, topology=topology, **extra).validate()
    shape = resolve_topology(config, 16, tensor_parallel=2)
    assert (shape.num_nodes, shape.gpus_per_node) == (4, 4)
    yaml_file = tmp_path / "node.yaml"
    yaml_file.write_text("preset: dgx-h100\n")
    from_yaml = ZeppelinConfig(enabled=True, topology=str(yaml_file)).validate()
    expected = zeppelin_node(get_topology("dgx-h100", num_nodes=4), 2)
    assert resolve_topology(from_yaml, 16, tensor_parallel=2) == expected
    with pytest.raises(ValueError, match="does not divide the 8 GPUs per node"):
        resolve_topology(ZeppelinConfig(enabled=True, topology="dgx-h100"), 8, tensor_parallel=3)


def test_startup_summary_shows_node_shape_cost_model_source_and_kernel() -> None:
    topology = zeppelin_node(get_topology("dgx-h100", num_nodes=4), 2)
    cost = CostModel.default(get_model("llama-7b", tensor_parallel=2), topology)
    config = ZeppelinConfig(enabled=True, topology="dgx-h100")
    runtime = argparse.Namespace(
        topology=topology, cost_model=cost, options=config.planner_options(cost), config=config
    )
    kernel = chosen_kernel("auto", device="cpu", dtype="torch.bfloat16")
    lines = startup_lines(runtime, tensor_parallel=2, kernel=kernel)
    assert lines[0] == node_shape_line(topology, tensor_parallel=2)
    assert "4 nodes x 4 Zeppelin ranks" in lines[0] and "8 GPUs per node / TP 2" in lines[0]
    assert "32 heads, 32 K/V heads, 16-bit" in lines[1] and "TP 2" in lines[1]
    assert lines[1] == cost_model_line(cost, runtime.options)
    assert "thresholds intra" in lines[1] and "datasheet figures (H100-SXM)" in lines[1]
    assert lines[2].startswith("zeppelin: attention kernel torch (auto: no CUDA device")
    assert lines[3] == (
        "zeppelin: planning 6 micro-batches ahead in 1 planner process on the first rank of "
        "each node, each plan sent to every rank"
    )
    for flags, words in [
        (dict(plan_ahead=0), "planning each micro-batch when it starts (--zeppelin-plan-ahead 0)"),
        (dict(plan_ahead=1, plan_workers=0), "planning 1 micro-batch ahead in a thread of the"),
        (
            dict(plan_ahead=4, plan_workers=2),
            "planning 4 micro-batches ahead in 2 planner processes on the first rank of each",
        ),
    ]:
        assert words in planning_line(ZeppelinConfig(**flags).validate())
    alone = ZeppelinConfig(plan_ahead=4, share_plans=False).validate()
    assert planning_line(alone) == "zeppelin: planning 4 micro-batches ahead in 1 planner process"
    assert chosen_kernel("torch", device="cpu", dtype=None) == KernelChoice(
        "torch", "requested with --zeppelin-kernel"
    )


def test_a_pipeline_stage_fills_whole_nodes_or_shares_one() -> None:
    # 4 DGX nodes, TP 2, PP 2: a stage is 16 GPUs, 2 whole nodes of 4 Zeppelin ranks each.
    config = ZeppelinConfig(enabled=True, topology="dgx-h100").validate()
    shape = resolve_topology(config, 8, tensor_parallel=2, pipeline_parallel=2)
    assert shape == zeppelin_node(get_topology("dgx-h100", num_nodes=2), 2)
    # One DGX node, PP 2: each stage holds 4 GPUs of the node and the NICs next to them.
    shape = resolve_topology(config, 4, pipeline_parallel=2)
    assert (shape.num_nodes, shape.gpus_per_node, shape.nics_per_node) == (1, 4, 4)
    assert shape.nic_gbit == get_topology("dgx-h100", num_nodes=1).nic_gbit
    # Cluster A (a NIC per pair of GPUs), PP 8 on one node: the two stages of a pair share it.
    a = ZeppelinConfig(enabled=True, topology="zeppelin-A").validate()
    shape = resolve_topology(a, 1, pipeline_parallel=8)
    assert (shape.gpus_per_node, shape.nic_gbit) == (
        1,
        get_topology("zeppelin-A", num_nodes=1).nic_gbit / 2,
    )
    # 3 nodes of 8, PP 2: a stage of 12 GPUs straddles a node.
    with pytest.raises(ValueError, match="fill whole nodes"):
        resolve_topology(config, 12, pipeline_parallel=2)


def test_the_startup_summary_names_the_pipeline_stage_the_plan_is_for() -> None:
    from megatron_zeppelin.planner.cost.models import ModelSpec, PipelineStage

    topology = get_topology("dgx-h100", num_nodes=2)
    whole = get_model("llama-7b")
    stage = PipelineStage(
        index=1, num_stages=2, layers=range(16, 32), embedding=False, output_layer=True
    )
    spec = ModelSpec(**{**whole.to_dict(), "num_layers": 16, "pipeline": stage})
    config = ZeppelinConfig(enabled=True, topology="dgx-h100")
    cost = CostModel.default(spec, topology)
    line = cost_model_line(cost, config.planner_options(cost))
    assert line.startswith(
        "zeppelin: cost model 16 layers (PP stage 1 of 2, layers 16-31, output layer and loss), "
        "32 heads"
    )
