"""Bad input is one line and exit status 2, never a traceback, a hang or silently wrong
training: damaged datasets, absurd lengths and sizes, flags a command would ignore.

Tier: pure (commands run in-process; no process starts).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from megatron_zeppelin.cli import main
from megatron_zeppelin.job.synthetic import write_synthetic_dataset
from megatron_zeppelin.megatron.documents.data import DocumentDataset, checksum_path

pytestmark = pytest.mark.pure

CLUSTER = ["--nodes", "1", "--gpus-per-node", "2", "--nics-per-node", "1"]


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"zeppelin {command}: error: "), err
    assert "Traceback" not in err[0]
    return err[0]


@pytest.fixture
def lengths_files(tmp_path) -> dict[str, str]:
    files = {
        "ok": "100\n200\n",
        "huge": "5\n" + str(10**24) + "\n",
        "int64max": str(2**63 - 1) + "\n",
        "tera": "5\n" + str(10**12) + "\n",
    }
    paths = {}
    for name, text in files.items():
        paths[name] = str(tmp_path / f"{name}.txt")
        with open(paths[name], "w") as f:
            f.write(text)
    paths["binary"] = str(tmp_path / "binary.txt")
    with open(paths["binary"], "wb") as f:
        f.write(bytes(range(256)) * 2)
    return paths


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--lengths", "{huge}", *CLUSTER], "line 2: length 1" + "0" * 24 + " is longer"),
    (["plan", "--lengths", "{int64max}", *CLUSTER], "is longer than any document Megatron"),
    (["plan", "--lengths", "{ok}", *CLUSTER, "--tp", "0"], "--tp must be a positive"),
    (["plan", "--lengths", "{ok}", *CLUSTER, "--tp", "-2"], "--tp must be a positive"),
    (["plan", "--lengths", "{binary}", *CLUSTER], "binary.txt is not a text file"),
    (["make-dataset", "--output", "{out}", "--lengths", "{binary}"], "binary.txt is not a text"),
    (["verify", "--lengths", "{tera}"], "line 2: length 1000000000000 is longer"),
    (["simulate", "--lengths", "{ok}", *CLUSTER, "--steps", "0"], "--steps must be at least 1"),
    (["simulate", "--lengths", "{ok}", *CLUSTER, "--nic-gbit", "inf"], "--nic-gbit must be a"),
    (["compare", "--lengths", "{ok}", *CLUSTER, "--nvlink-gbps", "nan"], "--nvlink-gbps must be"),
    (["plan", "--dist", "wikipedia", "--tokens", str(10**15), *CLUSTER], "beyond any cluster"),
    (["simulate", "--plan", "{plan}", "--lengths", "{ok}"], "drop --lengths"),
    (["simulate", "--plan", "{plan}", "--builder", "hybrid-dp"], "drop --builder"),
    (["check", "--json", "{missing}/report.json"], "does not exist"),
])  # fmt: skip
def test_commands_refuse_bad_input_in_one_line(argv, needle, lengths_files, tmp_path, capsys):
    plan = str(tmp_path / "plan.json")
    assert main(["plan", "--lengths", lengths_files["ok"], *CLUSTER, "--json", plan]) == 0
    capsys.readouterr()
    names = {
        **lengths_files,
        "plan": plan,
        "out": str(tmp_path / "out"),
        "missing": str(tmp_path / "missing"),
    }
    argv = [a.format(**names) for a in argv]
    assert main(argv) == 2
    assert needle in _one_error_line(capsys, argv[0])


def test_verify_refuses_a_reference_that_cannot_fit(tmp_path, capsys):
    path = tmp_path / "giga.txt"
    path.write_text("5\n1000000000\n")  # indexable, but its dense reference is exabytes
    assert main(["verify", "--lengths", str(path)]) == 2
    assert "needs about" in _one_error_line(capsys, "verify")


def test_compare_fails_when_no_builder_can_plan(lengths_files, capsys):
    argv = ["compare", "--lengths", lengths_files["ok"], *CLUSTER, "--capacity", "50"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out.count("cannot plan") == 6  # the table still shows why, per builder
    assert "no builder could plan" in captured.err
    # One builder that plans is enough for a comparison.
    assert main(["compare", "--lengths", lengths_files["ok"], *CLUSTER, "--capacity", "150"]) == 0


def test_simulate_plan_alone_still_works(lengths_files, tmp_path, capsys):
    plan = str(tmp_path / "plan.json")
    assert main(["plan", "--lengths", lengths_files["ok"], *CLUSTER, "--json", plan]) == 0
    assert main(["simulate", "--plan", plan, "--model", "llama-3b", "--no-remap"]) == 0


# --- datasets ----------------------------------------------------------------------------------
def _dataset(tmp_path, name="docs") -> str:
    prefix = str(tmp_path / name)
    write_synthetic_dataset(prefix, lengths=[50, 30, 20, 40, 10], vocab_size=512, seed=1)
    return prefix


def _pointers(prefix: str) -> tuple[int, np.ndarray]:
    """Offset and values of the .idx pointer table (see ``megatron.documents.data``)."""
    with open(prefix + ".idx", "rb") as f:
        head = f.read(34)
    num_sequences = int.from_bytes(head[18:26], "little")
    offset = 34 + 4 * num_sequences
    return offset, np.fromfile(prefix + ".idx", dtype=np.int64, count=num_sequences, offset=offset)


def _write_pointers(prefix: str, pointers: np.ndarray) -> None:
    offset, _ = _pointers(prefix)
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(pointers.astype(np.int64).tobytes())
    os.remove(checksum_path(prefix))  # the damage the format itself must catch


@pytest.mark.parametrize("damage, document", [
    ("zeroed", 1),  # every pointer 0: document 0 is right, 1 is the first wrong one
    ("random", 0),
    ("swapped", 2),  # two documents' pointers exchanged: in range, not monotone
    ("past_end", 4),
])  # fmt: skip
def test_a_damaged_pointer_table_names_the_file_and_first_bad_document(tmp_path, damage, document):
    prefix = _dataset(tmp_path)
    _, pointers = _pointers(prefix)
    if damage == "zeroed":
        pointers[:] = 0
    elif damage == "random":
        pointers[:] = np.random.default_rng(0).integers(-(10**9), 10**9, size=pointers.size)
    elif damage == "swapped":
        pointers[[2, 3]] = pointers[[3, 2]]
    else:
        pointers[4] += 10**6
    _write_pointers(prefix, pointers)
    with pytest.raises(
        ValueError, match=f"docs.idx: the pointer table is damaged from document {document} on"
    ):
        DocumentDataset(prefix)


def test_train_refuses_a_damaged_pointer_table_before_launch(tmp_path, capsys, monkeypatch):
    from megatron_zeppelin.commands import train as train_command

    monkeypatch.setattr(train_command, "_launch", lambda args: pytest.fail("launched"))
    prefix = _dataset(tmp_path)
    _, pointers = _pointers(prefix)
    _write_pointers(prefix, np.zeros_like(pointers))
    assert main(["train", "--run-dir", str(tmp_path), "--dataset", prefix]) == 2
    assert "pointer table is damaged from document 1" in _one_error_line(capsys, "train")


def test_the_checksum_sidecar_catches_a_same_size_bin_from_another_dataset(tmp_path, capsys):
    prefix = _dataset(tmp_path)
    other = str(tmp_path / "other")
    write_synthetic_dataset(other, lengths=[50, 30, 20, 40, 10], vocab_size=512, seed=2)
    assert os.path.getsize(prefix + ".bin") == os.path.getsize(other + ".bin")
    DocumentDataset(prefix)  # as written: accepted
    shutil.copy(other + ".bin", prefix + ".bin")
    with pytest.raises(ValueError, match="docs.bin does not match .*docs.checksum.json"):
        DocumentDataset(prefix)
    assert main(["make-dataset", "--inspect", prefix]) == 2
    assert "does not match" in _one_error_line(capsys, "make-dataset")
    # Without a sidecar the format cannot tell; the dataset is read as it is.
    os.remove(checksum_path(prefix))
    assert DocumentDataset(prefix).num_documents == 5


def test_an_empty_dataset_is_one_line_without_noise(tmp_path, capfd):
    from megatron_zeppelin.megatron.documents.data import indexed_dataset_module

    io = indexed_dataset_module()
    prefix = str(tmp_path / "empty")
    builder = io.IndexedDatasetBuilder(prefix + ".bin", dtype=io.DType.optimal_dtype(512))
    builder.finalize(prefix + ".idx")
    assert main(["make-dataset", "--inspect", prefix]) == 2
    _, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert lines == [
        f"zeppelin make-dataset: error: the dataset {prefix} holds no tokens "
        "(0 documents): train on a dataset with documents in it"
    ], err


@pytest.mark.parametrize("flags, needle", [
    (["--lr", "inf"], "--lr must be a positive finite number"),
    (["--lr", "nan"], "--lr must be a positive finite number"),
    (["--steps", "0"], "--steps 0 trains no step"),
])  # fmt: skip
def test_train_refuses_nonsense_flags(tmp_path, capsys, monkeypatch, flags, needle):
    from megatron_zeppelin.commands import train as train_command

    monkeypatch.setattr(train_command, "_launch", lambda args: pytest.fail("launched"))
    assert main(["train", "--run-dir", str(tmp_path), *flags]) == 2
    assert needle in _one_error_line(capsys, "train")


@pytest.mark.parametrize("command", ["verify", "check"])
def test_a_failed_run_of_verify_or_check_is_one_line_naming_the_log(command, monkeypatch, capsys):
    from megatron_zeppelin.launch import ranks as harness

    def stalled(fn, world_size, **kwargs):
        raise harness.DistributedRunError(
            "rank 2 of 4 was found stopped (SIGSTOP or a debugger) and was killed\n"
            "rank 0 of 4 raised CommStallError('...')\nTraceback (most recent call last): ...",
            2,
        )

    runner = {"verify": "commands.verify", "check": "job.check"}[command]
    monkeypatch.setattr(f"megatron_zeppelin.{runner}.run_distributed", stalled)
    assert main([command]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"zeppelin {command}: error: rank 2 of 4 was found stopped (SIGSTOP or a debugger) and "
        "was killed (every rank's traceback: "
    ), err
    log = err[0].rsplit(": ", 1)[1].rstrip(")")
    with open(log) as f:
        assert "Traceback" in f.read()
    os.remove(log)
