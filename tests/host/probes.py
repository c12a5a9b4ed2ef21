"""Test-only probes in the launched training processes, each behind an environment variable
(``run_on_cpu.py`` installs them; nothing here ships in the package):

``ZEPPELIN_TEST_GRADIENTS=DIR``
    after Megatron's ``finalize_model_grads`` (the gradients summed over the data-parallel
    ranks and divided by the global token count, as the optimizer receives them) every rank
    writes ``DIR/rankR-iterN.pt``: ``{global name: gradient}``, so a test compares every
    gradient of a run with another run's;
``ZEPPELIN_TEST_INIT_FROM_NAMES=1``
    right after ``get_model`` every parameter is drawn again from a generator seeded with its
    *global* name (norm weights and biases, constant at initialization, are left as they are).
    Megatron draws expert weights on each expert-parallel rank from the same generator state,
    so runs with different ``--expert-model-parallel-size`` start from different models; drawn
    by name, every layout starts from the same one.

The global name is the parameter's name inside the model (wrappers' ``module.`` prefixes
dropped) with a local expert index ``local_experts.I`` turned into the global one (this rank's
expert-parallel rank x local experts + I). Tensor parallelism is not handled (these tests run
TP 1): a sharded parameter would be compared shard against whole.
"""

from __future__ import annotations

import os
import re
import zlib
from typing import Any

import torch

GRADIENTS = "ZEPPELIN_TEST_GRADIENTS"
INIT_FROM_NAMES = "ZEPPELIN_TEST_INIT_FROM_NAMES"
_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")
_INIT_STD = 0.02


def global_names(model_chunk: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(global name, parameter)`` of a model chunk (see the module docstring)."""
    from megatron.core import parallel_state

    named = list(model_chunk.named_parameters())
    local = {int(m.group(1)) for name, _ in named for m in [_LOCAL_EXPERT.search(name)] if m}
    first = parallel_state.get_expert_model_parallel_rank() * len(local) if local else 0

    def rename(name: str) -> str:
        while name.startswith("module."):
            name = name[len("module.") :]
        return _LOCAL_EXPERT.sub(lambda m: f"local_experts.{first + int(m.group(1))}.", name)

    return [(rename(name), p) for name, p in named]


def _redraw(model: list[torch.nn.Module]) -> None:
    with torch.no_grad():
        for chunk in model:
            for name, param in global_names(chunk):
                if param.numel() > 1 and bool((param == param.reshape(-1)[0]).all()):
                    continue  # a norm weight or a bias: constant at initialization
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                drawn = torch.randn(param.shape, generator=generator) * _INIT_STD
                param.copy_(drawn.to(param.dtype))


def _dump(model: list[torch.nn.Module], directory: str, iteration: int) -> None:
    grads = {}
    for chunk in model:
        for name, param in global_names(chunk):
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None:
                grads[name] = grad.detach().float().clone()
    rank = torch.distributed.get_rank()
    torch.save(grads, os.path.join(directory, f"rank{rank}-iter{iteration}.pt"))


def install() -> None:
    """Wrap Megatron's ``get_model`` and ``finalize_model_grads`` where the variables ask."""
    from megatron.training import training

    if os.environ.get(INIT_FROM_NAMES):
        get_model = training.get_model

        def get_model_drawn_by_name(*args: Any, **kwargs: Any):
            model = get_model(*args, **kwargs)
            _redraw(model if isinstance(model, list) else [model])
            return model

        training.get_model = get_model_drawn_by_name
    directory = os.environ.get(GRADIENTS)
    if directory:
        finalize = training.finalize_model_grads
        calls = [0]

        def finalize_and_dump(model, *args: Any, **kwargs: Any):
            result = finalize(model, *args, **kwargs)
            calls[0] += 1
            _dump(model, directory, calls[0])
            return result

        training.finalize_model_grads = finalize_and_dump
