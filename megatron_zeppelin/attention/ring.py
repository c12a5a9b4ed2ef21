"""Ring attention over many documents at once: the forward, the backward, the autograd Function.

Every rank runs the same program over the ring schedule of its plan (``layout.py`` precomputes
what it means for this rank: the messages it sends, receives or relays, step by step, as many
steps as every rank), so every rank posts and waits on the same exchanges in the same order,
which is what keeps point-to-point transfers matched.

Forward, per rank:

1. post ring step 0 of the inter-node tier (slowest links first), then of the intra-node tier:
   each rank sends its own K/V blocks one hop on;
2. compute 0: local documents and the rank's own blocks of ring documents (one causal call) while
   those transfers run;
3. then ring step by ring step, the tiers taking turns (intra-node first, it lands first;
   ``interleave``): for each step of ``tier.steps``, wait for what it brings, post the next
   step forwarding it, and compute the queries against it (one varlen call per mask kind, all
   documents of the tier together), merging partial results with their log-sum-exp
   (``merge.py``).

Backward: the K/V blocks travel the same rings again (nothing but the rank's own tokens is kept
from the forward), and the gradient of each block travels behind them. The rank holding a block
after step ``s`` adds its contribution to the gradient received from the rank before it and
passes the sum on; after the last compute one more hop brings the total home to the block's
owner. The owner's own contribution at compute 0 never leaves it. Gradients of query rows stay
local. Each pair's gradient uses the final output and lse, so it is exact on its own.

Streams (CUDA): everything here runs on the caller's current stream, the compute stream: every
kernel call, merge and copy, and the posting of every exchange. The exchanger's transfers run on
its communicators' own streams (``comm/exchange.py``), which wait for the compute stream at
posting, and ``wait`` makes the compute stream wait for them; neither blocks the host on NCCL. So
while one ring step's blocks are computed, the next step's transfers are in flight. A
``step_timing.RingTimer`` (optional) marks events around both and reports per tier the compute,
the communication and the part of it the compute stream waited for.

Sinks (``--softmax-type``): the per-head sink logits join each row's softmax once every ring step
is merged (``merge.add_sink_``), and the backward runs from the output and lse with the sink in
them, which makes every pair's gradient the sink-softmax one; the sink's own gradient is a sum
over the rank's query rows (``merge.sink_gradient``). A sliding window lives in the layout
(``RankLayout.windowed``): its calls, nothing else, differ.

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

from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from megatron_zeppelin.attention.kernels.kernel_api import AttentionKernel, compute_dtype
from megatron_zeppelin.attention.kernels.kernels import get_kernel
from megatron_zeppelin.attention.layout import KernelCall, RankLayout, RingStep, Rows, TierLayout
from megatron_zeppelin.attention.merge import add_sink_, as_dtype, merge_rows_, sink_gradient
from megatron_zeppelin.attention.step_timing import RingTimer
from megatron_zeppelin.comm.protocol import Exchanger, Pending
from megatron_zeppelin.devices import to_device

__all__ = ["Buffers", "Gradients", "RingAttentionFunction", "RingRuntime", "interleave"]


@dataclass
class Buffers:
    """One buffer's tensors in a pass: inputs, and ``out``/``lse`` once computed (forward) or
    saved (backward, with ``dout``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    dout: torch.Tensor | None = None


def interleave(runs: Iterable[Iterator[None]]) -> None:
    """Resume each run once per round, in the given order, until every run is done.

    A run is one tier's pass written as a generator that yields after each compute, so the
    tiers' ring steps take turns: every tier has its step 0 in flight before any compute, and
    each round visits the tiers in the order their transfers land. Every rank resumes the same
    runs in the same order, which keeps their exchanges matched."""
    active = list(runs)
    while active:
        active = [run for run in active if next(run, _DONE) is not _DONE]


_DONE = object()

Forward = tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]
"""``out_tnd``, ``lse_tn`` and any more tensors the backward needs."""


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
                self.value = as_dtype(part, self.dtype).contiguous()
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


@dataclass
class Gradients:
    """The running dQ, dK, dV sums of one buffer's backward."""

    buffers: Buffers
    dq: _RowSum
    dk: _RowSum
    dv: _RowSum

    @property
    def saved(self) -> tuple[torch.Tensor, ...]:
        b = self.buffers
        return (b.dout, b.q, b.out, b.lse)


