"""What ``zeppelin verify`` runs: its cases, the worker on every rank, and the references.

``worker`` runs on every process of the emulated cluster (``launch.ranks.run_distributed``) and
``run_case`` feeds one case's plan through the remapping and the engine as the Megatron layer
does; ``reference`` (dense float64) and ``single_gpu`` (the batch on one GPU in the run's dtype)
are what the parent compares the ranks' results with, ``predicted_bytes`` what it compares their
byte counts with. ``commands/verify.py`` builds the cases, compares and reports.

Shapes: ``_tnd`` tensors are (t tokens, n heads, d head dim).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.attention.step_timing import RingTimer, cuda_events, host_events
from megatron_zeppelin.comm import DistExchanger, LinkCounters, PostingLog, ZeppelinGroups
from megatron_zeppelin.comm.counters import comparable
from megatron_zeppelin.comm.remap import attention_to_linear, linear_to_attention
from megatron_zeppelin.comm.threads import ThreadExchanger, ThreadHub
from megatron_zeppelin.planner.plan.heads import AttentionShape
from megatron_zeppelin.planner.plan.plan import Plan, SequencePlan, Tier, TokenRange, zigzag_spans
from megatron_zeppelin.planner.plan.schedule import engine_link_bytes
from megatron_zeppelin.testing.reference import (
    attention_rows,
    linear_rows,
    random_qkv,
    reference_attention,
)
from megatron_zeppelin.topology.model import Topology

__all__ = [
    "Case",
    "EngineSpec",
    "predicted_bytes",
    "reference",
    "run_case",
    "single_gpu",
    "worker",
]


@dataclass(frozen=True)
class EngineSpec:
    """Attention shape and numerics of a verification run."""

    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    dtype: str = "float64"
    kernel: str = "auto"
    seed: int = 0
    timeout_s: float = 60.0
    device: str = "cpu"
    step_timing: bool = False


@dataclass(frozen=True)
class Case:
    """One plan run with routing on or off."""

    name: str
    plan: Any  # planner.plan.plan.Plan (kept untyped so this module imports without torch)
    routing: bool
    dtype: str | None = None
    """Overrides ``EngineSpec.dtype`` for this case."""
    checks: dict[str, Any] = field(default_factory=dict)
    """Extra checks the worker runs (``bad_input``: the engine's ValueErrors)."""

    def spec(self, spec: EngineSpec) -> EngineSpec:
        return dataclasses.replace(spec, dtype=self.dtype) if self.dtype else spec


# --- worker: runs on every rank ----------------------------------------------------------------
def run_case(rank: int, case: Case, spec: EngineSpec, groups: Any) -> dict[str, Any]:
    """Run one case on this rank; return its results in packed-row order plus its byte counts,
    its posting log and (``spec.step_timing``) its per-tier timings."""
    spec = case.spec(spec)
    plan, dtype, device = case.plan, getattr(torch, spec.dtype), _device(spec)
    q_tnd, k_tnd, v_tnd = (
        x.to(device)
        for x in random_qkv(
            plan.num_tokens,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=dtype,
            seed=spec.seed,
        )
    )
    dout_tnd = _dout(plan.num_tokens, spec).to(device, dtype)
    rows_lin, rows_att = linear_rows(plan, rank), attention_rows(plan, rank)
    counters, posting = LinkCounters(plan.topology), PostingLog()
    # Staged posting, NCCL's discipline, on every backend: its posting order is what is checked.
    exchanger = DistExchanger(
        groups,
        plan=plan,
        routing=case.routing,
        counters=counters,
        timeout_s=spec.timeout_s,
        device=device,
        overlap=False,
        posting_log=posting,
    )
    timer = None
    if spec.step_timing:
        timer = RingTimer(cuda_events if device.type == "cuda" else host_events)
    engine = ZeppelinAttention(plan, rank, exchanger, kernel=spec.kernel, timer=timer)
    world = groups.world

    # As in the Megatron layer: linear layout -> attention layout -> engine -> linear layout.
    inputs = [x[rows_lin].clone().requires_grad_(True) for x in (q_tnd, k_tnd, v_tnd)]
    moved = [linear_to_attention(x, plan, rank, world) for x in inputs]
    remap_exact = all(torch.equal(m, x[rows_att]) for m, x in zip(moved, (q_tnd, k_tnd, v_tnd)))
    # The round trip is the identity, forward and backward.
    x = inputs[0].detach().requires_grad_(True)
    back = attention_to_linear(linear_to_attention(x, plan, rank, world), plan, rank, world)
    (grad,) = torch.autograd.grad(back, x, dout_tnd[rows_lin])
    remap_exact &= torch.equal(back, x) and torch.equal(grad, dout_tnd[rows_lin])
    out_tnd = attention_to_linear(engine(*moved), plan, rank, world)
    (out_tnd * dout_tnd[rows_lin]).sum().backward()
    result = {
        "rows": rows_lin,
        "out": out_tnd.detach().cpu(),
        "dq": inputs[0].grad.cpu(),
        "dk": inputs[1].grad.cpu(),
        "dv": inputs[2].grad.cpu(),
        "bytes": counters.all_reduce(),
        "remap_exact": bool(remap_exact),
        "posting": posting.batches,
        "step_timing": timer.summary() if timer is not None else None,
    }
    if case.checks.get("bad_input"):
        result["bad_input"] = _bad_input_messages(engine, moved, plan, rank, exchanger)
    return result


def _device(spec: EngineSpec):  # noqa: ANN202

    if spec.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dout(num_tokens: int, spec: EngineSpec):
    """The upstream gradient of the output (float64, packed rows), the same on every rank."""
    gen = torch.Generator().manual_seed(spec.seed + 7919)
    shape = (num_tokens, spec.num_heads, spec.head_dim)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _bad_input_messages(engine, qkv, plan, rank: int, exchanger) -> dict[str, str | None]:
    """The engine's error for each kind of bad input (``None`` when it accepted it)."""
    q, k, v = (x.detach() for x in qkv)
    wrong_world = _plan_on(plan, plan.topology.with_nodes(plan.topology.num_nodes + 1))
    attempts = {
        "token_count": lambda: engine(q[1:], k[1:], v[1:]),
        "dtype": lambda: engine(q, k.to(torch.float16), v),
        "head_count": lambda: engine(q[:, :1], k, v),
        "kv_heads": lambda: engine(q, k[:, :1].expand(-1, 3, -1).contiguous(), v),
        "world_size": lambda: ZeppelinAttention(wrong_world, rank, exchanger),
    }
    out: dict[str, str | None] = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _plan_on(plan, topology):
    """``plan``'s documents placed the same way on a larger cluster (its extra ranks idle)."""
    linear = list(plan.linear) + [()] * (topology.world_size - plan.world_size)
    return Plan(topology=topology, sequences=plan.sequences, linear=linear, name=plan.name)


def worker(rank: int, world_size: int, cases: list[Case], spec: EngineSpec) -> list[dict]:
    """Entry point of each process (``launch.ranks.run_distributed``). With ``--device cuda``
    the Zeppelin groups are NCCL groups on this process's GPU (the harness's group stays gloo)."""
    backend = None
    if spec.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    groups = ZeppelinGroups.create(
        cases[0].plan.topology, backend=backend, timeout_s=spec.timeout_s
    )
    results = []
    for case in cases:
        start = time.perf_counter()
        results.append(run_case(rank, case, spec, groups))
        results[-1]["seconds"] = time.perf_counter() - start
    return results


# --- references ---------------------------------------------------------------------------------
def predicted_bytes(plan, spec: EngineSpec, *, routing: bool) -> dict[str, int]:
    """Bytes per link class one forward and backward of the engine sends for ``plan``
    (``schedule.engine_link_bytes``): K and V around the flat rings in the forward, again in
    the backward, and dK, dV behind them; for 2-D documents the head all-to-alls and the rings
    across nodes too (gradients in float32 for half-precision inputs, as the engine sends)."""
    return comparable(engine_link_bytes(plan, _shape(spec), routing=routing))


def _shape(spec: EngineSpec):  # noqa: ANN202
    """The ``heads.AttentionShape`` of a verification run."""
    dtype = getattr(torch, spec.dtype)
    grad_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return AttentionShape(
        spec.num_heads, spec.num_kv_heads, spec.head_dim, dtype.itemsize, grad_dtype.itemsize
    )


@functools.lru_cache(maxsize=8)
def reference(lengths: tuple[int, ...], spec: EngineSpec) -> dict[str, Any]:
    """The float64 dense reference of a batch (documents in packed order) on the inputs the
    workers drew, rounded to ``spec.dtype`` as theirs were: output and input gradients."""
    dtype = getattr(torch, spec.dtype)
    num_tokens = sum(lengths)
    qkv = random_qkv(
        num_tokens,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=dtype,
        seed=spec.seed,
    )
    qkv = [x.to(torch.float64).requires_grad_(True) for x in qkv]
    out = reference_attention(*qkv, lengths)
    (out * _dout(num_tokens, spec).to(dtype).to(torch.float64)).sum().backward()
    return {"out": out.detach(), "dq": qkv[0].grad, "dk": qkv[1].grad, "dv": qkv[2].grad}


@functools.lru_cache(maxsize=8)
def single_gpu(lengths: tuple[int, ...], spec: EngineSpec) -> dict[str, Any]:
    """The batch on one GPU in ``spec.dtype``: every document local on one rank, the same
    kernel, inputs and upstream gradient as the workers (packed order, on the CPU)."""
    dtype, device = getattr(torch, spec.dtype), _device(spec)
    sequences = tuple(
        SequencePlan(i, n, Tier.LOCAL, (0,), zigzag_spans(n, (0,))) for i, n in enumerate(lengths)
    )
    linear = [[TokenRange(i, 0, n) for i, n in enumerate(lengths)]]
    one = Topology(num_nodes=1, gpus_per_node=1, nics_per_node=1)
    plan = Plan(topology=one, sequences=sequences, linear=linear)
    rows = attention_rows(plan, 0)
    qkv = random_qkv(
        sum(lengths),
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=dtype,
        seed=spec.seed,
    )
    qkv = [x[rows].to(device).requires_grad_(True) for x in qkv]
    engine = ZeppelinAttention(
        plan, 0, ThreadExchanger(ThreadHub(1), 0, plan=plan), kernel=spec.kernel
    )
    out = engine(*qkv)
    (out * _dout(sum(lengths), spec)[rows].to(device, dtype)).sum().backward()
    got = {"out": out.detach(), "dq": qkv[0].grad, "dk": qkv[1].grad, "dv": qkv[2].grad}
    packed = {}
    for name, value in got.items():
        packed[name] = torch.empty_like(value, device="cpu")
        packed[name][rows] = value.cpu()
    return packed
