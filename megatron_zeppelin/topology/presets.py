"""Named cluster designs, topology YAML files, and the one function that turns flags into a
``Topology``.

A preset is a *node design*: GPU model, GPUs and NICs per node, which GPU sits next to which NIC,
link speeds. The node count is always the caller's (``num_nodes``), since the same design serves
2 nodes or 128. Figures come from the package's ``data/hardware.json`` (published datasheet and
paper figures); a calibration file replaces them with measurements in the cost model.

``configs/topology/<preset>.yaml`` holds the same designs in editable form::

    name: zeppelin-C
    num_nodes: 1          # override with --num-nodes
    gpus_per_node: 8
    nics_per_node: 8
    ...

A YAML file may also start from a preset and change a few fields (``preset: dgx-h100`` plus
``nic_gbit: 200``).
"""

from __future__ import annotations

import json
from dataclasses import fields
from importlib import resources
from typing import Any

import yaml

from megatron_zeppelin.topology.model import Topology

# zeppelin-B's NIC speed is not published; 400 Gb/s is the usual part for H800 clusters.
_ASSUMED_NIC_GBIT = 400.0

_TOPOLOGY_FIELDS = tuple(f.name for f in fields(Topology))


def _load_hardware() -> dict[str, Any]:
    text = resources.files("megatron_zeppelin").joinpath("data/hardware.json").read_text()
    return json.loads(text)


def _build_presets() -> dict[str, Topology]:
    hardware = _load_hardware()
    presets: dict[str, Topology] = {}
    for name, cluster in hardware["clusters"].items():
        gpu = hardware["gpus"][cluster["gpu"]]
        presets[name] = Topology(
            num_nodes=1,
            gpus_per_node=int(cluster["gpus_per_node"]),
            nics_per_node=int(cluster["nics_per_node"]),
            nvlink_gbps=float(gpu["nvlink_gbps_per_direction"]),
            nic_gbit=float(cluster["nic_gbit"] or _ASSUMED_NIC_GBIT),
            gpu_name=cluster["gpu"],
            gpu_tflops=float(gpu["bf16_dense_tflops"]),
            hbm_gib=float(gpu["hbm_gib"]),
            name=name,
        )
    return presets


PRESETS: dict[str, Topology] = _build_presets()
"""Node designs by name, each with ``num_nodes=1``; see ``get_topology``."""


def get_topology(preset: str, *, num_nodes: int) -> Topology:
    """The preset's node design on ``num_nodes`` nodes."""
    if preset not in PRESETS:
        raise ValueError(f"unknown topology preset {preset!r}; known presets: {', '.join(PRESETS)}")
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a positive integer, got {num_nodes!r}")
    return PRESETS[preset].with_nodes(num_nodes)


def _with_fields(base: Topology, changes: dict[str, Any]) -> Topology:
    """``base`` with some fields changed. Changing the GPU or NIC count without giving
    ``nic_of_gpu`` drops the old GPU-to-NIC map, so GPUs spread evenly over the new NICs."""
    data = base.to_dict()
    if ("gpus_per_node" in changes or "nics_per_node" in changes) and "nic_of_gpu" not in changes:
        shape_changed = any(
            data[k] != changes.get(k, data[k]) for k in ("gpus_per_node", "nics_per_node")
        )
        if shape_changed:
            data["nic_of_gpu"] = []
    data.update(changes)
    return Topology.from_dict(data)


def load_topology_yaml(path: str, *, num_nodes: int | None = None) -> Topology:
    """Read a topology YAML file (see the module docstring); ``num_nodes`` overrides the file's."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"cannot read topology file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"topology file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(
            f"topology file {path} must be a mapping of fields such as gpus_per_node and "
            f"nics_per_node, got {type(data).__name__}"
        )
    data = dict(data)
    unknown = sorted(set(data) - set(_TOPOLOGY_FIELDS) - {"preset"})
    if unknown:
        raise ValueError(
            f"topology file {path}: unknown fields {unknown}; known: preset, "
            f"{', '.join(_TOPOLOGY_FIELDS)}"
        )
    if num_nodes is not None:
        data["num_nodes"] = num_nodes
    try:
        preset = data.pop("preset", None)
        if preset is not None:
            base = get_topology(str(preset), num_nodes=int(data.pop("num_nodes", 1)))
            return _with_fields(base, data)
        missing = [k for k in ("num_nodes", "gpus_per_node", "nics_per_node") if k not in data]
        if missing:
            raise ValueError(f"missing fields {missing} (or name a preset with 'preset:')")
        if "nic_of_gpu" in data:
            data["nic_of_gpu"] = tuple(data["nic_of_gpu"] or ())
        return Topology(**data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"topology file {path}: {exc}") from exc


def topology_from_args(
    *,
    preset: str | None = None,
    num_nodes: int | None = None,
    gpus_per_node: int | None = None,
    nics_per_node: int | None = None,
    yaml_path: str | None = None,
    **overrides: Any,
) -> Topology:
    """The topology that command-line flags describe.

    Start from ``yaml_path`` or ``preset`` (at most one), or from a custom node when neither is
    given (then ``gpus_per_node`` is required; ``nics_per_node`` defaults to one NIC per GPU).
    Every argument that is not ``None`` replaces the base's field; ``overrides`` may name any
    other ``Topology`` field (``nic_gbit=200``).
    """
    unknown = sorted(set(overrides) - set(_TOPOLOGY_FIELDS))
    if unknown:
        raise ValueError(f"unknown topology fields {unknown}; known: {', '.join(_TOPOLOGY_FIELDS)}")
    if preset is not None and yaml_path is not None:
        raise ValueError("give either a topology preset or a topology YAML file, not both")
    changes = {k: v for k, v in overrides.items() if v is not None}
    for key, value in (
        ("num_nodes", num_nodes),
        ("gpus_per_node", gpus_per_node),
        ("nics_per_node", nics_per_node),
    ):
        if value is not None:
            changes[key] = value
    if "nic_of_gpu" in changes:
        changes["nic_of_gpu"] = tuple(changes["nic_of_gpu"])
    if yaml_path is not None:
        base = load_topology_yaml(yaml_path)
    elif preset is not None:
        base = get_topology(preset, num_nodes=1)
    else:
        if gpus_per_node is None:
            raise ValueError(
                "describe the cluster: give a preset (one of "
                f"{', '.join(PRESETS)}), a topology YAML file, or gpus_per_node"
            )
        base = Topology(num_nodes=1, gpus_per_node=gpus_per_node, nics_per_node=gpus_per_node)
    return _with_fields(base, changes)


def preset_yaml(name: str) -> str:
    """The YAML text of a preset, as shipped in ``configs/topology/<name>.yaml``."""
    topo = get_topology(name, num_nodes=1)
    lines = [f"# Node design {name}: {topo.gpu_name}. Set the node count with --num-nodes."]
    for key, value in topo.to_dict().items():
        lines.append(f"{key}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"
