"""Before RL: warm-start the policy (SFT) and train a reward model from rule-derived preferences.

Torch + transformers only. The recipe (``SFTSettings`` / ``RewardModelSettings``: the budgets come
from the config's ``warmstart`` section, the rest from the ``SFT_*`` / ``RM_*`` constants below):

1. ``sft_warmstart``: next-token loss on the response of "careless annotator" demonstrations
   (25% correct; the wrong answers are mostly sum+1, some ±2/±3, random or digit-reversed), so
   the policy writes well-formed answers that are right only ~20% of the time.
2. ``train_reward_model``: a ``LlamaForSequenceClassification`` initialised from the SFT causal
   LM (a new score head), Bradley–Terry loss + ``score_l2``·r² on pairs the rule decides:
   chosen = the correct answer + EOS; rejected = an answer sampled from the SFT policy, a
   synthetic wrong answer, or a malformed one. Its held-out pair accuracy (pairs built from
   held-out prompts only) is what makes or breaks RL on it: aim for ≥ 0.99. Member ``k`` of an
   ensemble trains the same way with its own seed (``member_seed``: score-head init, sampled
   rejections, pair draws and order) and is measured on the same held-out pairs as member 0.

Responses come from the rollout's own engine (``infra.engines.hf``) and every sequence is
scored by the reward scorer's ``last_token_scores``: at its last real token, found from its
length (never by looking for padding). Run the whole recipe with ``python -m infra.pretrain ROOT``.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn.functional as F
from transformers import (
    AutoTokenizer,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from infra.data import PromptRow, addition_rule, read_prompt_rows
from infra.engines.hf import TransformersEngine
from infra.progress import Progress
from infra.reward_model import last_token_scores

if TYPE_CHECKING:
    from infra.config import WarmstartConfig

T = TypeVar("T")

# The built-in task's warm-start recipe. The budgets (steps, seconds) are the config's
# (``warmstart.*``); these fix the rest, tuned for the tiny addition models.
SFT_BATCH_SIZE = 64
SFT_LR = 2e-3
SFT_WARMUP_FRACTION = 0.05
SFT_MIN_LR_RATIO = 0.1
SFT_CORRECT_FRACTION = 0.25
SFT_EVAL_ROWS = 500
RM_PAIRS_PER_STEP = 64
RM_LR = 5e-4
RM_WARMUP_FRACTION = 0.02
RM_MIN_LR_RATIO = 0.1
RM_SCORE_L2 = 1e-3
RM_SAMPLED_FRACTION = 0.5
RM_MALFORMED_FRACTION = 0.1
RM_SAMPLES_PER_PROMPT = 2
RM_EVAL_REJECTED_PER_PROMPT = 2
# Response cap of the warm start's own generations (SFT evaluation, the reward model's sampled
# rejections): an answer is at most 3 digits + EOS, so 6 leaves room for overlong answers.
WARMSTART_MAX_NEW_TOKENS = 6

# --------------------------------------------------------------------------- tokens and batches


def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, raw_prompt: list[dict[str, str]]
) -> list[int]:
    """Token ids of the chat-templated prompt, ending with the assistant generation prompt."""
    text = tokenizer.apply_chat_template(raw_prompt, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_ids(tokenizer: PreTrainedTokenizerBase, answer: str, *, eos: bool = True) -> list[int]:
    """Token ids of a response text, optionally closed by EOS."""
    ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    return [*ids, tokenizer.eos_token_id] if eos else ids


AnswerIds = Callable[[str, bool], list[int]]


def cached_answer_ids(tokenizer: PreTrainedTokenizerBase) -> AnswerIds:
    """``answer_ids`` of ``tokenizer``, each (text, eos) tokenised once: the training loops draw
    the same few answers again and again. Callers copy the lists they are given, never change them."""

    @functools.cache
    def encode(answer: str, eos: bool) -> list[int]:
        return answer_ids(tokenizer, answer, eos=eos)

    return encode


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to a batch; returns ``input_ids`` (B, L) int64 and ``lengths`` (B,) int64."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)  # (B,)
    ids = torch.full((len(seqs), int(lengths.max())), pad_id, dtype=torch.long)  # (B, L)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return ids, lengths


def _length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < lengths[:, None]  # (B, L) bool, True = real token


def sample_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[PromptRow],
    *,
    n: int,
    greedy: bool,
    max_new_tokens: int,
    seed: int,
    batch_size: int,
) -> list[list[int]]:
    """``n`` responses per row (prompt-major: row i's are i*n .. i*n+n-1), greedy or sampled at
    T=1, by the rollout's own engine over ``model`` as it is in memory; a response keeps its EOS
    if it has one. Batch k of ``batch_size`` rows draws with seed ``seed + k``."""
    engine = TransformersEngine(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    prompts = [torch.tensor(render_prompt_ids(tokenizer, row.raw_prompt)) for row in rows]
    responses: list[list[int]] = []
    for batch, start in enumerate(range(0, len(prompts), batch_size)):
        out = engine.generate(
            prompts[start : start + batch_size],
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=0.0 if greedy else 1.0,
            seed=seed + batch,
        )
        responses.extend(ids.tolist() for ids in out.response_ids)
    return responses


def decode_response(tokenizer: PreTrainedTokenizerBase, response_ids: Sequence[int]) -> str:
    """Response text as the rule sees it: special tokens skipped."""
    return str(tokenizer.decode(list(response_ids), skip_special_tokens=True))


def evaluate_rule_accuracy(
    *,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[PromptRow],
    greedy: bool,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 512,
) -> float:
    """Mean ``addition_rule`` over one generated response per row (greedy or sampled at T=1)."""
    was_training = model.training
    responses = sample_responses(
        model,
        tokenizer,
        rows,
        n=1,
        greedy=greedy,
        max_new_tokens=max_new_tokens,
        seed=seed,
        batch_size=batch_size,
    )
    model.train(was_training)
    correct = sum(
        addition_rule(decode_response(tokenizer, resp), row.ground_truth)
        for resp, row in zip(responses, rows)
    )
    return correct / max(len(rows), 1)


# --------------------------------------------------------------------------- wrong answers


def _operands(row: PromptRow) -> tuple[int, int]:
    left, right = row.raw_prompt[-1]["content"].rstrip("=").split("+")
    return int(left), int(right)


def careless_answer(row: PromptRow, rng: random.Random, *, correct_fraction: float) -> str:
    """An annotator's answer: correct with ``correct_fraction``, else a typical mistake."""
    if rng.random() < correct_fraction:
        return str(row.ground_truth)
    return wrong_answer(row, rng)


def wrong_answer(row: PromptRow, rng: random.Random) -> str:
    """A well-formed wrong answer: sum+1 (55%), ±2/±3 (20%), random (15%), digits reversed (10%)."""
    total = int(row.ground_truth)
    draw = rng.random()
    if draw < 0.55:
        value = total + 1
    elif draw < 0.75:
        value = total + rng.choice((-3, -2, 2, 3))
    elif draw < 0.90:
        value = rng.randint(20, 198)
    else:
        value = int(row.ground_truth[::-1])
    if value == total:  # a palindrome reversed, or a lucky random draw
        value = total + 1
    return str(value)


def near_miss_answer(row: PromptRow, rng: random.Random) -> str:
    """A harder wrong answer for reward-model pairs: units (±1..3, 50%), tens or carry (±9/10/11/20,
    30%), random (10%) or digits reversed (10%) — the mistakes a half-trained policy makes."""
    total = int(row.ground_truth)
    draw = rng.random()
    if draw < 0.5:
        value = total + rng.choice((-3, -2, -1, 1, 2, 3))
    elif draw < 0.8:
        value = total + rng.choice((-20, -11, -10, -9, 9, 10, 11, 20))
    elif draw < 0.9:
        value = rng.randint(20, 198)
    else:
        value = int(row.ground_truth[::-1])
    if value == total:
        value = total + 1
    return str(value)


def malformed_answer(row: PromptRow, rng: random.Random) -> tuple[str, bool]:
    """A badly formed response ``(text, ends_with_eos)``: missing EOS, extra or missing characters."""
    answer = row.ground_truth
    a, b = _operands(row)
    options: list[tuple[str, bool]] = [
        (answer, False),  # right digits but never stops
        (answer + answer[-1], True),  # a digit too many
        (answer[:-1], True),  # a digit too few
        ("", True),  # empty answer
        (answer + "=", True),
        (f"{a}+{b}", True),  # echoes the question
        (answer[0] + " " + answer[1:], True),
        (answer + answer, False),
    ]
    return rng.choice(options)


# --------------------------------------------------------------------------- schedules


def _cosine_lr(base_lr: float, progress: float, *, warmup: float, floor: float) -> float:
    """Linear warm-up over the first ``warmup`` fraction, then cosine from 1 to ``floor``."""
    if progress < warmup:
        return base_lr * max(progress / warmup, 0.01)
    span = (progress - warmup) / max(1.0 - warmup, 1e-9)
    return base_lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(span, 1.0))))


