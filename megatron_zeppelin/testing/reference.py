"""Dense reference attention and layout indices: the oracle every engine test compares with.

``reference_attention`` computes causal attention inside each document of a packed batch in
float64, one dense score matrix per document, with autograd: slow, obviously right, and only for
small test inputs. It takes Megatron's two attention variants too: a sliding window (query
``i`` sees keys ``i - window .. i`` of its document, ``--window-size window,0``) and a sink
(one logit per head that joins every row's softmax denominator with a value of zero,
``--softmax-type``). The packed ("global") layout lists the documents back to back in the order
given (for a plan: ``plan.sequences``, ids increasing); ``attention_rows`` / ``linear_rows`` say
which packed rows make up a rank's attention or linear buffer, so a test can cut a global tensor
into per-rank inputs and glue per-rank outputs back together.

Shapes: ``q_tnd`` ``(t, nq, d)``, ``k_tnd``/``v_tnd`` ``(t, nkv, d)``, ``lse_tn`` ``(t, nq)``;
t packed tokens, n heads (query heads ``nq`` grouped over ``nkv`` K/V heads), d head dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_zeppelin.planner.plan.plan import Plan, TokenRange

__all__ = [
    "attention_rows",
    "linear_rows",
    "packed_offsets",
    "pair_attention",
    "random_qkv",
    "reference_attention",
    "rows_of_ranges",
]


def packed_offsets(lengths: Sequence[int]) -> list[int]:
    """Start row of every document in the packed layout, plus the total at the end."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + int(n))
    return offsets


def reference_attention(
    q_tnd: torch.Tensor,
    k_tnd: torch.Tensor,
    v_tnd: torch.Tensor,
    lengths: Sequence[int],
    *,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    window: int | None = None,
    sink_n: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within each document, in float64 (gradients flow to the inputs and to
    ``sink_n``). ``window``: each query sees only the ``window`` keys before it and itself;
    ``sink_n``: one logit per query head added to every row's softmax denominator.

    Returns ``out_tnd`` in float64, and ``lse_tn`` too with ``return_lse`` (the sink included).
    """
    t, nq, d = q_tnd.shape
    nkv = k_tnd.shape[1]
    if sum(lengths) != t or k_tnd.shape[0] != t or v_tnd.shape != k_tnd.shape:
        raise ValueError(
            f"documents of {sum(lengths)} tokens do not match q {tuple(q_tnd.shape)}, "
            f"k {tuple(k_tnd.shape)}, v {tuple(v_tnd.shape)}"
        )
    if nq % nkv:
        raise ValueError(f"{nq} query heads do not group over {nkv} K/V heads")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    q, k, v = (x.to(torch.float64) for x in (q_tnd, k_tnd, v_tnd))
    out, lse = pair_attention(q, k, v, lengths, lengths, causal=True, scale=scale, window=window)
    if sink_n is not None:
        # The sink is one more key of value zero: it adds to the denominator only.
        with_sink = torch.logaddexp(lse, sink_n.to(torch.float64)[None, :])
        out = out * torch.exp(lse - with_sink).unsqueeze(-1)
        lse = with_sink
    return (out, lse) if return_lse else out


def pair_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths_q: Sequence[int],
    lengths_k: Sequence[int],
    *,
    causal: bool,
    scale: float,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of every pair (the query rows of pair ``p`` against its key rows) in
    ``q``'s dtype, the causal mask and the left ``window`` aligned bottom-right as
    ``attention/kernels/kernel_api.py`` defines them: ``(out_tnd, lse_tn)``, differentiable.
    ``reference_attention`` is its causal case."""
    if not len(lengths_q):
        return q.new_zeros((0, *q.shape[1:])), q.new_zeros((0, q.shape[1]))
    outs, lses = [], []
    group = q.shape[1] // k.shape[1]
    q0 = k0 = 0
    for lq, lk in zip(lengths_q, lengths_k):
        qp = q[q0 : q0 + lq]
        kp = k[k0 : k0 + lk].repeat_interleave(group, 1)
        vp = v[k0 : k0 + lk].repeat_interleave(group, 1)
        scores = torch.einsum("qnd,knd->nqk", qp, kp) * scale
        hidden = torch.zeros(lq, lk, dtype=torch.bool, device=q.device)
        everything = torch.ones_like(hidden)
        if causal:
            hidden |= everything.triu(diagonal=lk - lq + 1)
        if window is not None:
            hidden |= everything.tril(diagonal=lk - lq - window - 1)
        scores = scores.masked_fill(hidden, float("-inf"))
        lse = scores.logsumexp(-1)
        probs = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1))
        outs.append(torch.einsum("nqk,knd->qnd", probs, vp))
        lses.append(lse.transpose(0, 1))
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs), torch.cat(lses)


def rows_of_ranges(plan: Plan, ranges: Sequence[TokenRange]) -> torch.Tensor:
    """Packed rows (int64) of ``ranges``, in their order."""
    offsets = packed_offsets(plan.lengths)
    start_of = {seq.id: offsets[i] for i, seq in enumerate(plan.sequences)}
    parts = [
        torch.arange(start_of[r.seq] + r.start, start_of[r.seq] + r.end, dtype=torch.int64)
        for r in ranges
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def attention_rows(plan: Plan, rank: int) -> torch.Tensor:
    """Packed rows that form ``rank``'s attention buffer (``plan.attention_ranges`` order)."""
    return rows_of_ranges(plan, plan.attention_ranges(rank))


def linear_rows(plan: Plan, rank: int) -> torch.Tensor:
    """Packed rows that form ``rank``'s linear buffer (``plan.linear_ranges`` order)."""
    return rows_of_ranges(plan, plan.linear_ranges(rank))


def random_qkv(
    num_tokens: int,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    head_dim: int,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded random packed ``q_tnd, k_tnd, v_tnd`` (CPU) for tests and benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    nkv = num_kv_heads or num_heads
    shapes = ((num_tokens, num_heads, head_dim), (num_tokens, nkv, head_dim))
    q = torch.randn(shapes[0], generator=gen, dtype=torch.float64)
    k = torch.randn(shapes[1], generator=gen, dtype=torch.float64)
    v = torch.randn(shapes[1], generator=gen, dtype=torch.float64)
    return tuple(x.to(dtype).requires_grad_(requires_grad) for x in (q, k, v))  # type: ignore[return-value]
