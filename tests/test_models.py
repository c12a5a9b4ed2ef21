"""Pure tier: model presets, explicit dimensions, FLOP and byte counts, causal pair counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_zeppelin.megatron.documents.sampler import DocumentCost
from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.costmodel import CostModel, causal_pairs
from megatron_zeppelin.planner.cost.models import MODEL_PRESETS, ModelSpec, PipelineStage, get_model
from megatron_zeppelin.planner.search.partition import plan_batch
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure


def brute_pairs(q0: int, q1: int, k0: int, k1: int) -> int:
    return sum(1 for q in range(q0, q1) for k in range(k0, k1) if k <= q)


@given(st.integers(0, 40), st.integers(0, 40), st.integers(0, 40), st.integers(0, 40))
def test_causal_pairs_counts_visible_pairs(a: int, b: int, c: int, d: int) -> None:
    q0, q1 = sorted((a, b))
    k0, k1 = sorted((c, d))
    assert causal_pairs(q0, q1, k0, k1) == brute_pairs(q0, q1, k0, k1)


def test_explicit_dimensions_equal_the_preset_they_spell() -> None:
    preset = MODEL_PRESETS["llama3-8b"]
    spelled = get_model("layers=32,hidden=4096,heads=32,kv-heads=8,ffn=14336,vocab=128256")
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size"):
        assert getattr(spelled, field) == getattr(preset, field)
    assert spelled.kv_bytes_per_token() == preset.kv_bytes_per_token()
    assert spelled.linear_flops_per_token() == preset.linear_flops_per_token()


def test_gqa_shrinks_kv_bytes_not_attention_flops() -> None:
    mha = get_model("layers=2,hidden=512,heads=8,ffn=1024")
    gqa = get_model("layers=2,hidden=512,heads=8,kv-heads=2,ffn=1024")
    assert gqa.kv_bytes_per_token() * 4 == mha.kv_bytes_per_token()
    assert gqa.attn_flops_per_pair() == mha.attn_flops_per_pair()
    assert gqa.linear_flops_per_token() < mha.linear_flops_per_token()


def test_tensor_parallel_divides_per_gpu_work() -> None:
    one, two = get_model("llama-13b"), get_model("llama-13b", tensor_parallel=2)
    assert two.attn_flops_per_pair() * 2 == pytest.approx(one.attn_flops_per_pair())
    assert two.linear_flops_per_token() * 2 == pytest.approx(one.linear_flops_per_token())
    assert two.kv_bytes_per_token() * 2 == one.kv_bytes_per_token()


@pytest.mark.parametrize(
    "text",
    [
        "llama-99b",
        "layers=32",
        "layers=x,hidden=1,heads=1,ffn=1",
        "depth=3",
        "layers=2,hidden=10,heads=3,ffn=8",
    ],
)
def test_bad_models_are_refused_with_a_sentence(text: str) -> None:
    with pytest.raises(ValueError) as err:
        get_model(text)
    assert len(str(err.value)) > 20


def _megatron_config(**fields):
    """Megatron's own ``TransformerConfig`` (megatron-core), as its argument parser builds it."""
    import torch
    from megatron.core.transformer import TransformerConfig

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}
    half = [k for k in dtype if fields.get(k)]
    fields.setdefault("params_dtype", dtype[half[0]] if half else torch.float32)
    return TransformerConfig(**fields)


def test_llama_7b_from_megatrons_config_is_the_cli_preset_with_the_issue_figures() -> None:
    from megatron_zeppelin.planner.cost.costmodel import CostModel
    from megatron_zeppelin.planner.cost.models import model_from_config
    from megatron_zeppelin.planner.cost.thresholds import tier_thresholds
    from megatron_zeppelin.topology.presets import get_topology

    # configs/models/llama-7b.yaml: MHA (no --group-query-attention, so Megatron leaves
    # num_query_groups unset) in bf16.
    config = _megatron_config(
        num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008, bf16=True
    )
    spec = model_from_config(config, vocab_size=32000, name="llama-7b")
    assert spec == get_model("llama-7b")
    assert (spec.num_kv_heads, spec.dtype_bytes) == (32, 2)
    assert spec.kv_bytes_per_token() == 16384
    cost = CostModel.default(spec, get_topology("dgx-h100", num_nodes=4))
    assert tier_thresholds(cost) == (4940, 49768)