def _progress(step: int, steps: int, started: float, max_seconds: float | None) -> float:
    """Fraction of the budget used: steps, or wall-clock seconds when that cap comes first."""
    by_steps = step / steps
    if max_seconds is None:
        return by_steps
    return max(by_steps, (time.perf_counter() - started) / max_seconds)


def _budget_left(step: int, steps: int, started: float, max_seconds: float | None) -> bool:
    return step < steps and (max_seconds is None or time.perf_counter() - started < max_seconds)


# --------------------------------------------------------------------------- SFT warm start


@dataclass(frozen=True, kw_only=True)
class SFTSettings:
    """Warm-start budget and data mix. Training stops at ``steps`` or ``max_seconds``, first
    reached. Every field is required; ``from_config`` builds the run's."""

    steps: int
    max_seconds: float | None
    batch_size: int
    lr: float
    warmup_fraction: float
    min_lr_ratio: float
    correct_fraction: float
    """Share of demonstrations with the right answer; the rest are typical mistakes."""
    max_new_tokens: int
    eval_rows: int
    """Held-out prompts used for the accuracy in the report."""

    @classmethod
    def from_config(cls, warmstart: WarmstartConfig) -> SFTSettings:
        """The budget of ``warmstart`` (``sft_steps``, ``sft_max_seconds``) with the recipe."""
        return cls(
            steps=warmstart.sft_steps,
            max_seconds=warmstart.sft_max_seconds,
            batch_size=SFT_BATCH_SIZE,
            lr=SFT_LR,
            warmup_fraction=SFT_WARMUP_FRACTION,
            min_lr_ratio=SFT_MIN_LR_RATIO,
            correct_fraction=SFT_CORRECT_FRACTION,
            max_new_tokens=WARMSTART_MAX_NEW_TOKENS,
            eval_rows=SFT_EVAL_ROWS,
        )


