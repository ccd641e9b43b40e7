"""score: the reward model, an LLM judge and/or reward functions, one score per sample.

The per-sample score is

    scores = reward.model_weight * rm + reward.judge.weight * judge
             + Σ weight_i * function_i (+ reward.rule_weight * rule)

    rm = mean − reward.uncertainty_penalty × std over the reward-model ensemble's members
               (one model: its score)

- the scoring workers (the reward pool's, else the rollout pool's) each take a shard of the
  batch and run the declared steps the batch asks for (``scoring_steps``, ``tasks.step``), which
  read ``prompt_ids``, ``response_ids``, ``raw_prompt`` (and ``ground_truth`` for the rule) from
  the store in one get; the reward model, when the worker holds one, rebuilds right-padded
  masks from the lengths, re-renders the conversation from ``raw_prompt`` with the RM's own chat
  template when its tokenizer differs, and scores the last real token with every member of an
  ensemble (``models.reward_model`` a list), combined by ``tasks.score.core.ensemble_scores``;
  the worker writes ``rm_scores`` (jagged: that score on the last real response token, an empty
  row for an empty response, never a score at index -1) and sends back its per-sample scalars
  (``score_rows``). The reward model sleeps again whatever happens (the worker's wake/sleep
  block).
- the LLM judge (``reward.judge``, ``infra.judge``), when the worker holds one, renders its
  prompt from each sample's question, decoded response, ``ground_truth`` and ``data_source`` and
  generates a verdict (at most ``reward.judge.max_new_tokens`` tokens, within the worker call's
  ``orchestration.call_timeout_s``) after the reward model has gone back to sleep; the worker
  sends the verdict texts back and the task parses them (``infra.judge.judge_scores``: a parse
  that gives None scores ``reward.judge.on_parse_error`` and counts in
  ``reward/judge/parse_failures``, the fraction of the batch's samples; a parse function that
  raises fails the task with ``JudgeParseError``, nothing written) and writes ``judge_verdicts``.
- reward functions (verl's ``compute_score`` signature) run in the flow's bounded pool of
  processes, each call bounded by ``reward.function_timeout_s`` (``infra.reward_functions``):
  they get the decoded responses from the workers and read ``ground_truth``, ``data_source``
  and ``extra_info`` from the store.
- the built-in task's rule (``reward.rule``) is computed on the workers as the honest metric.
- on-policy distillation (``algorithm.distill``): the teacher, when the worker holds it, scores
  each sampled token (``teacher_logprobs``, after the reward model has gone back to sleep); the
  advantage stage and the update use them, no score comes of them here.
- multi-turn rollouts (``rollout.multi_turn``): the rule, the judge and the reward functions
  read the conversation's final assistant message (``infra.agent_loop.final_answer`` of the
  stored ``messages``) in place of the whole decoded response, and reward functions get the
  conversation, tool calls and results included, in ``extra_info["messages"]``.

Every reward is one ``Reward`` record of ``REWARDS`` (its name, its weight for the batch's
``Scoring``, how its values are gathered from the workers' replies); ``compute_scores`` adds up
those the batch asks for, in that order. A training batch's also loses the overlong penalty
(``reward.overlong_buffer``, ``tasks.score.core.overlong_penalty``; validation scores do not).
With ``rollout.mask_truncated`` the task writes ``truncated`` (dense bool: the response was cut
at ``rollout.max_new_tokens`` without EOS, ``truncated_rows`` on the workers, which know the EOS
ids) for the update to leave those rows out of the actor's loss.

The task then writes ``scores`` (and ``rule_scores``, ``judge_verdicts``, ``truncated``) and
``reward_parts``: per sample, each part's unweighted value by name (``rm``, ``judge``, ``rule``,
``fn/<name>`` with the names of the ``reward/fn/<name>/mean`` metrics, ``overlong_penalty``),
which validation, dynamic sampling and the saved samples read; an ensemble adds ``rm_mean`` and
``rm_std`` (its members' mean and standard deviation; ``rm`` is the combined score).

A NaN/inf reward-model score fails the worker's shard naming its sample keys before it writes
anything, and a failing reward function fails the task; ``scores`` is written only when every
part succeeded. Rows already scored (a partition checkpointed in flight by ``separate_async``'s
producer, then resumed) are not scored again.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from infra.group import WorkerGroup
from infra.workers import ModelWorker, Role
from storage import BatchMeta
from tasks.context import Metrics, StageContext, StageResult, faults_at
from tasks.io import lengths, nested, read, rows, write
from tasks.logprobs.stage import TEACHER_STEP
from tasks.plan import Scoring
from tasks.rewards import RULES
from tasks.score.core import (
    assemble_rm_scores,
    ensemble_scores,
    find_nonfinite,
    overlong_penalty,
    score_metrics,
    truncated_rows,
)
from tasks.step import Shard, WorkerStep, run_steps

if TYPE_CHECKING:
    from infra.judge import JudgeScores
    from infra.judge_model import Judge
    from infra.reward_functions import FunctionScores
    from infra.reward_model import RewardScorer

FUNCTION_READS = ("ground_truth", "data_source", "extra_info")  # in the flow process


class NonFiniteScoreError(ValueError):
    """The reward model returned NaN or inf; nothing was written for the batch."""


@dataclass
class ShardScores:
    """A scoring worker's reply for its shard: per-sample scalars, no token data."""

    response_lengths: list[int]
    response_truncated: list[bool]  # cut at rollout.max_new_tokens without EOS
    rm: list[float] | None = None  # the reward model's score, when the worker holds one
    rm_mean: list[float] | None = None  # its ensemble's mean over members
    rm_std: list[float] | None = None  # and standard deviation (0 for one model)
    rm_members: int = 0  # the ensemble's size
    truncated: int = 0  # samples whose reward-model input was cut to reward.max_length
    rule: list[float] | None = None  # reward.rule against ground_truth, when asked
    texts: list[str] | None = None  # decoded responses, when reward functions need them
    verdicts: list[str] | None = None  # the LLM judge's, when asked


