"""Cost model against reality: run planned batches with the engine and compare with the simulator.

For every batch (document lengths drawn from an embedded distribution) the Zeppelin planner
makes a plan with the calibrated cost model; then every rank of the cluster runs one layer of it
for real and measures, from a common barrier:

* ``linear``: the GEMMs of one layer (``profile.linear.LayerGemms``) on the rank's tokens,
  forward and backward;
* ``attention``: ``ZeppelinAttention`` forward and backward on random Q, K, V of the rank's
  attention buffer, rings, routing and waiting for peers included.

What is compared: per rank, one layer's linear modules plus attention, forward and backward,
each timed from a barrier (every rank busy at once, as in a training step). Linear modules run
in the attention layout (``remap=False`` on both sides), so the remapping all-to-all is left out.

The prediction follows the simulator's timeline for the same plan and cost model
(``planner.simulate.simulator``: phase ``k`` of ring attention lasts ``max(compute, transfer)``, one
layer per rank is linear + attention compute + exposed communication), built from the simulator's
own pieces (``attention_phases``, ``step_transfer_times``) with one refinement the engine needs:
phase 0 is one causal call and priced on the cost model's diagonal curve, later phases are
unmasked calls priced on ``attention`` (``CostModel.attention_call_time``). And one coupling the
simulator leaves to its step maximum: the members of a ring finish their attention together,
because each one's last K/V gradient arrives from the rank before it after that rank's last
block (``attention.ring``), so a rank's predicted attention is the slowest of the ranks its
rings connect it to.

Where: on a CUDA machine one GPU (a one-rank cluster, all documents local); elsewhere gloo
processes on this host emulating ``nodes x gpus_per_node`` GPUs (``launch.ranks``).

Errors are relative, ``(predicted - measured) / measured``; the report gives their median and
worst (largest magnitude) per rank over the batches.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_zeppelin.attention.engine import ZeppelinAttention
from megatron_zeppelin.attention.kernels.kernels import choose_kernel
from megatron_zeppelin.comm import DistExchanger, ZeppelinGroups
from megatron_zeppelin.comm.threads import ThreadExchanger, ThreadHub
from megatron_zeppelin.devices import resolve_device
from megatron_zeppelin.launch.ranks import run_distributed
from megatron_zeppelin.planner.baselines.distributions import sample_lengths
from megatron_zeppelin.planner.cost.calibration import apply_calibration, load_calibration
from megatron_zeppelin.planner.cost.costmodel import FWD_SHARE, CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.plan import Plan
from megatron_zeppelin.planner.plan.schedule import ring_schedule
from megatron_zeppelin.planner.search.partition import PlannerOptions, plan_batch
from megatron_zeppelin.planner.simulate.simulator import attention_phases, step_transfer_times
from megatron_zeppelin.profile.linear import LayerGemms
from megatron_zeppelin.profile.runner import device_name
from megatron_zeppelin.profile.timing import resolve_dtype, synchronize
from megatron_zeppelin.topology.model import Topology


@dataclass(frozen=True)
class ValidationSettings:
    """What to run; picklable, so emulated ranks receive it whole."""

    calibration: str | None = None
    """Calibration file; ``None`` keeps the datasheet defaults (expect large errors on CPU)."""
    model: str = "tiny"
    dtype: str = "float32"
    device: str = "auto"
    kernel: str = "auto"
    """``auto``: the kernel whose curves the calibration's top level holds, where it runs here
    (``engine_kernel``), else the registry's ``auto``."""
    emulate: tuple[int, int] = (2, 2)
    """``(nodes, gpus_per_node)`` of the emulated cluster (CPU only)."""
    dist: str = "prolong"
    tokens: int = 8192
    """Tokens per batch (the whole cluster's)."""
    num_batches: int = 4
    seed: int = 0
    capacity: int | None = None
    """Tokens per GPU; ``None``: the even share times 1.25."""
    thresholds: str | tuple[int, int] = "auto"
    routing: bool = True
    warmup: int = 1
    repeats: int = 3
    rounds: int = 1
    """Passes over all batches; each figure keeps the median over passes."""
    threads: int = 1
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        get_model(self.model)
        resolve_dtype(self.dtype)
        if min(self.num_batches, self.tokens, self.repeats, self.rounds) < 1:
            raise ValueError("num_batches, tokens, repeats and rounds must all be at least 1")


def validation_topology(settings: ValidationSettings) -> Topology:
    """One GPU on CUDA, else the emulated cluster; link figures are placeholders the
    calibration replaces."""
    if resolve_device(settings.device).type == "cuda":
        return Topology(num_nodes=1, gpus_per_node=1, nics_per_node=1, name="one-gpu")
    nodes, gpus = settings.emulate
    return Topology(num_nodes=nodes, gpus_per_node=gpus, nics_per_node=gpus, name="cpu-gloo")


def calibrated_cost_model(settings: ValidationSettings, topology: Topology) -> CostModel:
    """Datasheet defaults, then the calibration (refused if measured elsewhere)."""
    cost = CostModel.default(get_model(settings.model), topology)
    if settings.calibration is None:
        return cost
    return apply_calibration(
        cost,
        load_calibration(settings.calibration),
        source=settings.calibration,
        expected_device=device_name(resolve_device(settings.device)),
        expected_dtype=settings.dtype,
    )


