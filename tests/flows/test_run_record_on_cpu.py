"""A run folder belongs to one run (``flows.run_record``): which settings refuse a resume and
which may change, the one-line refusal naming keys, values and both ways out,
``trainer.resume=never`` moving the old run aside, and the warm start's own records."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from flows import cli
from flows.checkpoint import RunState
from flows.run_record import (
    RunDirError,
    check_run_dir,
    check_warm_start,
    may_change,
    result_differences,
    write_record,
)
from infra.config import TrainConfig, load_config


@dataclass(frozen=True)
class _Report:
    """What a warm-start part's training returns (its numbers go to report.json)."""

    heldout_accuracy: float


def _cfg(run_dir: Path, *overrides: str) -> TrainConfig:
    return load_config("tiny", [f"run_dir={run_dir}", *overrides])


def _recorded(cfg: TrainConfig) -> dict:
    return json.loads(json.dumps(cfg.model_dump(mode="json")))


def _a_run(run_dir: Path, *overrides: str) -> TrainConfig:
    """A run folder as a run leaves it: its record and what it wrote."""
    cfg = _cfg(run_dir, *overrides)
    write_record(cfg)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    return cfg


@pytest.mark.parametrize(
    "override",
    [
        "seed=1",
        "rollout.n=2",
        "actor.lr=0.001",
        "warmstart.rm_steps=600",
        "reward.uncertainty_penalty=0.5",
        "algorithm.estimator=gae",
        "models.dtype=bfloat16",
        "resources.mode=colocate_async",
        "data.shuffle=false",
    ],
)
def test_a_setting_that_changes_the_result_refuses(tmp_path: Path, override: str) -> None:
    first = _cfg(tmp_path)
    found = result_differences(_recorded(first), _cfg(tmp_path, override))
    key, value = override.split("=")
    assert [d.key for d in found] == [key]
    assert str(found[0].current).lower() == value.lower() or found[0].current == float(value)


@pytest.mark.parametrize(
    "override",
    [
        "trainer.total_steps=50",
        "trainer.loggers=[jsonl, tensorboard]",
        "trainer.artifact_interval_s=0",
        "trainer.alerts=[{metric: critic/score/mean, below: 0.1}]",
        "trainer.progress_bar=true",
        "trainer.checkpoint_every=1",
        "trainer.eval_every=1",
        "trainer.max_restarts=3",
        "orchestration.retries=3",
        "resources.num_cpus=2",
        "faults=[{stage: score, step: 1, action: raise}]",
        "name=renamed",
    ],
)
def test_a_setting_that_extends_or_observes_may_change(tmp_path: Path, override: str) -> None:
    first = _cfg(tmp_path)
    assert result_differences(_recorded(first), _cfg(tmp_path, override)) == []
    assert may_change(override.split("=")[0])


def test_a_setting_the_record_lacks_counts_as_its_default(tmp_path: Path) -> None:
    """A run recorded before a setting existed ran as that setting's default does."""
    recorded = _recorded(_cfg(tmp_path))
    del recorded["rollout"]["top_p"]
    del recorded["trainer"]
    assert result_differences(recorded, _cfg(tmp_path)) == []
    found = result_differences(recorded, _cfg(tmp_path, "rollout.top_p=0.9"))
    assert [(d.key, d.recorded, d.current) for d in found] == [("rollout.top_p", 1.0, 0.9)]


