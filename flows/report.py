"""What a user sees of a run: ``metrics.jsonl``, the experiment trackers of ``trainer.loggers``
(flows/trackers.py), Prefect artifacts (metrics table, curves, samples, progress, summary), one
Prefect event per iteration (``ppoflow.iteration.completed``) and one per alert crossing
(``ppoflow.metric.alert``, from ``trainer.alerts``).

The curves artifact is markdown holding the reward/KL/validation plot as a PNG data URI (the
Prefect UI renders ``data:image/...`` sources in markdown artifacts, and the image travels with
the server's database, unlike a link to a file on the training machine). It is refreshed with
the metrics table, at most every ``trainer.artifact_interval_s``, in place (one version). The
samples table (prompt, response, score, turns of the latest ``samples/step_<N>.jsonl``, see
flows/samples.py) is refreshed with them too, a new version when that file has changed.

Training never waits on the Prefect API: artifacts are updated by a thread of the report's own
(in the flow run's context, the latest request winning), and when the API does not answer the
report warns once, skips artifacts for ``API_BACKOFF_S`` (or the artifact interval, if longer)
and brings them up to date at the next update that gets through; ``close`` waits at most
``CLOSE_WAIT_S`` for the last one. Events are queued by Prefect and sent in the background.
"""

from __future__ import annotations

import base64
import contextvars
import json
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.events import emit_event

from flows.plot import curves_png
from flows.samples import (
    drop_samples_from,
    read_samples,
    samples_path,
    samples_table,
    saved_steps,
)
from flows.trackers import JSONL, Tracker, TrackerRun, check_names, open_tracker
from infra.config import AlertConfig

R = TypeVar("R")

ITERATION_EVENT = "ppoflow.iteration.completed"
ALERT_EVENT = "ppoflow.metric.alert"
RESTART_EVENT = "ppoflow.worker.restarted"
API_BACKOFF_S = 30.0  # how long artifacts are skipped after the Prefect API did not answer
CLOSE_WAIT_S = 30.0  # how long ``close`` waits for the last artifact update
SAMPLE_ROWS = 32  # rows of the samples artifact
TABLE_COLUMNS = (
    "step",
    "critic/score/mean",
    "eval/rule_accuracy",
    "reward/rule/mean",
    "actor/pg_loss",
    "actor/kl_to_ref",
    "actor/ppo_kl",
    "actor/entropy",
    "response_length/mean",
    "timing_s/step",
    "perf/throughput",
)


