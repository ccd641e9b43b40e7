"""Tiny assets: character tokenizers, chat templates, models loaded back with from_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
)

from infra.assets import AssetPaths, TinyModelSpec, build_char_tokenizer, build_tiny_assets

PROMPT = [{"role": "user", "content": "12+34="}]


@pytest.mark.parametrize("variant", ["policy", "reward"])
def test_tokenizer_round_trip_one_token_per_character(tmp_path: Path, variant: str) -> None:
    build_char_tokenizer(tmp_path, variant=variant)  # type: ignore[arg-type]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "12+34=46 -7?"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id not in ids
    assert tokenizer("x", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3


def test_policy_chat_template_prompt_and_assistant_turn(tiny_assets: AssetPaths) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.tokenizer)
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert prompt == "<bos><|user|>12+34=<|assistant|>"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # bos + user marker + 6 characters + assistant marker: every marker is a single token.
    assert len(ids) == 9
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+34="
    full = tokenizer.apply_chat_template(
        [*PROMPT, {"role": "assistant", "content": "46"}], tokenize=False
    )
    assert full == prompt + "46<eos>"
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert full_ids[:9] == ids and full_ids[-1] == tokenizer.eos_token_id


def test_reward_tokenizer_differs_from_policy_tokenizer(tiny_assets: AssetPaths) -> None:
    policy = AutoTokenizer.from_pretrained(tiny_assets.tokenizer)
    reward = AutoTokenizer.from_pretrained(tiny_assets.reward_model_alt)
    assert policy.get_vocab() != reward.get_vocab()
    assert policy("12+34=")["input_ids"] != reward("12+34=")["input_ids"]
    assert policy.chat_template != reward.chat_template
    rendered = reward.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert rendered == "[BOS][Q]12+34=[/Q][A]"
    ids = reward(rendered, add_special_tokens=False)["input_ids"]
    assert reward.unk_token_id not in ids and len(ids) == 10
    assert reward.decode(ids, skip_special_tokens=True) == "12+34="


def test_models_load_back_with_from_pretrained(tiny_assets: AssetPaths) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.policy)
    ids = tokenizer("12+34=46", add_special_tokens=False, return_tensors="pt")[
        "input_ids"
    ]  # (1, 8)

    policy = AutoModelForCausalLM.from_pretrained(tiny_assets.policy)
    assert isinstance(policy, LlamaForCausalLM)
    spec = json.loads(tiny_assets.manifest.read_text())["policy"]
    assert policy.config.hidden_size == spec["hidden_size"]
    assert policy(input_ids=ids).logits.shape == (1, 8, len(tokenizer))
    assert policy.generation_config.eos_token_id == tokenizer.eos_token_id

    critic = AutoModelForTokenClassification.from_pretrained(tiny_assets.critic)
    assert isinstance(critic, LlamaForTokenClassification)
    assert critic(input_ids=ids).logits.shape == (1, 8, 1)

    for folder in (tiny_assets.reward_model, tiny_assets.reward_model_alt):
        rm_tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForSequenceClassification.from_pretrained(folder)
        assert isinstance(model, LlamaForSequenceClassification)
        assert model.config.num_labels == 1
        assert model.config.pad_token_id == rm_tokenizer.pad_token_id
        assert model.config.vocab_size == len(rm_tokenizer)
    assert (
        AutoTokenizer.from_pretrained(tiny_assets.reward_model).get_vocab() == tokenizer.get_vocab()
    )


def test_build_is_idempotent_and_rebuilds_on_change(tmp_path: Path) -> None:
    spec = TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    paths = build_tiny_assets(tmp_path, seed=3, policy=spec, reward=spec)
    weights = paths.policy / "model.safetensors"
    first = weights.stat().st_mtime_ns
    assert build_tiny_assets(tmp_path, seed=3, policy=spec, reward=spec) == paths
    assert weights.stat().st_mtime_ns == first  # untouched
    assert json.loads(paths.manifest.read_text())["seed"] == 3

    bigger = TinyModelSpec(hidden_size=24, num_layers=1, num_heads=2, intermediate_size=32)
    build_tiny_assets(tmp_path, seed=3, policy=bigger, reward=spec)
    assert AutoModelForCausalLM.from_pretrained(paths.policy).config.hidden_size == 24

    paths.manifest.unlink()  # an interrupted build leaves no manifest: the next call rebuilds
    build_tiny_assets(tmp_path, seed=3, policy=spec, reward=spec)
    assert paths.manifest.is_file()
    assert AutoModelForCausalLM.from_pretrained(paths.policy).config.hidden_size == 16


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    spec = TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    a = build_tiny_assets(tmp_path / "a", seed=0, policy=spec, reward=spec)
    b = build_tiny_assets(tmp_path / "b", seed=0, policy=spec, reward=spec)
    c = build_tiny_assets(tmp_path / "c", seed=1, policy=spec, reward=spec, force=True)
    weights = [
        AutoModelForCausalLM.from_pretrained(p.policy).model.embed_tokens.weight for p in (a, b, c)
    ]
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])
    assert (a.train_data.read_bytes() == b.train_data.read_bytes()) and a.heldout_data.is_file()


def test_each_seed_builds_its_own_folder(tmp_path: Path) -> None:
    from flows.reward_model import build_assets
    from infra.config import load_config

    def assets_of(seed: int, *extra: str) -> dict[str, str]:
        cfg = load_config(None, [f"models.assets_dir={tmp_path}", f"seed={seed}", *extra])
        return build_assets.fn(cfg)

    zero, one = assets_of(0), assets_of(1)
    assert Path(zero["policy"]).parent == tmp_path / "seed-0"
    assert Path(one["policy"]).parent == tmp_path / "seed-1"
    # Building seed 1 left seed 0's assets as they were: a run of seed 0 still reads its own.
    assert json.loads((tmp_path / "seed-0" / "manifest.json").read_text())["seed"] == 0
    agent = assets_of(2, "data.builtin_task=agent")
    assert Path(agent["policy"]).parent == tmp_path / "agent" / "seed-2"


def test_a_second_builder_of_the_same_folder_waits_for_the_first(tmp_path: Path) -> None:
    import threading

    from infra.assets import _build_tiny_assets, build_lock

    spec = TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    root = tmp_path / "seed-0"
    events: list[str] = []
    built: list[AssetPaths] = []

    def second_builder() -> None:
        built.append(build_tiny_assets(root, seed=0, policy=spec, reward=spec))
        events.append("second returned")

    second = threading.Thread(target=second_builder)
    with build_lock(root):  # the first builder: starts the second, then builds
        second.start()
        first = _build_tiny_assets(root, seed=0, policy=spec, reward=spec, force=True)
        weights = (first.policy / "model.safetensors").stat().st_mtime_ns
        events.append("first released")
    second.join(timeout=120)
    # The second returned only after the first let go, and found the folder built: it read the
    # first's assets and rebuilt nothing.
    assert events == ["first released", "second returned"]
    assert built == [first]
    assert (first.policy / "model.safetensors").stat().st_mtime_ns == weights
