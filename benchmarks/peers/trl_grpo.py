"""TRL GRPOTrainer on the pipeline benchmark's work; prints one JSON line on stdout.

Runs inside ``benchmarks/.venvs/trl-1.16.0`` (built by ``benchmarks/pipeline.py``)::

    benchmarks/.venvs/trl-1.16.0/bin/python benchmarks/peers/trl_grpo.py --work DIR --out DIR

The policy, reward model and tokenizer are loaded from ``DIR/policy`` and ``DIR/reward_model``
and passed to the trainer as objects. Settings matched to ppoflow: 16 completions per step
(4 prompts x 4), exactly 64 new tokens (``min_new_tokens`` = ``max_completion_length``), one
optimizer step per batch (batch 16, no accumulation, one iteration), no reference (beta 0),
the same lr, temperature 1, no gradient checkpointing (TRL's default is on), fp32, no logging
integrations.
"""

from __future__ import annotations

import time

from common import StepClock, TokenCounter, addition_messages, parse_args, report
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer


def main() -> None:
    started = time.perf_counter()
    args = parse_args(__doc__.splitlines()[0])
    total = args.warmup + args.steps
    tokenizer = AutoTokenizer.from_pretrained(f"{args.work}/policy")
    policy = AutoModelForCausalLM.from_pretrained(f"{args.work}/policy")
    reward_model = AutoModelForSequenceClassification.from_pretrained(f"{args.work}/reward_model")
    reward_tokenizer = AutoTokenizer.from_pretrained(f"{args.work}/reward_model")
    prompts = args.completions // args.group_size
    dataset = Dataset.from_dict({"prompt": addition_messages(prompts * total * 4)})
    settings = {
        "per_device_train_batch_size": args.completions,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "num_generations": args.group_size,
        "max_completion_length": args.response_tokens,
        "generation_kwargs": {"min_new_tokens": args.response_tokens},
        "temperature": 1.0,
        "top_p": 1.0,
        "beta": 0.0,
        "learning_rate": args.lr,
        "gradient_checkpointing": False,
        "bf16": False,
        "use_cpu": True,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "max_steps": total,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    config = GRPOConfig(output_dir=args.out, **settings)
    clock = StepClock()
    counter = TokenCounter(policy, eos_id=tokenizer.eos_token_id)
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=reward_model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        reward_processing_classes=reward_tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    report(
        system="trl GRPOTrainer",
        clock=clock,
        counter=counter,
        warmup=args.warmup,
        steps=args.steps,
        settings=settings,
        started=started,
    )


if __name__ == "__main__":
    main()
