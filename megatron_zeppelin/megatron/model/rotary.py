"""Rotary position embedding with per-document positions.

Packed training restarts positions at every document, and Zeppelin scatters a document's tokens
over GPUs, so a token's rotary angle must come from its position inside its own document, not
from where it sits in a rank's buffer. The model is therefore built without Megatron's rotary
module (``position_embedding_type='none'``) and Zeppelin's core attention applies RoPE here, to
the query and key rows it receives, with positions the plan defines (``positions_of_ranges``).

The maths is Megatron's (``RotaryEmbedding`` and ``apply_rotary_pos_emb`` of megatron-core),
with every option it has for GPT models (``Rope``, built from the flags by ``Rope.from_args``):

* the rotated part of a head is cut into halves ``(x1, x2)`` and becomes ``(x1 cos - x2 sin,
  x2 cos + x1 sin)``; with ``--rotary-interleaved`` the pairs are neighbours ``(x[2i],
  x[2i+1])`` instead;
* pair ``i`` turns at frequency ``base ** (-2i / rot_dim)`` (``--rotary-base``), computed in
  float32 as Megatron does; ``--rotary-percent p`` rotates only the leading ``rot_dim = head_dim
  * p`` features;
* ``--use-rope-scaling`` (Llama 3.x) divides the low frequencies by ``--rope-scaling-factor``,
  keeps the high ones and blends those between, with the constants megatron-core fixes: low-
  and high-frequency factors 1 and 4, original context 8192 positions (``llama3_frequencies``);
* ``--rotary-seq-len-interpolation-factor f`` turns position ``p`` by the angle of ``p / f``.

Shapes: ``t`` tokens, ``n`` heads, ``d`` head dim; ``x_tnd`` may carry extra middle dims (Megatron's
``[s, b, n, d]`` with ``b = 1``): positions index the leading dim.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_zeppelin.planner.plan.plan import TokenRange


def positions_of_ranges(ranges: Iterable[TokenRange]) -> torch.Tensor:
    """Position inside its document of every row of a buffer made of ``ranges`` (int64, ``t``)."""
    parts = [torch.arange(r.start, r.end, dtype=torch.long) for r in ranges]
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(parts)


@dataclass(frozen=True)
class Rope:
    """Megatron's rotary settings for GPT models (see the module docstring)."""

    base: float = 10000.0
    """``--rotary-base``."""
    percent: float = 1.0
    """``--rotary-percent``: the share of each head's features that rotates."""
    interleaved: bool = False
    """``--rotary-interleaved``: rotate neighbouring features, not the two halves."""
    seq_len_interpolation_factor: float | None = None
    """``--rotary-seq-len-interpolation-factor``: positions are divided by it."""
    scaling_factor: float | None = None
    """``--rope-scaling-factor`` when ``--use-rope-scaling`` is given (Llama 3.x), else ``None``."""

    def __post_init__(self) -> None:
        if not 0.0 < self.percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.percent}")
        for name in ("seq_len_interpolation_factor", "scaling_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"the rotary {name.replace('_', ' ')} must be positive: {value}")

    @classmethod
    def from_args(cls, args: Any) -> Rope:
        """The settings Megatron's ``GPTModel`` takes from parsed arguments."""
        return cls(
            base=float(getattr(args, "rotary_base", 10000)),
            percent=float(getattr(args, "rotary_percent", 1.0)),
            interleaved=bool(getattr(args, "rotary_interleaved", False)),
            seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
            scaling_factor=(
                float(getattr(args, "rope_scaling_factor", 8.0))
                if getattr(args, "use_rope_scaling", False)
                else None
            ),
        )

    def inverse_frequencies(self, rot_dim: int, *, dtype: torch.dtype, device: Any = None):  # noqa: ANN201
        """``(rot_dim / 2,)`` angular frequencies in ``dtype``, scaled when asked."""
        arange = torch.arange(0, rot_dim, 2, dtype=dtype, device=device)
        inv_freq = 1.0 / (self.base ** (arange / rot_dim))
        if self.scaling_factor is not None:
            inv_freq = llama3_frequencies(inv_freq, self.scaling_factor)
        return inv_freq


MEGATRON_DEFAULT = Rope()
"""Megatron's default rotary settings (base 10000, every feature, halves, no scaling)."""

LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_POSITIONS = 8192
"""The Llama 3.x scaling constants, fixed in megatron-core (only the factor is a flag)."""


def llama3_frequencies(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.x frequency scaling: wavelengths over ``LLAMA3_ORIGINAL_POSITIONS /
    LLAMA3_LOW_FREQ_FACTOR`` slow down by ``factor``, those under ``... /
    LLAMA3_HIGH_FREQ_FACTOR`` stay, those between blend linearly in ``context / wavelength``.
    Computed in the order megatron-core computes it, so float32 results agree to the bit."""
    context, low, high = LLAMA3_ORIGINAL_POSITIONS, LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR
    wavelength = 2 * math.pi / inv_freq
    slowed = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = ~(wavelength < context / high) * ~(wavelength > context / low)
    return torch.where(medium, blended, slowed)


def rotary_dim(head_dim: int, rotary_percent: float = 1.0) -> int:
    """Features of a head that rotate; even, as the halves pair up."""
    if not 0.0 < rotary_percent <= 1.0:
        raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}")
    rot = int(head_dim * rotary_percent)
    if rot < 2 or rot % 2:
        raise ValueError(
            f"rotary dimension {rot} (head_dim {head_dim} x rotary_percent {rotary_percent}) "
            "must be an even number >= 2; change rotary_percent or the head size"
        )
    return rot


def rotary_cos_sin(
    positions_t: torch.Tensor,
    rot_dim: int,
    rope: Rope | None = None,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` tables of shape ``(t, rot_dim)`` (each angle twice: halves repeated,
    or neighbours with ``rope.interleaved``), computed in ``dtype`` (float32 as Megatron does;
    float64 for float64 inputs)."""
    rope = rope or MEGATRON_DEFAULT
    inv_freq = rope.inverse_frequencies(rot_dim, dtype=dtype, device=positions_t.device)
    positions = positions_t.to(dtype)
    if rope.seq_len_interpolation_factor is not None:
        positions = positions * (1 / rope.seq_len_interpolation_factor)
    angles_tf = positions[:, None] * inv_freq[None, :]
    if rope.interleaved:
        angles_tr = angles_tf.repeat_interleave(2, dim=-1)
    else:
        angles_tr = torch.cat([angles_tf, angles_tf], dim=-1)
    return angles_tr.cos(), angles_tr.sin()


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation's sine partner of every feature: ``(-x2, x1)`` of the halves, or of each
    neighbouring pair when ``interleaved``."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)
    pairs = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1)
    return pairs.flatten(-2)


def apply_rotary(
    x_tnd: torch.Tensor, positions_t: torch.Tensor, rope: Rope | None = None
) -> torch.Tensor:
    """Rotate every row of ``x_tnd`` by its own position (``rope``: Megatron's settings, its
    defaults when ``None``); differentiable, same dtype out."""
    if x_tnd.shape[0] != positions_t.shape[0]:
        raise ValueError(
            f"{x_tnd.shape[0]} rows but {positions_t.shape[0]} positions: give one position per "
            "token of the buffer"
        )
    rope = rope or MEGATRON_DEFAULT
    head_dim = x_tnd.shape[-1]
    rot = rotary_dim(head_dim, rope.percent)
    compute = torch.float64 if x_tnd.dtype == torch.float64 else torch.float32
    cos, sin = rotary_cos_sin(positions_t, rot, rope, dtype=compute)
    # Broadcast the (t, rot) tables over every dim between tokens and features.
    view = (x_tnd.shape[0],) + (1,) * (x_tnd.dim() - 2) + (rot,)
    cos, sin = cos.view(view), sin.view(view)
    x_rot, x_pass = x_tnd[..., :rot], x_tnd[..., rot:]
    x_f = x_rot.to(compute)
    out = (x_f * cos + _rotate_half(x_f, rope.interleaved) * sin).to(x_tnd.dtype)
    if rot == head_dim:
        return out
    return torch.cat([out, x_pass], dim=-1)
