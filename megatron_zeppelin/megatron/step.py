"""One micro-batch step, the same in the Megatron hooks, the CPU job and ``zeppelin check``.

On every rank, in this order (``run_micro_batch``):

1. the micro-batch's plan, computed by every rank from the same lengths
   (``plan_workers.PlanRecipe``; pure and deterministic, so ``feed.py`` may compute it
   ahead, in planner processes or a background thread);
2. the rank reads only its linear-layout tokens (``batch.build_linear_batch``) and pads them
   (``batch.pad_linear_batch``): to a multiple of the tensor-parallel size under sequence
   parallelism, to at least one row on a rank the plan leaves empty;
3. ``ZeppelinPackedSeqParams`` carries plan, rank, exchanger, remap group and positions into
   Megatron's ``GPTModel.forward``, which hands it to every layer's core attention;
4. the model returns per-token losses; the caller turns them into the per-token loss *sum*
   (``loss.token_loss_sum``: the CPU job and the check back-propagate it, the hooks hand it to
   Megatron's schedules through ``loss.megatron_loss_func``).

``StepRuntime`` holds what setup builds once (settings, topology, cost model, planner options,
exchanger, rank, group, padding multiple); nothing in it changes per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.megatron.documents.batch import (
    LinearBatch,
    TokenReader,
    build_linear_batch,
    pad_linear_batch,
)
from megatron_zeppelin.megatron.documents.sampler import DocumentSlice
from megatron_zeppelin.megatron.model.core_attention import ZeppelinPackedSeqParams
from megatron_zeppelin.megatron.plans.plan_workers import PlanRecipe
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.plan.plan import Plan
from megatron_zeppelin.topology.model import Topology


@dataclass(frozen=True)
class StepRuntime:
    """What every micro-batch step of a run needs; built once at start-up."""

    config: ZeppelinConfig
    topology: Topology
    """The Zeppelin world's topology (``args.resolve_topology``)."""
    cost_model: CostModel
    options: Any
    """``PlannerOptions`` from ``config.planner_options``: the one path from flags to planner."""
    exchanger: Any
    """Ring transport of this rank (``runtime.create_transport``)."""
    zeppelin_rank: int
    remap_group: Any
    """Process group of the Zeppelin world (remap all-to-all)."""
    pad_multiple: int = 1
    """Rows of a rank's linear buffer are padded to a multiple of this: the tensor-parallel size
    under sequence parallelism, else 1."""
    watch: Any = None
    """``comm.watch.CommWatch`` bounding the step's collectives by the Zeppelin timeout and naming
    a stalled rank; ``None``: plain collectives."""
    kernel: str = "auto"
    """The attention kernel the engine runs: ``config.kernel``, with ``auto`` resolved at
    start-up where a calibration ranks the kernels (``report.chosen_kernel``)."""
    plan_share: Any = None
    """``comm.plan_share.PlanShare`` where one rank per node plans and every rank receives the
    plans (``runtime.create_plan_share``; the feed's, ``feed.MicroBatchFeed.for_run``)."""

    @classmethod
    def create(
        cls,
        *,
        config: ZeppelinConfig,
        topology: Topology,
        cost_model: CostModel,
        exchanger: Any,
        zeppelin_rank: int,
        remap_group: Any,
        tensor_parallel: int,
        sequence_parallel: bool,
        watch: Any = None,
        kernel: str | None = None,
        plan_share: Any = None,
    ) -> StepRuntime:
        return cls(
            config=config,
            topology=topology,
            cost_model=cost_model,
            options=config.planner_options(cost_model),
            exchanger=exchanger,
            zeppelin_rank=zeppelin_rank,
            remap_group=remap_group,
            pad_multiple=tensor_parallel if sequence_parallel else 1,
            watch=watch,
            kernel=kernel or config.kernel,
            plan_share=plan_share,
        )

    @property
    def recipe(self) -> PlanRecipe:
        """What this run's plans depend on besides the lengths (picklable: a planner
        process plans from it)."""
        return PlanRecipe(self.topology, self.cost_model, self.config, self.options)


@dataclass(frozen=True)
class MicroBatchRun:
    """What one micro-batch's forward gave: per-token losses and the mask that selects the
    tokens counting in the loss (padding and every document's last token are out)."""

    losses_bs: torch.Tensor
    loss_mask_bs: torch.Tensor
    plan: Plan
    batch: LinearBatch


def forward_batch(model: torch.nn.Module, batch: LinearBatch, params: Any) -> torch.Tensor:
    """Megatron's ``GPTModel`` on one packed row: per-token losses ``[1, s]``. Positions go in
    twice: as ``position_ids`` (learned absolute embeddings read them) and in ``params``
    (per-document RoPE inside core attention)."""
    data = batch.as_megatron()
    return model(
        data["tokens"],
        data["position_ids"],
        None,
        labels=data["labels"],
        packed_seq_params=params,
    )


def run_micro_batch(
    model: torch.nn.Module,
    slices: Sequence[DocumentSlice],
    plan: Plan,
    runtime: StepRuntime,
    dataset: TokenReader,
) -> MicroBatchRun:
    """Steps 2 to 4 of the module docstring for this rank."""
    batch = build_linear_batch(plan, runtime.zeppelin_rank, slices, dataset)
    batch = pad_linear_batch(batch, runtime.pad_multiple)
    batch = batch.to(next(model.parameters()).device)
    params = ZeppelinPackedSeqParams(
        plan=plan,
        rank=runtime.zeppelin_rank,
        exchanger=runtime.exchanger.for_plan(plan),
        remap_group=runtime.remap_group,
        positions=batch.position_ids_t,
        kernel=runtime.kernel,
        watch=runtime.watch,
    )
    losses_bs = forward_batch(model, batch, params)
    return MicroBatchRun(
        losses_bs=losses_bs, loss_mask_bs=batch.loss_mask_t.unsqueeze(0), plan=plan, batch=batch
    )
