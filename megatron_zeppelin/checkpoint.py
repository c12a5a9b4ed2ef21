"""Checkpoints that a kill at any moment cannot tear: atomic files, a manifest written last, a
``latest`` pointer moved only once the new checkpoint is complete.

Layout of a checkpoint root (``zeppelin train --save DIR``)::

    DIR/step-000008/rank000.pt ... rank003.pt   one file per rank, each written atomically
    DIR/step-000008/manifest.json               written last: the step, the job's settings and
                                                every rank file's step, size and SHA-256
    DIR/latest                                  "step-000008", replaced atomically after it

A save writes a new step directory beside the previous one; once its manifest and then
``latest`` are in place, older step directories are removed. A kill before that leaves
``latest`` on the previous checkpoint, whole. ``verify`` checks a checkpoint against its manifest
(every file present, of the recorded size and checksum, of the same step) and names the first
bad file; ``zeppelin train --load`` runs it before any process starts.

One file (the sampler state Megatron runs save beside Megatron's own checkpoint) follows the
same rule with ``write_state_file`` / ``read_state_file``: the file is written atomically, then
its manifest ``PATH.manifest.json`` (step, size, SHA-256); a read verifies the manifest first.
A ``.json`` path holds JSON (sorted keys), any other ``torch.save``'s format.

Every file goes through ``fileio.atomic_write`` (temporary name, fsync, rename, directory fsync).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from typing import Any

import torch

from megatron_zeppelin.fileio import atomic_write, atomic_write_text

__all__ = [
    "FileEntry",
    "Manifest",
    "commit",
    "entry_for",
    "load_rank_state",
    "rank_file_name",
    "read_state_file",
    "resolve",
    "serialize",
    "step_directory",
    "verify",
    "write_manifest",
    "write_rank_file",
    "write_state_file",
]

FORMAT = "zeppelin-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as it was written."""

    name: str
    step: int
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds: its step, the job's settings, every file."""

    step: int
    files: tuple[FileEntry, ...]
    job: dict[str, Any]

    @property
    def world_size(self) -> int:
        return len(self.files)

    def to_json(self) -> str:
        files = [asdict(f) for f in self.files]
        return json.dumps(
            {"format": FORMAT, "step": self.step, "job": self.job, "files": files}, indent=1
        )

    @classmethod
    def from_json(cls, text: str, *, path: str) -> Manifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
            files = tuple(FileEntry(**f) for f in raw["files"])
            return cls(int(raw["step"]), files, dict(raw.get("job", {})))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path} is not a valid checkpoint manifest ({exc})") from None


# --- writing -----------------------------------------------------------------------------------
def step_directory(root: str, step: int) -> str:
    """The directory of the checkpoint at ``step`` under ``root``."""
    return os.path.join(root, f"step-{step:06d}")


def rank_file_name(rank: int) -> str:
    return f"rank{rank:03d}.pt"


def serialize(state: Any) -> bytes:
    """``torch.save`` of ``state`` into bytes (so the checksum is of exactly what is written)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def entry_for(name: str, step: int, data: bytes) -> FileEntry:
    return FileEntry(name, step, len(data), hashlib.sha256(data).hexdigest())


def write_rank_file(directory: str, rank: int, step: int, data: bytes) -> FileEntry:
    """Write one rank's file of the checkpoint at ``step`` atomically; its manifest entry."""
    name = rank_file_name(rank)
    atomic_write(os.path.join(directory, name), lambda f: f.write(data))
    return entry_for(name, step, data)


def write_manifest(directory: str, manifest: Manifest) -> None:
    """Write the manifest, the last file of a complete checkpoint (after every rank file)."""
    atomic_write_text(os.path.join(directory, MANIFEST), manifest.to_json())


