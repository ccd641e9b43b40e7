"""Padding-free micro-batches (``actor.padding_free``): rows laid end to end in bins, the model's
attention kept to each row by ``position_ids``.

The layout puts every row's tokens and positions where it says; an update with rows laid end to
end takes the same steps as the padded one (float64, a rotary Llama and a GPT-2 with learned
positions); a model that ignores ``position_ids`` is refused before the first step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel

from infra.config import ConfigError, load_config
from tasks.batching import (
    PackedBatch,
    count_end_to_end_micro_batches,
    end_to_end,
    end_to_end_micro_batches,
    gather_response_logprobs,
    pack_batch,
)
from tasks.update import actor_update
from tasks.update.optimize import PaddingFreeError
from tests.tasks.test_optimize_on_cpu import (
    VOCAB,
    actor_inputs,
    actor_settings,
    assert_same_parameters,
    tiny_policy,
)


def ragged_batch(seed: int):
    """16 rows, prompts of 1-4 tokens, responses long and short as sampled ones are (row 3
    empty): several rows share a bin."""
    generator = torch.Generator().manual_seed(seed)
    responses = [14, 1, 12, 0, 2, 13, 3, 9, 4, 11, 2, 6, 1, 10, 5, 3]
    prompts = torch.randint(1, 5, (len(responses),), generator=generator).tolist()
    return pack_batch(
        prompt_ids=[torch.randint(1, VOCAB, (n,), generator=generator) for n in prompts],
        response_ids=[torch.randint(1, VOCAB, (n,), generator=generator) for n in responses],
        pad_id=0,
    )


def tiny_gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, attn_implementation="sdpa"
    )
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(config, key, 0.0)
    return GPT2LMHeadModel(config).to(torch.float64)


def test_the_layout_puts_each_rows_tokens_and_positions_at_its_offset() -> None:
    batch = ragged_batch(0)
    layout = end_to_end(batch)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    width = max(lengths)
    assert layout.input_ids.shape[1] == width
    assert layout.input_ids.shape[0] < batch.batch_size  # rows share bins
    seen: dict[int, list[tuple[int, int]]] = {}
    for row, n in enumerate(lengths):
        at = int(layout.row_bin[row])
        start = int(layout.response_index[row, 0]) - int(batch.prompt_lengths[row]) + 1
        assert layout.input_ids[at, start : start + n].tolist() == batch.input_ids[row, :n].tolist()
        assert layout.position_ids[at, start : start + n].tolist() == list(range(n))
        seen.setdefault(at, []).append((start, start + n))
    for spans in seen.values():  # rows of one bin never overlap
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_micro_batches_hold_about_the_budget_in_real_tokens_and_split_to_a_count() -> None:
    lengths = torch.tensor([30, 2, 28, 5, 25, 3, 10, 20, 7, 1])
    groups = end_to_end_micro_batches(lengths, budget=60)
    assert count_end_to_end_micro_batches(lengths, 60) == len(groups)
    assert sorted(torch.cat(groups).tolist()) == list(range(10))
    # bins of 30: (30), (28, 2), (25, 5), (20, 10), (7, 3, 1); two bins a micro-batch
    assert [g.tolist() for g in groups] == [[0, 1, 2], [3, 4, 6, 7], [5, 8, 9]]
    for group in groups:  # the layout at the longest row's width makes the same two bins or fewer
        rows = torch.zeros(int(lengths.max()), dtype=torch.long)
        batch = pack_batch(
            prompt_ids=[rows[: int(lengths[g])] + 1 for g in group],
            response_ids=[rows[:0] for _ in group],
            pad_id=0,
        )
        assert end_to_end(batch, 30).input_ids.shape[0] * 30 <= 60
    more = end_to_end_micro_batches(lengths, budget=60, count=5)
    assert len(more) == 5 and sorted(torch.cat(more).tolist()) == list(range(10))
    with pytest.raises(ValueError, match="outside"):
        end_to_end_micro_batches(lengths, budget=60, count=2)


def shared_bins(batch: PackedBatch, budget: int) -> int:
    """Bins holding two or more rows with a response, over the update's micro-batches."""
    lengths = batch.prompt_lengths + batch.response_lengths
    count = 0
    for group in end_to_end_micro_batches(lengths, budget):
        mb = batch.select(group)
        layout = end_to_end(mb, int(lengths.max()))
        answered = layout.row_bin[mb.response_lengths > 0]
        count += int((torch.bincount(answered) >= 2).sum())
    return count


@pytest.mark.parametrize("build", [tiny_policy, tiny_gpt2], ids=["llama", "gpt2"])
def test_an_update_with_rows_end_to_end_takes_the_padded_updates_steps(build) -> None:
    batch = ragged_batch(1)
    assert shared_bins(batch, budget=48) >= 3  # rows that train share bins
    reference = build(seed=4)
    inputs = actor_inputs(reference, batch, seed=5)
    results = []
    for padding_free in (False, True):
        model = copy.deepcopy(reference)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        cfg = actor_settings(
            "token-mean", 4, mini=16, max_tokens_per_micro_batch=48, padding_free=padding_free
        )
        metrics = actor_update(model=model, optimizer=optimizer, batch=batch, cfg=cfg, **inputs)
        results.append((model, metrics))
    (padded, metrics_a), (packed, metrics_b) = results
    assert not torch.equal(next(packed.parameters()), next(reference.parameters()))
    assert_same_parameters(padded, packed, atol=1e-10)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], abs=1e-10), key


class PositionsIgnored(nn.Module):
    """A causal LM that drops ``position_ids``: rows laid end to end see each other."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: Tensor, **kwargs: Tensor) -> object:
        kwargs.pop("position_ids", None)
        return self.inner(input_ids=input_ids, **kwargs)


def test_a_model_that_ignores_position_ids_is_refused_before_any_step() -> None:
    batch = ragged_batch(2)
    model = PositionsIgnored(tiny_policy(seed=6))
    inputs = actor_inputs(model, batch, seed=7)
    before = copy.deepcopy(model.state_dict())
    cfg = actor_settings("token-mean", 4, mini=16, max_tokens_per_micro_batch=48, padding_free=True)
    with pytest.raises(PaddingFreeError, match=r"set actor\.padding_free=false"):
        actor_update(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            batch=batch,
            cfg=cfg,
            **inputs,
        )
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_padding_free_without_a_token_budget_is_one_line_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"actor\.max_tokens_per_micro_batch") as caught:
        load_config("tiny", ["actor.padding_free=true"])
    assert "\n" not in str(caught.value)
    cfg = load_config("tiny", ["actor.padding_free=true", "actor.max_tokens_per_micro_batch=512"])
    assert cfg.actor.padding_free


def test_the_layouts_logprobs_equal_the_padded_forwards() -> None:
    batch = ragged_batch(3)
    model = tiny_gpt2(seed=8)
    with torch.no_grad():
        padded = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long())
        expected = gather_response_logprobs(logits=padded.logits, batch=batch)
        layout = end_to_end(batch)
        logits = model(
            input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False
        ).logits
    from tasks.batching import gather_response_logits, logprobs_from_response_logits

    got = logprobs_from_response_logits(
        response_logits=gather_response_logits(logits=logits, batch=batch, layout=layout),
        batch=batch,
    )
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
