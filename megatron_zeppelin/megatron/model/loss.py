"""Per-token loss: a sum of token losses and a token count per rank.

Zeppelin ranks hold different numbers of tokens (documents are whole, lengths vary), so the mean
of per-rank means would weigh a token on a light rank more than one on a heavy rank. Each rank
instead returns the sum of its token losses and its token count; the global loss is the sum of
sums over the global count, exactly the single-GPU mean over the same documents. Gradients
follow the same rule: every rank back-propagates its *sum*, the data-parallel all-reduce sums the
gradients, and one division by the global token count finishes the mean (Megatron does this with
``calculate_per_token_loss``; the CPU job does it in ``finish_gradients``).

Shapes: Megatron's ``GPTModel`` returns per-token losses ``[b, s]`` when given labels.

``watch`` (a ``comm.watch.CommWatch``, optional) bounds the all-reduces by the Zeppelin timeout
and names a stalled rank when one does not finish.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_zeppelin.comm.watch import CommWatch


def token_loss_sum(
    losses_bs: torch.Tensor, loss_mask_bs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the masked token losses (float32, differentiable) and the count of masked-in tokens
    (int64), both 0-dim."""
    if losses_bs.shape != loss_mask_bs.shape:
        raise ValueError(
            f"losses {tuple(losses_bs.shape)} and loss mask {tuple(loss_mask_bs.shape)} differ in "
            "shape: build the mask from the same batch as the labels"
        )
    mask = loss_mask_bs.reshape(-1).float()
    total = torch.sum(losses_bs.reshape(-1).float() * mask)
    count = mask.sum().detach().to(torch.long)
    return total, count


def megatron_loss_func(
    loss_mask_bs: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``loss_func`` in the shape Megatron's schedules expect with ``calculate_per_token_loss``:
    ``(loss sum, token count, {"lm loss": [sum, count]})``; Megatron sums both over the
    data-parallel ranks and divides once."""
    total, count = token_loss_sum(output_tensor, loss_mask_bs)
    report = torch.stack([total.detach(), count.to(total.dtype)])
    return total, count.to(torch.int), {"lm loss": report}


def global_mean_loss(
    total: torch.Tensor,
    count: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    watch: CommWatch | None = None,
) -> tuple[float, int]:
    """The global per-token loss and token count: sums over the ranks of ``group``."""
    both = torch.stack([total.detach().double(), count.detach().double()])
    if group is not None or (dist.is_available() and dist.is_initialized()):
        _all_reduce(both, group, watch, "loss all-reduce")
    num_tokens = int(both[1].item())
    if num_tokens == 0:
        raise ValueError("no token carries a loss in this step: check the loss mask and labels")
    return float(both[0].item() / num_tokens), num_tokens


def finish_gradients(
    params: Iterable[torch.nn.Parameter],
    num_tokens: int,
    group: dist.ProcessGroup | None = None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    watch: CommWatch | None = None,
) -> None:
    """Sum every gradient over ``group`` (the Zeppelin / data-parallel ranks) and divide by the
    global token count, turning per-rank loss-sum gradients into the gradient of the global
    per-token mean.

    Under sequence parallelism a tensor-parallel rank runs the norms on its share of the rows
    only, so the weights Megatron marks ``sequence_parallel`` hold a partial gradient: they are
    summed over ``tp_group`` first (what Megatron's ``finalize_model_grads`` does)."""
    if num_tokens < 1:
        raise ValueError(f"the global token count must be positive, got {num_tokens}")
    params = [p for p in params if p.grad is not None]
    if not params:
        return
    distributed = dist.is_available() and dist.is_initialized()
    partial = [p.grad for p in params if getattr(p, "sequence_parallel", False)]
    if partial and tp_group is not None and distributed:
        flat = torch.cat([g.reshape(-1) for g in partial])
        _all_reduce(flat, tp_group, watch, "sequence-parallel gradient all-reduce")
        _unflatten_into(flat, partial)
    grads = [p.grad for p in params]
    # One flat all-reduce instead of one per tensor: far fewer gloo round trips.
    flat = torch.cat([g.reshape(-1) for g in grads])
    if distributed:
        _all_reduce(flat, group, watch, "gradient all-reduce")
    flat /= num_tokens
    _unflatten_into(flat, grads)


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def _all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, watch: CommWatch | None, what: str
) -> None:
    if watch is None:
        dist.all_reduce(tensor, group=group)
    else:
        watch.all_reduce(tensor, group, what=what)
