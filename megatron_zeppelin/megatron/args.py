"""Megatron-LM argument glue: the ``--zeppelin*`` flags and the checks they need.

``extra_args_provider`` adds the flags to Megatron's parser (they come from ``ZeppelinConfig``).
``validate_megatron_args`` runs after Megatron's own validation and refuses combinations Zeppelin
cannot run, each with the flag to change:

* each micro-batch is one packed row (``--micro-batch-size 1``);
* every Megatron flag's answer (``coverage``: supported, refused at start-up, or irrelevant)
  is checked; context parallelism (Zeppelin *replaces* it), pipeline parallelism,
  attention dropout, MoE token dropping and the other refused flags stop the run here;
* tensor parallelism runs inside a Zeppelin rank: Zeppelin spans the data-parallel ranks of one
  tensor-parallel index, so the Zeppelin world is ``world_size / tp``; the topology flags
  describe the physical node and ``zeppelin_node`` derives the Zeppelin ranks per node
  (GPUs / tp) and their NICs;
* sequence parallelism is supported: each rank's linear layout is padded to a multiple of the
  tensor-parallel size (``batch.py``), padding that the loss and the plan never see;
* the loss is per token (``calculate_per_token_loss`` is switched on), so the result over ranks
  with different token counts equals the single-GPU one;
* Megatron's fused RoPE is switched off (``apply_rope_fusion``): RoPE runs per document inside
  Zeppelin's core attention, never in Megatron's attention.

Megatron's rank order puts tensor parallelism fastest: global rank ``g`` has TP index ``g % tp``
and data-parallel (Zeppelin) rank ``g // tp``; ``zeppelin_ranks`` lists one Zeppelin world.
"""

from __future__ import annotations

import argparse

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.megatron import coverage
from megatron_zeppelin.topology import presets
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.probe import detect_topology


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


