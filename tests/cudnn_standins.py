"""CPU stand-ins for PyTorch's cuDNN attention operators and its flash-attention switch, and the
masked attention maths the TransformerEngine stand-ins share.

Not tests: ``test_fused_kernels.py`` runs the package's adapters against these.

* ``masked_attention`` / ``masked_attention_backward``: packed pairs with no mask, the causal
  mask aligned bottom-right (flash-attn's and the ring's) or top-left (cuDNN's ``is_causal``:
  query ``i`` sees keys ``j <= i``), computed with the package's tiled kernel
  (``kernel_torch.TorchKernel``) in the inputs' dtype (float64 in the exactness tests). A top-left
  pair is computed as the kernel's pieces: its first ``min(lq, lk)`` queries against as many first
  keys (a square, where both alignments agree) and, where ``lq > lk``, its later queries
  against every key.
* ``cudnn_ops``: ``torch.ops.aten._cudnn_attention_forward`` / ``_backward`` as torch 2.13's
  schemas have them (``torch.ops.aten._cudnn_attention_forward.default._schema``), the causal
  mask top-left, the log-sum-exp ``(t, nq, 1)`` (float32 for fp16/bf16; a float64 call keeps
  float64 so a test measures the adapter, not float32 rounding); the varlen path of PyTorch's
  ``_cudnn_attention_forward`` (``aten/src/ATen/native/transformers/cuda/attention.cu``) returns
  the statistics ``run_cudnn_SDP_fprop_nestedtensor`` allocates, ``(t, h_q, 1)``, and the
  backward reads them as given. Every call is recorded (``calls``).
* ``flash_switch_api``: ``torch.nn.attention``'s ``list_flash_attention_impls``,
  ``current_flash_attention_impl``, ``activate_flash_attention_impl`` and
  ``restore_flash_attention_impl`` (torch 2.13, ``torch/nn/attention/_registry.py``), keeping
  the active implementation in a field; ``recording_flash_ops`` are the aten flash operators'
  stand-ins (``flash_standins.aten_flash_ops``) that record which implementation was active at
  each call.
"""

import types

import flash_standins
import numpy as np
import torch

from megatron_zeppelin.attention.kernels.kernel_api import VarlenBatch
from megatron_zeppelin.attention.kernels.kernel_torch import TorchKernel

MASKS = ("none", "bottom_right", "top_left")


def _runs(starts, lengths) -> torch.Tensor:  # noqa: ANN001
    return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)] or [torch.zeros(0)])


def _pieces(lengths_q, lengths_k, mask: str):  # noqa: ANN001, ANN202
    """``(VarlenBatch, query rows, key rows)`` whose bottom-right/unmasked calls make ``mask``."""
    lq, lk = np.asarray(lengths_q), np.asarray(lengths_k)
    if mask != "top_left":
        rows_q, rows_k = torch.arange(int(lq.sum())), torch.arange(int(lk.sum()))
        return [(VarlenBatch(lq, lk, causal=mask == "bottom_right"), rows_q, rows_k)]
    cu_q = np.concatenate([[0], np.cumsum(lq)])[:-1]
    cu_k = np.concatenate([[0], np.cumsum(lk)])[:-1]
    side = np.minimum(lq, lk)
    pieces = [(VarlenBatch(side, side, causal=True), _runs(cu_q, side), _runs(cu_k, side))]
    later = np.flatnonzero(lq > lk)
    if later.shape[0]:
        rows_q = _runs(cu_q[later] + lk[later], lq[later] - lk[later])
        batch = VarlenBatch(lq[later] - lk[later], lk[later], causal=False)
        pieces.append((batch, rows_q, _runs(cu_k[later], lk[later])))
    return pieces


def masked_attention(q, k, v, lengths_q, lengths_k, *, mask: str, scale: float):  # noqa: ANN001, ANN201
    """``out`` (the compute dtype) and ``lse`` ``(t, nq)`` of the packed pairs under ``mask``."""
    assert mask in MASKS, mask
    out = torch.zeros(q.shape, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=out.dtype)
    for batch, rows_q, rows_k in _pieces(lengths_q, lengths_k, mask):
        part, part_lse = TorchKernel().forward(
            q[rows_q], k[rows_k], v[rows_k], batch, softmax_scale=scale
        )
        out[rows_q], lse[rows_q] = part.to(out.dtype), part_lse.to(out.dtype)
    return out, lse


