"""Test-only: every parameter drawn from its name in the whole model, so runs of different
expert parallelism start from the same model.

Installed by ``run_on_cpu.py`` in every rank when ``ZEPPELIN_TEST_INIT_BY_NAME`` is set.
Megatron draws a MoE layer's expert weights on each expert-parallel rank from the same generator
state (and every later weight after however many experts that rank holds), so runs with
different ``--expert-model-parallel-size`` start from different models. Right after
``get_model`` every parameter is drawn again from a generator seeded with its name in the whole
model (``grad_dump.global_names``: global layer and expert indices), N(0, 0.02); norm weights and
biases, constant at initialization, are left as they are. Tensor-parallel slices are not put
together: the runs that use it have tensor parallelism 1.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch
from grad_dump import global_names

INIT_BY_NAME = "ZEPPELIN_TEST_INIT_BY_NAME"
_INIT_STD = 0.02


def _redraw(model: list[torch.nn.Module]) -> None:
    with torch.no_grad():
        for chunk in model:
            for name, param in global_names(chunk):
                if param.numel() > 1 and bool((param == param.reshape(-1)[0]).all()):
                    continue  # a norm weight or a bias: constant at initialization
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                drawn = torch.randn(param.shape, generator=generator) * _INIT_STD
                param.copy_(drawn.to(param.dtype))


def install() -> None:
    """Wrap Megatron's ``get_model`` where ``pretrain()`` calls it (see the module docstring)."""
    if not os.environ.get(INIT_BY_NAME):
        return
    from megatron.training import training

    get_model = training.get_model

    def get_model_drawn_by_name(*args: Any, **kwargs: Any):
        model = get_model(*args, **kwargs)
        _redraw(model if isinstance(model, list) else [model])
        return model

    training.get_model = get_model_drawn_by_name
