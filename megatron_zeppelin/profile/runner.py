"""``profile(...)``: measure this machine, fit the cost model's curves, write a calibration file.

Three ways to run, picked from the situation:

* **emulated cluster** (``emulate=(nodes, gpus_per_node)``, CPU): ``nodes x gpus_per_node`` gloo
  processes start on this host, one per emulated GPU. Every process measures the kernels at the
  same time, in lockstep (a barrier before every timed call), because that is how the
  validation and the engine run them: the emulated GPUs share the host's cores, so a kernel
  measured alone would look faster than it is.
* **under torchrun** (``torch.distributed`` already initialized): every rank measures its kernels
  at once, then the links of the cluster; rank 0 writes the file.
* **one process**: kernels and linear modules only; the file has no link figures, so the cost
  model keeps its datasheet link speeds.

Points are combined over ranks by the median and fitted with ``fit_efficiency`` / ``fit_link``:
unmasked attention blocks into ``attention``, causal ones into ``attention_diagonal`` (when each
kind has the 3 points a fit needs; otherwise one curve over all of them, as older files have).
Every attention kernel measured (``kernels.kernels_to_measure``: with ``auto``, every one that
runs here) gets its two curves in ``kernels``; the fastest of them (``kernel_curves.rank_curves``)
is the file's ``kernel`` and gives the top-level curves, the ones ``auto`` will run.
The file is written atomically by ``save_calibration``: it appears whole at the very end, so an
interrupted profile (Ctrl-C, an exception halfway) leaves no file, or the previous one untouched.

Besides the fitted figures the file carries a ``profile`` section (``Calibration.extra``:
settings, the load average before, during and after, the forward/backward split and the
prediction of every point, per-rail link points) for reports.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata

import torch
import torch.distributed as dist

from megatron_zeppelin.devices import resolve_device
from megatron_zeppelin.launch.ranks import run_distributed
from megatron_zeppelin.planner.baselines.kernel_curves import rank_curves
from megatron_zeppelin.planner.cost.calibration import (
    LINK_NAMES,
    MODEL_DIMS,
    Calibration,
    ComputeFigure,
    KernelCurves,
    LinkFigure,
    fit_efficiency,
    fit_link,
    normalize_dtype,
    save_calibration,
)
from megatron_zeppelin.planner.cost.models import ModelSpec, get_model
from megatron_zeppelin.profile import kernels as kernel_profile
from megatron_zeppelin.profile import linear as linear_profile
from megatron_zeppelin.profile import links as link_profile
from megatron_zeppelin.profile.timing import TimingOptions, dtype_name, resolve_dtype
from megatron_zeppelin.topology.model import Topology
from megatron_zeppelin.topology.probe import detect_topology

Progress = Callable[[str], None]
"""Called with a short message before every measurement stage (and may raise to abort)."""


@dataclass(frozen=True)
class ProfileSettings:
    """What to measure and how; picklable, so emulated ranks receive it whole."""

    model: str = "tiny"
    """Model preset whose layer shapes are measured."""
    tensor_parallel: int = 1
    device: str = "auto"
    """``auto`` (CUDA where present), ``cpu`` or ``cuda[:i]``."""
    dtype: str = "float32"
    kernel: str = "auto"
    """Attention kernel of the engine's registry (``torch``, ``flash``, ``auto``)."""
    emulate: tuple[int, int] | None = None
    """``(nodes, gpus_per_node)``: start that many gloo processes on this host (CPU)."""
    grid: kernel_profile.AttentionGrid = field(default_factory=kernel_profile.AttentionGrid.quick)
    linear_tokens: tuple[int, ...] = linear_profile.DEFAULT_CPU_TOKENS
    link_sizes: tuple[int, ...] = link_profile.DEFAULT_CPU_SIZES
    timing: TimingOptions = TimingOptions()
    rounds: int = 1
    """Passes over the attention grid and the linear token counts; each point keeps the median
    over passes, so a burst of load from other processes on a shared host spreads over every
    point instead of bending the curve at the few it happened to hit."""
    link_timing: TimingOptions = TimingOptions(warmup=3, repeats=15)
    threads: int | None = 1
    """CPU intra-op threads per process (``None``: torch's default); one per emulated GPU keeps
    the processes from fighting over cores."""
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        get_model(self.model, tensor_parallel=self.tensor_parallel)  # raises on a bad preset
        resolve_dtype(self.dtype)
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")
        if self.emulate is not None:
            nodes, gpus = self.emulate
            if nodes < 1 or gpus < 1:
                raise ValueError(
                    f"emulate needs positive nodes and GPUs per node, got {self.emulate}"
                )

    @property
    def model_spec(self) -> ModelSpec:
        return get_model(self.model, tensor_parallel=self.tensor_parallel)


