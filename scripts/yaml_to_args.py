"""Turn YAML files of command-line arguments into flags for Megatron-LM's ``pretrain_gpt.py``.

    python scripts/yaml_to_args.py configs/models/llama-7b.yaml configs/clusters/dgx-h100.yaml

Each file is a flat mapping ``flag-name: value``: ``true`` gives the bare flag, ``false`` and
``null`` leave it out, a list gives the flag followed by its items, anything else ``--flag
value``. Later files override earlier ones, key by key. The flags are printed on one line,
quoted for the shell, so a launcher can write ``ARGS=$(python scripts/yaml_to_args.py ...)``.

A top-level ``env:`` mapping is not a flag: it holds the job's environment variables (a
cluster's NICs and interfaces), which ``scripts/slurm/zeppelin_env.sh`` exports. It is skipped.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import yaml

ENV_SECTION = "env"
"""The top-level key of environment variables, never turned into a flag."""


def load_flags(paths: list[str]) -> dict[str, object]:
    """Merge the files' mappings in order (later wins); raise ValueError on a bad file."""
    merged: dict[str, object] = {}
    for path in paths:
        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {exc}") from exc
        if data is None:
            continue
        if not isinstance(data, dict):
            raise ValueError(f"{path} must be a mapping of flag names to values")
        for key, value in data.items():
            if key == ENV_SECTION:
                if not isinstance(value, dict):
                    raise ValueError(f"{path}: {ENV_SECTION!r} must map variable names to values")
                continue
            if not isinstance(key, str) or key.startswith("-"):
                raise ValueError(f"{path}: write flag names without dashes, got {key!r}")
            if isinstance(value, dict):
                raise ValueError(f"{path}: flag {key!r} has a nested mapping; values must be flat")
            merged[key] = value
    return merged


def to_argv(flags: dict[str, object]) -> list[str]:
    """The flags as an argument list, in the files' order."""
    argv: list[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        argv.append(f"--{key}")
        if value is True:
            continue
        if isinstance(value, list):
            argv.extend(str(v) for v in value)
        else:
            argv.append(str(value))
    return argv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="YAML files, later ones override earlier ones")
    args = parser.parse_args(argv)
    try:
        print(shlex.join(to_argv(load_flags(args.files))))
    except ValueError as exc:
        print(f"yaml_to_args: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
