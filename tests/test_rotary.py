"""Per-document rotary embeddings (tier: pure).

Megatron's own RoPE (megatron-core's ``RotaryEmbedding`` and its bshd rotation, with every option
a GPT model takes: base, percent, interleaving, Llama 3.x scaling, position interpolation) is the
oracle for one document; the per-document property is that a token's rotation depends only on
its position inside its own document, so attention scores depend only on relative positions.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.megatron.model.rotary import (
    Rope,
    apply_rotary,
    llama3_frequencies,
    positions_of_ranges,
    rotary_dim,
)
from megatron_zeppelin.planner.plan.plan import TokenRange

pytestmark = pytest.mark.pure


ROPES = {
    "default": Rope(),
    "base 500, half the head": Rope(base=500.0, percent=0.5),
    "interleaved": Rope(interleaved=True, percent=0.5),
    "llama3 scaling": Rope(base=500000.0, scaling_factor=8.0),
    "llama3 scaling, factor 32": Rope(base=10000.0, scaling_factor=32.0),
    "interpolation": Rope(seq_len_interpolation_factor=4),
    "all of them": Rope(
        base=500000.0, percent=0.5, interleaved=True, seq_len_interpolation_factor=2,
        scaling_factor=16.0,
    ),
}  # fmt: skip


def _megatron_rope(rope: Rope, head_dim: int, length: int, monkeypatch) -> torch.Tensor:  # noqa: ANN001
    """Megatron's own embedding table for positions ``0 .. length - 1`` (``RotaryEmbedding``,
    as ``GPTModel`` builds it from the flags), on the CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    module = RotaryEmbedding(
        head_dim,
        rope.percent,
        rotary_interleaved=rope.interleaved,
        seq_len_interpolation_factor=rope.seq_len_interpolation_factor,
        rotary_base=int(rope.base),
        rope_scaling=rope.scaling_factor is not None,
        rope_scaling_factor=rope.scaling_factor or 8.0,
        use_cpu_initialization=True,
    )
    # get_emb moves its frequencies to the current GPU first: here the CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    return module.get_emb(length)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_matches_megatron_rope_on_one_document(name: str, monkeypatch) -> None:  # noqa: ANN001
    """Megatron's RotaryEmbedding and its bshd rotation on one document starting at position 0
    (long enough for Llama 3 scaling's slowed and blended frequencies to turn visibly) against
    ``apply_rotary``: the same to float32 rounding."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.common.embeddings import rope_utils
    rope, head_dim, length = ROPES[name], 32, 3000
    freqs = _megatron_rope(rope, head_dim, length, monkeypatch)
    x = torch.randn(length, 1, 3, head_dim)
    expected = rope_utils._apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=rope.interleaved)
    got = apply_rotary(x, torch.arange(length), rope)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Per document: positions restart, whatever rows they sit in.
    rows = torch.tensor([2999, 0, 17, 1024])
    torch.testing.assert_close(
        apply_rotary(x[rows], rows, rope), expected[rows], rtol=1e-5, atol=1e-5
    )


def test_every_option_changes_the_rotation() -> None:
    """Each setting turns the features differently (a dropped one would show)."""
    x = torch.randn(3000, 2, 32, dtype=torch.float64)
    positions = torch.arange(3000)
    plain = apply_rotary(x, positions, Rope(base=10000.0))
    for rope in (
        Rope(base=500.0),
        Rope(percent=0.5),
        Rope(interleaved=True),
        Rope(seq_len_interpolation_factor=4),
        Rope(scaling_factor=8.0),
    ):
        assert (apply_rotary(x, positions, rope) - plain).abs().max() > 1e-3, rope


def test_llama3_scaling_slows_only_the_low_frequencies() -> None:
    inv_freq = Rope(base=500000.0).inverse_frequencies(128, dtype=torch.float64)
    scaled = llama3_frequencies(inv_freq, 8.0)
    wavelength = 2 * math.pi / inv_freq
    high, low = wavelength < 8192 / 4, wavelength > 8192
    assert torch.equal(scaled[high], inv_freq[high])
    torch.testing.assert_close(scaled[low], inv_freq[low] / 8)
    middle = ~high & ~low
    assert (
        middle.any()
        and ((scaled[middle] < inv_freq[middle]) & (scaled[middle] > inv_freq[middle] / 8)).all()
    )


def test_rope_reads_megatrons_arguments() -> None:
    args = SimpleNamespace(
        rotary_base=500000,
        rotary_percent=0.5,
        rotary_interleaved=True,
        rotary_seq_len_interpolation_factor=4,
        use_rope_scaling=True,
        rope_scaling_factor=32.0,
    )
    assert Rope.from_args(args) == Rope(500000.0, 0.5, True, 4, 32.0)
    args.use_rope_scaling = False
    assert Rope.from_args(args).scaling_factor is None
    with pytest.raises(ValueError, match="interpolation factor must be positive"):
        Rope(seq_len_interpolation_factor=0)


@settings(max_examples=examples(25), deadline=None)
@given(
    p=st.integers(0, 4000),
    q=st.integers(0, 4000),
    shift=st.integers(-4000, 4000),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(sorted(ROPES)),
)
def test_scores_depend_only_on_relative_position(p, q, shift, seed, name) -> None:  # noqa: ANN001
    rope = ROPES[name]
    shift = max(shift, -min(p, q))  # positions stay >= 0
    gen = torch.Generator().manual_seed(seed)
    query, key = torch.randn(2, 1, 2, 8, generator=gen, dtype=torch.float64)

    def score(a: int, b: int) -> torch.Tensor:
        qa = apply_rotary(query, torch.tensor([a]), rope)
        kb = apply_rotary(key, torch.tensor([b]), rope)
        return (qa * kb).sum(-1)

    torch.testing.assert_close(score(p, q), score(p + shift, q + shift), rtol=1e-9, atol=1e-9)


def test_positions_restart_in_every_document_and_range() -> None:
    ranges = [TokenRange(0, 5, 8), TokenRange(3, 0, 2), TokenRange(0, 60, 61)]
    assert positions_of_ranges(ranges).tolist() == [5, 6, 7, 0, 1, 60]
    assert positions_of_ranges([]).numel() == 0


def test_rotation_is_per_row_and_keeps_norms() -> None:
    x = torch.randn(6, 1, 2, 8, dtype=torch.float64)
    positions = torch.tensor([0, 9, 3, 0, 1, 9])
    out = apply_rotary(x, positions)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(out[0], x[0])  # position 0 is the identity
    torch.testing.assert_close(out[3], x[3])
    # Same position, same rotation, whatever the row.
    torch.testing.assert_close(apply_rotary(x[1:2], positions[1:2]), out[1:2])
    torch.testing.assert_close(apply_rotary(x[5:6], positions[5:6]), out[5:6])


def test_partial_rotary_leaves_the_tail_alone_and_gradients_flow() -> None:
    x = torch.randn(4, 2, 8, requires_grad=True)
    out = apply_rotary(x, torch.arange(4) + 3, Rope(percent=0.5))
    torch.testing.assert_close(out[..., 4:], x[..., 4:])
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="one position per"):
        apply_rotary(torch.zeros(3, 1, 8), torch.arange(2))
    with pytest.raises(ValueError, match="even"):
        rotary_dim(6, 0.5)
    with pytest.raises(ValueError, match="rotary_percent"):
        rotary_dim(8, 0.0)
