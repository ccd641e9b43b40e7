"""Experiment trackers beside ``metrics.jsonl``: TensorBoard, Weights & Biases and MLflow.

``RunReport`` (flows/report.py) writes ``metrics.jsonl`` itself and hands every logged row to the
trackers named in ``trainer.loggers``, opened here through one table (``TRACKERS``). Each
tracker is an optional extra (``pip install 'ppoflow[tensorboard]'``, ``[wandb]``,
``[mlflow]``), imported only when a run asks for it. Metric names are those of metrics.jsonl
everywhere, except where MLflow refuses a character (``mlflow_metric_name``).

Where each one writes:

- ``tensorboard``: ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>/tensorboard``).
- ``wandb``: project ``ppoflow``, run named after the ppoflow run, files under
  ``<run_dir>/wandb``; offline unless ``WANDB_MODE`` is set or an API key is configured
  (``WANDB_API_KEY`` or a netrc entry); ``wandb sync <run_dir>/wandb/offline-run-*`` uploads.
- ``mlflow``: experiment ``ppoflow``, run named after the ppoflow run, in the file store
  ``<run_dir>/mlruns`` unless ``MLFLOW_TRACKING_URI`` is set (``mlflow ui --backend-store-uri
  file:<run_dir>/mlruns``). MLflow 3 accepts a file store only with
  ``MLFLOW_ALLOW_FILE_STORE=true``, which the tracker sets for the process when it picks the
  file store (a tracking server or ``sqlite:///...`` in ``MLFLOW_TRACKING_URI`` needs none).

A resumed run (``start_step > 0``) continues the same tracker run: TensorBoard purges the
events of the interrupted attempt from ``start_step`` on, W&B and MLflow reuse the run id kept
in ``<run_dir>/wandb-run-id`` and ``<run_dir>/mlflow-run-id``.
"""

from __future__ import annotations

import netrc
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

PROJECT = "ppoflow"  # the W&B project and the MLflow experiment
WANDB_DEFAULT_BASE_URL = "https://api.wandb.ai"


class TrackerError(ValueError):
    """A tracker name that ppoflow does not know."""


class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TrackerRun:
    """What a tracker needs to know about the run it records."""

    run_dir: Path
    name: str
    start_step: int = 0  # > 0: a resumed run
    config: Mapping[str, Any] | None = None


def _run_id(path: Path, fresh: Callable[[], str], *, resumed: bool) -> tuple[str, bool]:
    """The tracker run id kept in ``path`` when resuming, else a new one; and whether it is reused."""
    if resumed and path.exists() and path.read_text().strip():
        return path.read_text().strip(), True
    run_id = fresh()
    path.write_text(run_id + "\n")
    return run_id, False


# ---------------------------------------------------------------------- TensorBoard
class TensorBoardTracker:
    """Scalars into ``<run_dir>/tensorboard`` with ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, run: TrackerRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            log_dir=str(run.run_dir / "tensorboard"),
            purge_step=run.start_step if run.start_step > 0 else None,
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# ---------------------------------------------------------------------- Weights & Biases
def _wandb_id() -> str:
    return secrets.token_hex(4)  # W&B's own run ids are 8 characters of [a-z0-9]


def wandb_has_account(env: Mapping[str, str] | None = None) -> bool:
    """An API key in ``WANDB_API_KEY`` or in the netrc entry of the W&B host."""
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY"):
        return True
    host = urlsplit(env.get("WANDB_BASE_URL", WANDB_DEFAULT_BASE_URL)).hostname
    try:
        entry = netrc.netrc(env.get("NETRC")).authenticators(host or "")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


class WandbTracker:
    """One W&B run per ppoflow run; every row is logged with its ``step`` as the x axis (so a
    resumed run that repeats steps appends instead of being dropped by W&B's own step counter)."""

    def __init__(self, run: TrackerRun) -> None:
        import wandb

        run_id, reused = _run_id(
            run.run_dir / "wandb-run-id", _wandb_id, resumed=run.start_step > 0
        )
        offline = not (os.environ.get("WANDB_MODE") or wandb_has_account())
        mode: Literal["offline"] | None = "offline" if offline else None  # None: W&B decides
        self.run = wandb.init(
            project=PROJECT,
            name=run.name,
            dir=str(run.run_dir),
            config=dict(run.config or {}),
            mode=mode,
            id=run_id,
            resume="allow" if reused else None,
            settings=wandb.Settings(console="off"),  # Prefect captures the flow's output
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({"step": step, **metrics})

    def close(self) -> None:
        self.run.finish()


# ---------------------------------------------------------------------- MLflow
_MLFLOW_REFUSED = re.compile(r"[^/\w.\- ]")  # MLflow's portable name characters, kept as they are


def mlflow_metric_name(name: str) -> str:
    """The MLflow name of a ppoflow metric: ``@`` becomes ``_at_`` (``reward/mean@1`` →
    ``reward/mean_at_1``), any other character MLflow refuses becomes ``_xHH_`` (its code in
    hex; ``:`` → ``_x3a_``). Names without such characters are unchanged."""
    name = name.replace("@", "_at_")
    return _MLFLOW_REFUSED.sub(lambda m: f"_x{ord(m.group()):02x}_", name)


class MlflowTracker:
    """One MLflow run per ppoflow run, in experiment ``ppoflow``; the config as ``config.json``."""

    def __init__(self, run: TrackerRun) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = f"file:{run.run_dir.resolve()}/mlruns"
            # MLflow 3 keeps the file store in maintenance mode and refuses it without this.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(PROJECT)
        )

        def fresh() -> str:
            created = self.client.create_run(experiment_id, run_name=run.name)
            return str(created.info.run_id)

        self.run_id, reused = _run_id(
            run.run_dir / "mlflow-run-id", fresh, resumed=run.start_step > 0
        )
        if reused:
            self.client.update_run(self.run_id, status="RUNNING")
        elif run.config is not None:
            self.client.log_dict(self.run_id, dict(run.config), "config.json")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_metric_name(k), float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


# ---------------------------------------------------------------------- the table
TRACKERS: dict[str, Callable[[TrackerRun], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}
JSONL = "jsonl"  # metrics.jsonl, written by RunReport itself


def check_names(names: Sequence[str]) -> None:
    unknown = [n for n in names if n != JSONL and n not in TRACKERS]
    if unknown:
        raise TrackerError(
            f"trainer.loggers names unknown tracker(s) {unknown}: choose from {[JSONL, *TRACKERS]}"
        )


def open_tracker(name: str, run: TrackerRun) -> Tracker:
    """The tracker ``name`` for ``run`` (``jsonl`` is not one: RunReport writes it)."""
    if name not in TRACKERS:
        raise TrackerError(
            f"trainer.loggers: {name!r} is not a tracker; choose from {list(TRACKERS)}"
        )
    return TRACKERS[name](run)