def score_rows(
    worker: ModelWorker,
    shard: BatchMeta,
    *,
    rule: str | None,
    texts: bool,
    model: bool = True,
    judge: bool = False,
    teacher: bool = False,
) -> ShardScores:
    """Worker side: the declared scoring steps the batch asks for (``scoring_steps``) over my
    samples, and their reply; raises NonFiniteScoreError, writing nothing, on a NaN/inf
    reward-model score."""
    model = model and worker.has("reward")
    asked: dict[Role, bool] = {"judge": judge, "teacher": teacher}
    for role, wanted in asked.items():
        if wanted and not worker.has(role):
            raise ValueError(
                f"the {role} was asked to score but worker {worker.spec.rank} (roles "
                f"{', '.join(worker.spec.roles)}) holds none"
            )
    steps = scoring_steps(
        worker.cfg.rollout.multi_turn,
        shard,
        seed=worker.cfg.seed,
        rule=rule,
        texts=texts,
        model=model,
        judge=judge,
        teacher=teacher,
    )
    ran = run_steps(worker, shard, steps)
    out, metrics = ran.returned, ran.metrics
    reply = ShardScores(
        response_lengths=out.need("response_lengths").tolist(),
        response_truncated=out.need("truncated").tolist(),
        texts=out.objects("response_text") if texts else None,
        verdicts=out.objects("judge_verdicts") if judge else None,
        rule=out.need("rule_scores").tolist() if rule else None,
    )
    if model:
        reply.rm, reply.truncated = out.need("rm").tolist(), int(metrics["rm/truncated"])
        reply.rm_mean, reply.rm_std = out.need("rm_mean").tolist(), out.need("rm_std").tolist()
        reply.rm_members = int(metrics["rm/members"])
    return reply


