"""Megatron-LM argument glue: the ``--zeppelin*`` flags and the checks they need.

``extra_args_provider`` adds the flags to Megatron's parser (they come from ``ZeppelinConfig``).
``validate_megatron_args`` runs after Megatron's own validation and refuses combinations Zeppelin
cannot run, each with the flag to change:

* each micro-batch is one packed row (``--micro-batch-size 1``);
* every Megatron flag's answer (``coverage``: supported, refused at start-up, or irrelevant)
  is checked; context parallelism (Zeppelin *replaces* it), attention dropout, MoE token
  dropping and the other refused flags stop the run here;
* tensor parallelism runs inside a Zeppelin rank: Zeppelin spans the data-parallel ranks of one
  tensor-parallel index and one pipeline stage, so the Zeppelin world is ``world_size / (tp x
  pp)``; the topology flags describe the physical node and ``zeppelin_node`` derives the
  Zeppelin ranks per node (GPUs / tp) and their NICs;
* pipeline parallelism: each stage's data-parallel group is a Zeppelin world, and every stage
  plans the same plan from the same documents, so a rank sends the next stage as many rows as
  its linear layout holds, which changes per micro-batch: the model's config gets Megatron's
  ``variable_seq_lengths`` (``hooks.model_provider``; the schedules then exchange each
  activation's shape first), which Megatron's allgather MoE token dispatcher refuses
  (``coverage``: ``--moe-token-dispatcher-type``). A stage's GPUs must fill whole nodes or share
  one (``stage_node``), so ``--use-tp-pp-dp-mapping`` (which strides a stage's data-parallel
  ranks over the whole job) is refused with pipeline parallelism;
* sequence parallelism is supported: each rank's linear layout is padded to a multiple of the
  tensor-parallel size (``batch.py``), padding that the loss and the plan never see;
* the loss is per token (``calculate_per_token_loss`` is switched on), so the result over ranks
  with different token counts equals the single-GPU one;
* Megatron's fused RoPE is switched off (``apply_rope_fusion``): RoPE runs per document inside
  Zeppelin's core attention, never in Megatron's attention, with every rotary flag Megatron's
  GPT takes (``rotary.Rope``); position embeddings other than rope, none and learned absolute
  (``yarn``, ``mrope``, ``relative``) are refused;
* a sliding window must be causal (``--window-size L,0``, ``variants.window_left``).

Megatron's rank order puts tensor parallelism fastest and pipeline stages slowest: global rank
``g`` has TP index ``g % tp``, data-parallel (Zeppelin) rank ``g // tp % dp`` and stage
``g // (tp x dp)``; ``zeppelin_ranks`` lists one Zeppelin world.
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


def zeppelin_world_size(world_size: int, tensor_parallel: int, pipeline_parallel: int = 1) -> int:
    """Zeppelin ranks: the data-parallel ranks of one tensor-parallel index and one stage."""
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size {tensor_parallel} does not divide the {world_size} "
            "processes: launch a multiple of the tensor-parallel size"
        )
    if pipeline_parallel < 1 or world_size % (tensor_parallel * pipeline_parallel):
        raise ValueError(
            f"tensor-parallel size {tensor_parallel} x --pipeline-model-parallel-size "
            f"{pipeline_parallel} does not divide the {world_size} processes: launch a multiple "
            "of their product"
        )
    return world_size // (tensor_parallel * pipeline_parallel)


def zeppelin_ranks(
    world_size: int,
    tensor_parallel: int,
    tp_rank: int,
    *,
    pipeline_parallel: int = 1,
    pp_rank: int = 0,
) -> list[int]:
    """Global ranks of the Zeppelin world of TP index ``tp_rank`` in pipeline stage
    ``pp_rank``, in Zeppelin-rank order (Megatron's order: TP fastest, stages slowest)."""
    if not 0 <= tp_rank < tensor_parallel:
        raise ValueError(f"tensor-parallel rank {tp_rank} outside 0..{tensor_parallel - 1}")
    if not 0 <= pp_rank < pipeline_parallel:
        raise ValueError(f"pipeline stage {pp_rank} outside 0..{pipeline_parallel - 1}")
    num = zeppelin_world_size(world_size, tensor_parallel, pipeline_parallel)
    first = pp_rank * num * tensor_parallel
    return [first + z * tensor_parallel + tp_rank for z in range(num)]


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
    # World t holds GPUs t, t + tp, ...; a NIC serving several worlds gives each its share.
    worlds = [[j * tp + t for j in range(gpus // tp)] for t in range(tp)]
    return _part_of_node(physical, worlds, what=f"{tp} tensor-parallel worlds", name=f"tp{tp}")


def _part_of_node(physical: Topology, parts: list[list[int]], *, what: str, name: str) -> Topology:
    """The node one of ``parts`` (equal lists of a node's GPUs that run at once, each its own
    Zeppelin world) sees: its GPUs, the NICs next to them renumbered from 0, and a NIC serving
    GPUs of several parts giving each part its share of the line rate. Every part must see the
    same NIC layout (they execute one plan)."""
    layouts = set()
    for gpus in parts:
        nics = [physical.nic_of_gpu[g] for g in gpus]
        renumber = {nic: i for i, nic in enumerate(sorted(set(nics)))}
        layouts.add(tuple(renumber[n] for n in nics))
    if len(layouts) != 1:
        raise ValueError(
            f"topology {physical.name}: its GPU-to-NIC map {list(physical.nic_of_gpu)} gives the "
            f"{what} different NIC layouts; describe a node whose NIC map repeats every one"
        )
    (nic_of_gpu,) = layouts
    part_of = {g: i for i, gpus in enumerate(parts) for g in gpus}
    sharing = max(
        len({part_of[g] for g in physical.gpus_of_nic(nic)})
        for nic in range(physical.nics_per_node)
    )
    return Topology(
        num_nodes=physical.num_nodes,
        gpus_per_node=len(nic_of_gpu),
        nics_per_node=len(set(nic_of_gpu)),
        nic_of_gpu=nic_of_gpu,
        nvlink_gbps=physical.nvlink_gbps,
        nic_gbit=physical.nic_gbit / sharing,
        gpu_name=physical.gpu_name,
        gpu_tflops=physical.gpu_tflops,
        hbm_gib=physical.hbm_gib,
        name=f"{physical.name}/{name}",
    )


def physical_node(
    config: ZeppelinConfig, zeppelin_world: int, *, tensor_parallel: int, pipeline_parallel: int = 1
) -> Topology:
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
            ranks = zeppelin_world * pipeline_parallel  # of one TP index, over every stage
            if ranks % nodes:
                raise ValueError(
                    f"{ranks} data-parallel ranks do not split evenly over {nodes} "
                    "nodes: change --zeppelin-nodes or the number of processes"
                )
            gpus = ranks // nodes * tp
        nics = min(config.nics_per_node or gpus, gpus)
        return Topology(num_nodes=1, gpus_per_node=gpus, nics_per_node=nics)
    kind = "yaml_path" if name.endswith((".yaml", ".yml")) else "preset"
    return presets.topology_from_args(
        gpus_per_node=config.gpus_per_node, nics_per_node=config.nics_per_node, **{kind: name}
    ).with_nodes(1)


def stage_node(physical: Topology, stage_gpus: int) -> tuple[Topology, int]:
    """The node one pipeline stage's ``stage_gpus`` GPUs see, and how many nodes it spans.

    Megatron gives a stage consecutive global ranks (stages are its slowest rank axis), so a
    stage either fills whole nodes (``stage_gpus`` a multiple of the GPUs per node: the physical
    node, ``stage_gpus / gpus_per_node`` times) or shares one node with other stages
    (``stage_gpus`` a divisor of it: a node of ``stage_gpus`` GPUs and the NICs next to them,
    where a NIC serving several stages gives each its share of the line rate). A stage that
    straddles nodes any other way is refused."""
    gpus = physical.gpus_per_node
    if stage_gpus % gpus == 0:
        return physical, stage_gpus // gpus
    if gpus % stage_gpus:
        raise ValueError(
            f"a pipeline stage holds {stage_gpus} GPUs (tensor-parallel x data-parallel size) "
            f"but a node of topology {physical.name} has {gpus}: Zeppelin needs each stage to "
            "fill whole nodes or a stage count per node that divides the node; change "
            "--pipeline-model-parallel-size or the number of processes"
        )
    stages = [list(range(first, first + stage_gpus)) for first in range(0, gpus, stage_gpus)]
    node = _part_of_node(physical, stages, what=f"stages of {stage_gpus} GPUs", name="stage")
    return node.with_nodes(1), 1


def resolve_topology(
    config: ZeppelinConfig,
    zeppelin_world: int,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> Topology:
    """The topology of one Zeppelin world: the physical node the flags describe, cut to one
    pipeline stage (``stage_node``), shaped for tensor parallelism (``zeppelin_node``), on as
    many nodes as the stage's data-parallel ranks fill. Raises ``ValueError`` saying what to
    change when it does not match."""
    tp, pp = tensor_parallel, pipeline_parallel
    physical = physical_node(config, zeppelin_world, tensor_parallel=tp, pipeline_parallel=pp)
    whole_node = zeppelin_node(physical, tp)  # refuses a TP that does not divide the node
    processes = zeppelin_world * tp * pp
    nodes = config.nodes or max(1, processes // physical.gpus_per_node)
    if nodes * physical.gpus_per_node != processes:
        stages = f" x PP {pp}" if pp > 1 else ""
        raise ValueError(
            f"--zeppelin-topology {config.topology} has {physical.gpus_per_node} GPUs per node, "
            f"i.e. {whole_node.gpus_per_node} Zeppelin ranks per node with tensor-parallel size "
            f"{tp}, so {nodes} nodes hold {nodes * whole_node.gpus_per_node} ranks, but "
            f"{zeppelin_world} data-parallel ranks run ({processes} processes / TP {tp}{stages}): "
            "set --zeppelin-nodes and --zeppelin-gpus-per-node so that nodes x GPUs per node "
            "is the number of processes"
        )
    node, stage_nodes = stage_node(physical, zeppelin_world * tp)
    shaped = whole_node if node is physical else zeppelin_node(node, tp)
    return shaped.with_nodes(stage_nodes)


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
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    zeppelin_world = zeppelin_world_size(world_size, tp, pp)
    resolve_topology(config, zeppelin_world, tensor_parallel=tp, pipeline_parallel=pp)
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
