"""``zeppelin plan``: plan one batch, print a summary, optionally write the plan and a chart.

Examples::

    zeppelin plan --lengths lengths.txt --nodes 2 --gpus-per-node 8 --nics-per-node 8 \\
        --capacity 16384 --model llama-7b --json plan.json
    zeppelin plan --topology zeppelin-C --nodes 4 --dist prolong --tokens 500000 --seed 0 \\
        --plot load.png

The input helpers here (batch, topology, cost model, planner options) are shared with
``zeppelin simulate`` and ``zeppelin compare``.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from megatron_zeppelin.config import ZeppelinConfig
from megatron_zeppelin.fileio import format_bytes
from megatron_zeppelin.megatron.args import zeppelin_node
from megatron_zeppelin.planner.baselines.distributions import read_lengths_file, sample_lengths
from megatron_zeppelin.planner.cost.calibration import apply_calibration, load_calibration
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.plan.plan import Tier
from megatron_zeppelin.planner.search.partition import plan_batch
from megatron_zeppelin.planner.simulate.simulator import simulate, tier_figures
from megatron_zeppelin.topology.presets import topology_from_args
from megatron_zeppelin.viz import plot_plan_load

DEFAULT_MODEL = "llama-7b"
DEFAULT_TOKENS = 262144
CAPACITY_HEADROOM = 1.25
"""Automatic capacity: the even share of tokens per GPU times this, rounded up to 1024."""


# --- shared arguments ----------------------------------------------------------------------
def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """Batch, cluster, model and cost-model flags (shared by plan, simulate and compare)."""
    batch = parser.add_argument_group("batch")
    batch.add_argument("--lengths", metavar="FILE", help="document lengths, one per line")
    batch.add_argument(
        "--dist",
        metavar="NAME",
        help="draw lengths from an embedded distribution instead "
        "(wikipedia, prolong, wlbllm, magi_realworld)",
    )
    batch.add_argument(
        "--tokens", type=int, default=DEFAULT_TOKENS, help="tokens per batch (--dist)"
    )
    batch.add_argument("--seed", type=int, default=0, help="seed of the first batch (--dist)")
    batch.add_argument(
        "--max-length", type=int, default=None, help="cut drawn documents longer than this"
    )
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--topology", metavar="PRESET", help="node design: zeppelin-A, ...")
    cluster.add_argument("--topology-file", metavar="YAML", help="node design from a YAML file")
    cluster.add_argument("--nodes", type=int, default=None, help="number of nodes")
    cluster.add_argument("--gpus-per-node", type=int, default=None)
    cluster.add_argument("--nics-per-node", type=int, default=None)
    cluster.add_argument("--nic-gbit", type=float, default=None, help="NIC line rate, Gbit/s")
    cluster.add_argument("--nvlink-gbps", type=float, default=None, help="NVLink GB/s per GPU")
    cluster.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="tokens one GPU may hold; default: "
        f"the even share times {CAPACITY_HEADROOM}, rounded up to 1024",
    )
    model = parser.add_argument_group("model and cost model")
    model.add_argument("--model", default=DEFAULT_MODEL, help="preset: llama-3b, llama-7b, ...")
    model.add_argument("--tp", type=int, default=1, help="tensor-parallel size inside a rank")
    model.add_argument("--cost-model", metavar="FILE", help="calibration file of measured figures")


def add_planner_arguments(parser: argparse.ArgumentParser) -> None:
    """Zeppelin planner flags (thresholds, routing, remapping)."""
    group = parser.add_argument_group("zeppelin planner")
    group.add_argument(
        "--intra-threshold",
        default=None,
        help="shortest document split inside a node, "
        "in tokens, or auto/off (default: the planner's)",
    )
    group.add_argument(
        "--inter-threshold",
        default=None,
        help="shortest document split across nodes, "
        "in tokens, or auto/off (default: the planner's)",
    )
    group.add_argument(
        "--no-routing", action="store_true", help="send inter-node messages directly"
    )
    group.add_argument(
        "--no-remap", action="store_true", help="run linear modules on the attention layout"
    )
    group.add_argument(
        "--no-split", action="store_true", help="split only documents that capacity forces"
    )
    group.add_argument(
        "--no-2d",
        action="store_true",
        help="keep every inter-node document on a flat ring "
        "(default: the cost model may split its heads inside each node and ring across nodes)",
    )
    group.add_argument(
        "--no-pool",
        action="store_true",
        help="place the batch in stages only (default: also as one pool of GPUs, first where "
        "long documents set the batch's least load and where the stages leave GPUs uneven, the "
        "faster kept)",
    )
    group.add_argument(
        "--linear-layout",
        choices=("auto", "attention", "node", "even"),
        default="auto",
        help="where linear modules run: auto (the fastest the cost model predicts), the "
        "attention layout, tokens even inside each node, or even over all GPUs",
    )


# --- shared readers --------------------------------------------------------------------------
def read_batches(args: argparse.Namespace, num_batches: int = 1) -> list[list[int]]:
    """``num_batches`` batches of document lengths: the lengths file (one batch, repeated) or
    draws from ``--dist`` with seeds ``seed, seed+1, ...``."""
    if (args.lengths is None) == (args.dist is None):
        raise ValueError("give the batch with exactly one of --lengths FILE or --dist NAME")
    if args.lengths is not None:
        return [read_lengths_file(args.lengths)] * num_batches

    return [
        sample_lengths(
            args.dist, num_tokens=args.tokens, seed=args.seed + i, max_length=args.max_length
        )
        for i in range(num_batches)
    ]


def read_topology(args: argparse.Namespace):
    """The ``Topology`` of the Zeppelin ranks the cluster flags describe (with ``--tp``: the
    node shaped for tensor parallelism, as ``megatron.args.zeppelin_node`` does in training)."""
    for flag, value in (("--nic-gbit", args.nic_gbit), ("--nvlink-gbps", args.nvlink_gbps)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be a positive finite bandwidth, got {value}")
    if args.topology is None and args.topology_file is None and args.gpus_per_node is None:
        raise ValueError(
            "describe the cluster: --topology PRESET --nodes N, or --nodes N --gpus-per-node G "
            "--nics-per-node K"
        )
    physical = topology_from_args(
        preset=args.topology,
        yaml_path=args.topology_file,
        num_nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        nics_per_node=args.nics_per_node,
        nic_gbit=args.nic_gbit,
        nvlink_gbps=args.nvlink_gbps,
    )
    tp = _tensor_parallel(args)
    if tp == 1:
        return physical

    # With tensor parallelism a node holds GPUs / TP Zeppelin ranks, as in a training run.
    return zeppelin_node(physical, tp)


def _tensor_parallel(args: argparse.Namespace) -> int:
    """``--tp``, refused unless a positive size."""
    tp = getattr(args, "tp", 1)
    if tp < 1:
        raise ValueError(f"--tp must be a positive tensor-parallel size, got {tp}")
    return tp


def read_cost_model(args: argparse.Namespace, topology):
    """Default cost model of ``--model`` on ``topology``, with ``--cost-model``'s figures."""
    model = get_model(args.model, tensor_parallel=_tensor_parallel(args))
    cost = CostModel.default(model, topology)
    if args.cost_model:
        cost = apply_calibration(cost, load_calibration(args.cost_model), source=args.cost_model)
    return cost


