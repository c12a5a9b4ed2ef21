"""Pure tier: attention curves per kernel in calibration files, their ranking, TE's stand-in from
dense SDPA's times, and ``zeppelin compare``'s "same kernel" and "as deployed" columns.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from megatron_zeppelin.attention.kernels import kernels
from megatron_zeppelin.cli import main
from megatron_zeppelin.megatron.report import chosen_kernel
from megatron_zeppelin.planner.baselines.kernel_curves import (
    STAND_IN_TOKENS,
    deployed,
    measured_curves,
    sdpa_stand_in,
    speed_order,
)
from megatron_zeppelin.planner.cost.calibration import (
    Calibration,
    ComputeFigure,
    KernelCurves,
    apply_calibration,
    load_calibration,
    save_calibration,
)
from megatron_zeppelin.planner.cost.costmodel import CostModel, Efficiency
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

H100 = str(Path(__file__).resolve().parents[1] / "configs/calibration/h100-bf16-llama-7b.json")
MODEL = get_model("llama-7b")
BASE = CostModel.default(MODEL, get_topology("dgx-h100", num_nodes=2))


def _curves(peak: float) -> KernelCurves:
    fit = Efficiency(peak, 300.0, 2e-5)
    return KernelCurves(ComputeFigure(((1024, 1e12, fit.time(1e12, 1024)),), fit))


def _calibration(**kernels: KernelCurves) -> Calibration:
    first = next(iter(kernels.values()))
    dims = {k: getattr(MODEL, k) for k in ("hidden_size", "num_heads", "num_kv_heads")}
    return Calibration(
        device="NVIDIA H100 80GB HBM3", machine="node", dtype="bf16", model=dims,
        attention=first.attention, kernel=next(iter(kernels)).replace("_", "-"),
        kernels={k.replace("_", "-"): v for k, v in kernels.items()},
    )  # fmt: skip


def test_kernel_curves_round_trip_and_old_files_load(tmp_path) -> None:
    cal = _calibration(torch_flash=_curves(3e14), te=_curves(5e14))
    path = tmp_path / "cal.json"
    save_calibration(cal, str(path))
    again = load_calibration(str(path))
    assert again.kernel == "torch-flash" and set(again.kernels) == {"torch-flash", "te"}
    assert again.kernels["te"].attention.fit == cal.kernels["te"].attention.fit
    # The shipped file predates these fields but for the one "kernel" line; without it too.
    data = json.loads(Path(H100).read_text())
    del data["kernel"]
    old = Calibration.from_dict(data)
    assert old.kernel is None and old.kernels == {} and measured_curves(old) == {}
    assert load_calibration(H100).kernel == "torch-flash"
    data["kernels"] = {"te": {"attention_diagonal": data["attention_diagonal"]}}
    with pytest.raises(ValueError, match="'kernels.te' must hold an 'attention' curve"):
        Calibration.from_dict(data, where="x.json")


def test_speed_order_is_fastest_first() -> None:
    cal = _calibration(torch_flash=_curves(3e14), te=_curves(5e14), cudnn=_curves(4e14))
    assert speed_order(cal, MODEL) == ["te", "cudnn", "torch-flash"]


def test_sdpa_stands_in_for_te_at_sdpa_measured_speed() -> None:
    """The stand-in predicts dense SDPA's measured times of the long documents it is taken
    from (within the measured kernel's own fit error), and is faster than the measured kernel."""
    cal = load_calibration(H100)
    curves, note = sdpa_stand_in(cal)
    assert "dense SDPA stands in for TE's kernel" in note and "torch-flash" in note
    assert curves.attention.fit.flops_per_s > 1.5 * cal.attention.fit.flops_per_s
    points = [
        p for p in cal.extra["profile"]["attention"]
        if p["sdpa_s"] and p["num_q"] >= STAND_IN_TOKENS
    ]  # fmt: skip
    assert len(points) == 5
    for p in points:
        predicted = curves.diagonal.fit.time(p["flops"], p["num_q"])
        assert predicted == pytest.approx(p["sdpa_s"], rel=0.25), p["num_q"]
    no_sdpa = dataclasses.replace(cal, extra={})
    assert sdpa_stand_in(no_sdpa) is None


def test_deployed_prices_each_system_with_its_kernel() -> None:
    cal = load_calibration(H100)
    base = apply_calibration(BASE, cal, source="h100.json")
    plan = deployed(base, cal, source="h100.json")
    assert plan.zeppelin_kernel == "torch-flash"
    assert plan.cost_model("zeppelin", base).attention == base.attention
    te = plan.cost_model("te-ring-cp", base)
    assert te.attention.flops_per_s > base.attention.flops_per_s
    assert (
        plan.kernel("megatron-dynamic-cp") == "te"
        and "stands in" in plan.builders["te-ring-cp"].note
    )
    assert plan.cost_model("flexsp", base).attention == base.attention  # FA2 kernels measured
    # A calibration that measured TE's kernel uses it, for Zeppelin too where it is fastest.
    measured = _calibration(cudnn=_curves(3e14), te=_curves(5e14))
    plan = deployed(BASE, measured, source="m.json")
    assert plan.zeppelin_kernel == "te"
    zeppelin, ring = plan.cost_model("zeppelin", BASE), plan.cost_model("te-ring-cp", BASE)
    assert zeppelin.attention == ring.attention and zeppelin.attention.flops_per_s == 5e14
    assert "flexsp: flash not measured" in plan.unpriced
    assert deployed(BASE, None, source="").builders == {}


def test_compare_prints_same_kernel_and_as_deployed(tmp_path, capsys) -> None:
    out_json = tmp_path / "compare.json"
    argv = [
        "compare", "--topology", "dgx-h100", "--nodes", "1", "--model", "llama-7b",
        "--dist", "wikipedia", "--tokens", "32768", "--steps", "1", "--quiet",
        "--builders", "zeppelin,te-ring-cp", "--cost-model", H100, "--json", str(out_json),
    ]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "same kernel" in text and "as deployed" in text and "dense SDPA stands in" in text
    data = json.loads(out_json.read_text())
    same = {r["builder"]: r for r in data["rows"]}
    as_deployed = {r["builder"]: r for r in data["as_deployed"]["rows"]}
    assert data["as_deployed"]["kernels"] == {"zeppelin": "torch-flash", "te-ring-cp": "te"}
    assert as_deployed["zeppelin"]["step_time_s"] == same["zeppelin"]["step_time_s"]
    assert as_deployed["te-ring-cp"]["step_time_s"] < same["te-ring-cp"]["step_time_s"]
    assert as_deployed["zeppelin"]["speedup_vs_te"] < same["zeppelin"]["speedup_vs_te"]


def test_auto_at_start_up_follows_the_calibration_of_this_gpu(tmp_path, monkeypatch) -> None:
    """A run's ``auto`` takes the fastest kernel its calibration measured on this GPU that runs
    here; on another GPU the fixed order, and the start-up line says why."""
    path = str(tmp_path / "cal.json")
    save_calibration(_calibration(torch_flash=_curves(5e14), te=_curves(3e14)), path)
    table = dict.fromkeys(kernels.CUDA_KERNELS)
    monkeypatch.setattr(kernels, "_UNAVAILABLE", {k: (lambda v=v: v) for k, v in table.items()})
    monkeypatch.setattr(kernels, "cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    run = {"device": "cuda", "dtype": torch.bfloat16, "calibration": path, "model": MODEL}
    choice = chosen_kernel("auto", **run)
    assert choice.name == "torch-flash" and "measured speed (calibration" in choice.why
    assert chosen_kernel("auto", **{**run, "calibration": None}).name == "te"  # Hopper order
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    choice = chosen_kernel("auto", **run)
    assert choice.name == "te" and "measured on NVIDIA H100 80GB HBM3, not this" in choice.why
