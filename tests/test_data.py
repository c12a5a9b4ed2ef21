"""Document dataset over Megatron ``.bin/.idx`` files, and the synthetic writer.

Tier: pure (files in a tmp dir; megatron-core's own writer and reader, no processes).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megatron_zeppelin.job.synthetic import write_synthetic_dataset
from megatron_zeppelin.megatron.documents.data import DocumentDataset

pytestmark = pytest.mark.pure


def _write_multi_sequence(prefix: str, docs: list[list[list[int]]]) -> None:
    """Documents made of several sequences (as ``--split-sentences`` writes them)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in docs:
        flat = [t for seq in doc for t in seq]
        builder.add_document(torch.tensor(flat), [len(seq) for seq in doc])
    builder.finalize(prefix + ".idx")


def test_lengths_and_reads_follow_the_written_documents(tmp_path):
    lengths = [5, 1, 17, 3, 40]
    summary = write_synthetic_dataset(str(tmp_path / "d"), lengths=lengths, vocab_size=100, seed=3)
    ds = DocumentDataset(summary.path_prefix)
    assert ds.lengths.tolist() == lengths
    assert ds.num_tokens == sum(lengths) == summary.num_tokens
    assert ds.dtype == np.uint16  # megatron-core's choice for a small vocabulary
    whole = [ds.read(d) for d in range(len(lengths))]
    assert all(w.dtype == np.int64 and w.shape[0] == n for w, n in zip(whole, lengths))
    assert all(((w >= 0) & (w < 100)).all() for w in whole)
    # Any range equals the slice of the whole document.
    rng = np.random.default_rng(0)
    for _ in range(20):
        d = int(rng.integers(len(lengths)))
        a, b = sorted(int(x) for x in rng.integers(0, lengths[d] + 1, size=2))
        assert np.array_equal(ds.read(d, a, b), whole[d][a:b])


def test_documents_of_several_sequences_read_contiguously(tmp_path):
    docs = [[[1, 2], [3, 4, 5]], [[6]], [[7, 8, 9], [10], [11, 12]]]
    prefix = str(tmp_path / "multi")
    _write_multi_sequence(prefix, docs)
    ds = DocumentDataset(prefix)
    assert ds.lengths.tolist() == [5, 1, 6]
    assert ds.read(0).tolist() == [1, 2, 3, 4, 5]
    assert ds.read(2, 1, 5).tolist() == [8, 9, 10, 11]


def test_read_counter_and_range_checks(tmp_path):
    summary = write_synthetic_dataset(str(tmp_path / "d"), lengths=[10, 20], seed=0)
    ds = DocumentDataset(summary.path_prefix + ".idx")  # a file name works as well as a prefix
    ds.read(1, 4, 9)
    ds.read(0, 3, 3)
    assert ds.num_tokens_read == 5
    with pytest.raises(ValueError, match="has 20 tokens"):
        ds.read(1, 5, 21)
    with pytest.raises(ValueError, match="outside 0..1"):
        ds.read(2)


def test_missing_file_is_named(tmp_path):
    summary = write_synthetic_dataset(str(tmp_path / "d"), lengths=[4, 4], seed=0)
    os.remove(summary.path_prefix + ".bin")
    with pytest.raises(ValueError, match=r"d\.bin does not exist"):
        DocumentDataset(summary.path_prefix)
    with pytest.raises(ValueError, match=r"nothing\.idx does not exist"):
        DocumentDataset(str(tmp_path / "nothing"))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("header", "not a Megatron index file"),
        ("truncate_idx", "is truncated"),
        ("truncate_bin", "do not belong together or one was cut short"),
        ("version", "index version"),
    ],
)
def test_corrupt_files_raise_value_error_naming_the_file(tmp_path, damage, message):
    prefix = write_synthetic_dataset(str(tmp_path / "d"), lengths=[7, 9, 11], seed=0).path_prefix
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if damage == "header":
        with open(idx, "r+b") as f:
            f.write(b"NOTMEGA!!")
    elif damage == "truncate_idx":
        os.truncate(idx, os.path.getsize(idx) - 8)
    elif damage == "truncate_bin":
        os.truncate(bin_, os.path.getsize(bin_) - 2)
    elif damage == "version":
        with open(idx, "r+b") as f:
            f.seek(9)
            f.write((7).to_bytes(8, "little"))
    with pytest.raises(ValueError, match=message) as info:
        DocumentDataset(prefix)
    assert os.path.basename(prefix) in str(info.value)


