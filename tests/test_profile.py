"""Profiling into calibration files, and the cost model's validation report.

Tier: pure (fits, reports, the prediction's phase pricing and ring coupling, refusal messages,
atomic writes on a one-process profile with tiny shapes) and processes (one emulated 2x2 gloo
profile, one small validation run; marked ``dist``).
"""

from __future__ import annotations

import json
import os

import pytest

from megatron_zeppelin.cli import main as cli_main
from megatron_zeppelin.commands.profile import parse_shape, parse_sizes
from megatron_zeppelin.planner.cost.calibration import apply_calibration, load_calibration
from megatron_zeppelin.planner.cost.costmodel import CostModel, Efficiency, LinkCost
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.profile.kernels import AttentionGrid, AttentionPoint, block_pairs
from megatron_zeppelin.profile.linear import LinearPoint
from megatron_zeppelin.profile.links import LinkPoint
from megatron_zeppelin.profile.runner import (
    ProfileSettings,
    RankMeasurements,
    _median_over_rounds,
    build_calibration,
    profile,
    write_calibration,
)
from megatron_zeppelin.profile.timing import TimingOptions
from megatron_zeppelin.profile.validate import (
    ValidationSettings,
    calibrated_cost_model,
    compare,
    make_plans,
    predict,
    ring_groups,
    validate,
    validation_topology,
)
from megatron_zeppelin.topology.model import Topology

TINY_GRID = AttentionGrid(causal=(8, 16, 32), full=((8, 32),))
FAST = TimingOptions(warmup=0, repeats=1)


def tiny_settings(**overrides) -> ProfileSettings:
    base = dict(
        device="cpu",
        grid=TINY_GRID,
        linear_tokens=(8, 16, 32),
        timing=FAST,
        link_sizes=(1024, 8192),
        link_timing=FAST,
    )
    return ProfileSettings(**{**base, **overrides})


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("cal") / "cpu.json")
    profile(tiny_settings(), output=path)
    return path


@pytest.mark.pure
def test_quick_profile_writes_a_loadable_calibration(calibration_file):
    cal = load_calibration(calibration_file)
    model = get_model("tiny")
    assert cal.dtype == "fp32" and cal.device.startswith("cpu")
    assert cal.model["hidden_size"] == model.hidden_size
    assert cal.model["num_kv_heads"] == model.num_kv_heads
    assert {"torch", "megatron-core", "flash-attn", "megatron-zeppelin"} <= set(cal.versions)
    assert cal.date and cal.machine
    assert len(cal.attention.points) == len(TINY_GRID.shapes())
    assert len(cal.linear.points) == 3
    # One process measures no links: the datasheet link figures must stay in use.
    assert cal.links == {}
    for num_q, flops, seconds in cal.attention.points:
        assert seconds > 0 and flops > 0 and num_q in (8, 16, 32)
    raw = json.load(open(calibration_file))["profile"]
    assert raw["settings"]["model"] == "tiny" and len(raw["attention"]) == len(TINY_GRID.shapes())
    assert "nvlink, nic, alltoall not measured" in raw["links_note"]
    assert raw["kernel_used"] == "torch"  # ``auto`` on a CPU: the tiled kernel
    assert "datasheet" in raw["links_note"]
    assert os.stat(calibration_file).st_mode & 0o777 == 0o644  # shareable, not mkstemp's 0600


@pytest.mark.pure
def test_calibrated_cost_model_reports_measured_sources(calibration_file):
    topology = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2)
    default = CostModel.default(get_model("tiny"), topology)
    cal = load_calibration(calibration_file)
    measured = apply_calibration(default, cal, source=calibration_file)
    assert measured.sources["attention"] == calibration_file
    assert measured.sources["linear"] == calibration_file
    assert measured.sources["nvlink"] == "default" and measured.sources["nic"] == "default"
    # The datasheet peak is irrelevant once calibrated: a 1000x faster GPU predicts the same.
    fast = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2, gpu_tflops=989_000.0)
    other = apply_calibration(CostModel.default(get_model("tiny"), fast), cal, source="x")
    assert other.attention_time(1024, 500_000) == measured.attention_time(1024, 500_000)
    assert other.linear_time(4096) == measured.linear_time(4096)


