"""Tiny local assets: a character tokenizer and tiny Llama models, built in-process, never downloaded.

``build_tiny_assets(root)`` writes everything the embedded pipeline needs into ``root``::

    root/
      manifest.json        specs + seed + format version; a rebuild happens only when they change
      tokenizer/           policy tokenizer (character-level WordLevel, chat template)
      policy/              LlamaForCausalLM, random init, tokenizer beside it
      critic/              LlamaForTokenClassification (num_labels=1: a value per token)
      reward_model/        LlamaForSequenceClassification (num_labels=1), policy tokenizer
      reward_model_alt/    the same class with the *reward* tokenizer (other ids, markers, template)
      data/                train.parquet, heldout.parquet (see ``infra.data``)

Every model is saved with ``save_pretrained`` and is meant to be loaded back with
``from_pretrained`` — the same path a user with real checkpoints takes.
"""

from __future__ import annotations

import fcntl
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from infra.data import make_addition_dataset
from infra.progress import Parts, Progress

ASSETS_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

# Characters the tokenizers know; anything else maps to the unknown token.
CHARACTERS: tuple[str, ...] = (*"0123456789", "+", "-", "=", " ", "?")


@dataclass(frozen=True)
class _TokenizerVariant:
    """What distinguishes the two tokenizers: special-token names, their order, and the template.

    ``markers`` are the chat-role tokens the template writes; they are special tokens, so they
    never split into characters and ``skip_special_tokens`` drops them.
    """

    pad: str
    bos: str
    eos: str
    unk: str
    markers: tuple[str, ...]
    specials_first: bool
    chat_template: str


_POLICY_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_REWARD_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}[Q]{{ message['content'] }}[/Q]"
    "{% elif message['role'] == 'assistant' %}[A]{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}[A]{% endif %}"
)

_VARIANTS: dict[str, _TokenizerVariant] = {
    "policy": _TokenizerVariant(
        pad="<pad>",
        bos="<bos>",
        eos="<eos>",
        unk="<unk>",
        markers=("<|user|>", "<|assistant|>"),
        specials_first=True,
        chat_template=_POLICY_TEMPLATE,
    ),
    "reward": _TokenizerVariant(
        pad="[PAD]",
        bos="[BOS]",
        eos="[EOS]",
        unk="[UNK]",
        markers=("[Q]", "[/Q]", "[A]"),
        specials_first=False,
        chat_template=_REWARD_TEMPLATE,
    ),
}


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of one tiny Llama model (~0.3M parameters at the defaults)."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    max_positions: int = 64


@dataclass(frozen=True)
class AssetPaths:
    """Where ``build_tiny_assets`` put each asset (every model folder also holds its tokenizer)."""

    root: Path
    tokenizer: Path
    policy: Path
    critic: Path
    reward_model: Path
    reward_model_alt: Path
    train_data: Path
    heldout_data: Path

    @property
    def manifest(self) -> Path:
        """The build record; present only once a build has completed."""
        return self.root / MANIFEST_NAME

    @classmethod
    def under(cls, root: Path) -> AssetPaths:
        """The fixed layout below ``root``."""
        return cls(
            root=root,
            tokenizer=root / "tokenizer",
            policy=root / "policy",
            critic=root / "critic",
            reward_model=root / "reward_model",
            reward_model_alt=root / "reward_model_alt",
            train_data=root / "data" / "train.parquet",
            heldout_data=root / "data" / "heldout.parquet",
        )