def masked_attention_backward(dout, q, k, v, out, lse, lengths_q, lengths_k, *, mask, scale):  # noqa: ANN001, ANN201
    """``dq, dk, dv`` (the compute dtype) from the GIVEN ``out`` and ``lse``."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=dtype)
    dk, dv = torch.zeros(k.shape, dtype=dtype), torch.zeros(k.shape, dtype=dtype)
    for batch, rows_q, rows_k in _pieces(lengths_q, lengths_k, mask):
        grads = TorchKernel().backward(
            dout[rows_q], q[rows_q], k[rows_k], v[rows_k], out[rows_q], lse[rows_q], batch,
            softmax_scale=scale,
        )  # fmt: skip
        for total, rows, part in zip((dq, dk, dv), (rows_q, rows_k, rows_k), grads):
            total.index_add_(0, rows, part.to(dtype))
    return dq, dk, dv


def lengths_of(cu: torch.Tensor) -> list[int]:
    if cu.dtype != torch.int32 or cu.dim() != 1:
        raise RuntimeError(f"cumulative lengths must be a 1-D int32 tensor, got {cu.dtype}")
    return (cu[1:] - cu[:-1]).tolist()


def _stats_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# --- torch.ops.aten._cudnn_attention_forward / _backward -------------------------------------
def cudnn_ops() -> types.SimpleNamespace:
    """The two operators (schemas in ``kernel_cudnn.py``), causal mask top-left."""
    calls: list[dict] = []

    def check(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k):  # noqa: ANN001, ANN202
        if cum_seq_q is None or query.dim() != 3:
            raise RuntimeError("this stand-in covers the varlen path: (t, n, d) with cum_seq_q")
        if key.shape != value.shape or query.shape[1] % key.shape[1]:
            raise RuntimeError("key and value (t, n_kv, d) must match; n_q a multiple of n_kv")
        lq, lk = lengths_of(cum_seq_q), lengths_of(cum_seq_k)
        if sum(lq) != query.shape[0] or sum(lk) != key.shape[0]:
            raise RuntimeError("cum_seq_q / cum_seq_k do not cover the packed rows")
        if max(lq) > max_q or max(lk) > max_k:
            raise RuntimeError("max_q / max_k below a sequence's length")
        return lq, lk

    def _cudnn_attention_forward(
        query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
        compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
        scale=None,
    ):  # noqa: ANN001, ANN202  # fmt: skip
        lq, lk = check(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
        if attn_bias is not None or dropout_p != 0.0:
            raise RuntimeError("this stand-in covers no bias and no dropout")
        s = query.shape[-1] ** -0.5 if scale is None else scale
        mask = "top_left" if is_causal else "none"
        calls.append({"op": "forward", "causal": is_causal, "lengths": (lq, lk)})
        out, lse = masked_attention(query, key, value, lq, lk, mask=mask, scale=s)
        lse = lse.to(_stats_dtype(query)).unsqueeze(-1) if compute_log_sumexp else torch.empty(0)
        seed = torch.zeros((), dtype=torch.int64)
        return (out.to(query.dtype), lse, cum_seq_q, cum_seq_k, max_q, max_k, seed, seed,
                torch.empty(0))  # fmt: skip

    def _cudnn_attention_backward(
        grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
        cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None,
    ):  # noqa: ANN001, ANN202  # fmt: skip
        lq, lk = check(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
        if tuple(logsumexp.shape) != (query.shape[0], query.shape[1], 1):
            raise RuntimeError(f"logsumexp must be (t, n_q, 1), got {tuple(logsumexp.shape)}")
        if logsumexp.dtype != _stats_dtype(query) or out.dtype != query.dtype:
            raise RuntimeError("logsumexp float32 (float64 for float64 inputs), out like query")
        if not isinstance(philox_seed, torch.Tensor) or not isinstance(philox_offset, torch.Tensor):
            raise TypeError("philox_seed and philox_offset must be tensors")
        s = query.shape[-1] ** -0.5 if scale is None else scale
        mask = "top_left" if is_causal else "none"
        calls.append({"op": "backward", "causal": is_causal, "lengths": (lq, lk)})
        grads = masked_attention_backward(
            grad_out, query, key, value, out, logsumexp[..., 0], lq, lk, mask=mask, scale=s
        )
        return tuple(g.to(query.dtype) for g in grads)

    return types.SimpleNamespace(
        _cudnn_attention_forward=_cudnn_attention_forward,
        _cudnn_attention_backward=_cudnn_attention_backward,
        calls=calls,
    )


# --- torch.nn.attention's flash-attention switch ---------------------------------------------
def flash_switch_api(impls=("FA3", "FA4")) -> types.SimpleNamespace:  # noqa: ANN001
    """The switch's four functions over a field ``active`` (``None``: PyTorch's FA2)."""
    api = types.SimpleNamespace(active=None, activations=[])

    def activate_flash_attention_impl(impl):  # noqa: ANN001, ANN202
        if impl not in impls:
            raise ValueError(f"Unknown flash attention impl '{impl}'")
        api.active = impl
        api.activations.append(impl)

    def restore_flash_attention_impl(_raise_warn=True):  # noqa: ANN001, ANN202
        api.active = None
        api.activations.append(None)

    api.list_flash_attention_impls = lambda: sorted(impls)
    api.current_flash_attention_impl = lambda: api.active
    api.activate_flash_attention_impl = activate_flash_attention_impl
    api.restore_flash_attention_impl = restore_flash_attention_impl
    return api


def recording_flash_ops(api: types.SimpleNamespace) -> types.SimpleNamespace:
    """The aten flash operators' stand-ins, recording ``api.active`` at each call (``ran``)."""
    ops = flash_standins.aten_flash_ops()
    ran: list = []

    def recorded(fn):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            ran.append(api.active)
            return fn(*args, **kwargs)

        return call

    return types.SimpleNamespace(
        _flash_attention_forward=recorded(ops._flash_attention_forward),
        _flash_attention_backward=recorded(ops._flash_attention_backward),
        ran=ran,
    )
