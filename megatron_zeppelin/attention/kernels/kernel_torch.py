"""The tiled PyTorch kernel (``"torch"``): runs everywhere, CPU included.

It cuts every pair of a ``VarlenBatch`` into square tiles (at most ``block_size`` per side,
smaller for short pairs so one-token documents are not padded to 128) and runs many tiles per
batched matmul, so no ``L x L`` score matrix of a long document is ever built; tiles of one query
block are merged with the online softmax. Half-precision inputs are computed with float32
accumulation; float64 stays float64. On CUDA it runs on the caller's current stream. It honours
a call's window (``supports_window``): tiles wholly before a query tile's window are skipped,
tiles cut by its edge masked like the causal diagonal.

Interface and shapes: ``kernel_api.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from megatron_zeppelin.attention.kernels.kernel_api import VarlenBatch, check_shapes, compute_dtype
from megatron_zeppelin.attention.merge import merge_rows_
from megatron_zeppelin.devices import to_device

__all__ = ["TorchKernel"]

_UNMASKED = 1 << 40  # a diagonal offset no tile reaches: "no causal mask"


class _TileChunk:
    """Square tiles of side ``size`` processed in one batched matmul: per tile, its first query
    and key row, how many of its rows are real, and its two diagonal offsets: key ``j`` is
    visible to query ``i`` of the tile when ``low <= j - i <= diag`` (``low`` from a window).
    ``masked``: some tile hides an entry (padding, the causal diagonal or the window's edge);
    chunks of full, unmasked tiles skip every mask. ``groups``: the distinct query rows the
    tiles gather and each gathered row's place among them, for the merge (found once here, not
    on the device at every call)."""

    def __init__(  # noqa: ANN001
        self, size: int, q_start, q_len, k_start, k_len, diag, low, masked: bool, groups=None
    ) -> None:
        self.size, self.q_start, self.q_len = size, q_start, q_len
        self.k_start, self.k_len, self.diag, self.low = k_start, k_len, diag, low
        self.masked = masked
        self.groups = groups

    def with_groups(self, total_q: int) -> _TileChunk:
        """This chunk with ``groups`` for a call of ``total_q`` query rows (host arrays)."""
        rows = np.minimum(self.q_start[:, None] + np.arange(self.size), total_q - 1)
        touched, inverse = np.unique(rows.reshape(-1), return_inverse=True)
        arrays = (self.q_start, self.q_len, self.k_start, self.k_len, self.diag, self.low)
        return _TileChunk(self.size, *arrays, self.masked, (touched, inverse.reshape(-1)))

    def to(self, device: torch.device) -> _TileChunk:
        move = lambda x: to_device(x, device)  # noqa: E731
        arrays = (self.q_start, self.q_len, self.k_start, self.k_len, self.diag, self.low)
        groups = tuple(map(move, self.groups)) if self.groups is not None else None
        return _TileChunk(self.size, *map(move, arrays), self.masked, groups)


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return (a + b - 1) // b


def _ranks_within(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``counts`` items per owner: each item's owner and its index within the owner."""
    owner = np.repeat(np.arange(counts.shape[0]), counts)
    first = np.cumsum(counts) - counts
    return owner, np.arange(owner.shape[0]) - first[owner]


