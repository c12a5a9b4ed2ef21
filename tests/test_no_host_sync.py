"""Threads tier: nothing in a layer makes the host wait for the device.

On a GPU an operator whose result the host must read (``.item()``, ``torch.unique``,
``nonzero``, a boolean mask) waits for every kernel queued before it, so the host stops queuing
and the GPU runs dry. Meta tensors carry shapes and no data, so each such operator fails on them:
the engine's forward and backward on meta tensors, with the tiled kernel, over the plans of the
ring and 2-D tests (zigzag and not, query rows merged more than once in a call, heads split over
a node, routed), must run through. (The other way a host waits, an index copied to the GPU from
pageable memory, leaves no trace on meta tensors; those copies go through
``devices.to_device``.)
"""

from __future__ import annotations

import pytest
import test_ring_threads
import test_two_d_threads
import torch

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.attention.merge import merge_rows_
from megatron_zeppelin.comm.threads import run_ranks

pytestmark = pytest.mark.threads

META = torch.device("meta")
PLANS = {
    **{f"flat {k}": v for k, v in test_ring_threads.PLANS.items()},
    **{f"2-D {k}": v for k, v in test_two_d_threads.PLANS.items()},
}


@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_a_layer_runs_on_meta_tensors(plan_name: str) -> None:
    plan = PLANS[plan_name]()

    def rank_fn(rank: int, exchanger) -> tuple:  # noqa: ANN001
        engine = ZeppelinAttention(plan, rank, exchanger, kernel="torch")
        t = engine.num_tokens
        q, k, v = (torch.empty(t, n, 8, device=META, requires_grad=True) for n in (24, 12, 12))
        out = engine(q, k, v)
        out.backward(torch.empty_like(out))
        return out.shape, q.grad.shape, k.grad.shape

    for rank, (out, dq, dk) in enumerate(run_ranks(rank_fn, plan.world_size, timeout_s=120)):
        t = plan.num_attention_tokens(rank)
        assert tuple(out) == tuple(dq) == (t, 24, 8) and tuple(dk) == (t, 12, 8)


def test_meta_tensors_catch_a_host_wait() -> None:
    """The check above can fail: a merge of repeated rows without its groups worked out on the
    host finds them on the device (``torch.unique``), which meta tensors refuse."""
    out, lse = torch.empty(4, 2, 8, device=META), torch.empty(4, 2, device=META)
    rows = torch.tensor([0, 1, 1, 3]).to(META)
    part, part_lse = torch.empty(4, 2, 8, device=META), torch.empty(4, 2, device=META)
    with pytest.raises(NotImplementedError, match="unique"):
        merge_rows_(out, lse, rows, part, part_lse, unique=False)
    groups = (torch.tensor([0, 1, 3]).to(META), torch.tensor([0, 1, 1, 2]).to(META))
    merge_rows_(out, lse, rows, part, part_lse, unique=False, groups=groups)
