"""Bad input stops a command with one line ``zeppelin CMD: error: ...`` and exit status 2, before
any process starts; a worker that finds bad input later ends the job the same way.

Tier: pure for the start-up checks (commands run in-process, the launcher is replaced by a stub
that fails the test if reached); processes for one ``zeppelin train`` launch whose workers
refuse their topology (marked ``dist``) and one in-process gloo rank running the CPU job on
micro-batches without documents.
"""

from __future__ import annotations

import os
import sys

import pytest

from megatron_zeppelin.cli import main
from megatron_zeppelin.commands import train as train_command


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"zeppelin {command}: error: "), err
    return err[0]


@pytest.fixture
def no_launch(monkeypatch):
    """Reaching the launcher means a check let bad input through."""

    def refuse(args):
        raise AssertionError("workers were started despite bad input")

    monkeypatch.setattr(train_command, "_launch", refuse)


@pytest.fixture
def dataset(tmp_path) -> str:
    from megatron_zeppelin.job.synthetic import write_synthetic_dataset

    prefix = str(tmp_path / "docs")
    write_synthetic_dataset(prefix, lengths=[50, 30, 20], vocab_size=512)
    return prefix


def _train(tmp_path, *flags: str) -> list[str]:
    return ["train", "--run-dir", str(tmp_path / "run"), *flags]


TRAIN_CASES = [
    (["--nproc", "3"], "do not split evenly over 2 nodes"),
    (["--nproc", "4", "--tensor-parallel", "3"], "--tensor-parallel 3 does not divide"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--zeppelin-topology", "dgx-h100"], "--zeppelin-topology dgx-h100 has 8 GPUs per node"),
    (["--zeppelin-nodes", "2", "--zeppelin-gpus-per-node", "4"], "2 nodes hold 8 ranks, but 4"),
    (["--zeppelin-intra-threshold", "900", "--zeppelin-inter-threshold", "100"], "below"),
    (
        [
            "--zeppelin-capacity",
            "100",
            "--zeppelin-intra-threshold",
            "off",
            "--zeppelin-inter-threshold",
            "off",
        ],
        "smaller than the longest document",
    ),
    (["--zeppelin-capacity", "500"], "does not fit in 1 micro-batch"),
    (["--tokens-per-step", "1000"], "exceeds --tokens-per-step 1000"),
    (["--num-kv-heads", "3"], "not a multiple of --num-kv-heads 3"),
    (["--nproc", "4", "--tensor-parallel", "4", "--zeppelin-nodes", "1"], "--num-kv-heads 2"),
    (["--zeppelin-kernel", "flash"], "needs CUDA, but this job runs on CPU processes"),
    (["--distribution", "nowhere"], "unknown length distribution"),
    (["--steps", "-1"], "--steps must be at least 0"),
]


@pytest.mark.pure
@pytest.mark.parametrize("flags, needle", TRAIN_CASES)
def test_train_refuses_bad_flags_before_launch(flags, needle, tmp_path, capsys, no_launch):
    assert main(_train(tmp_path, *flags)) == 2
    assert needle in _one_error_line(capsys, "train")


@pytest.mark.pure
def test_train_refuses_missing_corrupt_or_foreign_data(tmp_path, capsys, no_launch, dataset):
    assert main(_train(tmp_path, "--dataset", str(tmp_path / "absent"))) == 2
    assert "does not exist" in _one_error_line(capsys, "train")

    broken = tmp_path / "broken"
    (tmp_path / "broken.bin").write_bytes(b"")
    (tmp_path / "broken.idx").write_bytes(b"not an index at all")
    assert main(_train(tmp_path, "--dataset", str(broken))) == 2
    assert "not a Megatron index file" in _one_error_line(capsys, "train")

    # The same data with a vocabulary too small for its token ids.
    assert main(_train(tmp_path, "--dataset", dataset, "--vocab-size", "4")) == 2
    assert "outside the model's vocabulary" in _one_error_line(capsys, "train")


@pytest.mark.pure
def test_train_refuses_a_checkpoint_it_cannot_resume(tmp_path, capsys, no_launch):
    assert main(_train(tmp_path, "--load", str(tmp_path / "ckpt"))) == 2
    assert "no such directory" in _one_error_line(capsys, "train")

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert main(_train(tmp_path, "--load", str(ckpt))) == 2
    assert "holds no checkpoint" in _one_error_line(capsys, "train")

    # Rank files without a manifest cannot be verified (a cut-short save, or an old layout).
    (ckpt / "rank000.pt").write_bytes(b"")
    (ckpt / "rank001.pt").write_bytes(b"")
    assert main(_train(tmp_path, "--load", str(ckpt))) == 2
    assert "no manifest.json" in _one_error_line(capsys, "train")

    from megatron_zeppelin import checkpoint

    directory = checkpoint.step_directory(str(ckpt), 3)
    files = tuple(checkpoint.write_rank_file(directory, r, 3, b"state") for r in range(2))
    checkpoint.write_manifest(directory, checkpoint.Manifest(3, files, {}))
    checkpoint.commit(str(ckpt), 3)
    assert main(_train(tmp_path, "--load", str(ckpt))) == 2
    assert "saved by 2 processes but this run starts 4" in _one_error_line(capsys, "train")


@pytest.mark.pure
def test_train_refuses_a_calibration_for_another_model_in_one_line(tmp_path, capsys, no_launch):
    from megatron_zeppelin.job.train_cpu import MACHINE_CALIBRATION

    if not os.path.exists(MACHINE_CALIBRATION):
        pytest.skip("no calibration file in this checkout")
    flags = ["--zeppelin-calibration", MACHINE_CALIBRATION, "--hidden-size", "128"]
    assert main(_train(tmp_path, *flags)) == 2
    assert "hidden_size" in _one_error_line(capsys, "train")

    bad = tmp_path / "bad.json"
    bad.write_text("{not json\n\n")
    assert main(_train(tmp_path, "--zeppelin-calibration", str(bad))) == 2
    assert "not valid JSON" in _one_error_line(capsys, "train")


@pytest.mark.pure
def test_good_flags_pass_the_checks_and_reach_the_launcher(tmp_path, monkeypatch, dataset):
    launched = []
    monkeypatch.setattr(train_command, "_launch", lambda args: launched.append(args) or 0)
    assert main(_train(tmp_path, "--steps", "2")) == 0
    flags = [
        "--dataset",
        dataset,
        "--tokens-per-step",
        "64",
        "--zeppelin-max-document-length",
        "64",
        "--zeppelin-topology",
        "auto",
        "--zeppelin-nodes",
        "1",
        "--nproc",
        "2",
    ]
    assert main(_train(tmp_path, *flags)) == 0
    assert len(launched) == 2 and launched[1].nproc == 2


@pytest.mark.pure
def test_check_refuses_options_before_spawning(capsys):
    assert main(["check", "--tensor-parallel", "3"]) == 2
    assert "does not divide the check's 4 processes" in _one_error_line(capsys, "check")
    assert main(["check", "--tensor-parallel", "4"]) == 2
    assert "num_kv_heads" in _one_error_line(capsys, "check")
    assert main(["check", "--tolerance", "0"]) == 2
    assert "--tolerance must be positive" in _one_error_line(capsys, "check")


@pytest.mark.pure
def test_check_reports_rank_zeros_error_else_the_first(tmp_path):
    from megatron_zeppelin.job.check import _first_error

    assert _first_error(str(tmp_path), 4) is None
    (tmp_path / "rank2.error").write_text("two")
    assert _first_error(str(tmp_path), 4) == "two"
    (tmp_path / "rank0.error").write_text("zero")
    assert _first_error(str(tmp_path), 4) == "zero"


@pytest.mark.pure
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["verify", "--kernel", "bogus"], "not a known kernel"),
        (["verify", "--kernel", "flash"], "emulated ranks are CPU processes"),
        (["verify", "--nics-per-node", "3"], "exceeds"),
        (["verify", "--tokens", "0"], "positive"),
        (["profile", "-o", "x.json", "--emulate", "2x0"], "must be >= 1"),
        (["profile", "-o", "x.json", "--emulate", "2x2", "--dtype", "int8"], "unknown dtype"),
        (["profile", "-o", "x.json", "--emulate", "2x2", "--kernel", "nope"], "not a known"),
        (["validate-cost-model", "--tokens", "0"], "--tokens must be positive"),
        (["validate-cost-model", "--dtype", "fp8"], "unknown dtype"),
        (["validate-cost-model", "--calibration", "absent.json"], "no such file"),
    ],
)
def test_spawning_commands_check_flags_first(argv, needle, capsys, monkeypatch, tmp_path):
    from megatron_zeppelin.cli import load_command
    from megatron_zeppelin.launch import ranks as harness

    def refuse(*args, **kwargs):
        raise AssertionError("processes were started despite bad input")

    # The harness and every module that imported its launcher by name.
    load_command(argv[0])
    for module in list(sys.modules.values()):
        if getattr(module, "run_distributed", None) is harness.run_distributed:
            monkeypatch.setattr(module, "run_distributed", refuse)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert needle in _one_error_line(capsys, argv[0])
    assert not os.path.exists("x.json")