def test_kv_heads_dtype_and_tp_come_from_the_config() -> None:
    from megatron_zeppelin.planner.cost.models import dtype_bytes_of, model_from_config

    base = dict(num_layers=2, hidden_size=512, num_attention_heads=8, ffn_hidden_size=1024)
    gqa = model_from_config(_megatron_config(**base, num_query_groups=2), vocab_size=64)
    assert gqa.num_kv_heads == 2 and gqa.dtype_bytes == 4
    fp16 = _megatron_config(**base, fp16=True, tensor_model_parallel_size=2)
    assert model_from_config(fp16, vocab_size=64).tensor_parallel == 2
    assert dtype_bytes_of(fp16) == 2
    with pytest.raises(ValueError, match="--kv-channels"):
        model_from_config(_megatron_config(**base, kv_channels=32), vocab_size=64)


def test_the_cpu_jobs_model_is_the_tiny_preset() -> None:
    import dataclasses

    from megatron_zeppelin.megatron.runtime import ModelDims

    spec = ModelDims().model_spec(tensor_parallel=2)
    assert spec == dataclasses.replace(get_model("tiny", tensor_parallel=2), name="cpu-gpt")


def _stage(model: ModelSpec, index: int, layers: tuple[int, ...], num_stages: int = 2):
    stage = PipelineStage(
        index=index,
        num_stages=num_stages,
        layers=layers,
        embedding=index == 0,
        output_layer=index == num_stages - 1,
    )
    return ModelSpec(**{**model.to_dict(), "num_layers": len(layers), "pipeline": stage})


def test_a_pipeline_stage_is_priced_by_its_own_layers_and_the_last_by_its_output_layer() -> None:
    whole = get_model("llama-7b")
    first, last = _stage(whole, 0, tuple(range(16))), _stage(whole, 1, tuple(range(16, 32)))
    assert first.pipeline.describe() == "PP stage 0 of 2, layers 0-15, embedding"
    assert last.pipeline.describe() == "PP stage 1 of 2, layers 16-31, output layer and loss"
    # The output layer: 2 x hidden x vocab FLOPs per token forward, 3x that with its backward,
    # only where it runs; the embedding is a lookup.
    assert last.output_flops_per_token() == 3 * 2 * 4096 * 32000
    assert first.output_flops_per_token() == 0
    assert whole.output_flops_per_token() == last.output_flops_per_token()
    # Layers add up: the stages together run the whole model's GEMMs once.
    assert first.stage_flops_per_token() + last.stage_flops_per_token() == pytest.approx(
        whole.stage_flops_per_token()
    )
    assert last.stage_flops_per_token() > first.stage_flops_per_token()
    # Virtual stages interleave the layers; the description keeps them apart.
    interleaved = _stage(whole, 0, (0, 1, 4, 5), num_stages=2)
    assert interleaved.pipeline.describe() == "PP stage 0 of 2, layers 0-1, 4-5, embedding"
    with pytest.raises(ValueError, match="its pipeline stage holds 4"):
        ModelSpec(**{**interleaved.to_dict(), "num_layers": 3, "pipeline": interleaved.pipeline})


