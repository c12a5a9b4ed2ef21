"""CPU stand-ins for TransformerEngine's ``fused_attn_fwd`` / ``fused_attn_bwd``, one per calling
convention of TE 2.x, as ``kernel_te.TEModules``.

Not tests: ``test_fused_kernels.py`` runs ``kernel_te.TEFusedKernel`` against these. Each
stand-in's functions have the parameter list of one release, names, order and defaults
(``RELEASES``, read from ``transformer_engine/pytorch/cpp_extensions/fused_attn.py`` at the tags
v2.1, v2.8, v2.12 and v2.15 of NVIDIA/TransformerEngine), bound the way Python binds a call, so a
keyword a release does not have, or a positional argument too many, raises ``TypeError`` as the
real function would. What the real functions check or produce that an adapter can get wrong is
reproduced: the backend (``FusedAttnBackend["F16_arbitrary_seqlen"]``), ``fake_dtype``, the THD
layout with padded offsets, the mask names (``padding``, ``padding_causal`` aligned top-left,
``padding_causal_bottom_right``), TE's dtype enum as the backward's ``dqkv_dtype`` (2.1 to 2.14),
the formats of 2.15 (``o_format``/``do_format`` ``"thd"``, ``dqkv_layout`` ``"thd_thd_thd"``: the
C++ extension derives the output's shape from them), the return values (``(out, aux)``, ``(out,
aux, max_logit)`` with ``return_max_logit``, ``[dq, dk, dv, dbias]``) and the softmax statistics
in the layout the cuDNN version gives (``packed_stats``: ``[t, h, 1]`` from cuDNN 9.6, else
``[b, h, max_seqlen_q, 1]`` with padding after each pair, NaN in these stand-ins so a layout
mix-up shows). The maths is ``cudnn_standins.masked_attention`` (the package's tiled kernel) in
the inputs' dtype: float64 inputs (with ``fake_dtype`` float64, which the real library would
refuse) give float64 results and statistics, so the tests measure the adapter's layout handling
to float64 precision.
"""

import inspect
import types

import torch
from cudnn_standins import lengths_of, masked_attention, masked_attention_backward

from megatron_zeppelin.attention.kernels.kernel_te import TEModules

REQUIRED = inspect.Parameter.empty
_FWD_HEAD = (
    "is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k",
    "v", "fake_dtype", "fused_attention_backend",
)  # fmt: skip
_BWD_HEAD = (
    "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "o", "d_o",
    "fake_dtype",
)  # fmt: skip


def _params(head: tuple[str, ...], tail: str) -> list[tuple[str, object]]:
    """``head`` without defaults, then ``tail``'s ``name=default`` pairs (defaults evaluated)."""
    pairs = [(name, REQUIRED) for name in head]
    for item in tail.split():
        name, default = item.split("=")
        pairs.append((name, eval(default)))  # noqa: S307 - literals written here
    return pairs