@pytest.mark.dist
def test_a_worker_side_value_error_is_one_line_without_traceback(tmp_path, capfd):
    """The checks are skipped on purpose: the workers meet the bad topology themselves."""
    from megatron_zeppelin.cli import build_parser

    args = build_parser("train").parse_args(
        _train(tmp_path, "--nproc", "2", "--zeppelin-nodes", "3", "--quiet")
    )
    assert train_command._launch(args) == 2
    out, err = capfd.readouterr()
    lines = [line for line in (out + err).splitlines() if "error" in line.lower()]
    assert lines == [
        "zeppelin train: error: 2 data-parallel ranks do not split evenly over 3 nodes: "
        "change --zeppelin-nodes or the number of processes"
    ], out + err
    assert "Traceback" not in out + err


@pytest.mark.threads
def test_cpu_job_skips_micro_batches_without_documents(tmp_path, dataset, one_process_group):
    from megatron_zeppelin.job.train_cpu import build_parser, train

    # Three short documents over four micro-batches: every step leaves some empty.
    args = build_parser().parse_args(
        [
            "--run-dir",
            str(tmp_path),
            "--dataset",
            dataset,
            "--quiet",
            "--no-calibration",
            "--steps",
            "2",
            "--micro-batches",
            "4",
            "--tokens-per-step",
            "100",
            "--zeppelin-max-document-length",
            "64",
            "--zeppelin-nodes",
            "1",
            "--zeppelin-plan-workers",
            "0",  # this tier starts no process
        ]
    )
    steps = train(args)["steps"]
    assert len(steps) == 2
    for record in steps:
        assert any(not mb for mb in record["documents"]), record["documents"]
        docs = [d for mb in record["documents"] for d in mb]
        # Each document leaves its last token unlabelled; empty micro-batches add nothing.
        assert record["loss_tokens"] == sum(end - start for _, start, end in docs) - len(docs)
        assert record["loss"] == record["loss"] and record["loss"] > 0
