"""No import cycles among the project's modules: a module never imports, directly or through
others, a module that imports it. Every import counts, at the top of a module, inside a function
or under ``TYPE_CHECKING``; a cycle is broken by moving what both sides share to a module below
them, not by moving an import into a function."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "infra", "storage")


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name → file, for every module of the packages (a package is its
    ``__init__``)."""
    files: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def imported_names(module: str, path: Path) -> list[str]:
    """Every dotted name an import in the file asks for; ``from a import b`` gives ``a.b`` (a
    submodule when there is one, else a name of ``a``). Relative imports are made absolute."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the project's modules it imports (the longest prefix of each imported name that
    is a module: ``from storage import BatchMeta`` is ``storage``, ``from storage import shm`` is
    ``storage.shm``)."""
    files = module_files(root)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        graph[module] = set()
        for name in imported_names(module, path):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_import_cycles() -> None:
    cycles = import_cycles(import_graph(ROOT))
    assert cycles == [], f"import cycles (move what both sides share below them): {cycles}"


def test_the_check_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "__init__.py").write_text("")
    (tmp_path / "flows" / "loop.py").write_text("from flows.sampling import Sampler\n")
    (tmp_path / "flows" / "sampling.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from flows.loop import RetryOptions\n"
    )
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "__init__.py").write_text("from storage.base import Store\n")
    (tmp_path / "storage" / "base.py").write_text(
        "from storage import shm\n\ndef f():\n    from .meta import BatchMeta\n"
    )
    (tmp_path / "storage" / "shm.py").write_text("")
    (tmp_path / "storage" / "meta.py").write_text("def g():\n    from storage import Store\n")
    assert import_cycles(import_graph(tmp_path)) == [
        ["flows.loop", "flows.sampling"],
        ["storage", "storage.base", "storage.meta"],
    ]
