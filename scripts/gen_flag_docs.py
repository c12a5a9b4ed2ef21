"""The generated tables of docs/MEGATRON.md: the ``--zeppelin*`` flags (from ``ZeppelinConfig``)
and every Megatron flag's answer with ``--zeppelin`` (from ``megatron.coverage``).

    python scripts/gen_flag_docs.py            # print both tables
    python scripts/gen_flag_docs.py --write    # rewrite them in docs/MEGATRON.md
    python scripts/gen_flag_docs.py --check    # exit 1 if docs/MEGATRON.md is out of date

The flag names, types, defaults and help texts come from the dataclass and its field docstrings
(the same source ``extra_args_provider`` uses), and the answers from the registry the start-up
checks enforce, so neither table can drift from the code. In docs/MEGATRON.md each table sits
between ``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated: NAME -->``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from megatron_zeppelin.config import ZeppelinConfig, _base_type, field_docs, flag_of
from megatron_zeppelin.megatron import coverage

DOC = Path(__file__).resolve().parents[1] / "docs" / "MEGATRON.md"


def flag_rows() -> list[tuple[str, str, str, str]]:
    """``(flag, type, default, help)`` for every field, in declaration order."""
    docs = field_docs()
    rows = []
    for f in dataclasses.fields(ZeppelinConfig):
        kind, _ = _base_type(f.name)
        choices = f.metadata.get("choices")
        if kind is bool:
            negated = f.default is True  # the flag turns a feature off
            shown = "switch (turns it off)" if negated else "switch"
            default = "on" if negated else "off"
            rows.append((flag_of(f.name, negated=negated), shown, default, docs[f.name]))
            continue
        shown = " \\| ".join(choices) if choices else kind.__name__
        default = "none" if f.default is None else str(f.default)
        flags = [flag_of(f.name)] + [f"--zeppelin-{a}" for a in f.metadata.get("aliases", ())]
        rows.append((" / ".join(flags), shown, default, docs[f.name]))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", r"\|")  # a bare | would end the table cell


def markdown_table() -> str:
    lines = ["| flag | value | default | what it does |", "| --- | --- | --- | --- |"]
    for flag, kind, default, text in flag_rows():
        lines.append(f"| `{flag}` | {kind} | `{default}` | {_cell(text)} |")
    return "\n".join(lines)


def coverage_rows() -> list[tuple[list[str], coverage.Answer]]:
    """Consecutive answers that say the same (answer, reason, test, change) share a row."""
    rows: list[tuple[list[str], coverage.Answer]] = []
    for answer in coverage.ANSWERS:
        key = (answer.kind, answer.reason, answer.test, answer.change)
        if (
            rows
            and (rows[-1][1].kind, rows[-1][1].reason, rows[-1][1].test, rows[-1][1].change) == key
        ):
            rows[-1][0].append(answer.flag)
        else:
            rows.append(([answer.flag], answer))
    return rows


def coverage_table() -> str:
    lines = ["| Megatron flag | with `--zeppelin` | why | shown by / what to change |"]
    lines.append("| --- | --- | --- | --- |")
    for flags, answer in coverage_rows():
        names = ", ".join(f"`{f}`" for f in flags)
        last = f"`{answer.test}`" if answer.test else answer.change
        lines.append(f"| {names} | {answer.kind} | {_cell(answer.reason)} | {_cell(last)} |")
    return "\n".join(lines)


TABLES = {"zeppelin flags": markdown_table, "megatron flags": coverage_table}


def rewritten(text: str) -> str:
    """``text`` (docs/MEGATRON.md) with every generated table replaced by its current one."""
    for name, table in TABLES.items():
        begin, end = f"<!-- BEGIN generated: {name} -->", f"<!-- END generated: {name} -->"
        if begin not in text or end not in text:
            raise ValueError(f"{DOC} has no '{begin}' ... '{end}' block")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{table()}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite docs/MEGATRON.md's tables")
    mode.add_argument("--check", action="store_true", help="exit 1 if they are out of date")
    options = parser.parse_args(argv)
    if not (options.write or options.check):
        print(markdown_table() + "\n\n" + coverage_table())
        return 0
    text = DOC.read_text()
    fresh = rewritten(text)
    if options.write:
        DOC.write_text(fresh)
        return 0
    if fresh != text:
        print(f"{DOC} is out of date: run python scripts/gen_flag_docs.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
