"""The one place that reads the environment to find the cluster's shape.

Launchers say how many processes run and how many share a node:

* torchrun sets ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (and ``GROUP_WORLD_SIZE``, the node
  count, with the elastic agent);
* SLURM sets ``SLURM_NNODES``, ``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE`` (e.g. ``8`` or
  ``8(x4)``) and ``SLURM_GPUS_ON_NODE``.

torchrun's figures win when both are present (torchrun inside a one-task-per-node SLURM job is the
common case), but they must agree with ``SLURM_NNODES``. Every contradiction is a ``ValueError``
that names the variables, since a wrong shape would silently place rings across the wrong links.
One rank runs per GPU. Link speeds and the NIC layout come from ``preset`` (or the defaults of a
custom node with one NIC per GPU); nothing here probes the hardware itself.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.presets import PRESETS, get_topology


def _int_var(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        number = int(value.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    if number < 1:
        raise ValueError(f"environment variable {name}={value!r} must be at least 1")
    return number


def _tasks_per_node(env: Mapping[str, str]) -> int | None:
    """``SLURM_NTASKS_PER_NODE``: ``8``, ``8(x4)`` or ``8(x2),8``; nodes must be alike."""
    value = env.get("SLURM_NTASKS_PER_NODE")
    if value is None or value.strip() == "":
        return None
    counts = set()
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(\(x\d+\))?\s*", part)
        if match is None:
            raise ValueError(f"cannot parse SLURM_NTASKS_PER_NODE={value!r}")
        counts.add(int(match.group(1)))
    if len(counts) != 1:
        raise ValueError(
            f"SLURM_NTASKS_PER_NODE={value!r} gives nodes different task counts; "
            "run the same number of ranks on every node"
        )
    (count,) = counts
    if count < 1:
        raise ValueError(f"SLURM_NTASKS_PER_NODE={value!r} must be at least 1")
    return count


def _slurm_shape(env: Mapping[str, str]) -> tuple[int, int] | None:
    num_nodes = _int_var(env, "SLURM_NNODES")
    if num_nodes is None:
        return None
    num_tasks = _int_var(env, "SLURM_NTASKS")
    per_node = _tasks_per_node(env)
    gpus_on_node = _int_var(env, "SLURM_GPUS_ON_NODE")
    if per_node is None and num_tasks is not None:
        if num_tasks % num_nodes:
            raise ValueError(
                f"SLURM_NTASKS={num_tasks} is not a multiple of SLURM_NNODES={num_nodes}; "
                "run the same number of ranks on every node"
            )
        per_node = num_tasks // num_nodes
    if per_node is None:
        per_node = gpus_on_node
    if per_node is None:
        raise ValueError(
            "SLURM_NNODES is set but neither SLURM_NTASKS_PER_NODE, SLURM_NTASKS nor "
            "SLURM_GPUS_ON_NODE says how many ranks share a node"
        )
    if num_tasks is not None and num_tasks != num_nodes * per_node:
        raise ValueError(
            f"SLURM_NTASKS={num_tasks} differs from SLURM_NNODES={num_nodes} x "
            f"{per_node} tasks per node"
        )
    if gpus_on_node is not None and per_node > gpus_on_node:
        raise ValueError(
            f"{per_node} tasks per node but SLURM_GPUS_ON_NODE={gpus_on_node}: "
            "Zeppelin runs one rank per GPU"
        )
    return num_nodes, per_node


def _torchrun_shape(env: Mapping[str, str]) -> tuple[int, int] | None:
    world = _int_var(env, "WORLD_SIZE")
    local = _int_var(env, "LOCAL_WORLD_SIZE")
    if world is None:
        if local is not None:
            raise ValueError("LOCAL_WORLD_SIZE is set without WORLD_SIZE")
        return None
    if local is None:
        local = world  # a single-node launch that only sets WORLD_SIZE
    if world % local:
        raise ValueError(
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}; "
            "run the same number of ranks on every node"
        )
    num_nodes = world // local
    groups = _int_var(env, "GROUP_WORLD_SIZE")
    if groups is not None and groups != num_nodes:
        raise ValueError(
            f"GROUP_WORLD_SIZE={groups} nodes, but WORLD_SIZE={world} / "
            f"LOCAL_WORLD_SIZE={local} gives {num_nodes}"
        )
    return num_nodes, local


def detect_topology(env: Mapping[str, str] | None = None, *, preset: str | None = None) -> Topology:
    """The cluster shape from launcher variables (``os.environ`` by default).

    Without any launcher variable this is one process: one node with one GPU. ``preset`` supplies
    link speeds and the NIC layout; when the detected GPUs per node differ from the preset's, the
    NIC count becomes the largest divisor of both, so GPUs still spread evenly over NICs.
    """
    env = os.environ if env is None else env
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown topology preset {preset!r}; known presets: {', '.join(PRESETS)}")
    torchrun = _torchrun_shape(env)
    if torchrun is not None:
        # Under torchrun SLURM's task variables count agents, not ranks: only the nodes agree.
        num_nodes, gpus_per_node = torchrun
        slurm_nodes = _int_var(env, "SLURM_NNODES")
        if slurm_nodes is not None and slurm_nodes != num_nodes:
            raise ValueError(
                f"torchrun variables give {num_nodes} nodes but SLURM_NNODES={slurm_nodes}; "
                "launch torchrun on every node of the allocation"
            )
    else:
        num_nodes, gpus_per_node = _slurm_shape(env) or (1, 1)
    if preset is None:
        return Topology(
            num_nodes=num_nodes, gpus_per_node=gpus_per_node, nics_per_node=gpus_per_node
        )
    base = get_topology(preset, num_nodes=num_nodes)
    if base.gpus_per_node == gpus_per_node:
        return base
    data = base.to_dict()
    data.update(
        gpus_per_node=gpus_per_node,
        nics_per_node=math.gcd(base.nics_per_node, gpus_per_node),
        nic_of_gpu=[],
    )
    return Topology.from_dict(data)
