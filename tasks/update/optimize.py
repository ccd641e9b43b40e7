"""Torch-only PPO training loops for the actor and the critic (used inside Ray worker actors).

One call = `ppo_epochs` passes over the batch in mini-batches of `mini_batch_size` rows; each
mini-batch is one optimizer step, its gradient accumulated over micro-batches of
`micro_batch_size` rows. Every micro-batch loss is divided by the *mini-batch's* denominator
(real tokens, or non-empty rows; see `tasks.update.core`), so the step does not depend on the
micro-batch split. With data parallelism each worker passes the global denominators
(`global_tokens` / `global_seqs`, e.g. from `count_minibatch_units` summed over workers) and its
module SUMS gradients over workers (an FSDP2 module with divide factor 1, see `infra.training`,
or a `grad_reducer` called before clipping): N workers then take the same step as one worker
holding the whole batch. The gradient norm is the global one (sharded parameters' norms are
reduced by `clip_grad_norm_` itself).

Models follow the Hugging Face convention `model(input_ids=…, attention_mask=…).logits`; for the
critic, `logits[..., 0]` are the values (e.g. a token-classification head with one label).
Micro-batches are moved to the model's device. Metrics use verl's names; with data parallelism
the loss metrics are this worker's share (sum them over workers). The model's train/eval mode
is left as the caller set it (turn dropout off for PPO, e.g. `model.eval()`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tasks.batching import (
    PackedBatch,
    count_end_to_end_micro_batches,
    count_token_micro_batches,
    end_to_end,
    end_to_end_micro_batches,
    gather_response_logits,
    gather_response_values,
    logprobs_from_response_logits,
    token_micro_batches,
)
from tasks.kl import KL_PENALTIES, kl_penalty
from tasks.update.core import (
    AGGREGATIONS,
    ActorLossOutput,
    PolicyLossSettings,
    actor_loss,
    aggregate_loss,
    count_loss_units,
    entropy_from_logits,
    value_loss,
)
from tasks.update.correction import CORRECTIONS, rollout_correction, rollout_gap

__all__ = [
    "ActorUpdateSettings",
    "CriticUpdateSettings",
    "GradReducer",
    "actor_update",
    "count_minibatch_units",
    "critic_update",
]

GradReducer = Callable[[nn.Module], None]
# grad_sync(last) wraps a micro-batch's backward: True on the optimizer step's last one, where a
# sharded module reduces gradients (the others accumulate locally), e.g. infra.training's.
GradSync = Callable[[bool], contextlib.AbstractContextManager[None]]
Scheduler = torch.optim.lr_scheduler.LRScheduler


def _check_batching(
    *,
    ppo_epochs: int,
    mini_batch_size: int,
    micro_batch_size: int,
    max_tokens_per_micro_batch: int | None,
) -> None:
    if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
        raise ValueError(
            f"max_tokens_per_micro_batch must be ≥ 1 or None, got {max_tokens_per_micro_batch}"
        )
    if ppo_epochs < 1 or mini_batch_size < 1 or micro_batch_size < 1:
        raise ValueError(
            f"ppo_epochs, mini_batch_size and micro_batch_size must be ≥ 1; got {ppo_epochs}, "
            f"{mini_batch_size}, {micro_batch_size}"
        )
    if mini_batch_size % micro_batch_size:
        raise ValueError(
            f"mini_batch_size ({mini_batch_size}) must be a multiple of micro_batch_size "
            f"({micro_batch_size}): gradient accumulation = mini / micro"
        )


@dataclass(frozen=True, kw_only=True)
class ActorUpdateSettings:
    """How one actor update runs. Every field is required: a run builds these from its config
    (``tasks.update.stage.actor_settings``), so the config is the one place a value is chosen.

    ppo_epochs: passes over the batch; mini_batch_size: rows per optimizer step;
    micro_batch_size: rows per forward/backward (accumulation = mini / micro);
    max_tokens_per_micro_batch: when set, each mini-batch's rows are instead sorted by length
        and packed into micro-batches of ≤ this many padded tokens (rows × longest row; see
        `tasks.batching.token_micro_batches`), and micro_batch_size is not used for the split;
    padding_free: with max_tokens_per_micro_batch, lay each micro-batch's rows end to end
        without padding (`tasks.batching.end_to_end`: about this budget of real tokens a
        micro-batch), the model's attention kept to each row by ``position_ids``
        (``actor.padding_free``; `actor_update` first checks that the model does so);
    policy: the policy loss (``actor.policy_loss``) and every loss's settings
        (`tasks.update.core.PolicyLossSettings`, built once from ``actor.*``);
    agg: loss aggregation mode;
    entropy_coef: entropy bonus weight; kl_loss_coef / kl_loss_kind: KL-to-reference loss;
    distill_loss_coef: on-policy distillation's loss term (``algorithm.distill.mode: kl_loss``):
        coef · ½ (log π − log π_teacher)² on the sampled tokens, with the teacher's log-probs
        given to ``actor_update`` (0 = none);
    max_grad_norm: clip the global grad norm (None = no clipping);
    temperature: logits are divided by it (match the rollout's sampling temperature);
    shuffle_seed: permute rows before each epoch (seed + epoch), None keeps the order;
    rollout_correction: a `tasks.update.correction.CORRECTIONS` mode (resolved: never auto),
        with correction_cap (truncation) and correction_low / correction_high (masks);
    old_is_rollout: the old_logprobs given are the behaviour policy's (``algorithm.old_logprobs:
        rollout``): the ratio is clipped against them, and the correction's ratio is the current
        policy's (detached) against them, of which only the masks apply.
    """

    ppo_epochs: int
    mini_batch_size: int
    micro_batch_size: int
    max_tokens_per_micro_batch: int | None
    padding_free: bool
    policy: PolicyLossSettings
    agg: str
    entropy_coef: float
    kl_loss_coef: float
    kl_loss_kind: str
    distill_loss_coef: float
    max_grad_norm: float | None
    temperature: float
    shuffle_seed: int | None
    rollout_correction: str
    correction_cap: float
    correction_low: float
    correction_high: float
    old_is_rollout: bool

    def __post_init__(self) -> None:
        _check_batching(
            ppo_epochs=self.ppo_epochs,
            mini_batch_size=self.mini_batch_size,
            micro_batch_size=self.micro_batch_size,
            max_tokens_per_micro_batch=self.max_tokens_per_micro_batch,
        )
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"agg {self.agg!r} is not one of {sorted(AGGREGATIONS)}")
        if self.padding_free and self.max_tokens_per_micro_batch is None:
            raise ValueError(
                "padding_free lays rows end to end under a token budget: set "
                "max_tokens_per_micro_batch too (actor.max_tokens_per_micro_batch)"
            )
        if self.rollout_correction not in CORRECTIONS:
            raise ValueError(
                f"rollout_correction {self.rollout_correction!r} is not one of "
                f"{sorted(CORRECTIONS)}"
            )
        if self.kl_loss_kind not in KL_PENALTIES:
            raise ValueError(
                f"kl_loss_kind {self.kl_loss_kind!r} is not one of {sorted(KL_PENALTIES)}"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@dataclass(frozen=True, kw_only=True)
class CriticUpdateSettings:
    """How one critic update runs (fields as in `ActorUpdateSettings`, built by
    ``tasks.update.stage.critic_settings``); clip_range: value clip around the old values
    (None = unclipped)."""

    ppo_epochs: int
    mini_batch_size: int
    micro_batch_size: int
    max_tokens_per_micro_batch: int | None
    clip_range: float | None
    agg: str
    max_grad_norm: float | None
    shuffle_seed: int | None

    def __post_init__(self) -> None:
        _check_batching(
            ppo_epochs=self.ppo_epochs,
            mini_batch_size=self.mini_batch_size,
            micro_batch_size=self.micro_batch_size,
            max_tokens_per_micro_batch=self.max_tokens_per_micro_batch,
        )
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"agg {self.agg!r} is not one of {sorted(AGGREGATIONS)}")


def count_minibatch_units(*, response_mask: Tensor, mini_batch_size: int, agg: str) -> list[float]:
    """This worker's loss denominator for each mini-batch (in order, no shuffling).

    Sum these over data-parallel workers and pass them as `global_tokens` (token-mean) or
    `global_seqs` (seq-mean-*).
    """
    return [
        count_loss_units(response_mask=mb_mask, agg=agg)
        for mb_mask in torch.split(response_mask, mini_batch_size)
    ]


def _minibatch_rows(
    *, batch_size: int, mini_batch_size: int, epoch: int, shuffle_seed: int | None
) -> list[Tensor]:
    if shuffle_seed is None:
        order = torch.arange(batch_size)  # (B,)
    else:
        generator = torch.Generator().manual_seed(shuffle_seed + epoch)
        order = torch.randperm(batch_size, generator=generator)  # (B,)
    return list(torch.split(order, mini_batch_size))


def _denominators(
    *,
    override: float | Sequence[float] | None,
    response_mask: Tensor,
    minibatches: list[Tensor],
    agg: str,
    shuffled: bool,
) -> list[float]:
    """One loss denominator per mini-batch: the global override or this worker's own count.

    A single number is the global count of the one mini-batch; with several mini-batches per
    epoch it is accepted only when it equals this worker's whole-batch count (one worker), as
    one number cannot say how the global count splits across mini-batches.
    """
    local = [count_loss_units(response_mask=response_mask[rows], agg=agg) for rows in minibatches]
    if override is None:
        return local
    if isinstance(override, (int, float)):
        if len(minibatches) == 1:
            return [float(override)]
        if float(override) == sum(local):
            return local
        raise ValueError(
            f"a single global_tokens/global_seqs ({override}) was given for "
            f"{len(minibatches)} mini-batches per epoch and differs from this worker's count "
            f"({sum(local)}): pass one global count per mini-batch (count_minibatch_units on "
            "each worker, summed over workers)"
        )
    values = [float(v) for v in override]
    if len(values) != len(minibatches):
        raise ValueError(
            f"got {len(values)} global denominators for {len(minibatches)} mini-batches: pass "
            "one per mini-batch (see count_minibatch_units)"
        )
    if shuffled and len(minibatches) > 1:
        raise ValueError(
            "global_tokens/global_seqs per mini-batch need a fixed row order: set shuffle_seed=None"
        )
    return values


@dataclass
class _Tally:
    """Running metric sums: per optimizer step (`step_*`) and per real token (`token_*`)."""

    step_sums: dict[str, float] = field(default_factory=dict)
    token_sums: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    tokens: float = 0.0
    skipped_steps: int = 0

    def add_step(self, **values: float) -> None:
        for name, value in values.items():
            self.step_sums[name] = self.step_sums.get(name, 0.0) + value

    def add_tokens(self, n_tokens: float, **means: float) -> None:
        self.tokens += n_tokens
        for name, mean in means.items():
            self.token_sums[name] = self.token_sums.get(name, 0.0) + mean * n_tokens

    def add_max(self, **values: float) -> None:
        for name, value in values.items():
            self.maxima[name] = max(self.maxima.get(name, value), value)

    def metrics(self) -> dict[str, float]:
        out = {name: total / max(self.steps, 1) for name, total in self.step_sums.items()}
        out.update({name: total / max(self.tokens, 1.0) for name, total in self.token_sums.items()})
        out.update(self.maxima)
        return out


def _optimizer_step(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    grad_reducer: GradReducer | None,
    scheduler: Scheduler | None,
    tally: _Tally,
) -> float:
    """Reduce gradients, clip, step (skipped when the norm is not finite); returns the norm."""
    if grad_reducer is not None:
        grad_reducer(model)
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_grad_norm if max_grad_norm is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor's norm over every shard
    grad_norm = float(full_tensor() if callable(full_tensor) else norm)
    tally.steps += 1
    if torch.isfinite(torch.tensor(grad_norm)):
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    else:
        tally.skipped_steps += 1
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _forward_logits(model: nn.Module, mb: PackedBatch) -> Tensor:
    output = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask.long())
    logits: Tensor = output.logits
    return logits


def _response_logits(
    model: nn.Module, mb: PackedBatch, cfg: ActorUpdateSettings, width: int | None
) -> Tensor:
    """(b, T, V) logits / temperature predicting each response token: a forward of the padded
    rows, or with ``cfg.padding_free`` of the rows laid end to end in bins ``width`` wide."""
    if not cfg.padding_free:
        logits = _forward_logits(model, mb)  # (b, L, V)
        return gather_response_logits(logits=logits, batch=mb, temperature=cfg.temperature)
    layout = end_to_end(mb, width)
    logits = model(
        input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False
    ).logits  # (n, W, V)
    return gather_response_logits(
        logits=logits, batch=mb, temperature=cfg.temperature, layout=layout
    )


def _logprobs_and_entropy(
    model: nn.Module, mb: PackedBatch, cfg: ActorUpdateSettings, width: int | None
) -> tuple[Tensor, Tensor]:
    """The current policy's (b, T) log-probs of the response tokens and its entropy there (with
    a gradient only when ``cfg.entropy_coef`` weights it)."""
    mb_logits = _response_logits(model, mb, cfg, width)  # (b, T, V)
    logprobs = logprobs_from_response_logits(response_logits=mb_logits, batch=mb)  # (b, T)
    with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.entropy_coef != 0.0):
        entropy = entropy_from_logits(logits=mb_logits)  # (b, T)
    return logprobs, entropy


def _actor_micro_step(
    *,
    model: nn.Module,
    mb: PackedBatch,
    mb_tensors: dict[str, Tensor],
    cfg: ActorUpdateSettings,
    loss_denominator: float,
    tally: _Tally,
    width: int | None = None,
) -> dict[str, float]:
    """Forward + backward of one micro-batch; returns its (already normalised) loss parts.
    ``width`` (with ``cfg.padding_free``): the bins' width, the mini-batch's longest row.

    1. Response logits, log-probs and entropy of the current policy.
    2. π_old: the given old log-probs, or (one on-policy step) these log-probs detached.
    3. The off-policy correction's mask and weights (`_correct`).
    4. The policy loss, plus the distillation term; backward; the tallies.
    """
    # 1.
    logprobs, entropy = _logprobs_and_entropy(model, mb, cfg, width)  # (b, T) each
    # 2.
    token_means: dict[str, float] = {}
    old_logprobs = _old_logprobs(mb_tensors, logprobs, mb, token_means)  # (b, T)
    # 3.
    loss_mask, is_weights = _correct(
        mb_tensors,
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        mb=mb,
        cfg=cfg,
        tally=tally,
        token_means=token_means,
    )
    # 4.
    loss, out, parts = _micro_loss(
        logprobs, old_logprobs, entropy, loss_mask, is_weights, mb_tensors, cfg, loss_denominator
    )
    torch.autograd.backward(loss)
    tally.add_tokens(
        float(mb.response_mask.sum()),
        **{"actor/pg_clipfrac": float(out.clipfrac), "actor/ppo_kl": float(out.approx_kl)},
        **token_means,
    )
    return {
        "actor/pg_loss": float(out.pg_loss),
        "actor/entropy": float(out.entropy),
        "actor/kl_loss": float(out.kl_loss),
        **parts,
    }


def _micro_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    entropy: Tensor,
    loss_mask: Tensor,
    is_weights: Tensor | None,
    mb_tensors: dict[str, Tensor],
    cfg: ActorUpdateSettings,
    loss_denominator: float,
) -> tuple[Tensor, ActorLossOutput, dict[str, float]]:
    """A micro-batch's loss: the policy loss (`actor_loss`, with its parts) plus the
    distillation term (its metric)."""
    out = actor_loss(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=mb_tensors["advantages"],
        response_mask=loss_mask,
        is_weights=is_weights,
        entropy=entropy,
        ref_logprobs=mb_tensors.get("ref_logprobs"),
        policy=cfg.policy,
        agg=cfg.agg,
        entropy_coef=cfg.entropy_coef,
        kl_loss_coef=cfg.kl_loss_coef,
        kl_loss_kind=cfg.kl_loss_kind,
        loss_denominator=loss_denominator,
    )
    loss, parts = out.loss, {}
    if cfg.distill_loss_coef:
        distill = _distill_loss(logprobs, mb_tensors, loss_mask, cfg, loss_denominator)
        loss, parts["actor/distill_loss"] = loss + cfg.distill_loss_coef * distill, float(distill)
    return loss, out, parts


def _distill_loss(
    logprobs: Tensor,
    mb_tensors: dict[str, Tensor],
    loss_mask: Tensor,
    cfg: ActorUpdateSettings,
    loss_denominator: float,
) -> Tensor:
    """The distillation term: the k2 divergence of the policy from the teacher's log-probs,
    aggregated as the policy loss is."""
    if "teacher_logprobs" not in mb_tensors:
        raise ValueError("distill_loss_coef is set but no teacher_logprobs were given")
    divergence = kl_penalty(
        logprobs=logprobs, ref_logprobs=mb_tensors["teacher_logprobs"], kind="k2"
    )
    return aggregate_loss(
        loss_mat=divergence, response_mask=loss_mask, agg=cfg.agg, loss_denominator=loss_denominator
    )


def _old_logprobs(
    mb_tensors: dict[str, Tensor], logprobs: Tensor, mb: PackedBatch, token_means: dict[str, float]
) -> Tensor:
    """(b, T) π_old: the given ``old_logprobs``, or (one on-policy step: the weights have not
    moved yet) ``logprobs`` detached, logging ``actor/kl_to_ref`` into ``token_means`` when the
    reference's log-probs are there."""
    given = mb_tensors.get("old_logprobs")
    if given is not None:
        return given
    old_logprobs = logprobs.detach()  # (b, T)
    if "ref_logprobs" in mb_tensors:
        ref = mb_tensors["ref_logprobs"]
        kl = kl_penalty(logprobs=old_logprobs, ref_logprobs=ref, kind="k1")  # (b, T)
        token_means["actor/kl_to_ref"] = float(kl[mb.response_mask].mean().nan_to_num())
    return old_logprobs