def artifact_key(name: str, suffix: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{name}-{suffix}".lower()).strip("-")


def outside(alert: AlertConfig, value: float) -> bool:
    """Whether ``value`` is below the alert's ``below`` or above its ``above``."""
    return (alert.below is not None and value < alert.below) or (
        alert.above is not None and value > alert.above
    )


def curves_markdown(rows: Sequence[dict[str, Any]], name: str) -> str:
    """The curves of ``rows`` as a markdown image with a PNG data URI."""
    png = base64.b64encode(curves_png(rows, name)).decode("ascii")
    return f"![reward, KL and validation curves of run {name}](data:image/png;base64,{png})"


class RunReport:
    """Appends metrics and keeps the run's Prefect artifacts up to date."""

    def __init__(
        self,
        run_dir: Path,
        name: str,
        total_steps: int,
        *,
        start_step: int,
        artifact_interval_s: float,
        progress_bar: bool = True,
        loggers: Sequence[str] = (JSONL,),
        alerts: Sequence[AlertConfig] = (),
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.bar: Any = None
        self.bar_task: Any = None
        self.want_bar = progress_bar
        self.name = name
        self.total = total_steps
        self.path = run_dir / "metrics.jsonl"
        self.rows = self._load(start_step)
        self.progress_id: UUID | None = None
        self.artifact_interval_s = artifact_interval_s
        self._published_at = -math.inf
        self._unpublished: int | None = None  # the last step not yet in the artifacts
        self.curves_id: UUID | None = None
        self._samples_shown: tuple[int, int] | None = None  # (step, file mtime) in the artifact
        self._api_down_until = -math.inf  # artifacts are skipped until then (see the docstring)
        self._api_warned = False
        self._start_step = start_step
        self._lock = threading.Condition()  # guards _unpublished, _wanted, _closing, _busy
        self._wanted = False  # an artifact update is asked of the publisher thread
        self._closing = False
        self._busy = False  # the publisher thread is updating artifacts
        self._publisher: threading.Thread | None = None
        self.alerts = list(alerts)
        self._outside = [False] * len(self.alerts)  # per alert: was its last value outside?
        check_names(loggers)
        run = TrackerRun(run_dir=run_dir, name=name, start_step=start_step, config=config)
        self.trackers = self._open_trackers([n for n in dict.fromkeys(loggers) if n != JSONL], run)

    def _warn(self, what: str, exc: BaseException) -> None:
        print(f"[{self.name}] {what}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def _api(self, what: str, call: Callable[[], R]) -> R | None:
        """``call()`` (Prefect API requests); None when the API is down or does not answer
        (warned once per outage)."""
        if time.monotonic() < self._api_down_until:
            return None
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - the UI's records never stop a run
            self._api_down_until = time.monotonic() + max(API_BACKOFF_S, self.artifact_interval_s)
            if not self._api_warned:
                self._warn(
                    f"the Prefect API did not answer ({what}); artifacts are skipped until it "
                    "does, training goes on and metrics.jsonl keeps every row",
                    exc,
                )
                self._api_warned = True
            return None
        self._api_warned = False
        return result

    def _open_trackers(self, names: list[str], run: TrackerRun) -> dict[str, Tracker]:
        """The trackers that open; one that fails is reported and left out of the run."""
        trackers: dict[str, Tracker] = {}
        for name in names:
            try:
                trackers[name] = open_tracker(name, run)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops a run
                self._warn(f"tracker {name!r} did not start, the run goes on without it", exc)
        return trackers

    def _load(self, start_step: int) -> list[dict[str, Any]]:
        """Rows of steps before ``start_step`` (later ones, and their samples files, belong to an
        interrupted attempt)."""
        drop_samples_from(self.run_dir, start_step)
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r["step"] < start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def start(self, step: int) -> None:
        """Start the publisher thread (its first update creates the progress artifact)."""
        self._start_step = step
        self._publisher = threading.Thread(  # in the flow run's context: artifacts belong to it
            target=contextvars.copy_context().run,
            args=(self._publish_loop,),
            daemon=True,
            name=f"ppoflow-artifacts-{self.name}",
        )
        self._publisher.start()
        self._request()
        if self.want_bar and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
            )
            self.bar.start()
            self.bar_task = self.bar.add_task(self.name, total=self.total, completed=step, info="")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: v for k, v in metrics.items() if math.isfinite(v)}}
        self.rows.append(row)
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        self._track(step, {k: v for k, v in row.items() if k != "step"})
        self._check_alerts(step, row)
        with self._lock:
            self._unpublished = step
        due = time.monotonic() - self._published_at >= self.artifact_interval_s
        if due or step + 1 >= self.total:
            self._published_at = time.monotonic()
            self._request()
        self._show(step, row)
        emit_event(
            event=ITERATION_EVENT,
            resource=self._resource,
            payload={"step": step, "metrics": row},
        )

    def _track(self, step: int, metrics: dict[str, float]) -> None:
        """Hand the row to every tracker; one that fails is reported and dropped."""
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(step, metrics)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops a run
                self._warn(f"tracker {name!r} failed, no more rows go to it", exc)
                del self.trackers[name]

    @property
    def _resource(self) -> dict[str, str]:
        return {
            "prefect.resource.id": f"ppoflow.run.{self.name}",
            "prefect.resource.name": self.name,
        }

    def restarted(self, step: int, payload: dict[str, Any]) -> None:
        """Emit ``ppoflow.worker.restarted`` (and say so on stderr): a dead worker was replaced,
        or a lost store shard made anew, and the run continues from ``step``."""
        print(
            f"[{self.name}] restarted, continuing from step {step}: {payload.get('error', '')}",
            file=sys.stderr,
            flush=True,
        )
        emit_event(event=RESTART_EVENT, resource=self._resource, payload={"step": step, **payload})

    def _check_alerts(self, step: int, row: dict[str, Any]) -> None:
        """Emit ``ppoflow.metric.alert`` when an alert's metric goes outside its bounds (once per
        crossing: a value that stays outside does not emit again until it has come back)."""
        for i, alert in enumerate(self.alerts):
            if alert.metric not in row:
                continue
            value = float(row[alert.metric])
            now_outside = outside(alert, value)
            if now_outside and not self._outside[i]:
                emit_event(
                    event=ALERT_EVENT,
                    resource=self._resource,
                    payload={
                        "metric": alert.metric,
                        "value": value,
                        "below": alert.below,
                        "above": alert.above,
                        "step": step,
                    },
                )
            self._outside[i] = now_outside

    def _publish_curves(self, rows: list[dict[str, Any]]) -> None:
        """The curves artifact: created on the first publish, then updated in place."""
        text = curves_markdown(rows, self.name)
        if self.curves_id is not None:
            with get_client(sync_client=True) as client:
                client.update_artifact(self.curves_id, ArtifactUpdate(data=text))
            return
        self.curves_id = cast(
            UUID,
            create_markdown_artifact(
                markdown=text,
                key=artifact_key(self.name, "curves"),
                description=f"reward, KL and validation curves of run {self.name}",
            ),
        )

    def _publish_samples(self) -> None:
        """The samples table of the latest saved step, unless it shows that file already."""
        steps = saved_steps(self.run_dir)
        if not steps:
            return
        step = steps[-1]
        shown = (step, samples_path(self.run_dir, step).stat().st_mtime_ns)
        if shown == self._samples_shown:
            return
        table = samples_table(read_samples(self.run_dir, step, limit=SAMPLE_ROWS))
        if not table:  # a step that kept no group: the last table stays
            return
        create_table_artifact(
            table=table,
            key=artifact_key(self.name, "samples"),
            description=f"samples of step {step} of run {self.name} (ppoflow samples RUN_DIR)",
        )
        self._samples_shown = shown

    def _request(self) -> None:
        """Ask for an artifact update: on the publisher thread once started, else here."""
        if self._publisher is None:
            self._publish()
            return
        with self._lock:
            self._wanted = True
            self._lock.notify_all()

    def _publish_loop(self) -> None:
        while True:
            with self._lock:
                while not self._wanted and not self._closing:
                    self._lock.wait()
                if not self._wanted:
                    return
                self._wanted, self._busy = False, True
            try:
                self._publish()
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def flush(self, timeout: float = CLOSE_WAIT_S) -> bool:
        """Wait until the artifact updates asked for so far are done; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._publisher is not None and (self._wanted or self._busy):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def _publish(self) -> None:
        """Bring the progress artifact, the metrics table and the curves up to the last logged
        step (kept pending when the API does not answer)."""
        if self.progress_id is None:
            self.progress_id = self._api(
                "progress artifact",
                lambda: cast(
                    UUID,
                    create_progress_artifact(
                        progress=100.0 * self._start_step / self.total,
                        key=artifact_key(self.name, "progress"),
                        description=f"ppoflow run {self.name}: steps done / {self.total}",
                    ),
                ),
            )
        with self._lock:
            step = self._unpublished
        if step is None:
            return
        if self._api("metrics artifacts", lambda: self._publish_all(step)) is not None:
            with self._lock:
                if self._unpublished == step:
                    self._unpublished = None

    def _publish_all(self, step: int) -> bool:
        rows = list(self.rows)
        table = [
            {
                c: (round(r[c], 5) if isinstance(r.get(c), float) else r.get(c))
                for c in TABLE_COLUMNS
            }
            for r in rows
        ]
        create_table_artifact(
            table=table,
            key=artifact_key(self.name, "metrics"),
            description=f"per-step metrics of run {self.name}",
        )
        self._publish_curves(rows)
        self._publish_samples()
        if self.progress_id is not None:
            update_progress_artifact(self.progress_id, progress=100.0 * (step + 1) / self.total)
        return True

    def _show(self, step: int, row: dict[str, Any]) -> None:
        keys = (
            ("score", "critic/score/mean"),
            ("acc", "eval/rule_accuracy"),
            ("kl", "actor/kl_to_ref"),
            ("s", "timing_s/step"),
        )
        info = " ".join(f"{short}={row[k]:.3f}" for short, k in keys if k in row)
        if self.bar is not None:
            self.bar.update(self.bar_task, completed=step + 1, info=info)
        else:
            print(f"[{self.name}] step {step + 1}/{self.total} {info}", flush=True)

    def close(self) -> None:
        """Publish what is pending, close the trackers and stop the bar. Runs in the training
        loop's ``finally``: a failed publish or tracker is reported, not raised, so it cannot
        hide the error that ended a run (metrics.jsonl already holds every row)."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        if self._publisher is None:
            self._publish()
        else:
            with self._lock:
                self._wanted = self._unpublished is not None or self._wanted
                self._closing = True
                self._lock.notify_all()
            self._publisher.join(timeout=CLOSE_WAIT_S)
            if self._publisher.is_alive():
                print(
                    f"[{self.name}] the last artifact update did not finish within "
                    f"{CLOSE_WAIT_S:.0f} s (the Prefect API is slow or gone); metrics.jsonl has "
                    "every row",
                    file=sys.stderr,
                    flush=True,
                )
            self._publisher = None
        for name, tracker in self.trackers.items():
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001 - see the docstring
                self._warn(f"tracker {name!r} did not close", exc)
        self.trackers = {}

    def summary(self, *, plot: Path | None, checkpoint: Path | None, extra: dict[str, Any]) -> str:
        first = next((r for r in self.rows if "eval/rule_accuracy" in r), None)
        last = next((r for r in reversed(self.rows) if "eval/rule_accuracy" in r), None)
        lines = [f"# ppoflow run `{self.name}`", "", "| what | value |", "|---|---|"]
        lines += [f"| steps | {len(self.rows)} |"]
        if first and last:
            lines += [
                f"| held-out rule accuracy (first eval, step {first['step']}) | {first['eval/rule_accuracy']:.3f} |",
                f"| held-out rule accuracy (last eval, step {last['step']}) | {last['eval/rule_accuracy']:.3f} |",
            ]
        lines += [f"| {k} | {v} |" for k, v in extra.items()]
        if plot is not None:
            lines += [f"| curves, full size (on the training machine) | `{plot.resolve()}` |"]
        if checkpoint is not None:
            lines += [f"| checkpoint | `{checkpoint.resolve()}` |"]
        if self.rows:
            lines += ["", "## Curves", "", curves_markdown(self.rows, self.name)]
        text = "\n".join(lines) + "\n"
        (self.run_dir / "summary.md").write_text(text)
        self._api(
            "summary artifact",
            lambda: create_markdown_artifact(
                markdown=text, key=artifact_key(self.name, "summary"), description="run summary"
            ),
        )
        return text
