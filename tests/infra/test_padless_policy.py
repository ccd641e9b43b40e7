"""A Llama-3-style policy: its tokenizer has no pad token and a turn ends with another token
than the tokenizer's EOS. The worker pads with EOS and stops at every end token."""

from __future__ import annotations

from pathlib import Path

import torch
from byo_assets import build_reward_tokenizer  # a Llama-3-style tokenizer without a pad token
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from infra.config import load_config
from infra.engines import pad_token_id, stop_token_ids
from infra.workers import ModelWorker, WorkerSpec
from storage import BatchMeta, open_store
from tasks.generate.stage import generate_rows, sample_meta
from tasks.io import nested, rows
from tasks.update.stage import actor_settings, update_rows


def _llama3_policy(out: Path) -> Path:
    tok = build_reward_tokenizer()
    assert tok.pad_token is None
    # As Llama 3: the tokenizer's EOS ends the text, a chat turn ends with <|eot_id|>.
    tok.add_special_tokens({"eos_token": "<|end_of_text|>"})
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id, eot])
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_a_padless_policy_generates_scores_and_updates(tmp_path: Path) -> None:
    path = str(_llama3_policy(tmp_path / "llama3"))
    cfg = load_config(
        None,
        ["rollout.max_new_tokens=6", "rollout.n=2", "actor.lr=1e-3", "actor.mini_batch_size=4",
         "actor.micro_batch_size=2"],
    )  # fmt: skip
    store = open_store("memory://padless")
    worker = ModelWorker(
        WorkerSpec(
            roles=("rollout", "actor"),
            cfg=cfg,
            policy_path=path,
            tokenizer_path=path,
            store_url="memory://padless",
        )
    )
    tok = worker.tokenizer
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    # 1. Pad with EOS, stop at the tokenizer's EOS and the generation config's <|eot_id|>.
    assert worker.pad_id == tok.eos_token_id
    assert stop_token_ids(tok, path) == (tok.eos_token_id, eot)
    assert pad_token_id(tok) == tok.eos_token_id
    msgs = [[{"role": "user", "content": "2+2="}], [{"role": "user", "content": "hello there"}]]
    ids = [
        torch.tensor(tok.apply_chat_template(m, add_generation_prompt=True, return_dict=False))
        for m in msgs
    ]
    prompts = BatchMeta("padless/1", ("a/0", "b/0"))
    samples = sample_meta(prompts, 2)
    store.kv_batch_put(
        list(samples.keys), "padless/1", {"prompt_ids": nested([p for p in ids for _ in range(2)])}
    )
    worker.run(generate_rows, prompts, n=2, seed=0, first_group=0)
    responses = rows(
        store.kv_batch_get(list(samples.keys), "padless/1", ["response_ids"])["response_ids"]
    )
    for row in responses:
        ends = [i for i, t in enumerate(row.tolist()) if t in (tok.eos_token_id, eot)]
        assert ends in ([], [len(row) - 1])  # nothing after an end token
    # 2. One update on the rows (padded with EOS inside the batch) changes the policy.
    store.kv_batch_put(
        list(samples.keys),
        "padless/1",
        {"advantages": nested([torch.full((len(r),), 1.0) for r in responses])},
    )
    before = worker.parameters_digest()
    metrics = worker.run(
        update_rows,
        samples,
        step=0,
        reads=("prompt_ids", "response_ids", "advantages"),
        actor=actor_settings(cfg, 1),
        critic=None,
    )
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    assert worker.parameters_digest() != before
    store.close()
