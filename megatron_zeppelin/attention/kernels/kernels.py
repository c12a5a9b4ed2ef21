"""The kernel registry: attention kernels by name, and what ``"auto"`` picks and why.

Kernels (the interface is ``kernel_api.AttentionKernel``, one module per kernel):

* ``"torch"``: the tiled PyTorch kernel (``kernel_torch.py``), CPU and GPU, any float dtype;
* ``"te"``: TransformerEngine's fused attention on cuDNN, THD layout (``kernel_te.py``), the
  kernel TE's own ring context parallelism runs;
* ``"cudnn"``: PyTorch's own cuDNN varlen operators (``kernel_cudnn.py``), nothing to install;
* ``"torch-flash"``: PyTorch's own FlashAttention-2 varlen operators (``kernel_aten.py``);
* ``"torch-fa3"``, ``"torch-fa4"``: FlashAttention-3 / -4 behind the same operators through
  PyTorch's switch (``kernel_fa_switch.py``), where the package is installed;
* ``"flash"``: flash-attn 2, ``"flash3"``: FlashAttention-3 called directly (``kernel_flash.py``);
* ``"auto"``: for fp16/bf16 on CUDA, the first kernel that can run here in an order: the order
  of measured speed where a calibration of this GPU says so (``choose_kernel``'s ``measured``),
  else a fixed order per GPU generation (``fixed_order``: cuDNN-class kernels first on Hopper and
  Blackwell, flash-attn first before them); the tiled kernel where none runs.

Every kernel but ``torch`` needs CUDA and fp16/bf16. A kernel asked for by name that cannot run
here is one ``ValueError`` saying why and what to use instead; ``auto`` falls back, and
``choose_kernel`` returns which kernel it took and a sentence saying why (the start-up summary
prints it). What an adapter supports beyond the interface is declared on its class, so the
registry reads it without building the kernel (``kernel_class``). Sliding-window attention
needs a kernel that honours a call's window (``kernel_api.AttentionKernel.supports_window``):
asked for ``window=True``, ``auto`` skips the others and a named one that does not is refused
the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_zeppelin.attention.kernels.kernel_api import (
    AttentionKernel,
    cuda_capability,
    supports_window,
)
from megatron_zeppelin.attention.kernels.kernel_aten import (
    TorchFlashKernel,
    torch_flash_unavailable,
)
from megatron_zeppelin.attention.kernels.kernel_cudnn import TorchCudnnKernel, cudnn_unavailable
from megatron_zeppelin.attention.kernels.kernel_fa_switch import (
    TorchFA3Kernel,
    TorchFA4Kernel,
    fa3_switch_unavailable,
    fa4_switch_unavailable,
)
from megatron_zeppelin.attention.kernels.kernel_flash import (
    Flash2Kernel,
    Flash3Kernel,
    flash2_unavailable,
    flash3_unavailable,
)
from megatron_zeppelin.attention.kernels.kernel_te import TEFusedKernel, te_unavailable
from megatron_zeppelin.attention.kernels.kernel_torch import TorchKernel

__all__ = [
    "CUDA_KERNELS",
    "available_kernels",
    "choose_kernel",
    "fixed_order",
    "flash_available",
    "get_kernel",
    "kernel_class",
    "register_kernel",
    "requires_cuda",
]

HOPPER_ORDER = ("te", "cudnn", "flash3", "torch-fa3", "torch-fa4", "flash", "torch-flash")
"""Compute capability 9.x: cuDNN's fused kernels first (what TE and dense SDPA run there), then
FlashAttention-3/4, then the FlashAttention-2 kernels."""
BLACKWELL_ORDER = ("te", "cudnn", "torch-fa4", "flash", "torch-flash")
AMPERE_ORDER = ("flash", "torch-flash", "te", "cudnn")
"""Before Hopper: FlashAttention-2 first (cuDNN's fused kernels gain most on Hopper's)."""

_UNAVAILABLE: dict[str, Callable[[], str | None]] = {
    "te": te_unavailable,
    "cudnn": cudnn_unavailable,
    "flash3": flash3_unavailable,
    "torch-fa3": fa3_switch_unavailable,
    "torch-fa4": fa4_switch_unavailable,
    "flash": flash2_unavailable,
    "torch-flash": torch_flash_unavailable,
}
CUDA_KERNELS = tuple(_UNAVAILABLE)
"""The built-in kernels that run on CUDA only, in the Hopper order."""
_FACTORIES: dict[str, Callable[[], AttentionKernel]] = {
    "torch": TorchKernel,
    "te": TEFusedKernel,
    "cudnn": TorchCudnnKernel,
    "torch-flash": TorchFlashKernel,
    "torch-fa3": TorchFA3Kernel,
    "torch-fa4": TorchFA4Kernel,
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


def kernel_class(name: str) -> Callable[[], AttentionKernel]:
    """What builds kernel ``name`` (its adapter class for the built-in ones): capabilities an
    adapter declares are read from it without building the kernel."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {available_kernels()}")
    return _FACTORIES[name]


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


