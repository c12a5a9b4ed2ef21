"""Zeppelin's core attention reads Megatron's attention settings as Megatron's own attention does,
and refuses at construction what it would not honour.

Tiers: pure (``variants.py`` on plain values), threads (the module built from a real
``TransformerConfig`` in one in-process gloo rank, as Megatron's ``SelfAttention`` builds it).
Training through them against Megatron's own model: ``tests/host/test_attention_variants.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_zeppelin.megatron.model.variants import layer_window, skips_rope, window_left


@pytest.mark.pure
def test_window_sizes_read_as_megatron_and_transformer_engine_read_them() -> None:
    assert window_left(None) is None
    assert window_left((64, 0)) == 64 and window_left((0, 0)) == 0
    assert window_left((-1, 0)) is None  # -1: no window (TransformerEngine's convention)
    with pytest.raises(ValueError, match="see later tokens.*--window-size L,0"):
        window_left((64, 4))
    with pytest.raises(ValueError, match="-1 \\(none\\) or at least 0"):
        window_left((-5, 0))
    with pytest.raises(ValueError, match="LEFT,RIGHT"):
        window_left((64,))


@pytest.mark.pure
def test_the_window_skips_the_layers_megatron_skips() -> None:
    config = SimpleNamespace(window_size=(24, 0), window_attn_skip_freq=None)
    assert [layer_window(config, n) for n in (1, 2, 3)] == [24, 24, 24]
    config.window_attn_skip_freq = 3  # every third layer full
    assert [layer_window(config, n) for n in (1, 2, 3, 4)] == [24, 24, None, 24]
    config.window_attn_skip_freq = [0, 1, 1, 0]  # 1: windowed
    assert [layer_window(config, n) for n in (1, 2, 3, 4)] == [None, 24, 24, None]
    assert layer_window(SimpleNamespace(window_size=None, window_attn_skip_freq=2), 1) is None


@pytest.mark.pure
def test_no_rope_layers_follow_megatrons_pattern() -> None:
    assert not skips_rope(SimpleNamespace(no_rope_freq=None), 1)
    config = SimpleNamespace(no_rope_freq=[0, 1, 0, 1])  # what TransformerConfig makes of 2
    assert [skips_rope(config, n) for n in (1, 2, 3, 4)] == [False, True, False, True]


def _config(**changes):  # noqa: ANN003, ANN202
    from megatron.core.transformer import TransformerConfig

    settings = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        init_method_std=0.5,
    )
    return TransformerConfig(**{**settings, **changes})


def _core(config, layer: int = 1, **kwargs):  # noqa: ANN001, ANN003, ANN202
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_zeppelin.megatron.model.core_attention import ZeppelinCoreAttention

    kwargs.setdefault("attn_mask_type", AttnMaskType.causal)
    return ZeppelinCoreAttention(config, layer, **kwargs)


@pytest.mark.threads
def test_a_learnable_sink_is_megatrons_parameter(one_rank) -> None:  # noqa: ANN001
    config = _config(softmax_type="learnable")
    torch.manual_seed(3)
    core = _core(config)
    # DotProductAttention's parameter: its name, one logit per head, drawn by init_method.
    assert [name for name, _ in core.named_parameters()] == ["softmax_offset"]
    torch.manual_seed(3)
    drawn = config.init_method(torch.empty(4, dtype=config.params_dtype))
    assert torch.equal(core.softmax_offset.detach(), drawn) and drawn.abs().max() > 0
    sharded = core.sharded_state_dict(prefix="layer.", metadata={"dp_cp_group": None})
    (key,) = sharded
    assert key == "layer.softmax_offset" and sharded[key].axis_fragmentations == (1,)
    assert sharded[key].global_shape == (4,)


@pytest.mark.threads
def test_off_by_one_is_a_zero_sink_and_no_parameter(one_rank) -> None:  # noqa: ANN001
    core = _core(_config(softmax_type="off-by-one"))
    assert not list(core.parameters())
    assert torch.equal(core.softmax_offset, torch.zeros(4))
    assert not core.sharded_state_dict(metadata={"dp_cp_group": None})
    assert _core(_config()).softmax_offset is None


@pytest.mark.threads
def test_windows_and_rope_follow_the_layer(one_rank) -> None:  # noqa: ANN001
    from megatron_zeppelin.megatron.model.rotary import Rope

    config = _config(window_size=(24, 0), window_attn_skip_freq=2, no_rope_freq=2)
    rope = Rope(base=500.0, scaling_factor=8.0)
    layers = [_core(config, n, rope=rope) for n in (1, 2, 3, 4)]
    assert [c.window for c in layers] == [24, None, 24, None]
    assert [c.rope for c in layers] == [rope, None, rope, None]


@pytest.mark.threads
@pytest.mark.parametrize(
    "changes, kwargs, match",
    [
        ({}, {"k_channels": 192}, "settings it does not know \\(k_channels\\)"),
        ({}, {"attn_mask_type": "no_mask"}, "causal within each document"),
        ({"attention_dropout": 0.1}, {}, "--attention-dropout 0"),
        ({"qk_clip": True}, {}, "drop --qk-clip"),
        ({"log_max_attention_logit": True}, {}, "drop --log-max-attention-logit"),
        ({"window_size": (64, 8)}, {}, "--window-size L,0"),
    ],
)
def test_settings_it_would_not_honour_stop_the_build(one_rank, changes, kwargs, match) -> None:  # noqa: ANN001
    from megatron.core.transformer.enums import AttnMaskType

    if kwargs.get("attn_mask_type") == "no_mask":
        kwargs["attn_mask_type"] = AttnMaskType.no_mask
    try:
        config = _config(**changes)
    except (AssertionError, ValueError) as exc:  # this megatron-core validates it itself
        pytest.skip(f"megatron-core refuses {changes} already: {exc}")
    with pytest.raises(ValueError, match=match):
        _core(config, **kwargs)


@pytest.mark.pure
def test_a_spec_of_ones_own_gets_the_flags_rotary_settings() -> None:
    """``--spec MODULE NAME`` naming a spec with Zeppelin's core attention: the flags' rotary
    settings replace the spec's own (a copy's), since they are the model's only rotary."""
    from megatron_zeppelin.megatron.model.rotary import Rope
    from megatron_zeppelin.megatron.spec import core_attention_of, spec_from_flags

    args = SimpleNamespace(
        spec=[__name__, "OWN_SPEC"],
        transformer_impl="local",
        position_embedding_type="rope",
        rotary_base=500000,
        rotary_percent=1.0,
        rotary_interleaved=True,
        rotary_seq_len_interpolation_factor=None,
        use_rope_scaling=True,
        rope_scaling_factor=32.0,
        sequence_parallel=False,
    )
    spec = spec_from_flags(args, None, num_layers=2)
    assert core_attention_of(spec).params["rope"] == Rope(500000.0, 1.0, True, None, 32.0)
    assert core_attention_of(OWN_SPEC).params["rope"] == Rope(base=7.0)  # left as it was
    args.position_embedding_type = "learned_absolute"
    assert core_attention_of(spec_from_flags(args, None, num_layers=2)).params["rope"] is None


def _own_spec():  # noqa: ANN202
    from megatron_zeppelin.megatron.model.rotary import Rope
    from megatron_zeppelin.megatron.spec import zeppelin_layer_spec

    return zeppelin_layer_spec("local", normalization="LayerNorm", rope=Rope(base=7.0))


OWN_SPEC = _own_spec()
