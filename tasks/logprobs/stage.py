"""logprobs: ``old_logprobs`` (actor), ``ref_logprobs`` (reference) and ``values`` (critic).

The training workers each take a shard of the batch and run the declared steps of the step
plan's passes (``StepPlan.forward_passes``, see ``tasks.plan``; ``FORWARD_STEPS``), each over
``prompt_ids`` and ``response_ids`` with its model awake — the actor's log-probabilities of the
sampled tokens at the rollout temperature unless the update takes its own first forward pass (or
the rollout's) as ``old_logprobs``; the frozen reference's whenever the run holds a reference (a
KL in the reward, a KL loss, or ``algorithm.kl.monitor``); the critic's values when the
estimator is GAE — and ``tasks.step.run_steps`` writes what they computed. The flow leaves the
task out when the plan has no pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from infra.workers import ModelWorker
from storage import BatchMeta
from tasks.batching import (
    PackedBatch,
    count_token_micro_batches,
    gather_response_logprobs,
    gather_response_values,
    token_micro_batches,
)
from tasks.context import Metrics, StageContext, faults_at
from tasks.io import from_padded
from tasks.plan import ForwardPass, TeacherPass
from tasks.step import Awake, Shard, WorkerStep, run_steps

READS = ("prompt_ids", "response_ids")


def agree_count(worker: ModelWorker, n: int) -> int:
    """The largest of the data-parallel workers' ``n`` (an all-reduce MAX over the default
    torch.distributed group when ``worker.spec.world_size > 1``, else ``n``): every worker then
    runs as many forward passes, as FSDP's per-forward collectives need. Every worker of the
    group must call it."""
    if worker.spec.world_size <= 1:
        return n
    import torch.distributed as dist

    count = torch.tensor([n], dtype=torch.long)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def _forward(
    worker: ModelWorker,
    model: torch.nn.Module,
    mb: PackedBatch,
    gather: Callable[[Tensor, PackedBatch], Tensor],
) -> Tensor:
    logits = model(
        input_ids=mb.input_ids.to(worker.device),
        attention_mask=mb.attention_mask.long().to(worker.device),
    ).logits  # (b, L, V)
    return gather(logits, mb)  # (b, T)


@torch.no_grad()
def micro_forward(
    worker: ModelWorker,
    model: torch.nn.Module,
    batch: PackedBatch,
    gather: Callable[[Tensor, PackedBatch], Tensor],
    *,
    count_reducer: Callable[[int], int] | None = None,
    section: Literal["logprobs", "ref"] = "logprobs",
) -> Tensor:
    """``gather(logits, micro_batch)`` over micro-batches of the batch, as one (B, T) tensor in
    the batch's row order.

    Micro-batches (``cfg.forward_batching(section)``) are runs of rows (full widths) or, with a
    token budget, token-budget micro-batches of rows sorted by prompt + response
    length (``token_micro_batches``), each trimmed to its own longest row; their (b, t) outputs
    are zero-padded back to T. ``count_reducer`` maps this worker's micro-batch count to the one
    to run (e.g. ``lambda n: agree_count(worker, n)`` under FSDP; None = its own count); a
    larger count re-splits the rows.
    """
    rows = batch.batch_size
    micro, budget = worker.cfg.forward_batching(section)
    lengths = batch.prompt_lengths + batch.response_lengths  # (B,)
    if budget is None:
        micro = max(micro, 1)
        own = -(-rows // micro)
    else:
        own = count_token_micro_batches(lengths, budget)
    count = own if count_reducer is None else count_reducer(own)
    if not own <= count <= rows:
        raise ValueError(
            f"count_reducer gave {count} micro-batches for {rows} rows that need {own}: it must "
            "be between the two"
        )
    if budget is None:
        if count == own:
            spans = [(start, min(start + micro, rows)) for start in range(0, rows, micro)]
        else:  # `count` even runs of rows
            parts = torch.tensor_split(torch.arange(rows), count)
            spans = [(int(part[0]), int(part[-1]) + 1) for part in parts]
        return torch.cat([_forward(worker, model, batch.slice(a, b), gather) for a, b in spans])
    out = torch.zeros((rows, batch.response_mask.shape[1]))  # (B, T)
    for group in token_micro_batches(lengths, budget, count):
        part = _forward(worker, model, batch.select(group), gather)  # (b, t), t ≤ T
        if out.dtype != part.dtype or out.device != part.device:
            out = out.to(device=part.device, dtype=part.dtype)
        out[group.to(part.device), : part.shape[1]] = part
    return out


def response_logprobs(
    worker: ModelWorker,
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    count_reducer: Callable[[int], int] | None = None,
    section: Literal["logprobs", "ref"] = "logprobs",
) -> Tensor:
    """Log-probabilities (B, T) of the response tokens at the rollout temperature
    (``count_reducer`` and ``section`` as in ``micro_forward``)."""
    temperature = worker.cfg.rollout.temperature or 1.0

    def gather(logits: Tensor, mb: PackedBatch) -> Tensor:
        # On the logits' device: only the response positions are cast to float32, and only the
        # (b, T) log-probabilities come back to the host.
        logprobs = gather_response_logprobs(logits=logits, batch=mb, temperature=temperature)
        return logprobs.float().cpu()

    return micro_forward(worker, model, batch, gather, count_reducer=count_reducer, section=section)


def response_values(
    worker: ModelWorker,
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    count_reducer: Callable[[int], int] | None = None,
) -> Tensor:
    """The critic's values (B, T) at the response tokens (``count_reducer`` as in
    ``micro_forward``)."""

    def gather(logits: Tensor, mb: PackedBatch) -> Tensor:
        return gather_response_values(values=logits[..., 0].float(), batch=mb).cpu()

    return micro_forward(worker, model, batch, gather, count_reducer=count_reducer)


def _pass(
    worker: ModelWorker,
    module: torch.nn.Module | None,
    shard: Shard,
    *,
    name: ForwardPass | TeacherPass,
    collective: bool,
) -> tuple[Shard, Metrics]:
    """The forward pass ``name`` over the shard with its model (``module``) awake. With
    ``collective`` (the training workers' passes) every worker runs as many micro-batches as the
    others (FSDP's collectives); without it (the teacher's, on the scoring workers), its own."""
    assert module is not None, "a forward pass runs with its model awake"
    batch = shard.packed(worker.pad_id)
    agree = functools.partial(agree_count, worker) if collective else None
    if name == "values":
        out = response_values(worker, module, batch, count_reducer=agree)
    else:
        section: Literal["logprobs", "ref"] = "ref" if name == "ref_logprobs" else "logprobs"
        out = response_logprobs(worker, module, batch, count_reducer=agree, section=section)
    computed = Shard(batch_size=shard.batch_size)
    setattr(computed, name, from_padded(out, batch.response_lengths))
    return computed, {}


def _forward_step(
    name: ForwardPass | TeacherPass, awake: Awake, *, collective: bool = True
) -> WorkerStep:
    compute = functools.partial(_pass, name=name, collective=collective)
    return WorkerStep(name, READS, awake, compute, (name,))


FORWARD_STEPS: dict[ForwardPass, WorkerStep] = {  # one declared step per pass
    "old_logprobs": _forward_step("old_logprobs", "actor"),
    "ref_logprobs": _forward_step("ref_logprobs", "reference"),
    "values": _forward_step("values", "critic"),
}
# on-policy distillation's teacher, on the scoring workers: no collective with the others
TEACHER_STEP = _forward_step("teacher_logprobs", "teacher", collective=False)


def forward_rows(worker: ModelWorker, shard: BatchMeta, *, names: tuple[ForwardPass, ...]) -> None:
    """Worker side: the declared steps of the passes ``names``, in that order."""
    run_steps(worker, shard, tuple(FORWARD_STEPS[name] for name in names))


@faults_at("logprobs", lambda ctx: ctx.rt.train_group)
def logprobs(ctx: StageContext, meta: BatchMeta, step: int) -> BatchMeta:
    names = ctx.plan.forward_passes
    # Every training worker takes part (equal shards: the batch divides by the worker count), as
    # sharded models' forward passes are collectives.
    ctx.rt.train_group.run_sharded(forward_rows, meta, names=names)
    return meta.with_fields(*names)
