"""Tiny LLM judges built locally in seconds (nothing downloaded), whose greedy verdicts are known.

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

``build_marker_judge(out)`` saves a judge whose verdict depends on what it reads: "yes" then
EOS when its prompt ends with the special token ``<|agree|>`` (``AGREE``), "no" then EOS when
it ends with any other token. Its chat template (``<|user|>…``) adds no generation prompt, so
the prompt ends with the user message's last token, and the weights are set so:

- attention outputs and MLP down projections are zero as above, so the last hidden state is
  the normalised embedding of the prompt's last token;
- three orthonormal directions ``a``, ``b``, ``z`` (seeded): every token's embedding is ``a``
  plus small noise, except ``<|agree|>`` (``b`` plus noise) and "yes", "no" and EOS (``z`` plus
  noise);
- the output head is zero except three rows: ``head[no] = a``, ``head[yes] = b``,
  ``head[eos] = z``. After an ordinary token the largest logit is "no" (about ``|h|``; the
  other two come from the noise, about 0.05 of that), after ``<|agree|>`` it is "yes", and after
  "yes" or "no" it is EOS.

``AGREE_TEMPLATE`` is a prompt template (``reward.judge.template``) for this judge over the
built-in addition task: it ends with ``<|agree|>`` exactly when ``agrees(response,
ground_truth)`` holds, so each sample's verdict is known from that sample alone.
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
# The marker judge's chat template: the user message and nothing after it, generation prompt or not.
MARKER_TEMPLATE = "{% for message in messages %}<|user|>{{ message['content'] }}{% endfor %}"
AGREE = "<|agree|>"
# The judge's user message over the built-in addition task (a file, as a user would keep it).
PROMPT_TEMPLATE = (
    "Question: {{ question }}\n"
    "Answer: {{ response }}\n"
    "Expected: {{ ground_truth }} ({{ data_source }})\n"
    "Is the answer right? Reply yes or no.\n"
)
# The marker judge's user message: PROMPT_TEMPLATE, then AGREE exactly when ``agrees`` holds.
AGREE_TEMPLATE = PROMPT_TEMPLATE + (
    "{{ '" + AGREE + "' if (ground_truth|string)|select('in', response)|list else 'differ' }}"
)


def agrees(response: str, ground_truth: object) -> bool:
    """What AGREE_TEMPLATE computes: some character of the ground truth (a digit of the sum)
    occurs in the response. Loose on purpose: the tiny runs' untrained policy writes a few
    random characters, and this holds for about a third of them, so both verdicts occur."""
    return any(c in response for c in str(ground_truth))


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


def _config(tok: PreTrainedTokenizerFast) -> LlamaConfig:
    """One layer, hidden size 64, an untied head: the judges' shape."""
    return LlamaConfig(
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


def build_tiny_judge(out: Path, *, verdict: str = "yes", seed: int = 0) -> Path:
    """Save the judge (see the module docstring) under ``out``; returns ``out``."""
    tok = _tokenizer()
    config = _config(tok)
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


def _single_token(tok: PreTrainedTokenizerFast, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{text!r} is not one token of the judge's tokenizer: {ids}")
    return int(ids[0])


def build_marker_judge(out: Path, *, seed: int = 0) -> Path:
    """Save the judge that answers "yes" after ``<|agree|>`` and "no" after any other token (see
    the module docstring) under ``out``; returns ``out``."""
    tok = _tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|verdict|>", AGREE]})
    tok.chat_template = MARKER_TEMPLATE
    agree, eos = tok.convert_tokens_to_ids(AGREE), tok.eos_token_id
    yes, no = _single_token(tok, "yes"), _single_token(tok, "no")
    config = _config(tok)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # a, b, z: orthonormal columns of a seeded random (hidden, 3) matrix.
    a, b, z = torch.linalg.qr(torch.randn(config.hidden_size, 3)).Q.T
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = a.expand(config.vocab_size, -1).clone()  # (V, hidden)
        embeddings[agree] = b
        embeddings[[yes, no, eos]] = z
        embeddings += 0.05 * torch.randn_like(embeddings) / config.hidden_size**0.5
        model.model.embed_tokens.weight.copy_(embeddings)
        head = torch.zeros_like(embeddings)  # (V, hidden)
        head[no], head[yes], head[eos] = a, b, z
        model.lm_head.weight.copy_(head)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
