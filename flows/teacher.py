"""The distillation teacher of the built-in task's warm start (``warmstart.teacher``).

With ``algorithm.distill.coef > 0`` and no ``models.teacher``, a run on the built-in task trains
its teacher first:

1. The preset ``warmstart.teacher`` names (e.g. ``dapo``: GRPO with the exact rule) runs as a
   subflow in ``<run_dir>/warmstart/teacher``, from this run's own SFT policy and tokenizer, with
   this run's seed and its resources, store and orchestration settings.
2. Its final policy is exported (``flows.export``) to ``<run_dir>/warmstart/teacher/policy``,
   which becomes ``models.teacher``.

A finished teacher (its exported folder present) is reused by a resumed run; a teacher run
stopped half way resumes from its own checkpoints. The teacher's run is GRPO from the same
student start, so its held-out accuracy is also the baseline distillation is measured against.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from flows.export import export_policy
from flows.reward_model import ResolvedModels
from infra.config import TrainConfig, load_config


def teacher_dir(cfg: TrainConfig) -> Path:
    return cfg.resolved_run_dir / "warmstart" / "teacher"


def teacher_config(cfg: TrainConfig, models: ResolvedModels) -> TrainConfig:
    """The teacher's run: the ``warmstart.teacher`` preset from this run's SFT policy."""
    assert cfg.warmstart.teacher is not None
    teacher = load_config(
        cfg.warmstart.teacher,
        [
            f"seed={cfg.seed}",
            f"run_dir={teacher_dir(cfg)}",
            f"models.assets_dir={cfg.models.assets_dir}",
            f"models.policy={models.policy}",
            f"models.tokenizer={models.tokenizer}",
        ],
    )
    return teacher.model_copy(
        update={
            "resources": cfg.resources,
            "store": cfg.store,
            "orchestration": cfg.orchestration,
            "trainer": teacher.trainer.model_copy(
                update={"progress_bar": cfg.trainer.progress_bar, "loggers": ["jsonl"]}
            ),
        }
    )


def with_teacher(
    cfg: TrainConfig, models: ResolvedModels, train: Callable[[TrainConfig], dict[str, Any]]
) -> ResolvedModels:
    """``models`` with the teacher the run distills from: ``models.teacher``, else the one the
    warm start trains with ``train`` (the training flow; see the module docstring); unchanged
    without distillation."""
    if not cfg.algorithm.distills or models.teacher is not None:
        return models
    out = teacher_dir(cfg) / "policy"
    if not (out / "config.json").exists():
        logger = get_run_logger()
        tcfg = teacher_config(cfg, models)
        logger.info("warm start: training the distillation teacher (--config %s)", tcfg.name)
        summary = train(tcfg)
        logger.info("warm start: teacher held-out accuracy %s", summary["rule_accuracy_end"])
        partial = out.with_name("policy.partial")  # an export cut short is redone whole
        shutil.rmtree(partial, ignore_errors=True)
        export_policy(Path(summary["run_dir"]), out=partial)
        partial.rename(out)
    return replace(models, teacher=str(out))