def capacity_for(args: argparse.Namespace, batches: list[list[int]], topology) -> int:
    """``--capacity`` or the automatic one (see ``CAPACITY_HEADROOM``)."""
    if args.capacity is not None:
        if args.capacity < 1:
            raise ValueError(f"--capacity must be a positive number of tokens, got {args.capacity}")
        return args.capacity
    most = max(sum(b) for b in batches)
    return int(math.ceil(most / topology.world_size * CAPACITY_HEADROOM / 1024) * 1024)


def planner_options(args: argparse.Namespace, cost_model) -> Any:
    """``PlannerOptions`` from the planner flags, by the same rules as ``--zeppelin-*`` in a
    training run (``ZeppelinConfig.planner_options``): a threshold left out or ``auto`` comes
    from the cost model, ``off`` never splits over that tier unless capacity forces it."""
    thresholds = {}
    for flag in ("intra", "inter"):
        value = getattr(args, f"{flag}_threshold", None)
        if value not in (None, "auto", "off"):
            value = str(_tokens(value, flag))
        thresholds[f"{flag}_threshold"] = value or "auto"
    if thresholds["intra_threshold"] != "auto" and thresholds["inter_threshold"] != "auto":
        low, high = (thresholds[f"{f}_threshold"] for f in ("intra", "inter"))
        if low.isdigit() and high.isdigit() and int(high) < int(low):
            raise ValueError(
                f"--inter-threshold ({high}) is below --intra-threshold ({low}): a document "
                "worth a cross-node ring is worth an NVLink one"
            )
    config = ZeppelinConfig(
        routing=not getattr(args, "no_routing", False),
        remap=not getattr(args, "no_remap", False),
        **thresholds,
    )
    return config.planner_options(
        cost_model,
        allow_split=not getattr(args, "no_split", False),
        linear_layout=getattr(args, "linear_layout", "auto"),
        two_d=not getattr(args, "no_2d", False),
        pool=not getattr(args, "no_pool", False),
    )


