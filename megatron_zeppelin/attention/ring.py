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

Streams (CUDA): everything here runs on the caller's current stream, the compute stream: every
kernel call, merge and copy, and the posting of every exchange. The exchanger's transfers run on
its communicators' own streams (``comm/exchange.py``), which wait for the compute stream at
posting, and ``wait`` makes the compute stream wait for them; neither blocks the host on NCCL. So
while the kernels of compute ``c`` run, the transfers of step ``c`` are in flight. A
``step_timing.RingTimer`` (optional) marks events around both and reports per tier the compute,
the communication and the part of it the compute stream waited for.

Gradients travel in float32 for half-precision inputs (they are sums over the whole ring);
K/V travel in the input dtype. Letters: t rows of a buffer, n heads, d head dim; the travelling
rows are ``kv_t2nd`` ``(t, 2, nkv, d)`` (K and V of a token side by side, one message per edge).

Host cost per layer. Every index is precomputed by the layout once per micro-batch and shared by
all layers, and under zigzag every ring-step index is a slice, so blocks are taken as views and
merged in place. No buffer of the whole attention buffer is zero-filled, stacked or copied: out,
lse, dQ, dK and dV start as the outputs of the rank's own kernel call (which covers every row),
and only the rows of own K/V that leave the rank are stacked into a message. Fresh full-size
buffers are what the host pays for most (page faults), far more than the per-step bookkeeping.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from megatron_zeppelin.attention.kernel_api import AttentionKernel, compute_dtype
from megatron_zeppelin.attention.kernels import get_kernel
from megatron_zeppelin.attention.layout import KernelCall, RankLayout, Rows, TierLayout
from megatron_zeppelin.attention.merge import merge_rows_
from megatron_zeppelin.attention.step_timing import RingTimer
from megatron_zeppelin.comm.protocol import Exchanger, Pending

__all__ = ["RingAttentionFunction", "RingRuntime"]