def test_patterned_tokens_follow_a_per_document_stride(tmp_path):
    vocab = 64
    summary = write_synthetic_dataset(
        str(tmp_path / "p"), lengths=[30, 2, 50], vocab_size=vocab, tokens="patterned", seed=1
    )
    ds = DocumentDataset(summary.path_prefix)
    for d in range(ds.num_documents):
        steps = np.diff(ds.read(d)) % vocab
        assert len(set(steps.tolist())) <= 1 and all(1 <= s <= 4 for s in steps)


def test_synthetic_writer_is_deterministic_and_validates(tmp_path):
    a = write_synthetic_dataset(str(tmp_path / "a"), lengths=[9, 3], tokens="random", seed=5)
    b = write_synthetic_dataset(str(tmp_path / "b"), lengths=[9, 3], tokens="random", seed=5)
    c = write_synthetic_dataset(str(tmp_path / "c"), lengths=[9, 3], tokens="random", seed=6)
    read = lambda s: open(s.path_prefix + ".bin", "rb").read()  # noqa: E731
    assert read(a) == read(b) != read(c)
    with pytest.raises(ValueError, match="not both"):
        write_synthetic_dataset(str(tmp_path / "x"), lengths=[3], distribution="wikipedia")
    with pytest.raises(ValueError, match="positive"):
        write_synthetic_dataset(str(tmp_path / "x"), lengths=[3, 0])
    with pytest.raises(ValueError, match="tokens must be one of"):
        write_synthetic_dataset(str(tmp_path / "x"), lengths=[3], tokens="zeros")


def test_synthetic_lengths_from_an_embedded_distribution(tmp_path):
    pytest.importorskip("megatron_zeppelin.planner.baselines.distributions")
    summary = write_synthetic_dataset(
        str(tmp_path / "w"), distribution="wikipedia", num_tokens=200_000, max_length=16384, seed=0
    )
    ds = DocumentDataset(summary.path_prefix)
    assert ds.num_documents == summary.num_documents > 10
    assert int(ds.lengths.max()) <= 16384
    # Within a document's length of the request: lengths are drawn until the budget is met.
    assert abs(ds.num_tokens - 200_000) <= 16384


def test_make_dataset_command_writes_inspects_and_reports_bad_input(tmp_path, capsys):
    import json

    from megatron_zeppelin.cli import main

    lengths_file = tmp_path / "lengths.txt"
    lengths_file.write_text("12, 40\n7 3\n")
    prefix = str(tmp_path / "cli")
    report = tmp_path / "info.json"
    assert main(["make-dataset", "--output", prefix, "--lengths", str(lengths_file)]) == 0
    assert DocumentDataset(prefix).lengths.tolist() == [12, 40, 7, 3]
    assert main(["make-dataset", "--inspect", prefix, "--json", str(report)]) == 0
    info = json.loads(report.read_text())
    assert info["documents"] == 4 and info["tokens"] == 62 and info["max"] == 40
    capsys.readouterr()
    assert main(["make-dataset", "--inspect", str(tmp_path / "absent")]) == 2
    assert "absent.idx does not exist" in capsys.readouterr().err
    lengths_file.write_text("12 forty\n")
    assert main(["make-dataset", "--output", prefix, "--lengths", str(lengths_file)]) == 2
    assert "integer document lengths" in capsys.readouterr().err
