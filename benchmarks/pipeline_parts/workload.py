"""The shared work of the pipeline benchmark: its sizes (``Work``), the character tokenizer, the
policy and reward model saved for every system, the ppoflow config built from them, and the
description of each mode written into the report."""

from __future__ import annotations

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


def build_tokenizer() -> Any:
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
        model_max_length=128,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_work(out: Path) -> dict[str, Any]:
    """Save tokenizer + policy to ``out/policy`` and tokenizer + reward model to
    ``out/reward_model``; return parameter counts and the checked prompt length."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    tokenizer = build_tokenizer()
    ids = dict(
        vocab_size=len(tokenizer),
        n_positions=128,
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


def ppoflow_config(
    mode: str,
    work: Path,
    run_dir: Path,
    *,
    total_steps: int,
    threads: int,
    extra: Sequence[str] = (),
) -> Any:
    from infra.config import load_config

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
            f"name=bench-{mode}",
            f"seed={WORK.seed}",
            f"run_dir={run_dir}",
            f"models.assets_dir={work / 'tiny-assets'}",
            f"models.policy={work / 'policy'}",
            f"models.tokenizer={work / 'policy'}",
            f"models.reward_model={work / 'reward_model'}",
            "warmstart.enabled=false",
            f"rollout.prompts_per_step={prompts}",
            f"rollout.n={n}",
            f"rollout.max_new_tokens={WORK.response_tokens}",
            f"rollout.min_new_tokens={WORK.response_tokens}",
            *algorithm,
            *[f"actor.{o}" for o in optim],
            *[f"critic.{o}" for o in optim],
            f"resources.threads_per_worker={threads}",
            f"trainer.total_steps={total_steps}",
            "trainer.eval_every=1000000",
            "trainer.eval_prompts=1",
            "trainer.checkpoint_every=1000000",
            "trainer.resume=never",
            "trainer.progress_bar=false",
            *extra,
        ],
    )


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
}
