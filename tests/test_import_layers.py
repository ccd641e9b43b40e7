"""Arrows only point down: flows → tasks → infra → storage. Every import in the source tree,
at the top of a module or inside a function, is checked against that order."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("flows", "tasks", "infra", "storage")  # each may import only the packages after it


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in a file."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


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
