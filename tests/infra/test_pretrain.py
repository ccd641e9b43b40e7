"""Warm start and reward-model training with tiny budgets: direction and plumbing, not quality."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaForCausalLM

from infra.assets import AssetPaths
from infra.config import WarmstartConfig
from infra.data import PromptRow, read_prompt_rows
from infra.pretrain import (
    RewardModelReport,
    RewardModelSettings,
    SFTReport,
    SFTSettings,
    answer_ids,
    careless_answer,
    evaluate_rule_accuracy,
    malformed_answer,
    near_miss_answer,
    pad_right,
    render_prompt_ids,
    response_nll,
    sample_responses,
    sft_warmstart,
    train_reward_model,
    wrong_answer,
)
from infra.reward_model import last_token_scores

# The main job's recipe with small budgets.
SFT = SFTSettings.from_config(WarmstartConfig())
SFT_SMALL = replace(SFT, steps=60, max_seconds=None, batch_size=32, lr=3e-3, eval_rows=100)
RM_SMALL = replace(
    RewardModelSettings.from_config(WarmstartConfig()),
    steps=80,
    max_seconds=None,
    pairs_per_step=32,
    lr=2e-3,
    samples_per_prompt=1,
)


@pytest.fixture(scope="module")
def sft_run(
    tiny_assets: AssetPaths, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, SFTReport]:
    out = tmp_path_factory.mktemp("sft")
    report = sft_warmstart(
        policy_path=tiny_assets.policy,
        tokenizer_path=tiny_assets.tokenizer,
        train_path=tiny_assets.train_data,
        heldout_path=tiny_assets.heldout_data,
        out_path=out,
        settings=SFT_SMALL,
        seed=0,
    )
    return out, report


@pytest.fixture(scope="module")
def rm_run(
    tiny_assets: AssetPaths,
    sft_run: tuple[Path, SFTReport],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, RewardModelReport]:
    out = tmp_path_factory.mktemp("rm")
    report = train_reward_model(
        init_path=sft_run[0],
        tokenizer_path=tiny_assets.tokenizer,
        train_path=tiny_assets.train_data,
        heldout_path=tiny_assets.heldout_data,
        out_path=out,
        settings=RM_SMALL,
        seed=0,
    )
    return out, report


@pytest.fixture(scope="module")
def heldout_rows(tiny_assets: AssetPaths) -> list[PromptRow]:
    return read_prompt_rows(tiny_assets.heldout_data)


def _naive_greedy(model: LlamaForCausalLM, prompt: list[int], eos: int, steps: int) -> list[int]:
    """Reference decoder: one unpadded sequence, the whole prefix recomputed every token."""
    ids = list(prompt)
    for _ in range(steps):
        token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        if token == eos:
            break
    return ids[len(prompt) :]


def _rows(texts: list[str]) -> list[PromptRow]:
    return [
        PromptRow(uid=f"r{i}", raw_prompt=[{"role": "user", "content": t}], ground_truth="0")
        for i, t in enumerate(texts)
    ]


@torch.no_grad()
def test_greedy_responses_through_the_engine_match_naive_decoding(tiny_assets: AssetPaths) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.tokenizer)
    model = LlamaForCausalLM.from_pretrained(tiny_assets.policy).eval()
    rows = _rows(["12+34=", "9+9=", "99+10=", "5="])  # ragged lengths exercise left padding
    eos = tokenizer.eos_token_id
    batched = sample_responses(
        model, tokenizer, rows, n=1, greedy=True, max_new_tokens=6, seed=0, batch_size=3
    )
    prompts = [render_prompt_ids(tokenizer, row.raw_prompt) for row in rows]
    assert batched == [_naive_greedy(model, p, eos, 6) for p in prompts]
    assert all(len(r) <= 6 and eos not in r[:-1] for r in batched)


def test_sampling_is_seeded_and_prompt_major(tiny_assets: AssetPaths) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.tokenizer)
    model = LlamaForCausalLM.from_pretrained(tiny_assets.policy).eval()
    rows = _rows(["12+34=", "5="])

    def sample(seed: int) -> list[list[int]]:
        return sample_responses(
            model, tokenizer, rows, n=8, greedy=False, max_new_tokens=6, seed=seed, batch_size=2
        )

    first = sample(0)
    assert len(first) == 16 and first == sample(0) and first != sample(1)
    greedy = sample_responses(
        model, tokenizer, rows, n=3, greedy=True, max_new_tokens=6, seed=0, batch_size=2
    )
    assert greedy[:3] == [greedy[0]] * 3 and greedy[3:] == [greedy[3]] * 3  # row i: i*n ..


@torch.no_grad()
def test_score_is_read_at_the_last_real_token_whatever_the_padding(tiny_assets: AssetPaths) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_assets.reward_model).eval()
    prompt = render_prompt_ids(tokenizer, [{"role": "user", "content": "12+34="}])
    seqs = [[*prompt, *answer_ids(tokenizer, a)] for a in ("46", "4", "146")]
    ids, lengths = pad_right(seqs, tokenizer.pad_token_id)  # (3, L)
    batched = last_token_scores(model, ids, lengths)  # (3,)
    alone = torch.cat(
        [last_token_scores(model, torch.tensor([s]), torch.tensor([len(s)])) for s in seqs]
    )
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    # A pad id equal to a real token must not matter: positions come from lengths.
    ids_eos_pad, _ = pad_right(seqs, tokenizer.eos_token_id)
    torch.testing.assert_close(
        last_token_scores(model, ids_eos_pad, lengths), batched, rtol=1e-5, atol=1e-5
    )


@torch.no_grad()
def test_response_nll_counts_only_response_tokens(tiny_assets: AssetPaths) -> None:
    model = LlamaForCausalLM.from_pretrained(tiny_assets.policy).eval()
    prompt, response = [1, 4, 7, 8, 5], [9, 10, 2]
    logprobs = torch.log_softmax(
        model(input_ids=torch.tensor([[*prompt, *response]])).logits[0], -1
    )
    # Token at position j is predicted by the logits at j-1; the response starts at position 5.
    expected = -torch.stack([logprobs[4 + k, t] for k, t in enumerate(response)]).mean()
    torch.testing.assert_close(response_nll(model, [prompt], [response], 0), expected)
    # Padding a second, shorter example in the same batch changes nothing for a batch of equals.
    both = response_nll(model, [prompt, prompt], [response, response], 0)
    torch.testing.assert_close(both, expected)


def test_wrong_and_malformed_answers_never_match_the_truth(heldout_rows: list[PromptRow]) -> None:
    rng = random.Random(0)
    for row in heldout_rows[:200]:
        for _ in range(5):
            assert wrong_answer(row, rng) != row.ground_truth
            assert near_miss_answer(row, rng) != row.ground_truth
            text, eos = malformed_answer(row, rng)
            assert (text, eos) != (row.ground_truth, True)


def test_careless_annotator_mix(heldout_rows: list[PromptRow]) -> None:
    rng = random.Random(0)
    answers = [(row, careless_answer(row, rng, correct_fraction=0.25)) for row in heldout_rows * 8]
    correct = sum(a == row.ground_truth for row, a in answers) / len(answers)
    plus_one = sum(a == str(int(row.ground_truth) + 1) for row, a in answers) / len(answers)
    # 4000 draws: the standard error of a 0.25 share is ~0.007.
    assert abs(correct - 0.25) < 0.03
    assert plus_one > correct  # "mostly sum+1" among the mistakes: 0.75 * 0.55 ≈ 0.41


def test_sft_lowers_the_loss_and_saves_a_loadable_policy(
    sft_run: tuple[Path, SFTReport], heldout_rows: list[PromptRow]
) -> None:
    out, report = sft_run
    assert report.steps == SFT_SMALL.steps
    assert report.last_loss < report.first_loss
    assert 0.0 <= report.heldout_accuracy <= 1.0 and 0.0 <= report.heldout_sampled_accuracy <= 1.0
    model = LlamaForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    again = evaluate_rule_accuracy(
        model=model,
        tokenizer=tokenizer,
        rows=heldout_rows[:100],
        greedy=True,
        max_new_tokens=6,
        seed=0,
    )
    assert again == report.heldout_accuracy  # greedy: the saved policy reproduces the report


def test_reward_model_beats_chance_on_heldout_pairs(rm_run: tuple[Path, RewardModelReport]) -> None:
    out, report = rm_run
    assert report.steps == RM_SMALL.steps
    assert report.heldout_pairs == 2 * 500
    assert report.heldout_pair_accuracy > 0.6
    assert set(report.pair_accuracy_by_kind) <= {"sampled", "synthetic", "malformed"}
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1
    assert model.config.pad_token_id == AutoTokenizer.from_pretrained(out).pad_token_id


def test_seconds_cap_stops_training(tiny_assets: AssetPaths, tmp_path: Path) -> None:
    report = sft_warmstart(
        policy_path=tiny_assets.policy,
        tokenizer_path=tiny_assets.tokenizer,
        train_path=tiny_assets.train_data,
        heldout_path=tiny_assets.heldout_data,
        out_path=tmp_path,
        settings=replace(SFT, steps=10_000, max_seconds=0.0, eval_rows=10),
        seed=0,
    )
    assert report.steps == 0  # a zero-second budget trains nothing but still evaluates and saves
    assert LlamaForCausalLM.from_pretrained(tmp_path) is not None
