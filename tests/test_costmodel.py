"""Cost model: the two attention curves, the falling-rate form, the all-to-all figure, and how
calibration files carry them (fit quality, free-form sections, sources).

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
    Calibration,
    ComputeFigure,
    LinkFigure,
    apply_calibration,
    fit_efficiency,
    load_calibration,
    save_calibration,
)
from megatron_zeppelin.planner.cost.costmodel import FIGURES, CostModel, Efficiency, LinkCost
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.topology.model import Topology

pytestmark = pytest.mark.pure

MODEL = get_model("tiny")
TOPOLOGY = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2)
FULL = Efficiency(2e10, 64.0, 1e-4)
DIAGONAL = Efficiency(1e10, 128.0, 1e-4, fall_tokens=4096.0)


def _calibration(**changes) -> Calibration:
    def figure(eff: Efficiency) -> ComputeFigure:
        rows = [(n, 1e6 * n * n, eff.time(1e6 * n * n, n)) for n in (64, 256, 1024)]
        return ComputeFigure(tuple(rows), eff)

    alltoall = LinkCost(2e9, 3e-4)
    fields = dict(
        device="cpu: test",
        machine="m",
        dtype="fp32",
        model=None,
        attention=figure(FULL),
        attention_diagonal=figure(DIAGONAL),
        links={"alltoall": LinkFigure(((1 << 20, alltoall.time(1 << 20) * 1.1),), alltoall)},
        extra={"profile": {"settings": {"grid": "quick"}, "load_average": {"before": 1.5}}},
    )
    fields.update(changes)
    return Calibration(**fields)


def test_defaults_price_both_block_kinds_alike():
    cost = CostModel.default(MODEL, TOPOLOGY)
    assert set(cost.sources) == set(FIGURES) and set(cost.sources.values()) == {"default"}
    for num_q, pairs in ((16, 100), (1024, 300_000)):
        assert cost.attention_time(num_q, pairs, diagonal=True) == cost.attention_time(num_q, pairs)


def test_block_picks_the_diagonal_curve_only_when_masked():
    cost = CostModel.default(MODEL, TOPOLOGY).with_figures(
        "cal", attention=FULL, attention_diagonal=DIAGONAL
    )
    # Keys entirely before the queries: unmasked. Keys reaching past the first query: masked.
    below = cost.attention_block_time((512, 1024), (0, 512))
    assert below == cost.attention_time(512, 512 * 512)
    diagonal = cost.attention_block_time((512, 1024), (0, 1024))
    assert diagonal == cost.attention_time(512, 512 * 512 + 512 * 513 // 2, diagonal=True)
    assert diagonal != cost.attention_time(512, 512 * 512 + 512 * 513 // 2)
    assert cost.document_attention_time(1000) == cost.attention_time(
        1000, 1000 * 1001 // 2, diagonal=True
    )


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 10**7)), max_size=6))
def test_call_time_pays_the_overhead_once(blocks):
    cost = CostModel.default(MODEL, TOPOLOGY).with_figures("cal", attention=FULL)
    call = cost.attention_call_time(blocks, diagonal=False)
    alone = [cost.attention_time(q, p) for q, p in blocks if p > 0]
    if not alone:
        assert call == 0.0
    else:
        assert call == pytest.approx(sum(alone) - (len(alone) - 1) * FULL.overhead_s)


def test_falling_rate_peaks_between_half_and_fall():
    best = (DIAGONAL.half_tokens * DIAGONAL.fall_tokens) ** 0.5
    assert DIAGONAL.rate(best) > DIAGONAL.rate(best / 4)
    assert DIAGONAL.rate(best) > DIAGONAL.rate(best * 4)
    no_fall = Efficiency(1e10, 128.0)
    assert no_fall.rate(1e9) == pytest.approx(1e10, rel=1e-6)
    with pytest.raises(ValueError, match="fall_tokens"):
        Efficiency(1e10, 128.0, fall_tokens=0.0)


@settings(max_examples=examples(30), deadline=None)
@given(st.floats(1e9, 1e13), st.floats(0.0, 2000.0), st.floats(1e3, 1e5), st.floats(0.0, 1e-3))
def test_fit_recovers_a_falling_curve(peak, half, fall, overhead):
    truth = Efficiency(peak, half, overhead, fall)
    sizes = (16, 64, 256, 1024, 4096, 16384)
    points = [(n, 5e5 * n * n * k, truth.time(5e5 * n * n * k, n)) for n in sizes for k in (1, 3)]
    fit = fit_efficiency(points)
    for n, flops, seconds in points:
        assert fit.time(flops, n) == pytest.approx(seconds, rel=1e-4)
    # Away from the points too, the fitted rate follows the true one.
    assert fit.rate(2000) == pytest.approx(truth.rate(2000), rel=1e-3)


def test_fit_error_is_recorded_and_extra_sections_survive(tmp_path):
    cal = _calibration()
    assert cal.attention.fit_error == pytest.approx(0.0, abs=1e-12)
    assert cal.links["alltoall"].fit_error == pytest.approx(0.1 / 1.1, rel=1e-9)
    path = str(tmp_path / "cal.json")
    save_calibration(cal, path)
    assert os.stat(path).st_mode & 0o777 == 0o644
    raw = json.load(open(path))
    assert raw["profile"]["load_average"]["before"] == 1.5
    assert raw["links"]["alltoall"]["fit_error"] == pytest.approx(0.1 / 1.1, rel=1e-9)
    assert raw["attention_diagonal"]["fit"]["fall_tokens"] == DIAGONAL.fall_tokens
    back = load_calibration(path)
    assert back == cal and back.extra == cal.extra
    save_calibration(back, path)  # a second round trip keeps the section too
    assert json.load(open(path))["profile"] == raw["profile"]


def test_apply_sets_diagonal_and_alltoall_and_sources():
    default = CostModel.default(MODEL, TOPOLOGY)
    cost = apply_calibration(default, _calibration(), source="cal.json")
    assert cost.attention == FULL and cost.diagonal == DIAGONAL
    assert cost.alltoall_link() == LinkCost(2e9, 3e-4)
    assert cost.remap_time(1000) == pytest.approx(3e-4 + cost.remap_bytes(1000) / 2e9)
    for name in ("attention", "attention_diagonal", "alltoall"):
        assert cost.sources[name] == "cal.json"
    assert cost.sources["nic"] == "default"
    # An older file (one attention curve, no all-to-all) prices both kinds with it, and says so.
    old = apply_calibration(
        default, _calibration(attention_diagonal=None, links={}), source="old.json"
    )
    assert old.diagonal == old.attention == FULL
    assert old.sources["attention_diagonal"] == "old.json"
    assert old.sources["alltoall"] == "default"


def test_default_alltoall_follows_the_slowest_link():
    two_nodes = CostModel.default(MODEL, TOPOLOGY)
    one_node = CostModel.default(MODEL, Topology(num_nodes=1, gpus_per_node=4, nics_per_node=4))
    assert two_nodes.alltoall_link().bytes_per_s == two_nodes.nic.bytes_per_s
    assert one_node.alltoall_link().bytes_per_s == one_node.nvlink.bytes_per_s
    slower = two_nodes.with_figures("cal", nic=LinkCost(1e8, 1e-4))
    assert slower.remap_time(4096) > two_nodes.remap_time(4096)
    assert slower.sources["alltoall"] == "derived"
    with pytest.raises(ValueError, match="unknown cost figures"):
        two_nodes.with_figures("cal", carrier_pigeon=LinkCost(1.0, 1.0))
