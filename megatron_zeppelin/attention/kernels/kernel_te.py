"""TransformerEngine's fused attention (cuDNN) behind ``kernel_api.AttentionKernel``: ``"te"``.

TransformerEngine's own ring context parallelism calls, per ring step, ``fused_attn_fwd`` and
``fused_attn_bwd`` of ``transformer_engine.pytorch.cpp_extensions.fused_attn`` with packed rows
(THD: ``qkv_layout="thd_thd_thd"``, ``cu_seqlens_q``/``_kv`` and their padded offsets, the same
here since nothing is padded) on cuDNN's arbitrary-sequence-length backend for fp16/bf16. This
adapter makes the same calls with the ring's pairs: mask ``padding_causal_bottom_right`` for a
causal call (the ring's convention, ``kernel_api.py``), ``padding`` for an unmasked one.

Softmax statistics. The forward returns ``(out, aux_ctx_tensors)``: ``aux_ctx_tensors[0]`` is the
log-sum-exp of the scaled scores (natural log, float32 for fp16/bf16), ``[1]`` the dropout RNG
state. The statistics come ``[t, h, 1]`` (one row per packed query) where TE runs on cuDNN 9.6
or newer (and, from TE 2.18, not on compute capability 12.0), else ``[b, h, max_seqlen_q, 1]``
(query ``s`` of pair ``b`` at ``[b, :, s]``, padding after each pair's rows). The adapter reads
the layout from the forward's tensor and hands the backward the merged lse in the same layout
(before any forward, the layout cuDNN's version implies), with a zero RNG state (dropout is 0).

Calling conventions, from TE's sources at each release tag (TE 1.x is refused):

* forward, TE 2.0 to 2.18: ten positional arguments (``is_training, max_seqlen_q,
  max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v, fake_dtype, fused_attention_backend``),
  then keywords whose names have not changed (``cu_seqlens_q_padded``, ``cu_seqlens_kv_padded``,
  ``attn_scale``, ``dropout``, ``qkv_layout``, ``attn_mask_type``). Releases added keywords with
  defaults that are left alone: page tables (2.2), ``softmax_type``/``softmax_offset`` (2.8),
  ``return_max_logit`` (2.9), ``cuda_graph`` (2.10), ``bottom_right_diagonal`` (2.12, derived
  from the mask type);
* backward, TE 2.0 to 2.14: ``fused_attn_bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q,
  cu_seqlens_kv, q, k, v, o, d_o, fake_dtype, dqkv_dtype, aux_ctx_tensors,
  fused_attention_backend, ...)``, ``dqkv_dtype`` being TE's dtype enum
  (``constants.TE_DType[dtype]``), returning ``[dq, dk, dv, ...]``;
* TE 2.15 on: the backward's ``dqkv_dtype`` is gone (``aux_ctx_tensors`` moves up one place),
  and the output, its gradient and the input gradients have formats of their own (``o_format``
  in both passes, ``do_format`` and ``dqkv_layout`` in the backward) whose defaults are
  ``sbhd``: THD inputs need ``"thd"`` and ``"thd_thd_thd"`` passed.

The convention comes from the installed version (``TERelease``). Calls run on the caller's
current CUDA stream. Shapes as in ``kernel_api.py``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_zeppelin.attention.kernels.kernel_api import (
    HALF,
    VarlenBatch,
    capability_problem,
    check_half_inputs,
    compute_dtype,
    cuda_capability,
    installed_version,
    version_tuple,
)
from megatron_zeppelin.devices import to_device

__all__ = ["TEFusedKernel", "TEModules", "TERelease", "te_release", "te_unavailable"]

LAYOUT = "thd_thd_thd"
MASKS = {True: "padding_causal_bottom_right", False: "padding"}
"""TE's mask type for a causal (bottom-right) and an unmasked call of padded-free THD pairs."""


@dataclass(frozen=True)
class TERelease:
    """The calling convention of one installed TransformerEngine; see the module docstring."""

    label: str
    """What the start-up summary calls it, e.g. ``TransformerEngine 2.8.0``."""
    formats: bool
    """2.15 on: ``o_format``/``do_format``/``dqkv_layout``, no positional ``dqkv_dtype``."""