@dataclass
class RankMeasurements:
    """What one rank measured."""

    attention: dict[str, list[kernel_profile.AttentionPoint]]
    """Per attention kernel measured, its points."""
    linear: list[linear_profile.LinearPoint]
    links: list[link_profile.LinkPoint]
    device_name: str
    load_average: float | None = None
    """One-minute load average after the attention kernels (busy ranks included)."""


def device_name(device: torch.device) -> str:
    """The GPU model, or the CPU model, as written into calibration files and checked against."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine() or "unknown")


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for label, dist_name in (
        ("megatron-core", "megatron-core"),
        ("flash-attn", "flash-attn"),
        ("megatron-zeppelin", "megatron-zeppelin"),
    ):
        try:
            versions[label] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            versions[label] = "absent"
    if torch.version.cuda:
        versions["cuda"] = str(torch.version.cuda)
    return versions


def measure_rank(
    settings: ProfileSettings,
    *,
    topology: Topology | None,
    progress: Progress | None = None,
) -> RankMeasurements:
    """Measure on this process; with a ``topology`` (and an initialized world) the kernels run in
    lockstep with the other ranks and the links are measured too."""
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    device = resolve_device(settings.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = resolve_dtype(settings.dtype)
    model = settings.model_spec
    distributed = topology is not None and dist.is_initialized()
    lockstep = dist.barrier if distributed else None
    if lockstep is not None and settings.timing.min_seconds > 0:
        raise ValueError(
            "timing.min_seconds lets ranks repeat a call a different number of times, which "
            "breaks the lockstep of a distributed profile; set repeats instead"
        )
    say = progress or (lambda message: None)
    kernels = kernel_profile.kernels_to_measure(settings.kernel, device=device, dtype=dtype)
    attention_rounds: dict[str, list] = {name: [] for name in kernels}
    linear_rounds = []
    load_during = None
    for i in range(settings.rounds):
        for name in kernels:
            say(
                f"attention kernel {name!r}, {len(settings.grid.shapes())} shapes, "
                f"pass {i + 1} of {settings.rounds}"
            )
            attention_rounds[name].append(
                kernel_profile.measure_attention(
                    model,
                    grid=settings.grid,
                    device=device,
                    dtype=dtype,
                    kernel=name,
                    timing=settings.timing,
                    before_point=lockstep,
                    sdpa=name == kernels[0],
                )
            )
        load_during = _load_average()
        say(f"linear modules, {len(settings.linear_tokens)} token counts")
        linear_rounds.append(
            linear_profile.measure_linear(
                model,
                token_counts=settings.linear_tokens,
                device=device,
                dtype=dtype,
                timing=settings.timing,
                before_point=lockstep,
            )
        )
    attention = {name: _median_over_rounds(r) for name, r in attention_rounds.items()}
    linear = _median_over_rounds(linear_rounds)
    links: list[link_profile.LinkPoint] = []
    if distributed and topology.world_size > 1:
        say(f"links, {len(settings.link_sizes)} message sizes")
        links = link_profile.measure_links(
            topology, sizes=settings.link_sizes, device=device, timing=settings.link_timing
        )
    return RankMeasurements(attention, linear, links, device_name(device), load_during)


def _median_over_rounds(rounds: list[list]) -> list:
    """Per point, the median forward and the median backward seconds over the passes."""
    merged = []
    for same_point in zip(*rounds):
        forward = statistics.median(p.forward_s for p in same_point)
        backward = statistics.median(p.backward_s for p in same_point)
        merged.append(replace(same_point[0], forward_s=forward, backward_s=backward))
    return merged


def _emulated_rank(rank: int, world_size: int, settings: ProfileSettings) -> RankMeasurements:
    nodes, gpus = settings.emulate  # type: ignore[misc]
    topology = Topology(num_nodes=nodes, gpus_per_node=gpus, nics_per_node=gpus, name="cpu-gloo")
    return measure_rank(settings, topology=topology)


def _median_compute(per_rank: list[list], key: Callable) -> list:
    """Per measured shape, the point whose seconds is the median over ranks."""
    merged = []
    for points in zip(*per_rank):
        assert len({key(p) for p in points}) == 1, "ranks measured different grids"
        ordered = sorted(points, key=lambda p: p.seconds)
        merged.append(ordered[len(ordered) // 2])
    return merged


def build_calibration(
    settings: ProfileSettings, results: list[RankMeasurements]
) -> tuple[Calibration, dict]:
    """Fit the measured points (median over ranks); returns the calibration and the file's extra
    ``profile`` section."""
    same_shape = lambda p: (p.num_docs, p.num_q, p.num_k, p.causal)  # noqa: E731
    attention = {
        name: _median_compute([r.attention[name] for r in results], same_shape)
        for name in results[0].attention
    }
    linear = _median_compute([r.linear for r in results], lambda p: p.num_tokens)
    links = [p for r in results for p in r.links]
    curves = {name: KernelCurves(**attention_figures(points)) for name, points in attention.items()}
    model = settings.model_spec
    fastest = rank_curves(curves, model)[0]
    linear_rows = tuple((p.num_tokens, p.flops, p.seconds) for p in linear)
    link_figures = {}
    for name, kind in (("nvlink", "nvlink"), ("nic", "nic"), ("alltoall", "a2a-world")):
        rows = tuple(link_profile.points_of(links, kind))
        if len(rows) >= 2:
            link_figures[name] = LinkFigure(rows, fit_link(rows))
    calibration = Calibration(
        device=results[0].device_name,
        machine=socket.gethostname(),
        dtype=normalize_dtype(dtype_name(resolve_dtype(settings.dtype))),
        model={key: getattr(model, key) for key in MODEL_DIMS},
        versions=_versions(),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        attention=curves[fastest].attention,
        attention_diagonal=curves[fastest].attention_diagonal,
        linear=ComputeFigure(linear_rows, fit_efficiency(linear_rows)),
        links=link_figures,
        kernel=fastest,
        kernels=curves,
    )
    extra = {
        "settings": _settings_dict(settings),
        "model_name": model.name,
        "num_ranks": len(results),
        # What ``auto`` runs from these measurements (the fastest kernel measured).
        "kernel_used": fastest,
        "kernels_measured": rank_curves(curves, model),
        "load_average_during": [r.load_average for r in results],
        "attention": [
            _point_record(p, name, curves[name])
            for name, points in attention.items()
            for p in points
        ],
        "linear": [
            {**asdict(p), "predicted_s": calibration.linear.fit.time(p.flops, p.num_tokens)}
            for p in linear
        ],
        "links": [asdict(p) for p in links],
        "links_note": links_note(link_figures, len(results)),
    }
    return calibration, extra


def _point_record(point: kernel_profile.AttentionPoint, kernel: str, curves: KernelCurves) -> dict:
    """One measured call as the file's ``profile`` section lists it, with its kernel, the curve
    it was fitted into and that curve's prediction."""
    figure = curves.diagonal if point.causal else curves.attention
    return {
        **asdict(point),
        "kernel": kernel,
        "curve": "attention_diagonal"
        if point.causal and curves.attention_diagonal
        else "attention",
        "predicted_s": figure.fit.time(point.flops, point.num_q, call_tokens=point.total_q),
    }


