"""Deployments and schedules of ppoflow's flows, declared in ``prefect.yaml``.

    ppoflow deploy   # deploy_all(): validate every preset, create the process work pool if it is
                     # missing, register every deployment on the Prefect server (PREFECT_API_URL)
    prefect worker start --pool ppoflow-process   # then runs them
    ppoflow serve    # serve_all(): serve them from this process instead (no work pool, no worker)

``prefect.yaml`` is the one source of truth: deployment names are parameter presets
(``nightly-grpo``, ``weekly-ppo``, ``tiny-smoke``, ...), each with its schedules and a
``{"config": {...}}`` parameter validated by ``TrainConfig`` before anything is registered. The
registered deployments keep ``enforce_parameter_schema``, so the server also refuses a run whose
parameters break the schema, and the flow refuses the cross-field checks before any work.
"""

from __future__ import annotations

import datetime
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from infra.config import ConfigError, build_config

if TYPE_CHECKING:
    from prefect import Flow
    from prefect.deployments.runner import RunnerDeployment
    from prefect.schedules import Schedule

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PREFECT_YAML = REPO_ROOT / "prefect.yaml"


class DeploymentError(ValueError):
    """``prefect.yaml`` is invalid or names something that does not exist; says which entry."""


class ScheduleSpec(BaseModel):
    """One schedule of a deployment: a cron string or an interval in seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cron: str | None = Field(None, description="Cron string, e.g. '0 2 * * *'.")
    interval: float | None = Field(None, gt=0, description="Seconds between runs.")
    timezone: str | None = Field(None, description="IANA time zone of the cron string.")
    active: bool = Field(True, description="False registers the schedule paused.")

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleSpec:
        if (self.cron is None) == (self.interval is None):
            raise ValueError("give exactly one of 'cron' or 'interval'")
        self.to_schedule()  # Prefect checks the cron string
        return self

    def to_schedule(self) -> Schedule:
        from prefect.schedules import Cron, Interval

        if self.cron is not None:
            return Cron(self.cron, timezone=self.timezone, active=self.active)
        assert self.interval is not None
        return Interval(
            datetime.timedelta(seconds=self.interval), timezone=self.timezone, active=self.active
        )


class WorkPoolSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Work pool name; created as a 'process' pool when missing.")
    work_queue_name: str | None = Field(None, description="Queue in the pool (None = default).")
    job_variables: dict[str, Any] = Field(default_factory=dict)


class DeploymentSpec(BaseModel):
    """One entry of ``deployments:`` in prefect.yaml (the keys ppoflow uses)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="Deployment name = the parameter preset's name.")
    entrypoint: str = Field(description="'path/to/file.py:flow_function', relative to the file.")
    description: str | None = None
    tags: list[str] = Field(default_factory=list)
    version: str | None = None
    concurrency_limit: int | None = Field(
        None, ge=1, description="Runs at a time (1: one run_dir)."
    )
    work_pool: WorkPoolSpec | None = None
    schedules: list[ScheduleSpec] | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)

    @property
    def module_and_function(self) -> tuple[str, str]:
        """``flows/train.py:ppo_train`` → ``("flows.train", "ppo_train")``."""
        path, sep, func = self.entrypoint.partition(":")
        if not sep or not path.endswith(".py"):
            raise DeploymentError(
                f"deployment {self.name!r}: entrypoint {self.entrypoint!r} must look like "
                "'flows/train.py:ppo_train'"
            )
        return path[: -len(".py")].replace("/", "."), func

    @property
    def prefect_schedules(self) -> list[Schedule]:
        return [s.to_schedule() for s in self.schedules or []]


def check_parameters(spec: DeploymentSpec) -> None:
    """Validate a preset's ``{"config": {...}}`` with TrainConfig; the error names the field."""
    extra = set(spec.parameters) - {"config"}
    if extra:
        raise DeploymentError(
            f"deployment {spec.name!r}: parameters {sorted(extra)} are not flow parameters; "
            "ppoflow flows take one parameter, 'config' (a TrainConfig mapping)"
        )
    try:
        build_config(spec.parameters.get("config") or {})
    except ConfigError as exc:
        raise DeploymentError(f"deployment {spec.name!r}: parameters.config: {exc}") from None