def scoring_steps(
    multi_turn: bool,
    meta: BatchMeta,
    *,
    seed: int,
    rule: str | None,
    texts: bool,
    model: bool,
    judge: bool,
    teacher: bool,
) -> tuple[WorkerStep, ...]:
    """The declared steps that score ``meta``'s samples, in order (one store read for all):

    1. ``score/lengths``: returns each response's length (``response_lengths``) and whether it
       was cut at ``rollout.max_new_tokens`` without EOS (``truncated``).
    2. ``score/rm`` (if ``model``): the reward model, awake → writes ``rm_scores``, returns
       ``rm``, ``rm_mean``, ``rm_std``.
    3. ``teacher_logprobs`` (if ``teacher``): the distillation teacher's declared step
       (``TEACHER_STEP``) → writes ``teacher_logprobs``.
    4. ``score/decode`` (if the judge, the rule or reward functions need texts): the responses
       (a conversation's final answer) as ``response_text``.
    5. ``score/judge`` (if ``judge``): the judge, awake → returns ``judge_verdicts``.
    6. ``score/rule`` (if ``rule``): ``RULES[rule]`` → returns ``rule_scores``.
    """
    conversation = ("messages",) if multi_turn else ()
    measured = ("response_lengths", "truncated")
    steps = [WorkerStep("score/lengths", ("response_ids",), None, _measured, (), measured)]
    if model:
        reads = ("prompt_ids", "response_ids", "raw_prompt", *conversation)
        compute = functools.partial(_reward_model_scores, meta=meta, multi_turn=multi_turn)
        steps.append(WorkerStep("score/rm", reads, "reward", compute, ("rm_scores",), RM_RETURNS))
    if teacher:
        steps.append(TEACHER_STEP)
    if rule or texts or judge:
        reads = conversation or ("response_ids",)
        steps.append(WorkerStep("score/decode", reads, None, _decoded, (), ("response_text",)))
    if judge:
        where = f"{meta.partition_id}/{meta.keys[0] if meta.keys else ''}"
        compute = functools.partial(_judge_verdicts, seed=seed + zlib.crc32(where.encode()))
        steps.append(
            WorkerStep("score/judge", JUDGE_READS, "judge", compute, (), ("judge_verdicts",))
        )
    if rule:
        compute = functools.partial(_rule_scores, rule=rule)
        reads = ("response_text", "ground_truth")
        steps.append(WorkerStep("score/rule", reads, None, compute, (), ("rule_scores",)))
    return tuple(steps)


RM_RETURNS = ("rm", "rm_mean", "rm_std")
JUDGE_READS = ("raw_prompt", "response_text", "ground_truth", "data_source")


def _measured(worker: ModelWorker, _: None, shard: Shard) -> tuple[Shard, Metrics]:
    """Each response's length, and whether it was cut at ``rollout.max_new_tokens`` without
    EOS."""
    cut = truncated_rows(
        response_ids=rows(shard.need("response_ids")),
        eos_ids=worker.eos_ids,
        max_new_tokens=worker.cfg.rollout.max_new_tokens,
    )  # (B,)
    n = lengths(shard.need("response_ids"))  # (B,)
    return Shard(truncated=cut, response_lengths=n, batch_size=shard.batch_size), {}


def _reward_model_scores(
    worker: ModelWorker,
    scorer: RewardScorer,
    shard: Shard,
    *,
    meta: BatchMeta,
    multi_turn: bool,
) -> tuple[Shard, Metrics]:
    """The reward model (one or an ensemble) scores the samples (a multi-turn rollout's
    ``messages`` are the conversations, for a reward model with its own template): ``rm_scores``
    (the ensemble's score on each response's last token) and the per-sample ``rm``,
    ``rm_mean``, ``rm_std``; raises NonFiniteScoreError on a NaN/inf, naming the samples'
    keys (``meta``'s)."""
    scored = scorer.score(
        prompt_ids=rows(shard.need("prompt_ids")),
        response_ids=rows(shard.need("response_ids")),
        raw_prompt=shard.objects("raw_prompt"),
        conversations=shard.objects("messages") if multi_turn else None,
    )
    ensemble = ensemble_scores(
        scored.member_scores, uncertainty_penalty=worker.cfg.reward.uncertainty_penalty
    )
    rm = ensemble.score  # (B,)
    bad = find_nonfinite(rm)
    if bad:
        named = [meta.keys[i] for i in bad]
        raise NonFiniteScoreError(
            f"reward model returned non-finite scores for {len(named)} sample(s) in "
            f"{meta.partition_id}: {named[:8]}{' …' if len(named) > 8 else ''}; "
            "nothing was written"
        )
    n = lengths(shard.need("response_ids"))  # (B,)
    out = Shard(
        rm_scores=nested(assemble_rm_scores(rm, n)),
        rm=rm,
        rm_mean=ensemble.mean,
        rm_std=ensemble.std,
        batch_size=shard.batch_size,
    )
    counts = {
        "rm/truncated": float(scored.truncated.sum()),
        "rm/members": float(scored.member_scores.shape[1]),
    }
    return out, counts


def _decoded(worker: ModelWorker, _: None, shard: Shard) -> tuple[Shard, Metrics]:
    """The responses as text; a multi-turn rollout's is its conversation's final answer (of
    its ``messages``)."""
    if worker.cfg.rollout.multi_turn:
        from infra.agent_loop import final_answer

        texts = [final_answer(chat) for chat in shard.objects("messages")]
    else:
        ids = [r.tolist() for r in rows(shard.need("response_ids"))]
        texts = list(worker.tokenizer.batch_decode(ids, skip_special_tokens=True))
    return Shard(response_text=texts, batch_size=shard.batch_size), {}


