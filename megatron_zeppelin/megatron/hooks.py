"""Hooks for Megatron-LM's ``pretrain()``: model, forward step and datasets with Zeppelin.

Thin on purpose: everything that can be tested without ``megatron.training`` lives in the
modules it calls (``args``, ``spec`` (the layer spec the flags ask for), ``core_attention``,
``loss``, ``runtime``, ``step``, ``feed``, ``pipeline``, ``resume``, ``report``, ``batch``,
``sampler``, ``blend``, ``evaluation``). ``megatron.training`` is imported only inside the
functions, so this module imports anywhere megatron-core does.

The signatures follow how Megatron-LM ``core_v0.16.1`` calls its hooks:

* ``get_model`` calls ``model_provider(pre_process=, post_process=, config=, pg_collection=)``
  and, with virtual pipeline stages, ``vp_stage=`` too;
* ``build_train_valid_test_data_iterators`` calls ``train_valid_test_datasets_provider(
  num_samples)`` (with ``vp_stage=`` under virtual pipelining), wraps what it returns in its
  ``DataLoader`` / ``MegatronPretrainingSampler`` and hands ``forward_step`` an iterator;
* the schedules call ``forward_step(data_iterator, model)`` (once per micro-batch and model
  chunk under pipeline parallelism) and then, on the last stage, ``loss_func(output)``, which
  returns ``(loss sum, token count, {"lm loss": [sum, count]})``: with
  ``calculate_per_token_loss`` Megatron sums both over the data-parallel ranks and divides once.

Wiring, in order (``pretrain_gpt.py`` and the patched upstream script both use it):

1. ``extra_args_provider`` adds the ``--zeppelin*`` flags;
2. Megatron parses and initializes; the first ``model_provider`` call runs ``setup(args)``, which
   validates the flags, resolves the topology of the Zeppelin ranks (the data-parallel ranks of
   this TP index and pipeline stage, ``args.stage_node`` and ``args.zeppelin_node`` shaping the
   physical node for PP and TP), creates the process groups and the ring exchanger once, builds
   the cost model from the ``TransformerConfig`` Megatron builds (``planner.cost.models.
   model_from_config``; under pipeline parallelism of this stage's layers) and prints the
   start-up summary (``report.startup_lines``). It must run there: after Megatron's
   initialization, before the model and the data;
3. ``model_provider`` builds ``GPTModel`` with Zeppelin's spec (``position_embedding_type``
   'none' for RoPE models: RoPE is per document inside core attention); under pipeline
   parallelism its config gets ``variable_seq_lengths`` (a rank's rows change per micro-batch);
4. ``train_valid_test_datasets_provider`` opens the ``.bin/.idx`` datasets the data flags
   name, split by documents as Megatron splits them (``blend.py``), the training sampler,
   brought to a resumed iteration from the state saved beside the checkpoint (``resume.py``),
   and the validation and test streams (``evaluation.py``); Megatron's loaders only count
   micro-batches, over markers that say their split; asked again for the other model chunks
   of a virtual pipeline, it hands them the same markers;
5. ``forward_step`` takes the next micro-batch of the marker's split and its plan (planned
   ahead by planner processes, ``feed.py``, ``plan_workers.py``; every model chunk in turn,
   ``pipeline.ChunkCursors``) and runs the one micro-batch step of the CPU job and the check
   (``step.run_micro_batch``), returning Megatron's per-token loss function (a micro-batch
   without documents skips the model: zero loss, zero tokens; under pipeline parallelism it
   runs every stage on padding, ``empty_plan``). After a training step's last micro-batch it
   writes the sampler state when Megatron will save at the next iteration.

Token budget: a micro-batch holds up to ``zeppelin_world x (--zeppelin-capacity or
--seq-length)`` tokens of whole documents; one optimizer step draws ``--global-batch-size /
data-parallel size`` micro-batches at once, so the sampler can balance their cost.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.utils import get_attr_wrapped_model

from megatron_zeppelin.attention.kernels.kernels import choose_kernel
from megatron_zeppelin.comm.watch import CommWatch
from megatron_zeppelin.megatron import evaluation
from megatron_zeppelin.megatron.args import (
    extra_args_provider,
    is_enabled,
    resolve_topology,
    validate_megatron_args,
)
from megatron_zeppelin.megatron.documents.blend import SPLITS, data_blends, open_document_sets
from megatron_zeppelin.megatron.documents.resume import (
    is_save_iteration,
    restore_sampler,
    save_sampler_state,
)
from megatron_zeppelin.megatron.documents.sampler import DocumentCost, DocumentSampler
from megatron_zeppelin.megatron.model.loss import megatron_loss_func
from megatron_zeppelin.megatron.model.variants import window_left
from megatron_zeppelin.megatron.pipeline import ChunkCursors, pipeline_stage
from megatron_zeppelin.megatron.plans.feed import MicroBatchFeed
from megatron_zeppelin.megatron.report import (
    chosen_kernel,
    collector_line,
    plan_line,
    planning_text,
    startup_lines,
)
from megatron_zeppelin.megatron.runtime import (
    ParallelContext,
    build_cost_model,
    create_plan_share,
    create_transport,
    plan_summary,
)
from megatron_zeppelin.megatron.spec import spec_from_flags
from megatron_zeppelin.megatron.step import StepRuntime, run_micro_batch
from megatron_zeppelin.planner.cost.models import model_from_config
from megatron_zeppelin.planner.plan.plan import Plan

__all__ = [
    "extra_args_provider",
    "forward_step",
    "is_enabled",
    "model_provider",
    "plan_line",
    "setup",
    "train_valid_test_datasets_provider",
]


class _State:
    """What ``setup`` builds once per process and the step functions read."""

    def __init__(self) -> None:
        self.config: Any = None
        self.runtime: Any = None
        """``step.StepRuntime`` of this rank."""
        self.args: Any = None
        self.dataset: Any = None
        self.feed: Any = None
        """``feed.MicroBatchFeed`` over the sampler: micro-batches with their plans."""
        self.cursors: dict[str, ChunkCursors] = {}
        """By split, ``pipeline.ChunkCursors`` over its feed: each micro-batch for every model
        chunk."""
        self.markers: tuple = (None, None, None)
        """What the datasets provider returned Megatron (handed again to later model chunks)."""
        self.num_chunks: int = 1
        """Model chunks of this pipeline stage (virtual stages; 1 without them)."""
        self.pipeline_parallel: int = 1
        """Pipeline stages (Megatron's ``--pipeline-model-parallel-size``)."""
        self.num_micro_batches: int = 1
        self.micro_batches_done: int = 0
        self.kernel: Any = None
        """``report.KernelChoice``: the attention kernel every rank runs, and why."""
        self.evaluation: dict[str, evaluation.EvalStream] = {}
        """Validation and test micro-batches, by split (``evaluation.py``)."""

    def close_feeds(self) -> None:
        # Last opened, first closed: the feed that opened the run's planner (the training
        # feed, else the first evaluation feed) closes after those planning beside it.
        for stream in reversed(self.evaluation.values()):
            stream.close()
        if self.feed is not None:
            self.feed.close()
        self.evaluation, self.feed, self.cursors = {}, None, {}


_STATE = _State()


def reset() -> None:
    """Forget what ``setup`` built (tests, or a second run in one process)."""
    global _STATE
    _STATE.close_feeds()
    _STATE = _State()


def planner_model(args: argparse.Namespace, *, pp_rank: int = 0):
    """The planner's model of the run: ``planner.cost.models.model_from_config`` of the
    ``TransformerConfig`` Megatron builds from ``args`` (K/V heads only with
    ``--group-query-attention``, dtype from ``--bf16``/``--fp16``, TP size); under pipeline
    parallelism the model of stage ``pp_rank``, its own layers (``pipeline.pipeline_stage``)."""
    # lazy: megatron.training exists only beside Megatron-LM (tests install a stand-in).
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    stage = pipeline_stage(
        config, pp_rank=pp_rank, vp_size=getattr(args, "virtual_pipeline_model_parallel_size", None)
    )
    return model_from_config(
        config, vocab_size=args.padded_vocab_size, name="megatron", pipeline=stage
    )


def setup(args: argparse.Namespace) -> None:
    """Validate the flags and create groups, exchanger, cost model (after Megatron's init)."""
    config = validate_megatron_args(args, world_size=dist.get_world_size())
    evaluation.check_flags(args)  # the data and evaluation flags, and the datasets' headers
    _check_kernel(config.kernel, args)
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
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    topology = resolve_topology(
        config, ctx.zeppelin_world, tensor_parallel=tp, pipeline_parallel=pp
    )
    per_rank = args.micro_batch_size * ctx.zeppelin_world
    if args.global_batch_size % per_rank:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of micro-batch size"
            f" x data-parallel size ({per_rank}): change --global-batch-size"
        )
    spec = planner_model(args, pp_rank=parallel_state.get_pipeline_model_parallel_rank())
    cost_model = build_cost_model(spec, topology, calibration=config.calibration)
    device, dtype = _activations(args)
    kernel = chosen_kernel(
        config.kernel,
        device=device,
        dtype=dtype,
        window=_windowed(args),
        calibration=config.calibration,
        model=cost_model.model,
    )
    exchanger, _ = create_transport(topology, ctx, config)
    plan_share = create_plan_share(topology, ctx, config, pipeline_parallel=pp)
    _STATE.config = config
    _STATE.args = args
    _STATE.runtime = StepRuntime.create(
        config=config,
        topology=topology,
        cost_model=cost_model,
        exchanger=exchanger,
        zeppelin_rank=ctx.zeppelin_rank,
        remap_group=group,
        tensor_parallel=tp,
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        plan_share=plan_share,
        # The remap all-to-all is bounded by --zeppelin-comm-timeout-s and a stall names the
        # layer (Megatron's own collectives keep --distributed-timeout-minutes).
        watch=CommWatch(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            timeout_s=config.comm_timeout_s,
            backend=str(dist.get_backend()),
        ),
        kernel=kernel.name,
    )
    _STATE.kernel = kernel
    _STATE.num_micro_batches = args.global_batch_size // per_rank
    _STATE.pipeline_parallel = pp
    _STATE.num_chunks = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    _log_startup(args, tp)


