"""One attention kernel against dense float64 attention, forward and backward.

The cases are the block shapes a ring produces (``attention/layout.py``): a *diagonal* block
(causal, queries and keys of the same rows), a *suffix* block (causal, a chunk's queries against
its own keys and a longer prefix: the mask aligned bottom-right) and an *off-diagonal* block
(unmasked, a later chunk's queries against an earlier chunk's keys, of unequal lengths), and the
two a sliding window adds: a *windowed* block (causal with a left window, the diagonal band) and
a *window-edge* block (square pairs whose query ``i`` sees keys ``j >= i``: unmasked with a left
window of 0). Each case packs several pairs, one-row pairs included, with grouped-query K/V.

``kernel_errors`` draws inputs in the kernel's dtype on the device, computes the reference in
float64 on the same (rounded) inputs, and returns the relative error (``tolerances.py``) of the
output, the log-sum-exp and the three gradients. The GPU tests assert them within the dtype's
tolerance; ``scripts/bench_kernels.py`` prints them. ``kernels_errors`` checks several kernels
against one reference (the CPU test checks a kernel known to be wrong beside the right one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from megatron_zeppelin.attention.kernels.kernel_api import AttentionKernel, VarlenBatch
from megatron_zeppelin.testing.reference import pair_attention
from megatron_zeppelin.testing.tolerances import relative_error

__all__ = ["BLOCKS", "KernelCase", "kernel_errors", "kernels_errors"]


@dataclass(frozen=True)
class KernelCase:
    """A varlen call: per-pair query and key lengths, the mask, and the head shape."""

    block: str
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    causal: bool
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128
    window: int | None = None
    """The call's left window (``kernel_api.VarlenBatch.window``), ``None`` for none."""

    def with_head_dim(self, head_dim: int) -> KernelCase:
        return replace(self, head_dim=head_dim)


BLOCKS: dict[str, KernelCase] = {
    "diagonal": KernelCase("diagonal", (1, 128, 77, 300, 1024), (1, 128, 77, 300, 1024), True),
    "suffix": KernelCase("suffix", (64, 200, 1, 33), (300, 200, 50, 97), True),
    "off-diagonal": KernelCase("off-diagonal", (64, 300, 77, 1), (200, 100, 77, 5), False),
    "windowed": KernelCase("windowed", (1, 128, 300, 64), (1, 228, 300, 64), True, window=100),
    "window-edge": KernelCase("window-edge", (1, 64, 200), (1, 64, 200), False, window=0),
}


def kernel_errors(
    kernel: AttentionKernel,
    case: KernelCase,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
) -> dict[str, float]:
    """Relative errors of ``kernel`` against float64 on ``case``: keys ``out``, ``lse``,
    ``dq``, ``dk``, ``dv``. A NaN anywhere in a result (a row left unwritten in an
    uninitialised buffer, say) makes its error NaN, which fails every comparison."""
    return kernels_errors([kernel], case, device=device, dtype=dtype, seed=seed)[0]


def kernels_errors(
    kernels: Sequence[AttentionKernel],
    case: KernelCase,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
) -> list[dict[str, float]]:
    """``kernel_errors`` of each of ``kernels`` on the same inputs, against one float64
    reference (on a CPU the reference costs more than the kernels)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    nq, nkv, d = case.num_heads, case.num_kv_heads, case.head_dim

    def draw(rows: int, heads: int) -> torch.Tensor:
        return torch.randn(rows, heads, d, generator=gen, device=device).to(dtype)

    q = draw(sum(case.lengths_q), nq)
    k, v = draw(sum(case.lengths_k), nkv), draw(sum(case.lengths_k), nkv)
    dout = draw(q.shape[0], nq)
    scale = 1.0 / math.sqrt(d)
    batch = VarlenBatch(case.lengths_q, case.lengths_k, causal=case.causal, window=case.window)

    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = pair_attention(
        *leaves,
        case.lengths_q,
        case.lengths_k,
        causal=case.causal,
        scale=scale,
        window=case.window,
    )
    ref.backward(dout.double())
    want = {
        "out": ref,
        "lse": ref_lse,
        "dq": leaves[0].grad,
        "dk": leaves[1].grad,
        "dv": leaves[2].grad,
    }
    errors = []
    for kernel in kernels:
        out, lse = kernel.forward(q, k, v, batch, softmax_scale=scale)
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, batch, softmax_scale=scale)
        got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
        errors.append({name: _error(got[name], want[name]) for name in got})
    return errors


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error where the reference is finite; a NaN anywhere in ``actual`` is NaN."""
    if torch.isnan(actual).any():
        return math.nan
    finite = torch.isfinite(expected)
    if not torch.equal(torch.isfinite(actual), finite):
        return math.inf  # -inf log-sum-exp rows (no key seen) must match exactly
    return relative_error(actual[finite], expected[finite])