def fixed_order(capability: tuple[int, int] | None) -> tuple[tuple[str, ...], str]:
    """The order ``auto`` tries without measurements on a GPU of ``capability``, and its name."""
    if capability is None or (9, 0) <= capability < (10, 0):
        return HOPPER_ORDER, "the Hopper order (cuDNN-class kernels first)"
    if capability >= (10, 0):
        return BLACKWELL_ORDER, "the Blackwell order (cuDNN-class kernels first)"
    return AMPERE_ORDER, "the pre-Hopper order (FlashAttention-2 first)"


def _problem(name: str, window: bool) -> str | None:
    """Why kernel ``name`` cannot run here (with a window, when ``window``), ``None`` if it can."""
    probe = _UNAVAILABLE.get(name)
    problem = probe() if probe is not None else None
    if problem is None and window and not _supports_window(name):
        problem = f"kernel {name!r} has no sliding-window mask (--window-size)"
    return problem


def _supports_window(name: str) -> bool:
    factory = _FACTORIES[name]
    # An adapter class declares it; a factory of another kind (a stub) is asked its kernel.
    return supports_window(factory if isinstance(factory, type) else _instance(name))


def choose_kernel(
    name: str = "auto",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    window: bool = False,
    measured: tuple[Sequence[str], str] | None = None,
) -> tuple[str, str]:
    """The kernel that runs for ``name`` on ``device`` with inputs of ``dtype`` (calls with a
    sliding window among them when ``window``), and why.

    A named kernel is returned as it is when it can run here, else ``ValueError`` says why.
    ``"auto"`` (fp16/bf16 on CUDA) takes the first kernel that can run of ``measured``
    (``(names fastest first, where they were measured)``, from a calibration of this GPU), then
    of ``fixed_order``; else ``"torch"``. The reason names the order and what it skipped."""
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
            f"{str(dtype).removeprefix('torch.')} activations (the fused kernels take float16 "
            "or bfloat16): the tiled PyTorch kernel"
        )
    order, order_name = fixed_order(cuda_capability())
    measured_names: list[str] = []
    if measured is not None:
        names, where = measured
        measured_names = [n for n in names if n in _FACTORIES]
        order_name = f"measured speed ({where}), then {order_name}"
    skipped = []
    for candidate in dict.fromkeys([*measured_names, *order]):
        problem = _problem(candidate, window)
        if problem is None:
            before = f" (skipped: {'; '.join(skipped)})" if skipped else ""
            return candidate, f"{candidate}: the first of {order_name} that runs here{before}"
        skipped.append(f"{candidate}: {problem}")
    return "torch", f"no fused kernel runs here ({'; '.join(skipped)}): the tiled PyTorch kernel"


def get_kernel(
    name: str = "auto",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    window: bool = False,
) -> AttentionKernel:
    """The kernel called ``name``; ``"auto"`` resolves with ``device``, ``dtype`` and
    ``window`` (``choose_kernel`` in the fixed order, once per device, dtype and window: the
    engine asks at every call; a run that ranks kernels by a calibration resolves ``auto`` at
    start-up instead)."""
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
