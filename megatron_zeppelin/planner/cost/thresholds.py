"""Tier thresholds and vectorized per-document costs, both from the cost model.

A document of length ``L`` split over a ring of ``g`` ranks gives each rank ``c = L/g`` query
tokens (two zigzag chunks). Each of the ``g - 1`` off-diagonal ring steps computes those ``c``
queries against one incoming K/V block of ``c`` keys, about ``c*c/2`` causal pairs with zigzag,
while the next block (``c`` tokens of K and V) travels. The split pays only when that compute
hides the transfer:

    fwd_share * attention_time(c, c*c/2) >= transfer_time(kv_bytes(c), link)
    bwd_share * attention_time(c, c*c/2) >= transfer_time(2 * kv_bytes(c), link)

(the forward step moves K/V while computing the block's forward; the backward step moves K/V
and dK/dV while computing its backward, ``ATTN_BWD_OVER_FWD`` times the forward.)

Compute grows like ``c^2`` and the transfer like ``c``, so there is one crossing point ``c*`` per
link: the *chunk threshold*. The smallest ring (two ranks) splits a document of ``2 c*`` tokens,
which is the *tier threshold*: documents shorter than the NVLink threshold stay whole on one GPU,
documents shorter than the NIC threshold stay inside one node, unless capacity forces a split.
The compute side leaves out the kernel's fixed per-call cost (launches overlap the transfer they
wait for); the transfer keeps the link's latency. NICs are slower than NVLink, so their
threshold is larger; ``tier_thresholds`` enforces that order even for a calibration where it
would not hold.
"""

from __future__ import annotations

import numpy as np

from megatron_zeppelin.planner.cost.costmodel import FWD_SHARE, CostModel, Link

_MAX_CHUNK = 1 << 40


def chunk_threshold(cost_model: CostModel, link: Link) -> int:
    """Smallest per-rank chunk (tokens) whose ring-step compute hides its K/V transfer."""

    def hides(c: int) -> bool:
        compute = float(
            attention_costs(cost_model, np.asarray([c]), pairs=c * c / 2, diagonal=False)[0]
        )
        kv = cost_model.kv_bytes(c)
        return compute * FWD_SHARE >= cost_model.transfer_time(kv, link) and compute * (
            1.0 - FWD_SHARE
        ) >= cost_model.transfer_time(2 * kv, link)

    lo, hi = 1, 2
    while not hides(hi):  # exponential search, then bisection: both monotone in c
        lo, hi = hi, hi * 2
        assert hi < _MAX_CHUNK, "attention compute never hides the transfer"
    while lo < hi:
        mid = (lo + hi) // 2
        if hides(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def tier_thresholds(cost_model: CostModel) -> tuple[int, int]:
    """``(intra_node_threshold, inter_node_threshold)`` in tokens: the shortest document worth
    splitting over a two-rank ring on NVLink, and over a ring across NICs."""
    intra = 2 * chunk_threshold(cost_model, "nvlink")
    inter = max(2 * chunk_threshold(cost_model, "nic"), intra + 1)
    return intra, inter


def attention_costs(
    cost_model: CostModel,
    lengths: np.ndarray,
    *,
    pairs: float | np.ndarray | None = None,
    diagonal: bool = True,
) -> np.ndarray:
    """Seconds of causal attention per document (one layer, fwd+bwd; ``pairs`` defaults to the
    whole document's) without the per-call overhead: a varlen kernel serves many documents, and
    a ring step's launch overlaps the transfer it waits for. A whole document is a block cut by
    the causal diagonal (``diagonal=True``); a ring's later steps are unmasked blocks."""
    lengths = np.asarray(lengths, dtype=np.float64)
    eff = cost_model.diagonal if diagonal else cost_model.attention
    if pairs is None:
        pairs = lengths * (lengths + 1.0) / 2.0
    flops = pairs * cost_model.model.attn_flops_per_pair()
    return eff.busy_seconds(flops, lengths)


def linear_seconds_per_token(cost_model: CostModel) -> float:
    """Marginal seconds of one more token in a GPU's linear modules (one layer, fwd+bwd): what a
    document's tokens add to its GPU's load besides their attention. With the efficiency curve
    ``peak * n / (n + half)`` a GEMM pass over ``n`` tokens costs ``(n + half) * flops / peak``,
    so every token adds the same ``flops / peak``."""
    return cost_model.model.linear_flops_per_token() / cost_model.linear.flops_per_s