def make_plans(settings: ValidationSettings, topology: Topology, cost: CostModel) -> list[Plan]:
    """The planner's plan for each batch."""
    capacity = settings.capacity or -(-settings.tokens * 5 // (4 * topology.world_size))
    # Flat rings only: ``predict`` prices ring steps one layout at a time, not the 2-D scheme.
    options = PlannerOptions(
        thresholds=settings.thresholds, routing=settings.routing, remap=False, two_d=False
    )
    plans = []
    for i in range(settings.num_batches):
        lengths = sample_lengths(settings.dist, num_tokens=settings.tokens, seed=settings.seed + i)
        plans.append(
            plan_batch(
                lengths, topology=topology, cost_model=cost, capacity=capacity, options=options
            )
        )
    return plans


# --- measuring: runs on every rank ---------------------------------------------------------------
def _median_time(step, barrier, device: torch.device, settings: ValidationSettings) -> float:  # noqa: ANN001
    samples = []
    for i in range(settings.warmup + settings.repeats):
        barrier()  # every rank starts together, as in a training step
        synchronize(device)
        begin = time.perf_counter()
        step()
        synchronize(device)
        if i >= settings.warmup:
            samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def engine_kernel(settings: ValidationSettings) -> str:
    """The kernel the measured layers run: the one the prediction's curves describe."""
    if settings.kernel != "auto" or settings.calibration is None:
        return settings.kernel
    measured = load_calibration(settings.calibration).kernel
    if measured is None:
        return "auto"
    device, dtype = resolve_device(settings.device), resolve_dtype(settings.dtype)
    try:
        choose_kernel(measured, device=device, dtype=dtype)
    except ValueError:
        return "auto"
    return measured


def measure_plan(
    plan: Plan,
    rank: int,
    exchanger: Any,
    barrier,
    settings: ValidationSettings,  # noqa: ANN001
) -> dict[str, float]:
    """Seconds of one layer's linear modules and attention on ``rank`` (module docstring)."""
    device, dtype = resolve_device(settings.device), resolve_dtype(settings.dtype)
    model = get_model(settings.model)
    num_tokens = plan.num_attention_tokens(rank)
    engine = ZeppelinAttention(plan, rank, exchanger, kernel=engine_kernel(settings))
    gen = torch.Generator().manual_seed(settings.seed * 1009 + rank)

    def rand(heads: int) -> torch.Tensor:
        x = torch.randn(num_tokens, heads, model.head_dim, generator=gen)
        return x.to(device=device, dtype=dtype).requires_grad_()

    q, k, v = rand(model.num_heads), rand(model.num_kv_heads), rand(model.num_kv_heads)
    dout = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)

    def attention_step() -> None:
        engine(q, k, v).backward(dout)
        q.grad = k.grad = v.grad = None

    gemms = LayerGemms(model, max(1, num_tokens), device=device, dtype=dtype)

    def linear_step() -> None:
        if num_tokens:
            gemms.forward()
            gemms.backward()

    return {
        "linear_s": _median_time(linear_step, barrier, device, settings),
        "attention_s": _median_time(attention_step, barrier, device, settings),
    }


def _rank_worker(rank: int, world_size: int, plans: list[Plan], settings: ValidationSettings):  # noqa: ANN202
    """Entry point of each gloo process (``launch.ranks.run_distributed``)."""
    torch.set_num_threads(settings.threads)
    groups = ZeppelinGroups.create(plans[0].topology, timeout_s=settings.timeout_s)
    exchangers = [
        DistExchanger(groups, plan=plan, routing=settings.routing, timeout_s=settings.timeout_s)
        for plan in plans
    ]
    passes = [
        [measure_plan(p, rank, x, dist.barrier, settings) for p, x in zip(plans, exchangers)]
        for _ in range(settings.rounds)
    ]
    return median_over_passes(passes)


