"""A run folder belongs to one run: its record, the check of a new run against it, and
``trainer.resume=never``'s moving aside.

``<run_dir>/config.yaml`` records the resolved config the run was started with; every flow run
that continues it rewrites it, the same in every setting that changes the result.
``check_run_dir(cfg)`` runs before any resource is taken (in ``ppoflow train`` before Prefect and
Ray start, and first thing in the training flow):

- ``trainer.resume=auto``: a run_dir holding a run (its record and anything beside it) whose
  recorded settings differ from ``cfg``'s in a setting outside ``MAY_CHANGE_ON_RESUME``
  (``infra.config``) is refused with a one-line ``RunDirError`` naming the first differing keys
  with both values and the two ways out; so is a ``trainer.total_steps`` below the steps the
  latest checkpoint holds. A setting the record lacks (added to ppoflow after the run started)
  counts as its default.
- ``trainer.resume=never``: whatever run_dir holds is moved to ``<run_dir>.old-<N>`` (the first
  free N); nothing is deleted, and the run starts over in an empty folder.

The warm start's parts carry records of their own (``warmstart_parts``, ``check_part``): a part
made with other settings is refused the same way, never reused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra.config import MAY_CHANGE_ON_RESUME, ConfigError, TrainConfig

RECORD = "config.yaml"
PART_RECORD = "settings.json"  # beside a warm-start part's report.json
SHOWN = 3  # differences a refusal names; the rest are counted


class RunDirError(ConfigError):
    """run_dir holds a run (or a warm start) made with other settings; the message names the
    settings and the ways out."""


@dataclass(frozen=True)
class Difference:
    """One setting whose recorded value differs from the new run's."""

    key: str
    recorded: Any
    current: Any

    def __str__(self) -> str:
        return f"{self.key} was {_shown(self.recorded)}, now {_shown(self.current)}"


def _shown(value: Any, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def may_change(key: str) -> bool:
    """Whether the dotted ``key`` may differ between a run and its continuation."""
    return any(key == p or key.startswith(p + ".") for p in MAY_CHANGE_ON_RESUME)


def differences(
    recorded: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any], prefix: str = ""
) -> list[Difference]:
    """The dotted settings whose values differ, in the config's order; sections present on both
    sides are compared key by key, anything else whole. A key the record lacks is compared as
    its default (skipped when it has none); a key only the record has is no setting any more."""
    out: list[Difference] = []
    for key, value in current.items():
        dotted = f"{prefix}{key}"
        if key in recorded:
            old = recorded[key]
        elif key in defaults:
            old = defaults[key]
        else:
            continue
        if isinstance(old, dict) and isinstance(value, dict):
            nested = defaults.get(key)
            out += differences(old, value, nested if isinstance(nested, dict) else {}, dotted + ".")
        elif old != value:
            out.append(Difference(dotted, old, value))
    return out


def result_differences(recorded: dict[str, Any], cfg: TrainConfig) -> list[Difference]:
    """The differences between a recorded config and ``cfg`` that change the result."""
    defaults = TrainConfig().model_dump(mode="json")
    found = differences(recorded, cfg.model_dump(mode="json"), defaults)
    return [d for d in found if not may_change(d.key)]


def aside_path(run_dir: Path) -> Path:
    """``<run_dir>.old-<N>`` with the first N (from 1) that does not exist."""
    n = 1
    while (aside := run_dir.with_name(f"{run_dir.name}.old-{n}")).exists():
        n += 1
    return aside


def ways_out(run_dir: Path, what: str = "that run") -> str:
    return (
        f"set another run_dir, or trainer.resume=never to move {what} to {aside_path(run_dir)} "
        "and start over"
    )


def refusal(run_dir: Path, subject: str, found: list[Difference], what: str = "that run") -> str:
    """One line: ``subject`` (e.g. "the run in ... was started") with other settings, the first
    ``SHOWN`` of them, and the ways out."""
    shown = "; ".join(str(d) for d in found[:SHOWN])
    more = f"; {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    return f"{subject} with other settings ({shown}{more}): {ways_out(run_dir, what)}"


def holds_run(run_dir: Path) -> bool:
    """run_dir holds something of a run: anything beside its record."""
    return run_dir.is_dir() and any(p.name != RECORD for p in run_dir.iterdir())


