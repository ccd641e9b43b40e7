"""Assets of the multi-turn tests: a Qwen2-style policy whose byte-level BPE tokenizer (built
here, from ``byo_assets``) has a Hermes/ChatML chat template with tools, and a tools file.

The template follows Qwen2.5's: the tools' schemas in a system turn, assistant turns written as
sampled, consecutive ``tool`` messages in one ``user`` turn of ``<tool_response>`` blocks.
``<tool_call>`` and ``</tool_call>`` are added tokens (one id each), as in Qwen2.5.

Two more chat templates, written here in the manner of the families they stand for:

- ``REASONING_TEMPLATE`` (Qwen3 style): an assistant turn after the last user message is
  rendered with a ``<think>…</think>`` block while it is the last message or its reasoning is
  not empty; once a tool message follows it, a turn without reasoning loses the block.
- ``DECLARED_TEMPLATE`` with ``DECLARED_RESPONSE_TEMPLATE``: calls written as
  ``<function=NAME>{arguments}</function>``, a format the tokenizer declares in its
  ``response_template`` (transformers' response parsing), tool answers in a ``tool`` turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from byo_assets import QWEN_SPECIALS, _bpe
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# Consecutive tool messages in one user turn of <tool_response> blocks, any other message as it
# is, then the generation prompt: the end of the Hermes and the reasoning templates.
_TOOL_TURNS_AND_THE_REST = (
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

HERMES_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nYou may call these tools:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    '{{ \'\\n</tools>\\nCall one as <tool_call>{"name": <name>, "arguments": <object>}'
    "</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}" + _TOOL_TURNS_AND_THE_REST
)

_TOOLS_SYSTEM = (
    "{% if tools %}{{ '<|im_start|>system\\nYou may call these tools:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
)

REASONING_TEMPLATE = (
    _TOOLS_SYSTEM + "{% set ns = namespace(last_user=-1) %}"
    "{% for message in messages %}{% if message.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}"
    "{% set content = message.content %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{% if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{% else %}{{ '<|im_start|>assistant\\n' + content }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message.role == 'tool' %}" + _TOOL_TURNS_AND_THE_REST
)

DECLARED_TEMPLATE = (
    _TOOLS_SYSTEM + "{% for message in messages %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DECLARED_RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"<function=(?P<name>[\w.-]+)>",
            "close": "</function>",
            "content": "json",
            "repeats": True,
            "transform": {
                "type": "function",
                "function": {"name": "{name}", "arguments": "{content}"},
            },
        },
        "content": {},
    },
}

TOOLS_PY = '''"""Tools of the multi-turn tests."""

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def explode(text: str) -> str:
    """Always fails.

    Args:
        text: Anything.
    """
    raise RuntimeError("boom")


def hang(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def shout(text: str) -> str:
    """Repeats the text many times.

    Args:
        text: What to repeat.
    """
    return " ".join([text] * 200)
'''


def build_hermes_tokenizer(
    template: str = HERMES_TEMPLATE, response_template: dict[str, Any] | None = None
) -> PreTrainedTokenizerFast:
    """The Qwen-style BPE tokenizer with ``template`` as its chat template (and
    ``response_template``, when given, as its declared response format)."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(400, QWEN_SPECIALS, bos=None),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=512,
        padding_side="right",
    )
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.chat_template = template
    if response_template is not None:
        tok.response_template = response_template
    return tok


def write_tools(root: Path) -> Path:
    path = root / "agent_tools.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TOOLS_PY)
    return path


def save_agent_policy(out: Path, *, seed: int = 0, hidden_size: int = 32) -> Path:
    """A tiny Qwen2ForCausalLM with the Hermes tokenizer, saved to ``out`` (two heads of
    ``hidden_size / 2``: vLLM's CPU attention wants 32 or more)."""
    tok = build_hermes_tokenizer()
    eos, pad = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def char_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """``text`` as one token per character (``<tool_call>``/``</tool_call>`` kept whole): ids a
    policy may sample but that BPE never produces from the text."""
    out: list[int] = []
    for part in text.replace("</tool_call>", "\0E\0").replace("<tool_call>", "\0S\0").split("\0"):
        if part in ("S", "E"):
            out.append(
                tokenizer.convert_tokens_to_ids("<tool_call>" if part == "S" else "</tool_call>")
            )
        else:
            for ch in part:
                out += tokenizer.encode(ch, add_special_tokens=False)
    return out


def warm_start_caller(
    policy: Path, out: Path, tools_file: Path, prompts: list[str], *, steps: int = 150
) -> Path:
    """``policy`` trained to answer every prompt with ``CALL`` (one id per character, then EOS)
    and, after the tool's answer, with "3": a policy that calls a tool on its first turn and
    answers on its second, whose sampled ids BPE would never give back. Saved to ``out``."""
    from infra.agent_loop import tool_turn_ids
    from infra.rl_data import chat_prompt_ids
    from infra.tools import tool_schemas

    class _Spec:
        path, name = str(tools_file), "add"

    tok = build_hermes_tokenizer()
    schemas = tool_schemas([_Spec()])
    eos = tok.eos_token_id
    rows: list[tuple[list[int], list[bool]]] = []
    for text in prompts:
        chat = [{"role": "user", "content": text}]
        prompt = list(chat_prompt_ids(tok, chat, tools=schemas))
        call = char_ids(tok, CALL) + [eos]
        tool = tool_turn_ids(
            tok,
            [*chat, {"role": "assistant", "content": CALL}],
            [{"role": "tool", "name": "add", "content": "3"}],
            tools=schemas,
            eos_text="<|im_end|>",
        )
        answer = char_ids(tok, "3") + [eos]
        ids = prompt + call + tool + answer
        trained = [False] * len(prompt) + [True] * len(call) + [False] * len(tool) + [True] * 2
        rows.append((ids, trained))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)  # (B, L)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # (B, L)
    for i, (ids, trained) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.where(torch.tensor(trained), torch.tensor(ids), -100)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_pretrained(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
