"""PyTorch's own cuDNN varlen attention behind ``kernel_api.AttentionKernel``: ``"cudnn"``.

PyTorch ships cuDNN's fused attention as two operators that take packed rows with cumulative
offsets (schemas as in torch 2.13, ``torch.ops.aten._cudnn_attention_forward.default._schema``):

* ``aten::_cudnn_attention_forward(query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q,
  max_k, compute_log_sumexp, dropout_p=0., is_causal=False, return_debug_mask=False, *,
  scale=None) -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
  philox_offset, debug_attn_mask)``;
* ``aten::_cudnn_attention_backward(grad_out, query, key, value, out, logsumexp, philox_seed,
  philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *,
  scale=None) -> (dq, dk, dv)``.

With ``cum_seq_*`` given, query, key and value are ``(t, n, d)`` (grouped-query K/V taken as they
are: the query, key and value head counts reach cuDNN apart) and the log-sum-exp comes back
``(t, nq, 1)`` float32; the backward reads it in that shape. Nothing needs installing beyond a
PyTorch built with cuDNN 9.

The mask. cuDNN's causal mask here is aligned to the TOP-LEFT corner (query ``i`` sees keys
``j <= i``), while a ring's causal pairs are aligned bottom-right (``kernel_api.py``): query ``i``
of ``lq`` sees keys ``j <= i + lk - lq``, and the ring never makes ``lq > lk``. The two agree
where ``lq == lk``. A pair with more keys than queries is cut in two: its first ``lk - lq`` keys,
which every query sees (one unmasked call over all such pairs), and its last ``lq`` keys, a
square causal block (the causal call, with the squares of every pair). The two parts' outputs
are merged with their log-sum-exp (``merge.py``), exactly; the backward runs both parts with the
final output and lse and adds the gradients (the parts' key rows do not overlap). The cut's
index tensors are built once per batch. Calls run on the caller's current CUDA stream.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_zeppelin.attention.kernels.kernel_api import (
    HALF,
    VarlenBatch,
    capability_problem,
    check_half_inputs,
    compute_dtype,
    cuda_capability,
)
from megatron_zeppelin.attention.merge import merge_rows_
from megatron_zeppelin.devices import to_device

__all__ = ["TorchCudnnKernel", "cudnn_unavailable"]


def cudnn_unavailable() -> str | None:
    """Why kernel ``"cudnn"`` cannot run here (``None`` when it can)."""
    if not torch.backends.cudnn.is_available():
        return f"this PyTorch ({torch.__version__}) has no cuDNN"
    version = torch.backends.cudnn.version() or 0
    if version < 90000:
        return f"PyTorch's cuDNN attention needs cuDNN 9 or newer; this PyTorch has {version}"
    return capability_problem(cuda_capability(), (8, 0), "PyTorch's cuDNN attention")


class _Cut:
    """A causal batch as top-left causal calls run it (module docstring), on one device."""

    def __init__(self, batch: VarlenBatch, device: torch.device) -> None:
        lq, lk, cu_q, cu_k = (
            batch.lengths_q,
            batch.lengths_k,
            batch.cu_seqlens_q,
            batch.cu_seqlens_k,
        )
        if (lq > lk).any():
            raise ValueError(
                "kernel 'cudnn' takes causal pairs with at most as many queries as keys (the ring "
                f"makes no others); got {batch!r}"
            )
        self.square = VarlenBatch(lq, lq, causal=True)
        longer = np.flatnonzero(lk > lq)
        self.square_keys = None  # every pair square: the keys as they are
        self.prefix: VarlenBatch | None = None
        if longer.shape[0] == 0:
            return
        self.square_keys = to_device(_runs(cu_k[1:] - lq, lq), device)
        self.prefix = VarlenBatch(lq[longer], lk[longer] - lq[longer], causal=False)
        self.prefix_queries = to_device(_runs(cu_q[:-1][longer], lq[longer]), device)
        self.prefix_keys = to_device(_runs(cu_k[:-1][longer], lk[longer] - lq[longer]), device)


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(start, start + length)`` of every run (int64)."""
    owner = np.repeat(np.arange(lengths.shape[0]), lengths)
    first = np.cumsum(lengths) - lengths
    return (starts[owner] + np.arange(owner.shape[0]) - first[owner]).astype(np.int64)


