"""The shared work of the pipeline benchmark: its sizes (``Work``; ``VarlenWork`` for the
variable-length mode), the character tokenizer, the policy and reward model saved for every
system, the ppoflow config built from them, and the description of each mode written into the
report."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Work:
    """The shared work (see ``benchmarks/pipeline.py``'s docstring)."""

    prompt_tokens: int = 27
    response_tokens: int = 64
    completions: int = 16
    group_size: int = 4
    lr: float = 1e-4
    kl_coef: float = 0.05
    lam: float = 0.95
    vocab: int = 56
    seed: int = 0


WORK = Work()


@dataclass(frozen=True)
class VarlenWork:
    """The variable-length mode (``grpo-varlen``): responses stop at EOS, whose probability the
    saved policy fixes at ``eos_prob`` per token (lengths geometric, capped at
    ``max_new_tokens``); GRPO groups of ``group_size``; the same prompt file for every system."""

    prompts_per_step: int = 4
    group_size: int = 8
    max_new_tokens: int = 256
    eos_prob: float = 0.01
    n_positions: int = 512
    token_budget: int = 4096  # ppoflow's actor/logprobs max_tokens_per_micro_batch
    reward_token_budget: int = 1024  # ppoflow's reward.max_tokens_per_batch
    max_prompt_length: int = 64
    prompt_rows: int = 512
    lr: float = 1e-4
    seed: int = 0

    @property
    def completions(self) -> int:
        return self.prompts_per_step * self.group_size


VARLEN = VarlenWork()
VARLEN_MODES = ("grpo-varlen",)

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>")
CHARACTERS = tuple("0123456789abcdefghijklmnopqrstuvwxyz") + tuple(" +-=?:.,!'()*/")
# <bos> <|user|> + 18 characters + "ab+cd=" + <|assistant|> = 27 tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>please add these: {{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(model_max_length: int = 128) -> Any:
    """Character-level WordLevel tokenizer, 56 tokens, pad != eos, with the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIALS, *CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        extra_special_tokens=list(SPECIALS[4:]),
        padding_side="right",
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_models(tokenizer: Any, n_positions: int) -> tuple[Any, Any]:
    """The policy (GPT-2, 4 x 256) and the reward model (GPT-2, 4 x 128), each seeded."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    ids = dict(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_head=4,
        n_layer=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(WORK.seed)
    policy = GPT2LMHeadModel(GPT2Config(n_embd=256, **ids))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(policy.generation_config, key, ids[key])
    torch.manual_seed(WORK.seed + 1)
    reward = GPT2ForSequenceClassification(GPT2Config(n_embd=128, num_labels=1, **ids))
    return policy, reward


def _save(out: Path, tokenizer: Any, policy: Any, reward: Any) -> dict[str, Any]:
    for name, model in (("policy", policy), ("reward_model", reward)):
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+34="}], add_generation_prompt=True, return_dict=False
    )
    if len(prompt) != WORK.prompt_tokens or len(tokenizer) != WORK.vocab:
        raise RuntimeError(f"prompt has {len(prompt)} tokens, vocabulary {len(tokenizer)}")
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return {"policy_params": count(policy), "reward_model_params": count(reward)}


def build_work(out: Path) -> dict[str, Any]:
    """Save tokenizer + policy to ``out/policy`` and tokenizer + reward model to
    ``out/reward_model``; return parameter counts and the checked prompt length."""
    tokenizer = build_tokenizer()
    policy, reward = _build_models(tokenizer, n_positions=128)
    return _save(out, tokenizer, policy, reward)


