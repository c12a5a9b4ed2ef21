"""How close a distributed result must be to the float64 reference, per dtype.

Errors are measured relative to the size of the reference tensor (max-abs error over max-abs
value), so one tolerance serves outputs and gradients of any scale:

* float64: ``1e-10`` (the ring only reorders sums; anything larger is a real bug);
* float32: ``1e-5``;
* bfloat16 / float16: ``2e-2`` / ``5e-3`` (8 and 11 mantissa bits, float32 accumulation).
"""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "assert_close", "relative_error", "tolerance"]

TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 5e-3,
}


def tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance for results computed from inputs of ``dtype``."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance defined for {dtype}; use one of {list(TOLERANCES)}")
    return TOLERANCES[dtype]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual - expected| / max|expected|`` in float64 (0 for two empty tensors)."""
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if expected.numel() == 0:
        return 0.0
    a, e = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    scale = e.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float((a - e).abs().max() / scale)


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype, name: str = "result"
) -> None:
    """Raise ``AssertionError`` when ``actual`` is further from ``expected`` than ``dtype``
    allows."""
    err = relative_error(actual, expected)
    tol = tolerance(dtype)
    assert err <= tol, f"{name}: relative error {err:.3e} exceeds {tol:.0e} for {dtype}"