RELEASES = {
    "2.1.0": (
        _params(
            _FWD_HEAD,
            """attn_bias=None cu_seqlens_q_padded=None cu_seqlens_kv_padded=None
            s_quantizer=None o_quantizer=None attn_scale=None dropout=0.0 fast_zero_fill=True
            qkv_layout="sbh3d" attn_bias_type="no_bias" attn_mask_type="padding"
            window_size=(-1,-1) rng_gen=None""",
        ),
        _params(
            (*_BWD_HEAD, "dqkv_dtype", "aux_ctx_tensors", "fused_attention_backend"),
            """cu_seqlens_q_padded=None cu_seqlens_kv_padded=None s_quantizer=None
            dp_quantizer=None dqkv_quantizer=None attn_scale=None dropout=0.0
            fast_zero_fill=True qkv_layout="sbh3d" attn_bias_type="no_bias"
            attn_mask_type="padding" window_size=(-1,-1) deterministic=False""",
        ),
    ),
    "2.8.0": (
        _params(
            _FWD_HEAD,
            """attn_bias=None cu_seqlens_q_padded=None cu_seqlens_kv_padded=None
            page_table_k=None page_table_v=None s_quantizer=None o_quantizer=None
            attn_scale=None dropout=0.0 fast_zero_fill=True qkv_layout="sbh3d"
            attn_bias_type="no_bias" attn_mask_type="padding" softmax_type="vanilla"
            window_size=(-1,-1) rng_gen=None softmax_offset=None""",
        ),
        _params(
            (*_BWD_HEAD, "dqkv_dtype", "aux_ctx_tensors", "fused_attention_backend"),
            """cu_seqlens_q_padded=None cu_seqlens_kv_padded=None s_quantizer=None
            dp_quantizer=None dqkv_quantizer=None attn_scale=None dropout=0.0
            fast_zero_fill=True qkv_layout="sbh3d" attn_bias_type="no_bias"
            attn_mask_type="padding" softmax_type="vanilla" window_size=(-1,-1)
            deterministic=False""",
        ),
    ),
    "2.12.0": (
        _params(
            _FWD_HEAD,
            """attn_bias=None cu_seqlens_q_padded=None cu_seqlens_kv_padded=None
            page_table_k=None page_table_v=None s_quantizer=None o_quantizer=None
            attn_scale=None dropout=0.0 fast_zero_fill=True qkv_layout="sbh3d"
            attn_bias_type="no_bias" attn_mask_type="padding" softmax_type="vanilla"
            window_size=(-1,-1) bottom_right_diagonal=None rng_gen=None softmax_offset=None
            return_max_logit=False cuda_graph=False""",
        ),
        _params(
            (*_BWD_HEAD, "dqkv_dtype", "aux_ctx_tensors", "fused_attention_backend"),
            """cu_seqlens_q_padded=None cu_seqlens_kv_padded=None s_quantizer=None
            dp_quantizer=None dqkv_quantizer=None attn_scale=None dropout=0.0
            fast_zero_fill=True qkv_layout="sbh3d" attn_bias_type="no_bias"
            attn_mask_type="padding" softmax_type="vanilla" window_size=(-1,-1)
            bottom_right_diagonal=None deterministic=False cuda_graph=False""",
        ),
    ),
    "2.15.0": (
        _params(
            _FWD_HEAD,
            """attn_bias=None cu_seqlens_q_padded=None cu_seqlens_kv_padded=None
            page_table_k=None page_table_v=None s_quantizer=None o_quantizer=None
            attn_scale=None dropout=0.0 fast_zero_fill=True qkv_layout="sbh3d"
            o_format="sbhd" qkv_scale_inv_format=None attn_bias_type="no_bias"
            attn_mask_type="padding" softmax_type="vanilla" window_size=(-1,-1)
            bottom_right_diagonal=None rng_gen=None softmax_offset=None
            return_max_logit=False cuda_graph=False""",
        ),
        _params(
            (*_BWD_HEAD, "aux_ctx_tensors", "fused_attention_backend"),
            """cu_seqlens_q_padded=None cu_seqlens_kv_padded=None s_quantizer=None
            dp_quantizer=None dqkv_quantizer=None attn_scale=None dropout=0.0
            fast_zero_fill=True qkv_layout="sbh3d" o_format="sbhd" do_format="sbhd"
            dqkv_layout="sbh3d" qkv_scale_inv_format=None do_scale_inv_format=None
            attn_bias_type="no_bias" attn_mask_type="padding" softmax_type="vanilla"
            window_size=(-1,-1) bottom_right_diagonal=None deterministic=False
            cuda_graph=False""",
        ),
    ),
}
"""Per release: the forward's and the backward's parameters, in order, with their defaults."""

MASKS = {
    "padding": "none",
    "padding_causal": "top_left",
    "padding_causal_bottom_right": "bottom_right",
}
BACKENDS = {"F16_max512_seqlen": 0, "F16_arbitrary_seqlen": 1, "FP8": 2, "No_Backend": -1}
TE_DTYPE = {torch.float16: "kFloat16", torch.bfloat16: "kBFloat16", torch.float32: "kFloat32",
            torch.float64: "kFloat64 (stand-in only)"}  # fmt: skip