def set_eos_probability(
    policy: Any, tokenizer: Any, eos_prob: float, *, seed: int
) -> dict[str, Any]:
    """Give ``policy`` a fixed per-token EOS probability of about ``eos_prob``, in place.

    GPT-2's head has no bias and is tied to the token embeddings, so a constant EOS logit is
    made from one hidden dimension: the final layer norm's gain on dimension 0 is set to 0 and
    its bias to 1 (that coordinate is 1 at every position), every token's embedding loses
    dimension 0, and the EOS row becomes ``c * e_0`` (its logit is ``c`` everywhere). ``c`` is
    the log-sum-exp of the other logits, measured on random character sequences, plus
    ``log(eos_prob / (1 - eos_prob))``. Returns ``c`` and the measured EOS probability."""
    import torch

    eos = tokenizer.eos_token_id
    with torch.no_grad():
        wte = policy.transformer.wte.weight  # (V, D), tied to lm_head
        policy.transformer.ln_f.weight[0] = 0.0
        policy.transformer.ln_f.bias[0] = 1.0
        wte[:, 0] = 0.0
        wte[eos] = 0.0
        first_character = len(SPECIALS)
        generator = torch.Generator().manual_seed(seed)
        sample = torch.randint(
            first_character, len(tokenizer), (16, VARLEN.max_new_tokens), generator=generator
        )
        policy.eval()
        logits = policy(input_ids=sample).logits  # (16, T, V)
        others = torch.cat([logits[..., :eos], logits[..., eos + 1 :]], dim=-1)
        lse = float(others.logsumexp(-1).median())
        logit = lse + float(torch.log(torch.tensor(eos_prob / (1 - eos_prob))))
        wte[eos, 0] = logit
        measured = policy(input_ids=sample).logits.softmax(-1)[..., eos]  # (16, T)
    return {
        "eos_logit": round(logit, 4),
        "eos_prob_target": eos_prob,
        "eos_prob_measured_mean": round(float(measured.mean()), 5),
        "eos_prob_measured_min_max": [
            round(float(measured.min()), 5),
            round(float(measured.max()), 5),
        ],
    }


def build_varlen_work(out: Path) -> dict[str, Any]:
    """The variable-length mode's work under ``out``: ``policy`` (EOS at ``VARLEN.eos_prob``
    per token, see ``set_eos_probability``), ``reward_model`` (both with 512 positions) and
    ``prompts.jsonl`` (verl's layout, addition prompts in file order, read by every system)."""
    import json
    import random

    tokenizer = build_tokenizer(model_max_length=VARLEN.n_positions)
    policy, reward = _build_models(tokenizer, n_positions=VARLEN.n_positions)
    eos = set_eos_probability(policy, tokenizer, VARLEN.eos_prob, seed=VARLEN.seed)
    params = _save(out, tokenizer, policy, reward)
    rng = random.Random(VARLEN.seed)
    with (out / "prompts.jsonl").open("w") as f:
        for _ in range(VARLEN.prompt_rows):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            row = {
                "data_source": "addition",
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "reward_model": {"ground_truth": str(a + b)},
            }
            f.write(json.dumps(row) + "\n")
    return {**params, **eos}


