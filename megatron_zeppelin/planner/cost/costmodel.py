"""Cost model: seconds for attention blocks, linear modules and transfers, per layer.

Defaults come from FLOP counts and datasheet figures (``Topology``), scaled by kernel-efficiency
curves (``Efficiency``): a kernel on blocks of ``n`` query tokens reaches
``peak / (1 + half_tokens / n + n / fall_tokens)`` FLOP/s, so short chunks run less efficiently
than long ones and, where a calibration measured it, very large blocks lose rate again (tiles
that no longer fit in cache). A calibration file (``calibration.py``) replaces any of these
figures with measurements; ``sources`` records which is which.

Attention has two curves because kernels treat the two block kinds of ring attention
differently: ``attention`` for unmasked blocks (every key visible: a ring step's block of
earlier keys) and ``attention_diagonal`` for blocks cut by the causal diagonal (a whole document,
a ring document's own block), whose masked tiles cost work that produces no pair. Without a
calibration of its own the diagonal curve is the unmasked one.

Transfers: ``nvlink`` and ``nic`` are point-to-point links; ``alltoall`` is the remapping
layer's collective, priced per rank by the bytes one rank sends in total.

All times are for one transformer layer, forward plus backward; a step multiplies by
``model.num_layers``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from megatron_zeppelin.planner.cost.models import ATTN_BWD_OVER_FWD, ModelSpec
from megatron_zeppelin.topology.model import Topology

Link = Literal["nvlink", "nic", "alltoall"]

FWD_SHARE = 1.0 / (1.0 + ATTN_BWD_OVER_FWD)
"""The forward pass's share of a block's fwd+bwd attention time: a ring step's forward hides
its K/V transfer behind this share of the block's compute, the backward its K/V and dK/dV
behind the rest."""


def causal_pairs(q_start: int, q_end: int, k_start: int, k_end: int) -> int:
    """Number of (query, key) pairs with ``key <= query`` for query positions ``[q_start,
    q_end)`` and key positions ``[k_start, k_end)`` of one causal document."""
    if q_end <= q_start or k_end <= k_start:
        return 0
    # For query q the visible keys are [k_start, min(k_end, q + 1)).
    lo = max(q_start, k_start)  # first query that sees any key
    if lo >= q_end:
        return 0
    full_from = max(lo, k_end - 1)  # queries >= this see every key
    total = 0
    partial_end = min(q_end, full_from)
    if partial_end > lo:  # queries lo..partial_end-1 see (q - k_start + 1) keys
        n = partial_end - lo
        first = lo - k_start + 1
        total += n * first + n * (n - 1) // 2
    if q_end > full_from:
        total += (q_end - max(full_from, lo)) * (k_end - k_start)
    return total


@dataclass(frozen=True)
class Efficiency:
    """Achieved FLOP rate of a kernel on blocks of ``n`` tokens in a call of ``N`` tokens:
    ``flops_per_s / (1 + half_tokens / n + N / fall_tokens)``.

    ``half_tokens`` is where a short block reaches half the peak (launch, tile padding);
    ``fall_tokens`` (``None``: never) models calls so large that the rate falls again: a call's
    working set (its tiles, scores and gradients) outgrows the caches and the kernel turns
    memory-bound. ``N`` is the query count of the whole call, the same as ``n`` for a call of
    one block; a varlen call packing many short blocks runs each at its own ``n`` but streams
    through the cache as one. Without the fall term the rate is ``flops_per_s * n / (n +
    half_tokens)``; with it the best single-block rate lies at ``n = sqrt(half_tokens *
    fall_tokens)``. The form stays linear in ``1 / flops_per_s``, ``half_tokens / flops_per_s``
    and ``1 / (flops_per_s * fall_tokens)``, which is what makes it a least-squares fit.
    """

    flops_per_s: float
    half_tokens: float
    overhead_s: float = 0.0
    """Fixed cost of one kernel call (launch, setup)."""
    fall_tokens: float | None = None

    def __post_init__(self) -> None:
        if not self.flops_per_s > 0 or self.half_tokens < 0 or self.overhead_s < 0:
            raise ValueError(
                f"an efficiency needs flops_per_s > 0, half_tokens >= 0 and overhead_s >= 0, "
                f"got {self.flops_per_s}, {self.half_tokens}, {self.overhead_s}"
            )
        if self.fall_tokens is not None and not self.fall_tokens > 0:
            raise ValueError(f"fall_tokens must be positive or None, got {self.fall_tokens}")

    def rate(self, num_tokens: float, call_tokens: float | None = None) -> float:
        """FLOP/s reached on blocks of ``num_tokens`` tokens in a call of ``call_tokens``
        (default: the block alone), overhead aside."""
        slowdown = 1.0 + self.half_tokens / num_tokens
        if self.fall_tokens is not None:
            slowdown += (call_tokens or num_tokens) / self.fall_tokens
        return self.flops_per_s / slowdown

    def busy_seconds(
        self, flops: np.ndarray, num_tokens: np.ndarray, call_tokens: np.ndarray | None = None
    ) -> np.ndarray:
        """``rate`` elementwise: seconds of ``flops`` on blocks of ``num_tokens`` tokens (in calls
        of ``call_tokens``), overhead aside; zero where there is nothing to compute."""
        num_tokens = np.asarray(num_tokens, dtype=np.float64)
        safe = np.maximum(num_tokens, 1e-300)
        slowdown = 1.0 + self.half_tokens / safe
        if self.fall_tokens is not None:
            calls = num_tokens if call_tokens is None else np.asarray(call_tokens)
            slowdown = slowdown + calls / self.fall_tokens
        busy = (np.asarray(flops, dtype=np.float64) > 0) & (num_tokens > 0)
        return np.where(busy, flops * slowdown / self.flops_per_s, 0.0)

    def time(self, flops: float, num_tokens: int, *, call_tokens: int | None = None) -> float:
        """Seconds of one call doing ``flops`` on blocks of ``num_tokens`` tokens (``call_tokens``
        in the whole call, when it packs several blocks)."""
        if flops <= 0 or num_tokens <= 0:
            return 0.0
        return self.overhead_s + flops / self.rate(num_tokens, call_tokens)


@dataclass(frozen=True)
class LinkCost:
    """A link's achieved bandwidth (bytes/s, per direction) and per-message latency (s)."""

    bytes_per_s: float
    latency_s: float

    def time(self, num_bytes: float) -> float:
        if num_bytes <= 0:
            return 0.0
        return self.latency_s + num_bytes / self.bytes_per_s