def _with_signature(name: str, params: list[tuple[str, object]], impl):  # noqa: ANN001, ANN202
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    sig = inspect.Signature([inspect.Parameter(n, kind, default=d) for n, d in params])

    def function(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return impl(types.SimpleNamespace(**bound.arguments))

    function.__signature__ = sig
    function.__name__ = name
    return function


class _Release:
    """The semantics shared by every release; ``formats``: TE 2.15's format keywords."""

    def __init__(self, version: str, packed_stats: bool) -> None:
        self.version, self.packed_stats = version, packed_stats
        self.formats = "o_format" in dict(RELEASES[version][0])
        self.calls: list[dict] = []

    def _common(self, a) -> tuple[list[int], list[int], str]:  # noqa: ANN001
        if a.fused_attention_backend != BACKENDS["F16_arbitrary_seqlen"]:
            raise RuntimeError("fused attention backend must be F16_arbitrary_seqlen for fp16/bf16")
        if a.q.dtype != a.fake_dtype or a.k.dtype != a.q.dtype or a.v.dtype != a.q.dtype:
            raise RuntimeError("q, k, v must have fake_dtype")
        if a.qkv_layout != "thd_thd_thd":
            raise NotImplementedError(f"this stand-in covers thd_thd_thd, got {a.qkv_layout}")
        if a.cu_seqlens_q_padded is None or a.cu_seqlens_kv_padded is None:
            raise RuntimeError("THD layouts need cu_seqlens_q_padded and cu_seqlens_kv_padded")
        if not (torch.equal(a.cu_seqlens_q_padded, a.cu_seqlens_q)
                and torch.equal(a.cu_seqlens_kv_padded, a.cu_seqlens_kv)):  # fmt: skip
            raise NotImplementedError("this stand-in covers sequences without padding")
        if a.attn_mask_type not in MASKS or a.dropout != 0.0:
            raise NotImplementedError(f"mask {a.attn_mask_type}, dropout {a.dropout}")
        lq, lk = lengths_of(a.cu_seqlens_q), lengths_of(a.cu_seqlens_kv)
        if max(lq) > a.max_seqlen_q or max(lk) > a.max_seqlen_kv:
            raise RuntimeError("max_seqlen below a sequence's length")
        return lq, lk, MASKS[a.attn_mask_type]

    def _check_format(self, a, name: str, want: str) -> None:  # noqa: ANN001
        if self.formats and getattr(a, name) != want:
            raise RuntimeError(f"{name}={getattr(a, name)!r} cannot describe THD tensors")

    def forward(self, a):  # noqa: ANN001, ANN201
        lq, lk, mask = self._common(a)
        self._check_format(a, "o_format", "thd")
        scale = a.q.shape[-1] ** -0.5 if a.attn_scale is None else a.attn_scale
        self.calls.append({"op": "forward", "mask": a.attn_mask_type})
        out, lse = masked_attention(a.q, a.k, a.v, lq, lk, mask=mask, scale=scale)
        stats_dtype = torch.float64 if a.q.dtype == torch.float64 else torch.float32
        lse = lse.to(stats_dtype)
        if self.packed_stats:
            stats = lse.unsqueeze(-1)
        else:
            stats = torch.full((len(lq), a.q.shape[1], a.max_seqlen_q, 1), float("nan"),
                               dtype=stats_dtype)  # fmt: skip
            start = 0
            for b, n in enumerate(lq):
                stats[b, :, :n, 0] = lse[start : start + n].t()
                start += n
        aux = [stats, torch.zeros(2, dtype=torch.int64)] if a.is_training else None
        if getattr(a, "return_max_logit", False):
            return out.to(a.q.dtype), aux, torch.zeros(a.q.shape[1])
        return out.to(a.q.dtype), aux

    def _lse(self, stats: torch.Tensor, lq: list[int], heads: int, max_q: int) -> torch.Tensor:
        if self.packed_stats:
            want = (sum(lq), heads, 1)
        else:
            want = (len(lq), heads, max_q, 1)
        if tuple(stats.shape) != want:
            raise RuntimeError(f"softmax statistics must be {want}, got {tuple(stats.shape)}")
        if self.packed_stats:
            return stats[..., 0]
        return torch.cat([stats[b, :, :n, 0].t() for b, n in enumerate(lq)])

    def backward(self, a):  # noqa: ANN001, ANN201
        lq, lk, mask = self._common(a)
        if self.formats:
            for name, want in (("o_format", "thd"), ("do_format", "thd"),
                               ("dqkv_layout", "thd_thd_thd")):  # fmt: skip
                self._check_format(a, name, want)
        elif a.dqkv_dtype != TE_DTYPE[a.fake_dtype]:
            raise RuntimeError(f"dqkv_dtype must be TE's {TE_DTYPE[a.fake_dtype]}")
        stats, rng = a.aux_ctx_tensors[:2]
        if rng.shape != (2,) or rng.dtype != torch.int64:
            raise RuntimeError("aux_ctx_tensors[1] must be the (2,) int64 RNG state")
        if a.o.dtype != a.q.dtype or a.d_o.dtype != a.q.dtype:
            raise RuntimeError("o and d_o must have q's dtype")
        lse = self._lse(stats, lq, a.q.shape[1], a.max_seqlen_q)
        scale = a.q.shape[-1] ** -0.5 if a.attn_scale is None else a.attn_scale
        self.calls.append({"op": "backward", "mask": a.attn_mask_type})
        grads = masked_attention_backward(
            a.d_o, a.q, a.k, a.v, a.o, lse, lq, lk, mask=mask, scale=scale
        )
        return [*(g.to(a.q.dtype) for g in grads), None]


def te_modules(version: str, *, packed_stats: bool = True) -> tuple[TEModules, _Release]:
    """``TEModules`` of TE ``version`` (a key of ``RELEASES``) on a cuDNN that gives packed
    statistics (9.6 or newer) or not; and the release object (its ``calls``)."""
    fwd_params, bwd_params = RELEASES[version]
    release = _Release(version, packed_stats)
    fused_attn = types.SimpleNamespace(
        fused_attn_fwd=_with_signature("fused_attn_fwd", fwd_params, release.forward),
        fused_attn_bwd=_with_signature("fused_attn_bwd", bwd_params, release.backward),
        FusedAttnBackend=BACKENDS,
    )
    cudnn = (9, 10, 0) if packed_stats else (9, 5, 1)
    return TEModules(fused_attn, TE_DTYPE, lambda: cudnn), release
