"""prefect.yaml, ``ppoflow deploy`` and ``ppoflow serve`` (flows/deploy.py).

Fast tier: the presets validate against TrainConfig, and a bad preset fails before anything is
registered, naming the field. Slow tier (a real local Prefect server, see conftest.py): the
deployments, work pool and schedules land on the server; a tiny run goes through the process
work pool and its task runs, artifacts and events read back through the API; a bad run
parameter is refused naming the field; a run that sets one field keeps the rest of its
deployment's preset (Prefect alone would replace the whole config); a served deployment's 5 s
interval schedule fires on its own and that run resumes the first run's checkpoint. Flow runs are
named after the config and their steps (``tiny-smoke[steps 0-1]``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import pytest
import yaml
from server import (
    REPO,
    RUN_TIMEOUT_S,
    TINY_PRESET,
    LocalServer,
    TinyRun,
    log_tail,
    wait_flow_run,
)

from flows.deploy import DeploymentError, deploy_all, read_prefect_yaml
from infra.config import build_config, load_config

STAGES = ("generate", "score", "logprobs", "advantage", "update")
ITERATION_EVENT = "ppoflow.iteration.completed"


def recorded_task_runs(
    client: Any, run_id: UUID, expected: set[str], timeout_s: float = 60
) -> list:
    """The flow run's task runs once every ``expected`` name is recorded in a final state (or the
    timeout ends): the server records task runs from events it processes after the run ends."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout_s
    while True:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])), limit=200
        )
        final = {t.name for t in runs if t.state is not None and t.state.is_final()}
        if expected <= final or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def stage_names(steps: Iterable[int]) -> set[str]:
    return {f"{stage}[step={s}]" for stage in STAGES for s in steps}


def metrics_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]


# ---------------------------------------------------------------------- fast tier
def test_presets_validate_and_scheduled_ones_continue_one_run() -> None:
    specs = {s.name: s for s in read_prefect_yaml(REPO / "prefect.yaml")}
    assert {"nightly-grpo", "weekly-ppo", "tiny-smoke", "weekly-reward-model"} <= set(specs)
    for spec in specs.values():
        cfg = build_config(spec.parameters["config"])
        assert spec.work_pool is not None and spec.work_pool.name == "ppoflow-process"
        if spec.schedules and spec.entrypoint.endswith(":ppo_train"):
            # A schedule continues one run: fixed run_dir, resume, a step budget per run.
            assert cfg.run_dir is not None and cfg.trainer.resume == "auto"
            assert cfg.trainer.steps_per_run is not None
            assert all(s.cron for s in spec.schedules)
    # The smoke preset is configs/tiny.yaml in two halves of 2 steps.
    tiny = build_config(specs["tiny-smoke"].parameters["config"])
    expected = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            "name=tiny-smoke",
            "run_dir=runs/tiny-smoke",
            "trainer.total_steps=4",
            "trainer.steps_per_run=2",
            "trainer.resume=auto",
        ],
    )
    assert tiny == expected


def _write_yaml(path: Path, config: dict[str, Any], **extra: Any) -> Path:
    entry = {
        "name": "bad",
        "entrypoint": "flows/train.py:ppo_train",
        "work_pool": {"name": "ppoflow-process"},
        "parameters": {"config": config},
        **extra,
    }
    path.write_text(yaml.safe_dump({"deployments": [entry]}))
    return path


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"trainer": {"total_steps": 0}}, "trainer.total_steps"),
        ({"trainer": {"totl_steps": 5}}, "trainer.totl_steps"),
        (
            {"algorithm": {"filter_groups": {"enabled": True, "metric": "nope"}}},
            "algorithm.filter_groups.metric",
        ),
    ],
)
def test_bad_preset_fails_before_registering(
    tmp_path: Path, config: dict[str, Any], field: str
) -> None:
    # deploy_all validates everything before it talks to a server (there is none here).
    with pytest.raises(DeploymentError, match=r"deployment 'bad'") as err:
        deploy_all(_write_yaml(tmp_path / "prefect.yaml", config))
    assert field in str(err.value)


def test_bad_schedule_is_named(tmp_path: Path) -> None:
    path = _write_yaml(tmp_path / "prefect.yaml", {}, schedules=[{"cron": "every night"}])
    with pytest.raises(DeploymentError, match=r"deployment 'bad': schedules\.0"):
        read_prefect_yaml(path)


