"""Pure tier: model presets, explicit dimensions, FLOP and byte counts, causal pair counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_zeppelin.planner.costmodel import causal_pairs
from megatron_zeppelin.planner.models import MODEL_PRESETS, get_model

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
