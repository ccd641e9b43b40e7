"""Progress of a run's long phases besides the RL steps' own report (flows/report.py): before
the steps, building the assets and the warm start's SFT and reward models; inside the steps,
each evaluation and each step's dynamic-sampling rounds. The work calls ``progress(done,
total)`` (``infra.progress``).

1. Before the RL steps (``phase_progress``), on a terminal (``trainer.progress_bar`` and stderr
   a tty): a bar. Otherwise, and always inside the RL steps (``step_phase_progress``), lines on
   stderr: when the phase starts, at least every 30 s, and at its end
   (``infra.progress.LineProgress``; ``heartbeat()`` keeps them coming while one part runs
   long). Inside the steps the run's bar (``RunReport``) holds rich's live display: a second
   bar would raise ``LiveError`` (an older rich) or stack under it (a newer one), while a line
   on stderr is printed above the run's bar.
2. In a Prefect flow or task run: a progress artifact ``<run name>-<key>`` (0 to 100), created
   at the first report, then updated in place at most every ``trainer.artifact_interval_s`` and
   at the phase's end. A phase that comes back (an evaluation, a step's sampling) keeps one
   artifact for the run, updated at most every interval, its ends included (they come every
   step or every few). An API that does not answer costs one warning; the run goes on
   without that artifact.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast
from uuid import UUID

from infra.config import TrainConfig
from infra.progress import LineProgress

LINE_INTERVAL_S = 30.0
log = logging.getLogger(__name__)


class ProgressArtifact:
    """The Prefect progress artifact ``key`` (see the module docstring, 2.)."""

    def __init__(
        self, key: str, *, description: str, interval_s: float, recurring: bool = False
    ) -> None:
        self.key, self.description, self.interval_s = key, description, interval_s
        self.recurring = recurring
        self.id: UUID | None = None
        self.failed = False
        self.published = -math.inf

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        final = done >= total and not self.recurring
        if final or now - self.published >= self.interval_s:
            self.published = now
            self._publish(100.0 * done / total if total else 100.0)

    def _publish(self, percent: float) -> None:
        if self.failed:
            return
        from prefect.artifacts import create_progress_artifact, update_progress_artifact
        from prefect.context import get_run_context

        try:
            get_run_context()
        except RuntimeError:  # not in a flow or task run: no artifact
            return
        try:
            if self.id is None:
                self.id = cast(
                    UUID,
                    create_progress_artifact(
                        progress=percent, key=self.key, description=self.description
                    ),
                )
            else:
                update_progress_artifact(self.id, progress=percent)
        except Exception as exc:  # noqa: BLE001 - the API's failure must not stop the run
            self.failed = True
            log.warning("progress artifact %s not updated (%s); the run goes on", self.key, exc)


class PhaseProgress:
    """One phase's ``progress(done, total)``: a bar or lines, and its artifact."""

    def __init__(
        self, label: str, *, artifact: ProgressArtifact, bar: bool, quiet_s: float = 0.0
    ) -> None:
        self.label, self.artifact = label, artifact
        self.lines = (
            None if bar else LineProgress(label, interval_s=LINE_INTERVAL_S, quiet_s=quiet_s)
        )
        self.bar: Any = None
        self.task: Any = None
        if bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self.bar = Progress(
                f"ppoflow: {label}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
            )

    def __call__(self, done: int, total: int) -> None:
        if self.lines is not None:
            self.lines(done, total)
        elif self.bar is not None:
            if self.task is None:
                self.bar.start()
                self.task = self.bar.add_task(self.label, total=total)
            self.bar.update(self.task, completed=done)
            if done >= total:
                self.bar.stop()
        self.artifact(done, total)

    def heartbeat(self) -> AbstractContextManager[None]:
        """Lines between two calls too (``LineProgress.heartbeat``); a bar keeps its own clock."""
        return self.lines.heartbeat() if self.lines is not None else nullcontext()


def run_artifact(
    cfg: TrainConfig, key: str, what: str, *, recurring: bool = False
) -> ProgressArtifact:
    """The run's progress artifact ``<cfg.name>-<key>``, described as ``what``; ``recurring``
    for a phase that comes back (see the module docstring, 2.)."""
    from flows.report import artifact_key

    return ProgressArtifact(
        artifact_key(cfg.name, key),
        description=f"ppoflow: {what}",
        interval_s=cfg.trainer.artifact_interval_s,
        recurring=recurring,
    )


def phase_progress(cfg: TrainConfig, label: str, key: str) -> PhaseProgress:
    """A phase before the RL steps: a bar on a terminal, else lines; its artifact
    ``<cfg.name>-<key>``."""
    bar = cfg.trainer.progress_bar and sys.stderr.isatty()
    return PhaseProgress(label, artifact=run_artifact(cfg, key, label), bar=bar)


def step_phase_progress(
    label: str, artifact: ProgressArtifact, *, quiet: bool = False
) -> PhaseProgress:
    """A phase inside the RL steps: lines, never a bar (see the module docstring, 1.), and the
    run's ``artifact`` for this kind of phase. ``quiet``: no line until the phase has run one
    line interval (``LineProgress.quiet_s``)."""
    return PhaseProgress(
        label, artifact=artifact, bar=False, quiet_s=LINE_INTERVAL_S if quiet else 0.0
    )
