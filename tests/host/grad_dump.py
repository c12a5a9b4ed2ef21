"""Test-only: every rank writes the gradients Megatron's optimizer is about to apply.

Installed by ``run_on_cpu.py`` in every rank when ``ZEPPELIN_TEST_GRAD_DIR`` names a folder.
Megatron's ``train()`` takes ``finalize_model_grads`` from ``megatron.training.training`` when it
sets up the model's config (``config.finalize_model_grads_func``); the schedules call it after
the last micro-batch's backward of every iteration. It all-reduces the gradients over the
data-parallel ranks (and the embedding's over the first and last pipeline stage), sums the
sequence-parallel norms' over the tensor-parallel ranks, and divides them by the step's token
count (``calculate_per_token_loss``): what it leaves in each parameter's ``main_grad`` is the
gradient the optimizer applies (clipping aside). The wrapper calls it, then saves
``DIR/rank{R}-iter{N}.pt``: ``{"ranks": {"tp", "tp_size", "dp"}, "grads": {name: (tensor,
partition_dim)}}``, names as the whole model has them (a pipeline stage's layer ``i`` is
renamed to its global index, Megatron's ``layer_number - 1``), ``partition_dim`` the dimension
tensor parallelism splits (``None``: a full copy).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _global_grads(chunk: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int | None]]:
    model = _unwrap(chunk)
    grads = {}
    for name, param in model.named_parameters():
        found = _LAYER.match(name)
        if found:
            layer = model.decoder.layers[int(found.group(1))].layer_number - 1
            name = f"decoder.layers.{layer}.{name[found.end() :]}"
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        split = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        grads[name] = (grad.detach().clone().float(), split)
    return grads


def install() -> None:
    """Wrap ``finalize_model_grads`` where ``train()`` reads it (see the module docstring)."""
    directory = os.environ.get("ZEPPELIN_TEST_GRAD_DIR")
    if not directory:
        return
    import megatron.training.training as training
    from megatron.core import parallel_state
    from megatron.training import get_args

    finalize = training.finalize_model_grads

    def finalize_and_dump(model: list[torch.nn.Module], *args: Any, **kwargs: Any) -> Any:
        result = finalize(model, *args, **kwargs)
        grads = {}
        for chunk in model:
            grads.update(_global_grads(chunk))
        ranks = {
            "tp": parallel_state.get_tensor_model_parallel_rank(),
            "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_rank(),
        }
        iteration = get_args().curr_iteration + 1
        path = os.path.join(directory, f"rank{torch.distributed.get_rank()}-iter{iteration}.pt")
        torch.save({"ranks": ranks, "grads": grads}, path)
        return result

    training.finalize_model_grads = finalize_and_dump


def load_gradients(directory: str, iteration: int, *, gated: bool) -> dict[str, torch.Tensor]:
    """The whole model's gradients of ``iteration``: every parameter once, its tensor-parallel
    slices (from data-parallel rank 0) put back together along their partition dimension.
    ``gated`` (SwiGLU): each rank's ``linear_fc1`` holds its slice of the gate and then its
    slice of the up projection, so the gates go first and the ups after them."""
    slices: dict[str, dict[int, tuple[torch.Tensor, int]]] = {}
    full: dict[str, torch.Tensor] = {}
    for entry in sorted(os.listdir(directory)):
        if not entry.endswith(f"-iter{iteration}.pt"):
            continue
        dump = torch.load(os.path.join(directory, entry))
        if dump["ranks"]["dp"] != 0:
            continue
        for name, (grad, split) in dump["grads"].items():
            if split is None:
                full[name] = grad
            else:
                slices.setdefault(name, {})[dump["ranks"]["tp"]] = (grad, split)
    for name, parts in slices.items():
        ordered = [parts[tp] for tp in sorted(parts)]
        split = ordered[0][1]
        if gated and name.endswith("mlp.linear_fc1.weight"):
            halves = [grad.chunk(2, dim=split) for grad, _ in ordered]
            ordered = [(half[k], split) for k in (0, 1) for half in halves]
        full[name] = torch.cat([grad for grad, _ in ordered], dim=split)
    return full
