"""The shipped automation (docs/automations/cancel-on-metric-drop.yaml) cancels a training run
whose ``trainer.alerts`` fires, on a real local Prefect server (slow tier, fixtures in
conftest.py): ``prefect automation create --from-file`` registers it, a tiny deployment run with
an alert that fires at step 0 and far more steps than it can finish first is picked up by the
process worker, and the run ends CANCELLED with none of its processes (the flow run, Ray's
helpers and workers) left behind. The automation is deleted at the end.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from server import REPO, TINY_PRESET, LocalServer, log_tail, tiny_parameters

AUTOMATION_FILE = REPO / "docs" / "automations" / "cancel-on-metric-drop.yaml"
AUTOMATION_NAME = "ppoflow-cancel-on-metric-alert"
ALERT_EVENT = "ppoflow.metric.alert"
ALERT_WITHIN_S = 360.0  # the run's start: warm start, Ray, workers, step 0
CANCEL_WITHIN_S = 120.0
LEFTOVER_GRACE_S = 30.0
MARKER_VAR = "PPOFLOW_TEST_RUN_MARKER"


def _create_automation(server: LocalServer) -> UUID:
    """``prefect automation create --from-file`` of the shipped file; its id."""
    cmd = [sys.executable, "-m", "prefect", "automation", "create", "--from-file"]
    done = subprocess.run(
        [*cmd, str(AUTOMATION_FILE)], env=server.env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        (automation,) = client.read_automations_by_name(AUTOMATION_NAME)
    return automation.id


def _marked_pids(marker: str) -> list[int]:
    """Processes whose environment holds ``MARKER_VAR=marker`` (the run's, whatever session)."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
    except OSError:
        return "<gone>"


async def _first_alert(run_name: str, timeout_s: float, marker: str, seen: set[int]) -> Any:
    """The run's first alert event; ``seen`` collects the run's processes meanwhile."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    deadline = time.monotonic() + timeout_s
    async with get_client() as client:
        while True:
            flt = EventFilter(  # anew each time: its `occurred.until` defaults to its creation
                event=EventNameFilter(name=[ALERT_EVENT]),
                resource=EventResourceFilter(id=[f"ppoflow.run.{run_name}"]),
            )
            events = (await client.read_events(filter=flt, limit=5)).events
            seen.update(_marked_pids(marker))
            if events:
                return events[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {ALERT_EVENT} event of run {run_name} in {timeout_s:.0f} s")
            await asyncio.sleep(1.0)


async def _wait_state(flow_run_id: UUID, timeout_s: float) -> Any:
    """The flow run once it is final (or the timeout ends)."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    async with get_client() as client:
        while True:
            run = await client.read_flow_run(flow_run_id)
            if (run.state is not None and run.state.is_final()) or time.monotonic() > deadline:
                return run
            await asyncio.sleep(1.0)


def _alerting_parameters(server: LocalServer) -> dict[str, Any]:
    """The tiny-smoke preset, 40 steps in one flow run, an alert that fires at step 0."""
    params = tiny_parameters(server.root / "runs" / "alert-cancel", server.root / "assets")
    config = params["config"]
    config["name"] = "alert-cancel"
    trainer = config.setdefault("trainer", {})
    trainer.update(total_steps=40, checkpoint_every=40, eval_every=40)
    trainer["steps_per_run"] = None  # set, so that it is not the preset's 2
    trainer["alerts"] = [{"metric": "critic/score/mean", "above": -1e9}]
    return params


@pytest.mark.slow
def test_alert_automation_cancels_the_run(
    prefect_api: LocalServer,
    deployed: dict[str, UUID],
    pool_worker: subprocess.Popen[bytes],
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    automation_id = _create_automation(prefect_api)
    marker = uuid.uuid4().hex
    run_id: UUID | None = None
    try:
        # 1. A run that cannot finish before its step-0 alert cancels it.
        params = _alerting_parameters(prefect_api)
        created = run_deployment(
            f"ppo-train/{TINY_PRESET}",
            parameters=params,
            timeout=0,
            tags=["test"],
            job_variables={"env": {MARKER_VAR: marker}},
        )
        run_id = created.id
        seen: set[int] = set()
        alert = asyncio.run(_first_alert(params["config"]["name"], ALERT_WITHIN_S, marker, seen))
        assert len(seen) > 1  # the marker reached the flow process and what it started
        assert alert.payload["step"] == 0 and alert.payload["metric"] == "critic/score/mean"
        assert f"prefect.flow-run.{run_id}" in {r.id for r in alert.related}
        # 2. The automation cancels it (CANCELLING while the worker stops the process).
        run = asyncio.run(_wait_state(run_id, CANCEL_WITHIN_S))
        assert run.state is not None and run.state.is_cancelled(), (
            f"run is {run.state.type if run.state else None} {CANCEL_WITHIN_S:.0f} s after "
            f"the alert\nworker log:\n{log_tail(prefect_api.root / 'worker.log')}"
        )
        steps = (prefect_api.root / "runs" / "alert-cancel" / "metrics.jsonl").read_text()
        assert len(steps.splitlines()) < 40
        # 3. Nothing of the run is left: the flow process, Ray's helpers and workers.
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while (left := _marked_pids(marker)) and time.monotonic() < deadline:
            time.sleep(1.0)
        assert not left, "left behind:\n" + "\n".join(f"{p} {_cmdline(p)}" for p in left)
    finally:
        with get_client(sync_client=True) as client:
            client.delete_automation(automation_id)
            if run_id is not None:
                run = client.read_flow_run(run_id)
                if run.state is not None and not run.state.is_final():
                    from prefect.states import Cancelling

                    client.set_flow_run_state(run_id, Cancelling(), force=True)
                    asyncio.run(_wait_state(run_id, CANCEL_WITHIN_S))
