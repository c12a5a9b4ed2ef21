"""The model ``--zeppelin`` trains is the model Megatron itself builds from the same flags, with
only core attention replaced (megatron-core 0.19, in this process: nothing is launched).

For each set of flags (dense and MoE, RMSNorm and LayerNorm, QK norms, tied and untied
embeddings, shared experts, a dense layer among MoE ones) Megatron's real parser reads them,
``hooks.model_provider`` builds Zeppelin's model, and the reference builds Megatron's own the
way Megatron-LM's ``gpt_builders.py`` (core_r0.19.0) does: its decoder block spec with
``--num-experts``, its layer spec otherwise. Both must have the same parameters (names, shapes,
count) and the same modules but core attention (and the rotary module, whose RoPE Zeppelin's
core attention applies per document).

Tier: host.
"""

from __future__ import annotations

import sys
import warnings

import pytest
from cpu_adapter import validation_on_cpu
from test_pretrain_loop import MODEL, ON_CPU

from megatron_zeppelin.megatron import hooks, spec

pytestmark = pytest.mark.host

FLAGS = [
    *MODEL,
    *"--micro-batch-size 1 --global-batch-size 1 --train-iters 1 --lr 1e-3".split(),
    *"--eval-iters 0 --eval-interval 10".split(),
    *ON_CPU,
    *"--zeppelin --zeppelin-topology custom --zeppelin-nodes 1 --zeppelin-kernel torch".split(),
]
MOE = "--num-experts 4 --moe-router-topk 2"
CASES = {
    "dense": "",
    "dense-layernorm-qk-norm-tied": "--normalization LayerNorm --qk-layernorm",
    "moe": MOE,
    "moe-shared-mixed-layers": (
        f"{MOE} --moe-ffn-hidden-size 48 --moe-shared-expert-intermediate-size 32 "
        "--moe-layer-freq [1,0] --qk-l2-norm"
    ),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """A small dataset: the start-up checks read its header."""
    from megatron_zeppelin.job.synthetic import write_synthetic_dataset

    prefix = str(tmp_path_factory.mktemp("model-spec") / "docs")
    write_synthetic_dataset(prefix, lengths=[50, 30, 20] * 10, vocab_size=128)
    return prefix


def _parsed(extra: str, data: str, monkeypatch):
    """Megatron's parsed, validated and global arguments for ``FLAGS + extra``."""
    from megatron.training.arguments import parse_and_validate_args

    argv = [*FLAGS, "--data-path", data, *extra.split()]
    if "tied" in extra or "LayerNorm" in extra:
        argv.remove("--untie-embeddings-and-output-weights")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with validation_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parse_and_validate_args(hooks.extra_args_provider, args_defaults={})


def megatron_model(args):
    """Megatron's own GPT model for ``args``, as ``gpt_builders.gpt_builder`` of Megatron-LM
    core_r0.19.0 builds it with ``--transformer-impl local`` (a stand-in: that file ships with
    Megatron-LM, not with the megatron-core wheel)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    if args.num_experts:
        layer_spec = get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm,
        )
    else:
        layer_spec = get_gpt_layer_local_spec(
            config.num_moe_experts,
            config.moe_grouped_gemm,
            config.qk_layernorm,
            config.multi_latent_attention,
            config.experimental_attention_variant,
            normalization=config.normalization,
            use_kitchen=config.use_kitchen,
            use_kitchen_attention=config.use_kitchen_attention,
            kitchen_attention_backend=config.kitchen_attention_backend,
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
    )


def _modules(model) -> dict[str, str]:
    """Module class by name, but core attention and the rotary module."""
    return {
        name: type(module).__name__
        for name, module in model.named_modules()
        if "core_attention" not in name and "rotary_pos_emb" not in name
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_zeppelin_builds_the_model_megatron_builds(
    case: str, data: str, one_rank, monkeypatch
) -> None:
    from megatron.training import global_vars

    args = _parsed(CASES[case], data, monkeypatch)
    hooks.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = hooks.model_provider(pre_process=True, post_process=True)
            theirs = megatron_model(args)
    finally:
        hooks.reset()
        global_vars.unset_global_variables()
    shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    assert shapes == {n: tuple(p.shape) for n, p in theirs.named_parameters()}
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    assert _modules(ours) == _modules(theirs)
    cores = {type(m).__name__ for n, m in ours.named_modules() if n.endswith("core_attention")}
    assert cores == {"ZeppelinCoreAttention"}
    if "moe" in case:
        assert any("local_experts" in name for name in shapes), "no experts were built"


def test_every_parameter_of_megatrons_spec_builders_is_set_from_the_config() -> None:
    """A parameter a newer release adds would stop the run at start-up, never be left at its
    default (``spec.BUILDER_FIELDS``)."""
    unknown = spec.unknown_builder_parameters()
    assert set(unknown) >= {"get_gpt_layer_local_spec", "get_gpt_decoder_block_spec"}
    assert not any(unknown.values()), unknown
