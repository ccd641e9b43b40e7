"""RewardScorer: both tokenizer paths, pooling at the last real token, empty responses,
truncation, non-finite scores, batching invariance and sleep/wake."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from infra.assets import AssetPaths
from infra.engines import EngineAsleepError
from infra.reward_model import RewardScorer, tokenizers_match
from tasks.score import find_nonfinite

CASES = [("1+2=", "3"), ("12+34=", "46"), ("7+80=", ""), ("123+456=", "579 579"), ("5+5=", "10")]


@pytest.fixture(scope="module")
def policy_tokenizer(tiny_assets: AssetPaths):
    return AutoTokenizer.from_pretrained(tiny_assets.tokenizer)


@pytest.fixture(scope="module")
def batch(policy_tokenizer) -> dict[str, list]:
    """Policy-side rows as the rollout produces them: chat prompt ids, response ids + EOS."""
    raw_prompt, prompt_ids, response_ids = [], [], []
    for question, answer in CASES:
        messages = [{"role": "user", "content": question}]
        raw_prompt.append(messages)
        prompt_ids.append(
            torch.tensor(
                policy_tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, return_dict=False
                )
            )
        )
        answer_ids = policy_tokenizer(answer, add_special_tokens=False)["input_ids"]
        response_ids.append(torch.tensor([*answer_ids, policy_tokenizer.eos_token_id]))
    return {"prompt_ids": prompt_ids, "response_ids": response_ids, "raw_prompt": raw_prompt}


def _reference_score(model, ids: torch.Tensor) -> float:
    """One unpadded row through the model's own forward (its pooling is unambiguous here)."""
    with torch.no_grad():
        return float(model(input_ids=ids[None]).logits[0, 0])


def test_tokenizer_comparison_is_by_content_not_path(tiny_assets, policy_tokenizer):
    same = AutoTokenizer.from_pretrained(tiny_assets.reward_model)  # a copy in another folder
    other = AutoTokenizer.from_pretrained(tiny_assets.reward_model_alt)
    assert tokenizers_match(same, policy_tokenizer)
    assert not tokenizers_match(other, policy_tokenizer)


def test_same_tokenizer_scores_match_unpadded_forward(tiny_assets, batch):
    scorer = RewardScorer(
        tiny_assets.reward_model, policy_tokenizer_path=tiny_assets.tokenizer, batch_size=2
    )
    assert scorer.same_tokenizer
    out = scorer.score(**batch)
    assert out.scores.shape == (len(CASES),) and out.scores.dtype == torch.float32
    assert out.truncated.dtype == torch.bool and not out.truncated.any()
    for row, (prompt, response) in enumerate(zip(batch["prompt_ids"], batch["response_ids"])):
        expected = _reference_score(scorer.model, torch.cat([prompt, response]))
        assert out.scores[row].item() == pytest.approx(expected, abs=1e-5), f"row {row}"
    assert len(set(out.scores.tolist())) == len(CASES)  # real, distinct scores


def test_scores_do_not_depend_on_batching_or_padding(tiny_assets, batch):
    one = RewardScorer(
        tiny_assets.reward_model, policy_tokenizer_path=tiny_assets.tokenizer, batch_size=1
    )
    many = RewardScorer(
        tiny_assets.reward_model, policy_tokenizer_path=tiny_assets.tokenizer, batch_size=64
    )
    # A response ending in the pad id breaks pad-id pooling; lengths-based pooling is unaffected.
    pad = one.tokenizer.pad_token_id
    rows = {
        **batch,
        "response_ids": [torch.cat([r, torch.tensor([pad])]) for r in batch["response_ids"]],
    }
    torch.testing.assert_close(
        one.score(**rows).scores, many.score(**rows).scores, atol=1e-5, rtol=0
    )


def test_a_token_budget_cuts_batches_longest_first_and_keeps_the_scores(tiny_assets, batch):
    budgeted = RewardScorer(
        tiny_assets.reward_model,
        policy_tokenizer_path=tiny_assets.tokenizer,
        batch_size=64,
        max_tokens_per_batch=30,
    )
    # lengths 12, 3, 9, 9, 2: batches (12, 9 | 9, 3, 2) under 30 padded tokens; 64 rows at most
    assert budgeted.batches([12, 3, 9, 9, 2]) == [[0, 2], [3, 1, 4]]
    assert budgeted.batches([40, 5]) == [[0], [1]]  # a row over the budget is a batch alone
    whole = RewardScorer(
        tiny_assets.reward_model, policy_tokenizer_path=tiny_assets.tokenizer, batch_size=64
    )
    assert whole.batches([12, 3, 9, 9, 2]) == [[0, 2, 3, 1, 4]]
    lengths = [
        int(p.numel() + r.numel()) for p, r in zip(batch["prompt_ids"], batch["response_ids"])
    ]
    assert len(budgeted.batches(lengths)) > 1
    torch.testing.assert_close(
        budgeted.score(**batch).scores, whole.score(**batch).scores, atol=1e-5, rtol=0
    )


def test_empty_responses_score_the_prompt_alone(tiny_assets, batch):
    scorer = RewardScorer(tiny_assets.reward_model, policy_tokenizer_path=tiny_assets.tokenizer)
    empty = {**batch, "response_ids": [torch.zeros(0, dtype=torch.long) for _ in CASES]}
    out = scorer.score(**empty)  # every response empty: no crash, no index -1
    assert torch.isfinite(out.scores).all()
    for row, prompt in enumerate(batch["prompt_ids"]):
        assert out.scores[row].item() == pytest.approx(
            _reference_score(scorer.model, prompt), abs=1e-5
        )
    mixed = {
        **batch,
        "response_ids": [torch.zeros(0, dtype=torch.long), *batch["response_ids"][1:]],
    }
    assert scorer.score(**mixed).scores[0].item() == pytest.approx(out.scores[0].item(), abs=1e-5)


