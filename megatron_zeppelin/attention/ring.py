"""Ring attention over many documents at once: the forward, the backward, the autograd Function.

Every rank runs the same program over the global ring schedule of its plan (``layout.py``
precomputes what it means for this rank), so every rank posts and waits on the same exchanges in
the same order, which is what keeps point-to-point transfers matched.

Forward, per rank:

1. post ring step 0 of the inter-node tier (slowest links first), then of the intra-node tier:
   each rank sends its own K/V blocks one hop on;
2. compute 0: local documents and the rank's own blocks of ring documents (one causal call) while
   those transfers run;
3. for compute ``c = 1, 2, ...`` and each tier (intra-node first, it lands first): wait for step
   ``c - 1``, post step ``c`` forwarding the blocks just received, and compute the queries against
   them (one varlen call per mask kind, all documents of the tier together), merging partial
   results with their log-sum-exp (``merge.py``).

Backward: the K/V blocks travel the same rings again (nothing but the rank's own tokens is kept
from the forward), and the gradient of each block travels behind them. The rank holding a block
at compute ``c`` adds its contribution to the gradient received from the rank before it and
passes the sum on; after the last compute one more hop brings the total home to the block's
owner. The owner's own contribution at compute 0 never leaves it. Gradients of query rows stay
local. Each pair's gradient uses the final output and lse, so it is exact on its own.

Gradients travel in float32 for half-precision inputs (they are sums over the whole ring);
K/V travel in the input dtype. Letters: t rows of a buffer, n heads, d head dim; the travelling
rows are ``kv_t2nd`` ``(t, 2, nkv, d)`` (K and V of a token side by side, one message per edge).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_zeppelin.attention.kernels import AttentionKernel, compute_dtype, get_kernel
from megatron_zeppelin.attention.layout import KernelCall, RankLayout, TierLayout
from megatron_zeppelin.attention.merge import merge_rows_

__all__ = ["RingAttentionFunction", "RingRuntime"]


class RingRuntime:
    """A rank's layout bound to an exchanger, a kernel name and a softmax scale."""

    def __init__(
        self, layout: RankLayout, exchanger: Any, *, kernel: str, softmax_scale: float | None
    ) -> None:
        self.layout = layout
        self.exchanger = exchanger
        self.kernel_name = kernel
        self.softmax_scale = softmax_scale
        self._moved: dict[tuple[int, str], torch.Tensor] = {}

    def kernel(self, like: torch.Tensor) -> AttentionKernel:
        return get_kernel(self.kernel_name, device=like.device, dtype=like.dtype)

    def scale(self, head_dim: int) -> float:
        return self.softmax_scale if self.softmax_scale is not None else head_dim**-0.5

    def on(self, index: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """``index`` on ``device``, moved once per layout."""
        if index is None or device.type == "cpu":
            return index
        key = (id(index), str(device))
        if key not in self._moved:
            self._moved[key] = index.to(device)
        return self._moved[key]

    # --- exchanges -------------------------------------------------------------------------
    def _start(self, tier: TierLayout, step: int, rows_t: torch.Tensor, *, grad: bool) -> Any:
        messages = (tier.grad_steps if grad else tier.kv_steps)[step]
        sends = (tier.grad_sends if grad else tier.sends)[step]
        payload = {
            (self.layout.rank, dst): rows_t
            if index is None
            else rows_t.index_select(0, self.on(index, rows_t.device))
            for dst, index in sends.items()
        }
        kind = "grad" if grad else "kv"
        return self.exchanger.start(
            messages,
            payload,
            row_shape=tuple(rows_t.shape[1:]),
            dtype=rows_t.dtype,
            tag=f"zeppelin/{tier.tier.value}/{kind}/{step}",
        )

    def _received(self, tier: TierLayout, step: int, pending: Any, like: torch.Tensor):
        got = pending.wait()
        parts = [got[(src, self.layout.rank)] for src in tier.recv_from[step]]
        if not parts:
            return like.new_zeros((0, *like.shape[1:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # --- kernel calls ----------------------------------------------------------------------
    def _gather(self, x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        if index is None:
            return x.contiguous()
        return x.index_select(0, self.on(index, x.device))

    def forward_calls(self, calls, q, k, v, out, lse, *, fresh: bool = False) -> None:  # noqa: ANN001
        """Merge the attention of ``calls`` into the running ``out``/``lse`` (in place).
        ``fresh``: nothing merged yet, so a call covering every row is copied, not merged."""
        kernel = self.kernel(q)
        scale = self.scale(q.shape[-1])
        for call in calls:
            part, part_lse = kernel.forward(
                self._gather(q, call.q_index),
                self._gather(k, call.k_index),
                self._gather(v, call.k_index),
                call.batch,
                softmax_scale=scale,
            )
            if fresh and call.q_index is None:
                out.copy_(part)
                lse.copy_(part_lse)
                fresh = False
                continue
            merge_rows_(
                out,
                lse,
                self.on(call.q_index, q.device),
                part.to(out.dtype),
                part_lse.to(lse.dtype),
                unique=call.q_unique,
            )

    def backward_calls(self, calls: list[KernelCall], saved, k, v, dq, dkv) -> None:  # noqa: ANN001
        """Add the gradients of ``calls`` to ``dq`` and ``dkv`` (in place)."""
        dout, q, out, lse = saved
        kernel = self.kernel(q)
        scale = self.scale(q.shape[-1])
        for call in calls:
            qi, ki = self.on(call.q_index, q.device), self.on(call.k_index, q.device)
            g = lambda x, i: self._gather(x, i)  # noqa: E731
            dq_p, dk_p, dv_p = kernel.backward(
                g(dout, call.q_index),
                g(q, call.q_index),
                g(k, call.k_index),
                g(v, call.k_index),
                g(out, call.q_index),
                g(lse, call.q_index),
                call.batch,
                softmax_scale=scale,
            )
            if qi is None:
                dq.add_(dq_p)
            else:
                dq.index_add_(0, qi, dq_p.to(dq.dtype))
            for j, part in ((0, dk_p), (1, dv_p)):
                if ki is None:
                    dkv[:, j].add_(part)
                else:
                    dkv[:, j].index_add_(0, ki, part.to(dkv.dtype))

    # --- the two passes --------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out_tnd`` and ``lse_tn`` of this rank's queries, in the compute dtype."""
        layout = self.layout
        dtype = compute_dtype(q.dtype)
        out = q.new_zeros(q.shape, dtype=dtype)
        lse = q.new_full(q.shape[:2], float("-inf"), dtype=dtype)
        kv_own = torch.stack([k, v], dim=1)
        pending = {t.tier: self._start(t, 0, kv_own, grad=False) for t in layout.tiers}
        self.forward_calls(layout.own_calls, q, k, v, out, lse, fresh=True)
        for c in range(1, layout.num_steps + 1):
            for tier in reversed(layout.tiers):  # intra-node first: it lands first
                if c > tier.num_steps:
                    continue
                held = self._received(tier, c - 1, pending[tier.tier], kv_own)
                if c < tier.num_steps:
                    pending[tier.tier] = self._start(tier, c, held, grad=False)
                self.forward_calls(tier.calls[c], q, held[:, 0], held[:, 1], out, lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse):  # noqa: ANN001
        """``dq``, ``dk``, ``dv`` of this rank's buffer, in the compute dtype."""
        layout = self.layout
        dtype = compute_dtype(q.dtype)
        saved = (dout, q, out, lse)
        dq = q.new_zeros(q.shape, dtype=dtype)
        kv_own = torch.stack([k, v], dim=1)
        dkv_own = kv_own.new_zeros(kv_own.shape, dtype=dtype)
        pending = {t.tier: self._start(t, 0, kv_own, grad=False) for t in layout.tiers}
        grads: dict[Any, Any] = {}
        self.backward_calls(layout.own_calls, saved, k, v, dq, dkv_own)
        for c in range(1, layout.num_steps + 1):
            for tier in reversed(layout.tiers):
                if c > tier.num_steps:
                    continue
                held = self._received(tier, c - 1, pending[tier.tier], kv_own)
                if c < tier.num_steps:
                    pending[tier.tier] = self._start(tier, c, held, grad=False)
                dkv = held.new_zeros(held.shape, dtype=dtype)
                self.backward_calls(tier.calls[c], saved, held[:, 0], held[:, 1], dq, dkv)
                if c >= 2:  # the gradient of these blocks from the ranks before this one
                    self._add_grads(tier, c - 2, grads[tier.tier], dkv, dkv_own)
                grads[tier.tier] = self._start(tier, c - 1, dkv, grad=True)
        for tier in layout.tiers:
            self._add_grads(tier, tier.num_steps - 1, grads[tier.tier], None, dkv_own)
        return dq, dkv_own[:, 0], dkv_own[:, 1]

    def _add_grads(self, tier: TierLayout, step: int, pending: Any, dkv, dkv_own) -> None:  # noqa: ANN001
        got = self._received(tier, step, pending, dkv_own)
        dev = dkv_own.device
        for (src, dst), target in (
            (tier.grad_into_held[step], dkv),
            (tier.grad_into_own[step], dkv_own),
        ):
            if src.numel():
                assert target is not None, "gradient rows for a buffer that no longer exists"
                rows = got.index_select(0, self.on(src, dev))
                target.index_add_(0, self.on(dst, dev), rows.to(target.dtype))


class RingAttentionFunction(torch.autograd.Function):
    """``out_tnd = ring_attention(q_tnd, k_tnd, v_tnd)`` for one rank of a plan."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runtime: RingRuntime
    ) -> torch.Tensor:
        out, lse = runtime.forward(q, k, v)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.runtime = runtime
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # noqa: ANN205
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.runtime.backward(dout.contiguous(), q, k, v, out, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
