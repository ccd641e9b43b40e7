"""A Llama-3-style policy: its tokenizer has no pad token and a turn ends with another token
than the tokenizer's EOS. The worker pads with EOS and stops at every end token."""

from __future__ import annotations

from pathlib import Path

import torch
from byo_assets import build_reward_tokenizer  # a Llama-3-style tokenizer without a pad token
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from infra.config import OptimConfig, RolloutConfig
from infra.transport import Jagged
from infra.workers import PPOWorker, WorkerSpec, pad_token_id, stop_token_ids


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
    worker = PPOWorker(
        WorkerSpec(
            roles=("rollout", "actor"),
            policy_path=path,
            tokenizer_path=path,
            rollout=RolloutConfig(max_new_tokens=6, n=2),
            actor_optim=OptimConfig(lr=1e-3, mini_batch_size=4, micro_batch_size=2),
        )
    )
    tok = worker.tokenizer
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    # 1. Pad with EOS, stop at the tokenizer's EOS and the generation config's <|eot_id|>.
    assert worker.pad_id == tok.eos_token_id
    assert stop_token_ids(tok, path) == (tok.eos_token_id, eot)
    assert pad_token_id(tok) == tok.eos_token_id
    msgs = [[{"role": "user", "content": "2+2="}], [{"role": "user", "content": "hello there"}]]
    prompts = Jagged.from_rows(
        [
            torch.tensor(tok.apply_chat_template(m, add_generation_prompt=True, return_dict=False))
            for m in msgs
        ]
    )
    responses, logprobs, _ = worker.generate(prompts, n=2, seed=0)
    for row in responses.rows():
        ends = [i for i, t in enumerate(row.tolist()) if t in (tok.eos_token_id, eot)]
        assert ends in ([], [len(row) - 1])  # nothing after an end token
    # 2. One update on the rows (padded with EOS inside the batch) changes the policy.
    rep = Jagged.from_rows([r for r in prompts.rows() for _ in range(2)])
    before = worker.parameters_digest()
    advantages = Jagged.from_rows([torch.full((len(r),), 1.0) for r in responses.rows()])
    metrics = worker.update(rep, responses, {"advantages": advantages})
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    assert worker.parameters_digest() != before
