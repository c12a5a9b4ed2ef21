"""``zeppelin train``: the CPU training job on emulated nodes, launched through torchrun.

    zeppelin train                       # 4 processes = 2 nodes x 2 GPUs, 24 steps
    zeppelin train --steps 40 --json runs/cpu/train.json --save runs/cpu/ckpt

Every flag of ``python -m megatron_zeppelin.megatron.train_cpu`` is accepted and passed on;
``--nproc`` sets the process count (tensor parallel x Zeppelin ranks). Known third-party
warnings (Apex / TransformerEngine missing on CPU, megatron-core deprecations) are hidden in the
workers; ``--verbose`` shows them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from megatron_zeppelin.megatron import train_cpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="Processes to start (default 4).")
    train_cpu.add_arguments(parser)


def command_line(args: argparse.Namespace) -> list[str]:
    """The torchrun command that runs the job with ``args``."""
    forwarded: list[str] = []
    probe = train_cpu.build_parser()
    for action in probe._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue  # the job's own default applies
        flag = action.option_strings[0]
        if action.nargs == 0:  # store_true / store_false: the flag flips the default
            forwarded.append(flag)
        elif value is not None:
            forwarded += [flag, str(value)]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={args.nproc}", "-m", "megatron_zeppelin.megatron.train_cpu",
        *forwarded,
    ]  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if args.verbose:
        env["ZEPPELIN_VERBOSE"] = "1"  # the workers then keep third-party warnings on
    return subprocess.call(command_line(args), env=env)
