"""The pieces a Zeppelin training step is composed of, shared by the CPU job and the check.

One step, per micro-batch, on every rank (the order matters):

1. the sampler's documents give the lengths; every rank plans the same plan from them
   (``plan_micro_batch``; deterministic, no communication);
2. the rank reads only its linear-layout tokens (``batch.build_linear_batch``);
3. ``ZeppelinPackedSeqParams`` carries plan, rank, exchanger, remap group and positions into
   Megatron's ``GPTModel.forward``, which hands it to every layer's core attention;
4. the per-token loss *sum* is back-propagated; after the last micro-batch the gradients are
   summed over the Zeppelin ranks and divided by the global token count (``loss.py``).

Parallel layout: Megatron's tensor parallelism is the fastest axis (global rank ``g`` has TP index
``g % tp``); the Zeppelin ranks are the data-parallel ranks of one TP index, so there are ``tp``
Zeppelin worlds of ``world / tp`` ranks each, all planning the same plan. Megatron's own
data-parallel group of a TP index is exactly its Zeppelin world and serves the remap all-to-all
and the gradient sum.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.megatron.args import zeppelin_ranks
from megatron_zeppelin.megatron.core_attention import ZeppelinPackedSeqParams
from megatron_zeppelin.megatron.loss import token_loss_sum
from megatron_zeppelin.planner.costmodel import CostModel, causal_pairs
from megatron_zeppelin.planner.models import ModelSpec
from megatron_zeppelin.planner.plan import Plan
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

    def model_spec(self, *, tensor_parallel: int = 1) -> ModelSpec:
        """The planner's view of this model (fp32 on CPU)."""
        return ModelSpec(
            name="cpu-gpt",
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            vocab_size=self.vocab_size,
            dtype_bytes=4,
            tensor_parallel=tensor_parallel,
        )


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
    from megatron.core import parallel_state

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


def build_gpt(dims: ModelDims, *, seed: int, layer_spec=None):
    """Megatron's ``GPTModel`` in float32 on CPU with Zeppelin's layer spec.

    Weights come from ``seed`` through Megatron's CPU initialization, which draws every full
    weight and keeps this TP rank's slice: the same seed gives the same model whatever the TP size.
    ``layer_spec`` replaces the Zeppelin local spec (the check's reference model uses that).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megatron_zeppelin.megatron.spec import zeppelin_layer_spec

    config = TransformerConfig(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads,
        ffn_hidden_size=dims.ffn_hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        calculate_per_token_loss=True,
        tensor_model_parallel_size=_tp_size(),
    )
    spec = layer_spec or zeppelin_layer_spec("local", rotary_base=dims.rotary_base)
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


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def build_cost_model(
    dims: ModelDims, topology: Topology, *, tensor_parallel: int, calibration: str | None
) -> CostModel:
    """Datasheet cost model, with a calibration file's measured figures where one is given."""
    cost = CostModel.default(dims.model_spec(tensor_parallel=tensor_parallel), topology)
    if calibration:
        from megatron_zeppelin.planner.calibration import apply_calibration, load_calibration

        cost = apply_calibration(cost, load_calibration(calibration), source=calibration)
    return cost


NEVER_SPLIT = 1 << 62
"""A threshold no document reaches: the tier splits only what capacity forces."""


def planner_options(config: ZeppelinConfig, cost_model: CostModel):
    """``PlannerOptions`` from the Zeppelin flags (thresholds, routing, remapping).

    Each threshold is ``auto`` (the cost model's), ``off`` or a token count; both ``off`` turns
    balance splitting off altogether.
    """
    from megatron_zeppelin.planner.partition import PlannerOptions, tier_thresholds

    intra, inter = config.threshold("intra"), config.threshold("inter")
    if intra == "off" and inter == "off":
        return PlannerOptions(allow_split=False, routing=config.routing, remap=config.remap)
    if intra == "auto" and inter == "auto":
        thresholds: str | tuple[int, int] = "auto"
    else:
        auto_intra, auto_inter = tier_thresholds(cost_model)
        chosen = []
        for value, auto in ((intra, auto_intra), (inter, auto_inter)):
            chosen.append(auto if value == "auto" else NEVER_SPLIT if value == "off" else value)
        # A document worth a cross-node ring is worth an NVLink one: keep intra <= inter.
        thresholds = (min(chosen), chosen[1])
    return PlannerOptions(thresholds=thresholds, routing=config.routing, remap=config.remap)


def plan_micro_batch(
    lengths: list[int], *, topology: Topology, cost_model: CostModel, config: ZeppelinConfig
) -> Plan:
    """The micro-batch's plan; every rank computes the same one from the same lengths."""
    from megatron_zeppelin.planner.partition import plan_batch

    # No capacity given: no limit, i.e. room for the whole micro-batch (with slack) on any GPU.
    capacity = config.capacity if config.capacity is not None else 2 * sum(lengths)
    return plan_batch(
        lengths,
        topology=topology,
        cost_model=cost_model,
        capacity=capacity,
        options=planner_options(config, cost_model),
    )


def create_transport(topology: Topology, ctx: ParallelContext, config: ZeppelinConfig):
    """Ring exchanger and link counters of this rank's Zeppelin world (every process calls it,
    once, in the same order: it creates the groups of every Zeppelin world).

    ``comm``'s point-to-point ``DistExchanger`` (routing, overlapped relays, byte counters) on
    ``ZeppelinGroups`` of ``ctx.global_ranks``: with tensor parallelism 1 the whole world, with
    tensor parallelism > 1 the data-parallel ranks of this TP index. Sum the counters over
    ``ctx.dp_group`` (the Zeppelin world) to compare them with the plan's prediction.
    """
    from megatron_zeppelin.comm.counters import LinkCounters
    from megatron_zeppelin.comm.exchange import DistExchanger
    from megatron_zeppelin.comm.groups import ZeppelinGroups

    groups = ZeppelinGroups.create(
        topology, ranks=ctx.global_ranks, timeout_s=config.comm_timeout_s
    )
    assert groups.rank == ctx.zeppelin_rank, "the Zeppelin rank is the data-parallel rank"
    counters = LinkCounters(topology)
    exchanger = DistExchanger(
        groups, routing=config.routing, counters=counters, timeout_s=config.comm_timeout_s
    )
    return exchanger, counters


def forward_micro_batch(
    model: torch.nn.Module, batch, params: ZeppelinPackedSeqParams | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss sum and loss-token count of one micro-batch (``batch``: a ``LinearBatch``)."""
    data = batch.as_megatron()
    losses_bs = model(
        data["tokens"],
        None,  # positions live in the packed params: RoPE is applied in core attention
        None,
        labels=data["labels"],
        packed_seq_params=params,
    )
    return token_loss_sum(losses_bs, data["loss_mask"])


def plan_digest(plan: Plan) -> str:
    """Short content hash of a plan (to compare plans across runs and ranks)."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]


def plan_summary(plan: Plan, spec: ModelSpec, *, routing: bool) -> dict:
    """Tiers, balance and predicted ring bytes (per layer, forward) of a plan."""
    from megatron_zeppelin.planner.schedule import link_bytes, ring_schedule

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
        "link_bytes": link_bytes(
            plan,
            ring_schedule(plan),
            bytes_per_token=spec.kv_bytes_per_token(),
            routing=routing,
        ),
    }