def _tile_chunks(
    batch: VarlenBatch, *, block_size: int, min_tile: int, tiles_per_chunk: Callable[[int], int]
) -> list[_TileChunk]:
    """Every (query tile, key tile) a call must compute, skipping tiles the mask hides."""
    lq, lk = batch.lengths_q, batch.lengths_k
    sizes = [min_tile]
    while sizes[-1] < block_size:
        sizes.append(min(2 * sizes[-1], block_size))
    sizes_np = np.asarray(sizes)
    side = sizes_np[np.searchsorted(sizes_np, np.maximum(lq, lk)).clip(max=len(sizes) - 1)]
    chunks = []
    for size in sorted(set(side.tolist())):
        pairs = np.flatnonzero(side == size)
        p_lq, p_lk = lq[pairs], lk[pairs]
        # Key j of a pair is visible to query i when i + low_offset <= j <= i + offset
        # (bottom-right aligned, both bounds).
        offset = p_lk - p_lq if batch.causal else np.full_like(p_lq, _UNMASKED)
        if batch.window is None:
            low_offset = np.full_like(p_lq, -_UNMASKED)
        else:
            low_offset = p_lk - p_lq - batch.window
        tile_pair, tile_index = _ranks_within(_ceil_div(p_lq, size))
        q_lo = tile_index * size
        q_len = np.minimum(p_lq[tile_pair] - q_lo, size)
        # Keys seen by the tile's last query bound the key tiles it needs from above, the
        # first query's window from below.
        seen = np.minimum((q_lo + q_len + offset[tile_pair]).clip(min=0), p_lk[tile_pair])
        first = (q_lo + low_offset[tile_pair]).clip(min=0) // size
        work_tile, k_index = _ranks_within((_ceil_div(seen, size) - first).clip(min=0))
        work_pair = tile_pair[work_tile]
        k_lo = (k_index + first[work_tile]) * size
        q_start = batch.cu_seqlens_q[pairs][work_pair] + q_lo[work_tile]
        k_start = batch.cu_seqlens_k[pairs][work_pair] + k_lo
        k_len = np.minimum(p_lk[work_pair] - k_lo, size)
        diag = q_lo[work_tile] + offset[work_pair] - k_lo
        low = q_lo[work_tile] + low_offset[work_pair] - k_lo
        work_q_len = q_len[work_tile]
        # Full tiles the mask leaves whole (the bulk of an unmasked pair) go to chunks of their
        # own, which skip building and applying masks: a fifth of a tile's work.
        whole = (work_q_len == size) & (k_len == size) & (diag >= size - 1) & (low <= 1 - size)
        step = tiles_per_chunk(size)
        fields = (q_start, work_q_len, k_start, k_len, diag, low)
        for masked in (False, True):
            tiles = np.flatnonzero(whole != masked)
            for lo in range(0, tiles.shape[0], step):
                part = tiles[lo : lo + step]
                chunks.append(_TileChunk(size, *(f[part] for f in fields), masked))
    return chunks


