"""flows/deploy.py without a server process: run config merged over a deployment's preset, flow
run names, which prefect.yaml is read, and the wheel (presets and prefect.yaml shipped, module
entrypoints loadable from the installed package).

The merge tests run a probe flow from a real deployment on the Prefect test harness, in this
process, the way a worker's ``python -m prefect.engine`` does (``run_flow`` of a flow run created
from the deployment).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect import flow

from flows.checkpoint import STATE, RunState, checkpoint_dir
from flows.deploy import (
    PACKAGED_PREFECT_YAML,
    DeploymentError,
    effective_config,
    flow_run_name,
    planned_steps,
    read_prefect_yaml,
    resolve_prefect_yaml,
    run_name,
    working_folder,
)
from infra.config import TrainConfig, build_config, load_config

REPO = Path(__file__).resolve().parents[2]


@flow(name="deploy-probe", flow_run_name=flow_run_name)
def probe(config: TrainConfig = TrainConfig()) -> dict[str, Any]:  # noqa: B008 - the form's default
    """What ppo_train's first line sees: the effective config, as JSON."""
    return effective_config(config).model_dump(mode="json")


def tiny_preset(run_dir: Path) -> dict[str, Any]:
    """The tiny-smoke preset of prefect.yaml, its run_dir moved under the test's folder."""
    (spec,) = read_prefect_yaml(REPO / "prefect.yaml", ["tiny-smoke"])
    return {**spec.parameters["config"], "run_dir": str(run_dir)}


def fake_checkpoint(run_dir: Path, step: int) -> None:
    """A complete checkpoint as far as resume's choice of step is concerned: its state.json."""
    path = checkpoint_dir(run_dir, step)
    path.mkdir(parents=True)
    state = RunState(step=step, data={}, kl={}, submitted={}, produced={})
    (path / STATE).write_text(json.dumps(state.to_json()))


def run_from_deployment(preset: dict[str, Any], run_parameters: dict[str, Any]) -> Any:
    """Create a deployment of ``probe`` with ``preset``, a flow run of it with
    ``run_parameters``, run that flow run here; return (stored flow run, its final state)."""
    from prefect.client.orchestration import get_client
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as client:
        deployment_id = client.create_deployment(
            flow_id=client.create_flow(probe),
            name=f"preset-{uuid.uuid4().hex[:8]}",
            entrypoint="tests/flows/test_deploy_on_cpu.py:probe",
            parameters={"config": preset},
        )
        created = client.create_flow_run_from_deployment(deployment_id, parameters=run_parameters)
        state = run_flow(probe, flow_run=client.read_flow_run(created.id), return_type="state")
        return client.read_flow_run(created.id), state


# ---------------------------------------------------------------------- merge and names
def test_run_parameters_keep_only_the_fields_the_run_set() -> None:
    # Prefect validates a run's parameters into a TrainConfig; pydantic remembers what was given.
    params = probe.validate_parameters({"config": {"trainer": {"total_steps": 5}}})
    assert params["config"].model_dump(mode="json", exclude_unset=True) == {
        "trainer": {"total_steps": 5}
    }


def test_effective_config_outside_a_deployment_is_the_config() -> None:
    cfg = build_config({"name": "plain", "trainer": {"total_steps": 3}})
    assert effective_config(cfg) is cfg


def test_deployment_run_keeps_the_preset_under_one_override(
    prefect_harness: None, tmp_path: Path
) -> None:
    preset = tiny_preset(tmp_path / "run")
    fake_checkpoint(tmp_path / "run", 1)
    run, state = run_from_deployment(preset, {"config": {"trainer": {"total_steps": 3}}})
    # 1. The server replaced the preset's config whole: Prefect merges one level deep.
    assert run.parameters == {"config": {"trainer": {"total_steps": 3}}}
    # 2. The flow sees the preset with the one field changed.
    assert state.is_completed(), state.message
    expected = build_config({**preset, "trainer": {**preset["trainer"], "total_steps": 3}})
    assert state.result() == expected.model_dump(mode="json")
    assert expected.name == "tiny-smoke" and expected.rollout.n == 4
    # 3. Named after the preset's name; resumes after step 1; the new total ends it at step 2.
    assert run.name == "tiny-smoke[step 2]"


def test_deployment_run_without_parameters_is_the_preset(
    prefect_harness: None, tmp_path: Path
) -> None:
    preset = tiny_preset(tmp_path / "run")
    run, state = run_from_deployment(preset, {})
    assert state.is_completed(), state.message
    assert state.result() == build_config(preset).model_dump(mode="json")
    assert run.name == "tiny-smoke[steps 0-1]"


def test_merge_the_preset_refuses_fails_the_run_naming_the_field(
    prefect_harness: None, tmp_path: Path
) -> None:
    # Alone the override is valid (8 x 8 samples); over the preset's 4 x 4 samples it is not.
    preset = tiny_preset(tmp_path / "run")
    run, state = run_from_deployment(preset, {"config": {"resources": {"num_workers": 32}}})
    assert state.is_failed()
    assert "resources.num_workers=32" in str(state.result(raise_on_failure=False))
    assert run.name == "tiny-smoke[invalid config]"


