"""How close a distributed result must be to its reference, per dtype.

Errors are measured relative to the size of the reference tensor (max-abs error over max-abs
value), so one tolerance serves outputs and gradients of any scale. Two references:

* ``against="float64"``: dense attention in float64 on the same inputs (rounded to the dtype);
* ``against="same-dtype"``: the same batch on one GPU in the same dtype and kernel, so only the
  order of the float32 (or float64) sums and the final rounding differ.

Full precision: float64 ``1e-10`` (the ring only reorders sums; anything larger is a real bug),
float32 ``1e-5``, against either reference. Half precision follows from the dtype's machine
epsilon ``eps`` (``torch.finfo``: bfloat16 ``2**-7``, float16 ``2**-10``): results are rounded to
the dtype once at the end (half an ``eps`` of the largest value), and kernels that round per-step
partial gradients to the dtype before the float32 sum (flash-attn) add a few half-``eps`` more.
So ``HALF_EPS["float64"] = 4`` epsilons against float64 (bfloat16 ``3.1e-2``, float16 ``3.9e-3``)
and ``HALF_EPS["same-dtype"] = 2`` against one GPU (``1.6e-2``, ``2.0e-3``). Measured on CPU
with the tiled kernel (``docs/BENCHMARKS.md``): at most ``0.45 eps`` against either.
"""

from __future__ import annotations

import torch

__all__ = ["HALF_EPS", "TOLERANCES", "assert_close", "relative_error", "tolerance"]

TOLERANCES: dict[torch.dtype, float] = {torch.float64: 1e-10, torch.float32: 1e-5}
"""Full-precision tolerances (against either reference)."""

HALF_EPS: dict[str, float] = {"float64": 4.0, "same-dtype": 2.0}
"""Half-precision tolerances in machine epsilons of the dtype, per reference."""

HALF = (torch.bfloat16, torch.float16)


def tolerance(dtype: torch.dtype, *, against: str = "float64") -> float:
    """The relative tolerance for results computed from inputs of ``dtype``, compared with a
    float64 reference (``against="float64"``) or one GPU in the same dtype (``"same-dtype"``)."""
    if against not in HALF_EPS:
        raise ValueError(f"no reference called {against!r}; use one of {list(HALF_EPS)}")
    if dtype in HALF:
        return HALF_EPS[against] * torch.finfo(dtype).eps
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance defined for {dtype}; use one of {[*TOLERANCES, *HALF]}")
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
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    dtype: torch.dtype,
    name: str = "result",
    against: str = "float64",
) -> None:
    """Raise ``AssertionError`` when ``actual`` is further from ``expected`` than ``dtype``
    allows (against a float64 reference, or ``against="same-dtype"``)."""
    err = relative_error(actual, expected)
    tol = tolerance(dtype, against=against)
    assert err <= tol, f"{name}: relative error {err:.3e} exceeds {tol:.0e} for {dtype}"
