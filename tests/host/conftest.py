"""What the host tests' training runs share: the blend of two small datasets they all read,
written once per test process by ``zeppelin make-dataset`` as a user would write it (each
``make-dataset`` imports torch and megatron-core, seconds on two cores)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from launch import ROOT

VOCAB = 128  # token ids of the datasets
# Dataset A, up to 250 tokens: over a node's 128 tokens in test_pretrain_loop.py (inter-node
# rings), and alone in a micro-batch. With --split 8,1,1 documents 0-23 train, 24-26 validate
# and 27-29 test.
LENGTHS = (250, 7, 200, 40, 180, 30, 150, 20, 130, 12, 90, 8, 60, 5, 3, 110, 45, 70, 25, 140)
LENGTHS += (16, 95, 33, 11, 6, 220, 2, 80, 18, 100)
# Dataset B: 20 shorter documents (0-15 train, 16-17 validate, 18-19 test).
LENGTHS_B = (9, 64, 31, 120, 4, 77, 15, 48, 101, 22, 3, 58, 36, 90, 12, 70, 27, 140, 50, 8)
BLEND = "0.3 {a} 0.7 {b}"


def _make_dataset(folder: Path, name: str, lengths: tuple[int, ...]) -> str:
    listed = folder / f"{name}.txt"
    listed.write_text(" ".join(map(str, lengths)))
    prefix = str(folder / name)
    command = [sys.executable, "-m", "megatron_zeppelin.cli", "make-dataset", "--output", prefix]
    command += ["--lengths", str(listed), "--vocab-size", str(VOCAB)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return prefix


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> str:
    """The ``--data-path`` values: a weighted blend of two datasets (``0.3 A 0.7 B``)."""
    folder = tmp_path_factory.mktemp("blend")
    a, b = _make_dataset(folder, "docs", LENGTHS), _make_dataset(folder, "more", LENGTHS_B)
    return BLEND.format(a=a, b=b)
