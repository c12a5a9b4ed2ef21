"""``zeppelin validate-cost-model``: run planned batches for real and compare with the prediction.

Examples::

    # CPU: two emulated nodes of two GPUs (gloo processes), the committed CPU calibration
    zeppelin validate-cost-model --calibration configs/calibration/cpu-gloo-tiny.json \\
        --emulate 2x2 --batches 4 --tokens 8192 --json report.json --plot report.png

    # one GPU, a calibration measured on it
    zeppelin validate-cost-model --calibration h100-llama7b.json --model llama-7b --dtype bf16

See ``megatron_zeppelin.profile.validate`` for what is measured and predicted.
"""

from __future__ import annotations

import argparse
import json
import os

from megatron_zeppelin.commands.profile import check_kernel, check_positive, parse_shape
from megatron_zeppelin.devices import resolve_device
from megatron_zeppelin.profile.validate import ValidationSettings, validate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Plan batches with the calibrated cost model, run them with the engine, and report "
        "predicted against measured time per rank (median and worst error)."
    )
    parser.add_argument("--calibration", metavar="FILE", help="calibration file (zeppelin profile)")
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument("--dtype", default="float32", help="float32, bf16 or fp16")
    parser.add_argument("--device", default="auto", help="auto (one GPU where present), cpu")
    parser.add_argument("--kernel", default="auto", help="attention kernel: torch, flash, auto")
    parser.add_argument("--emulate", default="2x2", metavar="NODESxGPUS", help="CPU cluster shape")
    parser.add_argument("--dist", default="prolong", help="length distribution of the batches")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per batch (all ranks)")
    parser.add_argument("--batches", type=int, default=4, help="number of batches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capacity", type=int, default=None, help="tokens per GPU")
    parser.add_argument(
        "--thresholds", default="auto", metavar="INTRA,INTER", help="tier thresholds or auto"
    )
    parser.add_argument("--no-routing", action="store_true", help="send cross-node parts direct")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch (median)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="passes over all batches; median over passes"
    )
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    parser.add_argument("--plot", metavar="PNG", help="scatter of predicted against measured")


def _thresholds(text: str) -> str | tuple[int, int]:
    if text == "auto":
        return text
    try:
        intra, inter = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--thresholds takes INTRA,INTER tokens or auto, got {text!r}") from None
    return intra, inter


def format_report(report: dict) -> list[str]:
    """The table: one row per batch and rank, then the per-rank summary."""
    ms = lambda s: f"{s * 1e3:9.1f}"  # noqa: E731
    lines = [
        f"{'batch':>5} {'rank':>4} {'tokens':>6}  {'linear ms':>19}  {'attention ms':>19}  "
        f"{'total ms':>19}  {'error':>7}",
        f"{'':>18}  {'pred':>9} {'meas':>9}  {'pred':>9} {'meas':>9}  {'pred':>9} {'meas':>9}",
    ]
    for batch in report["batches"]:
        for r in batch["ranks"]:
            p, m = r["predicted"], r["measured"]
            lines.append(
                f"{batch['batch']:>5} {r['rank']:>4} {r['tokens']:>6}  "
                f"{ms(p['linear_s'])} {ms(m['linear_s'])}  "
                f"{ms(p['attention_s'])} {ms(m['attention_s'])}  "
                f"{ms(p['total_s'])} {ms(m['total_s'])}  {r['error']:+7.1%}"
            )
        step = batch["step"]
        lines.append(
            f"{batch['batch']:>5} {'step':>4} {'':>6}  tiers {batch['tiers']}  predicted "
            f"{step['predicted_s'] * 1e3:.1f} ms, measured {step['measured_s'] * 1e3:.1f} ms "
            f"({step['error']:+.1%})"
        )
    lines.append("")
    lines.append(f"{'rank':>4}  {'median error':>12}  {'worst error':>11}")
    for r in report["per_rank"]:
        lines.append(f"{r['rank']:>4}  {r['median_error']:>+12.1%}  {r['worst_error']:>+11.1%}")
    o = report["overall"]
    lines.append(
        f" all  median |error| {o['median_abs_error']:.1%}, worst {o['worst_error']:+.1%}; "
        f"step median |error| {o['step_median_abs_error']:.1%}, worst {o['step_worst_error']:+.1%}"
    )
    if "measures" in report:
        lines.append(f"measured: {report['measures']}")
    load = report.get("load_average") or {}
    if load.get("before") is not None:
        # Timings on a shared host are only as good as its idleness.
        lines.append(f"load average: {load['before']:.1f} before, {load['after']:.1f} after")
    return lines


def plot_report(report: dict, path: str) -> None:
    """Predicted against measured seconds per rank and batch (total and attention)."""
    # lazy: matplotlib is optional (the viz extra), needed only for --plot.
    import matplotlib

    matplotlib.use("Agg")
    # lazy: pyplot only after the backend is chosen.
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key, title in (
        (axes[0], "total_s", "linear + attention"),
        (axes[1], "attention_s", "attention"),
    ):
        world = len(report["per_rank"])
        top = 0.0
        for rank in range(world):
            xs = [b["ranks"][rank]["measured"][key] * 1e3 for b in report["batches"]]
            ys = [b["ranks"][rank]["predicted"][key] * 1e3 for b in report["batches"]]
            top = max(top, *xs, *ys)
            ax.scatter(xs, ys, label=f"rank {rank}")
        ax.plot([0, top * 1.05], [0, top * 1.05], color="grey", linestyle="--", label="exact")
        ax.set_xlabel("measured, ms per layer")
        ax.set_ylabel("predicted, ms per layer")
        ax.set_title(title)
        ax.legend(fontsize="small")
    o = report["overall"]
    fig.suptitle(
        f"cost model vs engine: median |error| {o['median_abs_error']:.0%}, "
        f"worst {o['worst_error']:+.0%}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:

    emulated = resolve_device(args.device).type == "cpu"
    check_kernel(args.kernel, emulated=emulated)
    check_positive(
        tokens=args.tokens,
        batches=args.batches,
        repeats=args.repeats,
        rounds=args.rounds,
        timeout=args.timeout,
    )
    if args.capacity is not None:
        check_positive(capacity=args.capacity)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.calibration is not None and not os.path.isfile(args.calibration):
        raise ValueError(
            f"--calibration {args.calibration}: no such file (write one with zeppelin profile)"
        )
    settings = ValidationSettings(
        calibration=args.calibration,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kernel=args.kernel,
        emulate=parse_shape(args.emulate),
        dist=args.dist,
        tokens=args.tokens,
        num_batches=args.batches,
        seed=args.seed,
        capacity=args.capacity,
        thresholds=_thresholds(args.thresholds),
        routing=not args.no_routing,
        warmup=args.warmup,
        repeats=args.repeats,
        rounds=args.rounds,
        timeout_s=args.timeout,
    )
    report = validate(settings)
    for line in format_report(report):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot_report(report, args.plot)
    return 0
