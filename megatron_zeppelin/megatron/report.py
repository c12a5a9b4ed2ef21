"""What a Zeppelin run prints: the start-up summary and the per-micro-batch plan line.

The Megatron hooks and the CPU job print the same lines (rank 0 only):

* ``startup_lines``: the Zeppelin node shape (ranks and NICs per node, and the physical node
  and tensor-parallel size it comes from), the cost model's source (model layers, under
  pipeline parallelism the stage's own with which they are; heads, K/V heads, dtype and K/V
  bytes per token; tier thresholds; datasheet figures or the calibration file), a MoE
  model's experts (count, top-k, expert parallelism, dispatcher, what the cost model prices),
  and the attention kernel with the reason it was chosen (``chosen_kernel``: with ``auto``, in
  the order of speed the calibration measured on this GPU, else the registry's fixed order);
* ``plan_line``: one micro-batch's plan (``runtime.plan_summary``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from megatron_zeppelin.attention.kernels.kernels import choose_kernel
from megatron_zeppelin.fileio import format_bytes
from megatron_zeppelin.planner.baselines.kernel_curves import speed_order
from megatron_zeppelin.planner.cost.calibration import load_calibration
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import ModelSpec
from megatron_zeppelin.topology.model import Topology

_DTYPE_NAMES = {2: "16-bit (bf16/fp16)", 4: "fp32"}


@dataclass(frozen=True)
class KernelChoice:
    """The attention kernel a run uses and why."""

    name: str
    why: str


def chosen_kernel(
    requested: str,
    *,
    device: Any,
    dtype: Any,
    window: bool = False,
    calibration: str | None = None,
    model: ModelSpec | None = None,
) -> KernelChoice:
    """The kernel the engine runs for ``--zeppelin-kernel requested`` with activations of
    ``dtype`` on ``device`` (with a sliding window when ``window``), and why (the kernel
    registry's own ``choose_kernel``); ``auto`` follows the speed order ``calibration``
    measured for ``model`` where it measured kernels on this GPU (``measured_order``)."""
    measured, note = (None, "")
    if requested == "auto":
        measured, note = measured_order(calibration, model, device)
    name, why = choose_kernel(
        requested, device=device, dtype=dtype, window=window, measured=measured
    )
    if requested != "auto":
        return KernelChoice(name, "requested with --zeppelin-kernel")
    return KernelChoice(name, f"auto: {why}{note}")


def measured_order(
    calibration: str | None, model: ModelSpec | None, device: Any
) -> tuple[tuple[list[str], str] | None, str]:
    """The kernels ``calibration`` measured on this CUDA device, fastest first, with where they
    were measured (``choose_kernel``'s ``measured``), or ``None`` and why not (a note for the
    start-up line; empty where there is nothing to say)."""
    if calibration is None or model is None or torch.device(device).type != "cuda":
        return None, ""
    cal = load_calibration(calibration)
    here = torch.cuda.get_device_name(torch.device(device))
    if cal.device.strip().lower() != here.strip().lower():
        return None, f"; calibration {calibration} was measured on {cal.device}, not this {here}"
    order = speed_order(cal, model)
    if not order:
        return None, f"; calibration {calibration} names no attention kernel it measured"
    return (order, f"calibration {os.path.relpath(calibration)}"), ""


def node_shape_line(topology: Topology, *, tensor_parallel: int) -> str:
    """How the Zeppelin ranks sit on the nodes."""
    per_node = topology.gpus_per_node
    physical = (
        f"{per_node * tensor_parallel} GPUs per node / TP {tensor_parallel}"
        if tensor_parallel > 1
        else f"{per_node} GPUs per node"
    )
    return (
        f"zeppelin: node shape {topology.num_nodes} nodes x {per_node} Zeppelin ranks "
        f"({topology.name}: {physical}), {topology.nics_per_node} NICs per node at "
        f"{topology.nic_gbit:g} Gbit/s for this tensor-parallel world, NIC of each rank "
        f"{list(topology.nic_of_gpu)}"
    )


def cost_model_line(cost_model: CostModel, options: Any, *, why: str = "") -> str:
    """Which model the planner prices and where its figures come from."""
    spec = cost_model.model
    if options.allow_split:
        intra, inter = options.resolved_thresholds(cost_model)
        thresholds = f"thresholds intra {intra:,} / inter {inter:,} tokens"
    else:
        thresholds = "no balance splitting (both thresholds off)"
    measured = {k: v for k, v in cost_model.sources.items() if v != "default"}
    if measured:
        files = ", ".join(sorted({os.path.relpath(v) for v in measured.values()}))
        source = f"measured {', '.join(sorted(measured))} from {files}"
        defaults = sorted(k for k, v in cost_model.sources.items() if v == "default")
        source += f"; datasheet {', '.join(defaults)}" if defaults else ""
    else:
        source = f"datasheet figures ({cost_model.topology.gpu_name})"
    if why:
        source += f" (calibration {why})"
    dtype = _DTYPE_NAMES.get(spec.dtype_bytes, f"{spec.dtype_bytes}-byte")
    stage = f" ({spec.pipeline.describe()})" if spec.pipeline else ""
    return (
        f"zeppelin: cost model {spec.num_layers} layers{stage}, {spec.num_heads} heads, "
        f"{spec.num_kv_heads} K/V heads, {dtype}, TP {spec.tensor_parallel}: "
        f"{format_bytes(spec.kv_bytes_per_token())} of K/V per token per layer per GPU; "
        f"{thresholds}; {source}"
    )


def moe_line(spec: ModelSpec, *, expert_parallel: int, dispatcher: str) -> str:
    """The experts a MoE model runs and how the cost model prices them."""
    shared = (
        f" and a shared FFN of {spec.moe_shared_ffn_hidden_size}"
        if spec.moe_shared_ffn_hidden_size
        else ""
    )
    return (
        f"zeppelin: MoE {spec.num_experts} experts, top-{spec.moe_topk}, EP {expert_parallel} "
        f"({dispatcher} dispatcher, dropless) in {spec.num_moe_layers} of {spec.num_layers} "
        f"layers; the cost model prices each token's router, {spec.moe_topk} expert FFNs of "
        f"{spec.moe_ffn_hidden_size}{shared}"
    )


def startup_lines(
    runtime: Any,
    *,
    tensor_parallel: int,
    kernel: KernelChoice,
    calibration_why: str = "",
    expert_parallel: int = 1,
    dispatcher: str = "",
) -> list[str]:
    """The start-up summary of a run (``runtime``: a ``step.StepRuntime``); a MoE model's
    experts with ``expert_parallel`` and ``dispatcher`` (Megatron's flags)."""
    spec = runtime.cost_model.model
    moe = [moe_line(spec, expert_parallel=expert_parallel, dispatcher=dispatcher)]
    return [
        node_shape_line(runtime.topology, tensor_parallel=tensor_parallel),
        cost_model_line(runtime.cost_model, runtime.options, why=calibration_why),
        *(moe if spec.num_experts else []),
        f"zeppelin: attention kernel {kernel.name} ({kernel.why})",
        planning_line(runtime.config),
    ]


def planning_line(config: Any) -> str:
    """Where the plans are made (``feed.MicroBatchFeed``)."""
    ahead, processes = config.plan_ahead, config.planner_processes
    if not ahead:
        return "zeppelin: planning each micro-batch when it starts (--zeppelin-plan-ahead 0)"
    where = (
        f"in {processes} planner process{'es' if processes > 1 else ''}"
        if processes
        else "in a thread of the training process (--zeppelin-plan-workers 0)"
    )
    if processes and config.share_plans:
        where += " on the first rank of each node, each plan sent to every rank"
    return f"zeppelin: planning {ahead} micro-batch{'es' if ahead > 1 else ''} ahead {where}"


def collector_line(manual_gc: bool) -> str | None:
    """A start-up hint where Megatron's ``--manual-gc`` is off: Python's collector then counts
    the objects every plan brings and makes full passes over the whole process on its own,
    on one rank at a time (docs/MEGATRON.md)."""
    if manual_gc:
        return None
    return (
        "zeppelin: Python's collector runs by itself: every plan brings thousands of objects, "
        "and its full passes stop a rank's step (0.1-0.3 s each in docs/BENCHMARKS.md); "
        "--manual-gc makes them at fixed steps on every rank"
    )


def planning_text(planning: dict, *, manual_gc: str = "") -> str:
    """``feed.PlanningStats.to_dict()`` in words: planning time, how much of it training hid
    (with plans shared: how many were made here, and how long training waited for plans), how
    long planner processes took to start, and the full passes Python's collector made by
    itself, with ``manual_gc`` (the flag that turns it off, where the run has one) after
    them."""
    share = planning["hidden_s"] / planning["planning_s"] if planning["planning_s"] else 1.0
    started = planning.get("startup_s", 0.0)
    passes = planning.get("collections", 0)
    collector = ""
    if passes:
        collector = (
            f"; Python's collector held the process for {passes} full "
            f"pass{'es' if passes > 1 else ''}, {planning['collection_s']:.2f} s in all "
            f"(longest {planning['longest_collection_s']:.2f} s)"
            + (f": {manual_gc} makes them at fixed steps" if manual_gc else "")
        )
    if planning.get("shared"):
        head = (
            f"{planning['num_plans']} plans taken, {planning['num_made']} made here (ahead "
            f"included) in {planning['planning_s']:.2f} s, the others received; training "
            f"waited {planning['waited_s']:.2f} s for plans"
        )
    else:
        head = (
            f"{planning['planning_s']:.2f} s for {planning['num_plans']} plans, "
            f"{planning['hidden_s']:.2f} s ({share:.0%}) hidden behind training"
        )
    return head + (f"; planner processes started in {started:.2f} s" if started else "") + collector


def plan_line(step: int, summary: dict) -> str:
    """One line of ``runtime.plan_summary``: tiers, imbalance, the bytes one layer's attention
    sends per link class (forward and backward, 2-D documents included) with the per-NIC split;
    ``step`` counts from 0."""
    tiers = ", ".join(f"{k} {v}" for k, v in summary["tiers"].items())
    links = summary["link_bytes"]
    nics = " ".join(f"{k[4:]}={format_bytes(v)}" for k, v in links.items() if k.startswith("nic:"))
    return (
        f"step {step + 1}: plan {summary['digest'][:8]} {summary['num_documents']} docs "
        f"({tiers}); imbalance attention {summary['attention_imbalance']:.2f} linear "
        f"{summary['linear_imbalance']:.2f}; attention bytes/layer (fwd+bwd) nvlink "
        f"{format_bytes(links['nvlink'])} nic {format_bytes(links['nic'])} [{nics}]"
    )
