"""``zeppelin check``: Zeppelin training equals single-process training (loss and gradients).

    zeppelin check --json runs/check.json

Runs ``job.check.run_check``: 4 gloo processes (2 emulated nodes x 2 GPUs) with tensor
parallel 1 and 2 x Zeppelin 2 (TP 2 also with sequence parallelism), against a single-process
reference. Exit status 0 when every
relative error is within the tolerance, 1 otherwise; 2 with one line on stderr for options
the check cannot run (refused before any process starts, ``check.check_options``, and a
``--json`` whose directory does not exist). A rank that dies or stalls (``--timeout-s``: how long
a transfer may wait) ends the run with one line naming it, exit status 1; every rank's traceback
goes to the log file the line names.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Importing the job module hides the third-party warnings megatron-core prints on import.
from megatron_zeppelin.job import train_cpu  # noqa: F401  isort: skip
from megatron_zeppelin.fileio import atomic_write_text  # noqa: E402
from megatron_zeppelin.job.check import CheckOptions, run_check  # noqa: E402
from megatron_zeppelin.launch.ranks import DistributedRunError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="Write the full report to this file.")
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        nargs="+",
        default=[1, 2],
        help="Tensor-parallel sizes to check (default: 1 2).",
    )
    parser.add_argument("--seed", type=int, default=CheckOptions.seed, help="Weights seed.")
    parser.add_argument("--tolerance", type=float, default=CheckOptions.tolerance)
    parser.add_argument("--no-routing", action="store_true", help="Send inter-node rings direct.")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=CheckOptions.timeout_s,
        help="Seconds a transfer may wait for a peer before the check fails.",
    )


def run(args: argparse.Namespace) -> int:

    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json {args.json}: the directory it would go in does not exist")
    options = CheckOptions(
        tensor_parallels=tuple(args.tensor_parallel),
        seed=args.seed,
        tolerance=args.tolerance,
        routing=not args.no_routing,
        timeout_s=args.timeout_s,
    )
    try:
        report = run_check(options)
    except DistributedRunError as exc:  # a rank died, stalled or failed: one line, story in a log
        print(
            f"zeppelin check: error: {exc.summary} (every rank's traceback: "
            f"{exc.write_log('zeppelin-check')})",
            file=sys.stderr,
        )
        return 1
    print(f"reference loss {report['reference_loss']:.6f}")
    for name, r in report["runs"].items():
        tiers = ", ".join(f"{k} {v}" for k, v in r["plan"]["tiers"].items())
        print(
            f"{name}: Zeppelin world {r['zeppelin_world']}, loss {r['loss']:.6f}, relative error "
            f"loss {r['loss_rel_error']:.2e}, worst gradient {r['max_grad_rel_error']:.2e} "
            f"(documents: {tiers})"
        )
    verdict = "PASS" if report["passed"] else "FAIL"
    print(f"{verdict}: tolerance {report['tolerance']:g} relative, float32")
    if args.json:
        atomic_write_text(args.json, json.dumps(report, indent=1))
    return 0 if report["passed"] else 1
