"""Where and in what precision the training job runs: its device, its dtype, its optimizer.

``--device cuda`` puts each process on its own GPU (``LOCAL_RANK``); ``--dtype bf16`` trains as
Megatron does with ``--bf16``: the model's parameters, activations and gradients in bfloat16,
and the optimizer stepping float32 *main* copies of the parameters, written back to the model
after each step (``MainWeightsAdam``; Megatron's ``Float16OptimizerWithFloat16Params`` does the
same). A bf16 model stepped by Adam on its own bf16 weights loses every update smaller than a
bfloat16 step of the weight (about 1/256 of it), which stalls small learning rates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from megatron_zeppelin.devices import resolve_device

__all__ = ["DEVICES", "DTYPES", "MainWeightsAdam", "job_device", "make_optimizer"]

DEVICES = ("cpu", "cuda")
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def job_device(name: str) -> torch.device:
    """This process's device: the CPU, or the GPU of its ``LOCAL_RANK`` (``devices.py``)."""
    if name not in DEVICES:
        raise ValueError(f"--device {name!r} is not one of {list(DEVICES)}")
    return resolve_device(name)


class MainWeightsAdam:
    """Adam over float32 copies of a half-precision model's parameters.

    ``step`` takes the model's (bf16) gradients into the float32 copies, steps Adam on them and
    copies the result back into the model; ``zero_grad`` clears the model's gradients. The
    state dict holds the float32 copies, so a resumed run continues from the exact weights."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        self.main_params = [p.detach().float().clone().requires_grad_() for p in self.model_params]
        self.adam = torch.optim.Adam(self.main_params, lr=lr)

    def step(self) -> None:
        for main, param in zip(self.main_params, self.model_params):
            main.grad = None if param.grad is None else param.grad.float()
        self.adam.step()
        with torch.no_grad():
            for main, param in zip(self.main_params, self.model_params):
                param.copy_(main)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.model_params:
            param.grad = None
        for main in self.main_params:
            main.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "main_params": [m.detach().clone() for m in self.main_params],
            "adam": self.adam.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["main_params"]
        if len(saved) != len(self.main_params):
            raise ValueError(
                f"the checkpoint's optimizer holds {len(saved)} main weights and this model has "
                f"{len(self.main_params)}: resume with the model flags the run was saved with"
            )
        with torch.no_grad():
            for main, value, param in zip(self.main_params, saved, self.model_params):
                main.copy_(value)
                param.copy_(value)
        self.adam.load_state_dict(state["adam"])


def make_optimizer(model: torch.nn.Module, *, lr: float, dtype: torch.dtype):  # noqa: ANN201
    """Adam on the parameters themselves in float32, on float32 main copies otherwise."""
    if dtype == torch.float32:
        return torch.optim.Adam(model.parameters(), lr=lr)
    return MainWeightsAdam(model.parameters(), lr=lr)
