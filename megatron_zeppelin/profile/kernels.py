"""Measured forward and backward time of the engine's attention kernels over a grid of shapes.

The cost model charges one varlen kernel call the FLOPs of its visible (query, key) pairs, each
block at the rate of its own query count, plus one call overhead (``CostModel.
attention_call_time``), on one of two curves. The engine issues two kinds of calls (``attention.
layout``), and the grid measures both, short chunks included:

* **causal** (``num_q == num_k``), fitted into ``attention_diagonal``: compute 0 of every rank,
  the local documents and each ring document's own diagonal block in one call; query ``i``
  sees keys ``0..i``, and the tiles the diagonal cuts cost work that yields no pair;
* **full** (``num_q`` queries against ``num_k`` earlier keys), fitted into ``attention``: every
  later ring step, one unmasked call over the blocks just received.

Full shapes keep the query-to-key ratios the engine produces (1:1, 2:1 and 1:2: a zigzag
rank's two chunks against one chunk, or one chunk against two): the curve is indexed by a
block's query count, and a 1024 x 256 block does not cost per pair what a 1024 x 1024 one does.
Both kinds are measured alone and *packed*: several equal blocks in one varlen call, as the
engine packs a phase's documents. A packed point fits the same curve as a single block (each
block at its own rate, the overhead once), so the packed points enter the fit and tie the
overhead to the per-block cost. Each shape runs through the registry's kernel
(``attention.kernels.kernels.get_kernel``) exactly as the engine calls it: one ``VarlenBatch`` built
once, then ``forward`` and ``backward`` timed apart. On CUDA a dense
``scaled_dot_product_attention`` of each causal length is timed as a reference point.

``kernels_to_measure`` says which kernels a profile measures: the one named, or for ``auto``
every kernel that runs here (on CUDA in fp16/bf16, each CUDA kernel of the registry whose library
is installed and runs on this GPU; elsewhere what ``auto`` picks). Dense SDPA is timed beside the
first of them only: it does not depend on the kernel.

Shape suffixes: ``t`` rows (tokens), ``n`` heads, ``d`` head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_zeppelin.attention.kernels.kernel_api import VarlenBatch
from megatron_zeppelin.attention.kernels.kernels import CUDA_KERNELS, choose_kernel, get_kernel
from megatron_zeppelin.planner.cost.costmodel import causal_pairs
from megatron_zeppelin.planner.cost.models import ModelSpec
from megatron_zeppelin.profile.timing import DEFAULT_TIMING, TimingOptions, median_seconds


@dataclass(frozen=True)
class AttentionGrid:
    """Shapes to measure."""

    causal: tuple[int, ...]
    """Lengths ``L`` of causal ``L x L`` calls."""
    full: tuple[tuple[int, int], ...] = ()
    """``(num_q, num_k)`` of unmasked calls."""
    packed: tuple[tuple[int, int], ...] = ()
    """``(num_documents, length)``: that many causal documents in one call."""
    packed_full: tuple[tuple[int, int, int], ...] = ()
    """``(num_blocks, num_q, num_k)``: that many unmasked blocks in one call."""

    def __post_init__(self) -> None:
        shapes = (*self.full, *self.packed, *self.packed_full)
        sizes = [*self.causal, *(n for shape in shapes for n in shape)]
        if not self.causal and not self.full:
            raise ValueError("an attention grid needs at least one causal or full shape")
        if any(int(n) < 1 for n in sizes):
            raise ValueError(f"attention grid sizes must be >= 1, got {sizes}")
        if len(self.causal) + len(self.full) < 3:
            raise ValueError("give at least 3 causal or full shapes: the fit has three unknowns")

    @classmethod
    def quick(cls) -> AttentionGrid:
        """CPU, about a minute per pass under contention: 16 .. 4K tokens, the blocks and calls
        the engine runs for batches of a few thousand tokens per rank (a call of 4K tokens
        anchors the fall term, which must not be extrapolated far past the largest call)."""
        return cls(
            causal=(16, 64, 256, 512, 1024, 2048, 4096),
            full=(
                (64, 64),
                (256, 128),
                (128, 256),
                (512, 512),
                (1024, 512),
                (512, 1024),
                (1024, 1024),
                (2048, 1024),
            ),
            packed=((16, 64), (8, 256), (4, 512)),
            packed_full=((16, 64, 64), (4, 256, 256), (2, 512, 1024)),
        )

    @classmethod
    def cpu(cls) -> AttentionGrid:
        """CPU, about a minute: 16 .. 4K tokens."""
        return cls(
            causal=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
            full=(
                (16, 1024),
                (64, 64),
                (128, 512),
                (256, 256),
                (512, 2048),
                (1024, 1024),
                (2048, 512),
                (2048, 2048),
            ),
            packed=((64, 16), (16, 64), (4, 1024)),
            packed_full=((16, 64, 64), (4, 256, 512), (2, 1024, 1024)),
        )

    @classmethod
    def gpu(cls) -> AttentionGrid:
        """CUDA: 16 .. 64K tokens."""
        return cls(
            causal=(16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
            full=(
                (64, 4096),
                (256, 256),
                (1024, 1024),
                (1024, 8192),
                (4096, 4096),
                (8192, 1024),
                (8192, 8192),
                (16384, 16384),
            ),
            packed=((256, 64), (64, 256), (16, 1024), (4, 8192)),
            packed_full=((64, 256, 256), (16, 1024, 1024), (4, 4096, 8192)),
        )

    @classmethod
    def named(cls, name: str) -> AttentionGrid:
        grids = {"quick": cls.quick, "cpu": cls.cpu, "gpu": cls.gpu}
        if name not in grids:
            raise ValueError(f"unknown attention grid {name!r}; choose one of {', '.join(grids)}")
        return grids[name]()

    def shapes(self) -> list[tuple[int, int, int, bool]]:
        """``(num_documents, num_q, num_k, causal)`` per call, in measuring order."""
        return (
            [(1, n, n, True) for n in self.causal]
            + [(1, q, k, False) for q, k in self.full]
            + [(d, n, n, True) for d, n in self.packed]
            + [(d, q, k, False) for d, q, k in self.packed_full]
        )


@dataclass(frozen=True)
class AttentionPoint:
    """One measured kernel call."""

    num_docs: int
    num_q: int
    """Query rows per document."""
    num_k: int
    causal: bool
    pairs: int
    """Visible (query, key) pairs of the whole call."""
    flops: float
    """Forward+backward FLOPs the cost model assigns to the call."""
    forward_s: float
    backward_s: float
    sdpa_s: float | None = None
    """Dense SDPA forward+backward of the same causal shape (CUDA only)."""

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def total_q(self) -> int:
        return self.num_docs * self.num_q


def block_pairs(num_q: int, num_k: int, causal: bool) -> int:
    """Visible pairs of one block: causal aligned bottom-right (as the kernels do), or all."""
    if not causal:
        return num_q * num_k
    # Queries are the last num_q positions of num_k keys.
    return causal_pairs(num_k - num_q, num_k, 0, num_k)


def kernels_to_measure(requested: str, *, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The kernels a profile measures for ``requested`` (module docstring)."""
    if requested != "auto":
        return [requested]
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return [choose_kernel("auto", device=device, dtype=dtype)[0]]
    runs = []
    for name in CUDA_KERNELS:
        try:
            choose_kernel(name, device=device, dtype=dtype)
        except ValueError:
            continue
        runs.append(name)
    return runs or ["torch"]


