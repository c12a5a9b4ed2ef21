"""The kernel registry: attention kernels by name, and what ``"auto"`` picks and why.

Kernels (the interface is ``kernel_api.AttentionKernel``, one module per kernel):

* ``"torch"``: the tiled PyTorch kernel (``kernel_torch.py``), CPU and GPU, any float dtype;
* ``"torch-flash"``: PyTorch's own FlashAttention-2 varlen operators (``kernel_aten.py``),
  fp16/bf16 on CUDA with nothing beyond PyTorch installed;
* ``"flash"``: flash-attn 2 (``kernel_flash.py``), fp16/bf16 on CUDA;
* ``"flash3"``: FlashAttention-3 (``kernel_flash.py``), fp16/bf16 on Hopper;
* ``"auto"``: for fp16/bf16 on CUDA the first of ``flash3``, ``flash``, ``torch-flash`` that
  can run here, else ``torch``.

A kernel asked for by name that cannot run here is one ``ValueError`` saying why and what to
use instead; ``auto`` falls back, and ``choose_kernel`` returns which kernel it took and a
sentence saying why (the start-up summary prints it). Sliding-window attention needs a kernel
that honours a call's window (``kernel_api.AttentionKernel.supports_window``; every built-in
kernel does): asked for ``window=True``, ``auto`` skips the others and a named one that does
not is refused the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_zeppelin.attention.kernel_api import AttentionKernel, supports_window
from megatron_zeppelin.attention.kernel_aten import TorchFlashKernel, torch_flash_unavailable
from megatron_zeppelin.attention.kernel_flash import (
    Flash2Kernel,
    Flash3Kernel,
    flash2_unavailable,
    flash3_unavailable,
)
from megatron_zeppelin.attention.kernel_torch import TorchKernel

__all__ = [
    "AUTO_ORDER",
    "available_kernels",
    "choose_kernel",
    "flash_available",
    "get_kernel",
    "register_kernel",
    "requires_cuda",
]

AUTO_ORDER = ("flash3", "flash", "torch-flash")
"""The CUDA kernels ``auto`` tries, in order, before the tiled ``torch`` kernel."""

_UNAVAILABLE: dict[str, Callable[[], str | None]] = {
    "flash3": flash3_unavailable,
    "flash": flash2_unavailable,
    "torch-flash": torch_flash_unavailable,
}
_FACTORIES: dict[str, Callable[[], AttentionKernel]] = {
    "torch": TorchKernel,
    "torch-flash": TorchFlashKernel,
    "flash": Flash2Kernel,
    "flash3": Flash3Kernel,
}
_INSTANCES: dict[str, AttentionKernel] = {}
_AUTO: dict[tuple[str, torch.dtype | None, bool], str] = {}  # auto's choices, per device, dtype,
# and whether a window is needed


def requires_cuda(name: str) -> bool:
    """Whether kernel ``name`` runs on CUDA only (every built-in kernel but ``torch``)."""
    return name in _UNAVAILABLE


def flash_available() -> bool:
    """Whether flash-attn 2 (kernel ``"flash"``) can run here."""
    return flash2_unavailable() is None


def register_kernel(name: str, factory: Callable[[], AttentionKernel]) -> None:
    """Make ``get_kernel(name)`` return ``factory()`` (e.g. a timing stub)."""
    if name == "auto":
        raise ValueError("'auto' is reserved: it picks between the registered kernels")
    _FACTORIES[name] = factory
    _UNAVAILABLE.pop(name, None)
    _INSTANCES.pop(name, None)
    _AUTO.clear()


def available_kernels() -> list[str]:
    return ["auto", *sorted(_FACTORIES)]


def _problem(name: str, window: bool) -> str | None:
    """Why kernel ``name`` cannot run here (with a window, when ``window``), ``None`` if it can."""
    problem = _UNAVAILABLE[name]() if name in _UNAVAILABLE else None
    if problem is None and window and not supports_window(_instance(name)):
        problem = f"kernel {name!r} has no sliding-window mask (--window-size)"
    return problem


def choose_kernel(
    name: str = "auto",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    window: bool = False,
) -> tuple[str, str]:
    """The kernel that runs for ``name`` on ``device`` with inputs of ``dtype`` (calls with a
    sliding window among them when ``window``), and why.

    A named kernel is returned as it is when it can run here, else ``ValueError`` says why.
    ``"auto"`` takes the first of ``AUTO_ORDER`` that can run (fp16/bf16 on CUDA), else
    ``"torch"``; the reason names what it skipped."""
    if name not in _FACTORIES and name != "auto":
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {available_kernels()}")
    if name != "auto":
        problem = _problem(name, window)
        if problem is not None:
            raise ValueError(
                f"attention kernel {name!r} cannot run here: {problem}; use 'auto' (which "
                "picks the best kernel that runs here) or 'torch' instead"
            )
        return name, f"{name}: asked for by name"
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if not on_cuda:
        return "torch", "no CUDA device: the tiled PyTorch kernel"
    if dtype not in (torch.float16, torch.bfloat16):
        return "torch", (
            f"{str(dtype).removeprefix('torch.')} activations (the flash kernels take float16 "
            "or bfloat16): the tiled PyTorch kernel"
        )
    skipped = []
    for candidate in AUTO_ORDER:
        problem = _problem(candidate, window) if candidate in _FACTORIES else "not registered"
        if problem is None:
            before = f" (skipped: {'; '.join(skipped)})" if skipped else ""
            return candidate, f"{candidate}: the fastest kernel that runs here{before}"
        skipped.append(f"{candidate}: {problem}")
    return "torch", f"no flash kernel runs here ({'; '.join(skipped)}): the tiled PyTorch kernel"


def get_kernel(
    name: str = "auto",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    window: bool = False,
) -> AttentionKernel:
    """The kernel called ``name``; ``"auto"`` resolves with ``device``, ``dtype`` and
    ``window`` (``choose_kernel``, once per device, dtype and window: the engine asks at every
    call)."""
    if name == "auto":
        key = (str(torch.device(device)) if device is not None else "cpu", dtype, window)
        if key not in _AUTO:
            _AUTO[key] = choose_kernel(name, device=device, dtype=dtype, window=window)[0]
        return _instance(_AUTO[key])
    known = _INSTANCES.get(name)
    if known is None or (window and not supports_window(known)):
        choose_kernel(name, device=device, dtype=dtype, window=window)  # why it cannot run
    return _instance(name)


def _instance(name: str) -> AttentionKernel:
    """The one instance of kernel ``name``, created on first use."""
    if name not in _INSTANCES:
        _INSTANCES[name] = _FACTORIES[name]()
    return _INSTANCES[name]