def test_other_tokenizer_rescores_with_its_own_template(tiny_assets, batch):
    scorer = RewardScorer(tiny_assets.reward_model_alt, policy_tokenizer_path=tiny_assets.tokenizer)
    assert not scorer.same_tokenizer
    seen: list[torch.Tensor] = []

    def capture(_module, _args, kwargs):
        seen.extend(kwargs["input_ids"])

    handle = scorer.model.base_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        out = scorer.score(**batch)
    finally:
        handle.remove()
    # Hand-written from the reward template: [BOS][Q]question[/Q][A]answer[EOS].
    texts = {f"[BOS][Q]{q}[/Q][A]{a}[EOS]" for q, a in CASES}
    seen_texts = {
        scorer.tokenizer.decode(row[row != scorer.tokenizer.pad_token_id]) for row in seen
    }
    assert seen_texts == texts
    policy_rows = {
        tuple(torch.cat([p, r]).tolist())
        for p, r in zip(batch["prompt_ids"], batch["response_ids"])
    }
    assert not policy_rows & {
        tuple(scorer.render(raw, r).tolist())
        for raw, r in zip(batch["raw_prompt"], batch["response_ids"])
    }
    for row, (raw, response) in enumerate(zip(batch["raw_prompt"], batch["response_ids"])):
        expected = _reference_score(scorer.model, scorer.render(raw, response))
        assert out.scores[row].item() == pytest.approx(expected, abs=1e-5)
    # A plain-string raw prompt is one user message.
    as_text = {**batch, "raw_prompt": [q for q, _ in CASES]}
    torch.testing.assert_close(scorer.score(**as_text).scores, out.scores, atol=1e-6, rtol=0)


def test_truncation_keeps_the_end_and_is_flagged(tiny_assets, batch):
    scorer = RewardScorer(
        tiny_assets.reward_model, policy_tokenizer_path=tiny_assets.tokenizer, max_length=10
    )
    out = scorer.score(**batch)
    for row, (prompt, response) in enumerate(zip(batch["prompt_ids"], batch["response_ids"])):
        full = torch.cat([prompt, response])
        assert out.truncated[row].item() == (full.numel() > 10)
        expected = _reference_score(scorer.model, full[-10:])
        assert out.scores[row].item() == pytest.approx(expected, abs=1e-5)
    assert out.truncated.any() and not out.truncated.all()
    default = RewardScorer(tiny_assets.reward_model, policy_tokenizer_path=tiny_assets.tokenizer)
    assert default.max_length == default.model.config.max_position_embeddings


def test_nonfinite_scores_are_returned_not_raised(tiny_assets, batch):
    scorer = RewardScorer(tiny_assets.reward_model, policy_tokenizer_path=tiny_assets.tokenizer)
    with torch.no_grad():
        scorer.model.score.weight[0, 0] = float("nan")
    out = scorer.score(**batch)
    assert find_nonfinite(out.scores) == list(range(len(CASES)))


def test_sleep_wake_and_input_checks(tiny_assets, batch):
    scorer = RewardScorer(tiny_assets.reward_model, policy_tokenizer_path=tiny_assets.tokenizer)
    before = {k: v.clone() for k, v in scorer.model.state_dict().items()}
    reference = scorer.score(**batch).scores
    scorer.sleep()
    with pytest.raises(EngineAsleepError):
        scorer.score(**batch)
    scorer.wake_up()
    assert all(torch.equal(before[k], v) for k, v in scorer.model.state_dict().items())
    assert torch.equal(scorer.score(**batch).scores, reference)
    with pytest.raises(ValueError, match="one row per sample"):
        scorer.score(**{**batch, "raw_prompt": batch["raw_prompt"][:-1]})


def test_reward_model_must_have_one_label(tiny_assets, tmp_path: Path):
    config = AutoConfig.from_pretrained(tiny_assets.reward_model)
    config.num_labels = 2
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_assets.reward_model).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardScorer(tmp_path, policy_tokenizer_path=tiny_assets.tokenizer)


def test_other_tokenizer_renders_a_multi_turn_conversation_whole(tiny_assets, batch):
    """A multi-turn rollout's stored chat (tool turns included) is what a reward model with its
    own template reads; the policy's ids are scored as they are by one that shares them."""
    scorer = RewardScorer(tiny_assets.reward_model_alt, policy_tokenizer_path=tiny_assets.tokenizer)
    chats = [
        [
            {"role": "user", "content": q},
            {"role": "assistant", "content": "call", "eos_text": "<eos>"},
            {"role": "tool", "name": "add", "content": a},
            {"role": "assistant", "content": a},
        ]
        for q, a in CASES
    ]
    out = scorer.score(**batch, conversations=chats)
    for row, chat in enumerate(chats):
        plain = [{k: m[k] for k in ("role", "content", "name") if k in m} for m in chat]
        ids = scorer.tokenizer.apply_chat_template(plain, tokenize=True, return_dict=False)
        assert scorer.render_conversation(chat).tolist() == list(ids)
        expected = _reference_score(scorer.model, torch.tensor(ids))
        assert out.scores[row].item() == pytest.approx(expected, abs=1e-5)
    same = RewardScorer(tiny_assets.reward_model, policy_tokenizer_path=tiny_assets.tokenizer)
    assert same.same_tokenizer
    torch.testing.assert_close(
        same.score(**batch, conversations=chats).scores, same.score(**batch).scores
    )
