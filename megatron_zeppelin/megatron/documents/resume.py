"""The sampler's place in the document stream, saved beside Megatron's checkpoints.

Megatron's checkpoint holds the model, the optimizer and the iteration, not Zeppelin's document
sampler. Its state is tiny and the same on every rank, so rank 0 writes it, atomically, as
``SAVE/zeppelin_sampler/iter_NNNNNNN.json`` (the iteration numbered as Megatron numbers its
``iter_NNNNNNN`` directories) for every iteration Megatron will save at: multiples of
``--save-interval``, ``--non-persistent-save-interval`` and ``--exit-interval``, and
``--train-iters``. The file is written when the step before that iteration has drawn its
documents; its content depends only on the seed, the data and the iteration, so a file written
before a save that never happened is still right for that iteration.

On ``--load``, the file of the loaded iteration restores the sampler in O(1). A checkpoint
without one (saved on a signal or a time limit, or by an older version) falls back to
replaying the sampler step by step, and says so in the log.

The validation stream (``evaluation.py``) is kept the same way, by the number of validation
steps it has handed out: ``SAVE/zeppelin_sampler/valid_NNNNNNN.json`` is written at the end of
every evaluation, and a resumed run restores the one Megatron's count of consumed validation
samples points at (replaying where it is missing).
"""

from __future__ import annotations

import json
import os
from argparse import Namespace
from collections.abc import Callable
from typing import Any

from megatron_zeppelin.fileio import atomic_write_text

SAMPLER_DIR = "zeppelin_sampler"
_FILES = {"train": "iter", "valid": "valid"}
_STEPS = {"train": "iteration", "valid": "validation step"}


def sampler_state_path(directory: str, iteration: int, split: str = "train") -> str:
    """Where the sampler state of ``iteration`` (for ``split="valid"``: of the validation
    stream after that many steps) lives under a checkpoint directory."""
    return os.path.join(directory, SAMPLER_DIR, f"{_FILES[split]}_{iteration:07d}.json")


def is_save_iteration(args: Namespace, iteration: int) -> bool:
    """Whether Megatron's loop (with these arguments) saves a checkpoint at ``iteration``."""
    for name in ("save_interval", "non_persistent_save_interval", "exit_interval"):
        every = getattr(args, name, None)
        if every and iteration % int(every) == 0:
            return True
    return iteration == getattr(args, "train_iters", None)


def save_sampler_state(
    directory: str, iteration: int, state: dict[str, Any], split: str = "train"
) -> str:
    """Write ``state`` for ``iteration`` (atomically); returns the file's path."""
    path = sampler_state_path(directory, iteration, split)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, json.dumps(state, sort_keys=True))
    return path


def restore_sampler(
    sampler: Any,
    directory: str | None,
    iteration: int,
    *,
    log: Callable[[str], None],
    split: str = "train",
) -> str:
    """Bring ``sampler`` to ``iteration``: from its saved state when the file is there (O(1)),
    else by replaying ``iteration`` steps. Returns ``"restored"``, ``"replayed"`` or
    ``"fresh"`` (iteration 0); says which in ``log``."""
    if iteration <= 0:
        return "fresh"
    what = f"{_STEPS[split]} {iteration}"
    path = sampler_state_path(directory, iteration, split) if directory else None
    if path and os.path.exists(path):
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"cannot read the sampler state {path} ({exc}): restore the file, or delete it "
                "to replay the sampler instead"
            ) from exc
        if int(state.get("step", -1)) != iteration:
            raise ValueError(
                f"{path} holds the sampler state of step {state.get('step')}, not of {what}: "
                "the checkpoint directory is mixed up"
            )
        sampler.load_state_dict(state)
        log(f"zeppelin: sampler restored at {what} from {path}")
        return "restored"
    where = f"in {os.path.dirname(path)}" if path else "(no --load directory)"
    log(
        f"zeppelin: no sampler state for {what} {where}: replaying the sampler "
        f"{iteration} steps to reach it (checkpoints saved at a --save-interval, "
        "--exit-interval or the last iteration carry the state)"
    )
    for _ in range(iteration):
        sampler.next_step()
    return "replayed"
