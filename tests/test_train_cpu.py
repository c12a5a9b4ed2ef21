"""The CPU training job: the loss falls, and stop/resume continues exactly like an uninterrupted
run (tier: processes; one spawn of 4 gloo ranks = 2 emulated nodes x 2 GPUs)."""

from __future__ import annotations

import pytest

from megatron_zeppelin.testing.dist import run_distributed

pytestmark = pytest.mark.dist


def _three_runs(rank: int, world_size: int, run_dir: str) -> dict:
    from megatron_zeppelin.megatron.train_cpu import build_parser, train

    common = [
        "--run-dir", run_dir, "--quiet", "--dataset-tokens", "40000", "--tokens-per-step",
        "2048", "--zeppelin-capacity", "1024", "--zeppelin-max-document-length", "1024",
        "--zeppelin-intra-threshold", "96", "--zeppelin-inter-threshold", "384",
    ]  # fmt: skip

    def run(*extra: str) -> list[dict]:
        return train(build_parser().parse_args(common + list(extra)))["steps"]

    whole = run("--steps", "6")
    first = run("--steps", "3", "--save", f"{run_dir}/ckpt")
    resumed = run("--steps", "6", "--load", f"{run_dir}/ckpt")
    return {"whole": whole, "first": first, "resumed": resumed}


def _key(record: dict) -> tuple:
    return (record["step"], record["documents"], [p["digest"] for p in record["plans"]])


def test_loss_falls_and_resume_matches_an_uninterrupted_run(tmp_path) -> None:
    results = run_distributed(_three_runs, 4, timeout_s=400, args=(str(tmp_path),))
    whole, first, resumed = results[0]["whole"], results[0]["first"], results[0]["resumed"]
    # Every rank saw the same global figures and the same plans.
    for other in results[1:]:
        assert [_key(r) for r in other["whole"]] == [_key(r) for r in whole]
        assert [r["loss"] for r in other["whole"]] == [r["loss"] for r in whole]

    losses = [r["loss"] for r in whole]
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(r["tokens"] <= 2048 for r in whole)
    tiers = {t for r in whole for p in r["plans"] for t, n in p["tiers"].items() if n}
    assert {"intra", "inter"} <= tiers, "the short run should exercise the rings"
    # Measured ring traffic crosses nodes on the emulated NICs.
    assert any(r["measured_link_bytes"]["nic"] > 0 for r in whole)

    # Stop after 3 steps and resume: the same next batches, plans and losses.
    assert [_key(r) for r in first] == [_key(r) for r in whole[:3]]
    assert [r["step"] for r in resumed] == [3, 4, 5]
    assert [_key(r) for r in resumed] == [_key(r) for r in whole[3:]]
    for a, b in zip(resumed, whole[3:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
