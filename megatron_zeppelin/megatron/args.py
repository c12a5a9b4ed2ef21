"""Megatron-LM argument glue: the ``--zeppelin*`` flags and the checks they need.

``extra_args_provider`` adds the flags to Megatron's parser (they come from ``ZeppelinConfig``).
``validate_megatron_args`` runs after Megatron's own validation and refuses combinations Zeppelin
cannot run, each with the flag to change:

* Zeppelin *replaces* context parallelism, so ``--context-parallel-size`` must stay 1;
* pipeline parallelism is not supported yet;
* tensor parallelism runs inside a Zeppelin rank: Zeppelin spans the data-parallel ranks of one
  tensor-parallel index, so the Zeppelin world is ``world_size / tp`` and the topology describes
  those ranks (``gpus_per_node`` counts data-parallel ranks per node, i.e. GPUs / tp);
* each micro-batch is one packed row (``--micro-batch-size 1``);
* the loss is per token (``calculate_per_token_loss`` is switched on), so the result over ranks
  with different token counts equals the single-GPU one.

Megatron's rank order puts tensor parallelism fastest: global rank ``g`` has TP index ``g % tp``
and data-parallel (Zeppelin) rank ``g // tp``; ``zeppelin_ranks`` lists one Zeppelin world.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.topology.model import Topology


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider``: adds ``--zeppelin`` and the ``--zeppelin-*`` flags."""
    return ZeppelinConfig.add_arguments(parser)


def zeppelin_world_size(world_size: int, tensor_parallel: int) -> int:
    """Zeppelin ranks: the data-parallel ranks of one tensor-parallel index."""
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size {tensor_parallel} does not divide the {world_size} "
            "processes: launch a multiple of the tensor-parallel size"
        )
    return world_size // tensor_parallel


def zeppelin_ranks(world_size: int, tensor_parallel: int, tp_rank: int) -> list[int]:
    """Global ranks of the Zeppelin world of TP index ``tp_rank``, in Zeppelin-rank order."""
    if not 0 <= tp_rank < tensor_parallel:
        raise ValueError(f"tensor-parallel rank {tp_rank} outside 0..{tensor_parallel - 1}")
    num = zeppelin_world_size(world_size, tensor_parallel)
    return [z * tensor_parallel + tp_rank for z in range(num)]


def resolve_topology(
    config: ZeppelinConfig, zeppelin_world: int, *, tensor_parallel: int = 1
) -> Topology:
    """The topology of the Zeppelin ranks, from the flags (a preset, a YAML file, 'custom' or
    'auto'); raises ``ValueError`` saying what to change when it does not match."""
    from megatron_zeppelin.topology import presets

    name = config.topology
    if name == "auto":
        from megatron_zeppelin.topology.probe import detect_topology

        found = detect_topology()
        # The launcher counts processes; with tensor parallelism a Zeppelin rank is tp of them.
        gpus = config.gpus_per_node or max(1, found.gpus_per_node // tensor_parallel)
        nodes = config.nodes or max(1, zeppelin_world // gpus)
        nics = config.nics_per_node or gpus
        topology = Topology(num_nodes=nodes, gpus_per_node=gpus, nics_per_node=min(nics, gpus))
    elif name == "custom":
        gpus = config.gpus_per_node
        if gpus is None:
            nodes = config.nodes or 1
            if zeppelin_world % nodes:
                raise ValueError(
                    f"{zeppelin_world} data-parallel ranks do not split evenly over {nodes} "
                    "nodes: change --zeppelin-nodes or the number of processes"
                )
            gpus = zeppelin_world // nodes
        nics = min(config.nics_per_node or gpus, gpus)
        nodes = config.nodes or max(1, zeppelin_world // gpus)
        topology = Topology(num_nodes=nodes, gpus_per_node=gpus, nics_per_node=nics)
    else:
        kwargs: dict[str, Any] = {}
        if name.endswith((".yaml", ".yml")):
            kwargs["yaml_path"] = name
        else:
            kwargs["preset"] = name
        base = presets.topology_from_args(
            gpus_per_node=config.gpus_per_node, nics_per_node=config.nics_per_node, **kwargs
        )
        nodes = config.nodes or max(1, zeppelin_world // base.gpus_per_node)
        topology = base.with_nodes(nodes)
    if topology.world_size != zeppelin_world and name not in ("auto", "custom"):
        raise ValueError(
            f"--zeppelin-topology {name} has {topology.gpus_per_node} GPUs per node, so "
            f"{topology.num_nodes} nodes hold {topology.world_size} ranks, but "
            f"{zeppelin_world} data-parallel ranks run (world size / tensor-parallel size "
            f"{tensor_parallel}): set --zeppelin-gpus-per-node and --zeppelin-nodes so that "
            "their product is the data-parallel size"
        )
    if topology.world_size != zeppelin_world:
        raise ValueError(
            f"the Zeppelin topology has {topology.num_nodes} nodes x {topology.gpus_per_node} "
            f"GPUs = {topology.world_size} ranks, but {zeppelin_world} data-parallel ranks run "
            f"(world size / tensor-parallel size {tensor_parallel}): set --zeppelin-nodes and "
            "--zeppelin-gpus-per-node so that their product is the data-parallel size"
        )
    return topology


def validate_megatron_args(args: argparse.Namespace, *, world_size: int) -> ZeppelinConfig:
    """Check Megatron's parsed ``args`` against Zeppelin's needs (see the module docstring);
    switch on per-token loss; return the validated ``ZeppelinConfig``."""
    config = ZeppelinConfig.from_args(args)
    if not config.enabled:
        return config
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if cp != 1:
        raise ValueError(
            f"--zeppelin replaces context parallelism: set --context-parallel-size 1 (got {cp}); "
            "Zeppelin spreads long documents over the data-parallel ranks instead"
        )
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if pp != 1:
        raise ValueError(
            f"--zeppelin does not support pipeline parallelism yet: set "
            f"--pipeline-model-parallel-size 1 (got {pp}) and use tensor parallelism or more "
            "data-parallel ranks"
        )
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    zeppelin_world = zeppelin_world_size(world_size, tp)
    micro_batch = int(getattr(args, "micro_batch_size", 1) or 1)
    if micro_batch != 1:
        raise ValueError(
            f"--zeppelin packs each micro-batch's documents into one row: set "
            f"--micro-batch-size 1 (got {micro_batch}); the token budget sets its size"
        )
    if getattr(args, "sequence_parallel", False):
        raise ValueError(
            "--zeppelin does not support --sequence-parallel yet (linear layouts are not a "
            "multiple of the tensor-parallel size): drop --sequence-parallel"
        )
    position = getattr(args, "position_embedding_type", "rope")
    if position not in ("rope", "none", "learned_absolute"):
        raise ValueError(
            f"--zeppelin supports --position-embedding-type rope, none or learned_absolute, "
            f"not {position!r}"
        )
    if getattr(args, "rotary_interleaved", False):
        raise ValueError(
            "--zeppelin applies RoPE in Megatron's default layout: drop --rotary-interleaved"
        )
    resolve_topology(config, zeppelin_world, tensor_parallel=tp)
    # Ranks hold different token counts: only a per-token loss matches single-GPU training.
    args.calculate_per_token_loss = True
    return config


def is_enabled(args: argparse.Namespace) -> bool:
    """Whether ``--zeppelin`` was given."""
    return bool(getattr(args, "zeppelin", False))
