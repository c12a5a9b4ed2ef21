"""Which device a process computes on: the one place that maps a device name, and this
process's ``LOCAL_RANK``, to a ``torch.device`` (the profiler, the cost-model validation and the
training job use it), the check that a job has a GPU for every process, and how host data
(index tensors built once per plan) reaches a device without making the host wait
(``to_device``)."""

from __future__ import annotations

import os

import numpy as np
import torch

__all__ = ["cuda_count", "require_gpus", "resolve_device", "to_device"]


def cuda_count() -> int:
    """GPUs this process can see (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str | None) -> torch.device:
    """``None``/``"auto"``: CUDA where present, else CPU; anything else as given. A CUDA device
    always has an index (``torch.cuda.set_device`` and the events need one): the one given, else
    this process's GPU by ``LOCAL_RANK``, one GPU per process."""
    if name in (None, "auto"):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r} asked for but no CUDA device is visible: use --device cpu"
        )
    if device.index is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= cuda_count():
            raise ValueError(
                f"process {local} of this node has no GPU of its own ({cuda_count()} visible): "
                "start at most one process per GPU"
            )
        device = torch.device("cuda", local)
    return device


def require_gpus(processes: int, *, fix: str) -> None:
    """One GPU per process (NCCL refuses two ranks on one GPU); ``fix`` says what to change."""
    if processes > cuda_count():
        raise ValueError(
            f"--device cuda runs one process per GPU: {processes} processes need {processes} "
            f"GPUs and {cuda_count()} are visible; {fix}"
        )


def to_device(x: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host data ``x`` as a tensor on ``device``. To a GPU the copy goes through pinned memory
    and is ordered on the current stream (``non_blocking``): the host does not wait. A plain
    ``.to("cuda")`` from pageable memory synchronizes the stream first, so the host would wait
    for every kernel queued before it (the caching host allocator keeps the pinned block alive
    until the copy has run)."""
    tensor = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
