"""Rotary position embedding with per-document positions.

Packed training restarts positions at every document, and Zeppelin scatters a document's tokens
over GPUs, so a token's rotary angle must come from its position inside its own document, not
from where it sits in a rank's buffer. The model is therefore built without Megatron's rotary
module (``position_embedding_type='none'``) and Zeppelin's core attention applies RoPE here, to
the query and key rows it receives, with positions the plan defines (``positions_of_ranges``).

The convention is Megatron's default (not interleaved): the rotated part of a head is cut into
halves ``(x1, x2)`` and becomes ``(x1 cos - x2 sin, x2 cos + x1 sin)``, with frequency
``base ** (-2i / rot_dim)`` for pair ``i``; ``rotary_percent < 1`` rotates only the leading
``rot_dim = head_dim * rotary_percent`` features, as Megatron does.

Shapes: ``t`` tokens, ``n`` heads, ``d`` head dim; ``x_tnd`` may carry extra middle dims (Megatron's
``[s, b, n, d]`` with ``b = 1``): positions index the leading dim.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_zeppelin.planner.plan import TokenRange


def positions_of_ranges(ranges: Iterable[TokenRange]) -> torch.Tensor:
    """Position inside its document of every row of a buffer made of ``ranges`` (int64, ``t``)."""
    parts = [torch.arange(r.start, r.end, dtype=torch.long) for r in ranges]
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat(parts)


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
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` tables of shape ``(t, rot_dim)`` (halves repeated), computed in
    ``dtype`` (float32 as Megatron does; float64 for float64 inputs)."""
    arange = torch.arange(0, rot_dim, 2, dtype=dtype, device=positions_t.device)
    inv_freq = 1.0 / (base ** (arange / rot_dim))
    angles_tf = positions_t.to(dtype)[:, None] * inv_freq[None, :]
    angles_tr = torch.cat([angles_tf, angles_tf], dim=-1)
    return angles_tr.cos(), angles_tr.sin()


def apply_rotary(
    x_tnd: torch.Tensor,
    positions_t: torch.Tensor,
    *,
    base: float = 10000.0,
    rotary_percent: float = 1.0,
) -> torch.Tensor:
    """Rotate every row of ``x_tnd`` by its own position; differentiable, same dtype out."""
    if x_tnd.shape[0] != positions_t.shape[0]:
        raise ValueError(
            f"{x_tnd.shape[0]} rows but {positions_t.shape[0]} positions: give one position per "
            "token of the buffer"
        )
    head_dim = x_tnd.shape[-1]
    rot = rotary_dim(head_dim, rotary_percent)
    compute = torch.float64 if x_tnd.dtype == torch.float64 else torch.float32
    cos, sin = rotary_cos_sin(positions_t, rot, base=base, dtype=compute)
    # Broadcast the (t, rot) tables over every dim between tokens and features.
    view = (x_tnd.shape[0],) + (1,) * (x_tnd.dim() - 2) + (rot,)
    cos, sin = cos.view(view), sin.view(view)
    x_rot, x_pass = x_tnd[..., :rot], x_tnd[..., rot:]
    x_f = x_rot.to(compute)
    x1, x2 = x_f.chunk(2, dim=-1)
    rotated_half = torch.cat([-x2, x1], dim=-1)
    out = (x_f * cos + rotated_half * sin).to(x_tnd.dtype)
    if rot == head_dim:
        return out
    return torch.cat([out, x_pass], dim=-1)
