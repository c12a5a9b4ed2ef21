"""Every ``zeppelin`` command in the README and the docs is one the CLI accepts, and every
``python scripts/...`` command one its script's argument parser accepts.

The commands are read from the files' code blocks (``tests/host/launch_commands.py`` reads
them; its Megatron training commands go through Megatron's own parser in the host tier), so a
new command is covered without editing this test. Each is parsed by the CLI's parser with the
subcommand's own arguments; a flag written in brackets (``[--no-2d]``) is optional, so both
forms are parsed. Parsing only: running them all would take minutes (``zeppelin train``); the
scripts run end to end, at their smallest, in ``tests/test_scripts.py``.

Tier: pure.
"""

from __future__ import annotations

import argparse
import importlib.util
import runpy
import shlex
import sys
from pathlib import Path

import pytest

from megatron_zeppelin.cli import COMMANDS, build_parser

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]


def _doc_code():
    spec = importlib.util.spec_from_file_location(
        "launch_commands", ROOT / "tests" / "host" / "launch_commands.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look themselves up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def _documented(prefix: str) -> list[tuple[str, str]]:
    doc = _doc_code()
    found = []
    for path in doc.markdown_files():
        for number, line in doc.code_lines(path.read_text()):
            if line.startswith(prefix):
                found.append((f"{path.relative_to(ROOT)}:{number}", line))
    return found


def documented_cli_commands() -> list[tuple[str, str]]:
    return _documented("zeppelin ")


def documented_script_commands() -> list[tuple[str, str]]:
    return _documented("python scripts/")


def _variants(words: list[str]) -> list[list[str]]:
    """The command without and with its bracketed optional flags."""
    optional = [w for w in words if w.startswith("[") and w.endswith("]")]
    plain = [w for w in words if w not in optional]
    return [plain] + ([plain + [w[1:-1] for w in optional]] if optional else [])


@pytest.mark.parametrize(("where", "line"), documented_cli_commands(), ids=lambda v: v)
def test_documented_zeppelin_command_parses(where: str, line: str, capsys) -> None:
    for words in _variants(shlex.split(line, comments=True)[1:]):
        command = words[0]
        assert command in COMMANDS, f"{where}: no subcommand {command!r}"
        try:
            build_parser(command).parse_args(words)
        except SystemExit as exc:
            pytest.fail(f"{where}: {' '.join(words)}: {capsys.readouterr().err.strip()} ({exc})")


def test_the_docs_hold_zeppelin_commands() -> None:
    assert len(documented_cli_commands()) >= 5


class _Parsed(Exception):
    """Raised in place of running a script once its arguments parsed."""


@pytest.mark.parametrize(("where", "line"), documented_script_commands(), ids=lambda v: v)
def test_documented_script_command_parses(where: str, line: str, monkeypatch, capsys) -> None:
    script, *argv = shlex.split(line, comments=True)[1:]
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        parse(parser, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    for words in _variants(argv):
        monkeypatch.setattr(sys, "argv", [script, *words])
        try:
            runpy.run_path(str(ROOT / script), run_name="__main__")
        except _Parsed:
            continue
        except SystemExit as exc:
            pytest.fail(f"{where}: {script} {' '.join(words)}: {capsys.readouterr().err} ({exc})")
        pytest.fail(f"{where}: {script} finished without parsing its arguments")


def test_the_docs_hold_script_commands() -> None:
    assert len(documented_script_commands()) >= 3
