"""Fixtures of the bring-your-own-assets CLI tests (imported by test_byo_cli.py).

``byo`` builds the user assets of ``tests/byo_assets.py`` once per session; ``byo_train`` runs
``ppoflow train --config tiny`` in-process on them and returns the rows of ``metrics.jsonl``;
``byo_cli`` runs the same command in a fresh interpreter, with its own TMPDIR and PREFECT_HOME,
for the cases that must fail before Ray or Prefect start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from byo_assets import ByoAssets, build_byo_assets, yaml_list

REPO = Path(__file__).resolve().parents[2]
CLI_TIMEOUT_S = 120


@dataclass(frozen=True)
class CliResult:
    """What a ``python -m flows.cli`` subprocess left: exit code, output, and whether it started
    Ray (a session under its TMPDIR) or a Prefect API (a database under its PREFECT_HOME)."""

    returncode: int
    stdout: str
    stderr: str
    ray_sessions: list[Path]
    prefect_databases: list[Path]


def read_metrics(run_dir: Path) -> list[dict]:
    """Every row of ``run_dir/metrics.jsonl``, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def byo(session_tmp: Path) -> ByoAssets:
    """The user's policy, reward model, datasets and reward functions (built once)."""
    return build_byo_assets(session_tmp / "byo")


@pytest.fixture()
def byo_base(byo: ByoAssets, tmp_path: Path) -> list[str]:
    """Overrides every BYO run shares: the user's policy and train file, a private run dir, and
    an assets dir that a run on the user's assets must never create."""
    return [
        f"models.policy={byo.policy}",
        f"models.assets_dir={tmp_path / 'builtin-assets'}",
        f"data.train_files={yaml_list(byo.train_parquet)}",
        f"run_dir={tmp_path / 'run'}",
        "resources.num_cpus=4",
        "trainer.total_steps=2",
        "rollout.max_new_tokens=8",
    ]


@pytest.fixture()
def byo_train(
    prefect_harness: None, ray_local: object, byo_base: list[str], tmp_path: Path
) -> Callable[..., list[dict]]:
    """``byo_train(*overrides)``: ``flows.cli.main(["train", "--config", "tiny", ...])`` in this
    process (it attaches to ``ray_local``); asserts exit code 0 and returns the metric rows."""
    from flows.cli import main

    def run(*overrides: str) -> list[dict]:
        rc = main(["train", "--config", "tiny", *byo_base, *overrides])
        assert rc == 0
        assert not (tmp_path / "builtin-assets").exists(), "the built-in task's assets were built"
        return read_metrics(tmp_path / "run")

    return run


@pytest.fixture()
def byo_cli(tmp_path: Path) -> Callable[..., CliResult]:
    """``byo_cli(*args)``: ``python -m flows.cli train *args`` in a subprocess (timeout
    ``CLI_TIMEOUT_S``) with a fresh TMPDIR (Ray's temp dir) and PREFECT_HOME."""
    ray_tmp, prefect_home = tmp_path / "r-tmp", tmp_path / "p-home"
    ray_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # A local Ray start makes its session dir under TMPDIR (infra.cluster) or RAY_TMPDIR.
    env.update(
        {"TMPDIR": str(ray_tmp), "RAY_TMPDIR": str(ray_tmp), "PREFECT_HOME": str(prefect_home)}
    )

    def run(*args: str) -> CliResult:
        proc = subprocess.run(
            [sys.executable, "-m", "flows.cli", "train", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
        )
        return CliResult(
            returncode=proc.returncode,
            stdout=proc.stdout,
            stderr=proc.stderr,
            ray_sessions=sorted(ray_tmp.rglob("session_*")),
            prefect_databases=sorted(prefect_home.rglob("*.db")),
        )

    return run
