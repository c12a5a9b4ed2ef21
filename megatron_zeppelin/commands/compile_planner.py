"""``zeppelin compile-planner``: the planner's compiled loops built now, once per environment.

    zeppelin compile-planner [--require]

Where numba is installed (the ``fast`` extra), the planner's innermost loops run compiled
(``planner/loops/``). numba builds them the first time a process asks (seconds; on two cores
a run's planner processes, all starting at once, took 26 s) and keeps them in its on-disk
cache, so later processes load them in about one. This builds them ahead, as
``scripts/setup.sh`` and the Docker image do, so a pip-installed package's first training run
does not wait for it. Where numba is missing, or ``ZEPPELIN_PLANNER_JIT=0`` keeps the numpy
loops, it says so: the plans are the same either way (only slower). Exit status 0 in both
cases, unless ``--require``: then 1 where the loops do not run compiled (an image or a cluster
environment that must have them).
"""

from __future__ import annotations

import argparse
import time

from megatron_zeppelin.planner.loops import jit
from megatron_zeppelin.planner.search.partition import warm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--require",
        action="store_true",
        help="Exit 1 where the loops do not run compiled (numba missing or turned off).",
    )


def run(args: argparse.Namespace) -> int:
    failed = 1 if args.require else 0
    if jit.turned_off():
        print("ZEPPELIN_PLANNER_JIT=0: the planner runs its numpy loops; nothing to build")
        return failed
    start = time.perf_counter()
    if not warm():
        print(
            "numba is not installed: the planner runs its numpy loops (the same plans, "
            "slower); pip install numba, or the package's fast extra, to compile them"
        )
        return failed
    seconds = time.perf_counter() - start
    print(
        f"the planner's compiled loops are ready (numba {jit.version()}, {seconds:.1f} s); "
        "later processes load them from numba's cache"
    )
    return 0
