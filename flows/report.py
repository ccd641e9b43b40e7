"""What a user sees of a run: ``metrics.jsonl``, Prefect artifacts (metrics table, progress,
summary) and one Prefect event per iteration (``ppoflow.iteration.completed``)."""

from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.events import emit_event

ITERATION_EVENT = "ppoflow.iteration.completed"
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


class RunReport:
    """Appends metrics and keeps the run's Prefect artifacts up to date."""

    def __init__(
        self,
        run_dir: Path,
        name: str,
        total_steps: int,
        *,
        start_step: int,
        progress_bar: bool = True,
        artifact_interval_s: float = 0.0,
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

    def _load(self, start_step: int) -> list[dict[str, Any]]:
        """Rows of steps before ``start_step`` (later ones belong to an interrupted attempt)."""
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r["step"] < start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def start(self, step: int) -> None:
        self.progress_id = create_progress_artifact(
            progress=100.0 * step / self.total,
            key=artifact_key(self.name, "progress"),
            description=f"ppoflow run {self.name}: steps done / {self.total}",
        )
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
        self._unpublished = step
        due = time.monotonic() - self._published_at >= self.artifact_interval_s
        if due or step + 1 >= self.total:
            self._publish()
        self._show(step, row)
        emit_event(
            event=ITERATION_EVENT,
            resource={
                "prefect.resource.id": f"ppoflow.run.{self.name}",
                "prefect.resource.name": self.name,
            },
            payload={"step": step, "metrics": row},
        )

    def _publish(self) -> None:
        """Bring the metrics table and the progress artifact up to the last logged step."""
        if self._unpublished is None:
            return
        step, self._unpublished = self._unpublished, None
        self._published_at = time.monotonic()
        table = [
            {
                c: (round(r[c], 5) if isinstance(r.get(c), float) else r.get(c))
                for c in TABLE_COLUMNS
            }
            for r in self.rows
        ]
        create_table_artifact(
            table=table,
            key=artifact_key(self.name, "metrics"),
            description=f"per-step metrics of run {self.name}",
        )
        if self.progress_id is not None:
            update_progress_artifact(self.progress_id, progress=100.0 * (step + 1) / self.total)

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
        """Publish what is pending and stop the bar. Runs in the training loop's ``finally``: a
        failed publish is reported, not raised, so it cannot hide the error that ended a run
        (metrics.jsonl already holds every row)."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        try:
            self._publish()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            print(f"[{self.name}] could not update the Prefect artifacts: {exc}", file=sys.stderr)

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
            lines += [f"| reward/KL plot | [{plot.name}]({plot.resolve().as_uri()}) |"]
        if checkpoint is not None:
            lines += [f"| checkpoint | `{checkpoint.resolve()}` |"]
        text = "\n".join(lines) + "\n"
        create_markdown_artifact(
            markdown=text, key=artifact_key(self.name, "summary"), description="run summary"
        )
        (self.run_dir / "summary.md").write_text(text)
        return text