class RingRuntime:
    """A rank's layout bound to an exchanger, a kernel name and a softmax scale. ``tag``
    prefixes the tags of its exchanges (runtimes whose exchanges are in flight together need
    different ones); ``timer`` (optional) times compute and transfers per tier, under names
    ``label`` + the tier's (``own`` for compute 0)."""

    def __init__(
        self,
        layout: RankLayout,
        exchanger: Exchanger,
        *,
        kernel: str,
        softmax_scale: float | None,
        tag: str = "zeppelin",
        timer: RingTimer | None = None,
        label: str = "",
    ) -> None:
        self.layout = layout
        self.tag = tag
        self.exchanger = exchanger
        self.kernel_name = kernel
        self.softmax_scale = softmax_scale
        self.timer = timer
        self.label = label
        self._moved: dict[tuple[int, str], torch.Tensor] = {}

    def _compute(self, tier: str):  # noqa: ANN202
        """Context of one tier's kernel calls at one step (timed when there is a timer)."""
        return nullcontext() if self.timer is None else self.timer.compute(self.label + tier)

    def kernel(self, like: torch.Tensor) -> AttentionKernel:
        windowed = self.layout.window is not None
        return get_kernel(self.kernel_name, device=like.device, dtype=like.dtype, window=windowed)

    def scale(self, head_dim: int) -> float:
        return self.softmax_scale if self.softmax_scale is not None else head_dim**-0.5

    def on(self, index: Rows, device: torch.device) -> Rows:
        """``index`` on ``device``, moved once per layout (shared by every layer) by a copy the
        stream orders (``devices.to_device``: the host never waits for it)."""
        if not isinstance(index, torch.Tensor) or device.type == "cpu":
            return index
        key = (id(index), str(device))
        if key not in self._moved:
            self._moved[key] = to_device(index, device)
        return self._moved[key]

    def _rows(self, x: torch.Tensor, index: Rows) -> torch.Tensor:
        """Rows ``index`` of ``x``: a view unless ``index`` is a tensor."""
        if index is None:
            return x
        if isinstance(index, slice):
            return x[index]
        return x.index_select(0, self.on(index, x.device))

    # --- exchanges -------------------------------------------------------------------------
    def _start(self, tier: TierLayout, step: RingStep, source, *, grad: bool) -> Pending:  # noqa: ANN001
        """Post one step. ``source`` is the travelling buffer ``(t, 2, nkv, d)`` the step
        forwards (K/V) or returns (dK/dV), or ``(k_tnd, v_tnd)`` of this rank's own buffer: own
        K and V are never stacked whole, only the rows that leave are (a few ring blocks of a
        large buffer)."""
        messages, sends = (step.grad, step.grad_sends) if grad else (step.kv, step.sends)
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
            tag=f"{self.tag}/{tier.tier.value}/{kind}/{step.index}",
        )
        if self.timer is not None:
            self.timer.posted(pending, self.label + tier.tier.value)
        return pending

    def _received(
        self, step: RingStep, pending: Pending, empty: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The rows ``step`` brought in message order (``empty`` when none came)."""
        if self.timer is not None:
            self.timer.waiting(pending)
        got = pending.wait()
        if self.timer is not None:
            self.timer.landed(pending)
        parts = [got[(src, self.layout.rank)] for src in step.recv_from]
        if not parts:
            return empty
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # --- kernel calls ----------------------------------------------------------------------
    def forward_calls(self, calls, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        """Merge the attention of ``calls`` into the running ``out``/``lse`` (in place) and
        return them. ``out is None``: nothing merged yet, so the first call's output is
        adopted when it covers every row, else ``out``/``lse`` start empty and the first call
        is written into its rows (merging into nothing is a copy)."""
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
            part, part_lse = as_dtype(part, dtype), as_dtype(part_lse, dtype)
            if out is None and call.q_index is None:
                out, lse = part, part_lse
                continue
            q_rows = self.on(call.q_index, q.device)
            if out is None:
                out = q.new_zeros(q.shape, dtype=dtype)
                lse = q.new_full(q.shape[:2], float("-inf"), dtype=dtype)
                if call.q_unique:  # rows of a buffer 2-D documents share (``two_d.py``)
                    _put(out, q_rows, part)
                    _put(lse, q_rows, part_lse)
                    continue
            groups = call.q_groups
            if groups is not None:
                groups = (self.on(groups[0], q.device), self.on(groups[1], q.device))
            merge_rows_(out, lse, q_rows, part, part_lse, unique=call.q_unique, groups=groups)
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
            dq.add(self.on(call.q_index, q.device), as_dtype(dq_p, dq.dtype))
            k_rows = self.on(call.k_index, q.device)
            dk.add(k_rows, as_dtype(dk_p, dk.dtype))
            dv.add(k_rows, as_dtype(dv_p, dv.dtype))

    # --- the two passes --------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sink_n: torch.Tensor | None = None,
    ) -> Forward:
        """``out_tnd`` and ``lse_tn`` of this rank's queries, in the compute dtype, with the
        sink logits ``sink_n`` (per query head, optional) in them (nothing more to save for the
        backward)."""
        buffers = Buffers(q, k, v)
        runs = self.forward_runs(buffers)
        for run in runs:  # post every tier's step 0, inter-node (slowest links) first
            next(run)
        self.forward_own(buffers)
        interleave(reversed(runs))  # intra-node first: it lands first
        if sink_n is not None:
            add_sink_(buffers.out, buffers.lse, sink_n)
        return buffers.out, buffers.lse, ()

    def forward_own(self, buffers: Buffers) -> None:
        """Compute 0: local documents and this rank's own blocks; starts ``out``/``lse``."""
        b = buffers
        with self._compute("own"):
            b.out, b.lse = self.forward_calls(self.layout.own_calls, b.q, b.k, b.v, None, None)

    def forward_runs(self, buffers: Buffers) -> list[Iterator[None]]:
        """One run per tier (see ``interleave``): the first resume posts step 0, each later
        one receives a step, forwards it and computes against it."""
        return [self._forward_tier(tier, buffers) for tier in self.layout.tiers]

    def _forward_tier(self, tier: TierLayout, b: Buffers) -> Iterator[None]:
        empty = b.k.new_zeros((0, 2, *b.k.shape[1:]))
        pending = self._start(tier, tier.steps[0], (b.k, b.v), grad=False)
        yield
        for step, following in zip(tier.steps, [*tier.steps[1:], None]):
            held = self._received(step, pending, empty)
            if following is not None:
                pending = self._start(tier, following, held, grad=False)
            k_held, v_held = held.unbind(1)
            with self._compute(tier.tier.value):
                self.forward_calls(step.calls, b.q, k_held, v_held, b.out, b.lse)
            yield

    def backward(self, dout, q, k, v, out, lse, saved=(), sink_n=None):  # noqa: ANN001
        """``dq``, ``dk``, ``dv`` of this rank's buffer, in the compute dtype, and the gradient
        of ``sink_n`` from this rank's rows (``None`` without a sink)."""
        grads = self.backward_grads(Buffers(q, k, v, out, lse, dout))
        runs = self.backward_runs(grads)
        for run in runs:
            next(run)
        self.backward_own(grads)
        interleave(reversed(runs))
        dsink = None if sink_n is None else sink_gradient(dout, out, lse, sink_n)
        return grads.dq.result(), grads.dk.result(), grads.dv.result(), dsink

    def backward_grads(self, buffers: Buffers) -> Gradients:
        """Empty running sums of this rank's dQ, dK, dV for ``buffers``."""
        dtype = compute_dtype(buffers.q.dtype)
        device = buffers.q.device
        sums = (_RowSum(tuple(x.shape), dtype, device) for x in (buffers.q, buffers.k, buffers.v))
        return Gradients(buffers, *sums)

    def backward_own(self, g: Gradients) -> None:
        """The gradients of compute 0 (local documents and own blocks)."""
        b = g.buffers
        with self._compute("own"):
            self.backward_calls(self.layout.own_calls, g.saved, b.k, b.v, g.dq, g.dk, g.dv)

    def backward_runs(self, grads: Gradients) -> list[Iterator[None]]:
        """One run per tier, like ``forward_runs``; each step's dK/dV follow one step behind."""
        return [self._backward_tier(tier, grads) for tier in self.layout.tiers]

    def _backward_tier(self, tier: TierLayout, g: Gradients) -> Iterator[None]:
        b = g.buffers
        dtype = compute_dtype(b.q.dtype)
        empty = b.k.new_zeros((0, 2, *b.k.shape[1:]))
        no_grad = empty.to(dtype)  # what a step that holds nothing sends back: nothing
        pending = self._start(tier, tier.steps[0], (b.k, b.v), grad=False)
        yield
        before, returning = None, None
        for step, following in zip(tier.steps, [*tier.steps[1:], None]):
            held = self._received(step, pending, empty)
            if following is not None:
                pending = self._start(tier, following, held, grad=False)
            # A rank outside every ring of the tier at this step still takes part in its
            # exchanges (they are matched in program order), at no cost beyond that.
            dkv = no_grad if held.shape[0] == 0 else self._held_grads(tier, step, held, g, dtype)
            if before is not None:  # the gradient of these blocks from the ranks before this one
                self._add_grads(before, returning, dkv, g.dk, g.dv)
            before, returning = step, self._start(tier, step, dkv, grad=True)
            yield
        self._add_grads(before, returning, None, g.dk, g.dv)

    def _held_grads(self, tier: TierLayout, step: RingStep, held, g: Gradients, dtype):  # noqa: ANN001, ANN202
        """dK and dV of the blocks ``held`` at ``step``, ``(t, 2, nkv, d)`` (dQ goes to ``g``)."""
        block = (held.shape[0], *held.shape[2:])
        dk_held, dv_held = _RowSum(block, dtype, held.device), _RowSum(block, dtype, held.device)
        with self._compute(tier.tier.value):
            self.backward_calls(step.calls, g.saved, *held.unbind(1), g.dq, dk_held, dv_held)
        return torch.stack((dk_held.result(), dv_held.result()), 1)

    def _add_grads(self, step: RingStep, pending: Pending, dkv, dk, dv) -> None:  # noqa: ANN001
        """Add the gradients received in ``step`` to the next held buffer's ``dkv`` (still
        travelling) and to this rank's own ``dk``/``dv`` (home)."""
        got = self._received(step, pending, None)
        into_held, into_own = step.grad_to_next, step.grad_to_own
        if got is None:
            assert into_held is None and into_own is None, "gradient rows that never came"
            return
        dev = got.device
        if into_held is not None:
            assert dkv is not None, "gradient rows for a buffer that no longer exists"
            rows = as_dtype(self._rows(got, into_held.src), dkv.dtype)
            if into_held.dst is None:
                dkv.add_(rows)
            elif isinstance(into_held.dst, slice):
                dkv[into_held.dst].add_(rows)
            else:
                dkv.index_add_(0, self.on(into_held.dst, dev), rows)
        if into_own is not None:
            dk_rows, dv_rows = as_dtype(self._rows(got, into_own.src), dk.dtype).unbind(1)
            dst = self.on(into_own.dst, dev)
            dk.add(dst, dk_rows)
            dv.add(dst, dv_rows)


def _put(x: torch.Tensor, rows: Rows, part: torch.Tensor) -> None:
    """``x[rows] = part`` for ``layout.Rows`` (never ``None`` here: that part is adopted)."""
    if isinstance(rows, slice):
        x[rows] = part
    else:
        x.index_copy_(0, rows, part)


class RingAttentionFunction(torch.autograd.Function):
    """``out_tnd = ring_attention(q_tnd, k_tnd, v_tnd, sink_n)`` for one rank of a plan
    (``sink_n``: per-head sink logits, or ``None``); ``runtime`` is a ``RingRuntime`` or
    anything with its ``forward`` and ``backward``."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sink_n: torch.Tensor | None,
        runtime: RingRuntime,
    ) -> torch.Tensor:
        out, lse, saved = runtime.forward(q, k, v, sink_n)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink_n, *saved)
        ctx.runtime = runtime
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor):  # noqa: ANN205
        q, k, v, out, lse, sink_n, *saved = ctx.saved_tensors
        dq, dk, dv, dsink = ctx.runtime.backward(
            dout.contiguous(), q, k, v, out, lse, tuple(saved), sink_n
        )
        dsink = None if dsink is None else dsink.to(sink_n.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None
