"""Topology presets, YAML files, flag resolution and the launcher-variable probe.

Tier: pure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_zeppelin.topology import (
    PRESETS,
    detect_topology,
    get_topology,
    load_topology_yaml,
    topology_from_args,
)
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "topology"


def test_required_presets_exist():
    assert {"zeppelin-A", "zeppelin-B", "zeppelin-C", "dgx-h100", "flexsp-a100"} <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_yaml_config_matches_preset(name):
    from_yaml = load_topology_yaml(str(CONFIGS / f"{name}.yaml"), num_nodes=4)
    assert from_yaml == get_topology(name, num_nodes=4)
    assert from_yaml.world_size == 4 * from_yaml.gpus_per_node


def test_preset_figures_follow_hardware_table():
    a = get_topology("zeppelin-A", num_nodes=2)
    assert (a.gpus_per_node, a.nics_per_node, a.nic_gbit) == (8, 4, 200.0)
    assert a.nic_of_gpu == (0, 0, 1, 1, 2, 2, 3, 3)
    assert get_topology("zeppelin-C", num_nodes=1).hbm_gib > 80


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="zeppelin-A"):
        get_topology("dgx-z9000", num_nodes=2)
    with pytest.raises(ValueError, match="num_nodes"):
        get_topology("dgx-h100", num_nodes=0)


def test_yaml_preset_with_overrides_and_errors(tmp_path):
    good = tmp_path / "t.yaml"
    good.write_text("preset: dgx-h100\nnum_nodes: 3\nnics_per_node: 4\nnic_gbit: 200\n")
    topo = load_topology_yaml(str(good))
    assert (topo.num_nodes, topo.nics_per_node, topo.nic_gbit) == (3, 4, 200)
    assert topo.nic_of_gpu == (0, 0, 1, 1, 2, 2, 3, 3)  # re-spread over the new NIC count
    cases = {
        "unknown.yaml": ("gpus_per_node: 8\nwarp_drive: 1\n", "unknown fields"),
        "list.yaml": ("- 1\n- 2\n", "mapping"),
        "broken.yaml": ("gpus_per_node: [8\n", "not valid YAML"),
        "missing.yaml": ("gpus_per_node: 8\n", "missing fields"),
        "nosum.yaml": ("num_nodes: 1\ngpus_per_node: 6\nnics_per_node: 4\n", "spread evenly"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            load_topology_yaml(str(tmp_path / name))
    with pytest.raises(ValueError, match="cannot read"):
        load_topology_yaml(str(tmp_path / "absent.yaml"))


def test_topology_from_args():
    topo = topology_from_args(preset="zeppelin-B", num_nodes=2, nic_gbit=100)
    assert (topo.world_size, topo.nic_gbit, topo.gpu_name) == (16, 100, "H800-SXM")
    custom = topology_from_args(num_nodes=2, gpus_per_node=4, nics_per_node=2)
    assert custom.nic_of_gpu == (0, 0, 1, 1)
    assert topology_from_args(yaml_path=str(CONFIGS / "dgx-h100.yaml"), num_nodes=5).num_nodes == 5
    with pytest.raises(ValueError, match="not both"):
        topology_from_args(preset="dgx-h100", yaml_path="x.yaml")
    with pytest.raises(ValueError, match="describe the cluster"):
        topology_from_args(num_nodes=2)
    with pytest.raises(ValueError, match="unknown topology fields"):
        topology_from_args(preset="dgx-h100", num_nodes=1, flux_capacitor=3)
    with pytest.raises(ValueError, match="exceeds gpus_per_node"):
        topology_from_args(num_nodes=1, gpus_per_node=2, nics_per_node=4)


@pytest.mark.parametrize(
    ("env", "shape"),
    [
        ({}, (1, 1)),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, (2, 8)),
        ({"WORLD_SIZE": "4"}, (1, 4)),
        ({"SLURM_NNODES": "4", "SLURM_NTASKS_PER_NODE": "8(x4)"}, (4, 8)),
        ({"SLURM_NNODES": "2", "SLURM_NTASKS": "8"}, (2, 4)),
        ({"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8"}, (2, 8)),
        (
            {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "SLURM_NNODES": "2", "SLURM_NTASKS": "2"},
            (2, 8),
        ),
    ],
)
def test_detect_shapes(env, shape):
    topo = detect_topology(env)
    assert (topo.num_nodes, topo.gpus_per_node) == shape


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"}, "not a multiple of LOCAL_WORLD_SIZE"),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "SLURM_NNODES": "4"}, "SLURM_NNODES=4"),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "4"}, "GROUP_WORLD"),
        ({"WORLD_SIZE": "two"}, "not an integer"),
        ({"LOCAL_WORLD_SIZE": "8"}, "without WORLD_SIZE"),
        ({"SLURM_NNODES": "2", "SLURM_NTASKS": "7"}, "not a multiple of SLURM_NNODES"),
        ({"SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8(x1),4"}, "different task counts"),
        ({"SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NTASKS": "6"}, "differs"),
        (
            {"SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "8", "SLURM_GPUS_ON_NODE": "4"},
            "one rank",
        ),
        ({"SLURM_NNODES": "2"}, "how many ranks"),
    ],
)
def test_detect_contradictions(env, message):
    with pytest.raises(ValueError, match=message):
        detect_topology(env)


def test_detect_with_preset():
    env = {"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8"}
    assert detect_topology(env, preset="zeppelin-A") == get_topology("zeppelin-A", num_nodes=4)
    small = detect_topology({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, preset="zeppelin-A")
    assert isinstance(small, Topology)
    assert (small.num_nodes, small.gpus_per_node, small.nics_per_node) == (2, 2, 2)
    assert small.nic_gbit == 200
    with pytest.raises(ValueError, match="unknown topology preset"):
        detect_topology({}, preset="nope")