def read_record(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / RECORD
    if not path.is_file():
        return None
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RunDirError(
            f"{path} is not valid YAML ({getattr(exc, 'problem', None) or exc}): "
            f"{ways_out(run_dir)}"
        ) from None
    return loaded if isinstance(loaded, dict) else None


def _steps_done(run_dir: Path) -> int | None:
    """Steps the latest complete checkpoint holds (None: no checkpoint)."""
    from flows.checkpoint import latest_checkpoint, read_state

    latest = latest_checkpoint(run_dir)
    return None if latest is None else read_state(latest).step + 1


def check_run_dir(cfg: TrainConfig) -> Path | None:
    """Refuse a run_dir holding a run ``cfg`` may not continue; with ``trainer.resume=never``
    move what it holds aside. Returns the folder it was moved to (None: nothing moved)."""
    run_dir = cfg.resolved_run_dir
    if cfg.trainer.resume == "never":
        if not holds_run(run_dir):
            return None
        if not (run_dir / RECORD).is_file():
            raise RunDirError(
                f"run_dir={run_dir} holds files but no record of a ppoflow run ({RECORD}), so "
                "trainer.resume=never does not move it aside: set another run_dir"
            )
        aside = aside_path(run_dir)
        run_dir.rename(aside)
        return aside
    if not holds_run(run_dir):
        return None
    recorded = read_record(run_dir)
    if recorded is not None:
        found = result_differences(recorded, cfg)
        if found:
            raise RunDirError(refusal(run_dir, f"the run in run_dir={run_dir} was started", found))
    done = _steps_done(run_dir)
    if done is not None and cfg.trainer.total_steps < done:
        raise RunDirError(
            f"trainer.total_steps={cfg.trainer.total_steps} is below the {done} steps the run in "
            f"run_dir={run_dir} has already taken (its latest checkpoint): set "
            f"trainer.total_steps to {done} or more, or {ways_out(run_dir)}"
        )
    return None


def write_record(cfg: TrainConfig) -> None:
    """Record ``cfg`` as the run's config (``<run_dir>/config.yaml``)."""
    run_dir = cfg.resolved_run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RECORD).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


# ---------------------------------------------------------------------- the warm start's parts
def _assets_format(cfg: TrainConfig) -> int:
    """The format version of the tiny assets the warm start trains on (their builder's)."""
    if cfg.data.builtin_task == "agent":
        from infra.agent_task import FORMAT_VERSION

        return FORMAT_VERSION
    from infra.assets import ASSETS_FORMAT_VERSION

    return ASSETS_FORMAT_VERSION


def sft_settings(cfg: TrainConfig) -> dict[str, Any]:
    """What makes the supervised warm start: the seed (its assets' too), the task, the budget."""
    return {
        "seed": cfg.seed,
        "data.builtin_task": cfg.data.builtin_task,
        "assets.format_version": _assets_format(cfg),
        "warmstart.sft_steps": cfg.warmstart.sft_steps,
        "warmstart.sft_max_seconds": cfg.warmstart.sft_max_seconds,
    }


def reward_model_settings(cfg: TrainConfig) -> dict[str, Any]:
    """What makes each warm-start reward model: its SFT policy's settings and its own budget
    (the member is its folder)."""
    return {
        **sft_settings(cfg),
        "warmstart.rm_steps": cfg.warmstart.rm_steps,
        "warmstart.rm_max_seconds": cfg.warmstart.rm_max_seconds,
    }


def warmstart_parts(cfg: TrainConfig) -> dict[Path, dict[str, Any]]:
    """The warm-start parts ``cfg`` trains, by folder, with the settings that make each."""
    if not cfg.warm_start:
        return {}
    root = cfg.resolved_run_dir / "warmstart"
    parts = {root / "sft": sft_settings(cfg)}
    if not cfg.models.reward_models and cfg.uses_reward_model:
        for k in range(cfg.warmstart.rm_ensemble):
            parts[root / ("reward_model" if k == 0 else f"reward_model_{k}")] = (
                reward_model_settings(cfg)
            )
    return parts


def check_part(out: Path, settings: dict[str, Any], run_dir: Path) -> None:
    """A finished warm-start part (``out/report.json``) is reused only when its record says it
    was made with ``settings``; otherwise ``RunDirError`` names the first differences."""
    if not (out / "report.json").exists():
        return
    where = f"the warm start in {out}"
    what = "that run (its warm start included)"
    path = out / PART_RECORD
    if not path.is_file():
        raise RunDirError(
            f"{where} has no record of the settings that made it ({PART_RECORD}), so it cannot "
            f"be reused: {ways_out(run_dir, what)}"
        )
    recorded = json.loads(path.read_text())
    found = [
        Difference(key, recorded.get(key), value)
        for key, value in settings.items()
        if recorded.get(key) != value
    ]
    if found:
        raise RunDirError(refusal(run_dir, f"{where} was made", found, what))


def check_warm_start(cfg: TrainConfig) -> None:
    """Every finished warm-start part ``cfg`` would reuse was made with ``cfg``'s settings."""
    for out, settings in warmstart_parts(cfg).items():
        check_part(out, settings, cfg.resolved_run_dir)


def record_part(out: Path, settings: dict[str, Any]) -> None:
    """Record the settings that made a warm-start part, beside its report."""
    out.mkdir(parents=True, exist_ok=True)
    (out / PART_RECORD).write_text(json.dumps(settings, indent=1) + "\n")
