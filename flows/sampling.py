"""A step's rollout: generate → score, and with dynamic sampling (``algorithm.filter_groups``)
filter → refill rounds until the step has its groups.

Round 0 generates and scores the step's submitted prompts. With filtering on, the ``filter``
task then keeps the groups whose metric spreads and removes the other rows from the partition;
while fewer than ``rollout.prompts_per_step`` groups are kept and fewer than ``max_rounds``
rounds ran, the next round draws further prompts from the data cursor (``Draw``: no prompt is
drawn twice in an epoch), generates and scores only those rows, and filters again with the
groups already kept first. Kept rows are never scored twice; a step that ends short trains on
what it kept and says so in ``filter/*``.

The training loop (``sync``, ``colocate_async``) and the ``separate_async`` producer both run a
step's rollout through ``Sampler``, so the rounds are the same in every mode, with the reward
model wherever the mode puts it (it wakes for each round's scoring).

With filtering on, each round's filter reports the groups kept out of ``prompts_per_step`` to
the run's ``<run name>-refill`` progress artifact and as lines on stderr (``flows.progress``).
The lines wait until the step's sampling has run one line interval (30 s), then come at least
that often until the step has its groups: a filtered run refills nearly every step, and the
step's ``filter/*`` metrics already say how its rounds went, so a line per round would double
a fast run's log; a slow step is when a user needs to see that it is still refilling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prefect import get_run_logger

from flows.progress import run_artifact, step_phase_progress
from flows.stages import filter_groups, generate, score
from infra.progress import Progress
from storage import BatchMeta
from tasks.context import Metrics, StageContext, StageResult, Timings
from tasks.filter.core import refill_size
from tasks.filter.stage import FilterJob

if TYPE_CHECKING:
    from flows.retry import RetryOptions

Draw = Callable[[int, int, int], BatchMeta]  # (step, round, prompts) → the new rows' handle

GENERATED = "rollout/generated_samples"  # responses generated for the step, every round's
SUMMED = ("perf/total_num_tokens",)


def merge_rounds(rounds: list[tuple[int, Metrics]]) -> Metrics:
    """One step's score metrics from its rounds' (each with its row count): ``*/max`` and
    ``*/min`` over the rounds, ``perf/total_num_tokens`` summed, the rest weighted by rows;
    and the responses generated in all (``rollout/generated_samples``)."""
    total = sum(rows for rows, _ in rounds)
    out: Metrics = {}
    for key in dict.fromkeys(k for _, m in rounds for k in m):
        have = [(rows, m[key]) for rows, m in rounds if key in m]
        if key.endswith("/max"):
            out[key] = max(v for _, v in have)
        elif key.endswith("/min"):
            out[key] = min(v for _, v in have)
        elif key in SUMMED:
            out[key] = sum(v for _, v in have)
        else:
            out[key] = sum(rows * v for rows, v in have) / max(sum(r for r, _ in have), 1)
    out[GENERATED] = float(total)
    return out


class Sampler:
    """Runs one step's rollout (see the module docstring)."""

    def __init__(self, ctx: StageContext, retry: RetryOptions, draw: Draw) -> None:
        self.ctx, self.retry, self.draw = ctx, retry, draw
        self.artifact = run_artifact(
            ctx.cfg, "refill", "dynamic sampling, groups kept", recurring=True
        )

    def __call__(self, metas: list[BatchMeta], step: int, timed: Timings) -> StageResult:
        """Generate ``metas`` (the step's partition first; colocate_async: later steps' too),
        score the step's rows, and filter and refill when the config asks for it."""
        if not self.ctx.cfg.algorithm.filter_groups.enabled:
            scored = self._first_round(metas, step, timed)
            generated = float(len(scored.meta.keys))
            return StageResult(scored.meta, {**scored.metrics, GENERATED: generated})
        label = f"dynamic sampling of step {step}, groups kept"
        progress = step_phase_progress(label, self.artifact, quiet=True)
        with progress.heartbeat():  # its clock starts with the step's sampling
            return self._rounds(self._first_round(metas, step, timed), step, timed, progress)

    def _first_round(self, metas: list[BatchMeta], step: int, timed: Timings) -> StageResult:
        """Round 0: generate and score the submitted prompts."""
        ctx, retry = self.ctx, self.retry
        with timed("generate"):
            meta = generate.with_options(**retry)(ctx, metas, step)[0]
        with timed("score"):
            return score.with_options(**retry)(ctx, meta, step)

    def _rounds(
        self, first: StageResult, step: int, timed: Timings, progress: Progress
    ) -> StageResult:
        """Filter round 0's groups and refill until the step has its groups (the module
        docstring); ``progress`` gets the groups kept after each round."""
        ctx, retry = self.ctx, self.retry
        settings = ctx.cfg.algorithm.filter_groups
        want = ctx.cfg.rollout.prompts_per_step
        n = ctx.cfg.rollout.n
        rounds = [(len(first.meta.keys), first.metrics)]
        candidates, kept = first.meta, 0
        judged = dropped = 0
        for r in range(settings.max_rounds):
            # 1. Filter this round's rows after the groups already kept.
            with timed("filter"):
                cut = filter_groups.with_options(**retry)(
                    ctx, FilterJob(candidates, want=want, round=r), step
                )
            judged += len(candidates.keys) // n - kept
            dropped += len(cut.choice.dropped)
            kept = len(cut.choice.kept)
            progress(kept, want)
            if kept >= want or r + 1 == settings.max_rounds:
                break
            # 2. The next round: further prompts, generated and scored on their own.
            size = refill_size(missing=want - kept, kept=kept, judged=judged, cap=want)
            new = self.draw(step, r + 1, size)
            name = f"[step={step}, round={r + 1}]"
            with timed("generate"):
                refill = generate.with_options(**retry, task_run_name=f"generate{name}")
                new = refill(ctx, [new], step, round=r + 1)[0]
            with timed("score"):
                rescore = score.with_options(**retry, task_run_name=f"score{name}")
                more = rescore(ctx, new, step, round=r + 1)
            rounds.append((len(more.meta.keys), more.metrics))
            candidates = BatchMeta(
                cut.meta.partition_id, cut.meta.keys + more.meta.keys, more.meta.fields
            )
        metrics = merge_rounds(rounds)
        metrics.update(
            {
                "filter/kept_groups": float(kept),
                "filter/dropped_groups": float(dropped),
                "filter/rounds": float(len(rounds)),
            }
        )
        if kept < want:
            get_run_logger().warning(
                "step %d: dynamic sampling kept %d of %d groups in %d round(s) "
                "(algorithm.filter_groups.max_rounds=%d); training on what was kept",
                step,
                kept,
                want,
                len(rounds),
                settings.max_rounds,
            )
        return StageResult(cut.meta.with_fields(*first.meta.fields), metrics)
