"""Off-policy correction (tasks.update.correction): hand-worked weights and masks of every mode,
the rollout_corr/* metrics, and the invariant that with the trainer's own log-probs as the
behaviour policy's every mode leaves the update unchanged (tiny models built in-test)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_optimize_on_cpu import (  # helpers of the fixed-row update tests
    actor_inputs,
    actor_settings,
    assert_same_parameters,
    make_batch,
    one_torch_thread,  # noqa: F401  (autouse fixture: one torch thread in this module too)
    tiny_policy,
)
from torch import Tensor

from tasks.batching import gather_response_logprobs, pack_batch
from tasks.update import actor_update
from tasks.update.correction import CORRECTIONS, rollout_correction, rollout_gap

MODES = sorted(CORRECTIONS)

# Two rows, the second with one padded position (its 7.0 must never leak in). The behaviour
# policy's log-probs are 0, so ρ_t = exp(old_logprobs):
#   row 0: ρ_t = [4, 0.25, 1]  → Σ log ρ = 0      → ρ_b = 1, geometric mean 1
#   row 1: ρ_t = [3, 1, ·]     → Σ log ρ = ln 3   → ρ_b = 3, geometric mean √3 ≈ 1.73
# with cap 2 and [low, high] = [0.5, 2].
OLD = torch.tensor(
    [[math.log(4), math.log(0.25), 0.0], [math.log(3), 0.0, 7.0]], dtype=torch.float64
)
MASK = torch.tensor([[True, True, True], [True, True, False]])
T, F = True, False
HAND = {
    # weights (B, T), keep_mask (B, T)
    "none": ([[1, 1, 1], [1, 1, 0]], [[T, T, T], [T, T, F]]),
    # min(ρ_t, 2): 4 → 2 and 3 → 2 (the cap bit twice, 2 of 5 tokens).
    "token_truncate": ([[2, 0.25, 1], [2, 1, 0]], [[T, T, T], [T, T, F]]),
    # min(ρ_b, 2) on every token of the row: row 0 → 1, row 1 → min(3, 2) = 2.
    "sequence_truncate": ([[1, 1, 1], [2, 2, 0]], [[T, T, T], [T, T, F]]),
    # ρ_t inside [0.5, 2]: only the tokens with ρ_t = 1 stay.
    "token_mask": ([[0, 0, 1], [0, 1, 0]], [[F, F, T], [F, T, F]]),
    # ρ_b inside [0.5, 2]: row 0 (1) stays, row 1 (3) goes.
    "sequence_mask": ([[1, 1, 1], [0, 0, 0]], [[T, T, T], [F, F, F]]),
    # geometric means 1 and √3 both lie inside [0.5, 2]: everything stays.
    "geometric_mask": ([[1, 1, 1], [1, 1, 0]], [[T, T, T], [T, T, F]]),
}
CLIPPED = {"token_truncate": 2 / 5, "sequence_truncate": 2 / 5}  # shares of the 5 real tokens
MASKED = {"token_mask": 3 / 5, "sequence_mask": 2 / 5}


def correct(mode: str, **bounds: float) -> object:
    limits = {"cap": 2.0, "low": 0.5, "high": 2.0, **bounds}
    return rollout_correction(
        old_logprobs=OLD,
        rollout_logprobs=torch.zeros_like(OLD),
        response_mask=MASK,
        mode=mode,
        **limits,
    )


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_hand_worked_weights_and_masks(mode: str) -> None:
    out = correct(mode)
    weights, keep = HAND[mode]
    torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=torch.float64))
    assert out.keep_mask.tolist() == keep
    gap = rollout_gap(
        old_logprobs=OLD, rollout_logprobs=torch.zeros_like(OLD), response_mask=MASK, correction=out
    )
    assert gap.clipped_fraction == pytest.approx(CLIPPED.get(mode, 0.0))
    assert gap.masked_fraction == pytest.approx(MASKED.get(mode, 0.0))


def test_a_tighter_high_masks_the_geometric_mean() -> None:
    # Row 1's geometric mean √3 ≈ 1.73 lies above high = 1.5: the whole row goes.
    out = correct("geometric_mask", high=1.5)
    assert out.keep_mask.tolist() == [[T, T, T], [F, F, F]]


def test_the_gap_metrics_are_the_hand_worked_values() -> None:
    out = correct("token_truncate")
    gap = rollout_gap(
        old_logprobs=OLD, rollout_logprobs=torch.zeros_like(OLD), response_mask=MASK, correction=out
    )
    # k1 = mean(log π_rollout − log π_old) = −(ln 4 + ln ¼ + 0 + ln 3 + 0) / 5 = −ln 3 / 5.
    assert gap.kl_k1 == pytest.approx(-math.log(3) / 5)
    # k3 = mean(ρ − 1 − ln ρ) over the 5 real tokens (the ρ = 1 tokens give 0).
    k3 = sum(r - 1 - math.log(r) for r in (4, 0.25, 3)) / 5
    assert gap.kl_k3 == pytest.approx(k3)
    # Trainer / rollout perplexity per row, exp(−mean log ρ): row 0 → 1, row 1 → 1/√3; mean.
    assert gap.ppl_ratio == pytest.approx((1 + 1 / math.sqrt(3)) / 2)
    # The token ratios before the cap: mean (4 + 0.25 + 1 + 3 + 1) / 5, max 4.
    assert gap.is_weight_mean == pytest.approx(9.25 / 5)
    assert gap.is_weight_max == pytest.approx(4.0)
    assert set(gap.metrics()) == {
        f"rollout_corr/{name}"
        for name in (
            "kl_k1",
            "kl_k3",
            "ppl_ratio",
            "is_weight_mean",
            "is_weight_max",
            "clipped_fraction",
            "masked_fraction",
        )
    }


def own_logprobs(model: torch.nn.Module, batch: object, temperature: float) -> Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
        return gather_response_logprobs(logits=logits, batch=batch, temperature=temperature)


@pytest.mark.parametrize("proximal", ["first_pass", "stored", "rollout"])
@pytest.mark.parametrize("mode", MODES)
def test_with_the_trainers_own_logprobs_every_mode_leaves_the_update_unchanged(
    mode: str, proximal: str
) -> None:
    """Rollout log-probs = the trainer's: ρ = 1 everywhere, so weights are 1 and nothing is
    masked. π_old is the first forward pass's (one on-policy step), the stored old_logprobs, or
    (old_is_rollout) the rollout's itself."""
    batch = make_batch(4)
    reference = tiny_policy(seed=4)
    settings = {"ppo_epochs": 1, "temperature": 0.9}
    own = own_logprobs(reference, batch, 0.9)
    inputs = actor_inputs(reference, batch, seed=5)  # advantages and a reference's log-probs
    old = None if proximal == "first_pass" else own
    results = []
    for chosen in ("none", mode):
        model = copy.deepcopy(reference)
        metrics = actor_update(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            batch=batch,
            old_logprobs=old,
            advantages=inputs["advantages"],
            ref_logprobs=inputs["ref_logprobs"],
            rollout_logprobs=None if proximal == "rollout" else own,
            cfg=actor_settings(
                "token-mean",
                micro=4,
                rollout_correction=chosen,
                old_is_rollout=proximal == "rollout",
                **settings,
            ),
        )
        results.append((model, metrics))
    (base, _), (corrected, metrics) = results
    assert not torch.equal(next(base.parameters()), next(reference.parameters()))
    assert_same_parameters(base, corrected, atol=1e-12)
    for name in ("kl_k1", "kl_k3", "clipped_fraction", "masked_fraction"):
        assert metrics[f"rollout_corr/{name}"] == pytest.approx(0.0, abs=1e-12), name
    for name in ("ppl_ratio", "is_weight_mean", "is_weight_max"):
        assert metrics[f"rollout_corr/{name}"] == pytest.approx(1.0, abs=1e-12), name


