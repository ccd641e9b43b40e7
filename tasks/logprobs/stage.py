"""logprobs: ``old_logprobs`` (actor), ``ref_logprobs`` (reference) and ``values`` (critic).

The training workers each take a shard of the batch (``forward_rows``): read ``prompt_ids``
and ``response_ids``, recompute the actor's log-probabilities of the sampled tokens (at the
rollout temperature), the frozen reference's when a KL term is configured, and the critic's
values when the estimator is GAE — each model woken in turn — and write them back. The actor's
pass is skipped when the update is one on-policy optimizer step
(``TrainConfig.recompute_old_logprobs``): the update then takes its own forward pass, made
before any weight changes, as ``old_logprobs``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from torch import Tensor

from infra.workers import ModelWorker
from storage import BatchMeta
from tasks.batching import PackedBatch, gather_response_logprobs, gather_response_values, pack_batch
from tasks.context import StageContext
from tasks.io import from_padded, rows

READS = ("prompt_ids", "response_ids")


def writes(ctx: StageContext) -> tuple[str, ...]:
    algo = ctx.cfg.algorithm
    return (
        (("old_logprobs",) if ctx.cfg.recompute_old_logprobs else ())
        + (("ref_logprobs",) if algo.use_reference else ())
        + (("values",) if algo.use_critic else ())
    )


def read_packed(worker: ModelWorker, shard: BatchMeta) -> PackedBatch:
    """My shard's prompts and responses as one right-padded causal-LM batch."""
    data = worker.read(shard, READS)
    return pack_batch(
        prompt_ids=rows(data["prompt_ids"]),
        response_ids=rows(data["response_ids"]),
        pad_id=worker.pad_id,
    )


@torch.no_grad()
def micro_forward(
    worker: ModelWorker,
    model: torch.nn.Module,
    batch: PackedBatch,
    gather: Callable[[Tensor, PackedBatch], Tensor],
) -> Tensor:
    """``gather(logits, micro_batch)`` over ``actor.micro_batch_size`` slices, concatenated (B, T)."""
    micro = max(worker.cfg.actor.micro_batch_size, 1)
    outs = []
    for start in range(0, batch.input_ids.shape[0], micro):
        mb = batch.slice(start, start + micro)
        logits = model(
            input_ids=mb.input_ids.to(worker.device),
            attention_mask=mb.attention_mask.long().to(worker.device),
        ).logits
        outs.append(gather(logits, mb))
    return torch.cat(outs)


def response_logprobs(worker: ModelWorker, model: torch.nn.Module, batch: PackedBatch) -> Tensor:
    """Log-probabilities (B, T) of the response tokens at the rollout temperature."""
    temperature = worker.cfg.rollout.temperature or 1.0

    def gather(logits: Tensor, mb: PackedBatch) -> Tensor:
        # On the logits' device: only the response positions are cast to float32, and only the
        # (b, T) log-probabilities come back to the host.
        return gather_response_logprobs(logits=logits, batch=mb, temperature=temperature).cpu()

    return micro_forward(worker, model, batch, gather)


def response_values(worker: ModelWorker, model: torch.nn.Module, batch: PackedBatch) -> Tensor:
    """The critic's values (B, T) at the response tokens."""

    def gather(logits: Tensor, mb: PackedBatch) -> Tensor:
        return gather_response_values(values=logits[..., 0].float(), batch=mb).cpu()

    return micro_forward(worker, model, batch, gather)


def forward_rows(worker: ModelWorker, shard: BatchMeta, *, names: tuple[str, ...]) -> None:
    """Worker side: read my samples → the forward passes of ``names`` → write them."""
    batch = read_packed(worker, shard)
    n = batch.response_lengths
    out: dict[str, Tensor] = {}
    if "old_logprobs" in names:
        with worker.awake("actor") as actor:
            out["old_logprobs"] = from_padded(response_logprobs(worker, actor.module, batch), n)
    if "ref_logprobs" in names:
        with worker.reference() as ref:
            out["ref_logprobs"] = from_padded(response_logprobs(worker, ref, batch), n)
    if "values" in names:
        with worker.awake("critic") as critic:
            out["values"] = from_padded(response_values(worker, critic.module, batch), n)
    worker.write(shard, out)


@task(name="logprobs", cache_policy=NO_CACHE, task_run_name="logprobs[step={step}]")
def logprobs(ctx: StageContext, meta: BatchMeta, step: int) -> BatchMeta:
    ctx.inject("logprobs", step, ctx.train_group)
    names = writes(ctx)  # never empty here: the training loop leaves the task out then
    ctx.train_group.run_sharded(forward_rows, meta, skip_empty=True, names=names)
    return meta.with_fields(*names)
