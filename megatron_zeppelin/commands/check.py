"""``zeppelin check``: Zeppelin training equals single-process training (loss and gradients).

    zeppelin check --json runs/check.json

Runs ``megatron.check.run_check``: 4 gloo processes (2 emulated nodes x 2 GPUs) with tensor
parallel 1 and 2 x Zeppelin 2 (TP 2 also with sequence parallelism), against a single-process
reference. Exit status 0 when every
relative error is within the tolerance, 1 otherwise; 2 with one line on stderr for options
the check cannot run (refused before any process starts, ``check.check_options``).
"""

from __future__ import annotations

import argparse
import json

# Importing the job module hides the third-party warnings megatron-core prints on import.
from megatron_zeppelin.megatron import train_cpu  # noqa: F401  isort: skip
from megatron_zeppelin.megatron.check import CheckOptions, run_check  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="Write the full report to this file.")
    parser.add_argument(
        "--tensor-parallel", type=int, nargs="+", default=[1, 2],
        help="Tensor-parallel sizes to check (default: 1 2).",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=CheckOptions.seed, help="Weights seed.")
    parser.add_argument("--tolerance", type=float, default=CheckOptions.tolerance)
    parser.add_argument("--no-routing", action="store_true", help="Send inter-node rings direct.")
    parser.add_argument("--timeout-s", type=float, default=CheckOptions.timeout_s)


def run(args: argparse.Namespace) -> int:
    options = CheckOptions(
        tensor_parallels=tuple(args.tensor_parallel),
        seed=args.seed,
        tolerance=args.tolerance,
        routing=not args.no_routing,
        timeout_s=args.timeout_s,
    )
    report = run_check(options)
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
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["passed"] else 1
