"""The CPU job's checkpoints: every rank's model, optimizer and sampler, saved so that a kill
at any moment leaves the previous checkpoint whole (``checkpoint.py`` has the layout and the
rules), and verified again when a rank resumes.

A save: every rank serializes its state and writes ``SAVE/step-NNNNNN/rankNNN.pt`` atomically;
one bounded all-gather brings every file's step, size and SHA-256 to rank 0, which writes the
manifest (last) and moves ``latest`` to it. The manifest's ``job`` records what a resumed run
must share with this one (``job_settings``): ``zeppelin train --load`` refuses another model or
tensor-parallel size before any process starts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_zeppelin import checkpoint
from megatron_zeppelin.comm.watch import CommWatch

__all__ = ["job_settings", "load", "restore", "save", "training_state"]

_SHA256_BYTES = 32


def job_settings(model_dims: dict[str, Any], tensor_parallel: int) -> dict[str, Any]:
    """What a resumed run must share with the run that saved: the model and the TP size."""
    return {"model": dict(model_dims), "tensor_parallel": tensor_parallel}


def save(
    root: str, step: int, state: dict[str, Any], *, job: dict[str, Any], watch: CommWatch
) -> None:
    """Save this rank's ``state`` as part of the checkpoint of ``step`` under ``root`` (every
    rank calls it: it gathers the files' entries to rank 0)."""
    directory = checkpoint.step_directory(root, step)
    entry = checkpoint.write_rank_file(
        directory, dist.get_rank(), step, checkpoint.serialize(state)
    )
    mine = torch.tensor([entry.step, entry.size, *bytes.fromhex(entry.sha256)], dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    watch.all_gather(rows, mine, what=f"checkpoint of step {step}")
    if dist.get_rank() != 0:
        return
    files = tuple(
        checkpoint.FileEntry(
            checkpoint.rank_file_name(rank),
            int(row[0]),
            int(row[1]),
            bytes(row[2 : 2 + _SHA256_BYTES].tolist()).hex(),
        )
        for rank, row in enumerate(rows)
    )
    checkpoint.write_manifest(directory, checkpoint.Manifest(step, files, job))
    checkpoint.commit(root, step)


def load(path: str) -> dict[str, Any]:
    """This rank's state from the checkpoint ``path`` names, checked against its manifest."""
    return checkpoint.load_rank_state(checkpoint.resolve(path), dist.get_rank())


def training_state(model, optimizer, sampler, step: int, *, dtype: str) -> dict[str, Any]:
    """What one rank saves: enough to continue exactly where it stopped (``dtype``: the run's
    ``--dtype``, which a resume must keep)."""
    return {
        "dtype": dtype,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": sampler.state_dict(),
        "step": step,
    }


def restore(state: dict[str, Any], model, optimizer, sampler, *, dtype: str, where: str) -> int:
    """Put a saved state back; the step it was saved at. Refuses a state saved with another
    ``--dtype`` (``where``: the checkpoint, for the message)."""
    saved = state.get("dtype", "float32")
    if saved != dtype:
        raise ValueError(
            f"checkpoint {where} was trained with --dtype {saved}: resume with the "
            f"same --dtype (this run asked for {dtype})"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.load_state_dict(state["sampler"])
    return int(state["step"])
