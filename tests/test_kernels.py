"""Tier: pure (CPU), plus gpu-marked tests comparing the CUDA kernels with the torch kernel.

The torch varlen kernel against the dense float64 reference: causal documents, grouped-query
attention, pairs cut into many tiles, one-token documents, unmasked and bottom-right causal
pairs of unequal sizes, rows that see no key at all, and whole tiles that skip every mask.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from megatron_zeppelin.attention.kernels import kernels as kernel_registry
from megatron_zeppelin.attention.kernels.kernel_api import VarlenBatch
from megatron_zeppelin.attention.kernels.kernel_torch import TorchKernel, _tile_chunks
from megatron_zeppelin.attention.kernels.kernels import (
    CUDA_KERNELS,
    choose_kernel,
    flash_available,
    get_kernel,
    register_kernel,
)
from megatron_zeppelin.testing.kernel_check import BLOCKS, kernel_errors, kernels_errors
from megatron_zeppelin.testing.reference import pair_attention, random_qkv, reference_attention
from megatron_zeppelin.testing.tolerances import assert_close, tolerance


@pytest.mark.pure
@pytest.mark.parametrize("block_size", [8, 128])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)])
def test_causal_documents_match_reference(block_size: int, heads: tuple[int, int]) -> None:
    lengths = [1, 7, 33, 1, 100, 16]
    nq, nkv = heads
    q, k, v = random_qkv(
        sum(lengths), num_heads=nq, num_kv_heads=nkv, head_dim=8, seed=1, requires_grad=True
    )
    kernel = TorchKernel(block_size=block_size)
    batch = VarlenBatch(lengths, lengths, causal=True)
    scale = 1 / math.sqrt(8)
    out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), batch, softmax_scale=scale)
    ref, ref_lse = reference_attention(q, k, v, lengths, return_lse=True)
    assert_close(out, ref, dtype=torch.float64, name="out")
    assert_close(lse, ref_lse, dtype=torch.float64, name="lse")
    dout = torch.randn_like(ref)
    ref.backward(dout)
    dq, dk, dv = kernel.backward(
        dout, q.detach(), k.detach(), v.detach(), out, lse, batch, softmax_scale=scale
    )
    for name, got, want in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        assert_close(got, want, dtype=torch.float64, name=name)


@pytest.mark.pure
@pytest.mark.parametrize("causal", [True, False])
def test_unequal_pairs_match_dense(causal: bool) -> None:
    # Causal pairs with more keys than queries (a chunk against its prefix), with fewer keys
    # (first queries see nothing), and single rows.
    lengths_q, lengths_k = [5, 20, 1, 9, 30], [12, 20, 4, 3, 70]
    q, _, _ = random_qkv(sum(lengths_q), num_heads=4, num_kv_heads=2, head_dim=4, seed=2)
    _, k, v = random_qkv(sum(lengths_k), num_heads=4, num_kv_heads=2, head_dim=4, seed=3)
    batch = VarlenBatch(lengths_q, lengths_k, causal=causal)
    out, lse = TorchKernel(block_size=8).forward(q, k, v, batch, softmax_scale=0.7)
    want_out, want_lse = pair_attention(
        *(x.double() for x in (q, k, v)), lengths_q, lengths_k, causal=causal, scale=0.7
    )
    assert torch.isfinite(out).all()
    assert_close(out, want_out, dtype=torch.float64, name="out")
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_close(lse[finite], want_lse[finite], dtype=torch.float64, name="lse")
    if causal:  # pair (9 queries, 3 keys): the first 6 queries see no key
        rows = slice(5 + 20 + 1, 5 + 20 + 1 + 6)
        assert torch.isneginf(lse[rows]).all() and torch.equal(
            out[rows], torch.zeros_like(out[rows])
        )


@pytest.mark.pure
def test_rows_without_keys_get_zero_gradients() -> None:
    lengths_q, lengths_k = [6], [2]  # causal: queries 0..3 see nothing, 4 sees one key
    q, _, _ = random_qkv(6, num_heads=2, head_dim=4, seed=4)
    _, k, v = random_qkv(2, num_heads=2, head_dim=4, seed=5)
    batch = VarlenBatch(lengths_q, lengths_k, causal=True)
    kernel = TorchKernel(block_size=8)
    out, lse = kernel.forward(q, k, v, batch, softmax_scale=0.5)
    dq, dk, dv = kernel.backward(torch.ones_like(out), q, k, v, out, lse, batch, softmax_scale=0.5)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.equal(dq[:4], torch.zeros_like(dq[:4]))
    assert dq[4:].abs().sum() > 0


@pytest.mark.pure
@pytest.mark.parametrize("window", [None, 0, 5, 70])
@pytest.mark.parametrize("causal", [True, False])
def test_tiles_cover_every_visible_entry_once(causal: bool, window: int | None) -> None:
    lengths_q, lengths_k = [1, 40, 300, 17], [1, 64, 300, 17]
    batch = VarlenBatch(lengths_q, lengths_k, causal=causal, window=window)
    chunks = _tile_chunks(batch, block_size=32, min_tile=8, tiles_per_chunk=lambda s: 5)
    seen = torch.zeros(batch.total_q, batch.total_k, dtype=torch.int64)
    num_tiles = 0
    for c in chunks:
        assert c.size <= 32  # no score matrix larger than one tile per pair
        for w in range(c.q_start.shape[0]):
            q0, k0, lq, lk = (int(x[w]) for x in (c.q_start, c.k_start, c.q_len, c.k_len))
            i, j = torch.arange(lq).unsqueeze(1), torch.arange(lk).unsqueeze(0)
            visible = (j - i <= int(c.diag[w])) & (j - i >= int(c.low[w]))
            assert visible.any(), "a tile the masks hide entirely was computed"
            seen[q0 : q0 + lq, k0 : k0 + lk] += visible.long()
            num_tiles += 1
    want = torch.zeros_like(seen)
    q0 = k0 = 0
    for lq, lk in zip(lengths_q, lengths_k):
        block = torch.ones(lq, lk, dtype=torch.int64)
        block = block.tril(lk - lq) if causal else block
        if window is not None:
            block = block.triu(lk - lq - window)
        want[q0 : q0 + lq, k0 : k0 + lk] = block
        q0, k0 = q0 + lq, k0 + lk
    assert torch.equal(seen, want)
    if window == 5 and causal:  # a narrow band skips most tiles of the 300 x 300 pair
        assert num_tiles < 60


@pytest.mark.pure
@pytest.mark.parametrize("window", [0, 3, 20, 500])
@pytest.mark.parametrize("causal", [True, False])
def test_windows_match_dense(causal: bool, window: int) -> None:
    # Windows narrower than a tile, a few tiles wide, and wider than every pair (no effect).
    lengths_q, lengths_k = [5, 40, 1, 9, 30], [12, 40, 4, 9, 70]
    q, _, _ = random_qkv(sum(lengths_q), num_heads=4, num_kv_heads=2, head_dim=4, seed=12)
    _, k, v = random_qkv(sum(lengths_k), num_heads=4, num_kv_heads=2, head_dim=4, seed=13)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    batch = VarlenBatch(lengths_q, lengths_k, causal=causal, window=window)
    kernel = TorchKernel(block_size=8)
    out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), batch, softmax_scale=0.7)
    want, want_lse = pair_attention(
        q, k, v, lengths_q, lengths_k, causal=causal, scale=0.7, window=window
    )
    assert_close(out, want.detach(), dtype=torch.float64, name="out")
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_close(lse[finite], want_lse.detach()[finite], dtype=torch.float64, name="lse")
    dout = torch.randn_like(want)
    want.backward(dout)
    grads = kernel.backward(
        dout, q.detach(), k.detach(), v.detach(), out, lse, batch, softmax_scale=0.7
    )
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (q.grad, k.grad, v.grad)):
        assert_close(got, ref, dtype=torch.float64, name=name)
    if window == 500:  # wider than every pair: the same as no window
        plain = VarlenBatch(lengths_q, lengths_k, causal=causal)
        same, _ = kernel.forward(q.detach(), k.detach(), v.detach(), plain, softmax_scale=0.7)
        assert torch.equal(out, same)


@pytest.mark.pure
@pytest.mark.parametrize("causal", [True, False])
def test_whole_tiles_skip_masks_and_match_dense(causal: bool) -> None:
    lengths_q, lengths_k = [64, 40, 96, 5], [64, 72, 96, 9]
    batch = VarlenBatch(lengths_q, lengths_k, causal=causal)
    chunks = _tile_chunks(batch, block_size=32, min_tile=8, tiles_per_chunk=lambda s: 3)
    assert {c.masked for c in chunks} == {True, False}
    for c in (c for c in chunks if not c.masked):  # nothing hidden: padding nor diagonal
        assert (c.q_len == c.size).all() and (c.k_len == c.size).all()
        assert (c.diag >= c.size - 1).all()
    q, _, _ = random_qkv(sum(lengths_q), num_heads=4, num_kv_heads=2, head_dim=4, seed=7)
    _, k, v = random_qkv(sum(lengths_k), num_heads=4, num_kv_heads=2, head_dim=4, seed=8)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    kernel = TorchKernel(block_size=32)
    out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), batch, softmax_scale=0.6)
    want, want_lse = pair_attention(
        *(x.double() for x in (q, k, v)), lengths_q, lengths_k, causal=causal, scale=0.6
    )
    assert_close(out, want.detach(), dtype=torch.float64, name="out")
    finite = torch.isfinite(want_lse)
    assert_close(lse[finite], want_lse.detach()[finite], dtype=torch.float64, name="lse")
    dout = torch.randn_like(want)
    want.backward(dout)
    grads = kernel.backward(
        dout, q.detach(), k.detach(), v.detach(), out, lse, batch, softmax_scale=0.6
    )
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (q.grad, k.grad, v.grad)):
        assert_close(got, ref, dtype=torch.float64, name=name)


@pytest.mark.pure
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_accumulate_in_float32(dtype: torch.dtype) -> None:
    lengths = [3, 50, 20]
    q, k, v = random_qkv(sum(lengths), num_heads=4, num_kv_heads=2, head_dim=16, seed=6)
    batch = VarlenBatch(lengths, lengths, causal=True)
    out, lse = TorchKernel(block_size=16).forward(
        q.to(dtype), k.to(dtype), v.to(dtype), batch, softmax_scale=0.25
    )
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref = reference_attention(q.to(dtype), k.to(dtype), v.to(dtype), lengths, softmax_scale=0.25)
    assert_close(out, ref, dtype=dtype, name="out")


@pytest.mark.pure
def test_registry_resolves_and_rejects(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel registered here leaves with the test: the registry is the process's, and
    # another test in this worker lists every registered kernel.
    for table in ("_FACTORIES", "_UNAVAILABLE", "_INSTANCES", "_AUTO"):
        monkeypatch.setattr(kernel_registry, table, dict(getattr(kernel_registry, table)))
    assert get_kernel("auto", device="cpu", dtype=torch.bfloat16).name == "torch"
    assert get_kernel("torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention kernel"):
        get_kernel("no-such-kernel")
    with pytest.raises(ValueError, match="reserved"):
        register_kernel("auto", TorchKernel)
    register_kernel("torch-small-tiles", lambda: TorchKernel(block_size=8))
    assert get_kernel("torch-small-tiles").block_size == 8
    if not flash_available():
        with pytest.raises(ValueError, match="flash-attn"):
            get_kernel("flash")


@pytest.mark.pure
def test_batch_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError):
        VarlenBatch([1, 2], [1], causal=True)
    with pytest.raises(ValueError):
        VarlenBatch([0], [1], causal=True)
    with pytest.raises(ValueError, match="negative"):
        VarlenBatch([1], [1], causal=True, window=-1)
    assert VarlenBatch([1], [1], causal=True, window=4).window_size == (4, 0)
    assert VarlenBatch([1], [1], causal=False).window_size == (-1, -1)
    kernel = TorchKernel()
    q, k, v = random_qkv(4, num_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="needs 5 query rows"):
        kernel.forward(q, k, v, VarlenBatch([5], [4], causal=True), softmax_scale=1.0)


@pytest.mark.pure
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_kernel_check_passes_the_tiled_kernel_and_catches_a_wrong_one(block: str) -> None:
    class OffByOneScale(TorchKernel):
        def forward(self, q, k, v, batch, *, softmax_scale):  # noqa: ANN001, ANN202
            return super().forward(q, k, v, batch, softmax_scale=softmax_scale * 1.01)

    # Fewer heads than on a GPU (float64 on a CPU), still two query heads per K/V head.
    case = replace(BLOCKS[block], num_heads=4, num_kv_heads=2, head_dim=16)
    errors, wrong = kernels_errors(
        [TorchKernel(block_size=64), OffByOneScale()], case, device="cpu", dtype=torch.float64
    )
    assert max(errors.values()) < 1e-10, errors
    assert wrong["out"] > 1e-4 and wrong["lse"] > 1e-4, wrong


def _cuda_kernel_or_skip(name: str):  # noqa: ANN202
    try:
        choose_kernel(name, device="cuda", dtype=torch.bfloat16)
    except ValueError as exc:
        pytest.skip(str(exc))
    return get_kernel(name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", [*CUDA_KERNELS, "torch"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_cuda_kernels_match_float64(name: str, head_dim: int, block: str) -> None:
    """Each kernel on CUDA in bfloat16 against dense float64 attention on the same rounded
    inputs: grouped-query K/V, head dims 64 and 128, diagonal, suffix and off-diagonal blocks,
    output, log-sum-exp and the three gradients."""
    kernel = _cuda_kernel_or_skip(name) if name != "torch" else TorchKernel()
    errors = kernel_errors(
        kernel,
        BLOCKS[block].with_head_dim(head_dim),
        device="cuda",
        dtype=torch.bfloat16,
        seed=head_dim,
    )
    for what, err in errors.items():
        tol = tolerance(torch.float32 if what == "lse" else torch.bfloat16)
        assert err <= tol, f"{name} {block} d={head_dim}: {what} error {err:.2e} > {tol:.0e}"
