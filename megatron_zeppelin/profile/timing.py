"""Wall-clock timing of one callable on CPU or CUDA: warmup, repeats, median.

On CUDA a call is bracketed by events and the stream is synchronized before the clock is read,
so queued kernels are counted; on CPU ``time.perf_counter`` is exact enough because every op
runs to completion before it returns. The median (not the mean) is reported: a CPU shared with
other processes, or a GPU clock ramping up, produces rare slow outliers that the mean would
spread over every figure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TimingOptions:
    """How often each measured call runs."""

    warmup: int = 2
    """Untimed calls first (allocator, kernel selection, caches)."""
    repeats: int = 5
    """Timed calls; the median is reported."""
    min_seconds: float = 0.0
    """Keep repeating (beyond ``repeats``) until this much time was measured, for tiny calls
    whose single timing is dominated by clock resolution."""
    max_repeats: int = 200
    """Upper bound on timed calls whatever ``min_seconds`` asks."""

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_repeats < self.repeats:
            raise ValueError(
                f"max_repeats ({self.max_repeats}) must be at least repeats ({self.repeats})"
            )


DEFAULT_TIMING = TimingOptions()


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], object],
    *,
    device: torch.device,
    options: TimingOptions = DEFAULT_TIMING,
    setup: Callable[[], object] | None = None,
) -> float:
    """Median seconds of ``fn()`` over ``options.repeats`` timed calls.

    ``setup`` runs untimed before every call (for example a forward pass whose backward is the
    timed part); its result is passed to nothing, so it should stash what ``fn`` needs.
    """
    for _ in range(options.warmup):
        if setup is not None:
            setup()
        fn()
    synchronize(device)
    samples: list[float] = []
    total = 0.0
    while len(samples) < options.repeats or (
        total < options.min_seconds and len(samples) < options.max_repeats
    ):
        if setup is not None:
            setup()
        samples.append(_one_call(fn, device))
        total += samples[-1]
    return statistics.median(samples)


def _one_call(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        synchronize(device)  # the setup's kernels must not be counted
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype from its short name (``float32``, ``bf16``, ``fp16``...)."""
    if isinstance(name, torch.dtype):
        return name
    aliases = {
        "float32": torch.float32, "fp32": torch.float32,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
        "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
        "float64": torch.float64, "fp64": torch.float64,
    }  # fmt: skip
    if name not in aliases:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(sorted(aliases))}")
    return aliases[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16`` (the name written into calibration files)."""
    return str(dtype).removeprefix("torch.")