@pytest.mark.parametrize(
    ("trainer", "checkpoints", "steps", "name"),
    [
        ({"total_steps": 4, "steps_per_run": 2}, [], range(0, 2), "run[steps 0-1]"),
        ({"total_steps": 4, "steps_per_run": 2}, [1], range(2, 4), "run[steps 2-3]"),
        ({"total_steps": 5, "steps_per_run": 2}, [1, 3], range(4, 5), "run[step 4]"),
        ({"total_steps": 4, "steps_per_run": 2}, [3], range(4, 4), "run[all 4 steps done]"),
        ({"total_steps": 4}, [1], range(2, 4), "run[steps 2-3]"),
        ({"total_steps": 4, "resume": "never"}, [1], range(0, 4), "run[steps 0-3]"),
    ],
)
def test_planned_steps_follow_resume_and_steps_per_run(
    tmp_path: Path, trainer: dict[str, Any], checkpoints: list[int], steps: range, name: str
) -> None:
    for step in checkpoints:
        fake_checkpoint(tmp_path, step)
    # An unfinished checkpoint (no state.json) is never resumed from.
    (tmp_path / "checkpoints" / "step-000009.tmp").mkdir(parents=True)
    cfg = build_config({"name": "run", "run_dir": str(tmp_path), "trainer": trainer})
    assert planned_steps(cfg) == steps
    assert run_name(cfg, planned_steps(cfg)) == name


# ---------------------------------------------------------------------- which prefect.yaml
def test_prefect_yaml_is_the_local_one_else_the_packaged_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_prefect_yaml() == PACKAGED_PREFECT_YAML
    assert resolve_prefect_yaml("prefect.yaml") == PACKAGED_PREFECT_YAML
    assert working_folder(resolve_prefect_yaml()) == tmp_path
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump({"deployments": []}))
    assert resolve_prefect_yaml() == Path("prefect.yaml")
    assert working_folder(resolve_prefect_yaml()) == tmp_path
    other = tmp_path / "elsewhere" / "prefect.yaml"
    assert resolve_prefect_yaml(other) == other
    assert working_folder(other) == other.parent
    # A checkout's ./prefect.yaml is a link to the packaged file; its runs work in the checkout.
    assert (REPO / "prefect.yaml").resolve() == PACKAGED_PREFECT_YAML
    assert working_folder(REPO / "prefect.yaml") == REPO


def test_module_colon_entrypoint_is_refused_naming_the_form(tmp_path: Path) -> None:
    entry = {"name": "bad", "entrypoint": "flows.train:ppo_train", "parameters": {"config": {}}}
    path = tmp_path / "prefect.yaml"
    path.write_text(yaml.safe_dump({"deployments": [entry]}))
    with pytest.raises(DeploymentError, match=r"deployment 'bad': entrypoint: .*flows\.train\.ppo"):
        read_prefect_yaml(path)


# ---------------------------------------------------------------------- the wheel
SOURCES = ("pyproject.toml", "README.md", "storage", "tasks", "flows", "infra")
CHECK_INSTALLED = """
import json, sys
from pathlib import Path
import flows
from flows.deploy import read_prefect_yaml, resolve_prefect_yaml, working_folder
from infra.config import load_config
from prefect.flows import load_flow_from_entrypoint

path = resolve_prefect_yaml()
specs = read_prefect_yaml()
print(json.dumps({
    "package": flows.__file__,
    "prefect_yaml": str(path),
    "working_folder": str(working_folder(path)),
    "flows": {s.name: load_flow_from_entrypoint(s.entrypoint).name for s in specs},
    "tiny": load_config("tiny").name,
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel --no-deps`` of a copy of the sources (the checkout gets no build folders)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(source, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*cmd, "-w", str(root / "dist"), str(src)], check=True)
    (built,) = (root / "dist").glob("ppoflow-*.whl")
    return built


def test_wheel_ships_the_presets_and_prefect_yaml(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = {p.relative_to(REPO).as_posix() for p in (REPO / "infra" / "presets").rglob("*")}
    presets = {p for p in presets if p.endswith((".yaml", ".py"))}
    assert presets and presets <= names
    assert "infra/prefect.yaml" in names


def test_installed_package_reads_its_prefect_yaml_and_loads_its_entrypoints(
    wheel: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
    subprocess.run([*cmd, str(wheel)], check=True)
    work = tmp_path / "work"  # no prefect.yaml, no checkout: only the installed package
    work.mkdir()
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    out = subprocess.run(
        [sys.executable, "-c", CHECK_INSTALLED],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["package"].startswith(str(site))
    assert seen["prefect_yaml"] == str(site / "infra" / "prefect.yaml")
    assert seen["working_folder"] == str(work)
    specs = read_prefect_yaml(PACKAGED_PREFECT_YAML)
    assert set(seen["flows"]) == {s.name for s in specs}
    assert set(seen["flows"].values()) == {"ppo-train", "reward-model"}
    assert seen["tiny"] == load_config(REPO / "infra" / "presets" / "tiny.yaml").name