@pytest.mark.pure
def test_compare_command_prints_measured_and_default_sources(calibration_file, capsys):
    code = cli_main(
        [
            "compare",
            "--dist",
            "wikipedia",
            "--tokens",
            "4096",
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            "--nics-per-node",
            "1",
            "--model",
            "tiny",
            "--cost-model",
            calibration_file,
            "--builders",
            "zeppelin",
            "--steps",
            "1",
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert f"attention={calibration_file}" in out and "nic=default" in out


def _points(eff: Efficiency) -> list[AttentionPoint]:
    model = get_model("tiny")
    attention = []
    shapes = [
        (16, 16, True),
        (128, 128, True),
        (1024, 1024, True),
        (64, 512, False),
        (512, 64, False),
        (2048, 2048, False),
    ]
    for num_q, num_k, causal in shapes:
        pairs = block_pairs(num_q, num_k, causal)
        flops = pairs * model.attn_flops_per_pair()
        seconds = eff.time(flops, num_q)
        attention.append(
            AttentionPoint(1, num_q, num_k, causal, pairs, flops, seconds / 3, seconds * 2 / 3)
        )
    return attention


def _synthetic(eff: Efficiency, link: LinkCost, **kernels: Efficiency) -> RankMeasurements:
    """A rank's measurements: kernel ``torch`` at ``eff`` unless ``kernels`` names others."""
    model = get_model("tiny")
    attention = {
        name.replace("_", "-"): _points(e) for name, e in (kernels or {"torch": eff}).items()
    }
    linear = []
    for n in (32, 256, 2048):
        flops = n * model.linear_flops_per_token()
        seconds = eff.time(flops, n)
        linear.append(LinearPoint(n, flops, seconds / 2, seconds / 2))
    links = [
        LinkPoint(kind, size, link.time(size), 0, 1, -1)
        for kind in ("nvlink", "nic", "a2a-world")
        for size in (1 << 10, 1 << 16, 1 << 22)
    ]
    return RankMeasurements(attention, linear, links, "cpu: synthetic")


@pytest.mark.pure
def test_fits_reproduce_synthetic_points():
    eff = Efficiency(flops_per_s=2e10, half_tokens=300.0, overhead_s=2e-4)
    link = LinkCost(bytes_per_s=3e9, latency_s=5e-5)
    cal, extra = build_calibration(tiny_settings(), [_synthetic(eff, link)])
    fit = cal.attention.fit  # queries and pairs vary apart: every parameter is identifiable
    assert fit.flops_per_s == pytest.approx(eff.flops_per_s, rel=1e-6)
    assert fit.half_tokens == pytest.approx(eff.half_tokens, rel=1e-6)
    assert fit.overhead_s == pytest.approx(eff.overhead_s, rel=1e-6)
    # Linear FLOPs grow with the tokens, so only the affine time is identifiable: it must
    # reproduce the points and predict an unmeasured token count.
    flops_per_token = get_model("tiny").linear_flops_per_token()
    for n in (32, 777, 2048):
        expected = eff.time(n * flops_per_token, n)
        assert cal.linear.fit.time(n * flops_per_token, n) == pytest.approx(expected, rel=1e-6)
    for name in ("nvlink", "nic", "alltoall"):
        assert cal.links[name].fit.bytes_per_s == pytest.approx(link.bytes_per_s, rel=1e-6)
        assert cal.links[name].fit.latency_s == pytest.approx(link.latency_s, rel=1e-6)
    for point in extra["attention"]:
        assert point["predicted_s"] == pytest.approx(point["forward_s"] + point["backward_s"])


@pytest.mark.pure
def test_every_kernel_measured_gets_its_curves_and_the_fastest_leads(tmp_path):
    link = LinkCost(bytes_per_s=3e9, latency_s=5e-5)
    slow = Efficiency(flops_per_s=1e10, half_tokens=300.0, overhead_s=2e-4)
    fast = Efficiency(flops_per_s=3e10, half_tokens=300.0, overhead_s=2e-4)
    rank = _synthetic(slow, link, torch_flash=slow, te=fast)
    cal, extra = build_calibration(tiny_settings(), [rank])
    assert cal.kernel == "te" and set(cal.kernels) == {"te", "torch-flash"}
    assert cal.attention.fit.flops_per_s == pytest.approx(fast.flops_per_s, rel=1e-6)
    assert cal.kernels["torch-flash"].attention.fit.flops_per_s == pytest.approx(1e10, rel=1e-6)
    assert extra["kernel_used"] == "te" and extra["kernels_measured"] == ["te", "torch-flash"]
    assert {p["kernel"] for p in extra["attention"]} == {"te", "torch-flash"}
    path = str(tmp_path / "two.json")
    write_calibration(cal, path, extra=extra)
    assert load_calibration(path).kernels == cal.kernels


@pytest.mark.pure
def test_ranks_combine_by_median():
    eff = Efficiency(flops_per_s=2e10, half_tokens=300.0, overhead_s=2e-4)
    link = LinkCost(bytes_per_s=3e9, latency_s=5e-5)
    slow = Efficiency(flops_per_s=1e9, half_tokens=300.0, overhead_s=2e-4)
    ranks = [_synthetic(eff, link), _synthetic(slow, link), _synthetic(eff, link)]
    cal, _ = build_calibration(tiny_settings(), ranks)
    assert cal.attention.fit.flops_per_s == pytest.approx(eff.flops_per_s, rel=1e-6)


def _listing(directory) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.pure
def test_interrupted_profile_leaves_no_file(tmp_path):
    path = tmp_path / "cal.json"

    def interrupt(message: str) -> None:
        if message.startswith("linear"):  # after the attention kernels were measured
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        profile(tiny_settings(), output=str(path), progress=interrupt)
    assert _listing(tmp_path) == []


@pytest.mark.pure
def test_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "cal.json"
    path.write_text("previous")

    def broken_fsync(*args, **kwargs):  # the bytes are written, the disk refuses to keep them
        raise OSError("disk full")

    monkeypatch.setattr("megatron_zeppelin.fileio.os.fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        profile(tiny_settings(), output=str(path))
    assert path.read_text() == "previous"
    assert _listing(tmp_path) == ["cal.json"]


@pytest.mark.pure
def test_calibration_for_another_model_dtype_or_device_is_refused(calibration_file, tmp_path):
    topology = Topology(num_nodes=1, gpus_per_node=2, nics_per_node=1)
    cal = load_calibration(calibration_file)
    with pytest.raises(ValueError, match="another model"):
        apply_calibration(CostModel.default(get_model("llama-7b"), topology), cal, source="f")
    settings = ValidationSettings(calibration=calibration_file, device="cpu", dtype="bf16")
    with pytest.raises(ValueError, match="measured in fp32, not in bf16"):
        calibrated_cost_model(settings, topology)
    data = json.load(open(calibration_file))
    data["device"] = "NVIDIA H100 80GB HBM3"
    other = tmp_path / "gpu.json"
    other.write_text(json.dumps(data))
    settings = ValidationSettings(calibration=str(other), device="cpu")
    with pytest.raises(ValueError, match="measured on 'NVIDIA H100"):
        calibrated_cost_model(settings, topology)


@pytest.mark.pure
def test_bad_profile_settings_are_refused():
    with pytest.raises(ValueError, match="unknown model"):
        ProfileSettings(model="llama-1000b")
    with pytest.raises(ValueError, match="unknown dtype"):
        ProfileSettings(dtype="float8")
    with pytest.raises(ValueError, match="at least 3"):
        AttentionGrid(causal=(16, 32))
    with pytest.raises(ValueError, match="NODESxGPUS"):
        parse_shape("two")
    assert parse_sizes("64,4K,2M") == (64, 4096, 2 << 20)


@pytest.mark.pure
def test_report_errors_follow_the_measurements():
    settings = ValidationSettings(
        device="cpu", emulate=(1, 2), tokens=2048, num_batches=2, thresholds=(64, 128)
    )
    topology = validation_topology(settings)
    cost = calibrated_cost_model(settings, topology)
    plans = make_plans(settings, topology, cost)
    exact = [[predict(p, cost, routing=True)[0][r] for p in plans] for r in range(2)]
    report = compare(plans, exact, cost, settings)
    assert report["overall"]["median_abs_error"] == pytest.approx(0.0, abs=1e-12)
    doubled = [[{k: 2 * v for k, v in m.items()} for m in per_rank] for per_rank in exact]
    report = compare(plans, doubled, cost, settings)
    for r in report["per_rank"]:
        assert r["median_error"] == pytest.approx(-0.5) and r["worst_error"] == pytest.approx(-0.5)


@pytest.mark.dist
def test_emulated_profile_measures_links_per_rail(tmp_path):
    path = tmp_path / "cal.json"
    cal = profile(tiny_settings(emulate=(2, 2), timeout_s=120.0), output=str(path))
    assert set(cal.links) == {"nvlink", "nic", "alltoall"}
    for figure in cal.links.values():
        assert figure.fit.bytes_per_s > 0 and len(figure.points) == 2
    raw = json.load(open(path))["profile"]
    assert raw["num_ranks"] == 4
    assert raw["links_note"] == "nvlink, nic, alltoall measured over 4 ranks"
    rails = {p["rail"] for p in raw["links"] if p["kind"] == "nic"}
    assert rails == {0, 1}  # local GPU j of node 0 talks to local GPU j of node 1
    assert all(p["src"] // 2 != p["dst"] // 2 for p in raw["links"] if p["kind"] == "nic")


@pytest.mark.dist
def test_validation_runs_planned_batches(calibration_file, tmp_path):
    settings = ValidationSettings(
        calibration=calibration_file,
        device="cpu",
        emulate=(2, 1),
        tokens=512,
        num_batches=1,
        thresholds=(32, 64),
        warmup=0,
        repeats=1,
        timeout_s=120.0,
    )
    report = validate(settings)
    (batch,) = report["batches"]
    assert sum(r["tokens"] for r in batch["ranks"]) == 512
    for r in batch["ranks"]:
        assert r["measured"]["attention_s"] > 0 and r["predicted"]["attention_s"] > 0
    assert report["cost_model_sources"]["attention"] == calibration_file
    from megatron_zeppelin.commands.validate import format_report, plot_report

    assert any("median error" in line for line in format_report(report))
    plot_report(report, str(tmp_path / "v.png"))
    assert (tmp_path / "v.png").stat().st_size > 0


@pytest.mark.pure
def test_prediction_prices_phases_by_mask_and_couples_rings():
    settings = ValidationSettings(
        device="cpu", emulate=(2, 2), tokens=4096, num_batches=2, thresholds=(64, 128)
    )
    topology = validation_topology(settings)
    # CPU-like compute, so that attention is not hidden behind the transfers.
    cost = calibrated_cost_model(settings, topology).with_figures(
        "test", attention=Efficiency(1e9, 64.0, 1e-4)
    )
    slow_diagonal = cost.with_figures("test", attention_diagonal=Efficiency(2.5e8, 64.0, 1e-4))
    for plan in make_plans(settings, topology, cost):
        predicted, step = predict(plan, cost, routing=True)
        slower, _ = predict(plan, slow_diagonal, routing=True)
        groups = ring_groups(plan)
        assert sorted(r for g in groups for r in g) == list(range(plan.world_size))
        for group in groups:  # ring members finish their attention together
            assert len({predicted[r]["attention_s"] for r in group}) == 1
        # Phase 0 (local documents, own diagonal blocks) runs on the diagonal curve.
        assert all(s["attention_s"] > p["attention_s"] for s, p in zip(slower, predicted))
        assert step == max(p["linear_s"] + p["attention_s"] for p in predicted)


@pytest.mark.pure
def test_profile_passes_combine_by_median():
    one = LinearPoint(64, 1e6, 1.0, 2.0)
    passes = [[one], [LinearPoint(64, 1e6, 3.0, 1.0)], [LinearPoint(64, 1e6, 2.0, 9.0)]]
    (merged,) = _median_over_rounds(passes)
    assert (merged.forward_s, merged.backward_s) == (2.0, 2.0)
    with pytest.raises(ValueError, match="rounds"):
        ProfileSettings(rounds=0)


@pytest.mark.pure
def test_a_cuda_device_gets_this_processs_gpu_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.set_device`` refuses ``torch.device("cuda")`` without an index, which is
    what ``zeppelin profile --device cuda`` passed it; the index comes from ``LOCAL_RANK``."""
    import torch

    from megatron_zeppelin.devices import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        resolve_device("cuda")
