"""The Prefect UI shows a finished training run: headless Chromium opens the tiny run's page on
the local server and keeps screenshots (tests/artifacts/, and docs/ui-run.png for the README).

Uses Debian's ``chromium`` through Playwright's Python API (no browser download); skips with a
message when either is missing. Asserts on page content: the stage task-run names and the
metrics artifact key (the run graph is a canvas, so names are read from the Task Runs tab), the
curves artifact's embedded PNG, drawn by the browser (an ``<img>`` with a natural width), and the
samples table with its columns and a prompt the run saved.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server import REPO, LocalServer, TinyRun

from flows.samples import read_samples, saved_steps

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = REPO / "tests" / "artifacts"
README_SHOT = REPO / "docs" / "ui-run.png"
UI_WAIT_MS = 60_000


def _chromium() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    return path


@pytest.fixture
def page() -> Iterator[Any]:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
    )
    executable = _chromium()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1100})
        finally:
            browser.close()


@pytest.mark.slow
def test_ui_shows_stage_task_runs_and_metrics_artifact(
    prefect_server: LocalServer, tiny_run: TinyRun, page: Any
) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    metrics_key = f"{tiny_run.run_name}-metrics"
    url = f"{prefect_server.ui_url}/runs/flow-run/{tiny_run.flow_run.id}"
    # 1. Task Runs tab: every stage of the run's first step, by name.
    page.goto(f"{url}?tab=Task%20Runs")
    for stage in ("generate", "score", "logprobs", "advantage", "update"):
        page.get_by_text(f"{stage}[step=0]", exact=True).first.wait_for(timeout=UI_WAIT_MS)
    assert "update[step=1]" in page.inner_text("body")
    page.screenshot(path=str(ARTIFACTS / "ui-task-runs.png"), full_page=True)
    # 2. Artifacts tab under the run graph (the graph draws the stage task runs).
    page.get_by_text("Artifacts", exact=True).first.click()
    page.get_by_text(metrics_key, exact=True).first.wait_for(timeout=UI_WAIT_MS)
    body = page.inner_text("body")
    assert "Completed" in body and f"{tiny_run.run_name}-summary" in body
    page.wait_for_timeout(1000)  # let the graph finish drawing
    shot = ARTIFACTS / "ui-flow-run.png"
    page.screenshot(path=str(shot), full_page=True)
    README_SHOT.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, README_SHOT)
    # 3. The metrics table itself: one row per step.
    page.get_by_text(metrics_key, exact=True).first.click()
    page.get_by_text("critic/score/mean").first.wait_for(timeout=UI_WAIT_MS)
    page.wait_for_timeout(500)
    page.screenshot(path=str(ARTIFACTS / "ui-metrics-artifact.png"), full_page=True)
    assert shot.stat().st_size > 10_000
    # 4. The curves artifact: the UI's markdown renderer keeps the data-URI image and draws it.
    _open_artifact(page, url, f"{tiny_run.run_name}-curves")
    image = page.locator('img[src^="data:image/png;base64,"]').first
    image.wait_for(timeout=UI_WAIT_MS)
    page.wait_for_function(
        "() => [...document.images].some(i => i.src.startsWith('data:image/png') && i.complete)",
        timeout=UI_WAIT_MS,
    )
    assert image.evaluate("img => img.naturalWidth") > 300
    page.screenshot(path=str(ARTIFACTS / "ui-curves-artifact.png"), full_page=True)
    # 5. The samples table: its columns, and prompts from the run's samples files.
    _open_artifact(page, url, f"{tiny_run.run_name}-samples")
    page.get_by_text("turns", exact=True).first.wait_for(timeout=UI_WAIT_MS)
    page.wait_for_timeout(500)
    body = page.inner_text("body")
    assert all(column in body for column in ("prompt", "response", "score"))
    prompts = {
        s["prompt"]
        for step in saved_steps(tiny_run.run_dir)
        for s in read_samples(tiny_run.run_dir, step)
    }
    assert any(prompt in body for prompt in prompts), sorted(prompts)[:4]
    page.screenshot(path=str(ARTIFACTS / "ui-samples-artifact.png"), full_page=True)


def _open_artifact(page: Any, run_url: str, key: str) -> None:
    """The artifact ``key`` of the run, through the run page's Artifacts tab."""
    page.goto(run_url)
    page.get_by_text("Artifacts", exact=True).first.click()
    page.get_by_text(key, exact=True).first.click()
