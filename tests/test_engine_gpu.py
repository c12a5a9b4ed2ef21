"""Tier: gpu. The ring engine on one GPU: thread-ranks with in-process transfers (one GPU
cannot hold two NCCL ranks), bfloat16, the kernel ``auto`` picks on CUDA, against float64."""

from __future__ import annotations

import pytest
import torch
from test_ring_threads import PLANS, run_engine

from megatron_zeppelin.testing.tolerances import assert_close


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_engine_on_cuda_in_bf16_matches_float64(plan_name: str) -> None:
    """The rings on one GPU (thread-ranks, in-process transfers) in bfloat16 with the kernel
    ``auto`` picks there: every ring step's partial result merged, forward and backward."""
    ref, got = run_engine(PLANS[plan_name](), torch.bfloat16, device="cuda", kernel="auto")
    for name in ("out", "dq", "dk", "dv"):
        assert_close(got[name], ref[name], dtype=torch.bfloat16, name=f"{plan_name} {name}")
