"""The ``zeppelin`` command line: registry, plan / simulate / compare, and error handling.

Tier: pure (commands run in-process; one subprocess checks that ``--help`` imports no torch).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from megatron_zeppelin.cli import COMMANDS, load_command, main
from megatron_zeppelin.planner.plan.plan import Plan

pytestmark = pytest.mark.pure

CLUSTER = ["--nodes", "2", "--gpus-per-node", "4", "--nics-per-node", "2", "--model", "llama-3b"]


def _write_lengths(tmp_path, lengths: list[int]) -> str:
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(str(n) for n in lengths) + "\n")
    return str(path)


def test_registry_entries_are_well_formed_and_planner_commands_load() -> None:
    for name, entry in COMMANDS.items():
        target = entry if isinstance(entry, str) else entry[0]
        assert target.startswith("megatron_zeppelin."), name
    for name in ("plan", "simulate", "compare"):
        command = load_command(name)
        assert callable(command.add_arguments) and callable(command.run)


def test_top_level_help_is_light() -> None:
    code = (
        "import sys; from megatron_zeppelin.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "compare" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--dist", "prolong"],  # no cluster
        ["compare", *CLUSTER],  # no batch
        ["compare", *CLUSTER, "--dist", "no-such-dist"],
        ["simulate", *CLUSTER, "--dist", "prolong", "--builder", "magic"],
        ["plan", *CLUSTER, "--lengths", "/no/such/file"],
        ["compare", *CLUSTER, "--dist", "prolong", "--tokens", "5000", "--capacity", "0"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0] and "Traceback" not in err[0]


def test_compare_runs_every_builder_on_the_same_batches(tmp_path, capsys) -> None:
    out_json = tmp_path / "compare.json"
    argv = [
        "compare",
        *CLUSTER,
        "--dist",
        "wikipedia",
        "--tokens",
        "30000",
        "--capacity",
        "8192",
        "--steps",
        "2",
        "--quiet",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "cost figures:" in text and "attention=default" in text
    data = json.loads(out_json.read_text())
    rows = {r["builder"]: r for r in data["rows"]}
    static = ("te-ring-cp", "llama3-allgather-cp", "hybrid-dp")
    assert set(rows) == {
        "zeppelin",
        *static,
        *(f"{name} (rule)" for name in static),
        "megatron-dynamic-cp",
        "flexsp",
    }
    for name in static:  # the best static size, priced beside every other that holds them
        assert len(data["static_cp"][name]["cp_size_per_batch"]) == 2
        assert rows[f"{name} (rule)"]["cp_size"] == "rule"
    assert rows["te-ring-cp"]["speedup_vs_te"] == pytest.approx(1.0)
    assert rows["megatron-dynamic-cp"]["speedup_vs_megatron"] == pytest.approx(1.0)
    for row in rows.values():
        assert len(row["step_times_s"]) == 2
        assert 0 < row["efficiency"] <= 1
        assert row["lower_bound_s"] == pytest.approx(rows["te-ring-cp"]["lower_bound_s"])
        te = rows["te-ring-cp"]["step_time_s"]
        assert row["speedup_vs_te"] == pytest.approx(te / row["step_time_s"])


def test_plan_writes_a_plan_that_simulate_reads(tmp_path, capsys) -> None:
    lengths = [9000, 3000, 700, 12000, 50, 400, 2500, 1800]
    plan_path = tmp_path / "plan.json"
    argv = [
        "plan",
        *CLUSTER,
        "--lengths",
        _write_lengths(tmp_path, lengths),
        "--capacity",
        "8192",
        "--json",
        str(plan_path),
    ]
    assert main(argv) == 0
    summary = capsys.readouterr().out
    assert "predicted step" in summary and "lower bound" in summary
    plan = Plan.from_json(str(plan_path))
    assert sorted(plan.lengths) == sorted(lengths)
    assert all(plan.num_attention_tokens(r) <= 8192 for r in range(plan.world_size))
    assert main(["simulate", "--plan", str(plan_path), "--model", "llama-3b"]) == 0
    assert "predicted step" in capsys.readouterr().out


def test_simulate_a_baseline_over_steps(tmp_path, capsys) -> None:
    out_json = tmp_path / "sim.json"
    argv = [
        "simulate",
        *CLUSTER,
        "--dist",
        "prolong",
        "--tokens",
        "20000",
        "--capacity",
        "8192",
        "--steps",
        "2",
        "--builder",
        "te-ring-cp",
        "--quiet",
        "--json",
        str(out_json),
    ]
    assert main(argv) == 0
    results = json.loads(out_json.read_text())
    assert len(results) == 2 and all(r["name"] == "te-ring-cp" for r in results)
    assert all(r["lower_bound_s"] <= r["step_time_s"] for r in results)


def test_plot_writes_png_files(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    lengths = _write_lengths(tmp_path, [9000, 3000, 700, 12000, 50, 400])
    plan_png, compare_png = tmp_path / "plan.png", tmp_path / "compare.png"
    common = [*CLUSTER, "--lengths", lengths, "--capacity", "8192"]
    assert main(["plan", *common, "--plot", str(plan_png)]) == 0
    assert main(["compare", *common, "--steps", "1", "--quiet", "--plot", str(compare_png)]) == 0
    for png in (plan_png, compare_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_pauses_the_garbage_collector_only_while_a_builder_runs(monkeypatch) -> None:
    """The collector is off while a builder plans and simulates, back on after it (also when
    the builder fails), and left off where the caller had switched it off."""
    import gc

    from megatron_zeppelin.commands import simulate as command

    seen = []

    def build_plans(name, lengths, **kwargs):
        seen.append(gc.isenabled())
        raise ValueError("no room")

    monkeypatch.setattr(command, "build_plans", build_plans)
    was_enabled = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            results = command.compare_batches(
                [[10, 20]], topology=None, cost_model=None, capacity=64, builders=["flexsp"]
            )
            assert results == {"flexsp": ["no room"]} and seen[-1] is False
            assert gc.isenabled() is enabled
    finally:
        (gc.enable if was_enabled else gc.disable)()


def test_compare_without_a_terminal_shows_a_line_per_builder(capsys) -> None:
    """Under pytest stderr is no terminal: no bar, but a line for each builder and batch."""
    argv = [
        "compare",
        *CLUSTER,
        "--dist",
        "prolong",
        "--tokens",
        "20000",
        "--capacity",
        "8192",
        "--steps",
        "2",
        "--builders",
        "zeppelin,te-ring-cp",
    ]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("batch ")]
    assert len(lines) >= 4 and len(lines) % 2 == 0
    assert lines[0].startswith("batch 1/2: zeppelin planned and simulated in ")
    assert "te-ring-cp" in lines[3] and "efficiency" in lines[3]
    # Then TE ring CP at each other static CP size, batch by batch.
    for first, second in zip(lines[4::2], lines[5::2]):
        assert first.startswith("batch 1/2: te-ring-cp") and second.startswith(
            "batch 2/2: te-ring-cp"
        )
    assert main([*argv, "--quiet"]) == 0
    assert "batch 1/2" not in capsys.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("numba") is None, reason="the compiled loops need numba"
)
def test_compile_planner_builds_the_loops(capsys) -> None:
    assert main(["compile-planner", "--require"]) == 0
    assert "compiled loops are ready" in capsys.readouterr().out


@pytest.mark.parametrize("require", [False, True])
def test_compile_planner_without_the_loops_says_so(monkeypatch, capsys, require) -> None:
    """Where numba is missing the command says the numpy loops run; ``--require`` fails."""
    import megatron_zeppelin.commands.compile_planner as command

    monkeypatch.setattr(command, "warm", lambda: False)
    argv = ["compile-planner", "--require"] if require else ["compile-planner"]
    assert main(argv) == (1 if require else 0)
    assert "numba is not installed" in capsys.readouterr().out
    monkeypatch.setenv("ZEPPELIN_PLANNER_JIT", "0")
    assert main(argv) == (1 if require else 0)
    assert "ZEPPELIN_PLANNER_JIT=0" in capsys.readouterr().out
