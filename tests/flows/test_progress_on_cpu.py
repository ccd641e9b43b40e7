"""Progress of a run's long phases: a line on stderr when a phase starts, at least every
interval (between calls too, by the heartbeat) and at its end (no terminal); the asset build,
each evaluation and each step's dynamic-sampling rounds; lines, not a second bar, inside the
run's bar; a Prefect progress artifact that reaches 100 and is kept in place for a phase that
comes back (against the real test harness API), and one warning when the API fails."""

from __future__ import annotations

import asyncio
import logging
import pickle
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prefect import flow
from prefect.artifacts import Artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

import flows.progress
from flows.evaluation import Evaluator
from flows.progress import PhaseProgress, ProgressArtifact, step_phase_progress
from flows.report import RunReport
from infra.config import TrainConfig, load_config
from infra.data import PromptRow
from infra.progress import LineProgress
from storage import BatchMeta
from tasks.context import StageResult, Timings
from tasks.filter.core import GroupChoice
from tasks.filter.stage import FilterResult
from tasks.score.stage import Scores

SHORT_S = 0.05  # the line interval of the tests that wait for lines


@pytest.fixture()
def short_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flows.progress, "LINE_INTERVAL_S", SHORT_S)


def _lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


def _counts(lines: list[str]) -> list[str]:
    """The ``done/total`` of each line."""
    return [re.findall(r": (\d+/\d+) \(", line)[-1] for line in lines]


# ---------------------------------------------------------------------- lines and the heartbeat
def test_lines_at_the_start_every_interval_and_at_the_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = LineProgress("warm start: sft", interval_s=3600)
    for step in range(1, 11):
        lines(step, 10)
    printed = _lines(capsys)
    assert len(printed) == 2, printed  # the first step and the last, nothing in between
    assert re.fullmatch(r"ppoflow: warm start: sft: 1/10 \(10%\) after 0 s", printed[0])
    assert printed[1].startswith("ppoflow: warm start: sft: 10/10 (100%)")
    every = LineProgress("rm", interval_s=0.0)
    for step in range(1, 4):
        every(step, 3)
    assert len(_lines(capsys)) == 3


def test_a_quiet_phase_prints_only_once_it_has_run_its_quiet_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fast = LineProgress("fast", interval_s=3600, quiet_s=3600)
    for done in range(1, 5):
        fast(done, 4)
    assert _lines(capsys) == []  # ended within its quiet time: nothing at all
    slow = LineProgress("slow", interval_s=3600, quiet_s=SHORT_S)
    slow(1, 4)
    time.sleep(2 * SHORT_S)
    slow(2, 4)
    slow(3, 4)
    slow(4, 4)
    printed = _lines(capsys)
    assert _counts(printed) == ["2/4", "4/4"], printed


def test_the_heartbeat_repeats_the_last_line_while_a_part_runs_long(
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = LineProgress("evaluation", interval_s=SHORT_S)
    with lines.heartbeat():
        lines(0, 2)
        time.sleep(10 * SHORT_S)  # one long part, no call
        lines(2, 2)
        time.sleep(4 * SHORT_S)  # finished: nothing more to repeat
    time.sleep(4 * SHORT_S)  # the heartbeat has stopped
    printed = _lines(capsys)
    assert printed[0] == "ppoflow: evaluation: 0/2 (0%) after 0 s"
    assert sum(line.startswith("ppoflow: evaluation: 0/2") for line in printed) >= 4, printed
    assert printed[-1].startswith("ppoflow: evaluation: 2/2 (100%)")
    assert sum("2/2" in line for line in printed) == 1
    # A reward model in a process of its own gets its LineProgress pickled.
    assert pickle.loads(pickle.dumps(lines)).label == "evaluation"


# ---------------------------------------------------------------------- the phases
def _cfg(tmp_path: Path, *overrides: str) -> TrainConfig:
    return load_config("tiny", [f"run_dir={tmp_path / 'run'}", *overrides])


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


@pytest.mark.parametrize("task", ["addition", "agent"])
def test_the_asset_build_reports_its_parts_and_a_reuse_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], task: str
) -> None:
    from flows.reward_model import build_assets

    cfg = _cfg(tmp_path, f"models.assets_dir={tmp_path / 'assets'}", f"data.builtin_task={task}")
    build_assets.fn(cfg)
    printed = [line for line in _lines(capsys) if line.startswith("ppoflow:")]
    # addition: the tokenizers, four models, the data; agent: the tokenizer, the policy, 2 files
    parts = 6 if task == "addition" else 4
    assert printed[0] == f"ppoflow: building the tiny assets: 0/{parts} (0%) after 0 s"
    assert printed[-1].startswith(f"ppoflow: building the tiny assets: {parts}/{parts} (100%)")
    build_assets.fn(cfg)
    assert "ppoflow:" not in capsys.readouterr().err  # the manifest matches: reused, silent