def _stats(lse_tn: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(t, nq)`` lse as the backward reads it: ``(t, nq, 1)``, float32 for fp16/bf16."""
    return lse_tn.to(compute_dtype(dtype)).unsqueeze(-1).contiguous()


def _rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


class TorchCudnnKernel:
    """PyTorch's cuDNN varlen operators (fp16/bf16 on CUDA), causal pairs cut for their
    top-left mask. ``ops`` defaults to ``torch.ops.aten``; tests pass a stand-in with the
    operators' contract (and ``dtypes``: a stand-in computing in float64 takes float64)."""

    name = "cudnn"
    # PyTorch's cuDNN operators take no window: ``auto`` skips them for windowed layers.
    supports_window = False

    def __init__(self, *, ops: object | None = None, dtypes: tuple[torch.dtype, ...] = HALF):
        if ops is None:
            problem = cudnn_unavailable()
            if problem is not None:
                raise ValueError(f"kernel 'cudnn' cannot run: {problem}")
            ops = torch.ops.aten
        self._ops = ops
        self._dtypes = dtypes

    def _cut(self, batch: VarlenBatch, device: torch.device) -> _Cut:
        key = ("cudnn-cut", str(device))
        if key not in batch.cache:
            batch.cache[key] = _Cut(batch, device)
        return batch.cache[key]

    def _forward(self, q, k, v, batch: VarlenBatch, scale: float):  # noqa: ANN001, ANN202
        """One operator call: ``out`` and ``lse`` ``(t, nq)`` in the compute dtype."""
        cu_q, cu_k = batch.cu_seqlens(q.device)
        out, lse, *_ = self._ops._cudnn_attention_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), None, cu_q, cu_k,
            batch.max_seqlen_q, batch.max_seqlen_k, True, 0.0, batch.causal, False, scale=scale,
        )  # fmt: skip
        assert tuple(lse.shape) == (q.shape[0], q.shape[1], 1), (tuple(lse.shape), q.shape)
        return out, lse[..., 0].to(compute_dtype(q.dtype))

    def _backward(self, dout, q, k, v, out, lse, batch: VarlenBatch, scale: float):  # noqa: ANN001, ANN202
        cu_q, cu_k = batch.cu_seqlens(q.device)
        philox = torch.zeros((), dtype=torch.int64, device=q.device)  # read for dropout only
        return self._ops._cudnn_attention_backward(
            dout.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
            out.to(q.dtype).contiguous(), _stats(lse, q.dtype), philox, philox,
            None, cu_q, cu_k, batch.max_seqlen_q, batch.max_seqlen_k, 0.0, batch.causal,
            scale=scale,
        )  # fmt: skip

    def forward(self, q_tnd, k_tnd, v_tnd, batch, *, softmax_scale):  # noqa: ANN001
        check_half_inputs("cudnn", q_tnd, k_tnd, v_tnd, batch, dtypes=self._dtypes)
        if not batch.causal:
            return self._forward(q_tnd, k_tnd, v_tnd, batch, softmax_scale)
        cut = self._cut(batch, q_tnd.device)
        keys = cut.square_keys
        out, lse = self._forward(
            q_tnd, _rows(k_tnd, keys), _rows(v_tnd, keys), cut.square, softmax_scale
        )
        if cut.prefix is None:
            return out, lse
        rows, prefix_keys = cut.prefix_queries, cut.prefix_keys
        part, part_lse = self._forward(
            q_tnd.index_select(0, rows),
            k_tnd.index_select(0, prefix_keys),
            v_tnd.index_select(0, prefix_keys),
            cut.prefix,
            softmax_scale,
        )
        out = out.to(compute_dtype(q_tnd.dtype))
        merge_rows_(out, lse, rows, part.to(out.dtype), part_lse, unique=True)
        return out, lse

    def backward(self, dout_tnd, q_tnd, k_tnd, v_tnd, out_tnd, lse_tn, batch, *, softmax_scale):  # noqa: ANN001
        check_half_inputs("cudnn", q_tnd, k_tnd, v_tnd, batch, dtypes=self._dtypes)
        if not batch.causal:
            return self._backward(
                dout_tnd, q_tnd, k_tnd, v_tnd, out_tnd, lse_tn, batch, softmax_scale
            )
        cut = self._cut(batch, q_tnd.device)
        keys = cut.square_keys
        dq, dk_sq, dv_sq = self._backward(
            dout_tnd, q_tnd, _rows(k_tnd, keys), _rows(v_tnd, keys), out_tnd, lse_tn,
            cut.square, softmax_scale,
        )  # fmt: skip
        if cut.prefix is None:
            return dq, dk_sq, dv_sq
        rows, prefix_keys = cut.prefix_queries, cut.prefix_keys
        dq_p, dk_p, dv_p = self._backward(
            dout_tnd.index_select(0, rows), q_tnd.index_select(0, rows),
            k_tnd.index_select(0, prefix_keys), v_tnd.index_select(0, prefix_keys),
            out_tnd.index_select(0, rows), lse_tn.index_select(0, rows), cut.prefix,
            softmax_scale,
        )  # fmt: skip
        dtype = compute_dtype(q_tnd.dtype)
        dq = dq.to(dtype).index_add_(0, rows, dq_p.to(dtype))
        # The square and prefix keys of every pair split its keys: each row is written once.
        grads = []
        for square, prefix in ((dk_sq, dk_p), (dv_sq, dv_p)):
            grad = square.new_empty(k_tnd.shape, dtype=dtype)
            grad.index_copy_(0, keys, square.to(dtype))
            grads.append(grad.index_copy_(0, prefix_keys, prefix.to(dtype)))
        return dq, *grads