def _activations(args: argparse.Namespace) -> tuple[str, torch.dtype]:
    """Where core attention's inputs live and their dtype (Megatron's ``params_dtype``)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, getattr(args, "params_dtype", None) or torch.float32


def _windowed(args: argparse.Namespace) -> bool:
    """Whether some layer runs sliding-window attention (``--window-size``)."""
    return window_left(getattr(args, "window_size", None)) is not None


def _check_kernel(requested: str, args: argparse.Namespace) -> None:
    """A kernel named with --zeppelin-kernel that cannot run here (or cannot mask a sliding
    window the model has) stops every rank at start-up with the reason and what to use instead
    ('auto' always runs)."""
    device, dtype = _activations(args)
    try:
        choose_kernel(requested, device=device, dtype=dtype, window=_windowed(args))
    except ValueError as exc:
        raise ValueError(f"--zeppelin-kernel {requested}: {exc}") from None


def _log_startup(args: argparse.Namespace, tensor_parallel: int) -> None:
    """The start-up summary (node shape, cost model source, experts, kernel) on rank 0, and
    under pipeline parallelism on the first rank of every stage (its cost model is its own)."""

    if not _is_stage_logging_rank():
        return
    lines = startup_lines(
        _STATE.runtime,
        tensor_parallel=tensor_parallel,
        kernel=_STATE.kernel,
        expert_parallel=int(getattr(args, "expert_model_parallel_size", 1) or 1),
        dispatcher=getattr(args, "moe_token_dispatcher_type", "allgather"),
    )
    hint = collector_line(bool(getattr(args, "manual_gc", False)))
    print("\n".join([*lines, hint] if hint else lines), flush=True)


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config: Any = None,
    pg_collection: Any = None,
):
    """``GPTModel`` with Zeppelin's layer spec; Megatron's ``get_model`` calls it with keywords.

    ``config`` is Megatron's ``TransformerConfig`` when the caller built one (else it is built
    from ``args``); ``pg_collection`` and ``vp_stage`` go to ``GPTModel`` unchanged.
    """
    # lazy: megatron.training exists only beside Megatron-LM (tests install a stand-in).
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if not is_enabled(args):
        raise ValueError("megatron_zeppelin's model_provider runs Zeppelin: add --zeppelin")
    if _STATE.config is None:
        setup(args)  # sets args.calculate_per_token_loss before the config is read below
    if config is None:
        config = core_transformer_config_from_args(args)
    # Ranks hold different token counts: the schedules must not divide by a per-rank count.
    config.calculate_per_token_loss = True
    num_layers = args.num_layers
    if _STATE.pipeline_parallel > 1:
        # Each stage sends its linear layout's rows: a shape that changes per micro-batch.
        config.variable_seq_lengths = True
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    rope = args.position_embedding_type == "rope"
    return GPTModel(
        config=config,
        transformer_layer_spec=spec_from_flags(
            args, config, num_layers=num_layers, vp_stage=vp_stage
        ),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=getattr(args, "fp16_lm_cross_entropy", False),
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="none" if rope else args.position_embedding_type,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def train_valid_test_datasets_provider(
    train_val_test_num_samples: list[int], vp_stage: int | None = None
):
    """Open the datasets the data flags name (``blend.py``: ``--split`` by documents, blends),
    the training sampler and the evaluation streams (``evaluation.py``); return Megatron a
    marker dataset per split (``None`` for a split without documents).

    Resuming (``args.iteration > 0``) restores the training sampler from the state saved beside
    the checkpoint (``resume.py``), or replays it to that step where the checkpoint has none: it
    is deterministic in its seed and the document lengths, so every rank lands on the same
    documents either way.
    """
    # lazy: megatron.training exists only beside Megatron-LM (tests install a stand-in).
    from megatron.training import get_args

    args = get_args()
    if _STATE.config is None:
        raise RuntimeError("hooks.setup has not run: build the model before the datasets")
    if vp_stage:
        # Megatron asks once per model chunk; every chunk takes its micro-batches from the
        # feeds the first call opened (``pipeline.ChunkCursors``).
        return _STATE.markers
    documents = dict(zip(SPLITS, open_document_sets(data_blends(args))))
    _STATE.close_feeds()
    _STATE.dataset = documents["train"]
    if _STATE.dataset is not None:
        sampler = _sampler(_STATE.dataset, _STATE.num_micro_batches)
        iteration = int(getattr(args, "iteration", 0) or 0)
        restore_sampler(sampler, getattr(args, "load", None), iteration, log=_log)
        _STATE.feed = MicroBatchFeed.for_run(
            sampler, _STATE.runtime.recipe, _STATE.runtime.plan_share
        )
    world = _STATE.runtime.topology.world_size
    _STATE.evaluation = evaluation.evaluation_streams(
        args,
        documents,
        make_sampler=_sampler,
        make_feed=_FeedsOfRun(_STATE.feed),
        data_parallel=world,
        restore=partial(_restore_validation, getattr(args, "load", None)),
        save=_save_validation_state if getattr(args, "save", None) else None,
    )
    counts = evaluation.marker_counts(args, train_val_test_num_samples, _STATE.evaluation, world)
    feeds = {"train": _STATE.feed, **_STATE.evaluation}
    _STATE.cursors = {split: _cursors(feed) for split, feed in feeds.items() if feed is not None}
    _STATE.markers = tuple(
        evaluation.Markers(counts[split], split) if split in _STATE.cursors else None
        for split in SPLITS
    )
    return _STATE.markers


def _cursors(feed) -> ChunkCursors:
    """Every model chunk's turn at ``feed``'s micro-batches; each draw looks ``feed.next`` up
    when it happens."""
    return ChunkCursors(lambda: feed.next(), _STATE.num_chunks)


class _FeedsOfRun:
    """The evaluation feeds of a run: beside the training feed, planning with its planner; with
    no training split (``--skip-train``), the first opens the run's planner and the others
    plan beside it. One planner per run: two planners sharing plans would broadcast on the same
    plan group from two threads, in an order that may differ between ranks."""

    def __init__(self, lead: MicroBatchFeed | None) -> None:
        self._lead = lead

    def __call__(self, sampler: DocumentSampler) -> MicroBatchFeed:
        if self._lead is None:
            self._lead = MicroBatchFeed.for_run(
                sampler, _STATE.runtime.recipe, _STATE.runtime.plan_share
            )
            return self._lead
        return self._lead.beside(sampler)


def _restore_validation(directory: str | None, sampler: DocumentSampler, step: int) -> None:
    restore_sampler(sampler, directory, step, log=_log, split="valid")


def _save_validation_state(step: int, state: dict) -> None:
    """Rank 0 keeps the validation stream's state at the end of an evaluation."""
    if _is_writing_rank():
        save_sampler_state(_STATE.args.save, step, state, split="valid")


