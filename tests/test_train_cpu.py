"""The CPU training job: the loss falls, and stop/resume continues exactly like an uninterrupted
run (tier: processes; one spawn of 4 gloo ranks = 2 emulated nodes x 2 GPUs)."""

from __future__ import annotations

import pytest

from megatron_zeppelin.launch.ranks import run_distributed

pytestmark = pytest.mark.dist


def _three_runs(rank: int, world_size: int, run_dir: str) -> dict:
    from megatron_zeppelin.job.train_cpu import build_parser, train

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


def _bf16_runs(rank: int, world_size: int, run_dir: str) -> dict:
    from megatron_zeppelin.job.train_cpu import build_parser, train

    common = [
        "--run-dir", run_dir, "--quiet", "--dataset-tokens", "30000", "--tokens-per-step",
        "2048", "--zeppelin-capacity", "1024", "--zeppelin-max-document-length", "1024",
        "--zeppelin-intra-threshold", "96", "--zeppelin-inter-threshold", "384", "--dtype", "bf16",
    ]  # fmt: skip

    def run(*extra: str) -> dict:
        return train(build_parser().parse_args(common + list(extra)))

    whole = run("--steps", "8")
    run("--steps", "4", "--save", f"{run_dir}/ckpt")
    resumed = run("--steps", "8", "--load", f"{run_dir}/ckpt")
    try:
        run("--steps", "8", "--load", f"{run_dir}/ckpt", "--dtype", "float32")
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"whole": whole, "resumed": resumed["steps"], "refused": refused}


def test_bf16_trains_with_float32_main_weights_and_resumes_exactly(tmp_path) -> None:
    """``--dtype bf16``: every parameter in bfloat16 (norms too), the loss falls, a resumed run
    continues with the same losses (the optimizer's float32 main weights are in the
    checkpoint), and resuming with another dtype is refused with the flag to change."""
    results = run_distributed(_bf16_runs, 2, timeout_s=400, args=(str(tmp_path),))
    whole, resumed = results[0]["whole"], results[0]["resumed"]
    assert whole["summary"]["parameter_dtypes"] == ["torch.bfloat16"]
    losses = [r["loss"] for r in whole["steps"]]
    assert losses[-1] < losses[0] - 0.05, losses
    assert [r["step"] for r in resumed] == [4, 5, 6, 7]
    for a, b in zip(resumed, whole["steps"][4:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert "resume with the same --dtype" in results[0]["refused"]
