"""The Megatron command lines users are given, as argument lists: every training command in the
README and the docs (read from the files, so a new one is covered without editing a test), and
every shipped model x cluster config expanded the way the Slurm scripts expand it.

A command is what follows ``pretrain_gpt.py`` or ``-m megatron_zeppelin.pretrain_gpt`` in a code
block (fenced or indented, lines joined at trailing backslashes, cut at a pipe), or an ``sbatch``
of one of the project's Slurm scripts, which ``scripts/slurm/zeppelin_env.sh`` turns into the
command every rank runs.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs", "scripts/slurm/README.md", "docker/README.md")
GPUS_PER_NODE = 8  # zeppelin_env.sh's default, the GPUs of every shipped cluster
ENTRY_POINTS = ("pretrain_gpt.py", "megatron_zeppelin.pretrain_gpt")


@dataclass(frozen=True)
class Command:
    """One Megatron launch: where it is written, its arguments, and the ranks it starts."""

    source: str
    argv: tuple[str, ...]
    world_size: int
    env: tuple[tuple[str, str], ...] = ()
    """Environment the launcher exports to every rank (name, value)."""


def markdown_files() -> list[Path]:
    files: list[Path] = []
    for entry in DOCUMENTS:
        path = ROOT / entry
        files += sorted(path.rglob("*.md")) if path.is_dir() else [path]
    return files


def code_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of fenced and 4-space-indented code blocks; a line ending in a
    backslash is joined with the next and numbered by its first line. Fenced blocks marked
    ```` ```text ```` hold a command's output, not commands, and are skipped."""
    lines, fenced, output, pending, first = [], False, False, "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.lstrip().startswith("```"):
            fenced = not fenced
            output = fenced and raw.strip()[3:].strip() == "text"
            continue
        if output:
            continue
        indented = raw.startswith("    ") and not raw.lstrip().startswith(("-", "*", "|"))
        if not (fenced or indented or pending):
            continue
        first = first or number
        line = raw.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append((first, pending + line))
        pending, first = "", 0
    return lines


def _words(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    return words[: words.index("|")] if "|" in words else words


def _launcher_world(words: list[str]) -> int:
    """Ranks a torchrun prefix starts (``--nproc-per-node`` x ``--nnodes``), else one node."""

    def value(flag: str, default: int) -> int:
        for i, word in enumerate(words):
            if word == flag:
                return int(words[i + 1])
            if word.startswith(flag + "="):
                return int(word.split("=", 1)[1])
        return default

    if "torchrun" not in words:
        return GPUS_PER_NODE
    return value("--nproc-per-node", 1) * value("--nnodes", 1)


@functools.cache
def documented_commands() -> tuple[Command, ...]:
    """Every training command of the README and the docs (read once per test process: the
    Slurm examples run ``zeppelin_env.sh``, most of a second each)."""
    commands = []
    for path in markdown_files():
        for number, line in code_lines(path.read_text()):
            if "pretrain_gpt" not in line and "sbatch" not in line:
                continue  # other code: zeppelin commands, Python, JSON, tables
            words = _words(line)
            where = f"{path.relative_to(ROOT)}:{number}"
            if "sbatch" in words:
                commands.append(_slurm_command(words, where))
                continue
            for i, word in enumerate(words):
                if word.endswith(ENTRY_POINTS[0]) or word == ENTRY_POINTS[1]:
                    world = _launcher_world(words[:i])
                    env = tuple(_assignments(words[:i]).items())
                    commands.append(Command(where, tuple(words[i + 1 :]), world, env=env))
                    break
    return tuple(commands)


def _assignments(words: list[str]) -> dict[str, str]:
    """``NAME=value`` words of a command line: what it exports to the launched ranks."""
    return dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_][A-Z0-9_]*=", w))


def _slurm_command(words: list[str], where: str) -> Command:
    env = _assignments(words)
    nodes = 2
    for i, word in enumerate(words):
        if word in ("--nodes", "-N"):
            nodes = int(words[i + 1])
    return slurm_command(
        env.get("MODEL", "llama-7b"), env.get("CLUSTER", "dgx-h100"), nodes, where=where
    )


def slurm_command(model: str, cluster: str, nodes: int, *, where: str = "") -> Command:
    """The command ``zeppelin_env.sh`` builds for every rank of an allocation of ``nodes``
    nodes (``ZEPPELIN_PRETRAIN``), with the environment it exports to the ranks."""
    script = f"""
        set -euo pipefail
        scontrol() {{ echo node0; }}   # the rendezvous host; no Slurm here
        export SLURM_JOB_NODELIST=node0 SLURM_NNODES={nodes}
        export MODEL={shlex.quote(model)} CLUSTER={shlex.quote(cluster)}
        export DATA_PREFIX=/data/corpus_text_document RUN_DIR=$(mktemp -d)
        export ZEPPELIN_DIR={shlex.quote(str(ROOT))} MEGATRON_DIR=/opt/Megatron-LM
        source "$ZEPPELIN_DIR/scripts/slurm/zeppelin_env.sh"
        rmdir "$RUN_DIR"
        printf '%s\\n' "$(eval echo "$ZEPPELIN_PRETRAIN")"
        printf '%s\\n' "CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
    """
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    command_line, env_line = done.stdout.strip().splitlines()[-2:]
    words = shlex.split(command_line)
    start = next(i for i, w in enumerate(words) if w.endswith(ENTRY_POINTS[0]))
    return Command(
        where or f"{model} on {cluster}",
        tuple(words[start + 1 :]),
        nodes * GPUS_PER_NODE,
        env=(tuple(env_line.split("=", 1)),),
    )


def shipped_configs() -> list[tuple[str, str]]:
    models = sorted(p.stem for p in (ROOT / "configs/models").glob("*.yaml"))
    clusters = sorted(p.stem for p in (ROOT / "configs/clusters").glob("*.yaml"))
    return [(m, c) for m in models for c in clusters]