def ppoflow_config(
    mode: str,
    work: Path,
    run_dir: Path,
    *,
    total_steps: int,
    threads: int,
    extra: Sequence[str] = (),
) -> Any:
    """The config of one measured ppoflow run in ``run_dir``. A measured run keeps nothing:
    ``run_dir`` is emptied first, so ``trainer.resume=never`` finds no earlier run to move aside
    (no ``<run_dir>.old-N`` folders pile up across repeats)."""
    from infra.config import load_config

    shutil.rmtree(run_dir, ignore_errors=True)
    if mode in VARLEN_MODES:
        return load_config(
            None, [*_varlen_overrides(work), *_common(mode, run_dir, total_steps, threads), *extra]
        )
    prompts, n = (WORK.completions // WORK.group_size, WORK.group_size)
    algorithm = ["algorithm.estimator=grpo", "algorithm.kl.monitor=false"]  # TRL: no reference
    if mode == "ppo":
        prompts, n = WORK.completions, 1
        algorithm = [
            "algorithm.estimator=gae",
            f"algorithm.lam={WORK.lam}",
            "algorithm.kl.in_reward=true",
            "algorithm.kl.kind=k1",
            f"algorithm.kl.coef={WORK.kl_coef}",
        ]
    batch = [f"mini_batch_size={WORK.completions}", f"micro_batch_size={WORK.completions}"]
    optim = [f"lr={WORK.lr}", "ppo_epochs=1", *batch]
    return load_config(
        None,
        [
            f"models.assets_dir={work / 'tiny-assets'}",
            f"models.policy={work / 'policy'}",
            f"models.tokenizer={work / 'policy'}",
            f"models.reward_model={work / 'reward_model'}",
            f"rollout.prompts_per_step={prompts}",
            f"rollout.n={n}",
            f"rollout.max_new_tokens={WORK.response_tokens}",
            f"rollout.min_new_tokens={WORK.response_tokens}",
            *algorithm,
            *[f"actor.{o}" for o in optim],
            *[f"critic.{o}" for o in optim],
            *_common(mode, run_dir, total_steps, threads),
            *extra,
        ],
    )


def _common(mode: str, run_dir: Path, total_steps: int, threads: int) -> list[str]:
    """The overrides every mode shares: names, no warm start, threads, no eval/checkpoints."""
    return [
        f"name=bench-{mode}",
        f"seed={WORK.seed}",
        f"run_dir={run_dir}",
        "warmstart.enabled=false",
        f"resources.threads_per_worker={threads}",
        f"trainer.total_steps={total_steps}",
        "trainer.eval_every=1000000",
        "trainer.eval_prompts=1",
        "trainer.checkpoint_every=1000000",
        "trainer.resume=never",
        "trainer.progress_bar=false",
    ]


def _varlen_overrides(work: Path) -> list[str]:
    """``grpo-varlen``: the EOS-biased policy, the shared prompt file in file order, responses
    up to ``VARLEN.max_new_tokens`` ending at EOS, groups of ``VARLEN.group_size``, one
    optimizer step per batch, token-budget micro-batches for the update and forward passes, the
    update's rows laid end to end without padding (``actor.padding_free``), reward-model
    batches under a token budget of their own (``reward.max_tokens_per_batch``)."""
    root = work / "varlen"
    v = VARLEN
    optim = [
        f"lr={v.lr}",
        "ppo_epochs=1",
        f"mini_batch_size={v.completions}",
        f"micro_batch_size={v.completions}",
        f"max_tokens_per_micro_batch={v.token_budget}",
    ]
    return [
        f"models.assets_dir={work / 'tiny-assets'}",
        f"models.policy={root / 'policy'}",
        f"models.tokenizer={root / 'policy'}",
        f"models.reward_model={root / 'reward_model'}",
        f"data.train_files=[{root / 'prompts.jsonl'}]",
        "data.shuffle=false",
        f"data.max_prompt_length={v.max_prompt_length}",
        f"rollout.prompts_per_step={v.prompts_per_step}",
        f"rollout.n={v.group_size}",
        f"rollout.max_new_tokens={v.max_new_tokens}",
        "rollout.min_new_tokens=0",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "algorithm.estimator=grpo",
        "algorithm.kl.monitor=false",  # TRL: beta 0, no reference
        *[f"actor.{o}" for o in optim],
        "actor.padding_free=true",
        f"logprobs.max_tokens_per_micro_batch={v.token_budget}",
        f"reward.max_tokens_per_batch={v.reward_token_budget}",
    ]


def resolved_models(cfg: Any) -> Any:
    from dataclasses import asdict

    from flows.reward_model import resolve_models
    from infra.assets import build_tiny_assets

    assets = build_tiny_assets(cfg.models.assets_dir, seed=cfg.seed)  # the prompt data
    return resolve_models(cfg, {k: str(v) for k, v in asdict(assets).items()})


MODES = {
    "grpo": "4 prompts x 4 samples (groups of 4); ppoflow algorithm.estimator=grpo; TRL "
    "GRPOTrainer with the reward model, beta 0 (no reference)",
    "ppo": "16 prompts x 1 sample; ppoflow algorithm.estimator=gae with kl.in_reward (k1, 0.05, "
    "reference model); TRL PPOTrainer (policy, reference, value model of the policy's size, "
    "reward model)",
    "grpo-varlen": f"{VARLEN.prompts_per_step} prompts x {VARLEN.group_size} samples (groups of "
    f"{VARLEN.group_size}), responses ending at EOS (P(EOS) ~ {VARLEN.eos_prob} per token set in "
    f"the saved policy, at most {VARLEN.max_new_tokens} tokens, temperature 1, top_p 1), the same "
    "prompt file in file order; ppoflow algorithm.estimator=grpo with token-budget micro-batches "
    f"({VARLEN.token_budget} tokens), the update's rows end to end without padding, reward-model "
    f"batches of at most {VARLEN.reward_token_budget} padded tokens; TRL GRPOTrainer with the reward model, beta 0; each run "
    "alone (ppoflow flow@all and flow-async, TRL at all threads and at --threads)",
}
