"""The built-in agentic task (``--config agent``): add two four-digit numbers, with an ``add``
tool the policy may call.

Four-digit sums are beyond what the tiny policy learns to add by itself; the tool adds exactly,
so the policy that learns to call it (and to copy its answer) gets the exact rule's reward.

- ``add``: the tool (``rollout.tools: [{path: infra.agent_task, name: add}]``). This module
  imports nothing heavy at the top, so the tool workers start fast.
- ``build_agent_assets(root)``: a character tokenizer whose chat template renders tools and
  ``tool`` turns, with the Hermes call written as a few merged pieces (``<tool_call>``,
  ``{"name": "add", "arguments": {"a": ``, ``, "b": ``, ``}}``, ``</tool_call>``) so that a call
  is 13 tokens; a tiny Llama policy; the prompts (train and held-out, no pair in both).
- ``agent_warmstart``: supervised warm start on demonstrations, ``TOOL_FRACTION`` of them
  calling the tool (the call, the tool's answer as the chat template renders it, the answer
  copied from it) and the rest answering directly (the right sum, which the tiny policy mostly
  fails to learn). The loss covers the assistant's tokens only, as RL's ``loss_mask`` does.
  After it the policy calls the tool on about ``TOOL_FRACTION`` of the prompts; RL with the
  exact rule as reward raises that share and the accuracy with it.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from infra.assets import AssetPaths
    from infra.pretrain import SFTSettings
    from infra.progress import Progress

__all__ = [
    "AgentWarmstartReport",
    "add",
    "agent_warmstart",
    "build_agent_assets",
    "build_agent_tokenizer",
    "demonstration",
]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


OPERANDS = range(1_000, 10_000)
TRAIN_PROMPTS = 20_000
HELDOUT_PROMPTS = 500
TOOL_FRACTION = 0.4  # demonstrations that call the tool; the rest answer directly
FORMAT_VERSION = 2
CALL_PIECES = ('{"name": "add", "arguments": {"a": ', ', "b": ', "}}")
MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")

AGENT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>{% for tool in tools %}{{ tool.function.name }}("
    "{{ tool.function.parameters.properties | list | join(',') }}){% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<|user|>{{ message.content }}"
    "{% elif message.role == 'assistant' %}<|assistant|>{{ message.content }}{{ eos_token }}"
    "{% elif message.role == 'tool' %}<|tool|>{{ message.content }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def call_text(a: int, b: int) -> str:
    """The Hermes call of ``add(a, b)``."""
    return f"<tool_call>{json.dumps({'name': 'add', 'arguments': {'a': a, 'b': b}})}</tool_call>"


def build_agent_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Printable ASCII one character a token, the call's merged pieces one token each, and the
    role markers as special tokens; the chat template ``AGENT_TEMPLATE``. Saved to ``out_dir``."""
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>", *MARKERS]
    pieces = ["<tool_call>", "</tool_call>", *CALL_PIECES]
    chars = [chr(c) for c in range(32, 127)]
    vocab = {token: i for i, token in enumerate([*specials, *pieces, *chars])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    pattern = "|".join(re.escape(p) for p in sorted(pieces, key=len, reverse=True)) + "|."
    core.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        extra_special_tokens=list(MARKERS),
        padding_side="right",
        model_max_length=128,
    )
    tokenizer.chat_template = AGENT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _pairs(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Distinct ``(a, b)`` pairs: ``(train, heldout)``, never sharing one."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    while len(seen) < TRAIN_PROMPTS + HELDOUT_PROMPTS:
        seen.add((rng.choice(OPERANDS), rng.choice(OPERANDS)))
    pairs = sorted(seen)
    rng.shuffle(pairs)
    return pairs[HELDOUT_PROMPTS:], pairs[:HELDOUT_PROMPTS]


def build_agent_assets(
    root: Path, *, seed: int = 0, force: bool = False, progress: Progress | None = None
) -> AssetPaths:
    """Tokenizer, tiny Llama policy and prompt files under ``root`` (``AssetPaths`` layout; no
    critic or reward model: the task's reward is the exact rule). Idempotent like
    ``build_tiny_assets``: a manifest written last records what was built. A build reports
    ``progress`` over its parts (the tokenizer, the policy, each prompt file); reused assets
    report nothing."""
    from infra.assets import build_lock

    with build_lock(Path(root)):
        return _build_agent_assets(Path(root), seed=seed, force=force, progress=progress)


def _build_agent_assets(
    root: Path, *, seed: int, force: bool, progress: Progress | None = None
) -> AssetPaths:
    from transformers import LlamaForCausalLM

    from infra.assets import AssetPaths, TinyModelSpec, _llama_config, _save_model
    from infra.data import write_addition_prompts
    from infra.progress import Parts

    paths = AssetPaths.under(root)
    spec = TinyModelSpec(max_positions=128)
    wanted = {"format_version": FORMAT_VERSION, "seed": seed, "policy": spec.__dict__}
    if not force and paths.manifest.is_file() and json.loads(paths.manifest.read_text()) == wanted:
        return paths
    built = Parts(progress, total=4)  # the tokenizer, the policy, the two prompt files
    paths.manifest.unlink(missing_ok=True)
    for folder in (paths.tokenizer, paths.policy):
        shutil.rmtree(folder, ignore_errors=True)
    tokenizer = build_agent_tokenizer(paths.tokenizer)
    built.done()
    _save_model(
        LlamaForCausalLM, _llama_config(spec, tokenizer), tokenizer, paths.policy, seed=seed
    )
    built.done()
    train, heldout = _pairs(seed)
    write_addition_prompts(paths.train_data, train)
    built.done()
    write_addition_prompts(paths.heldout_data, heldout)
    paths.manifest.write_text(json.dumps(wanted, indent=2, sort_keys=True))
    built.done()
    return paths


# --------------------------------------------------------------------------- warm start


def demonstration(
    tokenizer: PreTrainedTokenizerBase,
    a: int,
    b: int,
    *,
    use_tool: bool,
    tools: list[dict[str, Any]],
) -> tuple[list[int], list[int], list[bool]]:
    """``(prompt_ids, response_ids, trained)`` of one demonstration: the response as the agent
    loop stores it (sampled turns, then the chat template's tool turn), ``trained`` True on the
    assistant's tokens."""
    from infra.agent_loop import tool_turn_ids
    from infra.rl_data import chat_prompt_ids

    chat: list[dict[str, Any]] = [{"role": "user", "content": f"{a}+{b}="}]
    prompt = list(chat_prompt_ids(tokenizer, chat, tools=tools))
    eos = int(tokenizer.eos_token_id)
    answer = list(tokenizer.encode(str(a + b), add_special_tokens=False)) + [eos]
    if not use_tool:
        return prompt, answer, [True] * len(answer)
    call = call_text(a, b)
    call_ids = list(tokenizer.encode(call, add_special_tokens=False)) + [eos]
    tool = tool_turn_ids(
        tokenizer,
        [*chat, {"role": "assistant", "content": call}],
        [{"role": "tool", "name": "add", "content": str(a + b)}],
        tools=tools,
        eos_text=tokenizer.eos_token,
    )
    response = call_ids + tool + answer
    trained = [True] * len(call_ids) + [False] * len(tool) + [True] * len(answer)
    return prompt, response, trained


def _masked_nll(
    model: PreTrainedModel, rows: list[tuple[list[int], list[int], list[bool]]], pad_id: int
) -> Any:
    """Mean next-token NLL over the trained response tokens of ``rows``."""
    import torch
    import torch.nn.functional as F

    width = max(len(p) + len(r) for p, r, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, L)
    keep = torch.zeros((len(rows), width), dtype=torch.bool)  # (B, L)
    for i, (prompt, response, trained) in enumerate(rows):
        ids[i, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        keep[i, len(prompt) : len(prompt) + len(response)] = torch.tensor(trained)
    logits = model(input_ids=ids).logits[:, :-1]  # (B, L-1, V)
    nll = F.cross_entropy(logits.transpose(1, 2).float(), ids[:, 1:], reduction="none")
    target = keep[:, 1:].float()  # (B, L-1)
    return (nll * target).sum() / target.sum().clamp(min=1.0)


@dataclass(frozen=True)
class AgentWarmstartReport:
    first_loss: float
    last_loss: float
    """Mean NLL of the assistant's tokens over the last tenth of the steps."""
    steps: int
    seconds: float
    tool_fraction: float


def agent_warmstart(
    *,
    policy_path: Path,
    tokenizer_path: Path,
    train_path: Path,
    heldout_path: Path,
    out_path: Path,
    settings: SFTSettings,
    seed: int,
    progress: Progress | None = None,
) -> AgentWarmstartReport:
    """Fine-tune the policy on demonstrations (see the module docstring); save it and the
    tokenizer to ``out_path``. The schedule is ``infra.pretrain``'s (``settings``)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from infra.data import read_prompt_rows
    from infra.pretrain import _train_loop
    from infra.tools import tool_schemas

    # 1. The policy, the tokenizer, the tool's schema and the training prompts' operands.
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    model = LlamaForCausalLM.from_pretrained(policy_path)
    tools = tool_schemas([_Tool()]) or []
    operands = [_operands(row.ground_truth, row.raw_prompt) for row in read_prompt_rows(train_path)]
    rng = random.Random(seed)

    # 2. Each step: a batch of fresh demonstrations, TOOL_FRACTION of them with the tool. A
    #    demonstration depends on its operands and tool use only: each is rendered once.
    @functools.cache
    def demo(a: int, b: int, use_tool: bool) -> tuple[list[int], list[int], list[bool]]:
        return demonstration(tokenizer, a, b, use_tool=use_tool, tools=tools)

    def loss_fn(progress: float) -> Any:
        rows = [
            demo(a, b, rng.random() < TOOL_FRACTION)
            for a, b in rng.choices(operands, k=settings.batch_size)
        ]
        return _masked_nll(model, rows, int(tokenizer.pad_token_id))

    losses, steps, seconds = _train_loop(
        model=model,
        loss_fn=loss_fn,
        lr=settings.lr,
        warmup_fraction=settings.warmup_fraction,
        min_lr_ratio=settings.min_lr_ratio,
        steps=settings.steps,
        max_seconds=settings.max_seconds,
        progress=progress,
    )
    model.save_pretrained(out_path)
    tokenizer.save_pretrained(out_path)
    tail = losses[-max(len(losses) // 10, 1) :] if losses else [float("nan")]
    return AgentWarmstartReport(
        first_loss=losses[0] if losses else float("nan"),
        last_loss=sum(tail) / len(tail),
        steps=steps,
        seconds=seconds,
        tool_fraction=TOOL_FRACTION,
    )


@dataclass(frozen=True)
class _Tool:
    path: str = "infra.agent_task"
    name: str = "add"


def _operands(ground_truth: str, raw_prompt: Any) -> tuple[int, int]:
    text = str(raw_prompt[-1]["content"]).rstrip("=")
    a, b = (int(x) for x in text.split("+"))
    return a, b
