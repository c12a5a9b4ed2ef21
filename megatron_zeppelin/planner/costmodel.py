"""Cost model: seconds for attention blocks, linear modules and transfers, per layer.

Defaults come from FLOP counts and datasheet figures (``Topology``), scaled by kernel-efficiency
curves: a kernel on ``n`` query tokens reaches ``peak * n / (n + half_tokens)`` of the GPU's peak,
so short chunks run less efficiently than long ones. A calibration file (``calibration.py``)
replaces any of these figures with measurements; ``sources`` records which is which.

All times are for one transformer layer, forward plus backward; a step multiplies by
``model.num_layers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from megatron_zeppelin.planner.models import ModelSpec
from megatron_zeppelin.topology.model import Topology

Link = Literal["nvlink", "nic"]


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
    """Achieved FLOP rate of a kernel on ``n`` tokens: ``flops_per_s * n / (n + half_tokens)``."""

    flops_per_s: float
    half_tokens: float
    overhead_s: float = 0.0
    """Fixed cost of one kernel call (launch, setup)."""

    def time(self, flops: float, num_tokens: int) -> float:
        if flops <= 0 or num_tokens <= 0:
            return 0.0
        rate = self.flops_per_s * num_tokens / (num_tokens + self.half_tokens)
        return self.overhead_s + flops / rate


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
    """For each figure (``attention``, ``linear``, ``nvlink``, ``nic``): ``default`` or the
    calibration file it was measured in."""

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
            sources={k: "default" for k in ("attention", "linear", "nvlink", "nic")},
        )

    def with_figures(self, source: str, **figures: Efficiency | LinkCost) -> CostModel:
        """A copy with some figures replaced, recording where they came from."""
        sources = dict(self.sources)
        for key in figures:
            sources[key] = source
        return replace(self, sources=sources, **figures)

    # --- compute ---------------------------------------------------------------------------
    def attention_time(self, num_q: int, num_pairs: int) -> float:
        """One kernel call computing ``num_pairs`` causal (q, k) pairs for ``num_q`` queries."""
        return self.attention.time(num_pairs * self.model.attn_flops_per_pair(), num_q)

    def attention_block_time(self, q: tuple[int, int], k: tuple[int, int]) -> float:
        """Query range ``q`` against key range ``k`` of one causal document."""
        return self.attention_time(q[1] - q[0], causal_pairs(q[0], q[1], k[0], k[1]))

    def document_attention_time(self, length: int) -> float:
        """A whole causal document on one GPU."""
        return self.attention_block_time((0, length), (0, length))

    def linear_time(self, num_tokens: int) -> float:
        """QKV, projection and MLP GEMMs of one layer for ``num_tokens`` tokens."""
        return self.linear.time(num_tokens * self.model.linear_flops_per_token(), num_tokens)

    # --- communication ---------------------------------------------------------------------
    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of one ring message (K and V of ``num_tokens`` tokens, one layer)."""
        return num_tokens * self.model.kv_bytes_per_token()

    def remap_bytes(self, num_tokens: int) -> int:
        """Bytes the remapping all-to-all moves for ``num_tokens`` tokens, one layer, forward."""
        return num_tokens * self.model.hidden_bytes_per_token()

    def link(self, kind: Link) -> LinkCost:
        return self.nvlink if kind == "nvlink" else self.nic

    def transfer_time(self, num_bytes: float, kind: Link) -> float:
        return self.link(kind).time(num_bytes)
