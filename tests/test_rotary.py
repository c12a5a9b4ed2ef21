"""Per-document rotary embeddings (tier: pure).

Megatron's own RoPE (its inverse frequencies and its bshd rotation) is the oracle for one
document; the per-document property is that a token's rotation depends only on its position
inside its own document, so attention scores depend only on relative positions.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.megatron.rotary import apply_rotary, positions_of_ranges, rotary_dim
from megatron_zeppelin.planner.plan import TokenRange

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("base,percent", [(10000.0, 1.0), (500.0, 0.5)])
def test_matches_megatron_rope_on_one_document(base: float, percent: float) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.common.embeddings import rope_utils
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    apply_bshd = getattr(rope_utils, "_apply_rotary_pos_emb_bshd", None)
    if apply_bshd is None:
        pytest.skip("this megatron-core has no bshd rotary helper to compare with")
    head_dim, length = 16, 37
    rope = RotaryEmbedding(head_dim, percent, rotary_base=base, use_cpu_initialization=True)
    angles = torch.outer(torch.arange(length).float(), rope.inv_freq)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    x = torch.randn(length, 1, 3, head_dim)
    expected = apply_bshd(x, freqs)
    got = apply_rotary(x, torch.arange(length), base=base, rotary_percent=percent)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@settings(max_examples=examples(25), deadline=None)
@given(
    p=st.integers(0, 4000),
    q=st.integers(0, 4000),
    shift=st.integers(-4000, 4000),
    seed=st.integers(0, 2**16),
)
def test_scores_depend_only_on_relative_position(p: int, q: int, shift: int, seed: int) -> None:
    shift = max(shift, -min(p, q))  # positions stay >= 0
    gen = torch.Generator().manual_seed(seed)
    query, key = torch.randn(2, 1, 2, 8, generator=gen, dtype=torch.float64)

    def score(a: int, b: int) -> torch.Tensor:
        qa = apply_rotary(query, torch.tensor([a]))
        kb = apply_rotary(key, torch.tensor([b]))
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
    out = apply_rotary(x, torch.arange(4) + 3, rotary_percent=0.5)
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
