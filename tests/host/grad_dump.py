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
renamed to its global index, Megatron's ``layer_number - 1``, and a MoE layer's local expert
``local_experts.I`` to its global one, this rank's expert-parallel rank x local experts + I),
``partition_dim`` the dimension tensor parallelism splits (``None``: a full copy).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

GRAD_DIR = "ZEPPELIN_TEST_GRAD_DIR"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def global_names(chunk: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name in the whole model, parameter)`` of a model chunk (see the module docstring)."""
    from megatron.core import parallel_state

    model = _unwrap(chunk)
    named = list(model.named_parameters())
    local = {int(m.group(1)) for name, _ in named for m in [_LOCAL_EXPERT.search(name)] if m}
    first = parallel_state.get_expert_model_parallel_rank() * len(local)  # its first expert
    renamed = []
    for name, param in named:
        found = _LAYER.match(name)
        if found:
            layer = model.decoder.layers[int(found.group(1))].layer_number - 1
            name = f"decoder.layers.{layer}.{name[found.end() :]}"
        name = _LOCAL_EXPERT.sub(lambda m: f".local_experts.{first + int(m.group(1))}.", name)
        renamed.append((name, param))
    return renamed


def _global_grads(chunk: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int | None]]:
    grads = {}
    for name, param in global_names(chunk):
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        split = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        grads[name] = (grad.detach().clone().float(), split)
    return grads


def install() -> None:
    """Wrap ``finalize_model_grads`` where ``train()`` reads it (see the module docstring)."""
    directory = os.environ.get(GRAD_DIR)
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
    """The whole model's gradients of ``iteration``: every parameter once (the first rank that
    holds it: after ``finalize_model_grads`` its data-parallel copies are equal, and a MoE
    layer's experts live on the ranks of their expert-parallel index), its tensor-parallel
    slices put back together along their partition dimension.
    ``gated`` (SwiGLU): each rank's ``linear_fc1`` holds its slice of the gate and then its
    slice of the up projection, so the gates go first and the ups after them."""
    slices: dict[str, dict[int, tuple[torch.Tensor, int]]] = {}
    full: dict[str, torch.Tensor] = {}
    for entry in sorted(os.listdir(directory)):
        if not entry.endswith(f"-iter{iteration}.pt"):
            continue
        dump = torch.load(os.path.join(directory, entry))
        for name, (grad, split) in dump["grads"].items():
            if split is None:
                full.setdefault(name, grad)
            else:
                slices.setdefault(name, {}).setdefault(dump["ranks"]["tp"], (grad, split))
    for name, parts in slices.items():
        ordered = [parts[tp] for tp in sorted(parts)]
        split = ordered[0][1]
        if gated and name.endswith("mlp.linear_fc1.weight"):
            halves = [grad.chunk(2, dim=split) for grad, _ in ordered]
            ordered = [(half[k], split) for k in (0, 1) for half in halves]
        full[name] = torch.cat([grad for grad, _ in ordered], dim=split)
    return full
