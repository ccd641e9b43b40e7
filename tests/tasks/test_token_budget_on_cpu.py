"""Token-budget micro-batches: the packing's properties, and that actor/critic updates and the
log-prob forward give the same results as fixed-row micro-batches on tiny float64 Llama models
built in-test, while the model sees fewer padded tokens."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_optimize_on_cpu import (  # helpers of the fixed-row update tests
    VOCAB,
    actor_inputs,
    actor_settings,
    assert_same_parameters,
    critic_settings,
    one_torch_thread,  # noqa: F401  (autouse fixture: one torch thread in this module too)
    tiny_critic,
    tiny_policy,
)
from torch import Tensor, nn

from tasks.batching import PackedBatch, count_token_micro_batches, pack_batch, token_micro_batches
from tasks.update import AGGREGATIONS, CriticUpdateSettings, actor_update, critic_update

# ----------------------------------------------------------------------------- packing


def check_packing(lengths: list[int], budget: int, groups: list[Tensor]) -> None:
    """Every row once; each micro-batch within budget unless it is one over-long row; rows
    sorted by length (longest first) within and across micro-batches."""
    flat = torch.cat(groups) if groups else torch.zeros(0, dtype=torch.long)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert all(g.dtype == torch.long and g.numel() > 0 for g in groups)
    for g in groups:
        rows = [lengths[i] for i in g.tolist()]
        assert len(rows) * max(rows) <= budget or (len(rows) == 1 and rows[0] > budget)
    ordered = [lengths[i] for i in flat.tolist()]
    assert ordered == sorted(ordered, reverse=True)


def fewest_contiguous(lengths: list[int], budget: int) -> int:
    """Brute-force reference: the fewest runs of the longest-first order within budget."""
    sizes = sorted(lengths, reverse=True)
    best = [0] + [len(sizes) + 1] * len(sizes)  # best[i]: fewest runs covering sizes[:i]
    for end in range(1, len(sizes) + 1):
        for start in range(end):
            run = sizes[start:end]
            if len(run) * run[0] <= budget or len(run) == 1:
                best[end] = min(best[end], best[start] + 1)
    return best[-1]


def test_packing_hand_worked() -> None:
    # Lengths 33, 2, 4, 4, 27, 4, 4, 16 with budget 66, longest first: 66 // 33 = 2 rows
    # {33, 27} (cost 66), then 66 // 16 = 4 rows {16, 4, 4, 4} (64), then {4, 2} (8).
    lengths = torch.tensor([33, 2, 4, 4, 27, 4, 4, 16])
    groups = token_micro_batches(lengths, 66)
    assert [g.tolist() for g in groups] == [[0, 4], [7, 2, 3, 5], [6, 1]]
    assert count_token_micro_batches(lengths, 66) == 3
    # A row over the budget runs alone; count=5 halves the costliest runs of > 1 row.
    assert [g.tolist() for g in token_micro_batches(lengths, 30)] == [
        [0],
        [4],
        [7],
        [2, 3, 5, 6, 1],
    ]
    assert [g.tolist() for g in token_micro_batches(lengths, 66, count=5)] == [
        [0],
        [4],
        [7, 2],
        [3, 5],
        [6, 1],
    ]
    with pytest.raises(ValueError, match="outside"):
        token_micro_batches(lengths, 66, count=2)
    with pytest.raises(ValueError, match="outside"):
        token_micro_batches(lengths, 66, count=9)
    with pytest.raises(ValueError, match="budget"):
        count_token_micro_batches(lengths, 0)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=24),
    budget=st.integers(1, 160),
    extra=st.integers(0, 30),
)
def test_packing_properties(lengths: list[int], budget: int, extra: int) -> None:
    tensor = torch.tensor(lengths)
    groups = token_micro_batches(tensor, budget)
    check_packing(lengths, budget, groups)
    fewest = count_token_micro_batches(tensor, budget)
    assert len(groups) == fewest == fewest_contiguous(lengths, budget)
    count = min(fewest + extra, len(lengths))
    forced = token_micro_batches(tensor, budget, count=count)
    assert len(forced) == count
    check_packing(lengths, budget, forced)
    assert [g.tolist() for g in token_micro_batches(tensor, budget, count=count)] == [
        g.tolist() for g in forced
    ]  # deterministic


# ----------------------------------------------------------------------------- updates

PROMPTS = [3, 1, 4, 2, 2, 1, 3, 4]
RESPONSES = [30, 1, 0, 2, 25, 3, 1, 12]  # very different lengths; row 2 is empty
LONGEST = max(p + r for p, r in zip(PROMPTS, RESPONSES))  # 33
BUDGET = 2 * LONGEST  # what a fixed 2-row micro-batch may cost at worst


def jagged_batch(seed: int) -> PackedBatch:
    generator = torch.Generator().manual_seed(seed)
    return pack_batch(
        prompt_ids=[torch.randint(1, VOCAB, (n,), generator=generator) for n in PROMPTS],
        response_ids=[torch.randint(1, VOCAB, (n,), generator=generator) for n in RESPONSES],
        pad_id=0,
    )


class TokenCounter:
    """Counts the (b × L) tokens of every forward pass of a model."""

    def __init__(self, model: nn.Module) -> None:
        self.shapes: list[tuple[int, int]] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, _module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self.shapes.append((int(ids.shape[0]), int(ids.shape[1])))

    @property
    def tokens(self) -> int:
        return sum(b * length for b, length in self.shapes)


def run_actor(
    reference: nn.Module,
    batch: PackedBatch,
    inputs: dict[str, Tensor],
    agg: str,
    micro_batch_count: Callable[[int], int] | None = None,
    **extra: object,
) -> tuple[nn.Module, dict[str, float], TokenCounter]:
    model = copy.deepcopy(reference)
    counter = TokenCounter(model)
    options = {"mini": 4, "shuffle_seed": 1, **extra}
    metrics = actor_update(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        batch=batch,
        cfg=actor_settings(agg, **options),  # type: ignore[arg-type]
        micro_batch_count=micro_batch_count,
        **inputs,
    )
    return model, metrics, counter


ACTOR_METRICS = (
    "actor/pg_loss",
    "actor/entropy",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
)


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_actor_token_budget_matches_fixed_micro_batches(agg: str) -> None:
    batch = jagged_batch(0)
    reference = tiny_policy(seed=10)
    inputs = actor_inputs(reference, batch, seed=11)
    fixed, fixed_metrics, fixed_count = run_actor(reference, batch, inputs, agg, micro=2)
    packed, packed_metrics, packed_count = run_actor(
        reference, batch, inputs, agg, micro=2, max_tokens_per_micro_batch=BUDGET
    )
    assert not torch.equal(next(fixed.parameters()), next(reference.parameters()))
    assert_same_parameters(fixed, packed, atol=1e-10)
    for key in ACTOR_METRICS:
        assert packed_metrics[key] == pytest.approx(fixed_metrics[key], abs=1e-10), key
    # The forwards stay within the budget and see fewer padded tokens in no more passes.
    assert all(b * length <= BUDGET for b, length in packed_count.shapes)
    assert packed_count.tokens < fixed_count.tokens
    assert len(packed_count.shapes) <= len(fixed_count.shapes)


def test_token_budget_packs_fewer_padded_tokens_on_the_whole_batch() -> None:
    # One mini-batch of the 8 rows in order. Fixed 2-row micro-batches: 2·33 + 2·4 + 2·27 +
    # 2·16 = 160 tokens in 4 passes; the budget 66 packs 2·33 + 4·16 + 2·4 = 138 in 3.
    batch = jagged_batch(1)
    reference = tiny_policy(seed=12)
    inputs = actor_inputs(reference, batch, seed=12)
    common = {"mini": 8, "shuffle_seed": None, "ppo_epochs": 1}
    fixed, _, fixed_count = run_actor(reference, batch, inputs, "token-mean", micro=2, **common)
    packed, _, packed_count = run_actor(
        reference, batch, inputs, "token-mean", micro=2, max_tokens_per_micro_batch=66, **common
    )
    assert (fixed_count.tokens, len(fixed_count.shapes)) == (160, 4)
    assert (packed_count.tokens, len(packed_count.shapes)) == (138, 3)
    assert_same_parameters(fixed, packed, atol=1e-10)


@pytest.mark.parametrize("budgeted", [True, False])
def test_a_larger_micro_batch_count_gives_the_same_update(budgeted: bool) -> None:
    batch = jagged_batch(2)
    reference = tiny_policy(seed=13)
    inputs = actor_inputs(reference, batch, seed=13)
    extra: dict[str, object] = {"max_tokens_per_micro_batch": BUDGET} if budgeted else {}
    base, base_metrics, base_count = run_actor(
        reference, batch, inputs, "seq-mean-token-mean", micro=2, **extra
    )
    asked: list[int] = []

    def more(own: int) -> int:  # as a MAX over workers would when another worker needs more
        asked.append(own)
        return min(own + 2, 4)

    forced, forced_metrics, forced_count = run_actor(
        reference, batch, inputs, "seq-mean-token-mean", more, micro=2, **extra
    )
    assert len(asked) == 4  # 2 epochs × 2 mini-batches of 4 rows
    assert len(forced_count.shapes) == sum(min(n + 2, 4) for n in asked)
    assert len(forced_count.shapes) > len(base_count.shapes)
    assert_same_parameters(base, forced, atol=1e-10)
    for key in ACTOR_METRICS:
        assert forced_metrics[key] == pytest.approx(base_metrics[key], abs=1e-10), key
    with pytest.raises(ValueError, match="micro_batch_count gave 5"):
        run_actor(reference, batch, inputs, "token-mean", lambda n: 5, micro=2, **extra)


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_critic_token_budget_matches_fixed_micro_batches(agg: str) -> None:
    batch = jagged_batch(3)
    reference = tiny_critic(seed=14)
    generator = torch.Generator().manual_seed(15)
    shape = batch.response_mask.shape
    old_values = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.1
    returns = torch.randn(shape, generator=generator, dtype=torch.float64)
    results = []
    for budget in (None, BUDGET):
        model = copy.deepcopy(reference)
        counter = TokenCounter(model)
        cfg = CriticUpdateSettings(
            ppo_epochs=2,
            mini_batch_size=4,
            micro_batch_size=2,
            clip_range=0.2,
            agg=agg,
            max_grad_norm=0.5,
            shuffle_seed=1,
            max_tokens_per_micro_batch=budget,
        )
        metrics = critic_update(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            batch=batch,
            old_values=old_values,
            returns=returns,
            cfg=cfg,
            micro_batch_count=lambda n: n,
        )
        results.append((model, metrics, counter))
    (fixed, fixed_metrics, fixed_count), (packed, packed_metrics, packed_count) = results
    assert not torch.equal(fixed.score.weight, reference.score.weight)
    assert_same_parameters(fixed, packed, atol=1e-10)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/vpred_mean"):
        assert packed_metrics[key] == pytest.approx(fixed_metrics[key], abs=1e-10), key
    assert packed_count.tokens < fixed_count.tokens


def test_settings_reject_a_non_positive_budget() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        critic_settings(max_tokens_per_micro_batch=0)


# ----------------------------------------------------------------------------- stages


def fake_worker(micro: int, budget: int | None) -> Any:
    """The worker surface ``micro_forward`` reads, with a real run config."""
    from infra.config import load_config

    cfg = load_config(
        None,
        [
            f"logprobs.micro_batch_size={micro}",
            f"logprobs.max_tokens_per_micro_batch={'null' if budget is None else budget}",
            "rollout.temperature=0.9",
            "rollout.max_new_tokens=1",
            "data.max_prompt_length=1",
        ],
    )
    return SimpleNamespace(cfg=cfg, device=torch.device("cpu"), spec=SimpleNamespace(world_size=1))


def test_logprob_forward_with_a_token_budget_matches_fixed_rows() -> None:
    from tasks.logprobs.stage import agree_count, response_logprobs, response_values

    batch = jagged_batch(4)
    policy, critic = tiny_policy(seed=16), tiny_critic(seed=16)
    for forward, model in ((response_logprobs, policy), (response_values, critic)):
        counter = TokenCounter(model)
        fixed = forward(fake_worker(2, None), model, batch)
        fixed_tokens = counter.tokens
        packed = forward(fake_worker(2, BUDGET), model, batch)
        forced = forward(fake_worker(2, BUDGET), model, batch, count_reducer=lambda n: 8)
        more_rows = forward(fake_worker(2, None), model, batch, count_reducer=lambda n: 5)
        assert fixed.shape == packed.shape == forced.shape == batch.response_mask.shape
        assert fixed.dtype == packed.dtype == torch.float32
        for out in (packed, forced, more_rows):
            torch.testing.assert_close(out, fixed, atol=1e-5, rtol=0)
            assert not out[~batch.response_mask].any()  # zero past each response
        assert len(counter.shapes) == 4 + 3 + 8 + 5
        packed_tokens = sum(b * length for b, length in counter.shapes[4:7])
        assert packed_tokens < fixed_tokens
    assert agree_count(fake_worker(2, None), 3) == 3


def test_update_settings_carry_the_configured_budgets() -> None:
    from infra.config import load_config
    from tasks.update.stage import actor_settings as stage_actor_settings
    from tasks.update.stage import critic_settings

    cfg = load_config(None, [])
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    cfg = load_config(
        None,
        [
            f"actor.max_tokens_per_micro_batch={longest * 4}",
            f"critic.max_tokens_per_micro_batch={longest * 2}",
        ],
    )
    assert stage_actor_settings(cfg, 2).max_tokens_per_micro_batch == longest * 4
    assert critic_settings(cfg, 2).max_tokens_per_micro_batch == longest * 2
    assert cfg.logprobs_max_tokens == longest * 4
    assert stage_actor_settings(load_config(None, []), 1).max_tokens_per_micro_batch is None