def median_over_passes(passes: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """Per batch, the median of each measured figure over the passes over all batches (a burst
    of load from other processes then spreads over every batch instead of one)."""
    return [
        {key: statistics.median(m[key] for m in same_batch) for key in same_batch[0]}
        for same_batch in zip(*passes)
    ]


def measure(plans: list[Plan], settings: ValidationSettings) -> list[list[dict[str, float]]]:
    """``[rank][batch]`` measurements: gloo processes, or this process on one GPU."""
    world = plans[0].world_size
    if world == 1:
        torch.set_num_threads(settings.threads)
        hub = ThreadHub(1)
        passes = [
            [
                measure_plan(p, 0, ThreadExchanger(hub, 0, plan=p), lambda: None, settings)
                for p in plans
            ]
            for _ in range(settings.rounds)
        ]
        return [median_over_passes(passes)]

    return run_distributed(
        _rank_worker, world, timeout_s=settings.timeout_s, args=(plans, settings)
    )


# --- comparing ---------------------------------------------------------------------------------
def predict(plan: Plan, cost: CostModel, *, routing: bool) -> tuple[list[dict[str, float]], float]:
    """Per rank ``linear_s`` and ``attention_s`` of one layer, and the layer's step time
    (module docstring: the simulator's ring timeline, phases priced by mask kind)."""
    kv = cost.model.kv_bytes_per_token()
    steps = ring_schedule(plan)
    fwd = [step_transfer_times(plan, cost, step, kv, routing) for step in steps]
    bwd = [step_transfer_times(plan, cost, step, 2 * kv, routing) for step in steps]
    per_rank = []
    for rank, phases in enumerate(attention_phases(plan, plan.sequences)):
        attention = 0.0
        for k, blocks in enumerate(phases):
            compute = cost.attention_call_time(blocks, diagonal=k == 0)
            tf = fwd[k][rank] if k < len(fwd) else 0.0
            tb = bwd[k][rank] if k < len(bwd) else 0.0
            # The forward hides its transfer behind its share of the compute, the backward
            # behind the rest; only the excess is exposed.
            exposed = max(0.0, tf - compute * FWD_SHARE) + max(0.0, tb - compute * (1 - FWD_SHARE))
            attention += compute + exposed
        linear = cost.linear_time(plan.num_attention_tokens(rank))
        per_rank.append({"linear_s": linear, "attention_s": attention})
    for group in ring_groups(plan):
        slowest = max(per_rank[r]["attention_s"] for r in group)
        for r in group:
            per_rank[r]["attention_s"] = slowest
    return per_rank, max(r["linear_s"] + r["attention_s"] for r in per_rank)


def ring_groups(plan: Plan) -> list[set[int]]:
    """Ranks connected by the rings of multi-rank documents (every rank in exactly one set)."""
    parent = list(range(plan.world_size))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for seq in plan.sequences:
        for r in seq.ring[1:]:
            parent[root(r)] = root(seq.ring[0])
    groups: dict[int, set[int]] = {}
    for r in range(plan.world_size):
        groups.setdefault(root(r), set()).add(r)
    return list(groups.values())


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured > 0 else 0.0


def compare(
    plans: list[Plan], measured: list[list[dict]], cost: CostModel, settings: ValidationSettings
) -> dict[str, Any]:
    """The report: per batch and rank, predicted and measured seconds and errors; per rank,
    median and worst error of the rank's total over the batches."""
    batches = []
    for b, plan in enumerate(plans):
        predicted, step_pred = predict(plan, cost, routing=settings.routing)
        ranks = []
        for rank in range(plan.world_size):
            meas, pred = measured[rank][b], predicted[rank]
            total_meas = meas["linear_s"] + meas["attention_s"]
            total_pred = pred["linear_s"] + pred["attention_s"]
            ranks.append(
                {
                    "rank": rank,
                    "tokens": plan.num_attention_tokens(rank),
                    "predicted": {**pred, "total_s": total_pred},
                    "measured": {**meas, "total_s": total_meas},
                    "error": relative_error(total_pred, total_meas),
                    "attention_error": relative_error(pred["attention_s"], meas["attention_s"]),
                    "linear_error": relative_error(pred["linear_s"], meas["linear_s"]),
                }
            )
        step_meas = max(r["measured"]["total_s"] for r in ranks)
        batches.append(
            {
                "batch": b,
                "num_documents": len(plan.sequences),
                "tiers": plan.tier_counts(),
                "ranks": ranks,
                "step": {
                    "predicted_s": step_pred,
                    "measured_s": step_meas,
                    "error": relative_error(step_pred, step_meas),
                },
            }
        )
    world = plans[0].world_size
    per_rank = []
    for rank in range(world):
        errors = [batch["ranks"][rank]["error"] for batch in batches]
        per_rank.append(
            {
                "rank": rank,
                "median_error": statistics.median(errors),
                "median_abs_error": statistics.median(abs(e) for e in errors),
                "worst_error": max(errors, key=abs),
            }
        )
    every = [r["error"] for batch in batches for r in batch["ranks"]]
    steps = [batch["step"]["error"] for batch in batches]
    return {
        "settings": {**asdict(settings), "emulate": list(settings.emulate)},
        "cost_model_sources": dict(cost.sources),
        "batches": batches,
        "per_rank": per_rank,
        "overall": {
            "median_abs_error": statistics.median(abs(e) for e in every),
            "worst_error": max(every, key=abs),
            "step_median_abs_error": statistics.median(abs(e) for e in steps),
            "step_worst_error": max(steps, key=abs),
        },
    }


def validate(settings: ValidationSettings) -> dict[str, Any]:
    """Plan, run, predict and compare; returns the report (see ``compare``)."""
    topology = validation_topology(settings)
    cost = calibrated_cost_model(settings, topology)
    plans = make_plans(settings, topology, cost)
    load_before = _load_average()
    measured = measure(plans, settings)
    report = compare(plans, measured, cost, settings)
    # Timings on a shared host are only as good as its idleness: say how busy it was.
    report["load_average"] = {"before": load_before, "after": _load_average()}
    report["measures"] = (
        "per rank, one layer forward+backward: linear modules + ring attention (waits included), "
        "each timed from a barrier with every rank busy; remapping excluded"
    )
    return report


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
