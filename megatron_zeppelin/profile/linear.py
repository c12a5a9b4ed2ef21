"""Measured time of one layer's linear modules (QKV, projection, SwiGLU MLP), forward+backward.

The cost model charges ``linear_time(n)`` for the GEMMs of one layer on ``n`` tokens (see
``ModelSpec.linear_flops_per_token``). Here the same GEMMs run for real at several token counts:
``x_th`` goes through the QKV and MLP-in weights, the attention output through the projection,
the SwiGLU product through the MLP-out weight, and the backward computes input and weight
gradients of all four. Each point records the FLOPs the cost model assigns to it, so a fitted
``Efficiency`` reproduces ``linear_time`` directly.

Shape suffixes: ``t`` tokens, ``h`` hidden size, ``f`` FFN size, ``q`` QKV output width; all
widths divided by the model's tensor-parallel size, as one Zeppelin rank holds a TP shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_zeppelin.planner.cost.models import ModelSpec
from megatron_zeppelin.profile.timing import DEFAULT_TIMING, TimingOptions, median_seconds

DEFAULT_CPU_TOKENS = (64, 256, 1024, 2048, 4096)
DEFAULT_GPU_TOKENS = (256, 1024, 4096, 16384, 65536)


@dataclass(frozen=True)
class LinearPoint:
    """One measured token count."""

    num_tokens: int
    flops: float
    """Forward+backward FLOPs the cost model assigns to these tokens."""
    forward_s: float
    backward_s: float

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s


class LayerGemms:
    """Weights of one layer's GEMMs and the forward/backward that exercise them."""

    def __init__(
        self, model: ModelSpec, num_tokens: int, *, device: torch.device, dtype: torch.dtype
    ):
        tp = model.tensor_parallel
        h = model.hidden_size
        kv = model.num_kv_heads * model.head_dim
        q_width = (h + 2 * kv) // tp  # column parallel: output dim sharded
        f = model.ffn_hidden_size // tp
        h_in = h // tp  # row parallel: input dim sharded
        make = lambda *shape: (  # noqa: E731 - small, used four times below
            torch.randn(*shape, device=device, dtype=dtype) * shape[-1] ** -0.5
        ).requires_grad_()
        self.w_qkv_qh = make(q_width, h)
        self.w_proj_hh = make(h, h_in)
        self.w_in_2fh = make(2 * f, h)  # gate and up projections fused, as Megatron does
        self.w_out_hf = make(h, f)
        self.x_th = torch.randn(num_tokens, h, device=device, dtype=dtype, requires_grad=True)
        self.attn_th = torch.randn(num_tokens, h_in, device=device, dtype=dtype, requires_grad=True)
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.grads: tuple[torch.Tensor, ...] = ()

    def forward(self) -> None:
        qkv_tq = F.linear(self.x_th, self.w_qkv_qh)
        proj_th = F.linear(self.attn_th, self.w_proj_hh)
        gate_tf, up_tf = F.linear(self.x_th, self.w_in_2fh).chunk(2, dim=-1)
        mlp_th = F.linear(F.silu(gate_tf) * up_tf, self.w_out_hf)
        self.outputs = (qkv_tq, proj_th, mlp_th)
        if len(self.grads) != len(self.outputs):
            self.grads = tuple(torch.randn_like(o) for o in self.outputs)

    def backward(self) -> None:
        torch.autograd.backward(self.outputs, self.grads)
        self.outputs = ()
        for p in (
            self.w_qkv_qh,
            self.w_proj_hh,
            self.w_in_2fh,
            self.w_out_hf,
            self.x_th,
            self.attn_th,
        ):
            p.grad = None


def _then(first: Callable[[], object], second: Callable[[], object] | None) -> Callable[[], None]:
    """``first()`` then ``second()``: the forward a timed backward needs, then the barrier."""

    def both() -> None:
        first()
        if second is not None:
            second()

    return both


def measure_linear(
    model: ModelSpec,
    *,
    token_counts: Sequence[int] = DEFAULT_CPU_TOKENS,
    device: torch.device,
    dtype: torch.dtype,
    timing: TimingOptions = DEFAULT_TIMING,
    before_point: Callable[[], object] | None = None,
) -> list[LinearPoint]:
    """Time the GEMMs of one layer of ``model`` at each token count (see the module docstring).

    ``before_point`` runs untimed before every timed call (a barrier keeps emulated ranks in
    lockstep, so each call is measured with all ranks busy).
    """
    if not token_counts:
        raise ValueError("give at least one token count to measure the linear modules at")
    if any(n < 1 for n in token_counts):
        raise ValueError(f"token counts must be >= 1, got {list(token_counts)}")
    points = []
    for n in token_counts:
        gemms = LayerGemms(model, n, device=device, dtype=dtype)
        forward_s = median_seconds(gemms.forward, device=device, options=timing, setup=before_point)
        gemms.outputs = ()  # drop the last forward's graph before timing backward
        backward_s = median_seconds(
            gemms.backward, device=device, options=timing, setup=_then(gemms.forward, before_point)
        )
        points.append(
            LinearPoint(
                num_tokens=n,
                flops=n * model.linear_flops_per_token(),
                forward_s=forward_s,
                backward_s=backward_s,
            )
        )
        del gemms
    return points
