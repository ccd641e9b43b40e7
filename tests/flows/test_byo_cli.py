"""Bring your own model, data and reward: ``ppoflow train`` end to end on a user's assets.

The assets (tests/byo_assets.py) are shaped like real ones: a Qwen2 policy with a byte-level BPE
and a ChatML template, a Llama-3-style reward model with another tokenizer and no pad token,
verl-layout Parquet with struct columns, JSONL with plain-string prompts under other keys, and
verl-signature reward-function files. Successful runs go through ``flows.cli.main`` in-process
(real Prefect harness, the session's local Ray); the cases that must fail before any resource
is taken run ``python -m flows.cli`` in a subprocess.
"""

from __future__ import annotations

import math
import re

import pyarrow as pa
import pyarrow.parquet as pq
from byo_assets import RAISING_SOURCE, SOURCES, reward_functions, yaml_list

pytest_plugins = ("conftest_byo",)  # its fixtures: byo, byo_base, byo_train, byo_cli

FN_MEAN = "reward/fn/compute_score/mean"
RM_MEAN = "reward/rm/mean"


def _train_rows(rows: list[dict]) -> list[dict]:
    """The rows of training steps (a validation may log rows of its own)."""
    return [r for r in rows if "actor/pg_loss" in r]


def _assert_validation_at_start_and_end(rows: list[dict], *, val_n: int) -> None:
    """``val-core/<data source>/reward/mean@<val_n>`` of every source, finite, logged at step 0
    (before the first update) and at the last step."""
    last_step = max(r["step"] for r in rows)
    for source in SOURCES:
        key = f"val-core/{source}/reward/mean@{val_n}"
        logged = [r for r in rows if key in r]
        assert logged, (key, sorted({k for r in rows for k in r if k.startswith("val")}))
        assert logged[0]["step"] == 0 and logged[-1]["step"] == last_step, key
        assert all(math.isfinite(r[key]) for r in logged), key


def _finite_in_every_row(rows: list[dict], *keys: str) -> None:
    for key in keys:
        values = [r.get(key) for r in rows]
        assert all(v is not None and math.isfinite(v) for v in values), (key, values)


# ---------------------------------------------------------------------- the assets themselves
def test_byo_assets_load_back_like_a_users(byo) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    tok = AutoTokenizer.from_pretrained(byo.policy)
    policy = AutoModelForCausalLM.from_pretrained(byo.policy)
    assert type(policy).__name__ == "Qwen2ForCausalLM"
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids) == text
    out = policy.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)  # (1, P + 4)
    assert out.shape[1] <= len(ids) + 4

    rm_tok = AutoTokenizer.from_pretrained(byo.reward_model)
    rm = AutoModelForSequenceClassification.from_pretrained(byo.reward_model)
    assert type(rm).__name__ == "LlamaForSequenceClassification" and rm.config.num_labels == 1
    assert rm_tok.pad_token is None and rm.config.pad_token_id is None
    rendered = rm_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    # Another vocabulary: the same text has other ids.
    assert tok.encode("What is 3+4?") != rm_tok.encode("What is 3+4?", add_special_tokens=False)

    schema = pq.read_schema(byo.train_parquet)
    assert pa.types.is_list(schema.field("prompt").type)
    assert pa.types.is_struct(schema.field("reward_model").type)
    assert pa.types.is_struct(schema.field("extra_info").type)
    assert set(pq.read_table(byo.train_parquet)["data_source"].to_pylist()) == set(SOURCES)


# ---------------------------------------------------------------------- runs that complete
def test_rm_free_grpo_with_a_reward_function_and_validation(byo_train, byo) -> None:
    rows = byo_train(
        reward_functions(byo.score_fn),
        f"data.val_files={yaml_list(byo.val_parquet)}",
        "trainer.eval_every=1",
    )
    train_rows = _train_rows(rows)
    assert [r["step"] for r in train_rows] == [0, 1]
    _finite_in_every_row(train_rows, FN_MEAN, "reward_extra/acc/mean", "reward_extra/len/mean")
    assert all(r["reward_extra/known_source/mean"] == 1.0 for r in train_rows)
    assert all(RM_MEAN not in r for r in rows)
    _assert_validation_at_start_and_end(rows, val_n=1)