class _RowSum:
    """A running sum of kernel parts over the rows of one buffer, allocated lazily.

    The first part that covers every row in order is adopted as the sum (kernels return fresh
    tensors), which saves a zero fill and a full-size add: on the host, touching a freshly
    allocated buffer of the whole attention buffer costs more than every ring step together.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.value: torch.Tensor | None = None

    def add(self, rows: Rows, part: torch.Tensor) -> None:
        """Add ``part`` to ``rows`` (``layout.Rows``)."""
        if self.value is None:
            if rows is None and tuple(part.shape) == self.shape:
                # A view (one half of a received K/V gradient) is copied, not adopted.
                self.value = part.to(self.dtype).contiguous()
                return
            self.value = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        if rows is None:
            self.value.add_(part)
        elif isinstance(rows, slice):
            self.value[rows].add_(part)
        else:
            self.value.index_add_(0, rows, part)

    def result(self) -> torch.Tensor:
        if self.value is None:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self.value


class RingRuntime:
    """A rank's layout bound to an exchanger, a kernel name and a softmax scale."""

    def __init__(
        self,
        layout: RankLayout,
        exchanger: Exchanger,
        *,
        kernel: str,
        softmax_scale: float | None,
        timer: RingTimer | None = None,
    ) -> None:
        self.layout = layout
        self.exchanger = exchanger
        self.kernel_name = kernel
        self.softmax_scale = softmax_scale
        self.timer = timer
        self._moved: dict[tuple[int, str], torch.Tensor] = {}

    def _compute(self, tier: str):  # noqa: ANN202
        """Context of one tier's kernel calls at one step (timed when there is a timer)."""
        return nullcontext() if self.timer is None else self.timer.compute(tier)

    def kernel(self, like: torch.Tensor) -> AttentionKernel:
        return get_kernel(self.kernel_name, device=like.device, dtype=like.dtype)

    def scale(self, head_dim: int) -> float:
        return self.softmax_scale if self.softmax_scale is not None else head_dim**-0.5

    def on(self, index: Rows, device: torch.device) -> Rows:
        """``index`` on ``device``, moved once per layout (shared by every layer)."""
        if not isinstance(index, torch.Tensor) or device.type == "cpu":
            return index
        key = (id(index), str(device))
        if key not in self._moved:
            self._moved[key] = index.to(device)
        return self._moved[key]

    def _rows(self, x: torch.Tensor, index: Rows) -> torch.Tensor:
        """Rows ``index`` of ``x``: a view unless ``index`` is a tensor."""
        if index is None:
            return x
        if isinstance(index, slice):
            return x[index]
        return x.index_select(0, self.on(index, x.device))

    # --- exchanges -------------------------------------------------------------------------
    def _start(self, tier: TierLayout, step: int, source, *, grad: bool) -> Pending:  # noqa: ANN001
        """Post one step. ``source`` is the travelling buffer ``(t, 2, nkv, d)`` of this
        compute, or ``(k_tnd, v_tnd)`` of this rank's own buffer: own K and V are never
        stacked whole, only the rows that leave are (a few ring blocks of a large buffer)."""
        messages = (tier.grad_steps if grad else tier.kv_steps)[step]
        sends = (tier.grad_sends if grad else tier.sends)[step]
        if isinstance(source, tuple):
            k, v = source
            payload = {
                (self.layout.rank, dst): torch.stack((self._rows(k, i), self._rows(v, i)), 1)
                for dst, i in sends.items()
            }
            row_shape, dtype = (2, *k.shape[1:]), k.dtype
        else:
            payload = {(self.layout.rank, dst): self._rows(source, i) for dst, i in sends.items()}
            row_shape, dtype = tuple(source.shape[1:]), source.dtype
        kind = "grad" if grad else "kv"
        pending = self.exchanger.start(
            messages,
            payload,
            row_shape=row_shape,
            dtype=dtype,
            tag=f"zeppelin/{tier.tier.value}/{kind}/{step}",
        )
        if self.timer is not None:
            self.timer.posted(pending, tier.tier.value)
        return pending

    def _received(
        self, tier: TierLayout, step: int, pending: Pending, empty: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The rows received at ``step`` in message order (``empty`` when none came)."""
        if self.timer is not None:
            self.timer.waiting(pending)
        got = pending.wait()
        if self.timer is not None:
            self.timer.landed(pending)
        parts = [got[(src, self.layout.rank)] for src in tier.recv_from[step]]
        if not parts:
            return empty
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # --- kernel calls ----------------------------------------------------------------------
    def forward_calls(self, calls, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """Merge the attention of ``calls`` into the running ``out``/``lse`` (in place) and
        return them. ``out is None``: nothing merged yet, so the first call's output is
        adopted when it covers every row, else ``out``/``lse`` start empty."""
        kernel = self.kernel(q)
        scale = self.scale(q.shape[-1])
        dtype = compute_dtype(q.dtype)
        for call in calls:
            part, part_lse = kernel.forward(
                self._rows(q, call.q_index),
                self._rows(k, call.k_index),
                self._rows(v, call.k_index),
                call.batch,
                softmax_scale=scale,
            )
            part, part_lse = part.to(dtype), part_lse.to(dtype)
            if out is None and call.q_index is None:
                out, lse = part, part_lse
                continue
            if out is None:
                out = q.new_zeros(q.shape, dtype=dtype)
                lse = q.new_full(q.shape[:2], float("-inf"), dtype=dtype)
            q_rows = self.on(call.q_index, q.device)
            merge_rows_(out, lse, q_rows, part, part_lse, unique=call.q_unique)
        if out is None:
            out = q.new_zeros(q.shape, dtype=dtype)
            lse = q.new_full(q.shape[:2], float("-inf"), dtype=dtype)
        return out, lse

    def backward_calls(self, calls: list[KernelCall], saved, k, v, dq, dk, dv) -> None:  # noqa: ANN001
        """Add the gradients of ``calls`` to the ``_RowSum`` s ``dq``, ``dk``, ``dv``."""
        dout, q, out, lse = saved
        kernel = self.kernel(q)
        scale = self.scale(q.shape[-1])
        for call in calls:
            dq_p, dk_p, dv_p = kernel.backward(
                self._rows(dout, call.q_index),
                self._rows(q, call.q_index),
                self._rows(k, call.k_index),
                self._rows(v, call.k_index),
                self._rows(out, call.q_index),
                self._rows(lse, call.q_index),
                call.batch,
                softmax_scale=scale,
            )
            dq.add(self.on(call.q_index, q.device), dq_p.to(dq.dtype))
            k_rows = self.on(call.k_index, q.device)
            dk.add(k_rows, dk_p.to(dk.dtype))
            dv.add(k_rows, dv_p.to(dv.dtype))

    # --- the two passes --------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``out_tnd`` and ``lse_tn`` of this rank's queries, in the compute dtype."""
        layout = self.layout
        empty = k.new_zeros((0, 2, *k.shape[1:]))
        pending = {t.tier: self._start(t, 0, (k, v), grad=False) for t in layout.tiers}
        with self._compute("own"):
            out, lse = self.forward_calls(layout.own_calls, q, k, v, None, None)
        for c in range(1, layout.num_steps + 1):
            for tier in reversed(layout.tiers):  # intra-node first: it lands first
                if c > tier.num_steps:
                    continue
                held = self._received(tier, c - 1, pending[tier.tier], empty)
                if c < tier.num_steps:
                    pending[tier.tier] = self._start(tier, c, held, grad=False)
                with self._compute(tier.tier.value):
                    self.forward_calls(tier.calls[c], q, held[:, 0], held[:, 1], out, lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse):  # noqa: ANN001
        """``dq``, ``dk``, ``dv`` of this rank's buffer, in the compute dtype."""
        layout = self.layout
        dtype = compute_dtype(q.dtype)
        saved = (dout, q, out, lse)
        dq, dk, dv = (_RowSum(tuple(x.shape), dtype, x.device) for x in (q, k, v))
        empty = k.new_zeros((0, 2, *k.shape[1:]))
        pending = {t.tier: self._start(t, 0, (k, v), grad=False) for t in layout.tiers}
        grads: dict[Any, Any] = {}
        with self._compute("own"):
            self.backward_calls(layout.own_calls, saved, k, v, dq, dk, dv)
        for c in range(1, layout.num_steps + 1):
            for tier in reversed(layout.tiers):
                if c > tier.num_steps:
                    continue
                held = self._received(tier, c - 1, pending[tier.tier], empty)
                if c < tier.num_steps:
                    pending[tier.tier] = self._start(tier, c, held, grad=False)
                block = (held.shape[0], *k.shape[1:])
                dk_held, dv_held = _RowSum(block, dtype, k.device), _RowSum(block, dtype, k.device)
                with self._compute(tier.tier.value):
                    self.backward_calls(
                        tier.calls[c], saved, held[:, 0], held[:, 1], dq, dk_held, dv_held
                    )
                dkv = torch.stack((dk_held.result(), dv_held.result()), 1)
                if c >= 2:  # the gradient of these blocks from the ranks before this one
                    self._add_grads(tier, c - 2, grads[tier.tier], dkv, dk, dv)
                grads[tier.tier] = self._start(tier, c - 1, dkv, grad=True)
        for tier in layout.tiers:
            self._add_grads(tier, tier.num_steps - 1, grads[tier.tier], None, dk, dv)
        return dq.result(), dk.result(), dv.result()

    def _add_grads(self, tier: TierLayout, step: int, pending: Pending, dkv, dk, dv) -> None:  # noqa: ANN001
        """Add the gradients received at ``step`` to the held buffer's ``dkv`` (still
        travelling) and to this rank's own ``dk``/``dv`` (home)."""
        got = self._received(tier, step, pending, None)
        into_held, into_own = tier.grad_into_held[step], tier.grad_into_own[step]
        if got is None:
            assert into_held is None and into_own is None, "gradient rows that never came"
            return
        dev = got.device
        if into_held is not None:
            assert dkv is not None, "gradient rows for a buffer that no longer exists"
            rows = self._rows(got, into_held.src).to(dkv.dtype)
            if into_held.dst is None:
                dkv.add_(rows)
            elif isinstance(into_held.dst, slice):
                dkv[into_held.dst].add_(rows)
            else:
                dkv.index_add_(0, self.on(into_held.dst, dev), rows)
        if into_own is not None:
            rows = self._rows(got, into_own.src).to(dk.dtype)
            dst = self.on(into_own.dst, dev)
            dk.add(dst, rows[:, 0])
            dv.add(dst, rows[:, 1])


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