@dataclass(frozen=True)
class SFTReport:
    heldout_accuracy: float
    """Greedy rule accuracy on held-out prompts after training."""
    heldout_sampled_accuracy: float
    """The same at temperature 1."""
    first_loss: float
    last_loss: float
    """Mean response NLL over the last tenth of the steps."""
    steps: int
    seconds: float


def response_nll(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
) -> torch.Tensor:
    """Mean negative log-likelihood of the response tokens given their prompts (a scalar).

    Sequences are right-padded; causal attention keeps real tokens from seeing the padding.
    """
    ids, lengths = pad_right([[*p, *r] for p, r in zip(prompts, responses)], pad_id)  # (B, L)
    mask = _length_mask(lengths, ids.shape[1])  # (B, L)
    starts = torch.tensor([len(p) for p in prompts])  # (B,)
    target_mask = mask & (torch.arange(ids.shape[1])[None, :] >= starts[:, None])  # (B, L)
    logits = model(input_ids=ids).logits[:, :-1]  # (B, L-1, V); causal: no mask needed
    nll = F.cross_entropy(logits.transpose(1, 2).float(), ids[:, 1:], reduction="none")  # (B, L-1)
    keep = target_mask[:, 1:].float()  # (B, L-1)
    return (nll * keep).sum() / keep.sum().clamp(min=1.0)