@pytest.fixture()
def evaluator(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Evaluator:
    """The built-in task's evaluation of two prompts through the real validate task, its store,
    generation (slow: ten line intervals) and scoring replaced by stand-ins."""
    import tasks.validate.stage as stage

    def generate(ctx: Any, meta: BatchMeta, **_: Any) -> BatchMeta:
        time.sleep(10 * SHORT_S)
        return meta

    def scores(ctx: Any, meta: BatchMeta, scoring: Any) -> Scores:
        right = torch.tensor([1.0, 0.0])
        lengths, truncated = torch.tensor([3, 3]), torch.tensor([False, False])
        return Scores(
            total=right,
            response_lengths=lengths,
            response_truncated=truncated,
            named={"rule": right},
        )

    monkeypatch.setattr(stage, "submit_prompts", lambda ctx, **_: BatchMeta("val", ("a/0", "b/0")))
    monkeypatch.setattr(stage, "generate_partition", generate)
    monkeypatch.setattr(stage, "compute_scores", scores)
    monkeypatch.setattr(stage, "read", lambda *_: {"data_source": ["addition"] * 2})
    store = SimpleNamespace(kv_clear=lambda partition: None)
    ctx: Any = SimpleNamespace(cfg=_cfg(tmp_path), rt=SimpleNamespace(store=store))
    rows = [
        PromptRow(uid=u, raw_prompt=[{"role": "user", "content": "1+1="}], ground_truth="2")
        for u in "ab"
    ]
    return Evaluator(ctx, stage.validate, val_rows=None, heldout=rows)


def test_an_evaluation_shows_its_parts_and_a_line_while_generation_runs_long(
    short_interval: None, evaluator: Evaluator, capsys: pytest.CaptureFixture[str]
) -> None:
    assert evaluator(3) == {"eval/rule_accuracy": 0.5}
    printed = _lines(capsys)
    label = "ppoflow: evaluation at step 3 (2 prompts x 1), generate+score"
    assert printed[0] == f"{label}: 0/2 (0%) after 0 s"
    assert sum(line.startswith(f"{label}: 0/2") for line in printed) >= 4, printed  # heartbeat
    assert printed[-1].startswith(f"{label}: 2/2 (100%)")


def test_a_phase_inside_the_runs_bar_prints_lines_not_a_second_bar(
    short_interval: None,
    evaluator: Evaluator,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(RunReport, "_publish", lambda self: None)  # no Prefect API here
    report = RunReport(
        tmp_path, "bar-run", 3, start_step=0, progress_bar=True, artifact_interval_s=0.0
    )
    report.start(0)
    try:
        assert report.bar is not None  # the run's rich bar is live
        evaluator(0)
    finally:
        report.close()
    printed = _lines(capsys)
    assert printed[-1].startswith(
        "ppoflow: evaluation at step 0 (2 prompts x 1), generate+score: 2/2"
    )


class _Task:
    """A Prefect task as the sampler calls it: ``with_options(...)`` gives the function."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def with_options(self, **_: Any) -> Callable[..., Any]:
        return self.fn


@pytest.fixture()
def sample_step(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[int], None]:
    """A filtered step of 4 groups whose rounds keep 1, then 3, then 4 groups; each generation
    takes two line intervals (of ``short_interval``, or 30 s: nothing waits that long)."""
    import flows.sampling as sampling

    kept: Iterator[int] = iter([1, 3, 4])

    def generate(ctx: Any, metas: list[BatchMeta], step: int, round: int = 0) -> list[BatchMeta]:
        time.sleep(2 * SHORT_S)
        return metas

    def cut(ctx: Any, job: Any, step: int) -> FilterResult:
        choice = GroupChoice(kept=tuple(range(next(kept))), dropped=(), surplus=())
        return FilterResult(job.candidates, choice, removed=0)

    monkeypatch.setattr(sampling, "generate", _Task(generate))
    monkeypatch.setattr(
        sampling, "score", _Task(lambda ctx, meta, step, round=0: StageResult(meta))
    )
    monkeypatch.setattr(sampling, "filter_groups", _Task(cut))
    overrides = (
        "algorithm.filter_groups.enabled=true",
        "rollout.prompts_per_step=4",
        "rollout.n=2",
    )
    ctx: Any = SimpleNamespace(cfg=_cfg(tmp_path, *overrides))
    keys = tuple(f"p{i}/{j}" for i in range(4) for j in range(2))

    def draw(step: int, round: int, prompts: int) -> BatchMeta:
        return BatchMeta(
            "train", tuple(f"r{round}-{i}/{j}" for i in range(prompts) for j in range(2))
        )

    sampler = sampling.Sampler(ctx, {}, draw)

    def step(n: int) -> None:
        sampler([BatchMeta("train", keys)], n, Timings())

    return step


def test_a_fast_steps_refill_rounds_print_nothing(
    sample_step: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    sample_step(7)  # three rounds well within 30 s
    assert _lines(capsys) == []


def test_a_slow_steps_refill_rounds_show_the_groups_kept(
    short_interval: None, sample_step: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    sample_step(7)
    printed = _lines(capsys)
    label = "ppoflow: dynamic sampling of step 7, groups kept"
    assert all(line.startswith(f"{label}: ") for line in printed), printed
    assert {"1/4", "3/4"} <= set(_counts(printed)), printed
    assert printed[-1].startswith(f"{label}: 4/4 (100%)")


# ---------------------------------------------------------------------- the artifact
async def _versions(key: str) -> int:
    async with get_client() as client:
        found = await client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    return len(found)


def test_the_phase_artifact_ends_at_100_and_a_phase_that_comes_back_keeps_it(
    prefect_harness: None,
) -> None:
    """A phase's artifact ends at 100; one a phase that comes back keeps is updated in place
    and at most every interval, its ends included (with an hour's interval: the first report
    only; with none: every report, so it ends at 100)."""

    @flow(name="progress-phase")
    def phases() -> None:
        artifact = ProgressArtifact("phase-run-sft", description="sft", interval_s=3600)
        progress = PhaseProgress("warm start: sft", artifact=artifact, bar=False)
        for step in range(1, 6):
            progress(step, 5)
        for key, interval in (("phase-run-eval", 3600.0), ("phase-run-refill", 0.0)):
            each = ProgressArtifact(key, description=key, interval_s=interval, recurring=True)
            for step in (0, 10):
                evaluation = step_phase_progress(f"evaluation at step {step}", each)
                for part in range(3):
                    evaluation(part, 2)

    phases()
    for key, value in (("phase-run-sft", 100.0), ("phase-run-eval", 0.0)):
        artifact = Artifact.get(key)
        assert artifact is not None and float(artifact.data) == value, key
    refill = Artifact.get("phase-run-refill")
    assert refill is not None and float(refill.data) == 100.0
    assert asyncio.run(_versions("phase-run-eval")) == 1  # updated in place
    assert asyncio.run(_versions("phase-run-refill")) == 1


def test_an_api_that_fails_costs_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import prefect.artifacts
    import prefect.context

    def down(**_: Any) -> None:
        raise ConnectionError("the API is down")

    monkeypatch.setattr(prefect.context, "get_run_context", lambda: object())  # as in a run
    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", down)
    artifact = ProgressArtifact("run-refill", description="groups kept", interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="flows.progress"):
        for step in range(3):
            progress = step_phase_progress(f"dynamic sampling of step {step}", artifact)
            progress(2, 4)
            progress(4, 4)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "run-refill" in warnings[0].getMessage()
