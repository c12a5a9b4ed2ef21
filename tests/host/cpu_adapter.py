"""Test-only: run Megatron-LM's real ``megatron.training`` loop on CPU processes (gloo).

Megatron's loop assumes a GPU in a few places. This adapter makes exactly those calls work on
CPU, each standing in for one GPU per process; it never touches the plugin (the plugin runs on
CPU with gloo as it is). Found by running ``pretrain()`` of megatron-core 0.19 (and once of a
core_v0.16.1 checkout) on CPU and reading its source
(``megatron/training/{initialize,training,arguments}.py``,
``megatron/core/tensor_parallel/random.py``, ``megatron/core/optimizer/clip_grads.py``):

``torch.cuda.is_available`` -> True
    ``initialize_megatron`` asserts "Megatron requires CUDA".
``torch.cuda.device_count`` -> 1
    ``_initialize_distributed`` creates the model-parallel groups, and ``_set_random_seed``
    seeds the model-parallel RNG tracker, only when a device is counted.
``torch.cuda.current_device`` -> 0, ``torch.cuda.set_device`` -> nothing
    Megatron places each rank on ``cuda:LOCAL_RANK``; here every rank's device is the CPU (the
    pipeline schedules' buffers, ``p2p_communication``'s received activations and shape
    messages among them, are made on ``current_device()``: device 0 means the CPU below).
``torch.cuda.get_device_properties`` -> a Hopper GPU
    ``validate_args`` asks for the GPU architecture when TP or CP is above 1
    (``get_device_arch_version``), to decide about ``CUDA_DEVICE_MAX_CONNECTIONS``.
``torch.cuda.Stream``, ``current_stream``, ``stream``, ``synchronize``
    ``get_model`` wraps DDP construction in a side stream and makes the default stream wait, the
    timers synchronize, so does the pipeline's exchange of activation shapes
    (``_communicate_shapes``), and the MoE all-to-all dispatcher records an event on a side
    stream and waits for it before reading its token counts; CPU work is synchronous, so
    ordering calls have nothing to do and every event has happened.
``torch.cuda.get_rng_state``, ``torch.cuda.random.get_rng_state`` -> a CPU generator's state
    the RNG tracker (``CudaRNGStatesTracker.add``, ``fork``) and the checkpoint read the GPU
    generator's state, which would initialize CUDA; a CPU ``torch.Generator`` per process
    answers. Seeding and setting GPU generator states go through CUDA's lazy initialization,
    which queues them and never runs here: the tests use no dropout, so nothing draws from the
    tracker's states.
``torch.accelerator.is_available`` -> False, ``current_accelerator(check_available=True)`` -> None
    with ``torch.cuda.is_available`` True, PyTorch's own accelerator checks (DataLoader memory
    pinning, the optimizers' graph-capture check) would reach the missing driver; they see no
    accelerator instead, as on any CPU machine.
``torch._dynamo.config.disable`` = True
    Megatron compiles its fused kernels with ``torch.compile`` (``megatron.core.jit``) and warms
    them up in ``set_jit_fusion_options``; on CPU they run eagerly, which needs no compiler.
``_warmup_jit_function`` in ``megatron.training.initialize`` -> the same, on a forked CPU generator
    the warm-up draws random inputs and dropout masks (sized by TP and sequence parallelism) on
    the GPU, whose generator weights never come from; here they would advance the CPU generator
    that ``--use-cpu-initialization`` draws every weight from, so runs of different TP sizes
    would start from different models.
``maybe_move_tensor_to_cpu`` in ``megatron.core.transformer.moe.token_dispatcher`` -> a copy
    the MoE all-to-all dispatcher moves its token counts off the GPU with it and hands them to
    ``all_to_all_single`` as NumPy split sizes; it converts only tensors on the GPU, so on CPU the
    counts stayed tensors, which ``all_to_all_single`` refuses. Every tensor here stands for a
    GPU tensor, so every one is copied and converted as the GPU's would be.
``megatron.legacy.fused_kernels.load`` -> nothing (core_v0.16.1 only)
    that release's ``_compile_dependencies`` builds legacy CUDA kernels with nvcc; there is no
    CUDA toolkit here and nothing uses them (0.19 dropped the step).
Device arguments (a ``TorchFunctionMode``)
    ``device="cuda"`` / ``cuda:N`` / an integer index in factory calls and ``Tensor.to``, and
    ``Tensor.cuda()`` (``get_model`` moves the model, ``pretrain`` all-reduces its start time),
    mean the CPU; ``Tensor.type()`` reports ``torch.cuda.*Tensor`` names for CPU tensors, since
    ``clip_grad_by_total_norm_fp32`` and the optimizers assert that gradients are on the device.

Flags, not patches, cover the rest: ``--no-gradient-accumulation-fusion`` (Apex's fused
weight-gradient kernel), ``--no-persist-layer-norm`` (Apex's), ``--transformer-impl local`` (no
TransformerEngine), ``--distributed-backend gloo`` and ``--num-workers 0``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_GENERATOR = torch.Generator()  # answers for this process's GPU generator


class _Event:
    """A CUDA event on CPU: work is synchronous, so every event has happened."""

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """A CUDA stream on CPU: work is synchronous, so there is nothing to order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass


