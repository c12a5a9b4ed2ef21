"""What a Zeppelin run builds once: parallel state, the model, the cost model, the transport.

Shared by the CPU job and the check (the Megatron hooks build the same pieces from Megatron's
own arguments). The micro-batch step itself is ``step.py``; after a step's last micro-batch the
gradients are summed over the Zeppelin ranks and divided by the global token count
(``loss.py``).

Parallel layout: Megatron's tensor parallelism is the fastest axis (global rank ``g`` has TP index
``g % tp``); the Zeppelin ranks are the data-parallel ranks of one TP index, so there are ``tp``
Zeppelin worlds of ``world / tp`` ranks each, all planning the same plan. Megatron's own
data-parallel group of a TP index is exactly its Zeppelin world and serves the remap all-to-all
and the gradient sum.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.random import initialize_rng_tracker
from megatron.core.transformer import TransformerConfig

from megatron_zeppelin.comm.counters import LinkCounters
from megatron_zeppelin.comm.exchange import DistExchanger
from megatron_zeppelin.comm.groups import ZeppelinGroups
from megatron_zeppelin.comm.plan_share import PlanShare
from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.megatron.args import zeppelin_ranks
from megatron_zeppelin.megatron.model.norms import (
    needs_sequence_parallel_norms,
    sequence_parallel_spec,
)
from megatron_zeppelin.megatron.model.rotary import Rope
from megatron_zeppelin.megatron.precision import DTYPES
from megatron_zeppelin.megatron.spec import zeppelin_layer_spec
from megatron_zeppelin.planner.cost.calibration import apply_calibration, load_calibration
from megatron_zeppelin.planner.cost.costmodel import CostModel, causal_pairs
from megatron_zeppelin.planner.cost.models import ModelSpec, model_from_config
from megatron_zeppelin.planner.plan.heads import AttentionShape
from megatron_zeppelin.planner.plan.plan import Plan
from megatron_zeppelin.planner.plan.schedule import engine_link_bytes
from megatron_zeppelin.topology.model import Topology


@dataclass(frozen=True)
class ModelDims:
    """A small Llama-style GPT: RMSNorm, SwiGLU, GQA, per-document RoPE, no biases."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden_size: int = 128
    vocab_size: int = 512
    rotary_base: float = 10000.0
    dtype: str = "float32"
    """``float32`` or ``bf16`` (``precision.DTYPES``): parameters and activations."""

    def transformer_config(self, *, tensor_parallel: int = 1, sequence_parallel: bool = False):
        """Megatron's ``TransformerConfig`` of this model (initialized on the CPU)."""
        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_heads,
            num_query_groups=self.num_kv_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            params_dtype=DTYPES[self.dtype],
            bf16=self.dtype == "bf16",
            calculate_per_token_loss=True,
            tensor_model_parallel_size=tensor_parallel,
            sequence_parallel=sequence_parallel,
        )

    def model_spec(self, *, tensor_parallel: int = 1) -> ModelSpec:
        """The planner's view of this model, from the config the model is built with."""
        config = self.transformer_config(tensor_parallel=tensor_parallel)
        return model_from_config(config, vocab_size=self.vocab_size, name="cpu-gpt")


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits: its TP index and its Zeppelin (data-parallel) rank."""

    tensor_parallel: int
    tp_rank: int
    zeppelin_rank: int
    zeppelin_world: int
    global_ranks: tuple[int, ...]
    """Global ranks of this process's Zeppelin world, in Zeppelin-rank order."""
    dp_group: dist.ProcessGroup


def init_megatron_parallel(tensor_parallel: int) -> ParallelContext:
    """Initialize Megatron's parallel state on the running (gloo) world; CP = PP = 1."""
    world = dist.get_world_size()
    if world % tensor_parallel:
        raise ValueError(f"tensor parallel {tensor_parallel} does not divide {world} processes")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ranks = tuple(zeppelin_ranks(world, tensor_parallel, tp_rank))
    group = parallel_state.get_data_parallel_group()
    assert tuple(dist.get_process_group_ranks(group)) == ranks, "unexpected Megatron rank order"
    return ParallelContext(
        tensor_parallel=tensor_parallel,
        tp_rank=tp_rank,
        zeppelin_rank=parallel_state.get_data_parallel_rank(),
        zeppelin_world=len(ranks),
        global_ranks=ranks,
        dp_group=group,
    )


def build_gpt(dims: ModelDims, *, seed: int, layer_spec=None, sequence_parallel: bool = False):
    """Megatron's ``GPTModel`` on the CPU, in ``dims.dtype``, with Zeppelin's layer spec.

    Weights come from ``seed`` through Megatron's CPU initialization, which draws every full
    weight and keeps this TP rank's slice: the same seed gives the same model whatever the TP size.
    ``layer_spec`` replaces the Zeppelin local spec (the check's reference model uses that).
    """
    config = dims.transformer_config(
        tensor_parallel=_tp_size(), sequence_parallel=sequence_parallel
    )
    spec = layer_spec or zeppelin_layer_spec("local", rope=Rope(base=dims.rotary_base))
    if sequence_parallel:
        emulate_cuda_device_on_cpu()
        if needs_sequence_parallel_norms(spec):
            spec = sequence_parallel_spec(spec, dims.num_layers)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=dims.vocab_size,
            max_sequence_length=1 << 20,  # unused: no learned positions
            position_embedding_type="none",  # RoPE is per document, inside core attention
            share_embeddings_and_output_weights=False,
        )
    return model


