"""TRL GRPOTrainer on the pipeline benchmark's work; prints one JSON line on stdout.

Runs inside ``benchmarks/.venvs/trl-1.16.0`` (built by ``benchmarks/pipeline.py``)::

    benchmarks/.venvs/trl-1.16.0/bin/python benchmarks/peers/trl_grpo.py --work DIR --out DIR

The policy, reward model and tokenizer are loaded from ``DIR/policy`` and ``DIR/reward_model``
(``DIR/varlen/...`` with ``--variable-length``) and passed to the trainer as objects. Settings
matched to ppoflow: ``--completions`` per step in groups of ``--group-size`` (16 = 4 x 4 by
default), exactly ``--response-tokens`` new tokens (``min_new_tokens`` =
``max_completion_length``; with ``--variable-length`` responses end at EOS and that is only the
cap), one optimizer step per batch (the whole batch generated in one ``generate`` call, as
``generation_batch_size`` = batch x ``steps_per_generation`` 1, and trained in one
forward/backward, no accumulation, one iteration), no reference (beta 0), the same lr, temperature 1, top_p 1, no top-k, no
gradient checkpointing (TRL's default is on), fp32, no logging integrations. Prompts are
``"ab+cd="`` additions, or the rows of ``--prompts`` in file order (no shuffling).

With ``--use-vllm`` TRL generates with vLLM (``use_vllm=True, vllm_mode="colocate"``: the
engine in the trainer's process, its KV cache ``vllm_gpu_memory_utilization`` of host memory on
the CPU) and syncs the policy's weights into it every step; the tokens are then counted from
the completion mask ``_generate_and_score_completions`` returns (the policy's ``generate`` is
not called).

Where a step's time goes (``phases_s`` in the JSON line, per timed step): ``generate`` (the
policy's ``generate`` call), ``score`` (``_calculate_rewards``: the reward model), ``rollout``
(all of ``_generate_and_score_completions``: generate, score, tokenising, padding,
advantages), ``loss_forward`` (``compute_loss``) and ``training_step`` (rollout, loss forward
and backward); the rest of a step is the optimizer step, the callbacks and logging.
"""

from __future__ import annotations

import time
from typing import Any

from common import (
    Phases,
    StepClock,
    TokenCounter,
    addition_messages,
    parse_args,
    prompt_file_messages,
    report,
)
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer


class CompletionCounter:
    """``TokenCounter``'s records from the completion mask of each
    ``_generate_and_score_completions`` call (up to and including the first EOS)."""

    def __init__(self, trainer: Any) -> None:
        self.calls: list[dict[str, Any]] = []
        self._inner = trainer._generate_and_score_completions
        trainer._generate_and_score_completions = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = self._inner(*args, **kwargs)
        mask = out["completion_mask"]  # (B, T)
        lengths = mask.sum(-1)  # (B,)
        self.calls.append(
            {
                "rows": int(mask.shape[0]),
                "prompt_width": int(out["prompt_ids"].shape[1]),
                "tokens": int(lengths.sum()),
                "lengths": [int(n) for n in lengths.tolist()],
                "decoded_width": int(mask.shape[1]),
                "seconds": time.perf_counter() - start,
            }
        )
        return out


def main() -> None:
    started = time.perf_counter()
    args = parse_args(__doc__.splitlines()[0])
    total = args.warmup + args.steps
    models = f"{args.work}/varlen" if args.variable_length else args.work
    tokenizer = AutoTokenizer.from_pretrained(f"{models}/policy")
    policy = AutoModelForCausalLM.from_pretrained(f"{models}/policy")
    reward_model = AutoModelForSequenceClassification.from_pretrained(f"{models}/reward_model")
    reward_tokenizer = AutoTokenizer.from_pretrained(f"{models}/reward_model")
    prompts = args.completions // args.group_size
    count = prompts * total * 4
    messages = (
        prompt_file_messages(args.prompts, count) if args.prompts else addition_messages(count)
    )
    dataset = Dataset.from_dict({"prompt": messages})
    fixed = {} if args.variable_length else {"min_new_tokens": args.response_tokens}
    settings = {
        "per_device_train_batch_size": args.completions,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "num_generations": args.group_size,
        "max_completion_length": args.response_tokens,
        "generation_kwargs": fixed or None,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
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
        "shuffle_dataset": not args.prompts,
    }
    if args.use_vllm:
        settings |= {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": 0.05,
            "vllm_enable_sleep_mode": False,
        }
    config = GRPOConfig(output_dir=args.out, **settings)
    phases = Phases()
    clock = StepClock(phases)
    counter: Any = None
    if not args.use_vllm:
        counter = TokenCounter(policy, eos_id=tokenizer.eos_token_id)
        phases.wrap(policy, "generate", "generate")
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=reward_model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        reward_processing_classes=reward_tokenizer,
        callbacks=[clock],
    )
    phases.wrap(trainer, "_generate_and_score_completions", "rollout")
    phases.wrap(trainer, "_calculate_rewards", "score")
    phases.wrap(trainer, "compute_loss", "loss_forward")
    phases.wrap(trainer, "training_step", "training_step")
    if args.use_vllm:
        counter = CompletionCounter(trainer)
    trainer.train()
    report(
        system="trl GRPOTrainer" + (" + vLLM (colocate)" if args.use_vllm else ""),
        clock=clock,
        counter=counter,
        warmup=args.warmup,
        steps=args.steps,
        settings=settings,
        started=started,
    )


if __name__ == "__main__":
    main()