def _judge_verdicts(
    worker: ModelWorker, judge: Judge, shard: Shard, *, seed: int
) -> tuple[Shard, Metrics]:
    """The judge's verdict on each sample. Sampling (``reward.judge.temperature`` > 0) is
    seeded by the run's seed, the partition and the shard's first key, so a retried shard
    samples the same verdicts."""
    from infra.judge import JudgeInput, question_text

    samples = [
        JudgeInput(
            question=question_text(prompt),
            response=text,
            ground_truth=truth,
            data_source=str(source),
        )
        for prompt, text, truth, source in zip(
            shard.objects("raw_prompt"),
            shard.objects("response_text"),
            shard.objects("ground_truth"),
            shard.objects("data_source"),
            strict=True,
        )
    ]
    verdicts = judge.verdicts(samples, seed=seed)
    return Shard(judge_verdicts=verdicts, batch_size=shard.batch_size), {}


def _rule_scores(worker: ModelWorker, _: None, shard: Shard, *, rule: str) -> tuple[Shard, Metrics]:
    """``RULES[rule]`` of each decoded response against its ground truth."""
    scores = rule_on_texts(rule, shard.objects("response_text"), shard.objects("ground_truth"))
    return Shard(rule_scores=scores, batch_size=shard.batch_size), {}


def rule_on_texts(rule: str, texts: list[str], ground_truth: list[object]) -> torch.Tensor:
    """``RULES[rule]`` of each decoded response against its ground truth, (B,) float32."""
    check = RULES[rule]
    return torch.tensor(
        [check(t, str(g)) for t, g in zip(texts, ground_truth, strict=True)], dtype=torch.float32
    )


@dataclass
class Scores:
    """Per-sample scores of one batch: the weighted total, each reward's unweighted parts by
    name (``named``: the one part vocabulary of scoring, validation, saved samples and the
    filter, see ``REWARDS``), the fields the rewards store beside ``scores`` and the metrics."""

    total: torch.Tensor  # (B,)
    response_lengths: torch.Tensor  # (B,)
    response_truncated: torch.Tensor  # (B,) bool
    named: dict[str, torch.Tensor] = field(default_factory=dict)  # (B,) each
    fields: dict[str, object] = field(default_factory=dict)  # rule_scores, judge_verdicts
    metrics: Metrics = field(default_factory=dict)

    def named_parts(self) -> dict[str, list[float]]:
        """Each part's values by name."""
        return {name: values.tolist() for name, values in self.named.items()}

    def parts(self) -> list[dict[str, float]]:
        """Per sample, each part's value by name (``reward_parts``)."""
        named = self.named_parts()
        return [
            {name: float(values[i]) for name, values in named.items()}
            for i in range(len(self.total))
        ]


@dataclass(frozen=True)
class Gathered:
    """One reward's share of a batch's score: its parts' unweighted values (B,) by name, what it
    adds to the total (B,), its metrics and the fields it stores beside ``scores``."""

    named: dict[str, torch.Tensor]
    weighted: torch.Tensor
    metrics: Metrics
    fields: dict[str, object] = field(default_factory=dict)


Gather = Callable[["StageContext", BatchMeta, list[ShardScores], float], Gathered]


@dataclass(frozen=True)
class Reward:
    """One reward of the per-sample score, as every reward is: its name, its weight in the
    total for a batch's ``Scoring`` (None: the batch is not scored by it) and how its values
    are gathered, in the flow process, from the scoring workers' replies (``ShardScores``)."""

    name: str
    weight: Callable[[Scoring], float | None]
    gather: Gather


def _joined(
    replies: list[ShardScores], pick: Callable[[ShardScores], list[float] | None]
) -> torch.Tensor:
    """One per-sample list of the replies (in shard order) as a (B,) float32 tensor."""
    return torch.tensor([v for reply in replies for v in pick(reply) or ()], dtype=torch.float32)


