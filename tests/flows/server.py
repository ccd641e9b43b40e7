"""A real local Prefect server for the slow deployment tests, and the process handling they share.

Every process starts in its own session and is stopped by killing its whole process tree
(flow-run subprocesses, which Prefect starts in their own sessions, and the Ray helpers they
start included): SIGTERM, a grace period, then SIGKILL. Fixtures live in conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx

REPO = Path(__file__).resolve().parents[2]
TINY_PRESET = "tiny-smoke"
POOL = "ppoflow-process"
SERVER_START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 900.0


# ---------------------------------------------------------------------- processes
def _children() -> dict[int, list[int]]:
    """ppid → pids, from /proc."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (whatever session they moved to)."""
    children = _children()
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the process group and every descendant; SIGKILL what is left after ``grace_s``."""
    pids = process_tree(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    _signal_all(pids, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids[1:]):
        time.sleep(0.1)
    survivors = sorted(set(pids) | set(process_tree(proc.pid) if proc.poll() is None else []))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    _signal_all(survivors, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@contextlib.contextmanager
def running(
    cmd: list[str], *, env: dict[str, str], log: Path, cwd: Path = REPO
) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``cmd`` in its own session (output to ``log``); always stop its tree on exit."""
    with log.open("ab") as fh:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        stop_process(proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "<no log>"


# ---------------------------------------------------------------------- the server
@dataclass(frozen=True)
class LocalServer:
    """A running local Prefect server and the environment its clients use."""

    url: str  # the API, ".../api"
    root: Path  # PREFECT_HOME, logs, run dirs
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes]  # the server's process (``stop_process`` ends it early)

    @property
    def ui_url(self) -> str:
        return self.url.removesuffix("/api")

    @contextlib.contextmanager
    def settings(self) -> Iterator[None]:
        """Point this process's Prefect client at the server (and nothing else)."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.url}):
            yield

    def start(self, cmd: list[str], log_name: str) -> contextlib.AbstractContextManager[Any]:
        return running(cmd, env=self.env, log=self.root / log_name)


def server_env(root: Path, api_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(root / "home"),
        PREFECT_API_URL=api_url,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",  # short test schedules fire quickly
        PREFECT_SERVER_SERVICES_SCHEDULER_MAX_RUNS="3",
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_RUNNER_POLL_FREQUENCY="2",
        PYTHONUNBUFFERED="1",
    )
    env.pop("PREFECT_PROFILES_PATH", None)
    return env


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited ({proc.returncode}):\n{log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"prefect server not healthy within {timeout_s:.0f} s:\n{log_tail(log)}")


@contextlib.contextmanager
def local_server(root: Path) -> Iterator[LocalServer]:
    """``prefect server start`` on a free port with its own PREFECT_HOME, stopped on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = server_env(root, url)
    log = root / "server.log"
    cmd = [sys.executable, "-m", "prefect", "server", "start"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--analytics-off"]
    with running(cmd, env=env, log=log) as proc:
        wait_healthy(url, proc, log, SERVER_START_TIMEOUT_S)
        yield LocalServer(url=url, root=root, env=env, log=log, proc=proc)


# ---------------------------------------------------------------------- runs
def tiny_parameters(run_dir: Path, assets_dir: Path) -> dict[str, Any]:
    """The tiny-smoke preset from prefect.yaml, writing under the test's folders."""
    from flows.deploy import read_prefect_yaml

    (spec,) = read_prefect_yaml(REPO / "prefect.yaml", [TINY_PRESET])
    config = copy.deepcopy(spec.parameters["config"])
    config["run_dir"] = str(run_dir)
    config.setdefault("models", {})["assets_dir"] = str(assets_dir)
    return {"config": config}


async def wait_flow_run(flow_run_id: UUID, timeout_s: float) -> Any:
    """Poll until the flow run is final; return it."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    async with get_client() as client:
        while True:
            run = await client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {flow_run_id} not final within {timeout_s:.0f} s")
            await asyncio.sleep(1.0)


@dataclass(frozen=True)
class TinyRun:
    """The first run of the tiny-smoke preset, through the work pool."""

    flow_run: Any
    run_dir: Path
    parameters: dict[str, Any]
    run_name: str  # TrainConfig.name: the artifact keys' and the event resource's prefix