def te_release(version: str) -> TERelease:
    """The convention of TransformerEngine ``version``; ``ValueError`` for 1.x."""
    (major, minor, _), _pre = version_tuple(version)
    if major < 2:
        raise ValueError(
            f"TransformerEngine {version} is older than 2.0, the oldest release kernel 'te' "
            "knows: upgrade it (an NGC PyTorch container of 2025 or later ships 2.x) or use "
            "kernel 'cudnn' or 'torch-flash'"
        )
    return TERelease(f"TransformerEngine {version}", formats=(major, minor) >= (2, 15))


def te_unavailable() -> str | None:
    """Why kernel ``"te"`` cannot run here (``None`` when it can)."""
    version = installed_version("transformer_engine", "transformer_engine")
    if version is None:
        return "TransformerEngine is not installed (pip install transformer_engine[pytorch])"
    try:
        te_release(version)
    except ValueError as exc:
        return str(exc)
    return capability_problem(cuda_capability(), (8, 0), f"TransformerEngine {version}")


@dataclass(frozen=True)
class TEModules:
    """What the adapter takes from TransformerEngine (tests pass stand-ins): the
    ``cpp_extensions.fused_attn`` module, ``constants.TE_DType`` and ``utils.get_cudnn_version``."""

    fused_attn: Any
    te_dtype: Mapping[torch.dtype, Any]
    cudnn_version: Callable[[], tuple[int, int, int]]

    @classmethod
    def installed(cls) -> TEModules:
        prefix = "transformer_engine.pytorch"
        return cls(
            importlib.import_module(f"{prefix}.cpp_extensions.fused_attn"),
            importlib.import_module(f"{prefix}.constants").TE_DType,
            importlib.import_module(f"{prefix}.utils").get_cudnn_version,
        )


class _PaddedRows:
    """Where each packed query row sits in ``[b, h, max_seqlen_q, 1]`` statistics: its pair and
    its position in the pair, on one device (built once per batch)."""

    def __init__(self, batch: VarlenBatch, device: torch.device) -> None:
        pair = np.repeat(np.arange(batch.num_pairs), batch.lengths_q)
        position = np.arange(batch.total_q) - batch.cu_seqlens_q[:-1][pair]
        self.pair, self.position = to_device(pair, device), to_device(position, device)
        self.shape = (batch.num_pairs, batch.max_seqlen_q)

    def gather(self, stats: torch.Tensor) -> torch.Tensor:
        """``[b, h, s, 1]`` statistics as ``(t, h)``."""
        return stats[..., 0].transpose(1, 2)[self.pair, self.position]

    def scatter(self, lse_tn: torch.Tensor) -> torch.Tensor:
        """``(t, h)`` as ``[b, h, s, 1]`` statistics (zero in the padding, which TE never reads)."""
        stats = lse_tn.new_zeros((*self.shape, lse_tn.shape[1]))
        stats[self.pair, self.position] = lse_tn
        return stats.transpose(1, 2).unsqueeze(-1).contiguous()