def read_prefect_yaml(
    path: str | Path = DEFAULT_PREFECT_YAML, names: Sequence[str] | None = None
) -> list[DeploymentSpec]:
    """Parse and validate ``deployments:`` (all, or those named), presets included."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise DeploymentError(f"{path}: cannot read it: {exc}") from None
    specs: list[DeploymentSpec] = []
    for i, entry in enumerate(data.get("deployments") or []):
        label = entry.get("name", f"#{i}") if isinstance(entry, dict) else f"#{i}"
        try:
            spec = DeploymentSpec.model_validate(entry)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<entry>'}: {err['msg']}"
                for err in exc.errors()
            )
            raise DeploymentError(f"{path}: deployment {label!r}: {problems}") from None
        check_parameters(spec)
        specs.append(spec)
    known = [s.name for s in specs]
    if len(set(known)) != len(known):
        raise DeploymentError(f"{path}: deployment names repeat: {known}")
    if names:
        missing = sorted(set(names) - set(known))
        if missing:
            raise DeploymentError(f"{path}: no deployment named {missing}; there are {known}")
        specs = [s for s in specs if s.name in names]
    if not specs:
        raise DeploymentError(f"{path}: no deployments to register")
    return specs


def ensure_work_pool(name: str) -> bool:
    """Create a 'process' work pool called ``name`` if the server has none; True if created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return False
        except ObjectNotFound:
            pass
        template = ProcessWorker.get_default_base_job_template()
        try:
            client.create_work_pool(
                WorkPoolCreate(name=name, type="process", base_job_template=template)
            )
        except ObjectAlreadyExists:  # created concurrently: fine
            return False
        return True


def deploy_all(
    prefect_yaml: str | Path = DEFAULT_PREFECT_YAML, names: Sequence[str] | None = None
) -> dict[str, UUID]:
    """Register the deployments of ``prefect_yaml`` (all, or those named) on the Prefect server.

    1. Read and validate every entry and preset first: nothing is registered if one is bad.
    2. Create each named work pool that is missing (type 'process').
    3. ``flow.from_source(<folder of prefect.yaml>, entrypoint).deploy(...)``: the worker then
       runs the flow in that folder (a ``set_working_directory`` pull step).
    Returns ``{"<flow>/<deployment>": deployment id}``.
    """
    from prefect import Flow

    path = Path(prefect_yaml).resolve()
    specs = read_prefect_yaml(path, names)
    for spec in specs:
        if spec.work_pool is None:
            raise DeploymentError(
                f"deployment {spec.name!r} has no work_pool: `ppoflow deploy` needs one "
                "(or use `ppoflow serve`, which needs none)"
            )
    for pool in sorted({s.work_pool.name for s in specs if s.work_pool is not None}):
        ensure_work_pool(pool)
    ids: dict[str, UUID] = {}
    for spec in specs:
        assert spec.work_pool is not None
        # Both calls are sync here (Prefect dispatches on the caller's context).
        flow_obj = cast(
            "Flow[..., Any]",
            Flow.from_source(source=str(path.parent), entrypoint=spec.entrypoint),
        )
        deployment_id = flow_obj.deploy(
            name=spec.name,
            work_pool_name=spec.work_pool.name,
            work_queue_name=spec.work_pool.work_queue_name,
            job_variables=spec.work_pool.job_variables or None,
            schedules=spec.prefect_schedules,
            concurrency_limit=spec.concurrency_limit,
            parameters=spec.parameters,
            description=spec.description,
            tags=spec.tags,
            version=spec.version,
            build=False,
            push=False,
            print_next_steps=False,
            ignore_warnings=True,
        )
        ids[f"{flow_obj.name}/{spec.name}"] = cast(UUID, deployment_id)
    return ids


def load_flow(spec: DeploymentSpec) -> Flow[..., Any]:
    """Import the flow object named by ``spec.entrypoint`` (a module of this package)."""
    from prefect import Flow

    module, func = spec.module_and_function
    try:
        obj = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        raise DeploymentError(
            f"deployment {spec.name!r}: cannot load {spec.entrypoint!r}: {exc}"
        ) from exc
    if not isinstance(obj, Flow):
        raise DeploymentError(f"deployment {spec.name!r}: {spec.entrypoint!r} is not a flow")
    return obj


def runner_deployments(specs: Sequence[DeploymentSpec]) -> list[RunnerDeployment]:
    """The served form of ``specs``: same names, parameters, schedules; no work pool."""
    return [
        cast(
            "RunnerDeployment",
            load_flow(spec).to_deployment(
                name=spec.name,
                schedules=spec.prefect_schedules,
                concurrency_limit=spec.concurrency_limit,
                parameters=spec.parameters,
                description=spec.description,
                tags=spec.tags,
                version=spec.version,
            ),
        )
        for spec in specs
    ]


def serve_all(
    names: list[str] | None = None,
    *,
    prefect_yaml: str | Path = DEFAULT_PREFECT_YAML,
    limit: int | None = None,
) -> None:
    """Serve the deployments of ``prefect_yaml`` (all, or those named) until interrupted.

    Runs start as subprocesses of this one when their schedule fires or when someone asks
    (``run_deployment``, the UI, ``prefect deployment run``); ``limit`` caps concurrent runs.
    """
    from prefect import serve

    serve(*runner_deployments(read_prefect_yaml(prefect_yaml, names)), limit=limit)
