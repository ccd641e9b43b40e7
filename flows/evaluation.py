"""Evaluation of a training run, before a step's update every ``trainer.eval_every`` steps and
after the last step.

- the user's ``data.val_files``: the ``validate`` task (``val-core/<data_source>/reward/mean@n``);
- the built-in task: greedy answers to its held-out prompts checked by the rule
  (``eval/rule_accuracy``, the honest metric beside the learned reward model's score), through
  the store like a step's (partition ``eval/step-<N>``, cleared at the end).
"""

from __future__ import annotations

from typing import Any

from tasks.context import StageContext
from tasks.generate.stage import generate_partition, submit_prompts
from tasks.score.stage import score_rows


class Evaluator:
    """Evaluates on ``val_rows`` (the user's validation prompts) or else on ``heldout`` (the
    built-in task's); neither: no evaluation."""

    def __init__(
        self, ctx: StageContext, validate: Any, *, val_rows: list[Any] | None, heldout: list[Any]
    ) -> None:
        self.ctx, self.validate = ctx, validate
        self.val_rows, self.heldout = val_rows, heldout

    @property
    def enabled(self) -> bool:
        return bool(self.val_rows) or bool(self.heldout)

    def due(self, step: int) -> bool:
        return self.enabled and step % self.ctx.cfg.trainer.eval_every == 0

    def __call__(self, step: int) -> dict[str, float]:
        if self.val_rows:
            return dict(self.validate(self.ctx, self.val_rows, step))
        return self.rule_accuracy(step)

    def rule_accuracy(self, step: int) -> dict[str, float]:
        """The built-in task's greedy rule accuracy on its held-out prompts."""
        ctx = self.ctx
        partition = f"eval/step-{step:06d}"
        ctx.store.kv_clear(partition)  # a retried evaluation starts from nothing
        try:
            meta = submit_prompts(ctx, partition_id=partition, rows=self.heldout, n=1)
            meta = generate_partition(ctx, meta, seed=0, n=1, temperature=0.0)
            parts = ctx.rollout_group.run_sharded(
                score_rows,
                meta,
                skip_empty=True,
                rule=ctx.cfg.reward.rule,
                texts=False,
                model=False,
            )
        finally:
            ctx.store.kv_clear(partition)
        correct = [v for p in parts for v in p.rule or ()]
        return {"eval/rule_accuracy": sum(correct) / len(correct)}