def test_an_hf_engine_in_float32_matches_the_trainer() -> None:
    """Sync mode, float32, the transformers engine: the rollout's log-probs are the trainer's
    to float tolerance, so the gap metrics are zero and the weights one."""
    from infra.engines.hf import TransformersEngine

    trainer = tiny_policy(seed=6, dtype=torch.float32)
    engine = TransformersEngine(copy.deepcopy(trainer), eos_token_id=1, pad_token_id=0)
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 20, (int(n),), generator=generator) for n in (2, 3, 4, 5)]
    out = engine.generate(prompts, n=2, max_new_tokens=6, temperature=1.0, seed=6)
    rows = [p for p in prompts for _ in range(2)]
    batch = pack_batch(prompt_ids=rows, response_ids=out.response_ids, pad_id=0)
    width = batch.response_mask.shape[1]
    rollout = torch.zeros(batch.response_mask.shape)  # (B, T)
    for row, logprobs in enumerate(out.rollout_logprobs):
        rollout[row, : logprobs.numel()] = logprobs
    assert width > 0 and batch.response_mask.sum() > len(rows)
    metrics = actor_update(
        model=trainer,
        optimizer=torch.optim.SGD(trainer.parameters(), lr=0.1),
        batch=batch,
        old_logprobs=None,
        advantages=torch.ones(batch.response_mask.shape),
        rollout_logprobs=rollout,
        cfg=actor_settings(
            "token-mean",
            micro=8,
            ppo_epochs=1,
            temperature=1.0,
            kl_loss_coef=0.0,
            rollout_correction="token_truncate",
        ),
    )
    for name in ("kl_k1", "kl_k3", "clipped_fraction", "masked_fraction"):
        assert metrics[f"rollout_corr/{name}"] == pytest.approx(0.0, abs=1e-5), name
    for name in ("ppl_ratio", "is_weight_mean", "is_weight_max"):
        assert metrics[f"rollout_corr/{name}"] == pytest.approx(1.0, abs=1e-5), name