def zeppelin_node(physical: Topology, tensor_parallel: int) -> Topology:
    """The node shape one Zeppelin world sees on ``physical`` nodes with tensor parallelism.

    Megatron puts a Zeppelin rank's ``tp`` GPUs next to each other on a node (TP is the fastest
    rank axis), so a node holds ``gpus_per_node / tp`` Zeppelin ranks; Zeppelin rank ``j`` of
    the world of TP index ``t`` is GPU ``j * tp + t`` and talks through that GPU's NIC. The
    ``tp`` worlds run their rings at once, so a NIC serving GPUs of several worlds gives each
    world its share of the line rate. Every world must see the same shape (they execute one
    plan); a TP that does not divide the GPUs per node is refused.
    """
    gpus, tp = physical.gpus_per_node, tensor_parallel
    if tp < 1 or gpus % tp:
        raise ValueError(
            f"--tensor-model-parallel-size {tp} does not divide the {gpus} GPUs per node of "
            f"topology {physical.name}: tensor parallelism must stay inside a node, so use a "
            "TP that divides the GPUs per node"
        )
    if tp == 1:
        return physical
    shapes = set()
    for t in range(tp):
        nics = [physical.nic_of_gpu[j * tp + t] for j in range(gpus // tp)]
        renumber = {nic: i for i, nic in enumerate(sorted(set(nics)))}
        shapes.add(tuple(renumber[n] for n in nics))
    if len(shapes) != 1:
        raise ValueError(
            f"topology {physical.name}: its GPU-to-NIC map {list(physical.nic_of_gpu)} gives the "
            f"{tp} tensor-parallel worlds different NIC layouts; describe a node whose NIC map "
            "repeats every tensor-parallel group"
        )
    (nic_of_rank,) = shapes
    # Worlds that use one NIC: GPUs next to it with different TP indices.
    sharing = max(
        len({g % tp for g in physical.gpus_of_nic(nic)}) for nic in range(physical.nics_per_node)
    )
    return Topology(
        num_nodes=physical.num_nodes,
        gpus_per_node=gpus // tp,
        nics_per_node=len(set(nic_of_rank)),
        nic_of_gpu=nic_of_rank,
        nvlink_gbps=physical.nvlink_gbps,
        nic_gbit=physical.nic_gbit / sharing,
        gpu_name=physical.gpu_name,
        gpu_tflops=physical.gpu_tflops,
        hbm_gib=physical.hbm_gib,
        name=f"{physical.name}/tp{tp}",
    )


def physical_node(config: ZeppelinConfig, zeppelin_world: int, *, tensor_parallel: int) -> Topology:
    """One physical node as the flags describe it (a preset, a YAML file, 'custom' or 'auto');
    ``--zeppelin-gpus-per-node`` and ``--zeppelin-nics-per-node`` count physical GPUs and NICs."""

    name, tp = config.topology, tensor_parallel
    if name == "auto":
        # The launcher's processes per node are GPUs (one process per GPU).
        gpus = config.gpus_per_node or detect_topology().gpus_per_node
        nics = min(config.nics_per_node or gpus, gpus)
        return Topology(num_nodes=1, gpus_per_node=gpus, nics_per_node=nics)
    if name == "custom":
        gpus = config.gpus_per_node
        if gpus is None:
            nodes = config.nodes or 1
            if zeppelin_world % nodes:
                raise ValueError(
                    f"{zeppelin_world} data-parallel ranks do not split evenly over {nodes} "
                    "nodes: change --zeppelin-nodes or the number of processes"
                )
            gpus = zeppelin_world // nodes * tp
        nics = min(config.nics_per_node or gpus, gpus)
        return Topology(num_nodes=1, gpus_per_node=gpus, nics_per_node=nics)
    kind = "yaml_path" if name.endswith((".yaml", ".yml")) else "preset"
    return presets.topology_from_args(
        gpus_per_node=config.gpus_per_node, nics_per_node=config.nics_per_node, **{kind: name}
    ).with_nodes(1)


def resolve_topology(
    config: ZeppelinConfig, zeppelin_world: int, *, tensor_parallel: int = 1
) -> Topology:
    """The topology of one Zeppelin world: the physical node the flags describe, shaped for
    tensor parallelism (``zeppelin_node``), on as many nodes as the data-parallel ranks fill.
    Raises ``ValueError`` saying what to change when it does not match."""
    node = zeppelin_node(
        physical_node(config, zeppelin_world, tensor_parallel=tensor_parallel), tensor_parallel
    )
    nodes = config.nodes or max(1, zeppelin_world // node.gpus_per_node)
    topology = node.with_nodes(nodes)
    if topology.world_size != zeppelin_world:
        per_node = node.gpus_per_node * tensor_parallel
        raise ValueError(
            f"--zeppelin-topology {config.topology} has {per_node} GPUs per node, i.e. "
            f"{node.gpus_per_node} Zeppelin ranks per node with tensor-parallel size "
            f"{tensor_parallel}, so {nodes} nodes hold {topology.world_size} ranks, but "
            f"{zeppelin_world} data-parallel ranks run (world size / tensor-parallel size): set "
            "--zeppelin-nodes and --zeppelin-gpus-per-node so that nodes x GPUs per node is "
            "the number of processes"
        )
    return topology


def validate_megatron_args(args: argparse.Namespace, *, world_size: int) -> ZeppelinConfig:
    """Check Megatron's parsed ``args`` against Zeppelin's needs (see the module docstring);
    switch on per-token loss; return the validated ``ZeppelinConfig``."""
    config = ZeppelinConfig.from_args(args)
    if not config.enabled:
        return config
    micro_batch = int(getattr(args, "micro_batch_size", 1) or 1)
    if micro_batch != 1:
        raise ValueError(
            f"--zeppelin packs each micro-batch's documents into one row: set "
            f"--micro-batch-size 1 (got {micro_batch}); the token budget sets its size"
        )
    refusal = coverage.first_refusal(args)
    if refusal:
        raise ValueError(refusal)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    zeppelin_world = zeppelin_world_size(world_size, tp)
    resolve_topology(config, zeppelin_world, tensor_parallel=tp)
    # Ranks hold different token counts: only a per-token loss matches single-GPU training.
    args.calculate_per_token_loss = True
    # Zeppelin's core attention applies RoPE per document; Megatron's fused RoPE never runs,
    # so its config must not ask for the TransformerEngine kernel behind it.
    if hasattr(args, "apply_rope_fusion"):
        args.apply_rope_fusion = False
    return config


def is_enabled(args: argparse.Namespace) -> bool:
    """Whether ``--zeppelin`` was given."""
    return bool(getattr(args, "zeppelin", False))
