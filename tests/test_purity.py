"""Pure tier: the planner and the topology model stay free of process groups.

Every rank must compute the same plan from the same lengths without talking to the others, so
nothing under ``planner/`` or ``topology/`` may import ``torch.distributed`` (ruff's banned-API
rule enforces the same at lint time; this test keeps it true for whoever skips the linter)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_zeppelin"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package", ["planner", "topology"])
def test_pure_packages_never_import_torch_distributed(package: str) -> None:
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files, f"no modules found under {package}/"
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            name for name in imported_modules(path) if name.startswith("torch.distributed")
        )
        for path in files
    }
    assert not {k: v for k, v in offenders.items() if v}
