"""Progress of one phase of a run before its RL steps (SFT, a reward model, the teacher's run):
``phase_progress(cfg, label, key)`` gives the ``progress(done, total)`` callback the training
loops call (``infra.progress``).

1. On a terminal (``trainer.progress_bar`` and stderr a tty): a bar; otherwise a line on stderr
   when the phase starts, at least every 30 s, and at its end (``infra.progress.LineProgress``).
2. In a Prefect flow or task run: a progress artifact ``<run name>-<key>`` (0 to 100),
   updated at most every ``trainer.artifact_interval_s`` and at the end. An API that does not
   answer costs one warning; the phase goes on without the artifact.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, cast
from uuid import UUID

from infra.config import TrainConfig
from infra.progress import LineProgress, Progress

LINE_INTERVAL_S = 30.0
log = logging.getLogger(__name__)


class PhaseProgress:
    """See the module docstring."""

    def __init__(self, label: str, *, key: str, bar: bool, artifact_interval_s: float) -> None:
        self.label, self.key, self.artifact_interval_s = label, key, artifact_interval_s
        self.lines = None if bar else LineProgress(label, interval_s=LINE_INTERVAL_S)
        self.bar: Any = None
        self.task: Any = None
        self.artifact: UUID | None = None
        self.artifact_failed = False
        self.published = 0.0
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
        now = time.monotonic()
        if done >= total or now - self.published >= self.artifact_interval_s:
            self.published = now
            self._publish(100.0 * done / total if total else 100.0)

    def _publish(self, percent: float) -> None:
        if self.artifact_failed:
            return
        from prefect.artifacts import create_progress_artifact, update_progress_artifact
        from prefect.context import get_run_context

        try:
            get_run_context()
        except RuntimeError:  # not in a flow or task run: no artifact
            return
        try:
            if self.artifact is None:
                self.artifact = cast(
                    UUID,
                    create_progress_artifact(
                        progress=percent, key=self.key, description=f"ppoflow: {self.label}"
                    ),
                )
            else:
                update_progress_artifact(self.artifact, progress=percent)
        except Exception as exc:  # noqa: BLE001 - the API's failure must not stop the phase
            self.artifact_failed = True
            log.warning("progress artifact %s not updated (%s); the phase goes on", self.key, exc)


def phase_progress(cfg: TrainConfig, label: str, key: str) -> Progress:
    """The progress callback of phase ``label``, its artifact under ``<cfg.name>-<key>``."""
    from flows.report import artifact_key

    bar = cfg.trainer.progress_bar and sys.stderr.isatty()
    return PhaseProgress(
        label,
        key=artifact_key(cfg.name, key),
        bar=bar,
        artifact_interval_s=cfg.trainer.artifact_interval_s,
    )