def _tokens(text: str, flag: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--{flag}-threshold takes tokens, auto or off, got {text!r}") from None
    if value < 1:
        raise ValueError(f"--{flag}-threshold must be positive, got {value}")
    return value


def zeppelin_plan(lengths: list[int], *, topology, cost_model, capacity: int, options=None):
    """Zeppelin's plan of one batch."""
    return plan_batch(
        lengths, topology=topology, cost_model=cost_model, capacity=capacity, options=options
    )


def cost_sources_line(cost_model) -> str:
    """Which cost figures are measured and which are datasheet defaults."""
    items = ", ".join(f"{k}={v}" for k, v in sorted(cost_model.sources.items()))
    return f"cost figures: {items}"


# --- the command -------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    add_planner_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="OUT", help="write the plan file (zeppelin-plan/2)")
    out.add_argument("--plot", metavar="PNG", help="chart of per-rank attention, linear and comm")


def summary_lines(plan, result, cost_model) -> list[str]:
    """A short human summary of one plan and its simulation."""
    world = plan.world_size
    lines = [
        f"{plan.name}: {len(plan.sequences)} documents, {plan.num_tokens} tokens on "
        f"{world} GPUs ({plan.topology.num_nodes} x {plan.topology.gpus_per_node}), "
        f"capacity {plan.capacity}"
    ]
    for tier in Tier:
        seqs = [s for s in plan.sequences if Tier(s.tier) == tier]
        tokens = sum(s.length for s in seqs)
        longest = max((s.length for s in seqs), default=0)
        two_d = sum(s.is_two_d for s in seqs)
        note = f", {two_d} with heads split across nodes (2-D)" if two_d else ""
        lines.append(
            f"  {tier.value:>5}: {len(seqs):5d} documents {tokens:9d} tokens "
            f"(longest {longest}{note})"
        )
    attention = [r.attention_s for r in result.per_rank]
    linear = [plan.num_linear_tokens(r) for r in range(world)]
    lines.append(
        f"  imbalance (max/mean): attention {_imbalance(attention):.3f}, "
        f"linear tokens {_imbalance(linear):.3f}"
    )
    lines.append(
        "  bytes per layer (forward): "
        + ", ".join(
            f"{k} {format_bytes(v)}" for k, v in sorted(result.link_bytes.items()) if ":" not in k
        )
        + f" (remapping: {format_bytes(sum(result.remap_bytes.values()))})"
    )
    lines += tier_lines(plan, cost_model)
    lines.append(
        f"  predicted step {result.step_time_s * 1e3:.1f} ms, lower bound "
        f"{result.lower_bound_s * 1e3:.1f} ms, efficiency {result.efficiency:.3f}, "
        f"MFU {result.mfu:.3f}"
    )
    lines.append("  " + cost_sources_line(cost_model))
    return lines


def tier_lines(plan, cost_model) -> list[str]:
    """Each kind of split document alone on its busiest rank (``simulator.tier_figures``)."""
    figures = tier_figures(plan, cost_model, routing=bool(plan.routes))
    if not figures:
        return []
    lines = ["  split documents, each kind alone (busiest rank, one layer, forward + backward):"]
    for name, f in figures.items():
        hidden = 1 - f["exposed_s"] / f["transfer_s"] if f["transfer_s"] > 0 else 1.0
        lines.append(
            f"    {name:>5}: {f['documents']:4d} documents, compute {f['compute_s'] * 1e3:.2f} ms, "
            f"transfers {f['transfer_s'] * 1e3:.2f} ms ({hidden:.0%} hidden, "
            f"{f['exposed_s'] * 1e3:.2f} ms exposed); forward bytes NVLink "
            f"{format_bytes(f['nvlink_bytes'])}, NIC {format_bytes(f['nic_bytes'])}"
        )
    return lines


def _imbalance(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def run(args: argparse.Namespace) -> int:
    topology = read_topology(args)
    cost = read_cost_model(args, topology)
    (lengths,) = read_batches(args, 1)
    capacity = capacity_for(args, [lengths], topology)
    plan = zeppelin_plan(
        lengths,
        topology=topology,
        cost_model=cost,
        capacity=capacity,
        options=planner_options(args, cost),
    )
    result = simulate(plan, cost, remap=not args.no_remap)
    print("\n".join(summary_lines(plan, result, cost)))
    if args.json:
        plan.to_json(args.json)
        print(f"plan written to {args.json}")
    if args.plot:
        plot_plan_load(plan, result, cost, args.plot)
        print(f"chart written to {args.plot}", file=sys.stderr)
    return 0
