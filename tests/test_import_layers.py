"""Arrows only point down: flows → tasks → infra → storage. Every import in the source tree,
at the top of a module or inside a function, is checked against that order."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("flows", "tasks", "infra", "storage")  # each may import only the packages after it


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [found for node in ast.walk(tree) for found in _packages(node)]


def _packages(node: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level package) of each absolute import ``node`` makes (none if not one)."""
    if isinstance(node, ast.Import):
        return [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [(node.lineno, node.module.split(".")[0])]
    return []


def upward_imports(root: Path) -> list[str]:
    """``file:line imports pkg`` for each import of a layer above the file's own."""
    bad = []
    for rank, layer in enumerate(LAYERS):
        above = set(LAYERS[:rank])
        for path in sorted((root / layer).rglob("*.py")):
            for line, package in imported_packages(path):
                if package in above:
                    bad.append(f"{path.relative_to(root)}:{line} imports {package}")
    return bad


def test_no_layer_imports_one_above_it() -> None:
    assert upward_imports(ROOT) == []


def test_the_check_finds_an_upward_import_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "worker.py").write_text(
        "import torch\n\ndef f():\n    from tasks.batching import pack_batch\n"
    )
    (tmp_path / "storage").mkdir()
    (tmp_path / "storage" / "x.py").write_text("import infra.config\n")
    assert upward_imports(tmp_path) == [
        "infra/worker.py:4 imports tasks",
        "storage/x.py:1 imports infra",
    ]


def module_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of the absolute imports a module runs when it is imported: at
    its top level or in a top-level ``if``/``try`` block, not inside a function."""
    found: list[tuple[int, str]] = []
    pending: list[ast.stmt] = list(ast.parse(path.read_text(), filename=str(path)).body)
    while pending:
        node = pending.pop()
        found += _packages(node)
        if isinstance(node, ast.If) and not _type_checking(node):
            pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody
            pending += [s for handler in node.handlers for s in handler.body]
    return found


def _type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def prefect_on_import(root: Path) -> list[str]:
    """``file:line`` of each module-level Prefect import below ``flows/``: the worker processes
    import ``tasks``, ``infra`` and ``storage`` modules, and only the flow process needs Prefect."""
    return [
        f"{path.relative_to(root)}:{line}"
        for layer in LAYERS[1:]
        for path in sorted((root / layer).rglob("*.py"))
        for line, package in module_level_imports(path)
        if package == "prefect"
    ]


def test_only_the_flows_import_prefect_when_imported() -> None:
    assert prefect_on_import(ROOT) == []


def test_the_prefect_check_finds_a_task_decorator_but_not_a_lazy_import(tmp_path: Path) -> None:
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "stage.py").write_text(
        "import torch\nfrom prefect import task\n\n\ndef f():\n    import prefect.runtime\n"
    )
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "x.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import prefect\n"
    )
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "stages.py").write_text("from prefect import task\n")
    assert prefect_on_import(tmp_path) == ["tasks/stage.py:2"]
