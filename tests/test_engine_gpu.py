"""Tier: gpu. The ring engine on one GPU: thread-ranks with in-process transfers (one GPU
cannot hold two NCCL ranks), bfloat16, against float64, with the kernel ``auto`` picks there and
with every CUDA kernel that runs.

These ranks once hung on a GPU: PyTorch's autograd engine ran every thread's CUDA backward on
its one worker thread per device, so one rank's ring backward, waiting for a gradient, blocked
the backwards of the ranks that would send it. ``comm.threads.run_ranks`` now runs each
rank's backward on the rank's own thread (its module docstring)."""

from __future__ import annotations

import pytest
import torch
from test_ring_threads import PLANS, run_engine

from megatron_zeppelin.attention.kernels.kernels import CUDA_KERNELS, choose_kernel
from megatron_zeppelin.testing.tolerances import assert_close


def _runs_here(name: str) -> str:
    try:
        choose_kernel(name, device="cuda", dtype=torch.bfloat16)
    except ValueError as exc:
        pytest.skip(str(exc))
    return name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["auto", *CUDA_KERNELS])
@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_engine_on_cuda_in_bf16_matches_float64(plan_name: str, kernel: str) -> None:
    """The rings on one GPU (thread-ranks, in-process transfers) in bfloat16: every ring step's
    partial result merged, forward and backward, within bfloat16's bound of float64."""
    if kernel != "auto":
        _runs_here(kernel)
    # Head dim 8 is below what the fused kernels take; 64 is one they all do.
    ref, got = run_engine(
        PLANS[plan_name](), torch.bfloat16, device="cuda", kernel=kernel, head_dim=64
    )
    for name in ("out", "dq", "dk", "dv"):
        assert_close(got[name], ref[name], dtype=torch.bfloat16, name=f"{plan_name} {name}")