# ---------------------------------------------------------------------- against a server
@pytest.mark.slow
def test_deploy_registers_pool_deployments_and_schedules(
    prefect_api: LocalServer, deployed: dict[str, UUID]
) -> None:
    from prefect.client.orchestration import get_client

    specs = read_prefect_yaml(REPO / "prefect.yaml")
    assert {name.split("/")[1] for name in deployed} == {s.name for s in specs}
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("ppoflow-process")
        assert pool.type == "process"
        for spec in specs:
            flow = "reward-model" if "reward_model" in spec.entrypoint else "ppo-train"
            dep = client.read_deployment_by_name(f"{flow}/{spec.name}")
            assert dep.id == deployed[f"{flow}/{spec.name}"]
            assert dep.work_pool_name == "ppoflow-process"
            assert dep.parameters == spec.parameters
            assert dep.enforce_parameter_schema
            assert "config" in dep.parameter_openapi_schema["properties"]
            assert sorted(s.schedule.cron for s in dep.schedules) == sorted(
                s.cron for s in spec.schedules or []
            )
            assert dep.global_concurrency_limit is not None
            assert dep.global_concurrency_limit.limit == spec.concurrency_limit
            # The worker runs the flow in the folder of prefect.yaml.
            assert dep.pull_steps == [
                {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
            ]
    # Deploying again updates in place.
    assert deploy_all(REPO / "prefect.yaml", names=["weekly-ppo"]) == {
        "ppo-train/weekly-ppo": deployed["ppo-train/weekly-ppo"]
    }


async def _events(url: str, run_name: str, want: int, timeout_s: float) -> list[dict[str, Any]]:
    """Poll ``/api/events/filter`` until ``want`` iteration events of the run arrived."""
    body = {
        "filter": {
            "event": {"name": [ITERATION_EVENT]},
            "resource": {"id": [f"ppoflow.run.{run_name}"]},
            "occurred": {"since": "2000-01-01T00:00:00Z"},
        },
        "limit": 50,
    }
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            resp = await http.post(f"{url}/events/filter", json=body)
            resp.raise_for_status()
            events: list[dict[str, Any]] = resp.json()["events"]
            if len(events) >= want or time.monotonic() > deadline:
                return events
            await asyncio.sleep(0.5)


@pytest.mark.slow
def test_tiny_run_through_the_work_pool(prefect_api: LocalServer, tiny_run: TinyRun) -> None:
    from prefect.artifacts import Artifact
    from prefect.client.orchestration import get_client

    run_id = tiny_run.flow_run.id
    assert tiny_run.flow_run.state.is_completed()
    # 1. One task run per stage per step, for the first half (steps 0 and 1) only.
    with get_client(sync_client=True) as client:
        task_runs = recorded_task_runs(client, run_id, stage_names(range(2)))
    names = {t.name for t in task_runs}
    assert stage_names(range(2)) <= names
    assert not stage_names([2]) & names  # (validate[step=2] is the evaluation after step 1)
    assert all(t.state is not None and t.state.is_completed() for t in task_runs)
    # 2. The metrics table artifact holds a row per step; progress says half done.
    table = Artifact.get(f"{tiny_run.run_name}-metrics")
    assert table is not None and table.flow_run_id == run_id and table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["critic/score/mean"] is not None for r in rows)
    progress = Artifact.get(f"{tiny_run.run_name}-progress")
    assert progress is not None and float(progress.data) == pytest.approx(50.0)
    assert Artifact.get(f"{tiny_run.run_name}-summary") is not None
    # 3. One iteration event per step, carrying the metrics.
    events = asyncio.run(_events(prefect_api.url, tiny_run.run_name, 2, timeout_s=30))
    assert sorted(e["payload"]["step"] for e in events) == [0, 1]
    assert all("critic/score/mean" in e["payload"]["metrics"] for e in events)
    # 4. On disk: metrics and the checkpoint the next run resumes from.
    assert metrics_steps(tiny_run.run_dir) == [0, 1]
    assert (tiny_run.run_dir / "checkpoints" / "step-000001" / "state.json").exists()
    # 5. Named after the config and the steps it ran.
    assert tiny_run.flow_run.name == "tiny-smoke[steps 0-1]"


def _copy_after_step_1(run_dir: Path, to: Path) -> Path:
    """The first tiny run's folder as it was after step 1 (warm start, step-1 checkpoint)."""
    keep = {"step-000001"}
    shutil.copytree(
        run_dir,
        to,
        ignore=lambda d, names: [n for n in names if n.startswith("step-") and n not in keep],
    )
    metrics = to / "metrics.jsonl"
    rows = [line for line in metrics.read_text().splitlines() if line.strip()]
    metrics.write_text("".join(f"{r}\n" for r in rows if json.loads(r)["step"] <= 1))
    return to


