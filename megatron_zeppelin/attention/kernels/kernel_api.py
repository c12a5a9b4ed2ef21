"""The varlen-kernel interface: what the ring code asks of an attention kernel, and its checks.

One varlen call computes ``P`` independent attention problems packed back to back, as
flash-attn's ``flash_attn_varlen_func`` does: pair ``p`` takes query rows
``cu_seqlens_q[p]:cu_seqlens_q[p+1]`` and key rows ``cu_seqlens_k[p]:cu_seqlens_k[p+1]``.
A call is either unmasked (every query sees every key of its pair) or causal with the mask
aligned to the bottom-right corner, flash-attn's convention: query ``i`` of a pair with ``lq``
queries and ``lk`` keys sees keys ``j <= i + lk - lq``. A call may also carry a left *window*
``w`` (flash-attn's ``window_size[0]``, aligned the same way): query ``i`` then sees only keys
``j >= i + lk - lq - w``, on top of the causal bound or alone. The ring code cuts every block into
pairs of these kinds (``layout.py`` explains why that is always possible). Kernels say with
``supports_window`` whether they honour a window; the registry (``kernels.py``) keeps a call
with a window away from those that do not.

Every kernel returns the output AND the log-sum-exp of the scaled scores per query row and head
(natural log, ``-inf`` where a row sees no key, with a zero output there), so partial results
can be merged (``merge.py``); its backward takes the final (merged) output and lse, which makes
the gradient of each pair exact on its own. Kernels live one per module (``kernel_torch.py``,
``kernel_flash.py``, ``kernel_aten.py``, ``kernel_fa_switch.py``, ``kernel_cudnn.py``,
``kernel_te.py``); ``kernels.py`` is the registry that picks one.

Nothing a kernel does per call may block the host on the device: index tensors a kernel needs
on the GPU are built once per batch on the host and sent with ``devices.to_device`` (pinned
memory, a copy the stream orders), never with a plain ``.to(device)``, whose copy from pageable
memory waits for every kernel queued before it.

Shapes: ``q_tnd`` ``(t, nq, d)``, ``k_tnd``/``v_tnd`` ``(t, nkv, d)`` with ``nq % nkv == 0``
(grouped-query attention: query head ``h`` uses key/value head ``h // (nq // nkv)``); ``lse_tn``
``(t, nq)``. Letters: t packed rows, n heads, d head dim.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from megatron_zeppelin.devices import to_device

__all__ = [
    "AttentionKernel",
    "VarlenBatch",
    "capability_problem",
    "check_shapes",
    "compute_dtype",
    "cuda_capability",
    "installed_version",
    "supports_window",
    "version_tuple",
]


def cuda_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, ``None`` without one (what the kernels'
    availability checks read; the only place they look at the machine)."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def capability_problem(
    capability: tuple[int, int] | None, least: tuple[int, int], what: str
) -> str | None:
    """Why ``what`` cannot run on a GPU of ``capability`` (``None``: no GPU) when it needs
    ``least``; ``None`` when it can."""
    if capability is None:
        return f"{what} needs a CUDA GPU and none is visible"
    if capability < least:
        return (
            f"{what} needs compute capability {least[0]}.{least[1]} or newer; this GPU has "
            f"{capability[0]}.{capability[1]}"
        )
    return None


def installed_version(distribution: str, module: str) -> str | None:
    """The installed version of ``distribution`` (``None`` when ``module`` is absent); found
    without importing the module where the package metadata says it."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):  # a parent package that fails to import
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return getattr(importlib.import_module(module), "__version__", None) or "unknown"


