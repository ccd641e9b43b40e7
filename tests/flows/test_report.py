"""The run report: metrics.jsonl every step, Prefect artifacts at most every interval (and at
the first and last step, and on close), against the real test harness API."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prefect import flow
from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from flows.report import RunReport


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
    # the first step published, steps 1-2 fell inside the interval, close() published the rest
    assert asyncio.run(_versions("throttle-run-metrics")) == 2
    progress = Artifact.get("throttle-run-progress")
    assert progress is not None and float(progress.data) == 40.0
