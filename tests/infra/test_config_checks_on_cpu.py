"""Checks that belong to the config run when it is validated, before any resource or warm start:
the store the workers can reach, and token budgets against the longest prompt the run can see."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.config import BUILTIN_PROMPT_TOKENS, ConfigError, TrainConfig, load_config

ROLES = ("actor", "critic", "logprobs", "ref")


def one_line_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("url", ["memory://", "memory://run?timeout=5"])
def test_an_in_process_store_is_refused_naming_the_setting_and_the_fix(url: str) -> None:
    message = one_line_error([f"store.url={url}"])
    assert f"store.url={url!r}" in message and "ray://NAME?shards=N" in message


def test_a_ray_store_is_accepted() -> None:
    assert load_config(None, ["store.url=ray://mine?shards=2"]).store.url == "ray://mine?shards=2"


def test_the_builtin_prompts_are_builtin_prompt_tokens_long(tmp_path: Path) -> None:
    from infra.assets import build_char_tokenizer
    from infra.data import OPERAND_RANGE, addition_prompt, chat_prompt_ids

    tokenizer = build_char_tokenizer(tmp_path)  # the policy tokenizer of build_tiny_assets
    lengths = {
        len(chat_prompt_ids(tokenizer, [{"role": "user", "content": addition_prompt(a, b)}]))
        for a in OPERAND_RANGE
        for b in OPERAND_RANGE
    }
    assert lengths == {BUILTIN_PROMPT_TOKENS}


@pytest.mark.parametrize("role", ROLES)
def test_a_budget_on_the_builtin_task_is_judged_by_its_own_prompts(role: str) -> None:
    longest = BUILTIN_PROMPT_TOKENS + TrainConfig().rollout.max_new_tokens
    assert TrainConfig().longest_prompt == BUILTIN_PROMPT_TOKENS
    for budget in (64, longest):
        cfg = load_config(None, [f"{role}.max_tokens_per_micro_batch={budget}"])
        assert getattr(cfg, role).max_tokens_per_micro_batch == budget
    message = one_line_error([f"{role}.max_tokens_per_micro_batch={longest - 1}"])
    assert f"{role}.max_tokens_per_micro_batch={longest - 1}" in message
    assert f"at least {longest}" in message and "rollout.max_new_tokens" in message


@pytest.mark.parametrize(
    "users",
    [
        ["data.train_files=[prompts.parquet]", "reward.rule_weight=1"],
        ["models.policy=my-policy", "reward.rule_weight=1"],  # the built-in prompts, its template
        ["models.tokenizer=my-tokenizer"],
    ],
)
def test_a_budget_with_a_users_data_or_tokenizer_is_judged_by_max_prompt_length(
    users: list[str],
) -> None:
    assert load_config(None, users).longest_prompt == 1024
    message = one_line_error([*users, "actor.max_tokens_per_micro_batch=64"])
    assert "actor.max_tokens_per_micro_batch=64" in message and "at least 1032" in message
    assert "data.max_prompt_length" in message
    cfg = load_config(None, [*users, "data.max_prompt_length=32"])
    assert cfg.longest_prompt == 32
    load_config(None, [*users, "data.max_prompt_length=32", "actor.max_tokens_per_micro_batch=40"])