def _sampler(documents, num_micro_batches: int, num_epochs: int | None = None) -> DocumentSampler:
    """A sampler over ``documents`` (a ``blend.DocumentSet``) with the run's budget: a
    micro-batch holds up to ``zeppelin_world x (--zeppelin-capacity or --seq-length)`` tokens
    of whole documents, and a step ``num_micro_batches`` of them."""
    args, config, runtime = _STATE.args, _STATE.config, _STATE.runtime
    per_gpu = min(args.seq_length, config.capacity or args.seq_length)
    micro_batch_tokens = per_gpu * runtime.topology.world_size
    return DocumentSampler(
        documents.lengths,
        tokens_per_step=micro_batch_tokens * num_micro_batches,
        num_micro_batches=num_micro_batches,
        seed=args.seed,
        max_length=min(config.max_document_length or args.seq_length, micro_batch_tokens),
        long_documents=config.long_documents,
        micro_batch_capacity=micro_batch_tokens,
        # Per-layer weights: the same on every pipeline stage, which must draw the same.
        cost=DocumentCost.from_model(runtime.cost_model.model),
        source_sizes=documents.source_sizes,
        weights=documents.weights,
        num_epochs=num_epochs,
    )


def forward_step(data_iterator, model, checkpoint_activations_microbatch: bool | None = None):
    """Megatron's ``forward_step``: the next micro-batch through ``step.run_micro_batch``.

    Returns ``(per-token losses [1, s], loss_func)``; ``loss_func(output)`` gives Megatron's
    per-token triple (the schedules call it on the last pipeline stage only; the other stages
    return the hidden states the model gives them). The marker Megatron's loader hands over
    says the split: validation and test micro-batches come from their own streams
    (``evaluation.py``), training ones from the training sampler. Under virtual pipelining
    each model chunk takes every micro-batch in turn (``pipeline.ChunkCursors``).
    ``checkpoint_activations_microbatch`` (pipeline schedules only) is accepted for the call's
    shape.
    """
    # The marker also keeps Megatron's consumed-sample count in step with ours.
    split = "train" if data_iterator is None else evaluation.marker_split(next(data_iterator))
    chunk = get_attr_wrapped_model(model, "vp_stage") or 0
    item, drawn = _STATE.cursors[split].next(chunk)
    if split != "train":
        return _run(model, item, _STATE.evaluation[split].documents)
    if drawn and item.is_last_of_step:
        _save_sampler_state(item.step.step + 1)
    if drawn and item.plan is not None:
        _STATE.micro_batches_done += 1
        _log_plan(item.plan)
    return _run(model, item, _STATE.dataset)


