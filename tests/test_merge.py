"""Tier: pure. The online-softmax merge against dense softmax attention in float64."""

from __future__ import annotations

import pytest
import torch
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.attention.merge import merge, merge_rows, merge_rows_

pytestmark = pytest.mark.pure


def _partial(q_nd: torch.Tensor, k_knd: torch.Tensor, v_knd: torch.Tensor, keys: list[int]):
    """Dense attention of queries q (t, n, d) over the key subset ``keys``: (out, lse)."""
    t, n, d = q_nd.shape
    if not keys:
        return torch.zeros(t, n, d, dtype=q_nd.dtype), torch.full(
            (t, n), float("-inf"), dtype=q_nd.dtype
        )
    scores = torch.einsum("tnd,knd->tnk", q_nd, k_knd[keys])
    return torch.einsum("tnk,knd->tnd", scores.softmax(-1), v_knd[keys]), scores.logsumexp(-1)


def _inputs(seed: int, t: int = 5, num_keys: int = 12, n: int = 3, d: int = 4):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(shape, generator=gen, dtype=torch.float64) * 3
        for shape in ((t, n, d), (num_keys, n, d), (num_keys, n, d))
    )


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 10_000), pieces=st.lists(st.integers(0, 3), min_size=12, max_size=12))
def test_merging_pieces_in_any_grouping_equals_dense(seed: int, pieces: list[int]) -> None:
    q, k, v = _inputs(seed)
    dense_out, dense_lse = _partial(q, k, v, list(range(12)))
    out, lse = _partial(q, k, v, [])
    for piece in range(4):  # some pieces are empty: lse = -inf must merge as nothing
        part_out, part_lse = _partial(q, k, v, [i for i, p in enumerate(pieces) if p == piece])
        out, lse = merge(out, lse, part_out, part_lse)
    assert torch.allclose(out, dense_out, rtol=0, atol=1e-12)
    assert torch.allclose(lse, dense_lse, rtol=0, atol=1e-12)


def test_fully_masked_pieces_give_zero_not_nan() -> None:
    q, k, v = _inputs(1)
    empty_out, empty_lse = _partial(q, k, v, [])
    out, lse = merge(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    some_out, some_lse = _partial(q, k, v, [0, 3])
    out, lse = merge(some_out, some_lse, empty_out, empty_lse)
    assert torch.equal(out, some_out) and torch.equal(lse, some_lse)


def test_large_scores_do_not_overflow() -> None:
    q, k, v = _inputs(2)
    q = q * 1e3  # scores around 1e4: exp() overflows without the running maximum
    dense_out, dense_lse = _partial(q, k, v, list(range(12)))
    out, lse = merge(*_partial(q, k, v, list(range(6))), *_partial(q, k, v, list(range(6, 12))))
    assert torch.isfinite(out).all()
    assert torch.allclose(out, dense_out, atol=1e-9) and torch.allclose(lse, dense_lse, rtol=1e-12)


def test_merge_rows_with_repeated_rows_equals_dense() -> None:
    q, k, v = _inputs(3, t=4)
    dense_out, dense_lse = _partial(q, k, v, list(range(12)))
    # Start from keys 0..3 for every row, then scatter pieces covering 4..11; rows repeat.
    out, lse = _partial(q, k, v, [0, 1, 2, 3])
    rows, part_outs, part_lses = [], [], []
    for keys in ([4, 5], [6, 7, 8], [9, 10, 11]):
        piece_out, piece_lse = _partial(q, k, v, keys)
        rows.append(torch.arange(4))
        part_outs.append(piece_out)
        part_lses.append(piece_lse)
    rows_t, part_out, part_lse = torch.cat(rows), torch.cat(part_outs), torch.cat(part_lses)
    new_out, new_lse = merge_rows(out, lse, rows_t, part_out, part_lse)
    assert torch.allclose(new_out, dense_out, atol=1e-12)
    assert torch.allclose(new_lse, dense_lse, atol=1e-12)
    in_place_out, in_place_lse = out.clone(), lse.clone()
    merge_rows_(in_place_out, in_place_lse, rows_t, part_out, part_lse, unique=False)
    assert torch.allclose(in_place_out, dense_out, atol=1e-12)
    assert torch.allclose(in_place_lse, dense_lse, atol=1e-12)


def test_merge_rows_leaves_unnamed_rows_alone() -> None:
    q, k, v = _inputs(4, t=6)
    out, lse = _partial(q, k, v, [0, 1])
    part_out, part_lse = _partial(q[[1, 4]], k, v, [2, 3])
    new_out, new_lse = out.clone(), lse.clone()
    merge_rows_(new_out, new_lse, torch.tensor([1, 4]), part_out, part_lse, unique=True)
    untouched = [0, 2, 3, 5]
    assert torch.equal(new_out[untouched], out[untouched])
    assert torch.equal(new_lse[untouched], lse[untouched])
    expected_out, expected_lse = _partial(q, k, v, [0, 1, 2, 3])
    assert torch.allclose(new_out[[1, 4]], expected_out[[1, 4]], atol=1e-12)
    assert torch.allclose(new_lse[[1, 4]], expected_lse[[1, 4]], atol=1e-12)


def test_merge_rejects_mismatched_pieces() -> None:
    q, k, v = _inputs(5)
    out, lse = _partial(q, k, v, [0])
    try:
        merge(out, lse, out[:2], lse[:2])
    except ValueError as exc:
        assert "same query rows" in str(exc)
    else:
        raise AssertionError("merging pieces of different rows must raise")


def test_merge_rows_on_a_slice_merges_in_place_and_leaves_other_rows() -> None:
    q, k, v = _inputs(6, t=7)
    out, lse = _partial(q, k, v, [0, 1, 2])
    part_out, part_lse = _partial(q[2:5], k, v, [3, 4, 5])
    new_out, new_lse = out.clone(), lse.clone()
    merge_rows_(new_out, new_lse, slice(2, 5), part_out, part_lse, unique=True)
    untouched = [0, 1, 5, 6]
    assert torch.equal(new_out[untouched], out[untouched])
    assert torch.equal(new_lse[untouched], lse[untouched])
    expected_out, expected_lse = _partial(q, k, v, [0, 1, 2, 3, 4, 5])
    assert torch.allclose(new_out[2:5], expected_out[2:5], atol=1e-12)
    assert torch.allclose(new_lse[2:5], expected_lse[2:5], atol=1e-12)
    # ``None`` (every row) takes the same in-place path; a piece of other rows is refused.
    whole_out, whole_lse = out.clone(), lse.clone()
    merge_rows_(whole_out, whole_lse, None, *_partial(q, k, v, [3, 4, 5]), unique=True)
    assert torch.allclose(whole_out, expected_out, atol=1e-12)
    with pytest.raises(ValueError, match="cover the rows"):
        merge_rows_(whole_out, whole_lse, slice(0, 2), part_out, part_lse, unique=True)
