"""generate: sample ``n`` responses per prompt with the rollout engine.

The task shards the prompts (each prompt's first sample key) over the rollout workers; each
worker runs the rollout's declared step (``sampling_step``, ``tasks.step``) over its prompts'
sample rows: it reads their ``prompt_ids`` (every sample row holds its prompt's fields), samples
``n`` responses per prompt with the engine awake, and writes ``response_ids``,
``rollout_logprobs``, ``group_ids`` and ``rollout_version`` (``generate_rows``). The seed is a
function of (run seed, step, shard), so a retried task regenerates identical rows and its puts
are no-ops.

Multi-turn rollouts (``rollout.tools`` or ``rollout.max_turns`` > 1) run the agent loop
(``infra.agent_loop``) instead of one ``generate`` call, with the worker's tool pool, and also
write ``loss_mask``, ``messages``, ``num_turns``, ``tool_calls``, ``tool_errors`` and
``truncated_tool_responses`` (``AGENT_WRITES``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from infra.agent_loop import run_agent_loop
from infra.data import PromptRow, chat_prompt_ids
from infra.engines import GenerationEngine
from infra.tools import ToolPool, tool_schemas
from infra.workers import ModelWorker
from storage import BatchMeta
from tasks.context import Metrics, StageContext, faults_at
from tasks.io import nested, rows, write
from tasks.step import Shard, WorkerStep, run_steps

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from infra.config import RolloutConfig

T = TypeVar("T")

READS = ("prompt_ids",)
AGENT_READS = ("prompt_ids", "raw_prompt")
WRITES = ("response_ids", "rollout_logprobs", "group_ids", "rollout_version")
AGENT_COUNTS = ("num_turns", "tool_calls", "tool_errors", "truncated_tool_responses")
AGENT_WRITES = ("loss_mask", "messages", *AGENT_COUNTS)


def sample_keys(uids: list[str], n: int) -> list[str]:
    """``<prompt_uid>/<sample_index>``, prompt-major."""
    return [f"{uid}/{i}" for uid in uids for i in range(n)]


def row_prompt_ids(
    tokenizer: PreTrainedTokenizerBase | None,
    row: PromptRow,
    tools: list[dict[str, Any]] | None = None,
) -> torch.Tensor:
    """A row's prompt ids as a tensor: those ``infra.data.render_prompts`` filled in, else the
    policy's chat template rendered now with the tools' schemas (the built-in task's short
    prompts)."""
    if row.prompt_ids:
        return torch.tensor(row.prompt_ids, dtype=torch.int64)
    if tokenizer is None:
        raise ValueError(f"prompt {row.uid!r} is not rendered and this context has no tokenizer")
    return torch.tensor(chat_prompt_ids(tokenizer, row.raw_prompt, tools=tools), dtype=torch.int64)


def submit_prompts(
    ctx: StageContext, *, partition_id: str, rows: list[PromptRow], n: int | None = None
) -> BatchMeta:
    """Put the prompt fields of ``rows`` for every sample key."""
    n = ctx.cfg.rollout.n if n is None else n
    schemas = tool_schemas(ctx.cfg.rollout.tools)
    ids = [row_prompt_ids(ctx.tokenizer, row, schemas) for row in rows]
    keys = sample_keys([row.uid for row in rows], n)
    meta = BatchMeta(partition_id=partition_id, keys=tuple(keys), fields=())

    def each(values: list[T]) -> list[T]:
        return [v for v in values for _ in range(n)]

    return write(
        ctx,
        meta,
        {
            "prompt_ids": nested(each(ids)),
            "raw_prompt": each([row.raw_prompt for row in rows]),
            "ground_truth": each([row.ground_truth for row in rows]),
            "data_source": each([row.data_source for row in rows]),
            "extra_info": each([dict(row.extra_info) for row in rows]),
        },
    )


def generation_seed(seed: int, step: int, round: int = 0) -> int:
    return (seed * 1_000_003 + step * 7919 + round * 104_729) % (2**31 - 1)


def sample_meta(prompts: BatchMeta, n: int) -> BatchMeta:
    """The ``n`` sample keys of each prompt key ``<uid>/0``, prompt-major."""
    return BatchMeta(
        prompts.partition_id, tuple(sample_keys([k.rsplit("/", 1)[0] for k in prompts.keys], n))
    )


def generate_rows(
    worker: ModelWorker,
    prompts: BatchMeta,
    *,
    n: int,
    seed: int,
    first_group: int,
    temperature: float | None = None,
) -> int:
    """Worker side: the rollout's declared step (``sampling_step``) over my prompts' ``n``
    sample rows each: read their prompt fields → sample with the engine awake (one engine
    call, or the agent loop) → write the samples' rows. Prompt i of the shard is group
    ``first_group + i``. ``temperature`` overrides the rollout's (validation), and then no
    minimum length applies. Returns the policy version that generated them."""
    cfg = worker.cfg.rollout
    sampling = Sampling(
        n=n,
        seed=seed,
        temperature=cfg.temperature if temperature is None else temperature,
        min_new_tokens=cfg.min_new_tokens if temperature is None else 0,
        first_group=first_group,
    )
    run_steps(worker, sample_meta(prompts, n), (sampling_step(cfg, sampling),))
    return worker.version


@dataclass(frozen=True)
class Sampling:
    """How one generate call samples: ``n`` per prompt, the call's seed, its temperature and
    minimum response length, and the group label of its first prompt."""

    n: int
    seed: int
    temperature: float
    min_new_tokens: int
    first_group: int


def sampling_step(cfg: RolloutConfig, sampling: Sampling) -> WorkerStep:
    """The rollout's declared step over sample rows (each prompt's ``n`` rows, prompt-major,
    every one holding its prompt's fields): the agent loop for multi-turn rollouts
    (``rollout.tools`` or ``rollout.max_turns`` > 1), else one ``generate`` call."""
    compute = _agent_samples if cfg.multi_turn else _single_turn_samples
    return WorkerStep(
        "generate",
        AGENT_READS if cfg.multi_turn else READS,
        "rollout",
        functools.partial(compute, sampling=sampling),
        rollout_writes(cfg),
    )


def rollout_writes(cfg: RolloutConfig) -> tuple[str, ...]:
    """The fields a generation of the rollout writes."""
    return WRITES + AGENT_WRITES if cfg.multi_turn else WRITES


def _single_turn_samples(
    worker: ModelWorker, engine: GenerationEngine, shard: Shard, *, sampling: Sampling
) -> tuple[Shard, Metrics]:
    """One ``generate`` call: the responses and their log-probs."""
    cfg = worker.cfg.rollout
    out = engine.generate(
        rows(shard.need("prompt_ids"))[:: sampling.n],
        n=sampling.n,
        max_new_tokens=cfg.max_new_tokens,
        temperature=sampling.temperature,
        top_p=cfg.top_p,
        seed=sampling.seed,
        min_new_tokens=sampling.min_new_tokens,
    )
    samples = Shard(
        response_ids=nested(out.response_ids),
        rollout_logprobs=nested(out.rollout_logprobs),
        batch_size=shard.batch_size,
    )
    return _with_provenance(samples, worker, sampling), {}


def _agent_samples(
    worker: ModelWorker, engine: GenerationEngine, shard: Shard, *, sampling: Sampling
) -> tuple[Shard, Metrics]:
    """The agent loop: one row per trajectory, with its loss mask, messages and tool counts."""
    cfg = worker.cfg.rollout
    out = run_agent_loop(
        engine,
        worker.tokenizer,
        prompt_ids=rows(shard.need("prompt_ids"))[:: sampling.n],
        raw_prompts=shard.objects("raw_prompt")[:: sampling.n],
        n=sampling.n,
        seed=sampling.seed,
        rollout=cfg,
        temperature=sampling.temperature,
        min_new_tokens=sampling.min_new_tokens,
        tools=tool_pool(worker),
        tool_schemas=tool_schemas(cfg.tools),
        eos_token_ids=worker.eos_ids,
    )

    def ints(name: str) -> torch.Tensor:
        return torch.tensor([getattr(t, name) for t in out], dtype=torch.int64)  # (P * n,)

    samples = Shard(
        response_ids=nested([torch.tensor(t.response_ids, dtype=torch.int64) for t in out]),
        rollout_logprobs=nested(
            [torch.tensor(t.rollout_logprobs, dtype=torch.float32) for t in out]
        ),
        loss_mask=nested([torch.tensor(t.loss_mask, dtype=torch.bool) for t in out]),
        messages=[t.messages for t in out],
        num_turns=ints("num_turns"),
        tool_calls=ints("tool_calls"),
        tool_errors=ints("tool_errors"),
        truncated_tool_responses=ints("truncated_tool_responses"),
        batch_size=shard.batch_size,
    )
    return _with_provenance(samples, worker, sampling), {}


def _with_provenance(samples: Shard, worker: ModelWorker, sampling: Sampling) -> Shard:
    """``samples`` with their ``group_ids`` (prompt i of the shard is group ``first_group + i``)
    and ``rollout_version``, prompt-major."""
    count = samples.batch_size[0]  # P * n
    groups = torch.arange(sampling.first_group, sampling.first_group + count // sampling.n)
    samples.group_ids = groups.repeat_interleave(sampling.n)  # (P * n,)
    samples.rollout_version = torch.full((count,), worker.version, dtype=torch.int64)
    return samples


def tool_pool(worker: ModelWorker) -> ToolPool:
    """The worker's tool pool, made on first use and kept."""
    cfg = worker.cfg.rollout
    return worker.once(
        "tool-pool",
        lambda: ToolPool(cfg.tools, workers=cfg.tool_workers, timeout_s=cfg.tool_timeout_s),
    )