def _reward_model(
    ctx: StageContext, meta: BatchMeta, replies: list[ShardScores], weight: float
) -> Gathered:
    """``rm`` (an ensemble's combined score), and an ensemble's ``rm_mean`` and ``rm_std``."""
    rm = _joined(replies, lambda r: r.rm)
    mean, std = _joined(replies, lambda r: r.rm_mean), _joined(replies, lambda r: r.rm_std)
    ensemble = max(r.rm_members for r in replies) >= 2
    metrics = {
        "reward/rm/mean": float(rm.mean()),
        "reward/rm_mean/mean": float(mean.double().mean()),
        "reward/rm_std/mean": float(std.double().mean()),
        "reward/rm_truncated_ratio": sum(r.truncated for r in replies) / len(meta.keys),
    }
    named = {"rm": rm, **({"rm_mean": mean, "rm_std": std} if ensemble else {})}
    return Gathered(named, weight * rm, metrics)


def _functions(
    ctx: StageContext, meta: BatchMeta, replies: list[ShardScores], weight: float
) -> Gathered:
    """``fn/<name>`` per reward function (each with its own weight), in their process pool."""
    from infra.reward_functions import function_names
    from infra.reward_functions import metrics as function_metrics

    fs = _function_scores(ctx, meta, [t for r in replies for t in r.texts or ()])
    names = function_names(list(fs.scores))
    named = {
        f"fn/{n}": torch.tensor(v, dtype=torch.float32)
        for n, v in zip(names, fs.scores.values(), strict=True)
    }
    return Gathered(
        named, weight * torch.tensor(fs.total, dtype=torch.float32), function_metrics(fs)
    )


def _rule(
    ctx: StageContext, meta: BatchMeta, replies: list[ShardScores], weight: float
) -> Gathered:
    """``rule`` (``reward.rule`` against ``ground_truth``, computed on the workers)."""
    rule = _joined(replies, lambda r: r.rule)
    return Gathered(
        {"rule": rule},
        weight * rule,
        {"reward/rule/mean": float(rule.mean())},
        {"rule_scores": rule},
    )


def _judge(
    ctx: StageContext, meta: BatchMeta, replies: list[ShardScores], weight: float
) -> Gathered:
    """``judge``: the workers' verdicts, parsed here (raises before anything is written)."""
    verdicts = [v for r in replies for v in r.verdicts or ()]
    judged = _judge_scores(ctx, meta, verdicts)
    judge = torch.tensor(judged.values, dtype=torch.float32)  # (B,)
    metrics = {
        "reward/judge/mean": float(judge.double().mean()),
        "reward/judge/parse_failures": judged.failure_fraction,
    }
    return Gathered({"judge": judge}, weight * judge, metrics, {"judge_verdicts": verdicts})


def _overlong(
    ctx: StageContext, meta: BatchMeta, replies: list[ShardScores], weight: float
) -> Gathered:
    """``overlong_penalty`` (``reward.overlong_buffer``, subtracted: weight -1)."""
    buffer = ctx.cfg.reward.overlong_buffer
    lengths = torch.tensor([n for r in replies for n in r.response_lengths], dtype=torch.int64)
    lost = overlong_penalty(
        response_lengths=lengths,
        max_new_tokens=ctx.cfg.rollout.max_new_tokens,
        buffer_length=buffer.length,
        penalty=buffer.penalty,
    )  # (B,)
    metrics = {"reward/overlong_penalty/mean": float(lost.double().mean())}
    return Gathered({"overlong_penalty": lost}, weight * lost, metrics)


# Every reward, in the order they add up to the total; a part's name is its key in
# ``reward_parts``, validation's ``val-aux/*`` and the filter's metric.
REWARDS: tuple[Reward, ...] = (
    Reward("rm", lambda s: s.model_weight, _reward_model),
    Reward("fn", lambda s: 1.0 if s.functions else None, _functions),
    Reward("rule", lambda s: s.rule_weight if s.rule is not None else None, _rule),
    Reward("judge", lambda s: s.judge_weight, _judge),
    Reward("overlong_penalty", lambda s: -1.0 if s.overlong else None, _overlong),
)


def scoring_group(ctx: StageContext, scoring: Scoring) -> WorkerGroup:
    """The scoring models' workers (reward model, judge, teacher) when one of them scores, else
    the rollout pool's."""
    models = scoring.model_weight is not None or scoring.judge_weight is not None or scoring.teacher
    if models and ctx.rt.reward_group is not None:
        return ctx.rt.reward_group
    return ctx.rt.rollout_group


