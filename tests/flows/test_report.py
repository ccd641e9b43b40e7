"""The run report: metrics.jsonl every step, Prefect artifacts at most every interval (and at
the first and last step, and on close), the curves artifact (an embedded PNG, updated in
place), alert events related to their flow run, and trackers that fail without stopping the
run, against the real test harness API."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from prefect import flow
from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.context import get_run_context
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

from flows.plot import validation_keys
from flows.report import ALERT_EVENT, RunReport
from flows.trackers import TRACKERS, TrackerError, TrackerRun
from infra.config import AlertConfig


async def _versions(key: str) -> int:
    async with get_client() as client:
        found = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    return len(found)


def test_artifacts_are_throttled_but_complete(prefect_harness: None, tmp_path: Path) -> None:
    @flow(name="report-throttle")
    def run() -> None:
        report = RunReport(
            tmp_path, "throttle-run", 10, start_step=0, progress_bar=False, artifact_interval_s=3600
        )
        report.start(0)
        for step in range(4):
            report.log(step, {"critic/score/mean": float(step)})
        report.close()

    run()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4  # every step, on disk
    table = Artifact.get("throttle-run-metrics")
    assert table is not None and '"step": 3' in str(table.data)  # close() published step 3
    # the first step published (the publisher thread may already see later rows), steps 1-2 fell
    # inside the interval, close() published the rest: at most two versions for four steps
    assert asyncio.run(_versions("throttle-run-metrics")) in (1, 2)
    progress = Artifact.get("throttle-run-progress")
    assert progress is not None and float(progress.data) == 40.0


# ---------------------------------------------------------------------- curves, alerts, trackers
def _png_of(markdown: str) -> bytes:
    """The PNG bytes of the (only) data-URI image in ``markdown``."""
    match = re.search(r"\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown)
    assert match is not None, markdown[:200]
    return base64.b64decode(match.group(1))


def test_curves_artifact_is_an_embedded_png_updated_in_place(
    prefect_harness: None, tmp_path: Path
) -> None:
    seen: dict[str, str] = {}

    @flow(name="report-curves")
    def run() -> None:
        report = RunReport(
            tmp_path, "curves-run", 6, start_step=0, progress_bar=False, artifact_interval_s=3600
        )
        report.start(0)
        for step in range(3):
            metrics = {"critic/score/mean": 0.1 * step, "actor/kl_to_ref": 0.01 * step}
            report.log(step, {**metrics, "val-core/addition/reward/mean@1": 0.2 * step})
            if step == 0:
                assert report.flush()  # artifacts are updated on the report's own thread
                seen["first"] = str(Artifact.get("curves-run-curves").data)  # type: ignore[union-attr]
        report.close()
        seen["summary"] = report.summary(plot=tmp_path / "curves.png", checkpoint=None, extra={})

    run()
    final = Artifact.get("curves-run-curves")
    assert final is not None
    png = _png_of(str(final.data))
    assert png.startswith(b"\x89PNG") and 1_000 < len(png) < 100_000  # small, still a picture
    assert Image.open(io.BytesIO(png)).size[0] > 300
    assert _png_of(seen["first"]) != png  # close() redrew it with steps 1-2 ...
    assert asyncio.run(_versions("curves-run-curves")) == 1  # ... in place, one version
    # The summary shows the curves itself, no link to a file on the training machine.
    assert "file://" not in seen["summary"] and _png_of(seen["summary"]).startswith(b"\x89PNG")


def test_validation_metrics_get_their_own_panel() -> None:
    rows = [{"step": 0, "val-core/a/reward/mean@1": 0.1, "eval/rule_accuracy": 0.2, "x": 1.0}]
    assert validation_keys(rows) == ["eval/rule_accuracy", "val-core/a/reward/mean@1"]


async def _alert_events(name: str, want: int, timeout_s: float = 30.0) -> list[Any]:
    """The run's alert events from the API, oldest first, once ``want`` have arrived."""
    deadline = time.monotonic() + timeout_s
    async with get_client() as client:
        while True:
            flt = EventFilter(  # anew each time: its `occurred.until` defaults to its creation
                event=EventNameFilter(name=[ALERT_EVENT]),
                resource=EventResourceFilter(id=[f"ppoflow.run.{name}"]),
            )
            events = (await client.read_events(filter=flt, limit=50)).events
            if len(events) >= want or time.monotonic() > deadline:
                return sorted(events, key=lambda e: e.occurred)
            await asyncio.sleep(0.5)


def test_alert_fires_once_per_crossing_with_the_flow_run_related(
    prefect_harness: None, tmp_path: Path
) -> None:
    alerts = [AlertConfig(metric="critic/score/mean", below=0.5)]
    values = [1.0, 0.2, 0.1, 0.9, 0.3]  # crosses below 0.5 at steps 1 and 4

    @flow(name="report-alerts")
    def run() -> str:
        report = RunReport(
            tmp_path,
            "alert-run",
            5,
            start_step=0,
            progress_bar=False,
            artifact_interval_s=0.0,
            alerts=alerts,
        )
        report.start(0)
        for step, value in enumerate(values):
            report.log(step, {"critic/score/mean": value, "actor/kl_to_ref": 0.0})
        report.close()
        return str(get_run_context().flow_run.id)  # type: ignore[union-attr]

    flow_run_id = run()
    events = asyncio.run(_alert_events("alert-run", want=2))
    payloads = [e.payload for e in events]
    assert payloads == [
        {"metric": "critic/score/mean", "value": v, "below": 0.5, "above": None, "step": s}
        for s, v in ((1, 0.2), (4, 0.3))
    ]
    # The events worker relates each event to the flow run that emitted it (what an
    # automation's CancelFlowRun acts on).
    for event in events:
        related = {r.id: r.role for r in event.related}
        assert related.get(f"prefect.flow-run.{flow_run_id}") == "flow-run"


class _BrokenTracker:
    def __init__(self, run: TrackerRun) -> None:
        self.rows = 0

    def log(self, step: int, metrics: Any) -> None:
        raise OSError("disk full")

    def close(self) -> None:
        raise OSError("still full")


def test_a_failing_tracker_is_reported_not_raised(
    prefect_harness: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(TRACKERS, "broken", _BrokenTracker)

    @flow(name="report-broken-tracker")
    def run() -> None:
        report = RunReport(
            tmp_path,
            "broken-run",
            3,
            start_step=0,
            progress_bar=False,
            artifact_interval_s=0.0,
            loggers=["jsonl", "broken"],
        )
        report.start(0)
        for step in range(3):
            report.log(step, {"critic/score/mean": 1.0})
        report.close()

    run()
    err = capsys.readouterr().err
    assert err.count("tracker 'broken' failed, no more rows go to it: OSError: disk full") == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # the run went on


def test_unknown_tracker_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(TrackerError, match=r"trainer\.loggers.*'tensorbord'"):
        RunReport(tmp_path, "x", 1, start_step=0, artifact_interval_s=0.0, loggers=["tensorbord"])