# Datasheet derating: what well-tuned kernels and NCCL reach of the peak figures.
DEFAULT_ATTN_PEAK_FRACTION = 0.55
DEFAULT_ATTN_HALF_TOKENS = 768.0
DEFAULT_LINEAR_PEAK_FRACTION = 0.70
DEFAULT_LINEAR_HALF_TOKENS = 192.0
DEFAULT_KERNEL_OVERHEAD_S = 15e-6
DEFAULT_NVLINK_FRACTION = 0.80
DEFAULT_NVLINK_LATENCY_S = 8e-6
DEFAULT_NIC_FRACTION = 0.85
DEFAULT_NIC_LATENCY_S = 20e-6
# An all-to-all pays one latency per collective plus a rendezvous: a few point-to-point latencies.
DEFAULT_ALLTOALL_LATENCY_HOPS = 4

FIGURES = ("attention", "attention_diagonal", "linear", "nvlink", "nic", "alltoall")
"""The figures a calibration can replace, the keys of ``CostModel.sources``."""


@dataclass(frozen=True)
class CostModel:
    """Per-layer forward+backward costs on one cluster for one model."""

    model: ModelSpec
    topology: Topology
    attention: Efficiency
    linear: Efficiency
    nvlink: LinkCost
    nic: LinkCost
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    """For each figure of ``FIGURES``: ``default`` or the calibration file it was measured in."""
    attention_diagonal: Efficiency | None = None
    """Blocks cut by the causal diagonal; ``None``: priced like ``attention``."""
    alltoall: LinkCost | None = None
    """The remapping all-to-all, per rank; ``None``: derived from ``nvlink`` and ``nic``."""

    @classmethod
    def default(cls, model: ModelSpec, topology: Topology) -> CostModel:
        peak = topology.gpu_flops
        return cls(
            model=model,
            topology=topology,
            attention=Efficiency(
                peak * DEFAULT_ATTN_PEAK_FRACTION,
                DEFAULT_ATTN_HALF_TOKENS,
                DEFAULT_KERNEL_OVERHEAD_S,
            ),
            linear=Efficiency(
                peak * DEFAULT_LINEAR_PEAK_FRACTION,
                DEFAULT_LINEAR_HALF_TOKENS,
                DEFAULT_KERNEL_OVERHEAD_S,
            ),
            nvlink=LinkCost(
                topology.nvlink_bytes_per_s * DEFAULT_NVLINK_FRACTION, DEFAULT_NVLINK_LATENCY_S
            ),
            nic=LinkCost(topology.nic_bytes_per_s * DEFAULT_NIC_FRACTION, DEFAULT_NIC_LATENCY_S),
            sources={k: "default" for k in FIGURES},
        )

    def with_figures(self, source: str, **figures: Efficiency | LinkCost) -> CostModel:
        """A copy with some figures replaced, recording where they came from.

        A figure that follows another while it has none of its own (the diagonal curve follows
        ``attention``, the all-to-all follows the links) records the source it follows.
        """
        unknown = sorted(set(figures) - set(FIGURES))
        if unknown:
            raise ValueError(f"unknown cost figures {unknown}; choose among {list(FIGURES)}")
        sources = dict(self.sources)
        for key in figures:
            sources[key] = source
        if "attention_diagonal" not in figures and self.attention_diagonal is None:
            sources["attention_diagonal"] = sources.get("attention", "default")
        if "alltoall" not in figures and self.alltoall is None:
            links = {sources.get("nvlink", "default"), sources.get("nic", "default")}
            sources["alltoall"] = links.pop() if len(links) == 1 else "derived"
        return replace(self, sources=sources, **figures)

    @property
    def diagonal(self) -> Efficiency:
        """The curve of blocks cut by the causal diagonal."""
        return self.attention_diagonal if self.attention_diagonal is not None else self.attention

    # --- compute ---------------------------------------------------------------------------
    def attention_time(self, num_q: int, num_pairs: int, *, diagonal: bool = False) -> float:
        """One kernel call computing ``num_pairs`` visible (q, k) pairs for ``num_q`` queries;
        ``diagonal``: the block is cut by the causal diagonal, else every key is visible."""
        curve = self.diagonal if diagonal else self.attention
        return curve.time(num_pairs * self.model.attn_flops_per_pair(), num_q)

    def attention_call_time(self, blocks: Iterable[tuple[int, int]], *, diagonal: bool) -> float:
        """One varlen call over ``blocks`` of ``(num_q, pairs)``: each block at the rate of its
        own query count in a call of all the blocks' queries (``Efficiency``), the call overhead
        once (how the engine packs a ring phase)."""
        curve = self.diagonal if diagonal else self.attention
        flops_per_pair = self.model.attn_flops_per_pair()
        blocks = [(num_q, pairs) for num_q, pairs in blocks if pairs > 0 and num_q > 0]
        call_tokens = sum(num_q for num_q, _ in blocks)
        total = sum(pairs * flops_per_pair / curve.rate(q, call_tokens) for q, pairs in blocks)
        return total + curve.overhead_s if total > 0 else 0.0

    def attention_block_time(self, q: tuple[int, int], k: tuple[int, int]) -> float:
        """Query range ``q`` against key range ``k`` of one causal document; the diagonal curve
        when the keys reach past the first query (some of the block is masked)."""
        pairs = causal_pairs(q[0], q[1], k[0], k[1])
        return self.attention_time(q[1] - q[0], pairs, diagonal=k[1] > q[0] + 1)

    def document_attention_time(self, length: int) -> float:
        """A whole causal document on one GPU."""
        return self.attention_block_time((0, length), (0, length))

    def linear_time(self, num_tokens: int) -> float:
        """QKV, projection and MLP GEMMs of one layer for ``num_tokens`` tokens."""
        return self.linear.time(num_tokens * self.model.linear_flops_per_token(), num_tokens)

    def linear_times(self, num_tokens: np.ndarray) -> np.ndarray:
        """``linear_time`` elementwise."""
        num_tokens = np.asarray(num_tokens, dtype=np.float64)
        flops = num_tokens * self.model.linear_flops_per_token()
        busy = self.linear.busy_seconds(flops, num_tokens)
        return np.where(busy > 0, busy + self.linear.overhead_s, 0.0)

    # --- communication ---------------------------------------------------------------------
    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of one ring message (K and V of ``num_tokens`` tokens, one layer)."""
        return num_tokens * self.model.kv_bytes_per_token()

    def remap_bytes(self, num_tokens: int) -> int:
        """Bytes the remapping all-to-all moves for ``num_tokens`` tokens, one layer, forward."""
        return num_tokens * self.model.hidden_bytes_per_token()

    def link(self, kind: Link) -> LinkCost:
        if kind == "alltoall":
            return self.alltoall_link()
        return self.nvlink if kind == "nvlink" else self.nic

    def transfer_time(self, num_bytes: float, kind: Link) -> float:
        return self.link(kind).time(num_bytes)

    def alltoall_link(self) -> LinkCost:
        """The all-to-all figure: measured, or derived from the point-to-point links. A rank's
        bytes leave over its NIC when the world spans nodes (the slower share dominates),
        over NVLink otherwise; a collective pays a few latencies of its slowest link."""
        if self.alltoall is not None:
            return self.alltoall
        slow = self.nic if self.topology.num_nodes > 1 else self.nvlink
        return LinkCost(slow.bytes_per_s, DEFAULT_ALLTOALL_LATENCY_HOPS * slow.latency_s)

    def remap_time(self, num_tokens: int) -> float:
        """One remapping all-to-all in which a rank sends ``num_tokens`` tokens' hidden states
        (one layer, one direction); ``simulator`` prices the full matrix per link instead."""
        return self.alltoall_link().time(self.remap_bytes(num_tokens))
