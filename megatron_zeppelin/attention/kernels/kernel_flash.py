"""flash-attn's varlen kernels behind ``kernel_api.AttentionKernel``: ``"flash"`` and ``"flash3"``.

``"flash"`` is flash-attn 2 (the ``flash_attn`` package, Ampere and newer), ``"flash3"``
FlashAttention-3 (the ``flash_attn_interface`` module of the ``flash_attn_3`` package, built from
flash-attention's ``hopper/`` directory, Hopper GPUs). Nothing else in the package needs either.

The forward of ``"flash"`` is flash-attn 2's public ``flash_attn_varlen_func(...,
return_attn_probs=True)``, whose arguments and ``(out, softmax_lse, S_dmask)`` result have not
changed from 2.6 to 2.8. The backward must take the FINAL (merged) output and log-sum-exp, which
the public autograd function cannot, so it calls the private varlen backward, whose calling
convention did change. The convention is picked from the installed version (``FlashRelease``),
never from the function's signature: from 2.7 on the function is a ``torch.library.custom_op``
whose Python signature reads ``(*args, **kwargs)``, so there is nothing to read. Releases:

* flash-attn 2.6: ``_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv,
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
  window_size, softcap, alibi_slopes, deterministic, rng_state=None)``, a plain function
  returning ``(dq, dk, dv, softmax_d)``;
* flash-attn 2.7 and 2.8: the same with ``window_size_left, window_size_right`` (two ints) in
  place of ``window_size``, a custom op that writes ``dq``, ``dk``, ``dv`` and returns
  ``softmax_d`` (2.7.3 added a trailing ``zero_tensors=False``);
* FlashAttention-3 ``3.0.0b1`` (as in flash-attention v2.8.3's ``hopper/``): plain functions,
  ``_flash_attn_forward`` with 25 leading arguments (``q, k, v, k_new, v_new, qv, out,
  cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k, max_seqlen_q,
  max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
  q_descale, k_descale, v_descale, softmax_scale, causal``) returning ``(out, softmax_lse,
  ...)``, and ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q,
  cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale,
  causal, window_size=(-1, -1), ...)`` returning ``(dq, dk, dv, softmax_d)``;
* FlashAttention-3 ``3.0.0``: both are custom ops with the same leading arguments (defaults for
  the rest, ``window_size_left``/``_right`` split), the backward returning ``softmax_d``.

Every call passes the leading arguments by position (a custom op takes them so in every release)
and leaves trailing ones (softcap, determinism) at their defaults; a call's window
(``VarlenBatch.window``, flash-attn's own ``window_size`` convention) goes by keyword in the form
the release takes: one ``window_size`` tuple (flash-attn 2's forward, FlashAttention-3
``3.0.0b1``) or ``window_size_left``/``_right`` (FlashAttention-3 ``3.0.0``); flash-attn 2's
backward takes it by position, in the form ``window_split`` says. Gradients land in buffers the
adapter allocates and passes in (every release writes them).

Both return the varlen log-sum-exp as ``(nq, t)`` float32; the interface wants ``lse_tn``
``(t, nq)``. Their causal mask is aligned to the bottom-right corner, the convention the ring
layout produces. Calls run on the caller's current CUDA stream. Shapes as in ``kernel_api.py``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch

from megatron_zeppelin.attention.kernels.kernel_api import (
    VarlenBatch,
    capability_problem,
    check_half_inputs,
    cuda_capability,
    installed_version,
    version_tuple,
)

__all__ = [
    "Flash2Kernel",
    "Flash3Kernel",
    "FlashRelease",
    "flash2_release",
    "flash2_unavailable",
    "flash3_release",
    "flash3_unavailable",
]


@dataclass(frozen=True)
class FlashRelease:
    """The calling convention of one installed flash-attn; see the module docstring."""

    label: str
    """What the start-up summary calls it, e.g. ``flash-attn 2.7.4``."""
    window_split: bool
    """The private functions take ``window_size_left, window_size_right`` (else one
    ``window_size`` tuple)."""


def flash2_release(version: str) -> FlashRelease:
    """The convention of flash-attn ``version``; ``ValueError`` for releases before 2.6."""
    (major, minor, _), _pre = version_tuple(version)
    if (major, minor) < (2, 6):
        raise ValueError(
            f"flash-attn {version} is older than 2.6, the oldest release kernel 'flash' knows: "
            "upgrade it (pip install -U flash-attn) or use kernel 'torch-flash' or 'torch'"
        )
    return FlashRelease(f"flash-attn {version}", window_split=(major, minor) >= (2, 7))


def flash3_release(version: str) -> FlashRelease:
    """The convention of FlashAttention-3 (``flash_attn_3``) ``version``."""
    (major, _, _), pre = version_tuple(version)
    if major != 3:
        raise ValueError(
            f"flash_attn_3 {version} is not a FlashAttention-3 release kernel 'flash3' knows "
            "(3.0.0b1 and 3.0.x): use kernel 'flash' or 'torch-flash'"
        )
    return FlashRelease(f"FlashAttention-3 {version}", window_split=not pre)


def flash2_unavailable() -> str | None:
    """Why kernel ``"flash"`` cannot run here (``None`` when it can)."""
    version = installed_version("flash_attn", "flash_attn")
    if version is None:
        return "flash-attn is not installed (pip install flash-attn)"
    try:
        flash2_release(version)
    except ValueError as exc:
        return str(exc)
    return capability_problem(cuda_capability(), (8, 0), f"flash-attn {version}")


def flash3_unavailable() -> str | None:
    """Why kernel ``"flash3"`` cannot run here (``None`` when it can)."""
    if importlib.util.find_spec("flash_attn_interface") is None:
        return "FlashAttention-3 is not installed (flash_attn_interface, from hopper/)"
    try:
        version = importlib.metadata.version("flash_attn_3")
    except importlib.metadata.PackageNotFoundError:
        return (
            "flash_attn_interface imports but no flash_attn_3 package says which release it "
            "is; reinstall FlashAttention-3 from flash-attention's hopper/ directory"
        )
    try:
        flash3_release(version)
    except ValueError as exc:
        return str(exc)
    return capability_problem(cuda_capability(), (9, 0), f"FlashAttention-3 {version}")


def _kernel_inputs(name: str, q_tnd, k_tnd, v_tnd, batch: VarlenBatch):  # noqa: ANN001, ANN202
    """Checked, contiguous ``q, k, v`` and the pairs' ``cu_seqlens`` on their device. The engine
    passes views (K and V halves of a received buffer); the kernels need contiguous rows (a
    no-op for tensors that already are)."""
    check_half_inputs(name, q_tnd, k_tnd, v_tnd, batch)
    q, k, v = q_tnd.contiguous(), k_tnd.contiguous(), v_tnd.contiguous()
    return q, k, v, *batch.cu_seqlens(q.device)


def _window(batch: VarlenBatch) -> tuple[int, int]:
    """flash-attn's ``(left, right)`` window of ``batch``; ``(-1, -1)`` (the functions'
    default, which the causal flag bounds on the right) for a call without one."""
    return batch.window_size if batch.window is not None else (-1, -1)


def _window_kwargs(release: FlashRelease, batch: VarlenBatch) -> dict:
    """The window of ``batch`` as the keyword arguments ``release`` takes."""
    left, right = _window(batch)
    if release.window_split:
        return {"window_size_left": left, "window_size_right": right}
    return {"window_size": (left, right)}


def _lse_tn(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """flash-attn's varlen lse ``(nq, t)`` as the interface's float32 ``(t, nq)``."""
    assert tuple(lse.shape) == (q.shape[1], q.shape[0]), (tuple(lse.shape), tuple(q.shape))
    return lse.float().t()


class Flash2Kernel:
    """flash-attn 2's varlen kernels. ``interface`` and ``version`` default to the installed
    ``flash_attn.flash_attn_interface`` and its version (tests pass stand-ins)."""

    name = "flash"
    supports_window = True

    def __init__(self, *, interface: ModuleType | None = None, version: str | None = None):
        if interface is None:
            problem = flash2_unavailable()
            if problem is not None:
                raise ValueError(f"kernel 'flash' cannot run: {problem}")
            interface = importlib.import_module("flash_attn.flash_attn_interface")
            version = installed_version("flash_attn", "flash_attn")
        self.release = flash2_release(version or "unknown")
        self._forward = interface.flash_attn_varlen_func
        self._backward = interface._flash_attn_varlen_backward

    def forward(self, q_tnd, k_tnd, v_tnd, batch, *, softmax_scale):  # noqa: ANN001
        q, k, v, cu_q, cu_k = _kernel_inputs(self.name, q_tnd, k_tnd, v_tnd, batch)
        out, lse, _ = self._forward(
            q,
            k,
            v,
            cu_q,
            cu_k,
            batch.max_seqlen_q,
            batch.max_seqlen_k,
            dropout_p=0.0,
            softmax_scale=softmax_scale,
            causal=batch.causal,
            window_size=_window(batch),
            return_attn_probs=True,
        )
        return out, _lse_tn(lse, q)

    def backward(self, dout_tnd, q_tnd, k_tnd, v_tnd, out_tnd, lse_tn, batch, *, softmax_scale):  # noqa: ANN001
        q, k, v, cu_q, cu_k = _kernel_inputs(self.name, q_tnd, k_tnd, v_tnd, batch)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        window = _window(batch) if self.release.window_split else (_window(batch),)
        self._backward(
            dout_tnd.contiguous(),
            q,
            k,
            v,
            out_tnd.to(q.dtype).contiguous(),
            lse_tn.float().t().contiguous(),
            dq,
            dk,
            dv,
            cu_q,
            cu_k,
            batch.max_seqlen_q,
            batch.max_seqlen_k,
            0.0,
            softmax_scale,
            batch.causal,
            *window,
            0.0,  # softcap
            None,  # alibi_slopes
            False,  # deterministic
            None,  # rng_state
        )
        return dq, dk, dv


class Flash3Kernel:
    """FlashAttention-3's varlen kernels. ``interface`` and ``version`` default to the
    installed ``flash_attn_interface`` and the ``flash_attn_3`` version (tests pass stand-ins)."""

    name = "flash3"
    supports_window = True

    def __init__(self, *, interface: ModuleType | None = None, version: str | None = None):
        if interface is None:
            problem = flash3_unavailable()
            if problem is not None:
                raise ValueError(f"kernel 'flash3' cannot run: {problem}")
            interface = importlib.import_module("flash_attn_interface")
            version = importlib.metadata.version("flash_attn_3")
        self.release = flash3_release(version or "unknown")
        self._forward = interface._flash_attn_forward
        self._backward = interface._flash_attn_backward

    def forward(self, q_tnd, k_tnd, v_tnd, batch, *, softmax_scale):  # noqa: ANN001
        q, k, v, cu_q, cu_k = _kernel_inputs(self.name, q_tnd, k_tnd, v_tnd, batch)
        out, lse, *_ = self._forward(
            q, k, v, None, None, None, None,  # k_new, v_new, qv, out
            cu_q, cu_k, None, None, None,  # cu_seqlens_k_new, seqused_q, seqused_k
            batch.max_seqlen_q, batch.max_seqlen_k,
            None, None, None, None, None, None,  # page table .. seqlens_rotary
            None, None, None,  # q, k, v descale
            softmax_scale, batch.causal, **_window_kwargs(self.release, batch),
        )  # fmt: skip
        return out, _lse_tn(lse, q)

    def backward(self, dout_tnd, q_tnd, k_tnd, v_tnd, out_tnd, lse_tn, batch, *, softmax_scale):  # noqa: ANN001
        q, k, v, cu_q, cu_k = _kernel_inputs(self.name, q_tnd, k_tnd, v_tnd, batch)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._backward(
            dout_tnd.contiguous(), q, k, v, out_tnd.to(q.dtype).contiguous(),
            lse_tn.float().t().contiguous(), cu_q, cu_k,
            None, None,  # seqused_q, seqused_k
            batch.max_seqlen_q, batch.max_seqlen_k, dq, dk, dv, softmax_scale, batch.causal,
            **_window_kwargs(self.release, batch),
        )  # fmt: skip
        return dq, dk, dv
