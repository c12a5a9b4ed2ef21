"""Checkpoints a kill cannot tear: atomic rank files, a manifest written last, ``latest`` moved
only once the new checkpoint is complete, and a check that names the first bad file.

Tier: pure (files in a temporary directory; ``zeppelin train`` start-up checks in-process with
the launcher replaced by a stub that fails the test if reached).
"""

from __future__ import annotations

import os
import shutil

import pytest

from megatron_zeppelin import checkpoint
from megatron_zeppelin.cli import main
from megatron_zeppelin.commands import train as train_command

pytestmark = pytest.mark.pure

JOB = {"model": {"hidden_size": 64, "num_layers": 2}, "tensor_parallel": 1}


def save(root: str, step: int, world: int = 2, *, complete: bool = True) -> str:
    """A checkpoint of ``world`` ranks at ``step``; ``complete=False`` stops before the
    manifest, as a kill during the save would."""
    directory = checkpoint.step_directory(root, step)
    files = tuple(
        checkpoint.write_rank_file(
            directory, rank, step, checkpoint.serialize({"rank": rank, "step": step})
        )
        for rank in range(world)
    )
    if complete:
        checkpoint.write_manifest(directory, checkpoint.Manifest(step, files, JOB))
        checkpoint.commit(root, step)
    return directory


def test_a_complete_checkpoint_round_trips_and_replaces_the_previous_one(tmp_path):
    root = str(tmp_path / "ckpt")
    first = save(root, 2)
    assert checkpoint.resolve(root) == first
    manifest = checkpoint.verify(first)
    assert manifest.step == 2 and manifest.world_size == 2 and manifest.job == JOB
    assert checkpoint.load_rank_state(first, 1) == {"rank": 1, "step": 2}
    second = save(root, 4)
    assert checkpoint.resolve(root) == second
    assert not os.path.exists(first), "the previous checkpoint goes once the new one is complete"
    # A step directory can be named directly too.
    assert checkpoint.resolve(second) == second


def test_a_save_cut_short_leaves_the_previous_checkpoint_in_charge(tmp_path):
    root = str(tmp_path / "ckpt")
    good = save(root, 2)
    torn = save(root, 4, complete=False)
    with open(os.path.join(torn, "rank001.pt"), "r+b") as f:
        f.truncate(10)  # a file cut mid-write (atomic writes never leave one; a disk might)
    assert checkpoint.resolve(root) == good
    assert checkpoint.verify(good).step == 2
    # The next complete save removes the torn directory along with the old checkpoint.
    third = save(root, 6)
    assert checkpoint.resolve(root) == third
    assert not os.path.exists(torn) and not os.path.exists(good)


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("truncate", "rank001.pt has 10 bytes but the manifest says"),
        ("remove", "rank001.pt is missing"),
        ("foreign", "rank001.pt does not match the checksum"),
    ],
)
def test_verify_names_the_first_bad_file(tmp_path, damage, needle):
    root = str(tmp_path / "ckpt")
    directory = save(root, 2)
    other = save(str(tmp_path / "other"), 2)
    target = os.path.join(directory, "rank001.pt")
    if damage == "truncate":
        with open(target, "r+b") as f:
            f.truncate(10)
    elif damage == "remove":
        os.remove(target)
    else:  # same name and step, another run's bytes
        with open(os.path.join(other, "rank000.pt"), "rb") as f:
            data = f.read()
        with open(target, "wb") as f:
            f.write(data.replace(b"\x00", b"\x01", 1) if data else b"x")
    with pytest.raises(ValueError, match=needle):
        checkpoint.verify(directory)
    with pytest.raises(ValueError, match="rank001.pt"):
        checkpoint.load_rank_state(directory, 1)


def test_a_mixed_step_set_is_refused(tmp_path):
    root = str(tmp_path / "ckpt")
    directory = save(root, 2)
    manifest = checkpoint.verify(directory)
    stale = checkpoint.FileEntry(**{**vars(manifest.files[1]), "step": 1})
    checkpoint.write_manifest(directory, checkpoint.Manifest(2, (manifest.files[0], stale), JOB))
    with pytest.raises(ValueError, match="rank001.pt is from step 1 but the checkpoint is at"):
        checkpoint.verify(directory)


def test_resolve_explains_what_is_there_instead(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="no such directory"):
        checkpoint.resolve(str(root))
    root.mkdir()
    with pytest.raises(ValueError, match="holds no checkpoint"):
        checkpoint.resolve(str(root))
    save(str(root), 2, complete=False)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        checkpoint.resolve(str(root))
    (root / "latest").write_text("step-000009")
    with pytest.raises(ValueError, match="points to 'step-000009'"):
        checkpoint.resolve(str(root))


