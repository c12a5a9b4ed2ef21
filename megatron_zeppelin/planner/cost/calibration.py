"""Calibration files: measured kernel and link speeds that replace the cost model's defaults.

A profiler measures, on one machine, attention and linear kernels at several token counts and
transfers over NVLink, NICs and the all-to-all at several message sizes, then fits the cost
model's curve forms to the points (``fit_efficiency``, ``fit_link``). The file keeps the points
and the fits, and says what was measured, so a file from another model, dtype or device is
refused rather than silently mis-planning. Format (JSON, every section but the header optional)::

    {"format": "zeppelin-calibration/1", "device": "NVIDIA H100 80GB HBM3", "machine": "node-17",
     "dtype": "bf16", "model": {"hidden_size": 4096, "num_heads": 32, ...} or null,
     "versions": {"torch": "2.5.1"}, "date": "2025-06-01T12:00:00Z",
     "attention": {"points": [[num_tokens, flops, seconds], ...],
                   "fit": {"flops_per_s": ..., "half_tokens": ..., "overhead_s": ...,
                           "fall_tokens": ... or null},
                   "fit_error": 0.07},
     "attention_diagonal": {...same...},
     "kernel": "te",
     "kernels": {"te": {"attention": {...}, "attention_diagonal": {...}},
                 "torch-flash": {...}},
     "linear": {...same...},
     "links": {"nvlink": {"points": [[num_bytes, seconds], ...],
                          "fit": {"bytes_per_s": ..., "latency_s": ...}, "fit_error": ...},
               "nic": {...}, "alltoall": {...}},
     "profile": {...}}

``attention`` holds unmasked blocks, ``attention_diagonal`` blocks cut by the causal diagonal
(``costmodel``); a file without ``attention_diagonal`` prices both with ``attention``. Those two
are the curves of the attention kernel named by ``kernel`` (the one ``auto`` picks from the
measurements); ``kernels`` holds the two curves of every kernel the profile measured, that one
included (``KernelCurves``; ``planner/baselines/kernel_curves.py`` ranks them and prices each system
with the kernel it runs). Files written before these two fields load with ``kernel`` null (not
recorded) and no ``kernels``. A compute
point's ``num_tokens`` is the query count of one block and ``flops`` the whole call's: a call that
packs several equal blocks is one point (the cost model charges each block at its own rate and
the overhead once, so such a point fits the same curve); it carries a fourth number, the call's
query count ``[num_tokens, flops, seconds, call_tokens]``, for the fall term. ``fit_error`` is
the relative RMS error of the fit over the points, written for readers and recomputed on load.
``model: null`` means the figures do not depend on the model (a FLOP-rate measurement). Any
other top-level section (the profiler's ``profile``: settings, load average, per-point details)
is kept verbatim in ``Calibration.extra`` and written back by ``save_calibration``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_zeppelin.fileio import atomic_write_text
from megatron_zeppelin.planner.cost.costmodel import CostModel, Efficiency, LinkCost
from megatron_zeppelin.planner.cost.models import ModelSpec

CALIBRATION_FORMAT = "zeppelin-calibration/1"
LINK_NAMES = ("nvlink", "nic", "alltoall")
COMPUTE_NAMES = ("attention", "attention_diagonal", "linear")
_HEADER = (
    "format", "device", "machine", "dtype", "model", "versions", "date", "links", "kernel",
    "kernels",
)  # fmt: skip
# Model dimensions that change per-layer kernel shapes; a file measured with other values is
# refused. num_layers and vocab_size do not enter per-layer figures.
MODEL_DIMS = (
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "tensor_parallel",
)
_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}  # fmt: skip


@dataclass(frozen=True)
class ComputeFigure:
    """Measured kernel calls ``(num_tokens, flops, seconds[, call_tokens])`` and the fitted
    curve; ``call_tokens`` (default ``num_tokens``) for calls packing several blocks."""

    points: tuple[tuple[int, float, float] | tuple[int, float, float, int], ...]
    fit: Efficiency

    @property
    def fit_error(self) -> float | None:
        """Relative RMS error of ``fit`` over ``points`` (``None`` without points)."""
        return relative_rms(
            [(self.fit.time(p[1], p[0], call_tokens=_call_tokens(p)), p[2]) for p in self.points]
        )


def _call_tokens(point: Sequence[float]) -> int:
    return int(point[3]) if len(point) > 3 else int(point[0])


@dataclass(frozen=True)
class KernelCurves:
    """One attention kernel's two curves: unmasked blocks, and blocks cut by the diagonal
    (``None``: priced like unmasked ones)."""

    attention: ComputeFigure
    attention_diagonal: ComputeFigure | None = None

    @property
    def diagonal(self) -> ComputeFigure:
        return self.attention_diagonal or self.attention


@dataclass(frozen=True)
class LinkFigure:
    """Measured transfers ``(num_bytes, seconds)`` and the fitted line."""

    points: tuple[tuple[int, float], ...]
    fit: LinkCost

    @property
    def fit_error(self) -> float | None:
        """Relative RMS error of ``fit`` over ``points`` (``None`` without points)."""
        return relative_rms([(self.fit.time(b), s) for b, s in self.points])


def relative_rms(pairs: Iterable[tuple[float, float]]) -> float | None:
    """``sqrt(mean(((predicted - measured) / measured)^2))`` over ``(predicted, measured)``."""
    errors = [(p - m) / m for p, m in pairs if m > 0]
    if not errors:
        return None
    return float(np.sqrt(np.mean(np.square(errors))))


@dataclass(frozen=True)
class Calibration:
    """One machine's measured figures; see the module docstring for the file format."""

    device: str
    machine: str
    dtype: str
    model: dict[str, int] | None
    versions: dict[str, str] = field(default_factory=dict)
    date: str = ""
    attention: ComputeFigure | None = None
    linear: ComputeFigure | None = None
    links: dict[str, LinkFigure] = field(default_factory=dict)
    attention_diagonal: ComputeFigure | None = None
    """Blocks cut by the causal diagonal; ``None``: ``attention`` prices them."""
    kernel: str | None = None
    """The attention kernel ``attention``/``attention_diagonal`` measure (``None``: a file that
    does not say)."""
    kernels: dict[str, KernelCurves] = field(default_factory=dict)
    """Every attention kernel measured, by its registry name."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Top-level sections the format does not define (the profiler's ``profile``), verbatim."""

    def to_dict(self) -> dict[str, Any]:
        extra = {k: v for k, v in self.extra.items() if k not in (*_HEADER, *COMPUTE_NAMES)}
        return {
            "format": CALIBRATION_FORMAT,
            "device": self.device,
            "machine": self.machine,
            "dtype": self.dtype,
            "model": self.model,
            "versions": dict(self.versions),
            "date": self.date,
            "attention": _compute_dict(self.attention),
            "attention_diagonal": _compute_dict(self.attention_diagonal),
            "kernel": self.kernel,
            "kernels": {
                name: {
                    "attention": _compute_dict(curves.attention),
                    "attention_diagonal": _compute_dict(curves.attention_diagonal),
                }
                for name, curves in self.kernels.items()
            },
            "linear": _compute_dict(self.linear),
            "links": {
                name: {
                    "points": [list(p) for p in fig.points],
                    "fit": {"bytes_per_s": fig.fit.bytes_per_s, "latency_s": fig.fit.latency_s},
                    "fit_error": fig.fit_error,
                }
                for name, fig in self.links.items()
            },
            **extra,
        }

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "calibration file") -> Calibration:
        """Parse and check a calibration; ``ValueError`` names the field that is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != CALIBRATION_FORMAT:
            got = data.get("format")
            raise ValueError(f"{where}: field 'format' must be {CALIBRATION_FORMAT!r}, got {got!r}")
        strings = {}
        for key in ("device", "machine", "dtype"):
            strings[key] = _field(data, key, str, where)
        model = data.get("model")
        if model is not None:
            if not isinstance(model, dict):
                raise ValueError(f"{where}: field 'model' must be an object of dimensions or null")
            for key in MODEL_DIMS:
                if key in model and not (isinstance(model[key], int) and model[key] >= 1):
                    raise ValueError(f"{where}: field 'model.{key}' must be a positive integer")
        versions = data.get("versions") or {}
        if not isinstance(versions, dict):
            raise ValueError(f"{where}: field 'versions' must be an object")
        links_data = data.get("links") or {}
        if not isinstance(links_data, dict):
            raise ValueError(f"{where}: field 'links' must be an object")
        unknown = sorted(set(links_data) - set(LINK_NAMES))
        if unknown:
            raise ValueError(f"{where}: field 'links' names unknown links {unknown}")
        return cls(
            device=strings["device"],
            machine=strings["machine"],
            dtype=strings["dtype"],
            model=dict(model) if model is not None else None,
            versions={str(k): str(v) for k, v in versions.items()},
            date=str(data.get("date") or ""),
            attention=_compute_figure(data.get("attention"), "attention", where),
            attention_diagonal=_compute_figure(
                data.get("attention_diagonal"), "attention_diagonal", where
            ),
            linear=_compute_figure(data.get("linear"), "linear", where),
            kernel=_kernel_name(data.get("kernel"), where),
            kernels=_kernel_curves(data.get("kernels"), where),
            links={
                name: _link_figure(links_data[name], f"links.{name}", where)
                for name in LINK_NAMES
                if links_data.get(name) is not None
            },
            extra={k: v for k, v in data.items() if k not in (*_HEADER, *COMPUTE_NAMES)},
        )


def _compute_dict(fig: ComputeFigure | None) -> dict | None:
    if fig is None:
        return None
    f = fig.fit
    fit = {
        "flops_per_s": f.flops_per_s,
        "half_tokens": f.half_tokens,
        "overhead_s": f.overhead_s,
        "fall_tokens": f.fall_tokens,
    }
    return {"points": [list(p) for p in fig.points], "fit": fit, "fit_error": fig.fit_error}


def _kernel_name(value: Any, where: str) -> str | None:
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"{where}: field 'kernel' must be a kernel's name or null")
    return value


def _kernel_curves(data: Any, where: str) -> dict[str, KernelCurves]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: field 'kernels' must map kernel names to their curves")
    curves = {}
    for name, section in data.items():
        label = f"kernels.{name}"
        if not isinstance(section, dict) or section.get("attention") is None:
            raise ValueError(f"{where}: field '{label}' must hold an 'attention' curve")
        curves[str(name)] = KernelCurves(
            _compute_figure(section["attention"], f"{label}.attention", where),
            _compute_figure(
                section.get("attention_diagonal"), f"{label}.attention_diagonal", where
            ),
        )
    return curves


def _field(data: dict, key: str, kind: type, where: str) -> Any:
    if key not in data:
        raise ValueError(f"{where}: missing field '{key}'")
    if not isinstance(data[key], kind):
        raise ValueError(f"{where}: field '{key}' must be a {kind.__name__}")
    return data[key]


def _numbers(row: Any, size: int | tuple[int, ...], label: str, where: str) -> tuple[float, ...]:
    sizes = (size,) if isinstance(size, int) else size
    ok = isinstance(row, (list, tuple)) and len(row) in sizes
    ok = ok and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in row)
    if not ok or not all(np.isfinite(row)) or min(row) < 0:
        count = " or ".join(str(n) for n in sizes)
        raise ValueError(
            f"{where}: field '{label}' must hold {count} non-negative numbers, got {row!r}"
        )
    return tuple(row)


def _fit_values(fit: Any, keys: tuple[str, ...], label: str, where: str) -> list[float]:
    if not isinstance(fit, dict):
        raise ValueError(f"{where}: field '{label}.fit' must be an object with {list(keys)}")
    values = []
    for key in keys:
        value = fit.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            raise ValueError(f"{where}: field '{label}.fit.{key}' must be a number >= 0")
        values.append(float(value))
    if not values[0] > 0:
        raise ValueError(f"{where}: field '{label}.fit.{keys[0]}' must be positive")
    return values


def _compute_figure(data: Any, label: str, where: str) -> ComputeFigure | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: field '{label}' must be an object with points and fit")
    points = tuple(
        _numbers(p, (3, 4), f"{label}.points[{i}]", where)
        for i, p in enumerate(data.get("points", []))
    )
    flops_per_s, half, overhead = _fit_values(
        data.get("fit"), ("flops_per_s", "half_tokens", "overhead_s"), label, where
    )
    fall = data["fit"].get("fall_tokens")
    if fall is not None and (
        not isinstance(fall, (int, float)) or isinstance(fall, bool) or not fall > 0
    ):
        raise ValueError(f"{where}: field '{label}.fit.fall_tokens' must be positive or null")
    points = tuple((int(p[0]), float(p[1]), float(p[2]), *map(int, p[3:])) for p in points)
    fit = Efficiency(flops_per_s, half, overhead, None if fall is None else float(fall))
    return ComputeFigure(points, fit)


def _link_figure(data: Any, label: str, where: str) -> LinkFigure:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: field '{label}' must be an object with points and fit")
    points = tuple(
        _numbers(p, 2, f"{label}.points[{i}]", where) for i, p in enumerate(data.get("points", []))
    )
    bytes_per_s, latency = _fit_values(data.get("fit"), ("bytes_per_s", "latency_s"), label, where)
    return LinkFigure(tuple((int(b), float(s)) for b, s in points), LinkCost(bytes_per_s, latency))


def load_calibration(path: str) -> Calibration:
    """Read and check a calibration file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read calibration file {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {path} is not valid JSON: {exc}") from exc
    return Calibration.from_dict(data, where=f"calibration file {path}")


def save_calibration(cal: Calibration, path: str) -> None:
    """Write ``cal`` (its ``extra`` sections included) atomically: a reader sees the old file or
    the whole new one, never a part."""
    atomic_write_text(path, json.dumps(cal.to_dict(), indent=1) + "\n")


def normalize_dtype(dtype: str) -> str:
    """``bf16``, ``fp16`` or ``fp32`` for the usual spellings (``bfloat16``, ``torch.half``...)."""
    key = str(dtype).strip().lower()
    return _DTYPE_ALIASES.get(key, key)


def model_differences(cal: Calibration, model: ModelSpec) -> list[str]:
    """The layer dimensions ``cal`` was measured for that ``model`` does not have, one
    ``"<dim> <file's> (file) vs <model's> (model <name>)"`` each; none for a file that names no
    model."""
    if cal.model is None:
        return []
    planned = model.to_dict()
    return [
        f"{key} {cal.model[key]} (file) vs {planned[key]} (model {model.name})"
        for key in MODEL_DIMS
        if key in cal.model and cal.model[key] != planned[key]
    ]


def apply_calibration(
    cost: CostModel,
    cal: Calibration,
    *,
    source: str,
    expected_device: str | None = None,
    expected_dtype: str | None = None,
) -> CostModel:
    """``cost`` with the figures ``cal`` measures replaced (``sources`` records ``source``).

    Refuses a file measured for other model dimensions, or for another device or dtype than the
    caller plans for (when it says so), because its speeds would describe other kernels.
    """
    differ = model_differences(cal, cost.model)
    if differ:
        raise ValueError(
            f"calibration {source} was measured for another model: {'; '.join(differ)}. "
            "Profile this model or drop the calibration."
        )
    if (
        expected_device is not None
        and cal.device.strip().lower() != expected_device.strip().lower()
    ):
        raise ValueError(
            f"calibration {source} was measured on {cal.device!r}, not on {expected_device!r}; "
            "profile this device or drop the calibration"
        )
    if expected_dtype is not None and normalize_dtype(cal.dtype) != normalize_dtype(expected_dtype):
        raise ValueError(
            f"calibration {source} was measured in {cal.dtype}, not in {expected_dtype}; "
            "profile this dtype or drop the calibration"
        )
    figures: dict[str, Efficiency | LinkCost] = {}
    for name in COMPUTE_NAMES:
        figure = getattr(cal, name)
        if figure is not None:
            figures[name] = figure.fit
    for name in LINK_NAMES:
        if name in cal.links:
            figures[name] = cal.links[name].fit
    return cost.with_figures(source, **figures) if figures else cost


# --- fits ------------------------------------------------------------------------------------
def _relative_lstsq(columns: np.ndarray, seconds: np.ndarray, free: Sequence[int]) -> np.ndarray:
    """Least squares on relative error (times span decades) over the columns in ``free``."""
    coef = np.zeros(columns.shape[1])
    weights = 1.0 / seconds
    a = columns[:, free] * weights[:, None]
    # Columns span many decades (FLOPs times tokens against a constant): scale each to unit
    # norm so the solver's rank cut-off does not drop a small but real term.
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    solution, *_ = np.linalg.lstsq(a / norms, seconds * weights, rcond=None)
    coef[list(free)] = solution / norms
    return coef


def _best_nonnegative(columns: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Fit with every coefficient >= 0 and the first > 0: try the subsets of optional terms
    (column 0 is always fitted) and keep the feasible one with the smallest relative error."""
    best, best_err = None, np.inf
    optional = range(1, columns.shape[1])
    for r in range(len(optional), -1, -1):
        for subset in itertools.combinations(optional, r):
            coef = _relative_lstsq(columns, seconds, (0, *subset))
            if coef[0] <= 0 or (coef < 0).any():
                continue
            err = float((((columns @ coef) - seconds) / seconds) ** 2 @ np.ones(len(seconds)))
            if err < best_err - 1e-15:
                best, best_err = coef, err
    if best is None:
        raise ValueError("measured times do not grow with the work; check the measurements")
    return best


def fit_efficiency(points: Iterable[Sequence[float]], *, fall: bool = True) -> Efficiency:
    """Fit ``Efficiency`` to ``(num_tokens, flops, seconds[, call_tokens])`` points.

    ``seconds = overhead + flops / peak * (1 + half / n + N / fall_tokens)`` (``N`` the call's
    tokens, ``n`` without a fourth number) is linear in ``1/peak``, ``half/peak``,
    ``1/(peak*fall_tokens)`` and ``overhead``: ``seconds = a*flops + b*flops/n + e*flops*N +
    c``. Every coefficient must be >= 0; the subset of optional terms with the smallest relative
    error wins, so the fall term appears only where large calls really run slower
    (``fall=False`` leaves it out, as do fewer than 5 points).
    """
    rows = np.asarray([(*p[:3], _call_tokens(p)) for p in points], dtype=np.float64)
    if rows.ndim != 2 or len(rows) < 3:
        raise ValueError("fit_efficiency needs at least 3 (num_tokens, flops, seconds) points")
    if (rows <= 0).any():
        raise ValueError("fit_efficiency: token counts, FLOPs and seconds must all be positive")
    n, flops, seconds, call_tokens = rows.T
    columns = [flops, flops / n, np.ones_like(n)]
    if fall and len(rows) >= 5:
        columns.append(flops * call_tokens)
    coef = _best_nonnegative(np.stack(columns, axis=1), seconds)
    a, b, c = (float(x) for x in coef[:3])
    e = float(coef[3]) if len(coef) > 3 else 0.0
    return Efficiency(
        flops_per_s=1.0 / a, half_tokens=b / a, overhead_s=c, fall_tokens=a / e if e > 0 else None
    )


def fit_link(points: Iterable[Sequence[float]]) -> LinkCost:
    """Fit ``LinkCost`` to ``(num_bytes, seconds)`` points: ``seconds = latency + bytes / bw``."""
    rows = np.asarray([tuple(p) for p in points], dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] != 2 or len(rows) < 2:
        raise ValueError("fit_link needs at least 2 (num_bytes, seconds) points")
    if (rows <= 0).any():
        raise ValueError("fit_link: message sizes and seconds must all be positive")
    num_bytes, seconds = rows.T
    coef = _best_nonnegative(np.stack([num_bytes, np.ones_like(num_bytes)], 1), seconds)
    inv_bw, latency = (float(x) for x in coef)
    return LinkCost(bytes_per_s=1.0 / inv_bw, latency_s=latency)
