"""Megatron layer specs with Zeppelin's core attention.

Megatron builds a transformer layer from a ``ModuleSpec`` tree; ``SelfAttention``'s
``core_attention`` is one leaf of it. These specs are Megatron's own (the local one, and the
TransformerEngine one where TE is installed) with only that leaf replaced, so Megatron's
``TransformerLayer``, ``SelfAttention``, linear layers, norms and MLP run unchanged.

Megatron-LM's ``--spec MODULE NAME`` imports ``MODULE`` and takes its attribute ``NAME``, so

    --spec megatron_zeppelin.megatron.spec local     # Megatron-core modules only
    --spec megatron_zeppelin.megatron.spec te        # TransformerEngine linears and norms

work directly (``te`` exists only where TransformerEngine imports). Both use RMSNorm and RoPE with
Megatron's defaults; ``zeppelin_layer_spec`` builds others (LayerNorm, other rotary settings:
``rotary.Rope``).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_zeppelin.megatron.core_attention import ZeppelinCoreAttention
from megatron_zeppelin.megatron.rotary import MEGATRON_DEFAULT, Rope

SPEC_KINDS = ("local", "te")


def has_transformer_engine() -> bool:
    """Whether TransformerEngine's PyTorch modules import here."""
    try:
        # lazy: probed, not imported at the top: TransformerEngine is optional.
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure (missing CUDA too) means no TE
        return False
    return True


def _megatron_spec(kind: str, **kwargs: Any) -> ModuleSpec:
    if kind == "local":
        return gpt_layer_specs.get_gpt_layer_local_spec(**kwargs)
    if not has_transformer_engine():
        raise ValueError(
            "the 'te' spec needs TransformerEngine, which does not import here: install "
            "transformer-engine[pytorch] (see the Docker image) or use the 'local' spec"
        )
    kwargs.pop("normalization", None)  # TE's spec picks the norm from the config
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs)


def zeppelin_layer_spec(
    kind: str = "local",
    *,
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
    rope: Rope | None = MEGATRON_DEFAULT,
) -> ModuleSpec:
    """Megatron's GPT layer spec of ``kind`` (``local`` or ``te``) with Zeppelin's core attention.

    ``rope`` holds the rotary settings (``Rope.from_args`` of Megatron's flags); ``None`` turns
    Zeppelin's per-document RoPE off (for models with learned absolute positions). Build the
    model with ``position_embedding_type='none'`` otherwise, so RoPE is applied once.
    """
    if kind not in SPEC_KINDS:
        raise ValueError(f"unknown spec kind {kind!r}: use one of {', '.join(SPEC_KINDS)}")
    kwargs: dict[str, Any] = {"qk_layernorm": qk_layernorm}
    if kind == "local":
        kwargs["normalization"] = normalization
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns about missing Apex on every call
        spec = copy.deepcopy(_megatron_spec(kind, **kwargs))
    attention = spec.submodules.self_attention
    assert hasattr(attention.submodules, "core_attention"), "not a SelfAttention spec"
    attention.submodules.core_attention = ModuleSpec(
        module=ZeppelinCoreAttention, params={"rope": rope}
    )
    return spec


def core_attention_of(spec: ModuleSpec) -> ModuleSpec:
    """The core-attention leaf of a GPT layer spec (for checks and tests)."""
    return spec.submodules.self_attention.submodules.core_attention


local = zeppelin_layer_spec("local")
if has_transformer_engine():
    te = zeppelin_layer_spec("te")
