"""TRL PPOTrainer (``trl.experimental.ppo``) on the pipeline benchmark's work; prints one JSON line.

Runs inside ``benchmarks/.venvs/trl-1.12.0`` (the last TRL release with PPO), built by
``benchmarks/pipeline.py``::

    benchmarks/.venvs/trl-1.12.0/bin/python benchmarks/peers/trl_ppo.py --work DIR --out DIR

Models are loaded from ``DIR`` and passed as objects: the policy, a separate reference copy, a
value model of the policy's size (the policy folder loaded as a sequence classifier with one
label, as ppoflow's critic is the policy with a value head) and the reward model. Settings
matched to ppoflow: 16 prompts x 1 completion per step, exactly 64 new tokens (PPOTrainer has no
``min_new_tokens`` setting: it is injected into the policy's ``generate`` calls), one PPO epoch,
one mini-batch, no accumulation (one optimizer step per batch), k1 KL penalty 0.05 in the
reward, GAE lambda 0.95, temperature 1, the same lr, no gradient checkpointing (TRL's default
is on), fp32, no sample generations, no logging integrations.
"""

from __future__ import annotations

import time

from common import StepClock, TokenCounter, addition_messages, parse_args, report
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl.experimental.ppo import PPOConfig, PPOTrainer


def main() -> None:
    started = time.perf_counter()
    args = parse_args(__doc__.splitlines()[0])
    total = args.warmup + args.steps
    tokenizer = AutoTokenizer.from_pretrained(f"{args.work}/policy")
    policy = AutoModelForCausalLM.from_pretrained(f"{args.work}/policy")
    reference = AutoModelForCausalLM.from_pretrained(f"{args.work}/policy")
    value_model = AutoModelForSequenceClassification.from_pretrained(
        f"{args.work}/policy", num_labels=1
    )
    reward_model = AutoModelForSequenceClassification.from_pretrained(f"{args.work}/reward_model")
    input_ids = [
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for messages in addition_messages(args.completions * total * 2)
    ]
    dataset = Dataset.from_dict({"input_ids": input_ids})
    settings = {
        "per_device_train_batch_size": args.completions,
        "gradient_accumulation_steps": 1,
        "num_mini_batches": 1,
        "num_ppo_epochs": 1,
        "total_episodes": args.completions * total,
        "local_rollout_forward_batch_size": args.completions,
        "response_length": args.response_tokens,
        "stop_token": "eos",
        "temperature": 1.0,
        "kl_coef": args.kl_coef,
        "kl_estimator": "k1",
        "gamma": 1.0,
        "lam": args.lam,
        "learning_rate": args.lr,
        "num_sample_generations": 0,
        "gradient_checkpointing": False,
        "bf16": False,
        "use_cpu": True,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    config = PPOConfig(output_dir=args.out, **settings)
    clock = StepClock()
    counter = TokenCounter(
        policy, eos_id=tokenizer.eos_token_id, min_new_tokens=args.response_tokens
    )
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=reference,
        reward_model=reward_model,
        train_dataset=dataset,
        value_model=value_model,
        callbacks=[clock],
    )
    trainer.train()
    report(
        system="trl PPOTrainer",
        clock=clock,
        counter=counter,
        warmup=args.warmup,
        steps=args.steps,
        settings={**settings, "min_new_tokens (injected)": args.response_tokens},
        started=started,
    )


if __name__ == "__main__":
    main()