def _train_loop(
    *,
    model: PreTrainedModel,
    loss_fn: Callable[[float], torch.Tensor],
    lr: float,
    warmup_fraction: float,
    min_lr_ratio: float,
    steps: int,
    max_seconds: float | None,
    progress: Progress | None = None,
) -> tuple[list[float], int, float]:
    """AdamW with warm-up + cosine over the step/seconds budget; returns (losses, steps, seconds).
    ``progress(done, steps)`` follows every optimizer step."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    started = time.perf_counter()
    losses: list[float] = []
    step = 0
    while _budget_left(step, steps, started, max_seconds):
        fraction = _progress(step, steps, started, max_seconds)
        for group in optimizer.param_groups:
            group["lr"] = _cosine_lr(lr, fraction, warmup=warmup_fraction, floor=min_lr_ratio)
        loss = loss_fn(fraction)
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        step += 1
        if progress is not None:
            progress(step, steps)
    torch.nn.Module.eval(model)  # transformers leaves its eval() unannotated
    return losses, step, time.perf_counter() - started


def sft_warmstart(
    *,
    policy_path: Path,
    tokenizer_path: Path,
    train_path: Path,
    heldout_path: Path,
    out_path: Path,
    settings: SFTSettings,
    seed: int,
    progress: Progress | None = None,
) -> SFTReport:
    """Fine-tune the policy on careless-annotator answers; save it (and the tokenizer) to ``out_path``."""
    # 1. Load the policy the way a real checkpoint is loaded, and pre-tokenise the prompts.
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    model = LlamaForCausalLM.from_pretrained(policy_path)
    rows = read_prompt_rows(train_path)
    prompt_cache = {row.uid: render_prompt_ids(tokenizer, row.raw_prompt) for row in rows}
    rng = random.Random(seed)

    # 2. Each step: a batch of prompts, each with a freshly drawn careless answer (an answer's
    #    ids are tokenised once).
    ids_of = cached_answer_ids(tokenizer)

    def loss_fn(progress: float) -> torch.Tensor:
        batch = rng.choices(rows, k=settings.batch_size)
        answers = [
            careless_answer(r, rng, correct_fraction=settings.correct_fraction) for r in batch
        ]
        return response_nll(
            model,
            [prompt_cache[r.uid] for r in batch],
            [ids_of(a, True) for a in answers],
            tokenizer.pad_token_id,
        )

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
    # 3. Measure with the rule on held-out prompts, then save.
    heldout = read_prompt_rows(heldout_path)[: settings.eval_rows]
    accuracy = {
        greedy: evaluate_rule_accuracy(
            model=model,
            tokenizer=tokenizer,
            rows=heldout,
            greedy=greedy,
            max_new_tokens=settings.max_new_tokens,
            seed=seed,
        )
        for greedy in (True, False)
    }
    model.save_pretrained(out_path)
    tokenizer.save_pretrained(out_path)
    tail = losses[-max(len(losses) // 10, 1) :] if losses else [math.nan]
    return SFTReport(
        heldout_accuracy=accuracy[True],
        heldout_sampled_accuracy=accuracy[False],
        first_loss=losses[0] if losses else math.nan,
        last_loss=sum(tail) / len(tail),
        steps=steps,
        seconds=seconds,
    )


# --------------------------------------------------------------------------- reward model


@dataclass(frozen=True, kw_only=True)
class RewardModelSettings:
    """Reward-model budget, loss and the mix of rejected answers (the rest are synthetic wrong).
    Every field is required; ``from_config`` builds the run's."""

    steps: int
    max_seconds: float | None
    pairs_per_step: int
    lr: float
    warmup_fraction: float
    min_lr_ratio: float
    """Cosine decay ends at this fraction of ``lr``."""
    score_l2: float
    """Weight of mean r² next to the Bradley–Terry loss (keeps scores centred and bounded)."""
    sampled_fraction: float
    """Rejected answers sampled from the SFT policy (wrong by the rule)."""
    malformed_fraction: float
    samples_per_prompt: int
    """Policy samples drawn per prompt (once, before training) for the sampled rejections."""
    max_new_tokens: int
    eval_rejected_per_prompt: int
    """Held-out pairs per held-out prompt, drawn with the same mix."""

    @classmethod
    def from_config(cls, warmstart: WarmstartConfig) -> RewardModelSettings:
        """The budget of ``warmstart`` (``rm_steps``, ``rm_max_seconds``) with the recipe."""
        return cls(
            steps=warmstart.rm_steps,
            max_seconds=warmstart.rm_max_seconds,
            pairs_per_step=RM_PAIRS_PER_STEP,
            lr=RM_LR,
            warmup_fraction=RM_WARMUP_FRACTION,
            min_lr_ratio=RM_MIN_LR_RATIO,
            score_l2=RM_SCORE_L2,
            sampled_fraction=RM_SAMPLED_FRACTION,
            malformed_fraction=RM_MALFORMED_FRACTION,
            samples_per_prompt=RM_SAMPLES_PER_PROMPT,
            max_new_tokens=WARMSTART_MAX_NEW_TOKENS,
            eval_rejected_per_prompt=RM_EVAL_REJECTED_PER_PROMPT,
        )


