"""``zeppelin verify`` end to end, and its input errors.

Tier: processes (the default run starts 4 gloo processes); the error cases are pure (they fail
before any process starts).
"""

from __future__ import annotations

import json

import pytest

from megatron_zeppelin.cli import main as cli_main
from megatron_zeppelin.commands.verify import main as verify_main


@pytest.mark.dist
def test_default_run_passes_and_writes_a_report(tmp_path, capsys):
    report_path = tmp_path / "verify.json"
    assert cli_main(["verify", "--json", str(report_path)]) == 0
    printed = capsys.readouterr().out
    assert "all checks passed" in printed
    report = json.loads(report_path.read_text())
    assert report["ok"] is True
    assert sum(report["lengths"]) == 2048
    cases = {(c["case"], c["routing"]) for c in report["cases"]}
    assert {("zeppelin", True), ("zeppelin", False)} <= cases
    assert any(name.startswith("te-ring-cp") for name, _ in cases)
    for case in report["cases"]:
        assert max(case["errors"].values()) <= case["tolerance"] == 1e-10
        assert case["measured_bytes"] == case["predicted_bytes"]
    zeppelin = {c["routing"]: c for c in report["cases"] if c["case"] == "zeppelin"}
    # The default batch has a document across nodes: routing keeps NIC bytes and spreads them.
    assert zeppelin[True]["tiers"]["inter"] >= 1
    nic_keys = lambda c: {k for k, v in c["measured_bytes"].items() if k.startswith("nic:") and v}  # noqa: E731
    assert len(nic_keys(zeppelin[True])) > len(nic_keys(zeppelin[False]))
    assert zeppelin[True]["measured_bytes"]["nic"] == zeppelin[False]["measured_bytes"]["nic"]
    # The same plan with its inter-node document's heads split inside each node (K/V heads
    # split, not replicated): n - 1 ring steps per rail instead of g - 1 crosses fewer bytes.
    (two_d,) = [c for c in report["cases"] if c["case"] == "zeppelin-2d"]
    assert two_d["two_d_documents"] == zeppelin[True]["tiers"]["inter"]
    assert 0 < two_d["measured_bytes"]["nic"] < zeppelin[True]["measured_bytes"]["nic"]


@pytest.mark.dist
def test_bfloat16_run_checks_posting_order_and_times_each_tier(tmp_path, capsys):
    report_path = tmp_path / "verify.json"
    argv = ["verify", "--dtype", "bfloat16", "--step-timing", "--json", str(report_path)]
    assert cli_main(argv) == 0
    assert "all checks passed" in capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert report["spec"]["dtype"] == "bfloat16" and report["ok"] is True
    for case in report["cases"]:
        assert case["posting_order_consistent"] is True
        assert max(case["errors"].values()) <= case["tolerance"] == 4 * 2**-7
        assert max(case["errors_vs_single_gpu"].values()) <= case["tolerance_vs_single_gpu"]
        timing = case["step_timing"]
        assert len(timing["per_rank"]) == 4
        for figures in timing["max_over_ranks"].values():
            assert 0 <= figures["exposed_ms"] <= figures["comm_ms"] + 1e-6
    zeppelin = next(c for c in report["cases"] if c["case"] == "zeppelin")
    assert {"own", "intra", "inter"} <= set(zeppelin["step_timing"]["max_over_ranks"])


@pytest.mark.pure
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--thresholds", "many"], "--thresholds"),
        (["--thresholds", "1,2,3"], "two numbers"),
        (["--heads", "3", "--kv-heads", "2"], "multiple of --kv-heads"),
        (["--dist", "wikipedia", "--lengths", "x.txt"], "not both"),
        (["--nodes", "0"], "num_nodes"),
        (["--capacity", "0"], "--capacity"),
        (["--device", "cuda"], "GPU"),
    ],
)
def test_bad_flags_exit_2_with_a_sentence(argv, needle, capsys):
    assert verify_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeppelin verify: error:") and needle in err
