"""Transformer dimensions the cost model needs, and presets for the paper's LLaMA sizes.

FLOP counts are per layer, forward plus backward (backward = 2x forward for GEMMs; attention
backward recomputes the scores, so 2.5x forward, as flash-attention does). A mixture-of-experts
layer is priced by what one token runs through: the attention projections, the router, its
top-k experts' FFNs and the shared experts' (not every expert's, nor the dense FFN); the linear
work per token is the mean over the model's layers, dense and MoE.

Every ``ModelSpec`` a run plans with comes from ``model_from_config``: the Megatron hooks hand it
the ``TransformerConfig`` Megatron builds from its arguments, the CPU job the one its model is
built from, and the CLI's presets (``MODEL_PRESETS``) are written as the same config fields.
So a preset and a Megatron run of the same model price attention, K/V bytes and thresholds
alike (heads, K/V heads, dtype, tensor parallelism are read in one place).

Under pipeline parallelism a GPU runs one stage: ``num_layers`` counts that stage's layers and
``pipeline`` (a ``PipelineStage``) says which they are and whether the stage also runs the
embedding (first stage) and the output layer with the loss (last stage). Every stage plans the
same plan (the next stage receives exactly the rows the plan's linear layout gives a rank), and
it does: the planner's choices rest on per-layer figures, which are the same on every stage;
the stage's layers scale its predicted step time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

ATTN_BWD_OVER_FWD = 2.5
GEMM_BWD_OVER_FWD = 2.0


@dataclass(frozen=True)
class PipelineStage:
    """The part of the model one pipeline stage runs (Megatron's own split of the layers, read
    by ``megatron/pipeline.py``). Stages and layers count from 0, as Megatron numbers pipeline
    ranks and the layers in its checkpoints."""

    index: int
    num_stages: int
    layers: tuple[int, ...]
    """The transformer layers this stage holds, over its virtual-pipeline chunks, ascending."""
    embedding: bool
    """Runs the input embedding (the first stage)."""
    output_layer: bool
    """Runs the output layer and the loss (the last stage)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(n) for n in self.layers))
        if not 0 <= self.index < self.num_stages:
            raise ValueError(f"pipeline stage {self.index} outside 0..{self.num_stages - 1}")
        if list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"pipeline stage {self.index}: layers {self.layers} not ascending")

    def describe(self) -> str:
        """``"PP stage 1 of 2, layers 2-3, output layer and loss"``."""
        runs: list[list[int]] = []
        for layer in self.layers:
            if runs and layer == runs[-1][-1] + 1:
                runs[-1].append(layer)
            else:
                runs.append([layer])
        spans = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
        parts = [f"PP stage {self.index} of {self.num_stages}", f"layers {spans or 'none'}"]
        if self.embedding:
            parts.append("embedding")
        if self.output_layer:
            parts.append("output layer and loss")
        return ", ".join(parts)


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
    pipeline: PipelineStage | None = None
    """The pipeline stage this GPU runs (``num_layers`` are its layers); ``None``: the whole
    model, embedding and output layer included."""
    num_experts: int = 0
    """Experts of each MoE layer; 0: a dense model."""
    moe_topk: int = 0
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """FFN size of one expert."""
    moe_shared_ffn_hidden_size: int = 0
    """FFN size of the shared experts every token runs through (0: none)."""
    num_moe_layers: int = 0
    """Layers with experts (Megatron's ``--moe-layer-freq``) of the ``num_layers``; the others
    are dense."""

    def __post_init__(self) -> None:
        for label in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size"):
            if getattr(self, label) < 1:
                raise ValueError(f"model {self.name}: {label} must be >= 1")
        if self.num_experts:
            if not 1 <= self.moe_topk <= self.num_experts or self.moe_ffn_hidden_size < 1:
                raise ValueError(
                    f"model {self.name}: a MoE model needs 1 <= top-k ({self.moe_topk}) <= "
                    f"experts ({self.num_experts}) and an expert FFN size "
                    f"({self.moe_ffn_hidden_size}) >= 1"
                )
            if not 0 <= self.num_moe_layers <= self.num_layers:
                raise ValueError(
                    f"model {self.name}: {self.num_moe_layers} MoE layers of {self.num_layers}"
                )
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
        if self.pipeline is not None and len(self.pipeline.layers) != self.num_layers:
            raise ValueError(
                f"model {self.name}: {self.num_layers} layers but its pipeline stage holds "
                f"{len(self.pipeline.layers)}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def attn_flops_per_pair(self) -> float:
        """Forward+backward FLOPs of one (query, key) pair across all heads, per layer, per GPU."""
        fwd = 4.0 * self.head_dim * self.num_heads  # QK^T and PV, 2 FLOPs per multiply-add
        return fwd * (1.0 + ATTN_BWD_OVER_FWD) / self.tensor_parallel

    def linear_flops_per_token(self) -> float:
        """Forward+backward FLOPs of the GEMMs of one layer for one token, per GPU (SwiGLU
        MLPs), the mean over the layers: a MoE layer's FFN work is its router, ``moe_topk``
        experts and its shared experts."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        qkv = 2.0 * h * (h + 2 * kv)
        proj = 2.0 * h * h
        dense = _glu_flops(h, self.ffn_hidden_size)
        mlp = dense
        if self.num_experts:
            moe = (
                2.0 * h * self.num_experts  # router
                + self.moe_topk * _glu_flops(h, self.moe_ffn_hidden_size)
                + _glu_flops(h, self.moe_shared_ffn_hidden_size)
            )
            mlp = (moe * self.num_moe_layers + dense * (self.num_layers - self.num_moe_layers)) / (
                self.num_layers
            )
        return (qkv + proj + mlp) * (1.0 + GEMM_BWD_OVER_FWD) / self.tensor_parallel

    def output_flops_per_token(self) -> float:
        """Forward+backward FLOPs of the output layer (logits GEMM) for one token, per GPU, on a
        GPU that runs it (every GPU without pipeline parallelism, the last stage with it); the
        embedding is a lookup, no GEMM."""
        if self.pipeline is not None and not self.pipeline.output_layer:
            return 0.0
        logits = 2.0 * self.hidden_size * self.vocab_size
        return logits * (1.0 + GEMM_BWD_OVER_FWD) / self.tensor_parallel

    def stage_flops_per_token(self) -> float:
        """Forward+backward GEMM FLOPs of one token through everything this GPU runs: its
        layers' linear modules and, where it runs it, the output layer."""
        return self.num_layers * self.linear_flops_per_token() + self.output_flops_per_token()

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token in one layer, per GPU (what a ring step carries)."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes // self.tensor_parallel

    def hidden_bytes_per_token(self) -> int:
        """Bytes of one token's Q, K, V and output moved by the remapping all-to-all, per layer."""
        q_and_out = 2 * self.hidden_size * self.dtype_bytes // self.tensor_parallel
        return q_and_out + self.kv_bytes_per_token()

    def to_dict(self) -> dict:
        return asdict(self)


def _glu_flops(hidden: int, ffn: int) -> float:
    """Forward FLOPs of a gated MLP (three GEMMs) for one token."""
    return 2.0 * 3 * hidden * ffn


def dtype_bytes_of(config: Any) -> int:
    """Bytes per activation element of a Megatron config: 2 with ``bf16``/``fp16`` (the
    activations and the K/V a ring moves are half precision), else its ``params_dtype``'s."""
    if getattr(config, "bf16", False) or getattr(config, "fp16", False):
        return 2
    params_dtype = str(getattr(config, "params_dtype", "torch.float32"))
    return 2 if params_dtype in ("torch.bfloat16", "torch.float16") else 4


def model_from_config(
    config: Any,
    *,
    vocab_size: int,
    name: str = "megatron",
    pipeline: PipelineStage | None = None,
) -> ModelSpec:
    """The planner's model of a Megatron ``TransformerConfig`` (or any object with its field
    names): layers, hidden size, query heads, K/V heads (``num_query_groups``, which Megatron
    sets only with ``--group-query-attention``; ``None`` means one per query head), FFN size,
    dtype (``dtype_bytes_of``), tensor-parallel size, and the experts (``moe_fields``). With
    ``pipeline``, the model of that stage: its own layers."""
    heads = int(config.num_attention_heads)
    kv_channels = getattr(config, "kv_channels", None)
    if kv_channels is not None and int(kv_channels) * heads != int(config.hidden_size):
        raise ValueError(
            f"model {name}: kv_channels {kv_channels} x {heads} heads differs from hidden size "
            f"{config.hidden_size}; Zeppelin's cost model assumes head dim = hidden / heads: "
            "drop --kv-channels"
        )
    return ModelSpec(
        name=name,
        num_layers=len(pipeline.layers) if pipeline else int(config.num_layers),
        hidden_size=int(config.hidden_size),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_query_groups", None) or heads),
        ffn_hidden_size=int(config.ffn_hidden_size or 4 * config.hidden_size),
        vocab_size=int(vocab_size),
        dtype_bytes=dtype_bytes_of(config),
        tensor_parallel=int(getattr(config, "tensor_model_parallel_size", 1) or 1),
        pipeline=pipeline,
        **moe_fields(config, pipeline=pipeline),
    )


def moe_layers(freq: Any, num_layers: int) -> list[int]:
    """The layers with experts under Megatron's ``moe_layer_freq``: an integer N puts experts in
    every N-th layer from the first, a list marks each layer (1: experts, 0: dense)."""
    if isinstance(freq, int):
        return list(range(0, num_layers, freq))
    pattern = list(freq)
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ValueError(
            f"--moe-layer-freq {pattern} must give 0 or 1 for each of the {num_layers} layers"
        )
    return [layer for layer, experts in enumerate(pattern) if experts]


def moe_fields(config: Any, *, pipeline: PipelineStage | None = None) -> dict[str, int]:
    """``ModelSpec``'s expert fields from a Megatron config (``num_moe_experts``,
    ``moe_router_topk``, ``moe_ffn_hidden_size``, ``moe_shared_expert_intermediate_size``,
    ``moe_layer_freq``; with ``pipeline``, the MoE layers among the stage's); empty for a dense
    model."""
    experts = int(getattr(config, "num_moe_experts", None) or 0)
    if not experts:
        return {}
    with_experts = moe_layers(getattr(config, "moe_layer_freq", 1), int(config.num_layers))
    held = pipeline.layers if pipeline else range(int(config.num_layers))
    return {
        "num_experts": experts,
        "moe_topk": int(config.moe_router_topk),
        "moe_ffn_hidden_size": int(
            getattr(config, "moe_ffn_hidden_size", None) or config.ffn_hidden_size
        ),
        "moe_shared_ffn_hidden_size": int(
            getattr(config, "moe_shared_expert_intermediate_size", None) or 0
        ),
        "num_moe_layers": len(set(with_experts) & set(held)),
    }


PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3b": dict(num_layers=26, hidden_size=3200, num_attention_heads=32, ffn_hidden_size=8640),
    "llama-7b": dict(
        num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008
    ),
    "llama-13b": dict(
        num_layers=40, hidden_size=5120, num_attention_heads=40, ffn_hidden_size=13824
    ),
    "llama-30b": dict(
        num_layers=60, hidden_size=6656, num_attention_heads=52, ffn_hidden_size=17920
    ),
    "llama3-8b": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=128256,
    ),
    "tiny": dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=512,
        bf16=False,
    ),
}
"""The presets as Megatron config fields (``TransformerConfig`` names; ``vocab_size`` is
Megatron's ``--vocab-size``, default 32000; ``bf16`` defaults on, as the shipped configs train)."""


def preset_config(name: str, *, tensor_parallel: int = 1) -> SimpleNamespace:
    """A preset's fields as a config object ``model_from_config`` reads."""
    fields = {"bf16": True, "vocab_size": 32000, **PRESET_CONFIGS[name]}
    return SimpleNamespace(tensor_model_parallel_size=tensor_parallel, **fields)


def _preset(name: str, *, tensor_parallel: int = 1) -> ModelSpec:
    config = preset_config(name, tensor_parallel=tensor_parallel)
    return model_from_config(config, vocab_size=config.vocab_size, name=name)


MODEL_PRESETS: dict[str, ModelSpec] = {name: _preset(name) for name in PRESET_CONFIGS}


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
        return _preset(name, tensor_parallel=tensor_parallel)
    else:
        raise ValueError(
            f"unknown model {name!r}; known presets: {', '.join(MODEL_PRESETS)}, or explicit "
            "dimensions such as layers=32,hidden=4096,heads=32,kv-heads=8,ffn=14336"
        )
    if tensor_parallel == 1:
        return base
    return ModelSpec(**{**base.to_dict(), "tensor_parallel": tensor_parallel})
