"""Progress of the phases before the RL steps: a line on stderr when a phase starts, at least
every interval and at its end (no terminal), and a Prefect progress artifact that reaches 100
(against the real test harness API); the SFT loop reports every optimizer step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prefect import flow
from prefect.artifacts import Artifact

from flows.progress import PhaseProgress
from infra.progress import LineProgress


def test_lines_at_the_start_every_interval_and_at_the_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = LineProgress("warm start: sft", interval_s=3600)
    for step in range(1, 11):
        lines(step, 10)
    printed = capsys.readouterr().err.splitlines()
    assert len(printed) == 2, printed  # the first step and the last, nothing in between
    assert re.fullmatch(r"ppoflow: warm start: sft: 1/10 \(10%\) after 0 s", printed[0])
    assert printed[1].startswith("ppoflow: warm start: sft: 10/10 (100%)")
    every = LineProgress("rm", interval_s=0.0)
    for step in range(1, 4):
        every(step, 3)
    assert len(capsys.readouterr().err.splitlines()) == 3


def test_the_phase_artifact_ends_at_100(prefect_harness: None) -> None:
    @flow(name="progress-phase")
    def phase() -> None:
        progress = PhaseProgress(
            "warm start: sft", key="phase-run-sft", bar=False, artifact_interval_s=3600
        )
        for step in range(1, 6):
            progress(step, 5)

    phase()
    artifact = Artifact.get("phase-run-sft")
    assert artifact is not None and float(artifact.data) == 100.0


def test_the_sft_loop_reports_each_step(assets, tmp_path: Path) -> None:
    from infra.config import WarmstartConfig
    from infra.pretrain import SFTSettings, sft_warmstart

    calls: list[tuple[int, int]] = []
    settings = SFTSettings.from_config(WarmstartConfig(sft_steps=3))
    sft_warmstart(
        policy_path=Path(assets.policy),
        tokenizer_path=Path(assets.tokenizer),
        train_path=Path(assets.train_data),
        heldout_path=Path(assets.heldout_data),
        out_path=tmp_path / "sft",
        settings=settings,
        seed=0,
        progress=lambda done, total: calls.append((done, total)),
    )
    assert calls == [(1, 3), (2, 3), (3, 3)]
