"""Calibration files: fits recover known curves, files round-trip atomically, and a file from
another model, dtype or device is refused.

Tier: pure.
"""

from __future__ import annotations

import json
import os

import pytest
from examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zeppelin.planner.cost.calibration import (
    CALIBRATION_FORMAT,
    Calibration,
    ComputeFigure,
    LinkFigure,
    apply_calibration,
    fit_efficiency,
    fit_link,
    load_calibration,
    save_calibration,
)
from megatron_zeppelin.planner.cost.costmodel import CostModel, Efficiency, LinkCost
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

MODEL = get_model("llama-7b")
COST = CostModel.default(MODEL, get_topology("dgx-h100", num_nodes=2))
DIMS = {
    k: getattr(MODEL, k) for k in ("hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size")
}


def _calibration(**changes) -> Calibration:
    attention = Efficiency(4e14, 900.0, 1e-5)
    nvlink = LinkCost(3e11, 9e-6)
    fields = dict(
        device="NVIDIA H100 80GB HBM3",
        machine="node-1",
        dtype="bf16",
        model=dict(DIMS),
        versions={"torch": "2.5"},
        date="2025-01-01",
        attention=ComputeFigure(((1024, 1e12, attention.time(1e12, 1024)),), attention),
        links={"nvlink": LinkFigure(((1 << 20, nvlink.time(1 << 20)),), nvlink)},
    )
    fields.update(changes)
    return Calibration(**fields)


@settings(max_examples=examples(30), deadline=None)
@given(
    st.floats(1e13, 1e15),
    st.floats(10.0, 4000.0),
    st.floats(0.0, 1e-4),
)
def test_fit_efficiency_recovers_curve(peak, half, overhead):
    truth = Efficiency(peak, half, overhead)
    points = [(n, 3e6 * n * n, truth.time(3e6 * n * n, n)) for n in (64, 256, 1024, 4096, 16384)]
    fit = fit_efficiency(points)
    for n, flops, seconds in points:
        assert fit.time(flops, n) == pytest.approx(seconds, rel=1e-6)


@settings(max_examples=examples(30), deadline=None)
@given(st.floats(1e9, 1e12), st.floats(0.0, 1e-4))
def test_fit_link_recovers_line(bandwidth, latency):
    truth = LinkCost(bandwidth, latency)
    fit = fit_link([(b, truth.time(b)) for b in (1 << 10, 1 << 16, 1 << 22, 1 << 26)])
    assert fit.bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    assert fit.latency_s == pytest.approx(latency, rel=1e-4, abs=1e-9)


def test_fits_reject_too_few_or_bad_points():
    with pytest.raises(ValueError, match="at least 3"):
        fit_efficiency([(1, 1.0, 1.0)])
    with pytest.raises(ValueError, match="positive"):
        fit_link([(0, 1.0), (10, 2.0)])


def test_round_trip_and_apply(tmp_path):
    cal = _calibration()
    path = str(tmp_path / "cal.json")
    save_calibration(cal, path)
    assert load_calibration(path) == cal
    assert [p for p in os.listdir(tmp_path)] == ["cal.json"]  # no temporary file left behind
    cost = apply_calibration(
        COST, cal, source=path, expected_device="nvidia h100 80gb hbm3", expected_dtype="bfloat16"
    )
    assert cost.attention == cal.attention.fit and cost.nvlink == cal.links["nvlink"].fit
    assert cost.nic == COST.nic and cost.linear == COST.linear
    assert cost.sources["attention"] == path and cost.sources["nic"] == "default"


def test_save_is_atomic_when_serialization_fails(tmp_path):
    path = tmp_path / "cal.json"
    save_calibration(_calibration(), str(path))
    before = path.read_text()
    broken = _calibration(versions={"torch": object()})
    with pytest.raises(TypeError):
        save_calibration(broken, str(path))
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["cal.json"]


@pytest.mark.parametrize(
    ("changes", "kwargs", "message"),
    [
        ({"model": {**DIMS, "hidden_size": 5120}}, {}, "hidden_size 5120"),
        ({}, {"expected_dtype": "fp16"}, "measured in bf16"),
        ({}, {"expected_device": "NVIDIA A100"}, "measured on"),
    ],
)
def test_apply_refuses_other_model_dtype_device(changes, kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_calibration(COST, _calibration(**changes), source="cal.json", **kwargs)


def test_model_independent_file_applies_to_any_model():
    cost = apply_calibration(COST, _calibration(model=None), source="generic")
    assert cost.attention.flops_per_s == 4e14


def _write(tmp_path, data) -> str:
    path = tmp_path / "bad.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format="zeppelin-calibration/0"), "'format'"),
        (lambda d: d.pop("device"), "missing field 'device'"),
        (lambda d: d.update(dtype=16), "'dtype' must be a str"),
        (lambda d: d.update(model=[1]), "'model'"),
        (lambda d: d["model"].update(hidden_size=-1), "model.hidden_size"),
        (lambda d: d["attention"]["fit"].pop("half_tokens"), "attention.fit.half_tokens"),
        (lambda d: d["attention"]["points"].append([1, 2]), r"attention.points\[1\]"),
        (
            lambda d: d["links"]["nvlink"]["fit"].update(bytes_per_s=0),
            "links.nvlink.fit.bytes_per_s",
        ),
        (lambda d: d["links"].update(carrier_pigeon={}), "unknown links"),
    ],
)
def test_malformed_file_names_field(tmp_path, mutate, message):
    data = _calibration().to_dict()
    mutate(data)
    with pytest.raises(ValueError, match=message):
        load_calibration(_write(tmp_path, data))


def test_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="not valid JSON"):
        load_calibration(_write(tmp_path, "{nope"))
    with pytest.raises(ValueError, match="cannot read"):
        load_calibration(str(tmp_path / "absent.json"))
    assert _calibration().to_dict()["format"] == CALIBRATION_FORMAT