@pytest.mark.slow
def test_run_setting_one_field_keeps_the_deployment_preset(
    prefect_api: LocalServer,
    tiny_run: TinyRun,
    pool_worker: subprocess.Popen[bytes],
    tmp_path: Path,
) -> None:
    """A deployment (module entrypoint, its own folder) whose preset continues a copy of the
    first run; a run of it that sends only ``trainer.total_steps`` runs that preset, one step."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    run_dir = _copy_after_step_1(tiny_run.run_dir, tmp_path / "runs" / "tiny-smoke")
    preset = {**tiny_run.parameters["config"], "run_dir": str(run_dir)}
    served = yaml.safe_load((REPO / "prefect.yaml").read_text())
    (entry,) = [d for d in served["deployments"] if d["name"] == TINY_PRESET]
    entry.update(name="tiny-override", parameters={"config": preset})
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump({"deployments": [entry]}))
    assert entry["entrypoint"] == "flows.train.ppo_train"
    deploy_all(tmp_path / "prefect.yaml")
    override = {"config": {"trainer": {"total_steps": 3}}}
    created = run_deployment("ppo-train/tiny-override", parameters=override, timeout=0)
    run = asyncio.run(wait_flow_run(created.id, RUN_TIMEOUT_S))
    assert run.state.is_completed(), (
        f"{run.state.message}\n{log_tail(prefect_api.root / 'worker.log')}"
    )
    # 1. The server keeps the run's parameters as sent: they replace the preset's config whole.
    assert run.parameters == override
    # 2. The flow ran the preset with that one field changed (its run_dir/config.yaml).
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key in ("name", "run_dir", "rollout", "warmstart", "actor", "models"):
        assert ran[key] == build_config(preset).model_dump(mode="json")[key], key
    assert ran["trainer"] == {
        **build_config(preset).model_dump(mode="json")["trainer"],
        "total_steps": 3,
    }
    # 3. It resumed after step 1 and stopped at the new total: step 2 only, named so.
    assert metrics_steps(run_dir) == [0, 1, 2]
    assert run.name == "tiny-smoke[step 2]"
    with get_client(sync_client=True) as client:
        names = {t.name for t in recorded_task_runs(client, run.id, stage_names(range(2, 3)))}
    assert stage_names(range(2, 3)) <= names and not stage_names([3]) & names


@pytest.mark.slow
def test_bad_run_parameter_is_refused_naming_the_field(
    prefect_api: LocalServer, deployed: dict[str, UUID], pool_worker: subprocess.Popen[bytes]
) -> None:
    from prefect.client.orchestration import get_client

    dep_id = deployed[f"ppo-train/{TINY_PRESET}"]
    # 1. The server checks the schema generated from TrainConfig: refused at creation.
    with get_client(sync_client=True) as client, pytest.raises(Exception) as err:
        client.create_flow_run_from_deployment(
            dep_id, parameters={"config": {"trainer": {"total_steps": 0}}}
        )
    assert "total_steps" in str(err.value)
    # 2. A cross-field rule passes the schema and fails the run before any work, named.
    bad = {"config": {"algorithm": {"filter_groups": {"enabled": True, "metric": "nope"}}}}
    with get_client(sync_client=True) as client:
        created = client.create_flow_run_from_deployment(dep_id, parameters=bad)
    run = asyncio.run(wait_flow_run(created.id, timeout_s=300))
    assert run.state.is_failed(), run.state
    assert "algorithm.filter_groups.metric" in (run.state.message or ""), run.state.message


@pytest.mark.slow
def test_served_interval_schedule_fires_and_resumes(
    prefect_api: LocalServer, tiny_run: TinyRun, tmp_path: Path
) -> None:
    """``ppoflow serve`` of the tiny preset on a 5 s interval: the run the schedule starts on its
    own continues the first run (same run_dir) at step 2, after the step-1 checkpoint."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    served = yaml.safe_load((REPO / "prefect.yaml").read_text())
    (entry,) = [d for d in served["deployments"] if d["name"] == TINY_PRESET]
    entry.update(
        name="tiny-interval",
        parameters=tiny_run.parameters,
        schedules=[{"interval": 5}],
    )
    path = tmp_path / "prefect.yaml"
    path.write_text(yaml.safe_dump({"deployments": [entry]}))
    code = f"from flows.deploy import serve_all; serve_all(prefect_yaml={str(path)!r}, limit=1)"
    with prefect_api.start([sys.executable, "-c", code], "serve.log"):
        deadline = time.monotonic() + RUN_TIMEOUT_S
        finished = None
        with get_client(sync_client=True) as client:
            while finished is None:
                runs = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(
                        name=DeploymentFilterName(any_=["tiny-interval"])
                    ),
                    sort=FlowRunSort.EXPECTED_START_TIME_ASC,
                    limit=20,
                )
                finished = next((r for r in runs if r.state and r.state.is_final()), None)
                assert time.monotonic() < deadline, log_tail(prefect_api.root / "serve.log")
                time.sleep(1.0)
            dep = client.read_deployment_by_name("ppo-train/tiny-interval")
            client.pause_deployment(dep.id)
            assert finished.state.is_completed(), (
                f"{finished.state.message}\n{log_tail(prefect_api.root / 'serve.log')}"
            )
            assert finished.auto_scheduled  # created by the schedule, not by this test
            assert finished.name == "tiny-smoke[steps 2-3]"
            task_runs = recorded_task_runs(client, finished.id, stage_names(range(2, 4)))
    names = {t.name for t in task_runs}
    assert stage_names(range(2, 4)) <= names
    assert not any(f"[step={s}]" in n for s in (0, 1) for n in names)
    assert metrics_steps(tiny_run.run_dir) == [0, 1, 2, 3]
    assert (tiny_run.run_dir / "checkpoints" / "step-000003" / "state.json").exists()
