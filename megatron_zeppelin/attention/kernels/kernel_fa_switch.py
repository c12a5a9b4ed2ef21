"""FlashAttention-3 and -4 through PyTorch's switch: kernels ``"torch-fa3"`` and ``"torch-fa4"``.

From torch 2.11, ``torch.nn.attention.activate_flash_attention_impl("FA3" | "FA4")`` registers
another implementation behind the aten flash operators that ``"torch-flash"`` calls
(``aten::_flash_attention_forward`` / ``_backward``, schemas in ``kernel_aten.py``), for the
whole process, until ``restore_flash_attention_impl()``:

* ``"FA3"`` imports ``flash_attn_interface`` (the ``flash_attn_3`` package, built from
  flash-attention's ``hopper/`` directory; it exposes ``torch.ops.flash_attn_3``) and runs on
  compute capability 9.x only;
* ``"FA4"`` imports ``flash_attn.cute.interface`` (FlashAttention-4, CuTe DSL kernels) and runs
  on compute capability 9.x and 10.x.

Both keep the operators' contract: ``(t, n, d)`` packed rows with int32 cumulative offsets, the
varlen log-sum-exp ``(nq, t)`` float32, the causal mask aligned bottom-right, grouped-query K/V
as they are, and a backward that takes the output and lse it is given (the merged ones). So
these kernels are ``TorchFlashKernel`` with another implementation switched on: each activates
its own before a call when another one is active (``kernel_aten.FlashSwitch``). They are found
at run time: the package must import and the GPU must be one its kernels run on.
"""

from __future__ import annotations

import importlib.util

from megatron_zeppelin.attention.kernels.kernel_api import capability_problem, cuda_capability
from megatron_zeppelin.attention.kernels.kernel_aten import (
    FlashSwitch,
    TorchFlashKernel,
    torch_flash_unavailable,
)

__all__ = ["TorchFA3Kernel", "TorchFA4Kernel", "fa3_switch_unavailable", "fa4_switch_unavailable"]

_MODULES = {"FA3": "flash_attn_interface", "FA4": "flash_attn.cute.interface"}
_PACKAGES = {"FA3": "flash_attn_3 (flash-attention's hopper/)", "FA4": "flash-attn-4"}
_ARCHES = {"FA3": ((9, 0), (10, 0)), "FA4": ((9, 0), (11, 0))}
"""Compute capabilities each implementation's kernels run on: ``[low, high)``."""


def _module_present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that does not import
        return False


def _switch_unavailable(impl: str, switch: FlashSwitch | None = None) -> str | None:
    """Why ``impl`` cannot run through PyTorch's switch here (``None`` when it can)."""
    switch = switch if switch is not None else FlashSwitch()
    if not switch.offers(impl):
        return f"this PyTorch has no switch to {impl} (torch.nn.attention, torch 2.11 or later)"
    problem = torch_flash_unavailable()
    if problem is not None:
        return problem
    if not _module_present(_MODULES[impl]):
        return f"{impl} is not installed ({_MODULES[impl]}, from {_PACKAGES[impl]})"
    low, high = _ARCHES[impl]
    capability = cuda_capability()
    problem = capability_problem(capability, low, f"{impl} through PyTorch's switch")
    if problem is None and capability >= high:
        problem = (
            f"{impl}'s kernels do not run on compute capability {capability[0]}.{capability[1]}"
        )
    return problem


def fa3_switch_unavailable() -> str | None:
    """Why kernel ``"torch-fa3"`` cannot run here (``None`` when it can)."""
    return _switch_unavailable("FA3")


def fa4_switch_unavailable() -> str | None:
    """Why kernel ``"torch-fa4"`` cannot run here (``None`` when it can)."""
    return _switch_unavailable("FA4")


class _SwitchedKernel(TorchFlashKernel):
    """``TorchFlashKernel`` with ``impl`` switched on; construction activates it once, so a
    package that does not import fails here, with a sentence, not in the first layer."""

    def __init__(self, *, ops: object | None = None, switch: FlashSwitch | None = None) -> None:
        if ops is None:
            problem = _switch_unavailable(self.impl, switch)
            if problem is not None:
                raise ValueError(f"kernel {self.name!r} cannot run: {problem}")
        super().__init__(ops=ops, switch=switch)
        try:
            self._switch.use(self.impl)
        except (ImportError, RuntimeError) as exc:
            raise ValueError(
                f"kernel {self.name!r} cannot run: PyTorch could not switch to {self.impl} "
                f"({exc}); use kernel 'torch-flash'"
            ) from None


class TorchFA3Kernel(_SwitchedKernel):
    """FlashAttention-3 behind PyTorch's flash operators (Hopper)."""

    name = "torch-fa3"
    impl = "FA3"


class TorchFA4Kernel(_SwitchedKernel):
    """FlashAttention-4 behind PyTorch's flash operators (Hopper, Blackwell)."""

    name = "torch-fa4"
    impl = "FA4"
