"""Atomic writes and the one byte format of logs and tables."""

from __future__ import annotations

import os

import pytest

from megatron_zeppelin.fileio import atomic_write, atomic_write_text, format_bytes

pytestmark = pytest.mark.pure


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.bin"
    atomic_write_text(str(path), "old")

    def half_then_fail(f):
        f.write(b"new, half wri")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(str(path), half_then_fail)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["state.bin"]
    atomic_write(str(path), lambda f: f.write(b"new"))
    assert path.read_text() == "new" and oct(path.stat().st_mode & 0o777) == "0o644"


def test_bytes_are_counted_in_powers_of_1000_everywhere():
    assert format_bytes(999) == "999 B"
    assert format_bytes(1500) == "1.50 KB"
    assert format_bytes(2_000_000) == "2.00 MB"
    assert format_bytes(3.1e9) == "3.10 GB"