def _function_scores(ctx: StageContext, meta: BatchMeta, texts: list[str]) -> FunctionScores:
    from infra.reward_functions import RewardSample

    if ctx.rt.reward_pool is None:
        raise ValueError("reward functions asked for, but the run has no reward.functions")

    multi_turn = ctx.cfg.rollout.multi_turn
    data = read(ctx, meta, FUNCTION_READS + (("messages",) if multi_turn else ()))
    chats = data["messages"] if multi_turn else [None] * len(meta.keys)
    samples = [
        RewardSample(
            key=key,
            data_source=str(source),
            solution_str=text,
            ground_truth=truth,
            extra_info={**(extra or {}), **({"messages": chat} if chat is not None else {})},
        )
        for key, text, truth, source, extra, chat in zip(
            meta.keys,
            texts,
            data["ground_truth"],
            data["data_source"],
            data["extra_info"],
            chats,
            strict=True,
        )
    ]
    return ctx.rt.reward_pool.score(samples)


def compute_scores(ctx: StageContext, meta: BatchMeta, scoring: Scoring) -> Scores:
    """The rewards of ``scoring`` for one batch (see the module docstring and ``REWARDS``);
    raises before ``scores`` is written when one of them fails."""
    replies = scoring_group(ctx, scoring).run_on_keys(
        score_rows,
        meta,
        rule=scoring.rule,
        texts=scoring.functions,
        model=scoring.model_weight is not None,
        judge=scoring.judge_weight is not None,
        teacher=scoring.teacher,
    )
    out = Scores(
        total=torch.zeros(len(meta.keys), dtype=torch.float32),
        response_lengths=torch.tensor(
            [n for p in replies for n in p.response_lengths], dtype=torch.int64
        ),
        response_truncated=torch.tensor(
            [c for p in replies for c in p.response_truncated], dtype=torch.bool
        ),
    )
    for reward in REWARDS:
        weight = reward.weight(scoring)
        if weight is None:
            continue
        gathered = reward.gather(ctx, meta, replies, weight)
        out.total += gathered.weighted
        out.named.update(gathered.named)
        out.fields.update(gathered.fields)
        out.metrics.update(gathered.metrics)
    return out


def _judge_scores(ctx: StageContext, meta: BatchMeta, verdicts: list[str]) -> JudgeScores:
    """``reward.judge.parse`` over the verdicts, in this process (``infra.judge.judge_scores``)."""
    from infra.judge import judge_scores, load_parse_function, parse_label

    judge = ctx.cfg.reward.judge
    if judge is None:
        raise ValueError("the judge was asked to score, but the run has no reward.judge")
    return judge_scores(
        verdicts,
        meta.keys,
        parse=load_parse_function(judge.parse),
        label=parse_label(judge.parse),
        on_parse_error=judge.on_parse_error,
    )


@faults_at("score", lambda ctx: scoring_group(ctx, ctx.plan.scoring))
def score(ctx: StageContext, meta: BatchMeta, step: int, *, round: int = 0) -> StageResult:
    """Score the rows of ``meta`` (see the module docstring); ``round`` names a dynamic-sampling
    refill of ``step`` (``flows.sampling``), whose rows are new ones."""
    scoring = ctx.plan.scoring
    names = scoring.writes + (("truncated",) if ctx.plan.mask_truncated else ())
    # 0. Scored before a restart (a partition checkpointed in flight): nothing to redo.
    done = ctx.rt.store.kv_list(meta.partition_id)
    if meta.keys and all(set(names) <= set(done.get(k, ())) for k in meta.keys):
        return StageResult(meta.with_fields(*names))
    # 1. Score on the workers (they write rm_scores; raises, writing no scores, when a reward fails).
    scores = compute_scores(ctx, meta, scoring)
    metrics = {
        **score_metrics(scores=scores.total, response_lengths=scores.response_lengths),
        **scores.metrics,
        "response_length/mean": float(scores.response_lengths.float().mean()),
        "response_length/max": float(scores.response_lengths.max()),
        "perf/total_num_tokens": float(scores.response_lengths.sum()),
        "response/truncated_fraction": float(scores.response_truncated.double().mean()),
    }
    # 2. Write the per-sample totals, their parts (and which responses were cut).
    fields: dict[str, object] = {
        "scores": scores.total,
        "reward_parts": scores.parts(),
        **scores.fields,
    }
    if ctx.plan.mask_truncated:
        fields["truncated"] = scores.response_truncated
    write(ctx, meta, fields)
    return StageResult(meta.with_fields(*names), metrics)