_STREAM = _Stream()


@dataclass(frozen=True)
class _Properties:
    """What Megatron reads of ``torch.cuda.get_device_properties``: a Hopper GPU."""

    major: int = 9
    minor: int = 0
    name: str = "CPU standing in for a GPU"
    total_memory: int = 80 * 10**9


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index names an accelerator device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaMeansCpu(TorchFunctionMode):
    """Device arguments naming a GPU mean the CPU (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _accelerator_patches() -> list[tuple[Any, str, Any]]:
    current = torch.accelerator.current_accelerator
    return [
        (torch.accelerator, "is_available", lambda: False),
        (
            torch.accelerator,
            "current_accelerator",
            lambda check_available=False: None if check_available else current(),
        ),
    ]


def _validation_patches() -> list[tuple[Any, str, Any]]:
    """What ``validate_args`` needs: the GPU architecture."""
    return [
        (torch.cuda, "get_device_properties", lambda device=None: _Properties()),
    ]


def _warm_up_on_its_own_generator(warm_up):
    """Megatron's kernel warm-up, drawing from a forked CPU generator (see the docstring)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            return warm_up(*args, **kwargs)

    return run


def _loop_patches() -> list[tuple[Any, str, Any]]:
    """What ``pretrain()`` needs beyond validation (see the module docstring)."""
    import megatron.training.initialize as initialize

    cuda = torch.cuda
    return [
        (cuda, "is_available", lambda: True),
        (cuda, "device_count", lambda: 1),
        (cuda, "current_device", lambda: 0),
        (cuda, "set_device", lambda device: None),
        (cuda, "synchronize", lambda device=None: None),
        (cuda, "Stream", _Stream),
        (cuda, "current_stream", lambda device=None: _STREAM),
        (cuda, "stream", lambda stream: contextlib.nullcontext()),
        (cuda, "get_rng_state", lambda device="cuda": _GENERATOR.get_state()),
        (cuda.random, "get_rng_state", lambda device="cuda": _GENERATOR.get_state()),
        (torch._dynamo.config, "disable", True),
        (
            initialize,
            "_warmup_jit_function",
            _warm_up_on_its_own_generator(initialize._warmup_jit_function),
        ),
        *_accelerator_patches(),
        *_moe_patches(),
        *_core_v0_16_1_patches(),
    ]


def _moe_patches() -> list[tuple[Any, str, Any]]:
    """The MoE dispatcher's copies off the GPU (see the module docstring)."""
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if not torch.is_tensor(tensor):
            return tensor
        copy = tensor.detach().clone()
        return copy.numpy() if as_numpy else copy

    return [(token_dispatcher, "maybe_move_tensor_to_cpu", to_host)]


def _core_v0_16_1_patches() -> list[tuple[Any, str, Any]]:
    """Megatron-LM core_v0.16.1 only (its ``megatron.legacy`` is absent from 0.19's wheel)."""
    try:
        import megatron.legacy.fused_kernels as fused_kernels
    except ImportError:
        return []
    return [(fused_kernels, "load", lambda args: None)]


def _apply(patches: list[tuple[Any, str, Any]]) -> list[tuple[Any, str, Any]]:
    """Set every patch; return what they replaced, in the order to restore it."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    return saved[::-1]


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = _apply(patches)
    try:
        yield
    finally:
        _apply(saved)


def validation_on_cpu() -> contextlib.AbstractContextManager[None]:
    """``parse_args`` + ``validate_args`` on CPU, undone on exit (for in-process tests)."""
    return _patched(_validation_patches())


def install() -> None:
    """Everything, for the rest of this process (the launched training processes)."""
    _apply(_validation_patches() + _loop_patches())
    _CudaMeansCpu().__enter__()