def test_one_state_file_follows_the_same_rule(tmp_path):
    path = str(tmp_path / "iter_0000010" / "zeppelin_sampler.pt")
    entry = checkpoint.write_state_file(path, {"epoch": 3}, step=10)
    assert entry.step == 10 and entry.size == os.path.getsize(path)
    assert checkpoint.read_state_file(path, step=10) == {"epoch": 3}
    with pytest.raises(ValueError, match="from step 10, expected step 11"):
        checkpoint.read_state_file(path, step=11)
    with open(path, "ab") as f:
        f.write(b"junk")
    with pytest.raises(ValueError, match="zeppelin_sampler.pt has .* bytes but the manifest"):
        checkpoint.read_state_file(path)
    os.remove(path + ".manifest.json")
    with pytest.raises(ValueError, match="has no manifest"):
        checkpoint.read_state_file(path)
    # The sampler state of Megatron runs is JSON (``megatron.documents.resume``): same rule, same
    # check.
    sampler = str(tmp_path / "zeppelin_sampler" / "iter_0000010.json")
    checkpoint.write_state_file(sampler, {"step": 10, "cursor": [3, 1]}, step=10)
    assert checkpoint.read_state_file(sampler, step=10) == {"step": 10, "cursor": [3, 1]}
    with open(sampler, "w") as f:
        f.write('{"step": 10, "cursor": [3, 2]}')
    with pytest.raises(ValueError, match="iter_0000010.json .*(bytes|checksum)"):
        checkpoint.read_state_file(sampler, step=10)


# --- zeppelin train --load: refused before launch ------------------------------------------------
@pytest.fixture
def no_launch(monkeypatch):
    def refuse(args):
        raise AssertionError("workers were started despite bad input")

    monkeypatch.setattr(train_command, "_launch", refuse)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zeppelin train: error: "), err
    return err[0]


def _job_checkpoint(tmp_path, step: int, **job) -> str:
    root = str(tmp_path / "ckpt")
    directory = checkpoint.step_directory(root, step)
    files = tuple(checkpoint.write_rank_file(directory, r, step, b"state") for r in range(4))
    saved = {"model": {"hidden_size": 64, "num_layers": 2}, "tensor_parallel": 1, **job}
    checkpoint.write_manifest(directory, checkpoint.Manifest(step, files, saved))
    checkpoint.commit(root, step)
    return root


def test_train_refuses_a_torn_checkpoint_naming_the_file(tmp_path, capsys, no_launch):
    root = _job_checkpoint(tmp_path, 3)
    with open(os.path.join(checkpoint.resolve(root), "rank002.pt"), "ab") as f:
        f.write(b"more")
    assert main(["train", "--run-dir", str(tmp_path), "--load", root]) == 2
    assert "rank002.pt has 9 bytes but the manifest says 5" in _error_line(capsys)
    os.remove(os.path.join(checkpoint.resolve(root), "rank002.pt"))
    assert main(["train", "--run-dir", str(tmp_path), "--load", root]) == 2
    line = _error_line(capsys)
    assert "rank002.pt is missing" in line and "--nproc" not in line


def test_train_refuses_to_resume_another_model_or_size(tmp_path, capsys, no_launch):
    root = _job_checkpoint(tmp_path, 3)
    flags = ["train", "--run-dir", str(tmp_path), "--load", root]
    assert main([*flags, "--hidden-size", "128"]) == 2
    assert "saved with --hidden-size 64 but this run has --hidden-size 128" in _error_line(capsys)
    assert main([*flags, "--steps", "2"]) == 2
    assert "is at step 3, past --steps 2" in _error_line(capsys)
    shutil.rmtree(root)
    root = _job_checkpoint(tmp_path, 3, tensor_parallel=2)
    assert main([*flags, "--nproc", "4"]) == 2
    assert "saved with --tensor-parallel 2" in _error_line(capsys)


def test_train_with_nothing_left_to_do_says_so_without_starting(tmp_path, capsys, no_launch):
    root = _job_checkpoint(tmp_path, 3)
    assert main(["train", "--run-dir", str(tmp_path), "--load", root, "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out and "already at step 3" in out
    # No checkpoint at all: --steps 0 is a mistake, not a finished run.
    assert main(["train", "--run-dir", str(tmp_path), "--steps", "0"]) == 2
    line = _error_line(capsys)
    assert "--steps 0 trains no step" in line and "checkpoint" not in line