def emulate_cuda_device_on_cpu() -> None:
    """Let Megatron's sequence-parallel code run in CPU processes that stand in for GPUs.

    Megatron's sequence-parallel gather and reduce-scatter (``tensor_parallel/mappings.py``)
    allocate their outputs on ``torch.cuda.current_device()``, and its embedding forks the
    model-parallel CUDA RNG around dropout (``get_cuda_rng_tracker().fork()``). Without CUDA,
    the first answers the CPU here and the second uses Megatron's own tracker whose fork does
    nothing (the CPU model has no dropout). Does nothing where CUDA is available, so a GPU run
    never goes through it."""
    if torch.cuda.is_available():
        return

    torch.cuda.current_device = lambda: torch.device("cpu")
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def build_cost_model(
    dims: ModelDims | ModelSpec,
    topology: Topology,
    *,
    tensor_parallel: int = 1,
    calibration: str | None,
) -> CostModel:
    """Datasheet cost model, with a calibration file's measured figures where one is given.
    ``dims``: the planner's model (``planner.cost.models.model_from_config``), or the CPU job's
    dimensions with its tensor-parallel size."""
    spec = dims if isinstance(dims, ModelSpec) else dims.model_spec(tensor_parallel=tensor_parallel)
    cost = CostModel.default(spec, topology)
    if calibration:
        cost = apply_calibration(cost, load_calibration(calibration), source=calibration)
    return cost


def create_transport(topology: Topology, ctx: ParallelContext, config: ZeppelinConfig):
    """Ring exchanger and link counters of this rank's Zeppelin world (every process calls it,
    once, in the same order: it creates the groups of every Zeppelin world).

    ``comm``'s point-to-point ``DistExchanger`` (routing, overlapped relays, byte counters) on
    ``ZeppelinGroups`` of ``ctx.global_ranks``: with tensor parallelism 1 the whole world, with
    tensor parallelism > 1 the data-parallel ranks of this TP index. Sum the counters over
    ``ctx.dp_group`` (the Zeppelin world) to compare them with the plan's prediction.
    """

    groups = ZeppelinGroups.create(
        topology, ranks=ctx.global_ranks, timeout_s=config.comm_timeout_s
    )
    assert groups.rank == ctx.zeppelin_rank, "the Zeppelin rank is the data-parallel rank"
    counters = LinkCounters(topology)
    exchanger = DistExchanger(
        groups, routing=config.routing, counters=counters, timeout_s=config.comm_timeout_s
    )
    return exchanger, counters


def create_plan_share(
    topology: Topology,
    ctx: ParallelContext,
    config: ZeppelinConfig,
    *,
    pipeline_parallel: int = 1,
) -> PlanShare | None:
    """The plan group of this rank's Zeppelin world where plans are shared
    (``--zeppelin-share-plans`` with planner processes, ``comm/plan_share.py``), else ``None``.
    Every process calls it, once, in the same order: it creates the group of every Zeppelin
    world, one per TP index of every pipeline stage."""
    if not (config.share_plans and config.planner_processes) or ctx.zeppelin_world == 1:
        return None
    tp, world = ctx.tensor_parallel, dist.get_world_size()
    worlds = [
        zeppelin_ranks(world, tp, t, pipeline_parallel=pipeline_parallel, pp_rank=stage)
        for stage in range(pipeline_parallel)
        for t in range(tp)
    ]
    share = PlanShare.create(topology, worlds, timeout_s=config.comm_timeout_s)
    assert share.rank == ctx.zeppelin_rank, "plan group out of Megatron's data-parallel order"
    return share


def plan_digest(plan: Plan) -> str:
    """Short content hash of a plan's placement (to compare plans across runs, ranks and
    pipeline stages): its ``meta`` is left out, the builder's own figures, which differ
    between stages that run the same plan (a stage's predicted time counts its own layers)."""
    placement = {key: value for key, value in plan.to_dict().items() if key != "meta"}
    return hashlib.sha256(json.dumps(placement, separators=(",", ":")).encode()).hexdigest()[:16]


def plan_summary(plan: Plan, spec: ModelSpec, *, routing: bool) -> dict:
    """Tiers, balance and the bytes per link class one layer's attention sends for a plan,
    forward and backward (``schedule.engine_link_bytes``: the flat rings, and for documents on
    the 2-D scheme their head all-to-alls and rings across nodes)."""

    pairs = [0] * plan.world_size
    for seq in plan.sequences:
        for span in seq.attention:
            pairs[span.rank] += causal_pairs(span.start, span.end, 0, seq.length)
    tokens = [plan.num_linear_tokens(r) for r in range(plan.world_size)]
    mean_pairs = sum(pairs) / len(pairs)
    mean_tokens = sum(tokens) / len(tokens)
    return {
        "digest": plan_digest(plan),
        "num_documents": len(plan.sequences),
        "num_tokens": plan.num_tokens,
        "tiers": plan.tier_counts(),
        "attention_imbalance": max(pairs) / mean_pairs if mean_pairs else 1.0,
        "linear_imbalance": max(tokens) / mean_tokens if mean_tokens else 1.0,
        "link_bytes": engine_link_bytes(plan, AttentionShape.as_sent(spec), routing=routing),
    }
