"""Attention curves per kernel: which kernels a calibration measured, how they rank, and the cost
model of the kernel each system would run ("as deployed").

A calibration file carries the curves of every attention kernel its profile measured
(``Calibration.kernels``; the top-level curves are those of ``Calibration.kernel``). From them:

* ``speed_order``: the measured kernels, fastest first, by the predicted forward+backward time
  of ``REFERENCE_BLOCKS`` (causal documents and unmasked blocks of 1K, 4K and 16K queries for the
  model planned). ``auto`` takes the first of them that runs (``attention.kernels.kernels``);
* ``deployed``: one cost model per system, priced with the curve of the kernel it runs. Zeppelin
  runs what ``auto`` picks from the measurements (the fastest measured kernel); TransformerEngine
  ring CP and the other baselines that run inside Megatron-LM run TE's fused attention
  (``baselines.BASELINE_KERNELS``). Where TE's kernel was not measured but the profile timed dense
  ``scaled_dot_product_attention`` beside its kernel (every CUDA profile does, on causal
  documents), dense SDPA stands in for it: PyTorch runs cuDNN's fused kernels there on Hopper,
  the same kernels TE calls. The stand-in is the measured kernel's curves at SDPA's speed: their
  peak rate times the median ratio of the kernel's time to SDPA's over the documents of
  ``STAND_IN_TOKENS`` or more (shorter ones are timed with the harness's autograd call around
  SDPA, which a varlen call does not pay), overhead and short-block loss unchanged. Its note says
  so wherever it is used.

Pure: no torch, no process group.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, replace

from megatron_zeppelin.planner.baselines.baselines import BASELINE_KERNELS
from megatron_zeppelin.planner.cost.calibration import Calibration, ComputeFigure, KernelCurves
from megatron_zeppelin.planner.cost.costmodel import CostModel, causal_pairs
from megatron_zeppelin.planner.cost.models import ModelSpec

__all__ = [
    "REFERENCE_BLOCKS",
    "STAND_IN_TOKENS",
    "TE_KERNEL",
    "Deployment",
    "Priced",
    "deployed",
    "measured_curves",
    "rank_curves",
    "sdpa_stand_in",
    "speed_order",
]

TE_KERNEL = "te"
"""TransformerEngine's fused attention, the kernel TE ring CP runs
(``attention/kernels/kernel_te.py``)."""
REFERENCE_BLOCKS = ((1024, True), (4096, True), (16384, True), (1024, False), (4096, False),
                    (16384, False))  # fmt: skip
"""``(queries, causal)`` of the square blocks kernels are ranked by."""
STAND_IN_TOKENS = 4096
SAME_CLASS = {"flash": ("torch-flash",), "torch-flash": ("flash",), "flash3": ("torch-fa3",),
              "torch-fa3": ("flash3",)}  # fmt: skip
"""Kernels that run the same code by another route: one's curve prices the other's where only
one was measured (flash-attn 2's kernels are PyTorch's FlashAttention-2 operators)."""


def measured_curves(cal: Calibration) -> dict[str, KernelCurves]:
    """The curves of every kernel ``cal`` measured by name (the top-level ones under
    ``cal.kernel`` when ``kernels`` does not repeat them)."""
    curves = dict(cal.kernels)
    if cal.kernel is not None and cal.kernel not in curves and cal.attention is not None:
        curves[cal.kernel] = KernelCurves(cal.attention, cal.attention_diagonal)
    return curves


def _reference_seconds(curves: KernelCurves, model: ModelSpec) -> float:
    total = 0.0
    for n, causal in REFERENCE_BLOCKS:
        figure = curves.diagonal if causal else curves.attention
        pairs = causal_pairs(0, n, 0, n) if causal else n * n
        total += figure.fit.time(pairs * model.attn_flops_per_pair(), n)
    return total


def rank_curves(curves: Mapping[str, KernelCurves], model: ModelSpec) -> list[str]:
    """Kernel names fastest first by their curves' time of ``REFERENCE_BLOCKS`` for ``model``."""
    return sorted(curves, key=lambda name: _reference_seconds(curves[name], model))


def speed_order(cal: Calibration, model: ModelSpec) -> list[str]:
    """The kernels ``cal`` measured, fastest first (``rank_curves``)."""
    return rank_curves(measured_curves(cal), model)


def _scaled(figure: ComputeFigure | None, factor: float) -> ComputeFigure | None:
    if figure is None:
        return None
    fit = replace(figure.fit, flops_per_s=figure.fit.flops_per_s * factor)
    return ComputeFigure((), fit)