def call_with_threads(threads: int, train: Callable[..., T], kwargs: dict[str, Any]) -> T:
    """``train(**kwargs)`` with ``threads`` torch threads: the entry point of a process that
    trains one model (an ensemble member) beside others."""
    torch.set_num_threads(threads)
    return train(**kwargs)


def member_seed(seed: int, member: int) -> int:
    """The seed of ensemble member ``member`` (member 0 trains with the run's seed)."""
    return seed + 1000 * member


@dataclass(frozen=True)
class RewardModelReport:
    heldout_pair_accuracy: float
    """Share of held-out pairs (held-out prompts only) where chosen scores above rejected."""
    heldout_pairs: int
    pair_accuracy_by_kind: dict[str, float]
    """Held-out pair accuracy per rejection kind: sampled, synthetic, malformed."""
    train_pair_accuracy: float
    """Mean over the last tenth of the steps."""
    last_loss: float
    steps: int
    seconds: float
    member: int = 0
    """Which member of an ensemble (0: the first, or the only model)."""
    seed: int = 0
    """The seed it trained with (``member_seed``)."""


@dataclass(frozen=True)
class _Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    kind: str


def _policy_rejections(
    policy_path: Path,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[PromptRow],
    settings: RewardModelSettings,
    seed: int,
) -> dict[str, list[list[int]]]:
    """Responses the SFT policy samples (T=1) that the rule marks wrong, by prompt uid."""
    policy = LlamaForCausalLM.from_pretrained(policy_path)
    n = settings.samples_per_prompt
    responses = sample_responses(
        policy,
        tokenizer,
        rows,
        n=n,
        greedy=False,
        max_new_tokens=settings.max_new_tokens,
        seed=seed,
        batch_size=max(1, 1024 // n),
    )
    pool: dict[str, list[list[int]]] = {row.uid: [] for row in rows}
    for index, resp in enumerate(responses):
        row = rows[index // n]
        if addition_rule(decode_response(tokenizer, resp), row.ground_truth) == 0.0:
            pool[row.uid].append(resp)
    return pool


def _make_pair(
    row: PromptRow,
    prompt: list[int],
    ids_of: AnswerIds,
    pool: dict[str, list[list[int]]],
    settings: RewardModelSettings,
    rng: random.Random,
) -> _Pair:
    """chosen = the right answer + EOS; rejected drawn from the settings' mix (the rule decides)."""
    chosen = ids_of(row.ground_truth, True)
    draw = rng.random()
    if draw < settings.sampled_fraction and pool.get(row.uid):
        return _Pair(prompt, chosen, rng.choice(pool[row.uid]), "sampled")
    if draw >= 1.0 - settings.malformed_fraction:
        text, eos = malformed_answer(row, rng)
        rejected = ids_of(text, eos)
        if rejected and rejected != chosen:
            return _Pair(prompt, chosen, rejected, "malformed")
    return _Pair(prompt, chosen, ids_of(near_miss_answer(row, rng), True), "synthetic")


def _pair_scores(
    model: PreTrainedModel, pairs: Sequence[_Pair], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (chosen (N,), rejected (N,)) in one forward pass over the 2N sequences."""
    seqs = [[*p.prompt, *p.chosen] for p in pairs] + [[*p.prompt, *p.rejected] for p in pairs]
    ids, lengths = pad_right(seqs, pad_id)  # (2N, L)
    scores = last_token_scores(model, ids, lengths)  # (2N,)
    return scores[: len(pairs)], scores[len(pairs) :]


@torch.no_grad()
def _heldout_pair_accuracy(
    model: PreTrainedModel, pairs: Sequence[_Pair], pad_id: int
) -> tuple[float, dict[str, float]]:
    wins: list[bool] = []
    for start in range(0, len(pairs), 512):
        chosen, rejected = _pair_scores(model, pairs[start : start + 512], pad_id)
        wins.extend((chosen > rejected).tolist())
    by_kind: dict[str, list[bool]] = {}
    for pair, win in zip(pairs, wins):
        by_kind.setdefault(pair.kind, []).append(win)
    overall = sum(wins) / max(len(wins), 1)
    return overall, {kind: sum(w) / len(w) for kind, w in sorted(by_kind.items())}


def train_reward_model(
    *,
    init_path: Path,
    tokenizer_path: Path,
    train_path: Path,
    heldout_path: Path,
    out_path: Path,
    settings: RewardModelSettings,
    seed: int,
    member: int = 0,
    progress: Progress | None = None,
) -> RewardModelReport:
    """Train a scalar reward model from rule-derived pairs, starting from the SFT policy at ``init_path``.

    Saves a ``LlamaForSequenceClassification`` (num_labels=1, pad id set) and the tokenizer to
    ``out_path``. Held-out pairs use held-out prompts only, with policy samples of their own,
    drawn from ``seed`` whatever the ``member``; the training draws from ``member_seed``.
    """
    # 1. Prompts, and the SFT policy's own wrong answers for the sampled rejections.
    own_seed = member_seed(seed, member)
    torch.manual_seed(own_seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    train_rows, heldout_rows = read_prompt_rows(train_path), read_prompt_rows(heldout_path)
    prompts = {
        r.uid: render_prompt_ids(tokenizer, r.raw_prompt) for r in [*train_rows, *heldout_rows]
    }
    train_pool = _policy_rejections(init_path, tokenizer, train_rows, settings, own_seed)
    heldout_pool = _policy_rejections(init_path, tokenizer, heldout_rows, settings, seed + 1)
    ids_of = cached_answer_ids(tokenizer)
    eval_rng = random.Random(seed + 1)
    heldout_pairs = [
        _make_pair(row, prompts[row.uid], ids_of, heldout_pool, settings, eval_rng)
        for row in heldout_rows
        for _ in range(settings.eval_rejected_per_prompt)
    ]
    # 2. The reward model: the SFT causal LM's body with a new scalar score head.
    model = LlamaForSequenceClassification.from_pretrained(
        init_path, num_labels=1, pad_token_id=tokenizer.pad_token_id
    )
    rng = random.Random(own_seed)
    train_wins: list[float] = []

    def loss_fn(progress: float) -> torch.Tensor:
        batch = [
            _make_pair(row, prompts[row.uid], ids_of, train_pool, settings, rng)
            for row in rng.choices(train_rows, k=settings.pairs_per_step)
        ]
        chosen, rejected = _pair_scores(model, batch, tokenizer.pad_token_id)  # (N,), (N,)
        train_wins.append(float((chosen > rejected).float().mean()))
        bradley_terry = -F.logsigmoid(chosen - rejected).mean()
        return bradley_terry + settings.score_l2 * torch.cat([chosen, rejected]).pow(2).mean()

    # 3. Train, measure on held-out pairs, save.
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
    accuracy, by_kind = _heldout_pair_accuracy(model, heldout_pairs, tokenizer.pad_token_id)
    model.save_pretrained(out_path)
    tokenizer.save_pretrained(out_path)
    tail = max(len(losses) // 10, 1)
    return RewardModelReport(
        heldout_pair_accuracy=accuracy,
        heldout_pairs=len(heldout_pairs),
        pair_accuracy_by_kind=by_kind,
        train_pair_accuracy=sum(train_wins[-tail:]) / max(len(train_wins[-tail:]), 1),
        last_loss=sum(losses[-tail:]) / max(len(losses[-tail:]), 1),
        steps=steps,
        seconds=seconds,
        member=member,
        seed=own_seed,
    )


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> None:
    """Build the tiny assets under ROOT, warm-start the policy and train the reward model with
    the main job's budgets (the default config's ``warmstart``)."""
    import argparse
    import json

    from infra.assets import build_tiny_assets
    from infra.config import load_config

    parser = argparse.ArgumentParser(prog="python -m infra.pretrain", description=main.__doc__)
    parser.add_argument("root", type=Path, help="folder for assets/, sft/ and reward_model/")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    assets = build_tiny_assets(args.root / "assets", seed=args.seed)
    warmstart = load_config().warmstart
    sft = sft_warmstart(
        policy_path=assets.policy,
        tokenizer_path=assets.tokenizer,
        train_path=assets.train_data,
        heldout_path=assets.heldout_data,
        out_path=args.root / "sft",
        settings=SFTSettings.from_config(warmstart),
        seed=args.seed,
    )
    print(json.dumps({"sft": asdict(sft)}), flush=True)
    rm = train_reward_model(
        init_path=args.root / "sft",
        tokenizer_path=assets.tokenizer,
        train_path=assets.train_data,
        heldout_path=assets.heldout_data,
        out_path=args.root / "reward_model",
        settings=RewardModelSettings.from_config(warmstart),
        seed=args.seed,
    )
    print(json.dumps({"reward_model": asdict(rm)}), flush=True)


if __name__ == "__main__":
    main()
