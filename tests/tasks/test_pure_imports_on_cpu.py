"""The pure math modules import in a fresh interpreter without prefect, ray, transformers or the store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PURE_MODULES = (
    "tasks.advantage",
    "tasks.update",
    "tasks.score",
    "tasks.kl",
    "tasks.rewards",
    "tasks.masks",
    "tasks.batching",
)


def test_pure_modules_import_without_heavy_dependencies() -> None:
    code = (
        f"import {', '.join(PURE_MODULES)}; import sys; "
        "heavy = {'prefect', 'ray', 'storage', 'transformers'} & set(sys.modules); "
        "assert not heavy, sorted(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
