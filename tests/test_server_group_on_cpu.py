"""``SERVER_MODULES`` (tests/xdist_groups.py) names exactly the test modules that use the session's
local Prefect server, so the slow tier builds that server, its deployments, worker and tiny run
in one test process."""

from __future__ import annotations

import ast
from pathlib import Path

from xdist_groups import SERVER_MODULES

ROOT = Path(__file__).resolve().parents[1]
# The fixtures of tests/flows/conftest.py built on the session's server.
SERVER_FIXTURES = {"prefect_server", "prefect_api", "deployed", "pool_worker", "tiny_run"}


def server_modules(root: Path) -> set[str]:
    """The test modules with a test function that takes one of ``SERVER_FIXTURES``."""
    found = set()
    for path in sorted((root / "tests").rglob("test_*.py")):
        tests = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
        ]
        if any({a.arg for a in test.args.args} & SERVER_FIXTURES for test in tests):
            found.add(str(path.relative_to(root)))
    return found


def test_server_modules_names_every_module_that_uses_the_server() -> None:
    assert server_modules(ROOT) == SERVER_MODULES


def test_the_scan_finds_a_test_that_takes_the_server(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_a(tiny_run):\n    pass\n")
    (tmp_path / "tests" / "test_y.py").write_text("def test_b(tmp_path):\n    pass\n")
    assert server_modules(tmp_path) == {"tests/test_x.py"}
