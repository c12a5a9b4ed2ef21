"""Pure model of the cluster (nodes, GPUs, NICs, rails), named presets, and the one probe that
reads launcher variables."""

from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import (
    PRESETS,
    get_topology,
    load_topology_yaml,
    preset_yaml,
    topology_from_args,
)
from megatron_zeppelin.topology.probe import detect_topology

__all__ = [
    "PRESETS",
    "Topology",
    "detect_topology",
    "get_topology",
    "load_topology_yaml",
    "preset_yaml",
    "topology_from_args",
]