def links_note(link_figures: dict[str, LinkFigure], num_ranks: int) -> str:
    """What the file says of its links: which were measured, and that the others keep the cost
    model's datasheet figures (one process has no peer to measure a link to)."""
    ranks = f"{num_ranks} rank{'s' if num_ranks != 1 else ''}"
    measured = [name for name in LINK_NAMES if name in link_figures]
    kept = [name for name in LINK_NAMES if name not in link_figures]
    parts = [f"{', '.join(measured)} measured over {ranks}"] if measured else []
    if kept:
        parts.append(
            f"{', '.join(kept)} not measured ({ranks}: no peer over that link), so the cost "
            "model keeps its datasheet figures for them"
        )
    return "; ".join(parts)


def attention_figures(points: list[kernel_profile.AttentionPoint]) -> dict[str, ComputeFigure]:
    """``attention`` (unmasked blocks) and ``attention_diagonal`` (causal blocks) fitted apart
    when each kind has the 3 points a fit needs; otherwise one ``attention`` curve over all."""
    full = tuple(kernel_profile.fit_rows(points, causal=False))
    causal = tuple(kernel_profile.fit_rows(points, causal=True))
    if len(full) < 3 or len(causal) < 3:
        rows = tuple(kernel_profile.fit_rows(points))
        return {"attention": ComputeFigure(rows, fit_efficiency(rows))}
    return {
        "attention": ComputeFigure(full, fit_efficiency(full)),
        "attention_diagonal": ComputeFigure(causal, fit_efficiency(causal)),
    }


