"""A user's own assets, shaped like real ones, built locally in seconds (nothing downloaded).

``build_byo_assets(root)`` writes what a user brings to ppoflow instead of the built-in task::

    root/
      policy/          Qwen2ForCausalLM + byte-level BPE tokenizer, ChatML template (Qwen2 style),
                       eos <|im_end|>, pad <|endoftext|>, generation_config eos/pad like Qwen2.5
      reward_model/    LlamaForSequenceClassification (num_labels=1) + another byte-level BPE,
                       Llama-3 specials and template, NO pad token (config.pad_token_id is None)
      data/            train.parquet, val.parquet (verl's layout, struct columns),
                       train.jsonl (plain-string prompts under other keys)
      rewards/         score_fn.py (verl's compute_score, dict result), bad_reward.py (raises
                       for the data source RAISING_SOURCE)

Both tokenizers are trained on the prompts and answers below, so their merges and ids differ.
``yaml_list`` and ``reward_functions`` write the ``key=value`` overrides that point a run at them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SOURCES = ("toy/add", "toy/echo")
RAISING_SOURCE = "toy/echo"
SYSTEM_PROMPT = "You are a helpful assistant."
TRAIN_ROWS = 64
VAL_ROWS = 16
JSONL_ROWS = 32
WORDS = ("apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

SCORE_FN = f'''"""A verl-style reward: exact match of the stripped answer, partial credit for
containment; ``known_source`` says whether the data source arrived as written in the file."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    answer = solution_str.strip()
    acc = answer == ground_truth.strip()
    score = 1.0 if acc else (0.5 if ground_truth in solution_str else 0.0)
    known = data_source in {SOURCES!r}
    return {{
        "score": float(score), "acc": bool(acc), "len": len(solution_str), "known_source": known
    }}
'''

BAD_FN = f'''"""A verl-style reward that does not know the data source {RAISING_SOURCE!r}."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if data_source == {RAISING_SOURCE!r}:
        raise ValueError(f"no scorer for data_source {{data_source!r}}")
    return 1.0 if solution_str.strip() == ground_truth.strip() else 0.0
'''


@dataclass(frozen=True)
class ByoAssets:
    """Where ``build_byo_assets`` put each asset (model folders hold their tokenizer)."""

    root: Path
    policy: Path
    reward_model: Path
    train_parquet: Path
    val_parquet: Path
    train_jsonl: Path
    score_fn: Path
    bad_fn: Path


@dataclass(frozen=True)
class _Example:
    data_source: str
    question: str
    answer: str


def _examples(count: int, seed: int) -> list[_Example]:
    """Short prompts from the two sources, alternating, deterministic in ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 2 == 0:
            a, b = rng.randint(1, 49), rng.randint(1, 49)
            out.append(_Example(SOURCES[0], f"What is {a}+{b}?", str(a + b)))
        else:
            word = rng.choice(WORDS)
            out.append(_Example(SOURCES[1], f"Repeat the word: {word}", word))
    return out


def _corpus() -> list[str]:
    lines = [SYSTEM_PROMPT, "user", "assistant", "system"]
    for ex in _examples(300, seed=99):
        lines += [ex.question, ex.answer]
    return lines


def _qwen2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Qwen2's split (digits one by one) then byte-level: what ``Qwen2Tokenizer`` rebuilds on
    load, so the saved and the loaded tokenizer encode alike."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _bpe(vocab_size: int, specials: tuple[str, ...], *, bos: str | None) -> Tokenizer:
    """A byte-level BPE trained on the corpus; ``bos`` given = Llama-3 style, else Qwen2 style."""
    core = Tokenizer(models.BPE())
    if bos is None:
        core.normalizer = normalizers.NFC()
        core.pre_tokenizer = _qwen2_pre_tokenizer()
    else:
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(), trainer=trainer)
    if bos is not None:  # Llama-3 style: an encoding with special tokens starts with BOS
        core.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, core.token_to_id(bos))],
        )
    return core


def build_policy_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen2-like: ChatML template, eos ``<|im_end|>``, pad ``<|endoftext|>``, no BOS."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(400, QWEN_SPECIALS, bos=None),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=256,
        padding_side="right",
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_reward_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-3-like: its own merges and ids, BOS ``<|begin_of_text|>``, eos ``<|eot_id|>``,
    and no pad token."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(320, LLAMA_SPECIALS, bos=LLAMA_SPECIALS[0]),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"],
        model_max_length=256,
    )
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


def _save_policy(out: Path, seed: int) -> None:
    tok = build_policy_tokenizer()
    eos, pad = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    # Qwen2.5-Instruct's generation_config stops on either end token.
    model.generation_config = GenerationConfig(
        bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _save_reward_model(out: Path, seed: int) -> None:
    tok = build_reward_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        num_labels=1,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=None,
    )
    torch.manual_seed(seed + 1)
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _verl_rows(examples: list[_Example], split: str) -> list[dict]:
    rows = []
    for i, ex in enumerate(examples):
        prompt = [{"role": "user", "content": ex.question}]
        if i % 3 == 0:
            prompt.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        rows.append(
            {
                "data_source": ex.data_source,
                "prompt": prompt,
                "ability": "math" if ex.data_source == SOURCES[0] else "copy",
                "reward_model": {"style": "rule", "ground_truth": ex.answer},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def _write_parquet(path: Path, rows: list[dict]) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)


def _write_jsonl(path: Path, examples: list[_Example]) -> None:
    lines = [
        json.dumps({"question": ex.question, "answer": ex.answer, "source": ex.data_source})
        for ex in examples
    ]
    path.write_text("\n".join(lines) + "\n")


def build_byo_assets(root: Path, *, seed: int = 0) -> ByoAssets:
    """Write the user assets under ``root`` (see the module docstring) and return their paths."""
    root = Path(root)
    paths = ByoAssets(
        root=root,
        policy=root / "policy",
        reward_model=root / "reward_model",
        train_parquet=root / "data" / "train.parquet",
        val_parquet=root / "data" / "val.parquet",
        train_jsonl=root / "data" / "train.jsonl",
        score_fn=root / "rewards" / "score_fn.py",
        bad_fn=root / "rewards" / "bad_reward.py",
    )
    for folder in (paths.train_parquet.parent, paths.score_fn.parent):
        folder.mkdir(parents=True, exist_ok=True)
    _save_policy(paths.policy, seed)
    _save_reward_model(paths.reward_model, seed)
    _write_parquet(paths.train_parquet, _verl_rows(_examples(TRAIN_ROWS, seed), "train"))
    _write_parquet(paths.val_parquet, _verl_rows(_examples(VAL_ROWS, seed + 1), "test"))
    _write_jsonl(paths.train_jsonl, _examples(JSONL_ROWS, seed + 2))
    paths.score_fn.write_text(SCORE_FN)
    paths.bad_fn.write_text(BAD_FN)
    return paths


def yaml_list(*paths: Path) -> str:
    """``[a, b]``: a YAML flow list of paths for a ``key=value`` override."""
    return "[" + ", ".join(str(p) for p in paths) + "]"


def reward_functions(*files: Path, weight: float = 1.0) -> str:
    """``reward.functions=[{path: ..., weight: ...}, ...]``."""
    items = ", ".join(f"{{path: {f}, weight: {weight}}}" for f in files)
    return f"reward.functions=[{items}]"
