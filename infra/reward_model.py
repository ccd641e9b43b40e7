"""The colocated reward model: one scalar score per (prompt, response) sample and member.

``RewardScorer`` loads a sequence-classification reward model (``num_labels=1``) and its own
tokenizer from one folder, or an ensemble of them from several folders (``reward_model_paths``),
and scores rollouts with each member in one of two ways:

- **same tokenizer** as the policy (equal vocabulary and special tokens, whatever the paths):
  the policy's ``prompt_ids + response_ids`` are scored as they are;
- **different tokenizer**: each response is decoded with the policy tokenizer (special tokens
  skipped) and the conversation ``raw_prompt + [assistant: response]`` is rendered with the
  reward model's own chat template and tokenised by its own tokenizer; a multi-turn rollout's
  stored conversation (its assistant turns and tool results) is rendered whole in its place.

Either way an input longer than ``max_length`` keeps its *end* (the response) and is flagged in
``ScoreOutput.truncated``. Each row is scored at its last real token, found from the row lengths
(never from pad ids, which breaks when pad == EOS, and never by indexing -1): we run the base
model and apply the ``score`` head to that one hidden state. Architectures without a ``score``
head fall back to the model's own pooled logits (which pool by pad id; documented limitation).
An empty response is scored on the prompt alone. Non-finite scores are returned as they are;
the score stage decides what to do with them (``tasks.score.find_nonfinite``), and combines an
ensemble's members into one score (``tasks.score.core.ensemble_scores``: mean − penalty × std).

An ensemble's members wake and sleep together: the scorer is one ``Sleepable`` of the colocated
group (the ``reward`` role), so its turn holds every member on the device at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from infra.engines.base import ModuleResidency
from infra.kernels import fuse_activations
from infra.token_budget import longest_first_groups

__all__ = ["RewardScorer", "ScoreOutput", "reward_model_paths", "tokenizers_match"]


@dataclass(frozen=True)
class ScoreOutput:
    """``member_scores`` (B, M) float32, one column per ensemble member (M = 1: one model);
    ``truncated`` (B,) bool: some member's input was cut to its max_length."""

    member_scores: Tensor
    truncated: Tensor

    @property
    def scores(self) -> Tensor:
        """The members' mean, (B,) float32 (one model: its scores)."""
        return self.member_scores.mean(dim=1)


def reward_model_paths(given: str | Path | Sequence[str | Path] | None) -> tuple[str, ...]:
    """One reward-model folder, a list of them (an ensemble) or None, as a tuple of strings."""
    if given is None:
        return ()
    if isinstance(given, str | Path):
        return (str(given),)
    return tuple(str(path) for path in given)


