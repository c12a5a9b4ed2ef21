"""Pipeline parallelism with Zeppelin: which layers a stage runs, and each micro-batch's plan
handed to every model chunk of the stage.

Each pipeline stage's data-parallel group is a Zeppelin world; every rank of every stage draws
the same documents from the seeded sampler and plans the same plan, so the rows a rank sends
the next stage (its linear layout) are the rows that stage's rank expects. Megatron's
schedules call ``forward_step`` once per micro-batch per model chunk (a virtual pipeline
stage; one chunk without ``--num-layers-per-virtual-pipeline-stage``), each chunk's calls in
micro-batch order but interleaved with the other chunks' (the 1F1B and interleaved tables of
``pipeline_parallel/schedules.py``). ``ChunkCursors`` draws each micro-batch from the feed
once, when the first chunk asks for it, and gives the same one to every other chunk when its
turn comes; the backward of a micro-batch runs with what its forward built (the plan, the
engine bound to that plan's routes, the remap), which autograd keeps, so forwards that run
ahead of their backwards in 1F1B order never overwrite a plan still needed.

``pipeline_stage`` reads the stage's layers from Megatron's own split
(``get_num_layers_to_build`` and ``get_transformer_layer_offset``, per chunk), so uneven first
and last stages, ``--account-for-*-in-pipeline-split`` and ``--pipeline-model-parallel-layout``
give exactly the layers Megatron builds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_zeppelin.planner.cost.models import PipelineStage

T = TypeVar("T")


def pipeline_stage(config: Any, *, pp_rank: int, vp_size: int | None) -> PipelineStage | None:
    """The stage ``pp_rank`` of a Megatron ``TransformerConfig`` runs; ``None`` without
    pipeline parallelism. ``vp_size``: model chunks per stage (``None``: one)."""
    num_stages = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    if num_stages == 1:
        return None
    chunks = range(vp_size) if vp_size else [None]
    layers: list[int] = []
    for vp_stage in chunks:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
        layers.extend(range(offset, offset + count))
    return PipelineStage(
        index=pp_rank,
        num_stages=num_stages,
        layers=tuple(sorted(layers)),
        embedding=pp_rank == 0,
        output_layer=pp_rank == num_stages - 1,
    )


class ChunkCursors(Generic[T]):
    """Every model chunk of a stage takes every micro-batch once, in order; ``draw()`` is
    called once per micro-batch, by whichever chunk asks for it first (see the module
    docstring). Holds only micro-batches some chunk has still to take."""

    def __init__(self, draw: Callable[[], T], num_chunks: int = 1) -> None:
        if num_chunks < 1:
            raise ValueError(f"a stage has at least one model chunk, got {num_chunks}")
        self._draw = draw
        self._taken = [0] * num_chunks
        """Micro-batches each chunk has taken so far."""
        self._held: deque[T] = deque()
        """Micro-batches ``self._first ..`` that some chunk has still to take."""
        self._first = 0

    @property
    def num_held(self) -> int:
        return len(self._held)

    def next(self, chunk: int) -> tuple[T, bool]:
        """Chunk ``chunk``'s next micro-batch, and whether this call drew it from the feed."""
        if not 0 <= chunk < len(self._taken):
            raise ValueError(f"model chunk {chunk} outside 0..{len(self._taken) - 1}")
        index = self._taken[chunk]
        drawn = index == self._first + len(self._held)
        if drawn:
            self._held.append(self._draw())
        item = self._held[index - self._first]
        self._taken[chunk] += 1
        while self._held and min(self._taken) > self._first:
            self._held.popleft()
            self._first += 1
        return item, drawn