def commit(root: str, step: int, *, keep: int = 1) -> None:
    """Point ``latest`` at the checkpoint of ``step`` (its manifest must be written), then remove
    all but the ``keep`` newest step directories, incomplete ones included."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    atomic_write_text(os.path.join(root, LATEST), os.path.basename(step_directory(root, step)))
    steps = sorted(_step_directories(root), reverse=True)
    kept = [s for s in steps if s <= step][:keep]
    for old in steps:
        if old not in kept and old < step:
            shutil.rmtree(step_directory(root, old), ignore_errors=True)


def _step_directories(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    found = (_STEP_DIR.match(name) for name in os.listdir(root))
    return [int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0)))]


# --- reading -----------------------------------------------------------------------------------
def resolve(path: str, *, flag: str = "--load") -> str:
    """The step directory ``path`` names: the one ``latest`` points to, or ``path`` itself when
    it is a step directory with a manifest. Raises ``ValueError`` saying what is there instead."""
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {path}: no such directory (write one with --save)")
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.exists(latest):
        with open(latest) as f:
            name = f.read().strip()
        target = os.path.join(path, name)
        if not _STEP_DIR.match(name) or not os.path.isdir(target):
            raise ValueError(
                f"{flag} {path}: {latest} points to {name!r}, which is not a checkpoint here"
            )
        return target
    if any(_STEP_DIR.match(n) for n in os.listdir(path)):
        raise ValueError(
            f"{flag} {path} holds no complete checkpoint (no {LATEST} pointer: every save was "
            "cut short): write one with --save"
        )
    if any(n.startswith("rank") and n.endswith(".pt") for n in os.listdir(path)):
        raise ValueError(
            f"{flag} {path} holds rank files but no {MANIFEST}: it is incomplete or was written "
            "without one, so it cannot be verified; write a new one with --save"
        )
    raise ValueError(f"{flag} {path} holds no checkpoint: write one with --save")


def read_manifest(directory: str) -> Manifest:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a checkpoint manifest (not text)") from None
    return Manifest.from_json(text, path=path)


def verify(directory: str) -> Manifest:
    """Check every file of the checkpoint in ``directory`` against its manifest; the manifest.
    Raises ``ValueError`` naming the first missing, torn or foreign file."""
    manifest = read_manifest(directory)
    for entry in manifest.files:
        _check_file(os.path.join(directory, entry.name), entry, manifest.step)
    return manifest


def _check_file(path: str, entry: FileEntry, step: int) -> bytes:
    """The bytes of ``path`` if they are what ``entry`` recorded; else ``ValueError``."""
    if entry.step != step:
        raise ValueError(
            f"{path} is from step {entry.step} but the checkpoint is at step {step}: the set is "
            "mixed; resume from another checkpoint"
        )
    if not os.path.exists(path):
        raise ValueError(f"{path} is missing: the checkpoint is incomplete")
    with open(path, "rb") as f:
        data = f.read()
    if len(data) != entry.size:
        raise ValueError(
            f"{path} has {len(data)} bytes but the manifest says {entry.size}: the file is torn "
            "or was replaced; resume from another checkpoint"
        )
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise ValueError(
            f"{path} does not match the checksum in the manifest: the file is damaged or from "
            "another checkpoint; resume from another checkpoint"
        )
    return data


def load_rank_state(directory: str, rank: int) -> Any:
    """Rank ``rank``'s state from the checkpoint in ``directory``, verified against the manifest."""
    manifest = read_manifest(directory)
    name = rank_file_name(rank)
    entry = next((e for e in manifest.files if e.name == name), None)
    if entry is None:
        raise ValueError(
            f"{directory} was saved by {manifest.world_size} processes and has no file for rank "
            f"{rank}: resume with the same --nproc"
        )
    data = _check_file(os.path.join(directory, name), entry, manifest.step)
    return torch.load(io.BytesIO(data), weights_only=False)


# --- one file ----------------------------------------------------------------------------------
def write_state_file(path: str, state: Any, *, step: int) -> FileEntry:
    """Save ``state`` to ``path`` atomically, then its manifest ``PATH.manifest.json``."""
    if path.endswith(".json"):
        data = json.dumps(state, sort_keys=True).encode()
    else:
        data = serialize(state)
    atomic_write(path, lambda f: f.write(data))
    entry = entry_for(os.path.basename(path), step, data)
    manifest = Manifest(step, (entry,), {})
    atomic_write_text(path + ".manifest.json", manifest.to_json())
    return entry


def read_state_file(path: str, *, step: int | None = None) -> Any:
    """The state ``write_state_file`` saved at ``path``, after checking it against its manifest
    (and, given ``step``, that it is of that step). Raises ``ValueError`` naming the file."""
    manifest_path = path + ".manifest.json"
    if not os.path.exists(manifest_path):
        raise ValueError(
            f"{path} has no manifest ({manifest_path}): the save was cut short; resume from "
            "another checkpoint"
        )
    with open(manifest_path) as f:
        manifest = Manifest.from_json(f.read(), path=manifest_path)
    if step is not None and manifest.step != step:
        raise ValueError(f"{path} is from step {manifest.step}, expected step {step}")
    data = _check_file(path, manifest.files[0], manifest.step)
    if path.endswith(".json"):
        return json.loads(data)
    return torch.load(io.BytesIO(data), weights_only=False)