def generate_partition(
    ctx: StageContext,
    meta: BatchMeta,
    *,
    seed: int,
    n: int | None = None,
    temperature: float | None = None,
    first_group: int = 0,
) -> BatchMeta:
    """Generate ``n`` responses for each prompt group of ``meta`` (the rollout settings unless
    ``n``/``temperature`` are given, as validation does), the groups labelled from
    ``first_group`` on; returns the widened handle."""
    n = ctx.cfg.rollout.n if n is None else n
    prompts = BatchMeta(meta.partition_id, meta.keys[::n], ())  # first sample of each group
    shards = [s for s in prompts.shards(ctx.rt.rollout_group.size) if s.keys]
    starts = [first_group]
    for shard in shards[:-1]:
        starts.append(starts[-1] + len(shard.keys))
    ctx.rt.rollout_group.run_each(
        generate_rows,
        [
            {
                "prompts": shard,
                "n": n,
                "seed": seed + rank,
                "first_group": start,
                "temperature": temperature,
            }
            for rank, (shard, start) in enumerate(zip(shards, starts, strict=True))
        ],
    )
    return meta.with_fields(*written(ctx))


def written(ctx: StageContext) -> tuple[str, ...]:
    """The fields the run's generations write."""
    return rollout_writes(ctx.cfg.rollout)


@faults_at("generate", lambda ctx: ctx.rt.rollout_group)
def generate(
    ctx: StageContext, metas: list[BatchMeta], step: int, *, round: int = 0
) -> list[BatchMeta]:
    """Generate responses for each submitted partition in ``metas`` (several when generating
    ahead). ``round`` > 0: a dynamic-sampling refill of ``step`` (``flows.sampling``), with its
    own seed and group labels from ``round * rollout.prompts_per_step`` on."""
    out = []
    first_group = round * ctx.cfg.rollout.prompts_per_step
    for offset, meta in enumerate(metas):
        done = ctx.rt.store.kv_list(meta.partition_id)
        if all("response_ids" in done.get(k, ()) for k in meta.keys):
            out.append(meta.with_fields(*written(ctx)))  # produced ahead (colocate_async)
            continue
        seed = generation_seed(ctx.cfg.seed, step + offset, round)
        out.append(generate_partition(ctx, meta, seed=seed, first_group=first_group))
    return out