def _settings_dict(settings: ProfileSettings) -> dict:
    data = asdict(settings)
    data["emulate"] = list(settings.emulate) if settings.emulate else None
    return data


def write_calibration(calibration: Calibration, path: str, *, extra: dict | None = None) -> None:
    """Write the calibration with ``extra`` as its ``profile`` section (``save_calibration``:
    atomic, mode 0644)."""
    if extra is not None:
        calibration = replace(calibration, extra={**calibration.extra, "profile": extra})
    save_calibration(calibration, path)


def profile(
    settings: ProfileSettings = ProfileSettings(),
    *,
    output: str | None = None,
    progress: Progress | None = None,
) -> Calibration:
    """Measure, fit and (with ``output``) write a calibration; see the module docstring."""
    say = progress or (lambda message: None)
    load_before = _load_average()
    if settings.emulate is not None:
        if resolve_device(settings.device).type != "cpu":
            raise ValueError("emulated nodes run gloo processes on the CPU: pass device='cpu'")
        nodes, gpus = settings.emulate
        say(f"starting {nodes * gpus} gloo processes ({nodes} nodes x {gpus} GPUs)")
        results = run_distributed(
            _emulated_rank, nodes * gpus, timeout_s=settings.timeout_s, args=(settings,)
        )
    elif dist.is_initialized():
        topology = detect_topology()
        mine = measure_rank(settings, topology=topology, progress=progress)
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, mine)
    else:
        results = [measure_rank(settings, topology=None, progress=progress)]
    say("fitting")
    calibration, extra = build_calibration(settings, results)
    # Timings on a shared host are only as good as its idleness: say how busy it was.
    extra["load_average"] = {"before": load_before, "after": _load_average()}
    if output is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        write_calibration(calibration, output, extra=extra)
        say(f"wrote {output}")
    return calibration


def summary_lines(calibration: Calibration) -> list[str]:
    """A short human-readable account of the fitted figures."""
    lines = [f"device {calibration.device} ({calibration.machine}), dtype {calibration.dtype}"]
    for label, figure in (
        ("attention", calibration.attention),
        ("diagonal", calibration.attention_diagonal),
        ("linear", calibration.linear),
    ):
        if figure is not None:
            fit = figure.fit
            fall = f", falls at {fit.fall_tokens:.0f}" if fit.fall_tokens is not None else ""
            lines.append(
                f"{label:9s} {fit.flops_per_s / 1e12:8.4f} TFLOP/s peak, half at "
                f"{fit.half_tokens:7.0f} tokens{fall}, {fit.overhead_s * 1e6:7.1f} us per call "
                f"({len(figure.points)} points, fit error {figure.fit_error:.1%})"
            )
    if calibration.kernels:
        ranked = ", ".join(
            f"{name} {curves.attention.fit.flops_per_s / 1e12:.4g} / "
            f"{curves.diagonal.fit.flops_per_s / 1e12:.4g}"
            for name, curves in calibration.kernels.items()
        )
        lines.append(
            f"kernels   {calibration.kernel} leads (auto runs it); peak TFLOP/s unmasked / "
            f"diagonal: {ranked}"
        )
    for name, link in calibration.links.items():
        lines.append(
            f"{name:9s} {link.fit.bytes_per_s / 1e9:8.3f} GB/s, {link.fit.latency_s * 1e6:7.1f} us "
            f"latency ({len(link.points)} sizes, fit error {link.fit_error:.1%})"
        )
    if not calibration.links:
        lines.append("links     not measured (one process): datasheet figures stay in use")
    return lines