def version_tuple(version: str) -> tuple[tuple[int, int, int], bool]:
    """``(major, minor, patch)`` of a library's version and whether it is a pre-release
    (``3.0.0b1``, ``3.0.0.b1``); ``2.8.0+cu12`` and ``2.4.0+3cd6870c`` read as releases."""
    found = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?(.*)$", version)
    if found is None:
        raise ValueError(f"cannot read the version {version!r}")
    major, minor, patch, rest = found.groups()
    pre = re.match(r"^[.\-_]?(a|b|rc|dev)", rest) is not None
    return (int(major), int(minor), int(patch or 0)), pre


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention is accumulated in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class VarlenBatch:
    """The pairs of one varlen call: their lengths, whether the call is causal, and its left
    window (``None``: none; see the module docstring).

    Built once per plan and reused in forward and backward; kernels cache their per-device
    index tensors on it. Lengths are kept as numpy arrays: building thousands of these per
    plan is bookkeeping, not tensor work.
    """

    def __init__(
        self,
        lengths_q: Sequence[int],
        lengths_k: Sequence[int],
        *,
        causal: bool,
        window: int | None = None,
    ) -> None:
        self.lengths_q = np.asarray(lengths_q, dtype=np.int64).reshape(-1)
        self.lengths_k = np.asarray(lengths_k, dtype=np.int64).reshape(-1)
        if self.lengths_q.shape != self.lengths_k.shape:
            raise ValueError("a varlen batch needs one query length and one key length per pair")
        if self.num_pairs and (self.lengths_q.min() < 1 or self.lengths_k.min() < 1):
            raise ValueError("every pair of a varlen batch needs at least one query and one key")
        if window is not None and window < 0:
            raise ValueError(f"a left window counts keys and cannot be negative, got {window}")
        self.causal = bool(causal)
        self.window = None if window is None else int(window)
        self.cu_seqlens_q = np.concatenate([[0], np.cumsum(self.lengths_q)])
        self.cu_seqlens_k = np.concatenate([[0], np.cumsum(self.lengths_k)])
        self.max_seqlen_q = int(self.lengths_q.max()) if self.num_pairs else 0
        self.max_seqlen_k = int(self.lengths_k.max()) if self.num_pairs else 0
        self.cache: dict[Any, Any] = {}

    @property
    def num_pairs(self) -> int:
        return int(self.lengths_q.shape[0])

    @property
    def total_q(self) -> int:
        return int(self.cu_seqlens_q[-1])

    @property
    def total_k(self) -> int:
        return int(self.cu_seqlens_k[-1])

    def cu_seqlens(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cu_seqlens_q``, ``cu_seqlens_k`` as int32 on ``device`` (flash-attn's format)."""
        key = ("cu_seqlens", str(device))
        if key not in self.cache:
            self.cache[key] = tuple(
                to_device(cu.astype(np.int32), torch.device(device))
                for cu in (self.cu_seqlens_q, self.cu_seqlens_k)
            )
        return self.cache[key]

    @property
    def window_size(self) -> tuple[int, int]:
        """flash-attn's ``(left, right)`` window of this call, ``-1`` for no bound."""
        left = -1 if self.window is None else self.window
        return left, 0 if self.causal else -1

    def __repr__(self) -> str:
        kind = "causal" if self.causal else "full"
        if self.window is not None:
            kind += f" window {self.window}"
        return f"VarlenBatch({self.num_pairs} {kind} pairs, {self.total_q}x{self.total_k} rows)"


class AttentionKernel(Protocol):
    """A varlen kernel. Both methods return new tensors that the caller owns: the engine adopts
    them as its running output and gradient buffers and writes into them. ``forward`` returns
    ``(out_tnd, lse_tn)``; ``backward`` ``(dq, dk, dv)`` shaped like ``q``, ``k``, ``v``. Both
    run on the caller's current CUDA stream (the engine's compute stream)."""

    name: str
    supports_window: bool
    """Whether ``forward``/``backward`` honour ``VarlenBatch.window`` (a kernel without the
    attribute is taken not to)."""

    def forward(
        self,
        q_tnd: torch.Tensor,
        k_tnd: torch.Tensor,
        v_tnd: torch.Tensor,
        batch: VarlenBatch,
        *,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout_tnd: torch.Tensor,
        q_tnd: torch.Tensor,
        k_tnd: torch.Tensor,
        v_tnd: torch.Tensor,
        out_tnd: torch.Tensor,
        lse_tn: torch.Tensor,
        batch: VarlenBatch,
        *,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def supports_window(kernel: object) -> bool:
    """Whether ``kernel`` honours a call's window (``AttentionKernel.supports_window``)."""
    return bool(getattr(kernel, "supports_window", False))


HALF = (torch.float16, torch.bfloat16)
"""The dtypes the fused kernels (flash-attn, aten's flash and cuDNN operators, TE) take."""


def check_half_inputs(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: VarlenBatch,
    *,
    dtypes: tuple[torch.dtype, ...] = HALF,
) -> None:
    """``check_shapes``, then raise ``ValueError`` naming kernel ``name`` unless the inputs are
    in ``dtypes`` and the head dim is a multiple of 8 up to 256 (what the fused kernels take)."""
    check_shapes(q, k, v, batch)
    if q.dtype not in dtypes:
        raise ValueError(
            f"kernel {name!r} takes float16 or bfloat16 inputs, got {q.dtype}: use kernel "
            "'torch' (or 'auto', which picks it for other dtypes)"
        )
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        raise ValueError(
            f"kernel {name!r} takes head dims that are multiples of 8 up to 256, got "
            f"{q.shape[-1]}: use kernel 'torch'"
        )


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: VarlenBatch) -> None:
    """Raise ``ValueError`` unless ``q`` ``(t, nq, d)``, ``k`` and ``v`` ``(t, nkv, d)`` fit
    ``batch`` (``nq`` a multiple of ``nkv``; ``batch.total_q`` query and ``batch.total_k`` key
    rows). Every kernel checks its inputs with it before calling into its library."""
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"expected q (t, nq, d) and k, v (t, nkv, d); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k.shape[1]} K/V heads")
    if q.shape[0] != batch.total_q or k.shape[0] != batch.total_k:
        raise ValueError(
            f"{batch!r} needs {batch.total_q} query rows and {batch.total_k} key rows, got "
            f"{q.shape[0]} and {k.shape[0]}"
        )
