"""Evaluation of a training run, before a step's update every ``trainer.eval_every`` steps and
after the last step, through the ``validate`` task (tasks.validate.stage):

- the user's ``data.val_files``: ``rollout.val_n`` answers per prompt at
  ``rollout.val_temperature``, every reward of the run (``val-core/<data_source>/reward/mean@n``);
- the built-in task: one greedy answer to each held-out prompt, scored by the rule alone
  (``eval/rule_accuracy``, the honest metric beside the learned reward model's score).

Each evaluation shows its progress over its parts (generated, scored) as lines on stderr, at
least every 30 s while a part runs, and in the run's ``<run name>-eval`` progress artifact
(``flows.progress``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from flows.progress import run_artifact, step_phase_progress
from infra.data import PromptRow
from infra.progress import Progress
from tasks.context import Metrics, StageContext
from tasks.plan import Scoring
from tasks.validate.stage import Validation

Validate = Callable[[StageContext, Validation, int, Progress], Metrics]


class Evaluator:
    """Evaluates on ``val_rows`` (the user's validation prompts) or else on ``heldout`` (the
    built-in task's); neither: no evaluation. ``validate`` is the validate task as the run
    calls it (with its retries)."""

    def __init__(
        self,
        ctx: StageContext,
        validate: Validate,
        *,
        val_rows: list[PromptRow] | None,
        heldout: list[PromptRow],
    ) -> None:
        self.ctx, self.validate = ctx, validate
        rollout = ctx.cfg.rollout
        self.job: Validation | None = None
        if val_rows:
            self.job = Validation(
                rows=val_rows,
                n=rollout.val_n,
                temperature=rollout.val_temperature,
                # the training rewards, without the overlong penalty (a training batch's only)
                scoring=replace(ctx.plan.scoring, overlong=False),
            )
        elif heldout:
            # The rule alone, at weight 1: the held-out accuracy.
            rule = Scoring(
                model_weight=None, functions=False, rule=ctx.cfg.reward.rule, rule_weight=1
            )
            self.job = Validation(rows=heldout, n=1, temperature=0.0, scoring=rule)
        self.rule_only = not val_rows
        self.artifact = run_artifact(
            ctx.cfg, "eval", "evaluation, parts done (generated, scored)", recurring=True
        )

    @property
    def enabled(self) -> bool:
        return self.job is not None

    def due(self, step: int) -> bool:
        return self.enabled and step % self.ctx.cfg.trainer.eval_every == 0

    def __call__(self, step: int) -> Metrics:
        if self.job is None:
            return {}
        job = self.job
        label = f"evaluation at step {step} ({len(job.rows)} prompts x {job.n}), generate+score"
        progress = step_phase_progress(label, self.artifact)
        with progress.heartbeat():
            metrics = self.validate(self.ctx, job, step, progress)
        if self.rule_only:  # the built-in task reports its rule accuracy alone
            return {"eval/rule_accuracy": metrics["eval/rule_accuracy"]}
        return metrics