class TorchKernel:
    """Tiled PyTorch attention; see the module docstring."""

    name = "torch"
    supports_window = True

    def __init__(
        self, *, block_size: int = 128, min_tile: int = 8, max_tile_elements: int = 1 << 22
    ) -> None:
        if block_size < min_tile or min_tile < 1:
            raise ValueError("block_size must be at least min_tile, and min_tile at least 1")
        self.block_size = block_size
        self.min_tile = min_tile
        self.max_tile_elements = max_tile_elements

    def _chunks(self, batch: VarlenBatch, num_heads: int, device: torch.device) -> list[_TileChunk]:
        key = ("torch-tiles", self.block_size, self.min_tile, num_heads, str(device))
        if key not in batch.cache:
            budget = self.max_tile_elements // num_heads
            chunks = _tile_chunks(
                batch,
                block_size=self.block_size,
                min_tile=self.min_tile,
                tiles_per_chunk=lambda size: max(1, budget // (size * size)),
            )
            batch.cache[key] = [c.with_groups(batch.total_q).to(device) for c in chunks]
        return batch.cache[key]

    @staticmethod
    def _tile(chunk: _TileChunk, total_q: int, total_k: int, pad_rows: bool):
        """Gather indices of a chunk's tiles and the mask of hidden (query, key) entries
        (``None`` for a chunk without hidden entries)."""
        ar = torch.arange(chunk.size, device=chunk.q_start.device)
        rows_q = (chunk.q_start[:, None] + ar).clamp_(max=total_q - 1)
        rows_k = (chunk.k_start[:, None] + ar).clamp_(max=total_k - 1)
        if not chunk.masked:
            return rows_q, rows_k, None, None
        # hidden[w, i, j]: key j is after query i's causal limit, before its window, or a
        # padding key.
        distance = ar[None, None, :] - ar[None, :, None]
        hidden = distance > chunk.diag[:, None, None]
        hidden |= distance < chunk.low[:, None, None]
        hidden |= ar[None, None, :] >= chunk.k_len[:, None, None]
        pad_q = ar[None, :] >= chunk.q_len[:, None]
        if pad_rows:
            hidden |= pad_q[:, :, None]
        return rows_q, rows_k, hidden, pad_q

    def forward(self, q_tnd, k_tnd, v_tnd, batch, *, softmax_scale):  # noqa: ANN001
        """Output (compute dtype) and lse (compute dtype) of every query row of the batch."""
        check_shapes(q_tnd, k_tnd, v_tnd, batch)
        t, nq, d = q_tnd.shape
        nkv = k_tnd.shape[1]
        dtype = compute_dtype(q_tnd.dtype)
        out = torch.zeros((t, nq, d), dtype=dtype, device=q_tnd.device)
        lse = torch.full((t, nq), float("-inf"), dtype=dtype, device=q_tnd.device)
        for chunk in self._chunks(batch, nq, q_tnd.device):
            rows_q, rows_k, hidden, pad_q = self._tile(chunk, t, k_tnd.shape[0], False)
            w, s = rows_q.shape
            q_t = q_tnd[rows_q].to(dtype).view(w, s, nkv, nq // nkv, d)
            k_t, v_t = k_tnd[rows_k].to(dtype), v_tnd[rows_k].to(dtype)
            # In place from here on: the score tiles are the largest tensors of the kernel.
            scores = torch.einsum("wihgd,wjhd->whgij", q_t, k_t).mul_(softmax_scale)
            if hidden is not None:
                scores.masked_fill_(hidden[:, None, None], float("-inf"))
            peak = scores.amax(-1, keepdim=True)
            peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
            probs = scores.sub_(peak).exp_()
            total = probs.sum(-1)
            part = torch.einsum("whgij,wjhd->wihgd", probs, v_t)
            safe = torch.where(total > 0, total, torch.ones_like(total))
            part = part / safe.permute(0, 3, 1, 2).unsqueeze(-1)
            part_lse = (peak.squeeze(-1) + torch.log(total)).permute(0, 3, 1, 2)
            if pad_q is not None:
                # Padding rows alias real rows (clamped gathers): -inf merges them as nothing.
                part_lse = part_lse.masked_fill(pad_q[:, :, None, None], float("-inf"))
                part = part.masked_fill(pad_q[:, :, None, None, None], 0.0)
            merge_rows_(
                out,
                lse,
                rows_q.reshape(-1),
                part.reshape(w * s, nq, d),
                part_lse.reshape(w * s, nq),
                unique=False,
                groups=chunk.groups,
            )
        return out, lse

    def backward(self, dout_tnd, q_tnd, k_tnd, v_tnd, out_tnd, lse_tn, batch, *, softmax_scale):  # noqa: ANN001
        """Gradients (compute dtype) of this batch's pairs, given the FINAL output and lse."""
        check_shapes(q_tnd, k_tnd, v_tnd, batch)
        t, nq, d = q_tnd.shape
        nkv = k_tnd.shape[1]
        group = nq // nkv
        dtype = compute_dtype(q_tnd.dtype)
        dev = q_tnd.device
        # delta_i = sum_j P_ij dP_ij = <dout_i, out_i>: the softmax backward's row term.
        delta = (dout_tnd.to(dtype) * out_tnd.to(dtype)).sum(-1)
        # A row that saw no key has lse -inf and P = 0; +inf keeps exp(score - lse) at 0.
        lse = torch.where(torch.isinf(lse_tn), float("inf"), lse_tn.to(dtype))
        dq = torch.zeros((t, nq, d), dtype=dtype, device=dev)
        dk = torch.zeros(k_tnd.shape, dtype=dtype, device=dev)
        dv = torch.zeros(k_tnd.shape, dtype=dtype, device=dev)
        for chunk in self._chunks(batch, nq, dev):
            # Padding rows alias real rows: masking them keeps their gradients at exactly 0.
            rows_q, rows_k, hidden, _ = self._tile(chunk, t, k_tnd.shape[0], True)
            w, s = rows_q.shape
            q_t = q_tnd[rows_q].to(dtype).view(w, s, nkv, group, d)
            do_t = dout_tnd[rows_q].to(dtype).view(w, s, nkv, group, d)
            k_t, v_t = k_tnd[rows_k].to(dtype), v_tnd[rows_k].to(dtype)
            lse_t = lse[rows_q].view(w, s, nkv, group).permute(0, 2, 3, 1)
            delta_t = delta[rows_q].view(w, s, nkv, group).permute(0, 2, 3, 1)
            # In place from here on: the score tiles are the largest tensors of the kernel.
            scores = torch.einsum("wihgd,wjhd->whgij", q_t, k_t).mul_(softmax_scale)
            if hidden is not None:
                scores.masked_fill_(hidden[:, None, None], float("-inf"))
            probs = scores.sub_(lse_t.unsqueeze(-1)).exp_()
            dv_t = torch.einsum("whgij,wihgd->wjhd", probs, do_t)
            dprobs = torch.einsum("wihgd,wjhd->whgij", do_t, v_t)
            # dS = P * (dP - delta) * scale; the scale is applied to dQ and dK, d values per
            # row instead of one per score.
            dscores = dprobs.sub_(delta_t.unsqueeze(-1)).mul_(probs)
            dq_t = torch.einsum("whgij,wjhd->wihgd", dscores, k_t).mul_(softmax_scale)
            dk_t = torch.einsum("whgij,wihgd->wjhd", dscores, q_t).mul_(softmax_scale)
            dq.index_add_(0, rows_q.reshape(-1), dq_t.reshape(w * s, nq, d))
            dk.index_add_(0, rows_k.reshape(-1), dk_t.reshape(w * s, nkv, d))
            dv.index_add_(0, rows_k.reshape(-1), dv_t.reshape(w * s, nkv, d))
        return dq, dk, dv
