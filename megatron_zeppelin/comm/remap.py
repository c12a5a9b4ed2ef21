"""Remapping between the linear layout and the attention layout: one all-to-all each way.

The whole Megatron layer runs in the linear layout (the planner's choice by cost: even tokens
per GPU, even within nodes, or the attention layout itself); only core attention
runs in the attention layout (docs/DESIGN.md, "The remap between layouts").
``linear_to_attention`` and ``attention_to_linear`` move the rows of a ``(t, ...)`` tensor
between the two with ``all_to_all_single``; the split sizes and row orders come from the pure
``planner.plan.remap_layout``. Each is an autograd function whose backward is the other direction's
all-to-all applied to the gradient: a permutation's gradient is its inverse permutation.

``group``: the process group of the plan's ranks, group rank ``i`` being plan rank ``i``
(``None``: the world). Under tensor parallelism that is the group of one TP index.

``watch`` (a ``comm.watch.CommWatch``, optional): bounds each all-to-all by the Zeppelin timeout
and, when a peer stalls, raises an error naming it with this rank's step and ``layer``; the
backward's all-to-all is reported as the same layer's backward.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_zeppelin.comm.watch import CommWatch
from megatron_zeppelin.devices import to_device
from megatron_zeppelin.planner.plan.plan import Plan
from megatron_zeppelin.planner.plan.remap_layout import RemapLayout, remap_pair

__all__ = ["all_to_all_rows", "attention_to_linear", "linear_to_attention", "remap_rows"]


@dataclass(frozen=True)
class _Where:
    """What a remap reports to the watch: the operation and the layer it belongs to."""

    watch: CommWatch | None = None
    what: str = "remap"
    layer: int | None = None


def all_to_all_rows(
    x_t: torch.Tensor,
    layout: RemapLayout,
    group: dist.ProcessGroup | None,
    *,
    watch: CommWatch | None = None,
    what: str = "remap",
    layer: int | None = None,
    phase: str = "forward",
) -> torch.Tensor:
    """Move rows of ``x_t`` as ``layout`` says (no autograd); ``watch``, ``what``, ``layer`` and
    ``phase`` are what a stall error reports (module docstring)."""
    if x_t.shape[0] != layout.num_src_rows:
        raise ValueError(
            f"rank {layout.rank} holds {layout.num_src_rows} tokens in the source layout but the "
            f"tensor has {x_t.shape[0]} rows: pass the rank's tokens in that layout's buffer order"
        )
    device = x_t.device
    send = x_t.index_select(0, _index(layout, "send_index", device)).contiguous()
    recv = x_t.new_empty((layout.num_dst_rows, *x_t.shape[1:]))

    def issue(async_op: bool):
        return dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=list(layout.recv_counts),
            input_split_sizes=list(layout.send_counts),
            group=group,
            async_op=async_op,
        )

    if watch is None:
        issue(False)
    else:
        watch.run(what, issue, layer=layer, phase=phase, cuda=send.is_cuda)
    return recv.index_select(0, _index(layout, "recv_index", device))


def _index(layout: RemapLayout, name: str, device: torch.device) -> torch.Tensor:
    """``layout``'s index ``name`` on ``device``, copied once per layout (every layer reuses it)
    by a copy the stream orders: a copy from pageable memory in every layer would make the host
    wait for the device each time."""
    key = (name, str(device))
    if key not in layout.on_device:
        layout.on_device[key] = to_device(getattr(layout, name), device)
    return layout.on_device[key]


class _RemapFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_t, layout, back, group, where):  # type: ignore[override]
        ctx.back = back
        ctx.group = group
        ctx.where = where
        return all_to_all_rows(x_t, layout, group, **vars(where))

    @staticmethod
    def backward(ctx, grad_t):  # type: ignore[override]
        grad = all_to_all_rows(
            grad_t.contiguous(), ctx.back, ctx.group, **vars(ctx.where), phase="backward"
        )
        return grad, None, None, None, None


_RECENT_LAYOUTS: deque[tuple[Plan, int, tuple[RemapLayout, RemapLayout]]] = deque(maxlen=8)
_RECENT_LOCK = threading.Lock()


def _layouts(plan: Plan, rank: int) -> tuple[RemapLayout, RemapLayout]:
    """Both directions for ``rank``, computed once per plan: every layer of a micro-batch
    remaps with the same plan, so only the first call pays for the index arithmetic. Plans
    are found by identity, not by hash: hashing a plan walks all of its documents."""
    with _RECENT_LOCK:
        for known, known_rank, layouts in _RECENT_LAYOUTS:
            if known is plan and known_rank == rank:
                return layouts
    layouts = remap_pair(plan, rank)
    with _RECENT_LOCK:
        _RECENT_LAYOUTS.append((plan, rank, layouts))
    return layouts


def _check_group(plan: Plan, rank: int, group: dist.ProcessGroup | None) -> None:
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size != plan.world_size:
        raise ValueError(
            f"the plan is for {plan.world_size} ranks but the remap group has {size}: pass the "
            "group of the plan's ranks"
        )
    if me != rank:
        raise ValueError(f"rank {rank} given but this process is rank {me} of the remap group")


def remap_rows(
    x_t: torch.Tensor,
    layout: RemapLayout,
    group: dist.ProcessGroup | None,
    *,
    back: RemapLayout | None = None,
    watch: CommWatch | None = None,
    layer: int | None = None,
    what: str = "remap",
) -> torch.Tensor:
    """Autograd-enabled move of ``x_t``'s rows as ``layout`` says. The backward moves the
    gradient with ``back`` (any move from ``layout``'s destination to its source layout that
    every rank agrees on), by default ``layout.inverse()``."""
    where = _Where(watch, what, layer)
    return _RemapFunction.apply(x_t, layout, back or layout.inverse(), group, where)


def linear_to_attention(
    x_t: torch.Tensor,
    plan: Plan,
    rank: int,
    group: dist.ProcessGroup | None = None,
    *,
    watch: CommWatch | None = None,
    layer: int | None = None,
) -> torch.Tensor:
    """Rows in ``rank``'s linear buffer order -> rows in its attention buffer order."""
    _check_group(plan, rank, group)
    there, back = _layouts(plan, rank)
    return remap_rows(
        x_t, there, group, back=back, watch=watch, layer=layer, what="remap linear->attention"
    )


def attention_to_linear(
    x_t: torch.Tensor,
    plan: Plan,
    rank: int,
    group: dist.ProcessGroup | None = None,
    *,
    watch: CommWatch | None = None,
    layer: int | None = None,
) -> torch.Tensor:
    """Rows in ``rank``'s attention buffer order -> rows in its linear buffer order."""
    _check_group(plan, rank, group)
    there, back = _layouts(plan, rank)
    return remap_rows(
        x_t, back, group, back=there, watch=watch, layer=layer, what="remap attention->linear"
    )