class _Member:
    """One reward model of the scorer: the model, its tokenizer and how rows reach it."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        policy_tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
        dtype: torch.dtype,
        max_length: int | None,
    ) -> None:
        model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=dtype)
        if model.config.num_labels != 1:
            raise ValueError(
                f"reward model at {model_path} has num_labels={model.config.num_labels}; "
                "a reward model must output one score (num_labels=1)"
            )
        fuse_activations(model)
        self.model: PreTrainedModel = model.to(device).eval()
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_path)
        self.same_tokenizer = tokenizers_match(self.tokenizer, policy_tokenizer)
        if not self.same_tokenizer and not self.tokenizer.chat_template:
            raise ValueError(
                f"the reward model's tokenizer ({model_path}) differs from the policy's and has no "
                "chat_template to re-render conversations with: add one to its tokenizer_config"
            )
        self.max_length = max_length or int(model.config.max_position_embeddings)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        self.residency = ModuleResidency(self.model, device)


class RewardScorer:
    """Scores rollouts with a colocated reward model or ensemble; ``Sleepable`` like the rollout
    engines (every member wakes and sleeps with it).

    ``model_path`` is one folder or a sequence of them (the ensemble's members, in order).
    ``max_length`` defaults to each model's ``max_position_embeddings``. Rows are scored longest
    first, in batches of at most ``batch_size`` rows and, with ``max_tokens_per_batch``, at
    most that many padded tokens (rows × the batch's longest row); outputs keep the input
    order.
    ``model``, ``tokenizer``, ``same_tokenizer`` and ``max_length`` are the first member's.
    """

    def __init__(
        self,
        model_path: str | Path | Sequence[str | Path],
        *,
        policy_tokenizer_path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        batch_size: int = 64,
        max_tokens_per_batch: int | None = None,
        max_length: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_tokens_per_batch is not None and max_tokens_per_batch < 1:
            raise ValueError(
                f"max_tokens_per_batch must be >= 1 or None (reward.max_tokens_per_batch), got "
                f"{max_tokens_per_batch}"
            )
        paths = reward_model_paths(model_path)
        if not paths:
            raise ValueError("RewardScorer needs at least one reward-model folder")
        self._device = torch.device(device)
        self.policy_tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            policy_tokenizer_path
        )
        self.members = [
            _Member(
                path,
                policy_tokenizer=self.policy_tokenizer,
                device=self._device,
                dtype=dtype,
                max_length=max_length,
            )
            for path in paths
        ]
        self.batch_size = batch_size
        self.max_tokens_per_batch = max_tokens_per_batch

    @property
    def model(self) -> PreTrainedModel:
        return self.members[0].model

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.members[0].tokenizer

    @property
    def same_tokenizer(self) -> bool:
        return self.members[0].same_tokenizer

    @property
    def max_length(self) -> int:
        return self.members[0].max_length

    def parameter_bytes(self) -> list[int]:
        """Bytes of each member's parameters and buffers (what a wake-up puts on the device)."""
        return [
            sum(t.numel() * t.element_size() for t in (*m.model.parameters(), *m.model.buffers()))
            for m in self.members
        ]

    # -- Sleepable -----------------------------------------------------------------------------

    @property
    def is_awake(self) -> bool:
        return self.members[0].residency.is_awake

    def sleep(self) -> None:
        """Release device memory (CUDA: weights to pinned CPU memory; CPU: flag only)."""
        for member in self.members:
            member.residency.sleep()

    def wake_up(self) -> None:
        """Bring every member's bit-identical weights back to the device."""
        for member in self.members:
            member.residency.wake_up()

    # -- scoring -------------------------------------------------------------------------------

    def score(
        self,
        *,
        prompt_ids: list[Tensor],
        response_ids: list[Tensor],
        raw_prompt: Sequence[Any],
        conversations: Sequence[list[dict[str, Any]]] | None = None,
    ) -> ScoreOutput:
        """Score B samples with every member: row b is ``prompt_ids[b]`` answered by
        ``response_ids[b]``.

        ``raw_prompt[b]`` (chat messages or a plain string) is used only by a member whose
        tokenizer differs from the policy's; so are ``conversations[b]`` (a multi-turn
        rollout's whole chat: prompt, assistant turns, tool results), which such a member then
        renders in place of ``raw_prompt[b]`` and the decoded response. Raises ValueError when the three lists disagree in
        length or when a row has neither prompt nor response tokens (there is nothing to score).
        """
        self.members[0].residency.require_awake("RewardScorer.score()")
        if not len(prompt_ids) == len(response_ids) == len(raw_prompt):
            raise ValueError(
                f"score() needs one row per sample: got {len(prompt_ids)} prompt_ids, "
                f"{len(response_ids)} response_ids and {len(raw_prompt)} raw_prompt"
            )
        columns, truncated = [], torch.zeros(len(prompt_ids), dtype=torch.bool)  # (B,)
        for index in range(len(self.members)):
            scores, cut = self._score_member(
                index, prompt_ids, response_ids, raw_prompt, conversations
            )
            columns.append(scores)
            truncated |= cut
        return ScoreOutput(member_scores=torch.stack(columns, dim=1), truncated=truncated)

    def _score_member(
        self,
        index: int,
        prompt_ids: list[Tensor],
        response_ids: list[Tensor],
        raw_prompt: Sequence[Any],
        conversations: Sequence[list[dict[str, Any]]] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Member ``index``'s scores (B,) float32 and which of its inputs were cut (B,) bool."""
        member = self.members[index]
        # 1. Build the reward model's input ids, one row per sample.
        if member.same_tokenizer:
            rows = [
                torch.cat([p.long().cpu(), r.long().cpu()])
                for p, r in zip(prompt_ids, response_ids)
            ]
        elif conversations is not None:
            rows = [self.render_conversation(chat, member=index) for chat in conversations]
        else:
            rows = [self.render(raw, r, member=index) for raw, r in zip(raw_prompt, response_ids)]
        # 2. Keep the end of over-long rows.
        cap = member.max_length
        truncated = torch.tensor([row.numel() > cap for row in rows], dtype=torch.bool)  # (B,)
        rows = [row[-cap:] for row in rows]
        for position, row in enumerate(rows):
            if row.numel() == 0:
                raise ValueError(
                    f"row {position}: empty prompt and empty response, nothing to score"
                )
        # 3. Score in batches, longest first; scatter back to the input order.
        scores = torch.empty(len(rows), dtype=torch.float32)  # (B,)
        for chunk in self.batches([row.numel() for row in rows]):
            scores[chunk] = self._score_batch(member, [rows[i] for i in chunk])
        return scores, truncated

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Row indices of each scoring batch: longest first (ties in row order), a batch cut
        at ``batch_size`` rows or, with ``max_tokens_per_batch``, before its rows × its first
        (longest) row would pass that budget."""
        return longest_first_groups(lengths, self.max_tokens_per_batch, self.batch_size)

    def render(self, raw_prompt: Any, response_ids: Tensor, *, member: int = 0) -> Tensor:
        """Re-tokenise one sample for member ``member``: its chat template over the conversation
        ``raw_prompt + [{"role": "assistant", "content": decoded response}]`` (1-D int64)."""
        text = cast(
            str, self.policy_tokenizer.decode(response_ids.tolist(), skip_special_tokens=True)
        )
        messages: list[dict[str, str]] = [
            *_as_messages(raw_prompt),
            {"role": "assistant", "content": text},
        ]
        ids = self.members[member].tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=False, return_dict=False
        )
        return torch.tensor(ids, dtype=torch.long)

    def render_conversation(self, messages: list[dict[str, Any]], *, member: int = 0) -> Tensor:
        """Re-tokenise a multi-turn conversation for member ``member``: its chat template over
        the messages' roles, contents (and a tool message's ``name``) (1-D int64)."""
        chat = [
            {"role": str(m["role"]), "content": str(m.get("content") or "")}
            | ({"name": str(m["name"])} if "name" in m else {})
            for m in messages
        ]
        ids = self.members[member].tokenizer.apply_chat_template(
            chat, tokenize=True, add_generation_prompt=False, return_dict=False
        )
        return torch.tensor(ids, dtype=torch.long)

    @torch.inference_mode()
    def _score_batch(self, member: _Member, rows: list[Tensor]) -> Tensor:
        """Scores (b,) float32 on the CPU for right-padded rows, each at its last real token."""
        lengths = torch.tensor([row.numel() for row in rows])  # (b,)
        input_ids = torch.full((len(rows), int(lengths.max())), member.pad_id, dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, : row.numel()] = row  # (b, L)
        scores = last_token_scores(
            member.model, input_ids.to(self._device), lengths.to(self._device)
        )
        return scores.cpu()


def last_token_scores(model: PreTrainedModel, input_ids: Tensor, lengths: Tensor) -> Tensor:
    """One score per right-padded row of ``input_ids`` (B, L), read at its last real token
    (``lengths`` (B,), each >= 1, say where it is: padding is never looked for); (B,) float32.

    A ``*ForSequenceClassification`` model with a ``score`` head is read on the final hidden
    state at that token; any other model must pool by itself (``logits`` (B, 1)). Gradients flow:
    reward-model training scores its pairs with this, the scorer calls it in inference mode.
    """
    width = input_ids.shape[1]
    positions = torch.arange(width, device=input_ids.device)
    mask = (positions[None, :] < lengths[:, None]).long()  # (B, L) 1 = real token
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Module) or model.base_model is model:
        return cast(Tensor, model(input_ids=input_ids, attention_mask=mask).logits[:, 0].float())
    hidden = model.base_model(
        input_ids=input_ids, attention_mask=mask, use_cache=False
    ).last_hidden_state  # (B, L, H)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    pooled = hidden[rows, lengths - 1]  # (B, H)
    return cast(Tensor, head(pooled)[:, 0].float())


def tokenizers_match(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    """True when both map every token to the same id and share their special tokens."""
    if a.get_vocab() != b.get_vocab():
        return False
    specials = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    if any(getattr(a, name) != getattr(b, name) for name in specials):
        return False
    return sorted(a.all_special_ids) == sorted(b.all_special_ids)


def _as_messages(raw_prompt: Any) -> list[dict[str, str]]:
    """Chat messages from a raw prompt: a plain string becomes one user message."""
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    messages = []
    for message in raw_prompt:
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(
                f"raw_prompt must be a string or chat messages with 'role' and 'content', "
                f"got {message!r}"
            )
        messages.append({"role": str(message["role"]), "content": str(message["content"])})
    return messages
