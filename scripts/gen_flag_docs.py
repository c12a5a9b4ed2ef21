"""Print the ``--zeppelin*`` flags as a markdown table, generated from ``ZeppelinConfig``.

    python scripts/gen_flag_docs.py > /tmp/flags.md     # paste into docs/MEGATRON.md

The flag names, types, defaults and help texts come from the dataclass and its field docstrings
(the same source ``extra_args_provider`` uses), so the table cannot drift from the parser.
"""

from __future__ import annotations

import dataclasses
import sys

from megatron_zeppelin.config import ZeppelinConfig, _base_type, field_docs, flag_of


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


def markdown_table() -> str:
    lines = ["| flag | value | default | what it does |", "| --- | --- | --- | --- |"]
    for flag, kind, default, text in flag_rows():
        escaped = text.replace("|", r"\|")  # a bare | would end the table cell
        lines.append(f"| `{flag}` | {kind} | `{default}` | {escaped} |")
    return "\n".join(lines)


def main() -> int:
    print(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
