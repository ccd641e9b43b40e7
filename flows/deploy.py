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
Without a ``./prefect.yaml`` the one shipped with the package (``infra/prefect.yaml``, module
entrypoints such as ``flows.train.ppo_train``) is used, and its runs work in the current folder.

A run's ``config`` is a partial TrainConfig laid over its deployment's preset field by field
(``effective_config``): Prefect itself replaces a parameter whole, so without this a run that sets
``trainer.total_steps`` would lose the preset's ``name``, ``run_dir`` and every other section.
Flow runs are named after the config and the steps they will run (``flow_run_name``), e.g.
``tiny-smoke[steps 2-3]``.
"""

from __future__ import annotations

import datetime
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from flows.checkpoint import latest_checkpoint, read_state
from infra.config import ConfigError, TrainConfig, _merge, build_config

if TYPE_CHECKING:
    from prefect import Flow
    from prefect.deployments.runner import RunnerDeployment
    from prefect.schedules import Schedule

PREFECT_YAML = "prefect.yaml"
# Shipped in the wheel (package data of ``infra``); a checkout's ./prefect.yaml links to it.
PACKAGED_PREFECT_YAML = Path(__file__).resolve().parents[1] / "infra" / PREFECT_YAML


class DeploymentError(ValueError):
    """``prefect.yaml`` is invalid or names something that does not exist; says which entry."""


def split_entrypoint(entrypoint: str) -> tuple[str, str]:
    """``flows.train.ppo_train`` or ``flows/train.py:ppo_train`` → ``("flows.train", "ppo_train")``."""
    path, colon, func = entrypoint.rpartition(":")
    if colon and path.endswith(".py") and func:
        return path[: -len(".py")].replace("/", "."), func
    module, dot, func = entrypoint.rpartition(".")
    if not colon and dot and module and func:
        return module, func
    raise ValueError(
        f"{entrypoint!r} must look like 'flows.train.ppo_train' (a module) or "
        "'flows/train.py:ppo_train' (a file); Prefect reads 'module:function' as a file path"
    )


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
    entrypoint: str = Field(
        description=(
            "'flows.train.ppo_train' (a module of an installed package) or "
            "'flows/train.py:ppo_train' (a file, relative to prefect.yaml's folder)."
        )
    )
    description: str | None = None
    tags: list[str] = Field(default_factory=list)
    version: str | None = None
    concurrency_limit: int | None = Field(
        None, ge=1, description="Runs at a time (1: one run_dir)."
    )
    work_pool: WorkPoolSpec | None = None
    schedules: list[ScheduleSpec] | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, entrypoint: str) -> str:
        split_entrypoint(entrypoint)
        return entrypoint

    @property
    def module_and_function(self) -> tuple[str, str]:
        return split_entrypoint(self.entrypoint)

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


def resolve_prefect_yaml(path: str | Path | None = None) -> Path:
    """The deployments file: ``path`` when given; ``./prefect.yaml`` when it exists (a bare
    ``prefect.yaml`` too), else the one shipped with the package."""
    if path is not None and Path(path) != Path(PREFECT_YAML):
        return Path(path)
    local = Path(PREFECT_YAML)
    return local if local.is_file() else PACKAGED_PREFECT_YAML


def working_folder(prefect_yaml: Path) -> Path:
    """Where deployed runs work (relative run_dir and assets_dir resolve here): the folder of
    the user's prefect.yaml, or the current folder for the packaged one."""
    if prefect_yaml.absolute() == PACKAGED_PREFECT_YAML:  # a checkout's link is not it
        return Path.cwd()
    return prefect_yaml.absolute().parent