def build_char_tokenizer(
    out_dir: Path, *, variant: Literal["policy", "reward"] = "policy"
) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer with a chat template, save it to ``out_dir`` and return it.

    Every character is one token (WordLevel over single characters). The ``reward`` variant has
    different ids (characters first), different role markers and a different template, so a
    reward model using it exercises the re-tokenisation path.
    """
    spec = _VARIANTS[variant]
    specials = [spec.pad, spec.bos, spec.eos, spec.unk, *spec.markers]
    ordered = [*specials, *CHARACTERS] if spec.specials_first else [*CHARACTERS, *specials]
    vocab = {token: index for index, token in enumerate(ordered)}

    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=spec.unk))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    # transformers' TokenizersBackend.__init__ is unannotated
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        pad_token=spec.pad,
        bos_token=spec.bos,
        eos_token=spec.eos,
        unk_token=spec.unk,
        extra_special_tokens=list(spec.markers),
        padding_side="right",
        model_max_length=64,
    )
    tokenizer.chat_template = spec.chat_template
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _llama_config(
    spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast, *, num_labels: int | None = None
) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    if num_labels is not None:
        config.num_labels = num_labels  # a property (it fills id2label), not a constructor field
    return config


def _save_model(
    model_cls: type[PreTrainedModel],
    config: LlamaConfig,
    tokenizer: PreTrainedTokenizerFast,
    out_dir: Path,
    *,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    model = model_cls(config)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _manifest(seed: int, policy: TinyModelSpec, reward: TinyModelSpec) -> dict[str, object]:
    return {
        "format_version": ASSETS_FORMAT_VERSION,
        "seed": seed,
        "policy": asdict(policy),
        "reward": asdict(reward),
    }


def _read_manifest(path: Path) -> object:
    return json.loads(path.read_text()) if path.is_file() else None


def build_tiny_assets(
    root: Path,
    *,
    seed: int = 0,
    policy: TinyModelSpec = TinyModelSpec(),
    reward: TinyModelSpec = TinyModelSpec(),
    force: bool = False,
    progress: Progress | None = None,
) -> AssetPaths:
    """Build (or reuse) the tokenizers, tiny models and addition dataset under ``root``.

    Idempotent: when ``root/manifest.json`` records the same specs, seed and format version the
    existing assets are returned untouched; otherwise (or with ``force``) they are rebuilt. The
    manifest is written last, so an interrupted build is redone on the next call. A build
    reports ``progress`` over its parts (the tokenizers, each model, the data); reused assets
    report nothing.
    """
    root = Path(root)
    with build_lock(root):
        return _build_tiny_assets(
            root, seed=seed, policy=policy, reward=reward, force=force, progress=progress
        )


@contextmanager
def build_lock(root: Path) -> Iterator[None]:
    """An exclusive lock beside ``root``, held while it is checked and built: a second process
    building the same folder waits, then finds it built (a reader never sees half a build)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_tiny_assets(
    root: Path,
    *,
    seed: int,
    policy: TinyModelSpec,
    reward: TinyModelSpec,
    force: bool,
    progress: Progress | None = None,
) -> AssetPaths:
    paths = AssetPaths.under(root)
    wanted = _manifest(seed, policy, reward)
    if not force and _read_manifest(paths.manifest) == wanted:
        return paths
    # 1. Start clean: a stale manifest must not survive a half-finished rebuild.
    built = Parts(progress, total=6)  # the tokenizers, four models, the data
    paths.manifest.unlink(missing_ok=True)
    for folder in (
        paths.tokenizer,
        paths.policy,
        paths.critic,
        paths.reward_model,
        paths.reward_model_alt,
    ):
        shutil.rmtree(folder, ignore_errors=True)
    # 2. Tokenizers.
    policy_tokenizer = build_char_tokenizer(paths.tokenizer, variant="policy")
    reward_tokenizer = build_char_tokenizer(paths.reward_model_alt, variant="reward")
    built.done()
    # 3. Models, each with a fixed seed of its own.
    models = (
        (LlamaForCausalLM, policy, policy_tokenizer, None, paths.policy),
        (LlamaForTokenClassification, policy, policy_tokenizer, 1, paths.critic),
        (LlamaForSequenceClassification, reward, policy_tokenizer, 1, paths.reward_model),
        (LlamaForSequenceClassification, reward, reward_tokenizer, 1, paths.reward_model_alt),
    )
    for offset, (model_cls, spec, tokenizer, labels, out_dir) in enumerate(models):
        config = _llama_config(spec, tokenizer, num_labels=labels)
        _save_model(model_cls, config, tokenizer, out_dir, seed=seed + offset)
        built.done()
    # 4. Data, then the manifest that marks the build complete.
    make_addition_dataset(paths.train_data.parent, seed=seed)
    paths.manifest.write_text(json.dumps(wanted, indent=2, sort_keys=True))
    built.done()
    return paths