def _run(model, item, documents):
    """One micro-batch through the model; Megatron's per-token loss function with it."""
    plan = item.plan
    if plan is None:
        if _STATE.pipeline_parallel == 1:
            return empty_micro_batch(model)
        # The stages still exchange activations: run the model on padding rows alone.
        plan = empty_plan(_STATE.runtime.topology)
    run = run_micro_batch(model, item.slices, plan, _STATE.runtime, documents)
    return run.losses_bs, partial(megatron_loss_func, run.loss_mask_bs)


def _log_plan(plan: Plan) -> None:
    """Every ``--zeppelin-log-plan-every`` micro-batches: the plan line and how planning goes,
    on rank 0 and, under pipeline parallelism, the first rank of every stage (every stage runs
    the same plan: the same digest)."""
    every = _STATE.config.log_plan_every
    if not every or _STATE.micro_batches_done % every or not _is_stage_logging_rank():
        return
    runtime = _STATE.runtime
    summary = plan_summary(plan, runtime.cost_model.model, routing=runtime.config.routing)
    print(f"zeppelin micro-batch {plan_line(_STATE.micro_batches_done - 1, summary)}")
    planning = planning_text(_STATE.feed.stats.to_dict(), manual_gc="--manual-gc")
    print(f"zeppelin planning: {planning}", flush=True)