def _correct(
    mb_tensors: dict[str, Tensor],
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    mb: PackedBatch,
    cfg: ActorUpdateSettings,
    tally: _Tally,
    token_means: dict[str, float],
) -> tuple[Tensor, Tensor | None]:
    """The off-policy correction of one micro-batch (``tasks.update.correction``): its loss mask
    (b, T) and importance weights (b, T) (None: no weighting); its ``rollout_corr/*`` means go
    into ``token_means``, its maximum into ``tally``. Without the behaviour policy's log-probs:
    the batch's own mask, no weights.

    The proximal policy π_old is ``old_logprobs`` (stored, or the first forward pass's detached)
    against the behaviour policy's ``rollout_logprobs``; with ``cfg.old_is_rollout`` the
    old_logprobs ARE the behaviour policy's, and the current policy (detached) is compared with
    them: masks apply, weights do not (the clipped ratio already is π_θ / π_rollout).
    """
    behaviour = old_logprobs if cfg.old_is_rollout else mb_tensors.get("rollout_logprobs")
    if behaviour is None:
        return mb.response_mask, None
    proximal = logprobs.detach() if cfg.old_is_rollout else old_logprobs  # (b, T)
    correction = rollout_correction(
        old_logprobs=proximal,
        rollout_logprobs=behaviour,
        response_mask=mb.response_mask,
        mode=cfg.rollout_correction,
        cap=cfg.correction_cap,
        low=cfg.correction_low,
        high=cfg.correction_high,
    )
    gap = rollout_gap(
        old_logprobs=proximal,
        rollout_logprobs=behaviour,
        response_mask=mb.response_mask,
        correction=correction,
    ).metrics()
    tally.add_max(**{"rollout_corr/is_weight_max": gap.pop("rollout_corr/is_weight_max")})
    token_means.update(gap)
    if cfg.rollout_correction == "none":
        return mb.response_mask, None
    weighted = cfg.rollout_correction.endswith("_truncate") and not cfg.old_is_rollout
    return correction.keep_mask, correction.weights if weighted else None


