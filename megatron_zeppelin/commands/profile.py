"""``zeppelin profile``: measure this machine and write a calibration file for the cost model.

Examples::

    # CPU, two emulated nodes of two GPUs each (gloo processes), model `tiny`, float32
    zeppelin profile --model tiny --dtype float32 --device cpu --emulate 2x2 \\
        --output configs/calibration/cpu-gloo-tiny.json

    # one GPU: kernels and linear modules only (links keep their datasheet figures)
    zeppelin profile --model llama-7b --dtype bf16 --output h100-llama7b.json

    # a cluster: every rank measures, rank 0 writes
    torchrun --nnodes 2 --nproc-per-node 8 -m megatron_zeppelin.cli profile --model llama-7b \\
        --dtype bf16 --output cluster.json

Use the file with ``--calibration FILE`` wherever a cost model is built (plan, simulate, compare,
validate-cost-model).
"""

from __future__ import annotations

import argparse
import sys

from megatron_zeppelin.attention.kernels.kernels import available_kernels, requires_cuda
from megatron_zeppelin.devices import resolve_device
from megatron_zeppelin.profile import kernels as kernel_profile
from megatron_zeppelin.profile import linear as linear_profile
from megatron_zeppelin.profile import links as link_profile
from megatron_zeppelin.profile.runner import ProfileSettings, profile, summary_lines
from megatron_zeppelin.profile.timing import TimingOptions


def parse_shape(text: str) -> tuple[int, int]:
    """``2x4`` -> ``(2, 4)`` (nodes, GPUs per node)."""
    try:
        nodes, gpus = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"expected NODESxGPUS such as 2x2, got {text!r}") from None
    if nodes < 1 or gpus < 1:
        raise ValueError(f"nodes and GPUs per node must be >= 1, got {text!r}")
    return nodes, gpus


def parse_sizes(text: str) -> tuple[int, ...]:
    """``4K,1M,64`` -> byte or token counts (K = 1024, M = 1024**2, G = 1024**3)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = units.get(part[-1:], 1)
        digits = part[:-1] if part[-1:] in units else part
        try:
            sizes.append(int(digits) * scale)
        except ValueError:
            raise ValueError(f"cannot read size {part!r} in {text!r} (use e.g. 64,4K,1M)") from None
    return tuple(sizes)


def check_kernel(name: str, *, flag: str = "--kernel", emulated: bool = False) -> None:
    """Refuse an attention kernel the engine does not know, or a CUDA-only kernel on emulated
    (CPU) ranks, before any process starts."""

    if name not in available_kernels():
        raise ValueError(f"{flag} {name!r} is not a known kernel: use one of {available_kernels()}")
    if emulated and requires_cuda(name):
        raise ValueError(
            f"{flag} {name} needs CUDA, but emulated ranks are CPU processes: use torch (or auto)"
        )


def check_positive(**values: float) -> None:
    """Each keyword (a flag name with ``_`` for ``-``) must be above zero."""
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measure attention kernels, linear modules and links on this machine, fit the cost "
        "model's curves and write them as a calibration file."
    )
    parser.add_argument("--output", "-o", required=True, metavar="FILE", help="calibration file")
    parser.add_argument("--model", default="tiny", help="model preset whose shapes are measured")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="TP size inside a rank")
    parser.add_argument("--dtype", default="float32", help="float32, bf16 or fp16")
    parser.add_argument("--device", default="auto", help="auto (CUDA where present), cpu, cuda")
    parser.add_argument(
        "--kernel",
        default="auto",
        help="attention kernel to measure (te, cudnn, torch-flash, ...); auto: every kernel that "
        "runs here, each with its own curves, the fastest leading the file",
    )
    parser.add_argument(
        "--emulate",
        metavar="NODESxGPUS",
        help="CPU only: start this many gloo processes and measure them as a cluster (e.g. 2x2)",
    )
    parser.add_argument(
        "--grid",
        default="auto",
        choices=("auto", "quick", "cpu", "gpu"),
        help="attention shapes: quick (CPU, 16..2K), cpu (16..4K), gpu (16..64K); auto: gpu on "
        "CUDA, quick on CPU",
    )
    parser.add_argument("--linear-tokens", metavar="N,N,...", help="token counts for the GEMMs")
    parser.add_argument("--link-sizes", metavar="B,B,...", help="message sizes, e.g. 4K,256K,2M")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per shape")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per shape (median)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="passes over all shapes; each point keeps the median over passes (a shared host's "
        "bursts of load then spread over every point)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads per process (0: torch's default)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")


def settings_from_args(args: argparse.Namespace):  # noqa: ANN201 - ProfileSettings, imported late
    """The ``ProfileSettings`` the flags describe."""

    on_cuda = resolve_device(args.device).type == "cuda"
    grid_name = args.grid if args.grid != "auto" else ("gpu" if on_cuda else "quick")
    linear_default = (
        linear_profile.DEFAULT_GPU_TOKENS if on_cuda else linear_profile.DEFAULT_CPU_TOKENS
    )
    sizes_default = link_profile.DEFAULT_GPU_SIZES if on_cuda else link_profile.DEFAULT_CPU_SIZES
    return ProfileSettings(
        model=args.model,
        tensor_parallel=args.tensor_parallel,
        device=args.device,
        dtype=args.dtype,
        kernel=args.kernel,
        emulate=parse_shape(args.emulate) if args.emulate else None,
        grid=kernel_profile.AttentionGrid.named(grid_name),
        linear_tokens=parse_sizes(args.linear_tokens) if args.linear_tokens else linear_default,
        link_sizes=parse_sizes(args.link_sizes) if args.link_sizes else sizes_default,
        timing=TimingOptions(warmup=args.warmup, repeats=args.repeats),
        rounds=args.rounds,
        threads=args.threads or None,
        timeout_s=args.timeout,
    )


def run(args: argparse.Namespace) -> int:

    check_kernel(args.kernel, emulated=bool(args.emulate))
    check_positive(
        tensor_parallel=args.tensor_parallel,
        repeats=args.repeats,
        rounds=args.rounds,
        timeout=args.timeout,
    )
    if args.warmup < 0 or args.threads < 0:
        raise ValueError("--warmup and --threads must be 0 or more")
    settings = settings_from_args(args)  # checks the model, dtype and --emulate shape
    if settings.emulate and resolve_device(args.device).type != "cpu":
        raise ValueError("--emulate runs gloo processes on the CPU: pass --device cpu")
    progress = (
        None if args.quiet else (lambda message: print(f"profile: {message}", file=sys.stderr))
    )
    calibration = profile(settings, output=args.output, progress=progress)
    if not args.quiet:
        for line in summary_lines(calibration):
            print(line)
    return 0
