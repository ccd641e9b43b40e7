"""Fixtures of the slow deployment tests: one local Prefect server per session, the
repository's deployments registered on it, a process-pool worker, and one finished tiny
training run shared by the tests that read it (helpers in server.py).

Each fixture stops what it started in a ``finally`` (tests/conftest.py turns SIGTERM into
KeyboardInterrupt, so an interrupted session tears down too). The test process's Prefect
settings point at the server only inside ``prefect_api`` (per test) or a fixture's own setup,
so tests using the in-process harness are not sent to this server.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

import pytest
from server import (
    POOL,
    REPO,
    RUN_TIMEOUT_S,
    TINY_PRESET,
    LocalServer,
    TinyRun,
    local_server,
    log_tail,
    tiny_parameters,
    wait_flow_run,
)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    """``prefect server start`` on a free port with its own PREFECT_HOME; stopped at the end."""
    with local_server(tmp_path_factory.mktemp("prefect-server")) as server:
        yield server


@pytest.fixture
def prefect_api(prefect_server: LocalServer) -> Iterator[LocalServer]:
    """The server, with this test's Prefect client pointed at it."""
    with prefect_server.settings():
        yield prefect_server


@pytest.fixture(scope="module")
def judge_overrides(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """``models.judge`` and ``reward.judge`` for the marker judge (tests/judge_assets.py): "yes"
    exactly when ``agrees(response, ground_truth)``; its template in a file."""
    from judge_assets import AGREE_TEMPLATE, build_marker_judge

    root = tmp_path_factory.mktemp("judge")
    template = root / "judge.jinja"
    template.write_text(AGREE_TEMPLATE)
    return [
        f"models.judge={build_marker_judge(root / 'judge')}",
        f"reward.judge.template={template}",
        "reward.judge.parse={name: yes_no}",
        "reward.judge.weight=0.5",
        "reward.judge.max_new_tokens=8",
    ]


# ---------------------------------------------------------------------- deployments and runs
@pytest.fixture(scope="session")
def deployed(prefect_server: LocalServer) -> dict[str, UUID]:
    """``ppoflow deploy`` of the repository's prefect.yaml: ``{"flow/deployment": id}``."""
    from flows.deploy import deploy_all

    with prefect_server.settings():
        return deploy_all(REPO / "prefect.yaml")


@pytest.fixture(scope="session")
def pool_worker(prefect_server: LocalServer) -> Iterator[subprocess.Popen[bytes]]:
    """``prefect worker start`` on the process pool, in its own session."""
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process"]
    with prefect_server.start(cmd, "worker.log") as proc:
        yield proc


@pytest.fixture(scope="session")
def tiny_run(
    prefect_server: LocalServer,
    deployed: dict[str, UUID],
    pool_worker: subprocess.Popen[bytes],
) -> TinyRun:
    """``run_deployment('ppo-train/tiny-smoke')`` picked up by the worker, waited for."""
    from prefect.deployments import run_deployment

    run_dir = prefect_server.root / "runs" / TINY_PRESET
    params = tiny_parameters(run_dir, prefect_server.root / "assets")
    with prefect_server.settings():
        created = run_deployment(
            f"ppo-train/{TINY_PRESET}", parameters=params, timeout=0, tags=["test"]
        )
        run = asyncio.run(wait_flow_run(created.id, RUN_TIMEOUT_S))
    assert run.state.is_completed(), (
        f"tiny run ended {run.state.type}: {run.state.message}\n"
        f"worker log:\n{log_tail(prefect_server.root / 'worker.log')}"
    )
    return TinyRun(
        flow_run=run, run_dir=run_dir, parameters=params, run_name=params["config"]["name"]
    )


@pytest.fixture(scope="session")
def uninterrupted(assets, shared_root) -> Path:
    """The kill/resume tests' reference: ``cli_runs.command`` run to the end, uninterrupted (its
    run directory), made once per pytest run for every test process."""
    from cli_runs import reference_run

    return reference_run(assets, shared_root)