def _micro_batch(
    batch: PackedBatch, tensors: dict[str, Tensor], rows: Tensor, device: torch.device
) -> tuple[PackedBatch, dict[str, Tensor]]:
    """Rows of the batch (trimmed to their own widths) and of the (B, T) tensors, on `device`."""
    mb = batch.select(rows.to(batch.input_ids.device)).to(device)
    width = mb.response_mask.shape[1]
    return mb, {name: t[rows.to(t.device), :width].to(device) for name, t in tensors.items()}


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# Called as (model=, mb=, mb_tensors=, cfg=, loss_denominator=, tally=) -> loss parts, the
# actor's with width= too when its micro-batches are padding-free.
MicroStep = Callable[..., dict[str, float]]
# This worker's micro-batch count for a mini-batch → the count to run (e.g. the MAX over workers).
MicroBatchCount = Callable[[int], int]


def _micro_rows(
    batch: PackedBatch,
    mini_rows: Tensor,
    cfg: ActorUpdateSettings | CriticUpdateSettings,
    micro_batch_count: MicroBatchCount | None,
) -> list[Tensor]:
    """The (b,) batch-row indices of each micro-batch of one mini-batch's (m,) rows.

    With `cfg.max_tokens_per_micro_batch`: token-budget micro-batches of the rows' prompt +
    response lengths (`token_micro_batches`); otherwise runs of `cfg.micro_batch_size` rows.
    `micro_batch_count` maps this worker's count to the one to run; a larger count re-splits
    the rows (halving token-budget micro-batches, or even runs of rows).
    """
    budget = cfg.max_tokens_per_micro_batch
    padding_free = isinstance(cfg, ActorUpdateSettings) and cfg.padding_free
    lengths = (batch.prompt_lengths + batch.response_lengths)[mini_rows.to(batch.input_ids.device)]
    if budget is None:
        own = -(-int(mini_rows.numel()) // cfg.micro_batch_size)
    elif padding_free:
        own = count_end_to_end_micro_batches(lengths, budget)
    else:
        own = count_token_micro_batches(lengths, budget)
    count = own if micro_batch_count is None else micro_batch_count(own)
    if not own <= count <= mini_rows.numel():
        raise ValueError(
            f"micro_batch_count gave {count} micro-batches for a mini-batch of "
            f"{mini_rows.numel()} rows that needs {own}: it must be between the two"
        )
    if budget is None:
        if count == own:
            return list(torch.split(mini_rows, cfg.micro_batch_size))
        return list(torch.tensor_split(mini_rows, count))
    split = end_to_end_micro_batches if padding_free else token_micro_batches
    return [mini_rows[group] for group in split(lengths, budget, count)]


def _bin_width(
    batch: PackedBatch, mini_rows: Tensor, cfg: ActorUpdateSettings | CriticUpdateSettings
) -> dict[str, int]:
    """``{"width": the mini-batch's longest row}`` for padding-free actor micro-batches (their
    bins' width, see `tasks.batching.end_to_end_micro_batches`), else nothing."""
    if not (isinstance(cfg, ActorUpdateSettings) and cfg.padding_free):
        return {}
    lengths = batch.prompt_lengths + batch.response_lengths
    return {"width": int(lengths[mini_rows.to(lengths.device)].max())}


@dataclass
class _Epochs:
    """The loop both updates share: per epoch, per mini-batch (one optimizer step), per
    micro-batch `micro_step` (forward + backward, returns its loss parts); then reduce, clip and
    step. `role` names the grad-norm metric (`<role>/grad_norm`); `micro_batch_count` maps each
    mini-batch's micro-batch count to the one to run (see `_micro_rows`)."""

    role: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    cfg: ActorUpdateSettings | CriticUpdateSettings
    micro_step: MicroStep

    def run(
        self,
        batch: PackedBatch,
        per_token: dict[str, Tensor],
        scheduler: Scheduler | None,
        grad_reducer: GradReducer | None,
        global_tokens: float | Sequence[float] | None,
        global_seqs: float | Sequence[float] | None,
        micro_batch_count: MicroBatchCount | None = None,
        grad_sync: GradSync | None = None,
    ) -> _Tally:
        cfg, tally = self.cfg, _Tally()
        override = global_tokens if cfg.agg == "token-mean" else global_seqs
        step = functools.partial(self.micro_step, model=self.model, cfg=cfg, tally=tally)
        device = _model_device(self.model)
        for epoch in range(cfg.ppo_epochs):
            # 1. Mini-batches and each one's loss denominator.
            minibatches = _minibatch_rows(
                batch_size=batch.batch_size,
                mini_batch_size=cfg.mini_batch_size,
                epoch=epoch,
                shuffle_seed=cfg.shuffle_seed,
            )
            denominators = _denominators(
                override=override,
                response_mask=batch.response_mask,
                minibatches=minibatches,
                agg=cfg.agg,
                shuffled=cfg.shuffle_seed is not None,
            )
            for mini_rows, denominator in zip(minibatches, denominators):
                # 2. Forward/backward every micro-batch with the mini-batch's denominator.
                micro = _micro_rows(batch, mini_rows, cfg, micro_batch_count)
                bins = _bin_width(batch, mini_rows, cfg)
                for index, micro_rows in enumerate(micro):
                    mb, mb_tensors = _micro_batch(batch, per_token, micro_rows, device)
                    last = index == len(micro) - 1
                    with grad_sync(last) if grad_sync is not None else contextlib.nullcontext():
                        tally.add_step(
                            **step(
                                mb=mb, mb_tensors=mb_tensors, loss_denominator=denominator, **bins
                            )
                        )
                # 3. Reduce, clip, step.
                grad_norm = _optimizer_step(
                    model=self.model,
                    optimizer=self.optimizer,
                    max_grad_norm=cfg.max_grad_norm,
                    grad_reducer=grad_reducer,
                    scheduler=scheduler,
                    tally=tally,
                )
                tally.add_step(**{f"{self.role}/grad_norm": grad_norm})
        return tally


def actor_update(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    ref_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    cfg: ActorUpdateSettings,
    scheduler: Scheduler | None = None,
    grad_reducer: GradReducer | None = None,
    global_tokens: float | Sequence[float] | None = None,
    global_seqs: float | Sequence[float] | None = None,
    micro_batch_count: MicroBatchCount | None = None,
    grad_sync: GradSync | None = None,
) -> dict[str, float]:
    """PPO epochs over `batch`; old_logprobs, advantages, ref_logprobs, rollout_logprobs are (B, T).

    `old_logprobs=None` (one optimizer step only): the step's own forward pass, detached, is
    the old policy (ratio 1), and with `ref_logprobs` actor/kl_to_ref (k1) is logged.
    `rollout_logprobs` (the behaviour policy's) drive `cfg.rollout_correction` and the
    `rollout_corr/*` metrics (`_correct`).

    1. Split rows into mini-batches (one optimizer step each) and fix each one's denominator.
    2. Per mini-batch: forward/backward every micro-batch (as `ActorUpdateSettings` splits
       them) with that denominator. `micro_batch_count(own)` (optional) gives how many to run
       from this worker's own count: under FSDP a MAX over the workers, so every worker runs as
       many passes. The split changes the step only by float rounding.
    3. Reduce gradients (grad_reducer), clip, step; the scheduler steps per optimizer step.
    Returns mean metrics over steps (losses, grad norm) or real tokens (clipfrac, ppo_kl).
    """
    given = {
        "advantages": advantages,
        "old_logprobs": old_logprobs,
        "ref_logprobs": ref_logprobs,
        "rollout_logprobs": rollout_logprobs,
        "teacher_logprobs": teacher_logprobs,
    }
    per_token = _actor_per_token(batch, cfg, given)
    if cfg.padding_free:
        check_keeps_rows_apart(model, batch)
    loop = _Epochs(
        role="actor", model=model, optimizer=optimizer, cfg=cfg, micro_step=_actor_micro_step
    )
    tally = loop.run(
        batch,
        per_token,
        scheduler,
        grad_reducer,
        global_tokens,
        global_seqs,
        micro_batch_count,
        grad_sync,
    )
    metrics = tally.metrics()
    metrics["actor/lr"] = float(optimizer.param_groups[0]["lr"])
    metrics["actor/skipped_steps"] = float(tally.skipped_steps)
    return metrics


def _actor_per_token(
    batch: PackedBatch, cfg: ActorUpdateSettings, given: dict[str, Tensor | None]
) -> dict[str, Tensor]:
    """The (B, T) inputs of ``actor_update`` that were given, checked: ``old_logprobs=None`` only
    for one optimizer step, the behaviour policy's log-probs where the correction needs them,
    every shape the batch's."""
    per_token = {name: value for name, value in given.items() if value is not None}
    if "old_logprobs" not in per_token and (
        cfg.ppo_epochs > 1 or cfg.mini_batch_size < batch.batch_size
    ):
        raise ValueError(
            "old_logprobs=None needs a single optimizer step (ppo_epochs=1 and mini_batch_size ≥ "
            f"the batch's {batch.batch_size} rows); got ppo_epochs={cfg.ppo_epochs}, "
            f"mini_batch_size={cfg.mini_batch_size}: recompute old_logprobs"
        )
    behaviour = per_token.get("old_logprobs" if cfg.old_is_rollout else "rollout_logprobs")
    if behaviour is None and (cfg.old_is_rollout or cfg.rollout_correction != "none"):
        raise ValueError(
            f"rollout_correction={cfg.rollout_correction!r} (old_is_rollout="
            f"{cfg.old_is_rollout}) needs the behaviour policy's log-probs: pass "
            "rollout_logprobs (or old_logprobs with old_is_rollout)"
        )
    _check_per_token(batch, per_token)
    return per_token


class PaddingFreeError(ValueError):
    """The model mixes rows laid end to end (``actor.padding_free``)."""


_KEEPS_ROWS_APART: weakref.WeakSet[nn.Module] = weakref.WeakSet()


@torch.no_grad()
def check_keeps_rows_apart(model: nn.Module, batch: PackedBatch, *, probe_tokens: int = 16) -> None:
    """Raise `PaddingFreeError` unless the model's logits for two rows laid end to end equal
    those of each row alone (once per model; float32 and float64 logits within 1e-4, lower
    precisions within 5e-2).

    The rows are the batch's first two cut to `probe_tokens` tokens each (one row twice when
    the batch has one). A model that does not build its attention from ``position_ids`` (no
    packed-sequence masks) lets the second row see the first and fails here.
    """
    if model in _KEEPS_ROWS_APART:
        return
    device = _model_device(model)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    picks = (0, min(1, batch.batch_size - 1))
    rows = [batch.input_ids[b, : min(lengths[b], probe_tokens)].to(device) for b in picks]
    alone = [model(input_ids=row.unsqueeze(0), use_cache=False).logits[0] for row in rows]
    positions = torch.cat([torch.arange(row.numel(), device=device) for row in rows])
    together = model(
        input_ids=torch.cat(rows).unsqueeze(0),
        position_ids=positions.unsqueeze(0),
        use_cache=False,  # with a cache, transformers builds no packed-sequence mask
    ).logits[0]
    gap = float((together.double() - torch.cat(alone).double()).abs().max())
    precise = together.dtype in (torch.float32, torch.float64)
    tolerance = 1e-4 if precise else 5e-2
    if not gap <= tolerance:
        raise PaddingFreeError(
            f"actor.padding_free=true: {type(model).__name__} lets rows laid end to end see "
            f"each other (logits differ from each row alone by {gap:.3g} > {tolerance:g}): "
            "set actor.padding_free=false"
        )
    _KEEPS_ROWS_APART.add(model)


def _check_per_token(batch: PackedBatch, tensors: dict[str, Tensor]) -> None:
    expected = tuple(batch.response_mask.shape)
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but the batch's response_mask is "
                f"{expected} (B, T)"
            )


