"""flash-attn's varlen kernels behind the kernel interface of ``kernels.py``.

Used for fp16/bf16 on CUDA when the ``flash_attn`` package imports; nothing else in the package
needs it. Two conventions are adapted here:

* flash-attn returns the varlen log-sum-exp as ``(nq, t)``; the interface wants ``lse_tn``
  ``(t, nq)`` in float32;
* the backward is flash-attn's private ``_flash_attn_varlen_backward``, whose arguments changed
  across 2.x releases (``window_size`` became ``window_size_left``/``_right``, ``softcap`` and
  ``deterministic`` were added), so arguments are passed by name, filtered by its signature.

Its causal mask is aligned to the bottom-right corner, the convention the ring layout produces.
Shapes as in ``kernels.py``: ``q_tnd`` ``(t, nq, d)``, ``k_tnd``/``v_tnd`` ``(t, nkv, d)``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from megatron_zeppelin.attention.kernels import _check_shapes, flash_available

__all__ = ["FlashKernel"]


class FlashKernel:
    """flash-attn's varlen kernels (fp16/bf16 on CUDA); imported on construction."""

    name = "flash"

    def __init__(self) -> None:
        if not flash_available():
            raise ValueError(
                "kernel 'flash' needs the flash-attn package (pip install flash-attn) on a CUDA "
                "machine; use kernel='torch' or 'auto' instead"
            )
        from flash_attn import flash_attn_interface as fa

        self._varlen_func = fa.flash_attn_varlen_func
        self._varlen_backward = fa._flash_attn_varlen_backward
        try:
            self._backward_params = set(inspect.signature(self._varlen_backward).parameters)
        except (TypeError, ValueError):  # a compiled custom op without a Python signature
            self._backward_params = set()

    def forward(self, q_tnd, k_tnd, v_tnd, batch, *, softmax_scale):  # noqa: ANN001
        _check_shapes(q_tnd, k_tnd, v_tnd, batch)
        # The engine passes views (K and V halves of a received buffer); the kernels need
        # contiguous rows. A no-op for tensors that already are.
        q_tnd, k_tnd, v_tnd = q_tnd.contiguous(), k_tnd.contiguous(), v_tnd.contiguous()
        cu_q, cu_k = batch.cu_seqlens(q_tnd.device)
        out, lse, _ = self._varlen_func(
            q_tnd,
            k_tnd,
            v_tnd,
            cu_q,
            cu_k,
            batch.max_seqlen_q,
            batch.max_seqlen_k,
            dropout_p=0.0,
            softmax_scale=softmax_scale,
            causal=batch.causal,
            return_attn_probs=True,
        )
        # flash-attn 2 returns the varlen lse as (nq, t); this module's contract is (t, nq).
        if lse.shape == (q_tnd.shape[1], q_tnd.shape[0]):
            lse = lse.t()
        return out, lse.float()

    def backward(self, dout_tnd, q_tnd, k_tnd, v_tnd, out_tnd, lse_tn, batch, *, softmax_scale):  # noqa: ANN001
        _check_shapes(q_tnd, k_tnd, v_tnd, batch)
        q_tnd, k_tnd, v_tnd = q_tnd.contiguous(), k_tnd.contiguous(), v_tnd.contiguous()
        cu_q, cu_k = batch.cu_seqlens(q_tnd.device)
        dq, dk, dv = torch.empty_like(q_tnd), torch.empty_like(k_tnd), torch.empty_like(v_tnd)
        args: dict[str, Any] = dict(
            dout=dout_tnd.contiguous(),
            q=q_tnd,
            k=k_tnd,
            v=v_tnd,
            out=out_tnd.contiguous(),
            softmax_lse=lse_tn.float().t().contiguous(),
            dq=dq,
            dk=dk,
            dv=dv,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_k=batch.max_seqlen_k,
            dropout_p=0.0,
            softmax_scale=softmax_scale,
            causal=batch.causal,
            window_size=(-1, -1),
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            rng_state=None,
        )
        params = self._backward_params or set(args) - {"window_size"}
        # The private backward's arguments changed across flash-attn 2.x releases: pass by name.
        self._varlen_backward(**{k: v for k, v in args.items() if k in params})
        return dq, dk, dv
