"""Megatron layer specs with Zeppelin's core attention.

Megatron builds a transformer layer from a ``ModuleSpec`` tree; ``SelfAttention``'s
``core_attention`` is one leaf of it. These specs are Megatron's own (the local one, and the
TransformerEngine one where TE is installed) with only that leaf replaced, so Megatron's
``TransformerLayer``, ``SelfAttention``, linear layers, norms, MLP and MoE layers run unchanged.

``model_spec`` is the one path from a run's ``TransformerConfig`` to its spec, built as
Megatron's own GPT builder builds it (``gpt_builders.py`` of Megatron-LM, and
``megatron/training/models/gpt.py`` of megatron-core 0.19): with ``--num-experts`` the decoder
block spec (``get_gpt_decoder_block_spec``: MoE layers where ``--moe-layer-freq`` puts them),
otherwise one layer spec for every layer. Every parameter of Megatron's spec builders is
mapped to the config field it is built from (``BUILDER_FIELDS``); a builder parameter not
in that map stops the run at start-up, so a Megatron release that adds one cannot have it
silently left at its default.

Megatron-LM's ``--spec MODULE NAME`` imports ``MODULE`` and takes its attribute ``NAME``, so

    --spec megatron_zeppelin.megatron.spec local     # Megatron-core modules only
    --spec megatron_zeppelin.megatron.spec te        # TransformerEngine linears and norms

work directly (``te`` exists only where TransformerEngine imports). Both use RMSNorm and RoPE with
Megatron's defaults; the Megatron hooks rebuild the named kind from the run's config with
``model_spec`` and the flags' rotary settings (``rotary.Rope``): ``spec_from_flags``, which also
takes a ``--spec`` of the user's that uses Zeppelin's core attention and refuses one that does
not.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import warnings
from typing import Any

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_zeppelin.megatron.model.core_attention import ZeppelinCoreAttention
from megatron_zeppelin.megatron.model.norms import (
    needs_sequence_parallel_norms,
    sequence_parallel_spec,
)
from megatron_zeppelin.megatron.model.rotary import MEGATRON_DEFAULT, Rope

SPEC_KINDS = ("local", "te")

BUILDER_FIELDS: dict[str, str | None] = {
    "num_experts": "num_moe_experts",
    "moe_grouped_gemm": "moe_grouped_gemm",
    "qk_layernorm": "qk_layernorm",
    "multi_latent_attention": "multi_latent_attention",
    "moe_use_legacy_grouped_gemm": "moe_use_legacy_grouped_gemm",
    "normalization": "normalization",
    "qk_l2_norm": "qk_l2_norm",
    "use_kitchen": "use_kitchen",
    "use_kitchen_attention": "use_kitchen_attention",
    "kitchen_attention_backend": "kitchen_attention_backend",
    "use_te_activation_func": "use_te_activation_func",
    "mla_down_proj_fusion": "mla_down_proj_fusion",
    "use_grouped_gemm_for_dense_mlp": "use_grouped_gemm_for_dense_mlp",
    "use_te_op_fuser": "use_transformer_engine_op_fuser",
    "fp8": None,  # deprecated in both releases; the builders ignore it
}
"""Parameter of ``get_gpt_layer_local_spec`` / ``get_gpt_layer_with_transformer_engine_spec``
(megatron-core 0.16.1 and 0.19) -> the ``TransformerConfig`` field it is built from (a release
whose config lacks the field lacks the feature: the builder's default is then right); ``None``:
left at the builder's default, as Megatron's GPT builder leaves it."""

BLOCK_BUILDER_PARAMETERS = frozenset(
    {"config", "use_transformer_engine", "normalization", "qk_l2_norm", "vp_stage", "pp_rank"}
)
"""Parameters of ``get_gpt_decoder_block_spec`` that ``model_spec`` knows how to fill."""


def has_transformer_engine() -> bool:
    """Whether TransformerEngine's PyTorch modules import here."""
    try:
        # lazy: probed, not imported at the top: TransformerEngine is optional.
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure (missing CUDA too) means no TE
        return False
    return True


def _layer_builder(kind: str):
    if kind not in SPEC_KINDS:
        raise ValueError(f"unknown spec kind {kind!r}: use one of {', '.join(SPEC_KINDS)}")
    if kind == "local":
        return gpt_layer_specs.get_gpt_layer_local_spec
    if not has_transformer_engine():
        raise ValueError(
            "the 'te' spec needs TransformerEngine, which does not import here: install "
            "transformer-engine[pytorch] (see the Docker image) or use the 'local' spec"
        )
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec


def unknown_builder_parameters() -> dict[str, list[str]]:
    """Parameters of Megatron's spec builders (the installed release) that ``model_spec`` does
    not know how to set, by builder name (empty lists: it knows them all)."""
    builders = [gpt_layer_specs.get_gpt_layer_local_spec]
    if hasattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec"):
        builders.append(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec)
    found = {b.__name__: _unknown(b, BUILDER_FIELDS) for b in builders}
    block = gpt_layer_specs.get_gpt_decoder_block_spec
    found[block.__name__] = _unknown(block, BLOCK_BUILDER_PARAMETERS)
    return found


def _unknown(builder, known) -> list[str]:
    return [p for p in inspect.signature(builder).parameters if p not in known]


def _require_known(builder, known) -> None:
    unknown = _unknown(builder, known)
    if unknown:
        raise ValueError(
            f"megatron-core's {builder.__name__} takes {', '.join(unknown)}, which "
            "megatron_zeppelin does not know how to set: use megatron-core 0.16.1 or 0.19.x"
        )


def layer_spec_kwargs(builder, config: Any) -> dict[str, Any]:
    """Every parameter of Megatron's layer-spec ``builder``, from ``config`` (``BUILDER_FIELDS``);
    raises ``ValueError`` for a parameter it does not know."""
    _require_known(builder, BUILDER_FIELDS)
    kwargs = {}
    for name, parameter in inspect.signature(builder).parameters.items():
        field = BUILDER_FIELDS[name]
        if field is not None:
            kwargs[name] = getattr(config, field, parameter.default)
    return kwargs


def with_zeppelin_attention(spec, *, rope: Rope | None):
    """A deep copy of a layer spec or block spec with every layer's core attention Zeppelin's."""
    spec = copy.deepcopy(spec)
    layers = spec.layer_specs if isinstance(spec, TransformerBlockSubmodules) else [spec]
    for layer in layers:
        attention = layer.submodules.self_attention
        assert hasattr(attention.submodules, "core_attention"), "not an attention spec"
        attention.submodules.core_attention = ModuleSpec(
            module=ZeppelinCoreAttention,
            params={"rope": rope},
        )
    return spec


def model_spec(
    config: Any,
    *,
    kind: str,
    rope: Rope | None,
    vp_stage: int | None = None,
):
    """The spec Megatron's GPT builder builds for ``config`` (a ``TransformerConfig``) with the
    ``kind`` of layers, every layer's core attention Zeppelin's: a block spec with MoE layers
    (``config.num_moe_experts``), a layer spec otherwise. ``rope``: the rotary settings
    (``rotary.Rope.from_args``); ``None`` turns Zeppelin's per-document RoPE off (models
    without rotary positions)."""
    builder = _layer_builder(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns about missing Apex on every call
        if getattr(config, "num_moe_experts", None):
            block = gpt_layer_specs.get_gpt_decoder_block_spec
            _require_known(block, BLOCK_BUILDER_PARAMETERS)
            spec = block(
                config,
                use_transformer_engine=kind == "te",
                normalization=config.normalization,
                qk_l2_norm=getattr(config, "qk_l2_norm", False),
                vp_stage=vp_stage,
            )
        else:
            spec = builder(**layer_spec_kwargs(builder, config))
    return with_zeppelin_attention(spec, rope=rope)


def zeppelin_layer_spec(
    kind: str = "local",
    *,
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
    rope: Rope | None = MEGATRON_DEFAULT,
) -> ModuleSpec:
    """Megatron's dense GPT layer spec of ``kind`` (``local`` or ``te``) with Zeppelin's core
    attention, for a model without a ``TransformerConfig`` at hand (``--spec``'s attributes,
    the CPU job); a Megatron run's spec comes from ``model_spec``.

    ``rope`` holds the rotary settings (``Rope.from_args`` of Megatron's flags); ``None`` turns
    Zeppelin's per-document RoPE off (for models with learned absolute positions). Build the
    model with ``position_embedding_type='none'`` otherwise, so RoPE is applied once.
    """
    builder = _layer_builder(kind)
    kwargs: dict[str, Any] = {"qk_layernorm": qk_layernorm}
    if "normalization" in inspect.signature(builder).parameters:
        kwargs["normalization"] = normalization  # TE's spec picks the norm from the config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron warns about missing Apex on every call
        spec = builder(**kwargs)
    return with_zeppelin_attention(spec, rope=rope)


def rope_of_flags(args: argparse.Namespace) -> Rope | None:
    """The run's rotary settings (``None`` without rotary embeddings)."""
    return Rope.from_args(args) if args.position_embedding_type == "rope" else None


def spec_from_flags(
    args: argparse.Namespace, config: Any, *, num_layers: int, vp_stage: int | None = None
):
    """Zeppelin's spec of the kind ``--spec`` names (or ``--transformer-impl`` implies), built
    from the run's ``TransformerConfig`` as Megatron's GPT builder builds it
    (``spec.model_spec``: MoE layers, norms, QK norms, ...) with the flags' rotary settings; a
    ``--spec`` without Zeppelin's core attention is refused, since the plan's layouts would then
    reach a module that cannot read them. A spec of the user's with Zeppelin's core attention
    gets the flags' rotary settings (a copy of it does): they are the model's only rotary,
    Megatron's own is off for Zeppelin models. ``num_layers``: the layers of the model chunk
    being built (a block spec lists them); ``vp_stage``: its virtual pipeline stage (MoE's
    block spec slices the layers)."""
    kind = "te" if getattr(args, "transformer_impl", "local") == "transformer_engine" else "local"
    named = getattr(args, "spec", None)
    if named:
        if len(named) != 2:
            raise ValueError(f"--spec takes MODULE NAME, got {' '.join(named)}")
        if named[0] == "megatron_zeppelin.megatron.spec" and named[1] in SPEC_KINDS:
            kind = named[1]
        else:
            spec = import_module(tuple(named))
            try:
                ours = all(
                    core_attention_of(layer).module is ZeppelinCoreAttention
                    for layer in layers_of(spec)
                )
            except AttributeError:  # not a layer spec at all (None, a function, a block spec)
                ours = False
            if not ours:
                raise ValueError(
                    f"--spec {' '.join(named)} does not use Zeppelin's core attention: use "
                    "--spec megatron_zeppelin.megatron.spec local (or te), or drop --spec"
                )
            spec = copy.deepcopy(spec)
            for layer in layers_of(spec):
                core = core_attention_of(layer)
                core.params = {**(core.params or {}), "rope": rope_of_flags(args)}
            return spec
    spec = model_spec(config, kind=kind, rope=rope_of_flags(args), vp_stage=vp_stage)
    if getattr(args, "sequence_parallel", False) and needs_sequence_parallel_norms(spec):
        # Without Apex, Megatron's local spec has norms that refuse sequence parallelism.
        return sequence_parallel_spec(spec, num_layers)
    return spec


def layers_of(spec) -> list[ModuleSpec]:
    """The layer specs of a layer spec or block spec."""
    return list(spec.layer_specs) if isinstance(spec, TransformerBlockSubmodules) else [spec]


def core_attention_of(spec: ModuleSpec) -> ModuleSpec:
    """The core-attention leaf of a GPT layer spec (for checks and tests)."""
    return spec.submodules.self_attention.submodules.core_attention


local = zeppelin_layer_spec("local")
if has_transformer_engine():
    te = zeppelin_layer_spec("te")
