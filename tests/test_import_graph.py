"""Pure tier: no two modules of the package import each other, directly or round a circle,
and every import inside a function says why it is not at the top of its module.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING``: a circle
hidden in a function or a type-only import still means two modules that cannot be read, changed
or tested apart (interfaces live beside their users instead: ``comm/protocol.py``,
``attention/kernels/kernel_api.py``).

Imports sit at the top of their module, where they show what it depends on. One that must wait
for its function (an optional package probed, matplotlib only for a chart, megatron-core kept
out of a command that does not need torch, ``megatron.training`` that exists only beside
Megatron-LM) carries a ``# lazy:`` comment saying why, on its line or on the comment lines right
above it (above its run of imports)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_zeppelin"


@functools.cache
def package_modules() -> dict[str, tuple[Path, str, ast.Module]]:
    """Module name -> its file, source and syntax tree (parsed once for every test here)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        source = path.read_text()
        modules[name] = (path, source, ast.parse(source, filename=str(path)))
    return modules


def module_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from pkg import name`` counts as
    ``pkg.name`` when that is a module, else as ``pkg``)."""
    modules = package_modules()
    graph: dict[str, set[str]] = {}
    for name, (_, _, tree) in modules.items():
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_round_a_circle() -> None:
    graph = module_graph()
    assert "megatron_zeppelin.attention.kernels.kernels" in graph
    assert cycles(graph) == []


LAZY = "# lazy:"


def unexplained_lazy_imports(source: str, tree: ast.Module | None = None) -> list[int]:
    """Lines of the imports inside functions of ``source`` (parsed as ``tree``) that carry no
    ``# lazy:`` reason."""
    tree = tree or ast.parse(source)
    lines = source.splitlines()
    import_lines: set[int] = set()
    nested: list[ast.stmt] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                import_lines.update(range(child.lineno, child.end_lineno + 1))
                if in_function:
                    nested.append(child)
            elif not isinstance(child, ast.expr):  # imports sit in statements, not expressions
                function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                visit(child, in_function or function)

    visit(tree, False)
    unexplained = []
    for node in nested:
        if any(LAZY in lines[n - 1] for n in range(node.lineno, node.end_lineno + 1)):
            continue
        # Up through the run of imports and comments this import is in, to a reason.
        above, explained = node.lineno - 1, False
        while above >= 1 and not explained:
            line = lines[above - 1].lstrip()
            if line.startswith("#"):
                explained = line.startswith(LAZY)
            elif above not in import_lines:
                break
            above -= 1
        if not explained:
            unexplained.append(node.lineno)
    return sorted(set(unexplained))


def test_the_lazy_import_check_sees_an_import_without_a_reason() -> None:
    source = (
        "import os\n"
        "\n"
        "def f():\n"
        "    # lazy: matplotlib is optional.\n"
        "    import matplotlib\n"
        "    import matplotlib.pyplot\n"
        "    x = 1\n"
        "    import json\n"
        "    from megatron_zeppelin import fileio  # lazy: a reason on the line\n"
        "    # a comment that gives no reason\n"
        "    from megatron_zeppelin.planner import plan\n"
        "    try:\n"
        "        pass\n"
        "    except ImportError:\n"
        "        import yaml\n"
    )
    assert unexplained_lazy_imports(source) == [8, 11, 15]


def test_imports_inside_functions_say_why_they_wait() -> None:
    found = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path, source, tree in package_modules().values()
        if (lines := unexplained_lazy_imports(source, tree))
    }
    assert not found, (
        "imports inside functions without a '# lazy:' reason (move them to the top of the "
        f"module, or say why they must wait): {found}"
    )
