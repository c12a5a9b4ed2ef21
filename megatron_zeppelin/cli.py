"""The ``zeppelin`` command line: a registry of subcommands, imported only when they run.

Adding a subcommand is one line in ``COMMANDS``: its name, the module (or ``module:object``) that
exposes ``add_arguments(parser)`` and ``run(args) -> int``, and a one-line help text.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

COMMANDS: dict[str, tuple[str, str] | str] = {
    "plan": ("megatron_zeppelin.commands.plan", "plan one batch and print or save the plan"),
    "simulate": ("megatron_zeppelin.commands.simulate", "predict the step time of one builder"),
    "compare": (
        "megatron_zeppelin.commands.simulate:compare",
        "compare Zeppelin with the baselines on the same batches",
    ),
    "verify": ("megatron_zeppelin.commands.verify", "check the engine on emulated nodes"),
    "profile": ("megatron_zeppelin.commands.profile", "measure this machine for the cost model"),
    "validate-cost-model": (
        "megatron_zeppelin.commands.validate",
        "run planned batches for real and compare with the cost model's prediction",
    ),
    "make-dataset": ("megatron_zeppelin.commands.dataset", "write or inspect a .bin/.idx dataset"),
    "train": ("megatron_zeppelin.commands.train", "train a small GPT on emulated nodes (CPU)"),
    "check": ("megatron_zeppelin.commands.check", "check Zeppelin training against one process"),
    "compile-planner": (
        "megatron_zeppelin.commands.compile_planner",
        "build the planner's compiled loops (numba) once for this environment",
    ),
}
"""Subcommand name -> ``(target, help)`` or just ``target``."""


def _entry(name: str) -> tuple[str, str | None]:
    entry = COMMANDS[name]
    return (entry, None) if isinstance(entry, str) else entry


def load_command(name: str) -> ModuleType:
    """The object behind subcommand ``name`` (it has ``add_arguments`` and ``run``)."""
    target, _ = _entry(name)
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only ``selected``'s own arguments are added (and imported)."""
    parser = argparse.ArgumentParser(
        prog="zeppelin",
        description="Zeppelin for Megatron-LM: plan, simulate and run variable-length batches.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        _, help_text = _entry(name)
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            load_command(name).add_arguments(command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; bad input prints one line on stderr and returns 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(selected if selected in COMMANDS else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage or the help
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(load_command(args.command).run(args) or 0)
    except BrokenPipeError:  # output piped into `head`: not an error of ours
        sys.stdout = open(os.devnull, "w")  # stays open until exit
        return 0
    except (ValueError, OSError) as exc:
        print(f"zeppelin {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"zeppelin {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