class TEFusedKernel:
    """TransformerEngine's fused attention in THD layout (fp16/bf16 on CUDA). ``modules`` and
    ``version`` default to the installed TransformerEngine; tests pass stand-ins (and
    ``dtypes``: a stand-in computing in float64 takes float64)."""

    name = "te"
    # The window is not passed to TE's calls yet: ``auto`` skips this kernel for windowed
    # layers (kernels.py).
    supports_window = False

    def __init__(
        self,
        *,
        modules: TEModules | None = None,
        version: str | None = None,
        dtypes: tuple[torch.dtype, ...] = HALF,
    ) -> None:
        if modules is None:
            problem = te_unavailable()
            if problem is not None:
                raise ValueError(f"kernel 'te' cannot run: {problem}")
            try:
                modules = TEModules.installed()
            except (ImportError, AttributeError, RuntimeError) as exc:
                raise ValueError(
                    f"kernel 'te' cannot run: TransformerEngine does not import ({exc}); use "
                    "kernel 'cudnn' or 'torch-flash'"
                ) from None
            version = installed_version("transformer_engine", "transformer_engine")
        self.release = te_release(version or "unknown")
        self._te = modules
        self._backend = modules.fused_attn.FusedAttnBackend["F16_arbitrary_seqlen"]
        self._dtypes = dtypes
        self._packed_stats: bool | None = None
        """Layout of the statistics: seen in a forward, else implied by cuDNN's version."""

    def _inputs(self, q_tnd, k_tnd, v_tnd, batch: VarlenBatch):  # noqa: ANN001, ANN202
        check_half_inputs("te", q_tnd, k_tnd, v_tnd, batch, dtypes=self._dtypes)
        q, k, v = q_tnd.contiguous(), k_tnd.contiguous(), v_tnd.contiguous()
        return q, k, v, *batch.cu_seqlens(q.device)

    def _formats(self, *names: str) -> dict[str, str]:
        """The format keywords of TE 2.15 on (``o_format``, ``do_format``, ``dqkv_layout``)."""
        if not self.release.formats:
            return {}
        return {name: LAYOUT if name == "dqkv_layout" else "thd" for name in names}

    def _rows(self, batch: VarlenBatch, device: torch.device) -> _PaddedRows:
        key = ("te-padded-rows", str(device))
        if key not in batch.cache:
            batch.cache[key] = _PaddedRows(batch, device)
        return batch.cache[key]

    def forward(self, q_tnd, k_tnd, v_tnd, batch, *, softmax_scale):  # noqa: ANN001
        q, k, v, cu_q, cu_k = self._inputs(q_tnd, k_tnd, v_tnd, batch)
        out, aux, *_ = self._te.fused_attn.fused_attn_fwd(
            True, batch.max_seqlen_q, batch.max_seqlen_k, cu_q, cu_k, q, k, v,
            q.dtype, self._backend,
            cu_seqlens_q_padded=cu_q,
            cu_seqlens_kv_padded=cu_k,
            attn_scale=softmax_scale,
            dropout=0.0,
            qkv_layout=LAYOUT,
            attn_mask_type=MASKS[batch.causal],
            **self._formats("o_format"),
        )  # fmt: skip
        stats = aux[0]
        if stats.dim() == 3:
            assert tuple(stats.shape) == (q.shape[0], q.shape[1], 1), tuple(stats.shape)
            self._packed_stats = True
            return out, stats[..., 0].to(compute_dtype(q.dtype))
        assert tuple(stats.shape) == (batch.num_pairs, q.shape[1], batch.max_seqlen_q, 1), tuple(
            stats.shape
        )
        self._packed_stats = False
        return out, self._rows(batch, q.device).gather(stats).to(compute_dtype(q.dtype))

    def _stats(self, lse_tn: torch.Tensor, batch: VarlenBatch, dtype: torch.dtype) -> torch.Tensor:
        """The merged lse in the layout TE's backward reads (float32 for fp16/bf16)."""
        if self._packed_stats is None:
            capability = cuda_capability()
            self._packed_stats = self._te.cudnn_version() >= (9, 6, 0) and capability != (12, 0)
        lse = lse_tn.to(compute_dtype(dtype))
        if self._packed_stats:
            return lse.unsqueeze(-1).contiguous()
        return self._rows(batch, lse.device).scatter(lse)

    def backward(self, dout_tnd, q_tnd, k_tnd, v_tnd, out_tnd, lse_tn, batch, *, softmax_scale):  # noqa: ANN001
        q, k, v, cu_q, cu_k = self._inputs(q_tnd, k_tnd, v_tnd, batch)
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
        aux = [self._stats(lse_tn, batch, q.dtype), rng_state]
        dqkv_dtype = () if self.release.formats else (self._te.te_dtype[q.dtype],)
        dq, dk, dv, *_ = self._te.fused_attn.fused_attn_bwd(
            batch.max_seqlen_q, batch.max_seqlen_k, cu_q, cu_k, q, k, v,
            out_tnd.to(q.dtype).contiguous(), dout_tnd.to(q.dtype).contiguous(),
            q.dtype, *dqkv_dtype, aux, self._backend,
            cu_seqlens_q_padded=cu_q,
            cu_seqlens_kv_padded=cu_k,
            attn_scale=softmax_scale,
            dropout=0.0,
            qkv_layout=LAYOUT,
            attn_mask_type=MASKS[batch.causal],
            **self._formats("o_format", "do_format", "dqkv_layout"),
        )  # fmt: skip
        return dq, dk, dv
