"""Pure tier: the package's layout says its architecture, and the docs' citations resolve.

- The planner's wings (``planner.WINGS``, lowest first) form a strict layering: a module of a
  wing imports only its own wing and the wings before it, and never the planner's face
  (``megatron_zeppelin.planner``, which imports the search).
- Nothing outside ``testing/`` and ``tests/`` imports ``megatron_zeppelin.testing`` but the
  oracle's users named here.
- No package folder holds more than 15 modules.
- Every module path the docs cite (``docs/*.md``, the READMEs) exists, as a file path
  (``planner/search/partition.py``) or dotted (``megatron_zeppelin.megatron.spec``)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from megatron_zeppelin.planner import WINGS

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_zeppelin"
PLANNER = "megatron_zeppelin.planner"

# The modules that may import the oracle (``testing/``): the commands that run it and the
# kernel benchmark, which holds every kernel to the dense reference.
ORACLE_USERS = {
    "megatron_zeppelin/commands/verify.py",
    "megatron_zeppelin/commands/verify_run.py",
    "megatron_zeppelin/job/check.py",
    "scripts/bench_kernels.py",
}

MAX_MODULES = 15


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (``from pkg import name`` gives ``pkg`` and
    ``pkg.name``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@functools.cache
def planner_modules() -> dict[str, set[str]]:
    """Planner module (its path from the package) -> what it imports."""
    return {
        str(path.relative_to(PACKAGE)): imports_of(path)
        for path in sorted((PACKAGE / "planner").rglob("*.py"))
    }


def wing_breaches(wings: tuple[str, ...], modules: dict[str, set[str]]) -> list[str]:
    """``module -> import`` for every import of a wing above the module's own, or of the
    planner's face; and every planner module in no wing."""
    breaches = []
    for path, imported in sorted(modules.items()):
        parts = Path(path).parts
        if parts == ("planner", "__init__.py"):
            continue
        if len(parts) != 3 or parts[1] not in wings:
            breaches.append(f"{path}: in no wing of {wings}")
            continue
        rank = wings.index(parts[1])
        for name in sorted(imported):
            if name == PLANNER:
                breaches.append(f"{path} -> {name} (the face; import the wing's module)")
            elif name.startswith(PLANNER + "."):
                wing = name.split(".")[2]
                if wing in wings and wings.index(wing) > rank:
                    breaches.append(f"{path} -> {name}")
    return breaches


def test_the_wing_check_sees_an_import_from_above() -> None:
    modules = {
        "planner/cost/models.py": {"math"},
        "planner/plan/plan.py": {f"{PLANNER}.cost.models"},
        "planner/cost/costmodel.py": {f"{PLANNER}.plan.plan", f"{PLANNER}.cost.models"},
        "planner/plan/heads.py": {PLANNER},
        "planner/loose.py": set(),
    }
    assert wing_breaches(("cost", "plan"), modules) == [
        f"planner/cost/costmodel.py -> {PLANNER}.plan.plan",
        "planner/loose.py: in no wing of ('cost', 'plan')",
        f"planner/plan/heads.py -> {PLANNER} (the face; import the wing's module)",
    ]


def test_planner_wings_import_only_the_wings_below_them() -> None:
    modules = planner_modules()
    wings_found = {Path(p).parts[1] for p in modules if len(Path(p).parts) == 3}
    assert wings_found == set(WINGS)
    assert not wing_breaches(WINGS, modules)


def python_files_outside_tests() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "scripts").rglob("*.py"))


def test_only_the_oracle_users_import_testing() -> None:
    importers = set()
    for path in python_files_outside_tests():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("megatron_zeppelin/testing/"):
            continue
        if any(
            n == "megatron_zeppelin.testing" or n.startswith("megatron_zeppelin.testing.")
            for n in imports_of(path)
        ):
            importers.add(rel)
    assert importers == ORACLE_USERS


def module_counts() -> dict[str, int]:
    """Package folder -> how many modules it holds (``__init__.py`` not counted)."""
    return {
        init.parent.relative_to(ROOT).as_posix(): sum(
            1 for p in init.parent.glob("*.py") if p.name != "__init__.py"
        )
        for init in sorted(PACKAGE.rglob("__init__.py"))
    }


def test_no_package_folder_holds_more_than_15_modules() -> None:
    counts = module_counts()
    assert counts["megatron_zeppelin/planner/search"] > 0  # the count sees sub-packages
    assert {folder: n for folder, n in counts.items() if n > MAX_MODULES} == {}


def test_every_folder_of_modules_is_a_package() -> None:
    """A folder of modules without ``__init__.py`` would be left out of the wheel."""
    folders = {p.parent for p in PACKAGE.rglob("*.py")}
    assert (
        sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()) == []
    )


# Citations: ``dir/file.py`` paths and dotted ``megatron_zeppelin.x.y`` names.
PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.py)\b")
DOTTED = re.compile(r"(?<![\w.])megatron_zeppelin(?:\.\w+)+")
REPO_DIRS = {"megatron_zeppelin", "scripts", "tests", "docs", "configs", "patches", "docker"}
# Megatron-LM's own folders, cited beside ours under the same first name.
EXTERNAL = ("megatron/core/", "megatron/training/", "megatron/legacy/")


def cited_paths(text: str) -> set[str]:
    """The paths of this repository ``text`` cites, as paths from the repository root."""
    found = set()
    for path in PATH.findall(text):
        first = path.split("/")[0]
        if path.startswith(EXTERNAL):
            continue
        if first in REPO_DIRS:
            found.add(path)
        elif (PACKAGE / first).is_dir():
            found.add(f"megatron_zeppelin/{path}")
    return found


def resolves(name: str) -> bool:
    """A dotted name is a module of the package, or one name defined in such a module."""
    parts = name.split(".")
    for end in (len(parts), len(parts) - 1):
        base = ROOT.joinpath(*parts[:end])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return end == len(parts) or parts[end] in base_names(base)
    return False


def base_names(base: Path) -> set[str]:
    file = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    tree = ast.parse(file.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def doc_files() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [
        ROOT / "README.md",
        ROOT / "scripts/slurm/README.md",
    ]


def test_the_citation_reader_sees_paths_and_names() -> None:
    text = (
        "`planner/search/partition.py:plan_batch`, (`scripts/test.sh`, `megatron/plans/feed.py`) "
        "megatron/core/transformer/attention.py, `megatron_zeppelin.megatron.spec local`"
    )
    assert cited_paths(text) == {
        "megatron_zeppelin/planner/search/partition.py",
        "megatron_zeppelin/megatron/plans/feed.py",
    }
    assert resolves("megatron_zeppelin.megatron.spec")
    assert resolves("megatron_zeppelin.planner.search.partition.plan_batch")
    assert not resolves("megatron_zeppelin.planner.partition")
    assert not resolves("megatron_zeppelin.planner.search.partition.no_such_name")


def test_every_module_the_docs_cite_exists() -> None:
    missing, cited = {}, 0
    for doc in doc_files():
        text = doc.read_text()
        paths = cited_paths(text)
        names = set(DOTTED.findall(text))
        cited += len(paths) + len(names)
        gone = sorted(p for p in paths if not (ROOT / p).exists())
        gone += sorted(n for n in names if not resolves(n))
        if gone:
            missing[doc.relative_to(ROOT).as_posix()] = gone
    assert cited > 50  # the docs cite modules, and the reader finds them
    assert missing == {}