def test_reward_model_with_another_tokenizer_mixed_with_a_function_and_a_critic(
    byo_train, byo
) -> None:
    rows = byo_train(
        f"models.reward_model={byo.reward_model}",
        "reward.model_weight=0.5",
        reward_functions(byo.score_fn),
        "algorithm.estimator=gae",
    )
    train_rows = _train_rows(rows)
    assert len(train_rows) == 2
    _finite_in_every_row(train_rows, RM_MEAN, FN_MEAN, "critic/vf_loss")


def test_jsonl_with_plain_string_prompts_and_mapped_keys_validated_at_mean_2(
    byo_train, byo
) -> None:
    """Prompts from a JSONL under other keys (the same file validates, two samples per prompt,
    with an interval longer than the run: validation still runs before the first step and at
    the end)."""
    rows = byo_train(
        f"data.train_files={yaml_list(byo.train_jsonl)}",
        "data.prompt_key=question",
        "data.ground_truth_key=answer",
        "data.data_source_key=source",
        reward_functions(byo.score_fn),
        f"data.val_files={yaml_list(byo.train_jsonl)}",
        "trainer.eval_every=10",
        "rollout.val_n=2",
    )
    train_rows = _train_rows(rows)
    assert len(train_rows) == 2
    _finite_in_every_row(train_rows, FN_MEAN)
    # The function saw the `source` column as data_source.
    assert all(r["reward_extra/known_source/mean"] == 1.0 for r in train_rows)
    _assert_validation_at_start_and_end(rows, val_n=2)


# ---------------------------------------------------------------------- runs that fail
def test_a_raising_reward_function_fails_the_run_naming_it(
    prefect_harness, ray_local, byo_base, byo, capfd
) -> None:
    from flows.cli import main

    args = [*byo_base, reward_functions(byo.bad_fn), "data.shuffle=false"]  # rows 0-3: both sources
    try:
        rc, text = main(["train", "--config", "tiny", *args]), ""
    except Exception as exc:  # the flow's exception, raised through the CLI
        rc, text = None, f"{type(exc).__name__}: {exc}\n"
    assert rc != 0, "the run completed with a reward function that raises"
    captured = capfd.readouterr()
    if rc is not None:  # the CLI's own error lines
        text = "\n".join(line for line in captured.err.splitlines() if line.startswith("ppoflow:"))
    assert f"{byo.bad_fn.name}:compute_score" in text, captured.err[-3000:]
    assert RAISING_SOURCE in text, text
    assert re.search(r"\btrain-\d+(@\d+)?/\d+\b", text), text  # a sample key


def _one_line_exit_2(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert len(lines) == 1, result.stderr[-3000:]
    assert not result.ray_sessions, result.ray_sessions
    assert not result.prefect_databases, result.prefect_databases
    assert not re.search(r"\bray\b", lines[0], re.IGNORECASE), lines[0]
    return lines[0]


def test_a_prompt_over_max_prompt_length_exits_2_before_any_resource(byo_cli, byo_base, byo):
    result = byo_cli(
        "--config",
        "tiny",
        *byo_base,
        reward_functions(byo.score_fn),
        "data.max_prompt_length=4",
    )
    line = _one_line_exit_2(result)
    assert str(byo.train_parquet) in line and re.search(r"\brow \d+", line), line
    assert "data.max_prompt_length" in line, line


def test_a_policy_without_any_reward_exits_2_naming_both_settings(byo_cli, byo) -> None:
    line = _one_line_exit_2(byo_cli("--config", "tiny", f"models.policy={byo.policy}"))
    assert "models.reward_model" in line and "reward.functions" in line, line


def test_an_unknown_config_file_exits_2(byo_cli) -> None:
    line = _one_line_exit_2(byo_cli("--config", "nope.yaml"))
    assert "nope.yaml" in line, line


def test_a_missing_policy_folder_exits_2_naming_models_policy(byo_cli, byo_base, byo) -> None:
    overrides = [o for o in byo_base if not o.startswith("models.policy=")]
    result = byo_cli(
        "--config",
        "tiny",
        *overrides,
        "models.policy=/does/not/exist",
        reward_functions(byo.score_fn),
    )
    line = _one_line_exit_2(result)
    assert "models.policy" in line and "/does/not/exist" in line, line