def sdpa_stand_in(cal: Calibration) -> tuple[KernelCurves, str] | None:
    """TE's stand-in curves from dense SDPA's times in ``cal``'s profile, and the sentence saying
    so; ``None`` where the file has no SDPA times (module docstring)."""
    points = (cal.extra.get("profile") or {}).get("attention") or []
    # The SDPA time sits on the first kernel's point; compare it with the file's kernel's own.
    sdpa = {p["num_q"]: p["sdpa_s"] for p in points if p.get("sdpa_s") and p.get("num_docs") == 1}
    ratios = [
        (p["forward_s"] + p["backward_s"]) / sdpa[p["num_q"]]
        for p in points
        if p.get("causal") and p.get("num_docs") == 1 and p.get("num_q", 0) >= STAND_IN_TOKENS
        and p["num_q"] in sdpa and p.get("kernel", cal.kernel) == cal.kernel
    ]  # fmt: skip
    if not ratios or cal.attention is None:
        return None
    ratio = statistics.median(ratios)
    kernel = cal.kernel or "the profiled kernel"
    curves = KernelCurves(_scaled(cal.attention, ratio), _scaled(cal.attention_diagonal, ratio))
    note = (
        f"dense SDPA stands in for TE's kernel (not measured): {kernel}'s curves at SDPA's "
        f"speed, x{ratio:.2f} (median over {len(ratios)} causal documents of "
        f"{STAND_IN_TOKENS // 1024}K tokens or more)"
    )
    return curves, note


@dataclass(frozen=True)
class Priced:
    """One system as deployed: the kernel it runs, its cost model, where the curve comes from."""

    kernel: str
    cost_model: CostModel
    note: str


@dataclass(frozen=True)
class Deployment:
    """The cost model each system is priced with as deployed."""

    zeppelin_kernel: str
    builders: dict[str, Priced]
    """Builder -> how it is priced; a builder not named keeps the base model."""
    unpriced: str = ""
    """Why some or all builders keep the base model (no calibration, a kernel not measured)."""

    def cost_model(self, builder: str, base: CostModel) -> CostModel:
        return self.builders[builder].cost_model if builder in self.builders else base

    def kernel(self, builder: str) -> str | None:
        return self.builders[builder].kernel if builder in self.builders else None


def _priced(base: CostModel, kernel: str, curves: KernelCurves, source: str, note: str) -> Priced:
    cost = base.with_figures(
        source, attention=curves.attention.fit, attention_diagonal=curves.diagonal.fit
    )
    return Priced(kernel, cost, note)


def deployed(
    base: CostModel,
    cal: Calibration | None,
    *,
    source: str,
    builders: Mapping[str, str] | None = None,
) -> Deployment:
    """Per builder, the cost model of the kernel it runs (module docstring): Zeppelin the fastest
    kernel ``cal`` measured, each baseline its ``BASELINE_KERNELS`` entry, priced from ``cal``'s
    curve of that kernel, of a kernel running the same code, or TE's SDPA stand-in. Without a
    calibration, or for a kernel it has no curve for, the base model (``unpriced`` says so)."""
    wanted = dict(BASELINE_KERNELS if builders is None else builders)
    if cal is None:
        return Deployment("auto", {}, "no calibration: every system keeps the one curve")
    measured = measured_curves(cal)
    curves = {name: (c, f"measured in {source}") for name, c in measured.items()}
    if TE_KERNEL not in curves:
        stand_in = sdpa_stand_in(cal)
        if stand_in is not None:
            curves[TE_KERNEL] = stand_in
    order = speed_order(cal, base.model)
    chosen: dict[str, Priced] = {}
    missing = []
    if order:
        fastest = order[0]
        curve, note = curves[fastest]
        label = f"{source} ({fastest})"
        chosen["zeppelin"] = _priced(base, fastest, curve, label, f"fastest {note}")
    else:
        fastest = cal.kernel or "the profiled kernel"
        missing.append(f"zeppelin: {source} names no kernel")
    for builder, kernel in wanted.items():
        name = next((k for k in (kernel, *SAME_CLASS.get(kernel, ())) if k in curves), None)
        if name is None:
            missing.append(f"{builder}: {kernel} not measured in {source}")
            continue
        curve, note = curves[name]
        if name != kernel:
            note = f"{name}'s curve (the same kernels), {note}"
        label = f"{source} ({name if name in measured else name + ' stand-in'})"
        chosen[builder] = _priced(base, kernel, curve, label, note)
    unpriced = f"{'; '.join(missing)}: priced with the one curve" if missing else ""
    return Deployment(fastest, chosen, unpriced)
