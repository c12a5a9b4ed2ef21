"""Transformer dimensions the cost model needs, and presets for the paper's LLaMA sizes.

FLOP counts are per layer, forward plus backward (backward = 2x forward for GEMMs; attention
backward recomputes the scores, so 2.5x forward, as flash-attention does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

ATTN_BWD_OVER_FWD = 2.5
GEMM_BWD_OVER_FWD = 2.0


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of a decoder-only transformer (GQA when ``num_kv_heads < num_heads``)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int = 32000
    dtype_bytes: int = 2
    """Bytes per activation element (2 for bf16/fp16, 4 for fp32)."""
    tensor_parallel: int = 1
    """Tensor-parallel size inside one Zeppelin rank: per-GPU work divides by it."""

    def __post_init__(self) -> None:
        for label in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size"):
            if getattr(self, label) < 1:
                raise ValueError(f"model {self.name}: {label} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model {self.name}: hidden_size {self.hidden_size} is not a multiple of "
                f"num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.num_kv_heads % self.tensor_parallel and self.tensor_parallel % self.num_kv_heads:
            raise ValueError(
                f"model {self.name}: tensor_parallel {self.tensor_parallel} does not divide "
                f"num_kv_heads {self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def attn_flops_per_pair(self) -> float:
        """Forward+backward FLOPs of one (query, key) pair across all heads, per layer, per GPU."""
        fwd = 4.0 * self.head_dim * self.num_heads  # QK^T and PV, 2 FLOPs per multiply-add
        return fwd * (1.0 + ATTN_BWD_OVER_FWD) / self.tensor_parallel

    def linear_flops_per_token(self) -> float:
        """Forward+backward FLOPs of the GEMMs of one layer for one token, per GPU (SwiGLU MLP)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        qkv = 2.0 * h * (h + 2 * kv)
        proj = 2.0 * h * h
        mlp = 2.0 * 3 * h * self.ffn_hidden_size
        return (qkv + proj + mlp) * (1.0 + GEMM_BWD_OVER_FWD) / self.tensor_parallel

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token in one layer, per GPU (what a ring step carries)."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes // self.tensor_parallel

    def hidden_bytes_per_token(self) -> int:
        """Bytes of one token's Q, K, V and output moved by the remapping all-to-all, per layer."""
        q_and_out = 2 * self.hidden_size * self.dtype_bytes // self.tensor_parallel
        return q_and_out + self.kv_bytes_per_token()

    def to_dict(self) -> dict:
        return asdict(self)


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama-3b", 26, 3200, 32, 32, 8640),
        ModelSpec("llama-7b", 32, 4096, 32, 32, 11008),
        ModelSpec("llama-13b", 40, 5120, 40, 40, 13824),
        ModelSpec("llama-30b", 60, 6656, 52, 52, 17920),
        ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, vocab_size=128256),
        ModelSpec("tiny", 2, 64, 4, 2, 128, vocab_size=512, dtype_bytes=4),
    )
}


_DIM_KEYS = {
    "layers": "num_layers",
    "hidden": "hidden_size",
    "heads": "num_heads",
    "kv-heads": "num_kv_heads",
    "ffn": "ffn_hidden_size",
    "vocab": "vocab_size",
    "dtype-bytes": "dtype_bytes",
}


def parse_model_dims(text: str) -> ModelSpec:
    """A model from explicit dimensions, for example
    ``layers=32,hidden=4096,heads=32,kv-heads=8,ffn=14336``; ``kv-heads`` defaults to
    ``heads``, ``vocab`` and ``dtype-bytes`` are optional."""
    dims: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in _DIM_KEYS:
            raise ValueError(
                f"cannot read model dimension {item.strip()!r}: write key=value pairs with keys "
                f"{', '.join(_DIM_KEYS)}"
            )
        try:
            dims[_DIM_KEYS[key]] = int(value)
        except ValueError:
            raise ValueError(f"model dimension {key} must be an integer, got {value!r}") from None
    required = ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size")
    missing = [k for k, v in _DIM_KEYS.items() if v in required and v not in dims]
    if missing:
        raise ValueError(f"model dimensions miss {', '.join(missing)} (got {text!r})")
    dims.setdefault("num_kv_heads", dims["num_heads"])
    return ModelSpec(name="custom", **dims)


def get_model(name: str, *, tensor_parallel: int = 1) -> ModelSpec:
    """A preset by name (``llama-7b``) or explicit dimensions (see ``parse_model_dims``);
    raises ``ValueError`` listing the known presets."""
    if "=" in name:
        base = parse_model_dims(name)
    elif name in MODEL_PRESETS:
        base = MODEL_PRESETS[name]
    else:
        raise ValueError(
            f"unknown model {name!r}; known presets: {', '.join(MODEL_PRESETS)}, or explicit "
            "dimensions such as layers=32,hidden=4096,heads=32,kv-heads=8,ffn=14336"
        )
    if tensor_parallel == 1:
        return base
    return ModelSpec(**{**base.to_dict(), "tensor_parallel": tensor_parallel})