def measure_attention(
    model: ModelSpec,
    *,
    grid: AttentionGrid,
    device: torch.device,
    dtype: torch.dtype,
    kernel: str = "auto",
    timing: TimingOptions = DEFAULT_TIMING,
    before_point: Callable[[], object] | None = None,
    sdpa: bool = True,
) -> list[AttentionPoint]:
    """Time ``kernel`` on every shape of ``grid`` with ``model``'s heads (one tensor-parallel
    shard). ``before_point`` runs untimed before every timed call (a barrier: emulated ranks
    start each call together, so every measurement sees the contention of all ranks busy at
    once, as in a training step). ``sdpa``: time dense SDPA beside the causal shapes (CUDA)."""
    impl = get_kernel(kernel, device=device, dtype=dtype)
    tp = model.tensor_parallel
    num_heads = max(1, model.num_heads // tp)
    num_kv_heads = max(1, model.num_kv_heads // tp)
    head_dim = model.head_dim
    scale = head_dim**-0.5
    points = []
    for num_docs, num_q, num_k, causal in grid.shapes():
        batch = VarlenBatch([num_q] * num_docs, [num_k] * num_docs, causal=causal)
        gen = torch.Generator(device="cpu").manual_seed(num_q * 7919 + num_k)
        q_tnd, dout_tnd = (
            torch.randn(batch.total_q, num_heads, head_dim, generator=gen).to(device, dtype)
            for _ in range(2)
        )
        k_tnd, v_tnd = (
            torch.randn(batch.total_k, num_kv_heads, head_dim, generator=gen).to(device, dtype)
            for _ in range(2)
        )
        call = _KernelCall(impl, batch, q_tnd, k_tnd, v_tnd, dout_tnd, scale=scale)
        forward_s = median_seconds(call.forward, device=device, options=timing, setup=before_point)
        call.keep_forward()
        backward_s = median_seconds(
            call.backward, device=device, options=timing, setup=before_point
        )
        sdpa_s = None
        if sdpa and device.type == "cuda" and causal and num_docs == 1:
            sdpa_s = _dense_sdpa_seconds(q_tnd, k_tnd, v_tnd, device=device, timing=timing)
        pairs = num_docs * block_pairs(num_q, num_k, causal)
        points.append(
            AttentionPoint(
                num_docs=num_docs,
                num_q=num_q,
                num_k=num_k,
                causal=causal,
                pairs=pairs,
                flops=pairs * model.attn_flops_per_pair(),
                forward_s=forward_s,
                backward_s=backward_s,
                sdpa_s=sdpa_s,
            )
        )
    return points


class _KernelCall:
    """One shape's inputs and its forward and backward calls, as the engine makes them."""

    def __init__(self, impl, batch, q_tnd, k_tnd, v_tnd, dout_tnd, *, scale: float) -> None:  # noqa: ANN001
        self.impl, self.batch, self.scale = impl, batch, scale
        self.q_tnd, self.k_tnd, self.v_tnd, self.dout_tnd = q_tnd, k_tnd, v_tnd, dout_tnd
        self.out_tnd: torch.Tensor | None = None
        self.lse_tn: torch.Tensor | None = None

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.impl.forward(
            self.q_tnd, self.k_tnd, self.v_tnd, self.batch, softmax_scale=self.scale
        )

    def keep_forward(self) -> None:
        """Run the forward once more and keep its output and lse for the backward."""
        out_tnd, self.lse_tn = self.forward()
        self.out_tnd = out_tnd.to(self.q_tnd.dtype)

    def backward(self) -> tuple[torch.Tensor, ...]:
        assert self.out_tnd is not None and self.lse_tn is not None, "call keep_forward first"
        return self.impl.backward(
            self.dout_tnd,
            self.q_tnd,
            self.k_tnd,
            self.v_tnd,
            self.out_tnd,
            self.lse_tn,
            self.batch,
            softmax_scale=self.scale,
        )


def _dense_sdpa_seconds(
    q_tnd: torch.Tensor,
    k_tnd: torch.Tensor,
    v_tnd: torch.Tensor,
    *,
    device: torch.device,
    timing: TimingOptions,
) -> float:
    """Forward+backward of PyTorch's fused causal SDPA on one document (reference point)."""
    group = q_tnd.shape[1] // k_tnd.shape[1]
    # SDPA wants (batch, heads, tokens, dim) and equal head counts.
    q = q_tnd.transpose(0, 1).unsqueeze(0).detach().requires_grad_()
    k = k_tnd.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0).detach().requires_grad_()
    v = v_tnd.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0).detach().requires_grad_()

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    return median_seconds(step, device=device, options=timing)


def fit_rows(points: list[AttentionPoint], *, causal: bool | None = None) -> list[tuple]:
    """Rows for ``fit_efficiency``: ``(num_q, flops, seconds)`` with ``num_q`` per block and the
    whole call's FLOPs, and the call's query count as a fourth number for packed calls (module
    docstring); ``causal`` picks one kind."""
    return [
        (p.num_q, p.flops, p.seconds, *((p.total_q,) if p.num_docs > 1 else ()))
        for p in points
        if causal is None or p.causal == causal
    ]
