"""generate: sample ``n`` responses per prompt with the rollout engine.

Reads ``prompt_ids`` of each prompt's first sample key, asks the rollout workers (sharded by
prompt) to generate, and writes ``response_ids``, ``rollout_logprobs``, ``group_ids`` and
``rollout_version`` for every sample key. The seed is a function of (run seed, step), so a
retried task regenerates identical rows and its put is a no-op.
"""

from __future__ import annotations

from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.data import chat_prompt_ids
from infra.group import concat, split, take
from infra.transport import Jagged
from infra.workers import PPOWorker
from storage import BatchMeta
from tasks.context import StageContext
from tasks.io import read, write

READS = ("prompt_ids",)
WRITES = ("response_ids", "rollout_logprobs", "group_ids", "rollout_version")
PROMPT_FIELDS = ("prompt_ids", "raw_prompt", "ground_truth", "data_source", "extra_info")


def sample_keys(uids: list[str], n: int) -> list[str]:
    """``<prompt_uid>/<sample_index>``, prompt-major."""
    return [f"{uid}/{i}" for uid in uids for i in range(n)]


def row_prompt_ids(tokenizer: Any, row: Any) -> torch.Tensor:
    """A row's prompt ids as a tensor: those ``infra.data.render_prompts`` filled in, else the
    policy's chat template rendered now (the built-in task's short prompts)."""
    ids = getattr(row, "prompt_ids", ()) or chat_prompt_ids(tokenizer, row.raw_prompt)
    return torch.tensor(ids, dtype=torch.int64)


def submit_prompts(
    ctx: StageContext, *, partition_id: str, rows: list[Any], n: int | None = None
) -> BatchMeta:
    """Put the prompt fields of ``rows`` (``infra.data.PromptRow``) for every sample key."""
    n = ctx.cfg.rollout.n if n is None else n
    ids = [row_prompt_ids(ctx.tokenizer, row) for row in rows]
    keys = sample_keys([row.uid for row in rows], n)
    meta = BatchMeta(partition_id=partition_id, keys=tuple(keys), fields=())

    def each(values: list[Any]) -> list[Any]:
        return [v for v in values for _ in range(n)]

    return write(
        ctx,
        meta,
        {
            "prompt_ids": Jagged.from_rows(each(ids)),
            "raw_prompt": each([row.raw_prompt for row in rows]),
            "ground_truth": each([row.ground_truth for row in rows]),
            "data_source": each([getattr(row, "data_source", "addition") for row in rows]),
            "extra_info": each([dict(getattr(row, "extra_info", {}) or {}) for row in rows]),
        },
    )


def generation_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919) % (2**31 - 1)


def generate_partition(
    ctx: StageContext,
    meta: BatchMeta,
    *,
    seed: int,
    n: int | None = None,
    temperature: float | None = None,
) -> BatchMeta:
    """Generate ``n`` responses for each prompt group of ``meta`` and write them (the rollout
    settings unless ``n``/``temperature`` are given, as validation does)."""
    n = ctx.cfg.rollout.n if n is None else n
    extra = {} if temperature is None else {"temperature": temperature}
    # 1. The prompt rows (first sample of each group).
    prompt_meta = BatchMeta(meta.partition_id, meta.keys[::n], ())
    prompts: Jagged = read(ctx, prompt_meta, READS)["prompt_ids"]
    # 2. Generate, sharded by prompt over the rollout workers.
    group = ctx.rollout_group
    shards = [sl for sl in split(len(prompts), group.size) if sl.stop > sl.start]
    outs = group.call_sharded(
        PPOWorker.generate,
        [
            ((take(prompts, sl),), {"n": n, "seed": seed + rank, **extra})
            for rank, sl in enumerate(shards)
        ],
    )
    responses = concat([o[0] for o in outs])
    logprobs = concat([o[1] for o in outs])
    version = min(o[2] for o in outs)
    # 3. Write the responses for every sample key.
    group_ids = torch.arange(len(prompts), dtype=torch.int64).repeat_interleave(n)  # (B,)
    return write(
        ctx,
        meta,
        {
            "response_ids": responses,
            "rollout_logprobs": logprobs,
            "group_ids": group_ids,
            "rollout_version": torch.full((len(meta.keys),), version, dtype=torch.int64),
        },
    )


@task(name="generate", cache_policy=NO_CACHE, task_run_name="generate[step={step}]")
def generate(ctx: StageContext, metas: list[BatchMeta], step: int) -> list[BatchMeta]:
    """Generate responses for each submitted partition in ``metas`` (several when generating ahead)."""
    out = []
    for offset, meta in enumerate(metas):
        done = ctx.store.kv_list(meta.partition_id)
        if all("response_ids" in done.get(k, ()) for k in meta.keys):
            out.append(meta.with_fields(*WRITES))  # produced ahead of time (colocate_async)
            continue
        seed = generation_seed(ctx.cfg.seed, step + offset)
        out.append(generate_partition(ctx, meta, seed=seed))
    return out
