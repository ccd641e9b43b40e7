"""The PPO training flow: ``ppo_train(config)``.

1. Check the inputs (model folders, datasets, reward functions) and the run folder (a run_dir
   holding a run with other settings is refused; ``flows.run_record``); resolve the models (on the
   built-in task the reward-model subflow builds tiny assets, warm-starts the policy and trains
   a reward model); render every prompt (``data.max_prompt_length``) — all before any resource.
2. Start/attach Ray, reserve resource pools, start the workers (all models asleep), open the store.
3. Run the iterations (flows.loop): one Prefect task per stage per step, checkpoints, metrics.
4. Write the reward/KL plot and the summary artifact; release every resource.

Run it with ``ppoflow train`` (CLI), as a Prefect deployment (flows.deploy), or call it.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from transformers import AutoTokenizer

from flows import stopping
from flows.deploy import effective_config, flow_run_name
from flows.inputs import Datasets, check_inputs, check_teacher_vocabulary, load_datasets
from flows.loop import RunResult, Trainer
from flows.plot import plot_run
from flows.reward_model import ResolvedModels, reward_model_flow
from flows.run_record import check_run_dir, check_warm_start, write_record
from flows.runtime import build_runtime
from flows.teacher import with_teacher
from infra.config import TrainConfig
from infra.reward_model import reward_model_paths


@flow(name="ppo-train", log_prints=True, flow_run_name=flow_run_name)
def ppo_train(config: TrainConfig = TrainConfig()) -> dict[str, Any]:  # noqa: B008 - the form's default
    """Train a policy with PPO-family RL from a (colocated) reward model and/or reward functions."""
    cfg = effective_config(config)  # a deployment run: laid over its preset
    # `ppoflow train`: its signal handlers in place of the ones Prefect's engine set for the run.
    with stopping.signals(cfg.trainer.stop_grace_s):
        return _train(cfg)


def _train(cfg: TrainConfig) -> dict[str, Any]:
    logger = get_run_logger()
    run_dir = cfg.resolved_run_dir
    # 1. Inputs; the run folder (refused, or moved aside: flows.run_record) and its record;
    # models, prompts.
    check_inputs(cfg)
    aside = check_run_dir(cfg)
    if aside is not None:
        logger.info("trainer.resume=never: the run that was in %s is now in %s", run_dir, aside)
    check_warm_start(cfg)
    write_record(cfg)
    models = with_teacher(cfg, reward_model_flow(cfg), ppo_train)
    if models.teacher is not None:  # the built-in task's tokenizer exists from here on
        check_teacher_vocabulary(models.teacher, models.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(models.tokenizer)
    datasets = load_datasets(cfg, models, tokenizer)
    changed = {
        k: int(v) for k, v in datasets.notes.items() if k.endswith(("_truncated", "_dropped"))
    }
    if any(changed.values()):
        logger.warning(
            "prompts over data.max_prompt_length (data.truncation=%s): %s",
            cfg.data.truncation,
            changed,
        )
    # 2. Compute and store.
    rt = build_runtime(cfg, models)
    try:
        # 3. Iterations.
        result = Trainer(cfg, rt, models, run_dir, datasets, tokenizer).run()
    finally:
        rt.shutdown()
    # 4. Plot and summary.
    summary = _summarise(cfg, result, models, datasets)
    logger.info("run finished: %s", summary)
    return summary


def _summarise(
    cfg: TrainConfig, result: RunResult, models: ResolvedModels, datasets: Datasets
) -> dict[str, Any]:
    """The run's curves and summary (``summary.md`` and its artifact), and what the flow
    returns: the steps run, the rule's and validation's first and last values, the reward
    models' pair accuracies, the last checkpoint and the plot."""
    run_dir = cfg.resolved_run_dir
    report = result.report
    plot = plot_run(run_dir) if report.rows else None
    extra = {
        "mode": cfg.resources.mode,
        "estimator": cfg.algorithm.estimator,
        "SFT held-out accuracy": models.sft_accuracy,
        "RM held-out pair accuracy": (
            ", ".join(f"{a:.3f}" for a in models.rm_pair_accuracies) or None
        ),
        "reward model": ", ".join(reward_model_paths(models.reward_model)) or "none",
        "reward functions": ", ".join(f.label for f in cfg.reward.functions) or "none",
        **{k: int(v) for k, v in datasets.notes.items()},
    }
    report.summary(plot=plot, checkpoint=result.checkpoint, extra=extra)
    evals = [r["eval/rule_accuracy"] for r in report.rows if "eval/rule_accuracy" in r]
    validation: dict[str, list[float]] = {}
    for row in report.rows:
        for key, value in row.items():
            if key.startswith("val-core/"):
                validation.setdefault(key, []).append(value)
    summary = {
        "run_dir": str(run_dir),
        "steps": len(report.rows),
        "first_step": result.first_step,
        "last_step": result.last_step,
        "rule_accuracy_start": evals[0] if evals else None,
        "rule_accuracy_end": evals[-1] if evals else None,
        "rm_pair_accuracy": models.rm_pair_accuracy,
        "rm_pair_accuracies": list(models.rm_pair_accuracies),
        "validation": {k: {"first": v[0], "last": v[-1]} for k, v in validation.items()},
        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
        "plot": str(plot) if plot else None,
    }
    return summary