def _critic_micro_step(
    *,
    model: nn.Module,
    mb: PackedBatch,
    mb_tensors: dict[str, Tensor],
    cfg: CriticUpdateSettings,
    loss_denominator: float,
    tally: _Tally,
) -> dict[str, float]:
    values = gather_response_values(values=_forward_logits(model, mb)[..., 0], batch=mb)  # (b, T)
    if values.dtype in (torch.float16, torch.bfloat16):
        values = values.float()
    out = value_loss(
        values=values,
        old_values=mb_tensors["old_values"],
        returns=mb_tensors["returns"],
        response_mask=mb.response_mask,
        clip_range=cfg.clip_range,
        agg=cfg.agg,
        loss_denominator=loss_denominator,
    )
    torch.autograd.backward(out.loss)
    n_tokens = float(mb.response_mask.sum())
    vpred = float(values.detach().sum()) / max(n_tokens, 1.0)  # masked positions are 0
    tally.add_tokens(
        n_tokens, **{"critic/vf_clipfrac": float(out.clipfrac), "critic/vpred_mean": vpred}
    )
    return {"critic/vf_loss": float(out.loss.detach())}


def critic_update(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    old_values: Tensor,
    returns: Tensor,
    cfg: CriticUpdateSettings,
    scheduler: Scheduler | None = None,
    grad_reducer: GradReducer | None = None,
    global_tokens: float | Sequence[float] | None = None,
    global_seqs: float | Sequence[float] | None = None,
    micro_batch_count: MicroBatchCount | None = None,
    grad_sync: GradSync | None = None,
) -> dict[str, float]:
    """Clipped value-loss epochs over `batch`; old_values and returns are (B, T).

    Same steps as `actor_update`: mini-batch denominators, micro-batch backward (fixed rows or
    a token budget, `micro_batch_count` as there), reduce, clip, step.
    """
    per_token = {"old_values": old_values, "returns": returns}
    _check_per_token(batch, per_token)

    loop = _Epochs(
        role="critic", model=model, optimizer=optimizer, cfg=cfg, micro_step=_critic_micro_step
    )
    tally = loop.run(
        batch,
        per_token,
        scheduler,
        grad_reducer,
        global_tokens,
        global_seqs,
        micro_batch_count,
        grad_sync,
    )
    metrics = tally.metrics()
    metrics["critic/lr"] = float(optimizer.param_groups[0]["lr"])
    return metrics