def test_every_pipeline_stage_plans_the_same_plan() -> None:
    """Every stage plans from its own model, yet the next stage expects the rows the plan's
    linear layout gives a rank: the plans must be the same, and a stage's predicted time its
    own layers' share."""
    topology = get_topology("dgx-h100", num_nodes=1)
    whole = get_model("llama-7b")
    stages = [_stage(whole, 0, tuple(range(12))), _stage(whole, 1, tuple(range(12, 32)))]
    lengths = sample_lengths("prolong", num_tokens=6 * 16_384, seed=3)
    plans = [
        plan_batch(
            lengths, topology=topology, cost_model=CostModel.default(m, topology), capacity=16_384
        )
        for m in [whole, *stages]
    ]
    assert plans[0] == plans[1] == plans[2]
    # The sampler weighs documents by the same per-layer figures: every stage draws the same.
    assert DocumentCost.from_model(stages[0]) == DocumentCost.from_model(stages[1])
    assert plans[0].linear == plans[1].linear == plans[2].linear
    predicted = [p.meta["predicted_step_s"] for p in plans]
    assert predicted[1] == pytest.approx(predicted[0] * 12 / 32)
    assert predicted[2] == pytest.approx(predicted[0] * 20 / 32)


def test_a_moe_layer_is_priced_by_the_experts_a_token_runs_through() -> None:
    """Attention projections + router + top-k experts + shared experts, not every expert and
    not the dense FFN; a layer without experts (``--moe-layer-freq``) keeps the dense FFN."""
    from megatron_zeppelin.planner.cost.models import model_from_config

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128)
    dense = model_from_config(_megatron_config(**base), vocab_size=64)
    moe = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=1)
    top2 = model_from_config(_megatron_config(**base, **moe), vocab_size=64)
    assert (top2.num_experts, top2.moe_topk, top2.num_moe_layers) == (8, 2, 2)
    h, gemm = 64, 3.0  # forward + backward
    mlp = lambda ffn: 2.0 * 3 * h * ffn * gemm  # noqa: E731 - a SwiGLU MLP per token
    router = 2.0 * h * 8 * gemm
    # The same layer with a dense FFN of the two experts' size, plus the router.
    assert top2.linear_flops_per_token() == pytest.approx(
        dense.linear_flops_per_token() - mlp(128) + 2 * mlp(32) + router
    )
    # More experts at the same top-k add only router work; a larger top-k adds expert FFNs.
    more = model_from_config(
        _megatron_config(**base, **{**moe, "num_moe_experts": 64}), vocab_size=64
    )
    assert more.linear_flops_per_token() - top2.linear_flops_per_token() == pytest.approx(
        2.0 * h * 56 * gemm
    )
    top4 = model_from_config(
        _megatron_config(**base, **{**moe, "moe_router_topk": 4}), vocab_size=64
    )
    assert top4.linear_flops_per_token() - top2.linear_flops_per_token() == pytest.approx(
        2 * mlp(32)
    )
    shared = {**moe, "moe_shared_expert_intermediate_size": 48}
    with_shared = model_from_config(_megatron_config(**base, **shared), vocab_size=64)
    assert with_shared.linear_flops_per_token() - top2.linear_flops_per_token() == pytest.approx(
        mlp(48)
    )
    # Experts in the first layer only: the mean of a MoE layer and a dense one.
    half = model_from_config(
        _megatron_config(**base, **{**moe, "moe_layer_freq": [1, 0]}), vocab_size=64
    )
    assert half.num_moe_layers == 1
    assert half.linear_flops_per_token() == pytest.approx(
        (top2.linear_flops_per_token() + dense.linear_flops_per_token()) / 2
    )
    assert (
        model_from_config(_megatron_config(**base, **{**moe, "moe_layer_freq": 2}), vocab_size=64)
        == half
    )
    # A pipeline stage counts the MoE layers among its own.
    stage = PipelineStage(index=1, num_stages=2, layers=(1,), embedding=False, output_layer=True)
    config = _megatron_config(**base, **{**moe, "moe_layer_freq": [1, 0]})
    assert model_from_config(config, vocab_size=64, pipeline=stage).num_moe_layers == 0
    with pytest.raises(ValueError, match="moe-layer-freq"):
        model_from_config(_megatron_config(**base, **{**moe, "moe_layer_freq": [1]}), vocab_size=64)
