"""Tier: threads. The engine's per-tier timings (``attention.step_timing``) with a fake clock.

On a GPU the timer records CUDA events; here each thread-rank has a clock that moves only when
a kernel runs (10 ms a call) and while a transfer is waited on (3 ms a wait), so every figure is
known: compute is 10 ms per kernel call of the tier, exposed communication 3 ms per exchange,
and communication (posted -> landed) at least the exposed part. The engine's results must not
change with a timer.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from test_ring_threads import DOCS_2X2, TOPO_2X2, make_plan

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.attention.kernels import kernels
from megatron_zeppelin.attention.kernels.kernel_torch import TorchKernel
from megatron_zeppelin.attention.step_timing import HostEvent, RingTimer
from megatron_zeppelin.comm.threads import run_ranks
from megatron_zeppelin.testing.reference import attention_rows, random_qkv

pytestmark = pytest.mark.threads

KERNEL_MS, WAIT_MS = 10, 3
_LOCAL = threading.local()


class ClockedKernel(TorchKernel):
    """The torch kernel, advancing this thread's clock by ``KERNEL_MS`` per call."""

    name = "clocked"

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        _LOCAL.clock[0] += KERNEL_MS
        _LOCAL.calls += 1
        return super().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        _LOCAL.clock[0] += KERNEL_MS
        _LOCAL.calls += 1
        return super().backward(*args, **kwargs)


class SlowWaits:
    """An exchanger whose waits take ``WAIT_MS`` on this thread's clock; counts exchanges by
    tier (from their tags)."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.started: Counter[str] = Counter()

    def set_plan(self, plan):  # noqa: ANN001, ANN201
        return self.inner.set_plan(plan)

    @property
    def plan(self):  # noqa: ANN201
        return self.inner.plan

    def start(self, messages, payload, **kwargs):  # noqa: ANN001, ANN003, ANN201
        self.started[kwargs["tag"].split("/")[1]] += 1
        pending = self.inner.start(messages, payload, **kwargs)
        wait = pending.wait

        def slow_wait():  # noqa: ANN202
            _LOCAL.clock[0] += WAIT_MS
            return wait()

        pending.wait = slow_wait
        return pending


def test_timer_accounts_compute_communication_and_exposed_time_per_tier(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_INSTANCES", {})
    monkeypatch.setitem(kernels._FACTORIES, "clocked", ClockedKernel)
    plan = make_plan(TOPO_2X2, DOCS_2X2, routed=True)
    qkv = random_qkv(plan.num_tokens, num_heads=4, num_kv_heads=2, head_dim=8, seed=1)

    def body(rank: int, exchanger):  # noqa: ANN001, ANN202
        _LOCAL.clock, _LOCAL.calls = [0], 0
        timer = RingTimer(lambda: HostEvent(clock=lambda: _LOCAL.clock[0] / 1000.0))
        slow = SlowWaits(exchanger)
        rows = attention_rows(plan, rank)
        x = [t[rows].clone().requires_grad_(True) for t in qkv]
        timed = ZeppelinAttention(plan, rank, slow, kernel="clocked", timer=timer)
        out = timed(*x)
        out.sum().backward()
        grads = [t.grad.clone() for t in x]
        plain = ZeppelinAttention(plan, rank, exchanger, kernel="torch")
        y = [t[rows].clone().requires_grad_(True) for t in qkv]
        out_plain = plain(*y)
        out_plain.sum().backward()
        same = torch.equal(out, out_plain) and all(torch.equal(a, b.grad) for a, b in zip(grads, y))
        return timer.summary(), dict(slow.started), _LOCAL.calls, same

    for summary, started, calls, same in run_ranks(body, plan.world_size, plan=plan):
        assert same, "a timer changes nothing in the results"
        assert set(summary) == {"own", *started}
        total_compute = sum(t["compute_ms"] for t in summary.values())
        assert total_compute == pytest.approx(KERNEL_MS * calls)
        for tier, count in started.items():
            figures = summary[tier]
            assert figures["steps"] == count
            assert figures["exposed_ms"] == pytest.approx(WAIT_MS * count)
            assert figures["comm_ms"] >= figures["exposed_ms"] - 1e-9
        assert summary["own"]["steps"] == 0 and summary["own"]["compute_ms"] >= 2 * KERNEL_MS - 1e-6
