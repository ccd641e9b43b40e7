"""A tiny LLM judge built locally in seconds (nothing downloaded), whose greedy verdict is known.

``build_tiny_judge(out, verdict="yes")`` saves a ``LlamaForCausalLM`` with its own byte-level BPE
tokenizer and chat template (``<|user|>…<|verdict|>``) under ``out``. Its weights are set so that
greedy decoding answers ``verdict`` then EOS, whatever the prompt:

- every layer's attention output and MLP down projection are zero, so the residual stream at a
  position is the embedding of the token there, and the last hidden state is that embedding
  normalised;
- the output head is the embedding matrix with rows permuted along the cycle
  ``<|verdict|> → verdict tokens → <|end|> → <|verdict|>``: the head row of the next token in the
  cycle is the current token's embedding, and a random 64-dimensional embedding is closer to
  itself than to any other row, so each step emits the next token of the cycle.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

JUDGE_TEMPLATE = (
    "{% for message in messages %}<|user|>{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|verdict|>{% endif %}"
)
SPECIALS = ("<|pad|>", "<|end|>", "<|user|>", "<|verdict|>")
# The judge's user message over the built-in addition task (a file, as a user would keep it).
PROMPT_TEMPLATE = (
    "Question: {{ question }}\n"
    "Answer: {{ response }}\n"
    "Expected: {{ ground_truth }} ({{ data_source }})\n"
    "Is the answer right? Reply yes or no.\n"
)


def _tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["yes", "no", "maybe", "Question: Answer: Expected: Is the answer right?"] * 20
    core.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|user|>", "<|verdict|>"],
        model_max_length=1024,
    )
    tok.chat_template = JUDGE_TEMPLATE
    return tok


def build_tiny_judge(out: Path, *, verdict: str = "yes", seed: int = 0) -> Path:
    """Save the judge (see the module docstring) under ``out``; returns ``out``."""
    tok = _tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    cycle = [
        tok.convert_tokens_to_ids("<|verdict|>"),
        *tok.encode(verdict, add_special_tokens=False),
        tok.eos_token_id,
    ]
    if len(set(cycle)) != len(cycle):
        raise ValueError(f"verdict {verdict!r} repeats a token: {cycle}")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        head = embeddings.clone()
        for current, following in zip(cycle, cycle[1:] + cycle[:1]):
            head[following] = embeddings[current]
        model.lm_head.weight.copy_(head)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