def read_prefect_yaml(
    path: str | Path | None = None, names: Sequence[str] | None = None
) -> list[DeploymentSpec]:
    """Parse and validate ``deployments:`` (all, or those named), presets included."""
    path = resolve_prefect_yaml(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise DeploymentError(
            f"{path}: cannot read it ({exc.strerror}); give another with --prefect-yaml PATH"
        ) from None
    except yaml.YAMLError as exc:
        raise DeploymentError(f"{path}: not valid YAML: {str(exc).splitlines()[0]}") from None
    specs: list[DeploymentSpec] = []
    for i, entry in enumerate(data.get("deployments") or []):
        label = entry.get("name", f"#{i}") if isinstance(entry, dict) else f"#{i}"
        try:
            spec = DeploymentSpec.model_validate(entry)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<entry>'}: "
                f"{str(err['msg']).removeprefix('Value error, ')}"
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
    prefect_yaml: str | Path | None = None, names: Sequence[str] | None = None
) -> dict[str, UUID]:
    """Register the deployments of ``prefect_yaml`` (all, or those named) on the Prefect server.

    1. Read and validate every entry and preset first: nothing is registered if one is bad.
    2. Create each named work pool that is missing (type 'process').
    3. ``flow.from_source(<working folder>, entrypoint).deploy(...)``: the worker then runs
       the flow in that folder (a ``set_working_directory`` pull step; see ``working_folder``).
    Returns ``{"<flow>/<deployment>": deployment id}``.
    """
    from prefect import Flow

    path = resolve_prefect_yaml(prefect_yaml)
    specs = read_prefect_yaml(path, names)
    folder = working_folder(path)
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
            Flow.from_source(source=str(folder), entrypoint=spec.entrypoint),
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
    prefect_yaml: str | Path | None = None,
    limit: int | None = None,
) -> None:
    """Serve the deployments of ``prefect_yaml`` (all, or those named) until interrupted.

    Runs start as subprocesses of this one when their schedule fires or when someone asks
    (``run_deployment``, the UI, ``prefect deployment run``); ``limit`` caps concurrent runs.
    """
    from prefect import serve

    serve(*runner_deployments(read_prefect_yaml(prefect_yaml, names)), limit=limit)


# ---------------------------------------------------------------------- inside a flow run
def deployment_preset() -> dict[str, Any] | None:
    """The ``config`` parameter of the deployment this flow run was created from, read from the
    server; None outside a flow run, for a run of no deployment, or a deployment without one.

    ``prefect.runtime.deployment.parameters`` is not it: that is the run's own parameters."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx is not None else None
    if run is None or run.deployment_id is None:
        return None
    with get_client(sync_client=True) as client:
        preset = client.read_deployment(run.deployment_id).parameters.get("config")
    return preset if isinstance(preset, dict) else None


def effective_tree(config: TrainConfig) -> dict[str, Any] | None:
    """The fields ``config`` set explicitly laid over its deployment's preset, section by
    section, not validated yet; None outside a deployment run."""
    preset = deployment_preset()
    if preset is None:
        return None
    return _merge(preset, config.model_dump(mode="json", exclude_unset=True))


def effective_config(config: TrainConfig) -> TrainConfig:
    """``config`` laid over its deployment's preset (``effective_tree``) and validated again:
    every field the run did not set keeps the preset's value. Outside a deployment run
    ``config`` is returned as is. Raises ConfigError when the merge is invalid."""
    tree = effective_tree(config)
    return config if tree is None else build_config(tree)


def planned_steps(cfg: TrainConfig) -> range:
    """The steps a flow run of ``cfg`` will run, chosen as ``flows.loop.Trainer.run`` does: from
    the step after the latest checkpoint in run_dir (``trainer.resume='auto'``), at most
    ``trainer.steps_per_run`` of them, never past ``trainer.total_steps``."""
    ckpt = latest_checkpoint(cfg.resolved_run_dir) if cfg.trainer.resume == "auto" else None
    first = 0 if ckpt is None else read_state(ckpt).step + 1
    per_run, total = cfg.trainer.steps_per_run, cfg.trainer.total_steps
    return range(first, total if per_run is None else min(total, first + per_run))


def run_name(cfg: TrainConfig, steps: range) -> str:
    """``tiny-smoke[steps 2-3]``, ``tiny-smoke[step 3]``, ``tiny-smoke[all 4 steps done]``."""
    if not steps:
        return f"{cfg.name}[all {cfg.trainer.total_steps} steps done]"
    if len(steps) == 1:
        return f"{cfg.name}[step {steps[0]}]"
    return f"{cfg.name}[steps {steps[0]}-{steps[-1]}]"


def flow_run_name() -> str:
    """The training flow's run name, for ``@flow(flow_run_name=flow_run_name)``: the effective
    config's name and planned steps. A config the merge refuses names the run
    ``<name>[invalid config]``; the flow body then fails with the ConfigError."""
    from prefect.runtime import flow_run

    config = flow_run.parameters.get("config")
    if not isinstance(config, TrainConfig):  # validated before naming: a TrainConfig
        return "ppo-train[invalid config]"
    tree = effective_tree(config)
    try:
        cfg = config if tree is None else build_config(tree)
    except ConfigError:
        assert tree is not None  # only the merge is validated here
        return f"{tree.get('name', config.name)}[invalid config]"
    try:
        steps = planned_steps(cfg)
    except (OSError, ValueError):  # an unreadable checkpoint state: the flow body reports it
        return f"{cfg.name}[steps ?]"
    return run_name(cfg, steps)