def test_the_refusal_is_one_line_naming_keys_values_and_both_ways_out(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _a_run(run_dir)
    with pytest.raises(RunDirError) as err:
        check_run_dir(_cfg(run_dir, "seed=1", "rollout.n=2"))
    message = str(err.value)
    assert message == (
        f"the run in run_dir={run_dir} was started with other settings (seed was 0, now 1; "
        f"rollout.n was 4, now 2): set another run_dir, or trainer.resume=never to move that "
        f"run to {run_dir}.old-1 and start over"
    )
    # More than three: the first three, and a count of the rest.
    with pytest.raises(RunDirError, match=r"now 0.5; 1 more\): set another run_dir") as err:
        check_run_dir(_cfg(run_dir, "seed=1", "rollout.n=2", "actor.lr=0.5", "critic.lr=0.5"))
    assert "\n" not in str(err.value)
    # The same settings, or only those that may change: it continues.
    assert check_run_dir(_cfg(run_dir, "trainer.total_steps=9", "trainer.loggers=[]")) is None


def test_total_steps_may_not_go_below_the_steps_already_checkpointed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _a_run(run_dir)
    checkpoint = run_dir / "checkpoints" / "step-000003"
    checkpoint.mkdir(parents=True)
    state = RunState(step=3, data={}, kl={}, submitted={}, produced={})
    (checkpoint / "state.json").write_text(json.dumps(state.to_json()))
    with pytest.raises(RunDirError) as err:
        check_run_dir(_cfg(run_dir, "trainer.total_steps=3"))
    assert str(err.value).startswith(
        f"trainer.total_steps=3 is below the 4 steps the run in run_dir={run_dir} has already "
        "taken (its latest checkpoint): set trainer.total_steps to 4 or more, or set another "
        "run_dir, or trainer.resume=never"
    )
    for total in (4, 10):
        assert check_run_dir(_cfg(run_dir, f"trainer.total_steps={total}")) is None


def test_resume_never_moves_the_old_run_aside_whole(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _a_run(run_dir)
    (run_dir / "warmstart" / "sft").mkdir(parents=True)
    (run_dir / "warmstart" / "sft" / "report.json").write_text("{}")
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    aside = check_run_dir(_cfg(run_dir, "seed=1", "trainer.resume=never"))
    assert aside == tmp_path / "run.old-1" and not run_dir.exists()
    after = {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()}
    assert after == before
    # The next one goes to the first free number; an empty or absent folder is not moved.
    _a_run(run_dir, "seed=1")
    assert check_run_dir(_cfg(run_dir, "trainer.resume=never")) == tmp_path / "run.old-2"
    assert check_run_dir(_cfg(run_dir, "trainer.resume=never")) is None
    run_dir.mkdir()
    assert check_run_dir(_cfg(run_dir, "trainer.resume=never")) is None


def test_a_folder_without_a_record_is_never_moved(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="holds files but no record of a ppoflow run"):
        check_run_dir(_cfg(tmp_path, "trainer.resume=never"))
    assert (tmp_path / "notes.txt").exists()


def test_a_folder_holding_only_its_record_is_started_again(tmp_path: Path) -> None:
    """A run refused on its inputs leaves only its record: nothing to protect."""
    write_record(_cfg(tmp_path))
    assert check_run_dir(_cfg(tmp_path, "seed=1")) is None


def test_the_warm_start_is_reused_only_with_the_settings_recorded_beside_it(
    tmp_path: Path,
) -> None:
    from flows.reward_model import _train_once
    from flows.run_record import sft_settings

    calls: list[int] = []

    def train(*, out_path: Path, seed: int) -> _Report:
        calls.append(seed)
        out_path.mkdir(parents=True, exist_ok=True)
        return _Report(heldout_accuracy=0.5 + seed)

    cfg = _cfg(tmp_path)
    out = tmp_path / "warmstart" / "sft"
    made = sft_settings(cfg)
    first = _train_once(out, train, made_with=made, run_dir=tmp_path, seed=0)
    again = _train_once(out, train, made_with=made, run_dir=tmp_path, seed=0)
    assert calls == [0] and again == first
    check_warm_start(cfg)
    for override, named in (
        ("seed=1", "seed was 0, now 1"),
        ("warmstart.sft_steps=6", "warmstart.sft_steps was 5, now 6"),
    ):
        other = _cfg(tmp_path, override)
        with pytest.raises(RunDirError) as err:
            _train_once(out, train, made_with=sft_settings(other), run_dir=tmp_path, seed=1)
        message = str(err.value)
        assert message.startswith(f"the warm start in {out} was made with other settings ({named})")
        assert message.endswith("and start over") and "trainer.resume=never" in message
        with pytest.raises(RunDirError, match=named):
            check_warm_start(other)  # the same refusal before any resource
    assert calls == [0]
    (out / "settings.json").unlink()  # a warm start with no record is never reused either
    with pytest.raises(RunDirError, match="has no record of the settings that made it"):
        _train_once(out, train, made_with=made, run_dir=tmp_path, seed=0)


def test_ppoflow_train_refuses_in_one_line_with_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_quiet_defaults", lambda: None)
    run_dir = tmp_path / "run"
    _a_run(run_dir)
    code = cli.main(["train", "--config", "tiny", f"run_dir={run_dir}", "seed=1"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith(f"ppoflow: the run in run_dir={run_dir} was")
    assert "seed was 0, now 1" in err and "trainer.resume=never" in err
