"""Pure tier (subprocesses, no process groups): the benchmark scripts still run end to end.

The figures they print belong in docs/BENCHMARKS.md, not in assertions; these runs are the
smallest each script allows and check only that it finishes and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(*argv: str, timeout: float = 240.0) -> str:
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.pure
def test_planner_latency_benchmark_prints_its_table() -> None:
    out = run_script(
        "scripts/bench_planner.py", "--quick", "--seeds", "1", "--distributions", "wikipedia"
    )
    assert "| 1024 |" in out and "wikipedia" in out and "prolong" not in out
    (row,) = [line for line in out.splitlines() if line.startswith("| 1024 |")]
    *_, efficiency, ended, _ = [cell.strip() for cell in row.split("|")]
    assert 0 < float(efficiency) <= 1 and ended in ("0/1", "1/1")


@pytest.mark.dist
def test_comparison_sweep_prints_speedups() -> None:
    out = run_script("scripts/compare_sweep.py", "--quick", "--steps", "1")
    assert "speedup_vs_te" in out


@pytest.mark.dist
@pytest.mark.parametrize("script", ["scripts/gen_flag_docs.py"])
def test_flag_table_matches_the_megatron_doc(script: str) -> None:
    table = [line for line in run_script(script).splitlines() if line.startswith("| `--")]
    doc = (ROOT / "docs" / "MEGATRON.md").read_text()
    assert table and all(line in doc for line in table), "rerun scripts/gen_flag_docs.py"


@pytest.mark.dist
def test_engine_overhead_benchmark_runs_on_a_small_plan() -> None:
    out = run_script(
        "scripts/bench_engine_overhead.py",
        "--num-docs",
        "40",
        "--long-lengths",
        "2048",
        "--repeats",
        "1",
        "--no-kernel-timing",
    )
    assert "bookkeeping" in out


@pytest.mark.dist
def test_host_overhead_benchmark_prints_host_against_gpu_time() -> None:
    out = run_script(
        "scripts/bench_host_overhead.py",
        "--tokens-per-gpu",
        "4096",
        "--distributions",
        "wikipedia",
        "--repeats",
        "1",
    )
    rows = [line for line in out.splitlines() if line.startswith("| 4096 | wikipedia |")]
    assert [row.split("|")[3].strip() for row in rows] == ["flat", "2-D"]
    host, gpu, ratio = (float(cell) for cell in rows[0].split("|")[8:11])
    assert host > 0 and gpu > 0 and ratio == pytest.approx(host / gpu, abs=0.01)


@pytest.mark.dist
def test_fault_drill_resumes_a_torn_checkpoint_with_the_same_losses(tmp_path) -> None:
    out = run_script(
        "scripts/fault_drill.py",
        "--drills",
        "torn-checkpoint",
        "--steps",
        "5",
        "--fault-at",
        "2",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path),
        timeout=1200.0,
    )
    row = next(line for line in out.splitlines() if line.startswith("torn-checkpoint"))
    assert row.split()[1] == "yes", out
    assert "max |loss diff| 0" in out and "rank001.pt has" in out


@pytest.mark.dist
def test_resume_benchmark_checks_the_restored_batch_and_prints_both_times() -> None:
    out = run_script(
        "scripts/bench_resume.py",
        "--tokens",
        "300000",
        "--tokens-per-step",
        "20000",
        "--micro-batches",
        "2",
        "--steps",
        "3",
    )
    assert "replay" in out and "restore" in out and "ms per step" in out


@pytest.mark.dist
def test_plan_ahead_benchmark_runs_every_planner() -> None:
    out = run_script(
        "scripts/bench_plan_ahead.py", "--plans", "2", "--workers", "1", "--dist", "wikipedia"
    )
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"none", "thread", "processes 1", "processes 1, collector off"} <= set(rows)
    relative = float(rows["processes 1"].split("|")[3])
    assert 0.0 < relative
    assert float(rows["processes 1"].split("|")[4]) > 0.0  # the longest stop, in ms
    # With the collector off (``--manual-gc``) it makes no full pass of its own.
    assert rows["processes 1, collector off"].split("|")[5].strip().startswith("0 (")
    assert "decoded in" in out


@pytest.mark.pure
def test_pipeline_shapes_benchmark_counts_and_prices_both_ways() -> None:
    out = run_script(
        "scripts/bench_pipeline_shapes.py", "--steps", "1", "--micro-batches", "2",
        "--corpus-tokens", "2000000", "--seq-length", "4096", "--nodes", "1",
    )  # fmt: skip
    fill = float(out.split("mean ")[1].split(",")[0])
    assert 0.5 < fill <= 1.0
    assert "padded shape:" in out and "shape messages:" in out


@pytest.mark.dist
def test_planning_at_scale_benchmark_prints_plan_and_step_times() -> None:
    out = run_script("scripts/bench_plan_scale.py", "--only", "2", "--no-pool")
    (row,) = [line for line in out.splitlines() if line.startswith("| lognormal |")]
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells[:3] == ["lognormal", "1024", "0.50"] and len(cells) == 14
    plan_s, step_s, ratio = map(float, cells[7:10])
    assert plan_s > 0 and step_s > 0 and ratio == pytest.approx(plan_s / step_s, abs=0.01)


@pytest.mark.dist
def test_ring_search_benchmark_times_the_rings_of_one_plan() -> None:
    out = run_script("scripts/bench_ring_search.py", "--only", "2", "--repeats", "1")
    first, second, third = out.splitlines()[-3:]
    assert first.startswith("lognormal 1024 GPUs 50% dgx-h100 llama-7b, seed 0:"), first
    rings = int(first.split(" rings searched")[0].split()[-1])
    soonest = int(first.split(", ")[-1].split(" to the soonest")[0])
    assert rings > 100 and 0 < soonest < rings  # both paths of the search are timed
    whole, fits = (float(part.split(" ms")[0].split()[-1]) for part in second.split(", "))
    assert whole > 0 and fits > 0  # both timed (separate passes: no order between them here)
    assert third.startswith("rings' lines: ") and int(third.split()[-3]) > 0, third


@pytest.mark.dist
def test_plan_digests_find_the_same_plans_twice(tmp_path) -> None:
    written = str(tmp_path / "digests.json")
    run_script("scripts/plan_digests.py", "--sets", "sweep", "--first", "3", "--write", written)
    out = run_script("scripts/plan_digests.py", "--sets", "sweep", "--first", "3", "--against",
                     written)  # fmt: skip
    assert "3 of 3 plans the same; step after / before: max 1.0000" in out


@pytest.mark.pure
def test_plan_wire_benchmark_compares_the_forms_and_the_remaps() -> None:
    out = run_script("scripts/bench_plan_wire.py", "--rounds", "1", "--plans", "2")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:6] in FORMS}
    assert set(rows) == {"pickle", "wire"} and all(float(r[3]) > 0 for r in rows.values())
    assert "rank by rank" in out and "remap_pair" in out
    parts = {
        line.split(":")[0].removeprefix("before the first layer, "): float(line.split()[-7])
        for line in out.splitlines()
        if line.startswith("before the first layer") and "in all" not in line
    }
    assert set(parts) == {"linear batch", "layouts and remap", "engine"}
    assert all(ms > 0 for ms in parts.values())
    for name in ("the plan line's summary", "the simulator's report"):
        line = next(line for line in out.splitlines() if line.startswith(name))
        assert float(line.removeprefix(name + ":").split()[0]) > 0


FORMS = ("pickle", "wire  ")


@pytest.mark.dist
def test_plan_sharing_benchmark_feeds_steps_and_reports_waits() -> None:
    out = run_script("scripts/bench_plan_share.py", "--steps", "2", "--ahead", "1")
    assert "first step waited" in out and "cores per node with plans shared" in out