def test_a_correction_without_the_behaviour_policy_is_refused() -> None:
    batch = make_batch(1)
    model = tiny_policy(seed=1)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        actor_update(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            batch=batch,
            old_logprobs=None,
            advantages=torch.zeros(batch.response_mask.shape, dtype=torch.float64),
            cfg=actor_settings(
                "token-mean", micro=8, ppo_epochs=1, rollout_correction="token_mask"
            ),
        )


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_a_shifted_behaviour_policy_weights_or_masks_every_token(mode: str) -> None:
    """Rollout log-probs one nat below the trainer's: ρ = e everywhere, above cap = high = 2.
    token_truncate weights every token by 2, the same step as no correction at twice the
    learning rate (plain SGD, no clipping, the policy loss alone); token_mask leaves every
    token out, so nothing moves."""
    batch = make_batch(7)
    reference = tiny_policy(seed=7)
    own = own_logprobs(reference, batch, 1.0)
    advantages = actor_inputs(reference, batch, seed=8)["advantages"]
    plain = {"ppo_epochs": 1, "temperature": 1.0, "entropy_coef": 0.0, "kl_loss_coef": 0.0}
    plain["max_grad_norm"] = None

    def step(chosen: str, lr: float) -> tuple[torch.nn.Module, dict[str, float]]:
        model = copy.deepcopy(reference)
        metrics = actor_update(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=lr),
            batch=batch,
            old_logprobs=None,
            advantages=advantages,
            rollout_logprobs=torch.where(batch.response_mask, own - 1.0, 0.0),
            cfg=actor_settings("token-mean", micro=4, rollout_correction=chosen, **plain),
        )
        return model, metrics

    corrected, metrics = step(mode, lr=0.5)
    assert metrics["rollout_corr/kl_k1"] == pytest.approx(-1.0)
    assert metrics["rollout_corr/is_weight_max"] == pytest.approx(math.e)
    if mode == "token_truncate":
        assert metrics["rollout_corr/clipped_fraction"] == pytest.approx(1.0)
        assert_same_parameters(corrected, step("none", lr=1.0)[0], atol=1e-12)
    else:
        assert metrics["rollout_corr/masked_fraction"] == pytest.approx(1.0)
        assert_same_parameters(corrected, reference, atol=0.0)
