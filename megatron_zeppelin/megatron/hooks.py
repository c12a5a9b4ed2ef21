"""Hooks for Megatron-LM's ``pretrain()``: model, forward step and datasets with Zeppelin.

Thin on purpose: everything that can be tested without ``megatron.training`` lives in the
modules it calls (``args``, ``spec``, ``core_attention``, ``loss``, ``runtime``, ``batch``,
``sampler``). ``megatron.training`` is imported only inside the functions, so this module imports
anywhere megatron-core does.

Wiring, in order (see ``pretrain_gpt.py``):

1. ``extra_args_provider`` adds the ``--zeppelin*`` flags;
2. after Megatron parsed and initialized, ``setup(args)`` validates them, resolves the topology of
   the Zeppelin ranks (the data-parallel ranks of this TP index), creates the process groups and
   the ring exchanger once, and builds the cost model;
3. ``model_provider`` builds ``GPTModel`` with Zeppelin's spec (``position_embedding_type``
   'none': RoPE is per document inside core attention);
4. ``forward_step`` takes the next micro-batch's documents, plans, builds this rank's batch and
   ``ZeppelinPackedSeqParams``, runs the model and returns Megatron's per-token loss function.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

from megatron_zeppelin.megatron.args import extra_args_provider, is_enabled

__all__ = ["extra_args_provider", "forward_step", "is_enabled", "model_provider", "setup",
           "train_valid_test_datasets_provider"]  # fmt: skip


class _State:
    """What ``setup`` builds once per process and the step functions read."""

    config: Any = None
    topology: Any = None
    cost_model: Any = None
    exchanger: Any = None
    zeppelin_rank: int = 0
    remap_group: Any = None
    dataset: Any = None
    sampler: Any = None
    pending: list = []


_STATE = _State()


def setup(args: argparse.Namespace) -> None:
    """Validate the flags and create groups, exchanger, cost model (after Megatron's init)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zeppelin.megatron.args import resolve_topology, validate_megatron_args
    from megatron_zeppelin.megatron.runtime import (
        ModelDims,
        ParallelContext,
        build_cost_model,
        create_transport,
    )

    config = validate_megatron_args(args, world_size=dist.get_world_size())
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_data_parallel_group()
    ctx = ParallelContext(
        tensor_parallel=tp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        zeppelin_rank=parallel_state.get_data_parallel_rank(),
        zeppelin_world=parallel_state.get_data_parallel_world_size(),
        global_ranks=tuple(dist.get_process_group_ranks(group)),
        dp_group=group,
    )
    topology = resolve_topology(config, ctx.zeppelin_world, tensor_parallel=tp)
    dims = ModelDims(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_attention_heads,
        num_kv_heads=args.num_query_groups or args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=args.padded_vocab_size,
    )
    _STATE.config = config
    _STATE.topology = topology
    _STATE.cost_model = build_cost_model(
        dims, topology, tensor_parallel=tp, calibration=config.calibration
    )
    _STATE.exchanger, _ = create_transport(topology, ctx, config)
    _STATE.zeppelin_rank = ctx.zeppelin_rank
    _STATE.remap_group = group


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage=None, **_):
    """``GPTModel`` with Zeppelin's layer spec (local, or TE with ``--transformer-impl
    transformer_engine``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_zeppelin.megatron.spec import zeppelin_layer_spec

    args = get_args()
    kind = "te" if getattr(args, "transformer_impl", "local") == "transformer_engine" else "local"
    rope = args.position_embedding_type == "rope"
    spec = zeppelin_layer_spec(
        kind,
        normalization=args.normalization,
        qk_layernorm=args.qk_layernorm,
        rotary_base=args.rotary_base if rope else None,
        rotary_percent=args.rotary_percent,
    )
    return GPTModel(
        config=core_transformer_config_from_args(args),
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="none" if rope else args.position_embedding_type,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples: list[int]):
    """Zeppelin draws documents itself (a resumable sampler over ``--data-path``); Megatron's
    loop only needs an iterator, so the train split is an endless stream of step indices."""
    from megatron.training import get_args

    from megatron_zeppelin.megatron.data import DocumentDataset
    from megatron_zeppelin.megatron.sampler import DocumentCost, DocumentSampler

    args = get_args()
    if not args.data_path or len(args.data_path) != 1:
        raise ValueError("--zeppelin reads one dataset: give --data-path PREFIX (no blend)")
    _STATE.dataset = DocumentDataset(args.data_path[0])
    config = _STATE.config
    _STATE.sampler = DocumentSampler(
        _STATE.dataset.lengths,
        tokens_per_step=args.seq_length * _STATE.topology.world_size,
        num_micro_batches=1,
        seed=args.seed,
        max_length=config.max_document_length,
        long_documents=config.long_documents,
        cost=DocumentCost.from_model(_STATE.cost_model.model),
    )
    return _StepStream(), None, None


class _StepStream:
    """An iterable Megatron can wrap: each item is a marker; the sampler holds the real state."""

    def __iter__(self):
        while True:
            yield None

    def __len__(self) -> int:
        return 1 << 62


def forward_step(data_iterator, model):
    """Megatron's ``forward_step``: plan this micro-batch, build this rank's batch, run."""
    from megatron_zeppelin.megatron.batch import build_linear_batch
    from megatron_zeppelin.megatron.core_attention import ZeppelinPackedSeqParams
    from megatron_zeppelin.megatron.loss import megatron_loss_func
    from megatron_zeppelin.megatron.runtime import plan_micro_batch

    if data_iterator is not None:
        next(data_iterator)
    if not _STATE.pending:
        _STATE.pending = list(_STATE.sampler.next_step().micro_batches)
    slices = _STATE.pending.pop(0)
    plan = plan_micro_batch(
        [s.num_tokens for s in slices],
        topology=_STATE.topology,
        cost_model=_STATE.cost_model,
        config=_STATE.config,
    )
    batch = build_linear_batch(plan, _STATE.zeppelin_rank, slices, _STATE.dataset)
    device = next(model.parameters()).device
    batch = batch.to(device)
    params = ZeppelinPackedSeqParams(
        plan=plan,
        rank=_STATE.zeppelin_rank,
        exchanger=_STATE.exchanger.set_plan(plan),
        remap_group=_STATE.remap_group,
        positions=batch.position_ids_t,
        kernel=_STATE.config.kernel,
    )
    data = batch.as_megatron()
    output = model(
        data["tokens"], data["position_ids"], None, labels=data["labels"], packed_seq_params=params
    )
    return output, partial(megatron_loss_func, data["loss_mask"])