def empty_plan(topology) -> Plan:
    """The plan of a micro-batch without documents: no token anywhere. A rank's batch is then
    padding alone (``batch.pad_linear_batch``), which core attention answers with zeros and
    the loss never counts, so every stage still runs its model and passes activations on."""
    return Plan(topology=topology, sequences=(), linear=((),) * topology.world_size)


def _save_sampler_state(iteration: int) -> None:
    """Rank 0 writes the sampler state for ``iteration`` when Megatron saves there."""

    args = _STATE.args
    directory = getattr(args, "save", None)
    if directory and is_save_iteration(args, iteration) and _is_writing_rank():
        save_sampler_state(directory, iteration, _STATE.feed.state_dict())


def empty_micro_batch(model):
    """``forward_step``'s result for a micro-batch without documents (a small dataset spread
    over many micro-batches): no token, a zero loss. Every rank draws the same micro-batches,
    so all skip the model together and no collective goes unmatched. The output is a
    ``[1, 0]`` loss tensor tied to every parameter by a zero factor, so the backward pass gives
    each one a zero gradient and Megatron's data-parallel gradient reduction runs as usual."""

    anchor = sum((p.reshape(-1)[:1].sum() for p in model.parameters() if p.requires_grad), 0.0)
    output_bs = (anchor * 0.0).reshape(1, 1)[:, :0]
    loss_mask_bs = torch.zeros((1, 0), dtype=torch.float32, device=output_bs.device)
    return output_bs, partial(megatron_loss_func, loss_mask_bs)


def _is_logging_rank() -> bool:

    return not dist.is_initialized() or dist.get_rank() == 0


_is_writing_rank = _is_logging_rank


def _is_stage_logging_rank() -> bool:
    """Rank 0, and under pipeline parallelism the first rank of every stage."""
    if _STATE.pipeline_parallel == 1:
        return _is_logging_rank()
    return (
        parallel_state.get_data_parallel_rank() == 0
        and parallel_state.get_tensor_model_parallel_rank() == 0
    )


def _log(line: str) -> None:
    if _is_logging_rank():
        print(line, flush=True)
