"""``ppoflow config``: the resolved config as YAML, exit 0; a bad config is one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows import cli
from infra.config import TrainConfig, load_config


@pytest.fixture(autouse=True)
def keep_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's environment defaults would outlive the call in this process."""
    monkeypatch.setattr(cli, "_quiet_defaults", lambda: None)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["config", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_no_config_prints_the_main_job(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys)
    assert (code, err) == (0, "")
    main_job = TrainConfig().model_dump(mode="json")
    main_job["warmstart"]["rm_ensemble"] = 2  # the main job's ensemble (preset default)
    main_job["reward"]["uncertainty_penalty"] = 1.0
    main_job["algorithm"]["norm_by_std"] = False  # and its RL settings
    main_job["actor"]["lr_schedule"] = "cosine"
    main_job["trainer"]["total_steps"] = 100
    assert yaml.safe_load(out) == main_job
    assert out.startswith("name: default\n")  # the config's own field order


def test_the_default_preset_prints_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "--config", "default") == run(capsys)


def test_a_printed_config_is_the_run_again(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, _ = run(capsys, "--config", "tiny", "trainer.total_steps=2", "rollout.n=2")
    assert code == 0
    saved = tmp_path / "resolved.yaml"
    saved.write_text(out)
    expected = load_config("tiny", ["trainer.total_steps=2", "rollout.n=2"])
    assert load_config(saved) == expected
    assert run(capsys, "--config", str(saved)) == (0, out, "")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["rollout.n=0"], "rollout.n"),
        (["store.url=memory://"], "store.url"),
        (["--config", "no-such-preset"], "no-such-preset"),
        (["rollout.n"], "key=value"),
    ],
)
def test_a_bad_config_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], names: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("ppoflow: ") and err.count("\n") == 1 and names in err
