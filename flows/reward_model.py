"""The reward-model flow: tiny assets → supervised warm start of the policy → a reward model (or
``warmstart.rm_ensemble`` of them, each with its own seed and data order) trained on preference
pairs derived from the rule, reporting each one's held-out pair accuracy.

Outputs land in ``<run_dir>/warmstart/{sft,reward_model}`` (ensemble members after the first in
``reward_model_<k>``), with the warm start's numbers in ``<run_dir>/warmstart/report.json``; a
finished stage is not redone, so a resumed or re-scheduled run reuses them, and only when the
settings recorded beside it (``settings.json``, ``flows.run_record``) are the run's. The warm
start belongs to the built-in addition task (``TrainConfig.warm_start``): a user's policy or
dataset never goes through it, and
``resolve_models`` then only fills in the defaults (reference = policy, tokenizer = the policy's).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows.progress import LINE_INTERVAL_S, phase_progress
from flows.run_record import check_part, record_part, reward_model_settings, sft_settings
from infra.config import TrainConfig
from infra.progress import LineProgress


@dataclass(frozen=True)
class ResolvedModels:
    """Concrete model folders for a training run (``reward_model`` None: no reward model, a tuple:
    an ensemble; ``judge`` None: no LLM judge).

    ``train_data`` / ``heldout_data`` are the built-in task's prompt files (None with
    ``data.train_files``). ``rm_pair_accuracies``: each trained reward model's held-out pair
    accuracy, ``rm_pair_accuracy`` their mean."""

    policy: str
    tokenizer: str
    reference: str
    reward_model: str | tuple[str, ...] | None
    critic: str | None
    judge: str | None = None
    teacher: str | None = None  # on-policy distillation's (``algorithm.distill``)
    train_data: str | None = None
    heldout_data: str | None = None
    sft_accuracy: float | None = None
    rm_pair_accuracy: float | None = None
    rm_pair_accuracies: tuple[float, ...] = ()


def one_or_many(paths: Sequence[str]) -> str | tuple[str, ...] | None:
    """No folder → None, one → that folder, several → the ensemble's folders."""
    if not paths:
        return None
    return paths[0] if len(paths) == 1 else tuple(paths)


@task(name="build-assets", cache_policy=NO_CACHE)
def build_assets(cfg: TrainConfig) -> dict[str, str]:
    from infra.agent_task import build_agent_assets
    from infra.assets import build_tiny_assets

    # Progress over the build's parts; reused assets show none.
    progress = phase_progress(cfg, "building the tiny assets", "assets")
    # A folder per seed (the models' initial weights and the data split depend on it): runs of
    # different seeds never rebuild each other's assets.
    if cfg.data.builtin_task == "agent":
        root = cfg.models.assets_dir / "agent" / f"seed-{cfg.seed}"
        paths = build_agent_assets(root, seed=cfg.seed, progress=progress)
    else:
        root = cfg.models.assets_dir / f"seed-{cfg.seed}"
        paths = build_tiny_assets(root, seed=cfg.seed, progress=progress)
    return {k: str(v) for k, v in asdict(paths).items()}


def _train_once(
    out: Path, train: Callable[..., Any], *, made_with: dict[str, Any], run_dir: Path, **kwargs: Any
) -> dict[str, float]:
    """Run ``train(out_path=out, **kwargs)`` unless ``out/report.json`` says it already ran with
    the settings ``made_with`` (its record beside the report, ``flows.run_record.check_part``:
    other settings are refused, never reused); the report's numbers are kept there so a resumed
    or re-scheduled run reuses the model."""
    path = out / "report.json"
    if path.exists():
        check_part(out, made_with, run_dir)
        return dict(json.loads(path.read_text()))
    report = train(out_path=out, **kwargs)
    result = {k: float(v) for k, v in asdict(report).items() if isinstance(v, int | float)}
    record_part(out, made_with)
    path.write_text(json.dumps(result))
    return result


def _in_own_process(train: Callable[..., Any], threads: int) -> Callable[..., Any]:
    """``train`` run in a freshly spawned process with ``threads`` torch threads: its own
    interpreter and random state, so members trained side by side each train as they would
    alone, and the GIL of one does not hold back another."""

    def run(**kwargs: Any) -> Any:
        from infra.pretrain import call_with_threads

        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            return pool.submit(call_with_threads, threads, train, kwargs).result()

    return run


def rm_workers(cfg: TrainConfig) -> int:
    """How many ensemble members train at once (``warmstart.rm_workers``; by default one per
    member, as many as the CPUs this process may use hold at ``threads_per_worker`` each)."""
    if cfg.warmstart.rm_workers is not None:
        return min(cfg.warmstart.rm_workers, cfg.warmstart.rm_ensemble)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    fit = max(1, (cpus or 1) // cfg.resources.threads_per_worker)
    return min(fit, cfg.warmstart.rm_ensemble)


def _data_paths(assets: dict[str, str]) -> dict[str, Path]:
    return {
        "tokenizer_path": Path(assets["tokenizer"]),
        "train_path": Path(assets["train_data"]),
        "heldout_path": Path(assets["heldout_data"]),
    }


@task(name="sft", cache_policy=NO_CACHE)
def sft(cfg: TrainConfig, assets: dict[str, str], out: Path) -> dict[str, float]:
    from infra.agent_task import agent_warmstart
    from infra.pretrain import SFTSettings, sft_warmstart

    settings = SFTSettings.from_config(cfg.warmstart)
    return _train_once(
        out,
        agent_warmstart if cfg.data.builtin_task == "agent" else sft_warmstart,
        made_with=sft_settings(cfg),
        run_dir=cfg.resolved_run_dir,
        policy_path=Path(assets["policy"]),
        settings=settings,
        seed=cfg.seed,
        progress=phase_progress(cfg, "warm start: SFT steps", "warmstart-sft"),
        **_data_paths(assets),
    )


@task(
    name="train-reward-model",
    cache_policy=NO_CACHE,
    task_run_name="train-reward-model[member={member}]",
)
def reward_model(
    cfg: TrainConfig,
    assets: dict[str, str],
    sft_dir: Path,
    out: Path,
    member: int = 0,
    own_process: bool = False,
) -> dict[str, float]:
    from infra.pretrain import RewardModelSettings, train_reward_model

    settings = RewardModelSettings.from_config(cfg.warmstart)
    threads = cfg.resources.threads_per_worker
    label = f"warm start: reward model {member} steps"
    return _train_once(
        out,
        _in_own_process(train_reward_model, threads) if own_process else train_reward_model,
        made_with=reward_model_settings(cfg),
        run_dir=cfg.resolved_run_dir,
        init_path=sft_dir,
        settings=settings,
        seed=cfg.seed,
        member=member,
        # A reward model in a process of its own prints its lines there.
        progress=(
            LineProgress(label, interval_s=LINE_INTERVAL_S)
            if own_process
            else phase_progress(cfg, label, f"warmstart-reward-model-{member}")
        ),
        **_data_paths(assets),
    )


def _needs_assets(cfg: TrainConfig) -> bool:
    """The tiny assets serve the built-in task (its data, its policy) and the warm start."""
    return cfg.data.builtin or cfg.models.policy is None


def resolve_models(
    cfg: TrainConfig,
    assets: dict[str, str] | None,
    *,
    policy: str | None = None,
    reward_model: str | tuple[str, ...] | None = None,
) -> ResolvedModels:
    """Fill in the defaults: the policy (a given folder, the warm-started one, or the tiny
    asset), its tokenizer, the reference (= the policy), the reward model (given, trained, or
    none) and the built-in data files."""
    m = cfg.models
    policy = policy or (str(m.policy) if m.policy else None)
    if policy is None:
        assert assets is not None
        policy = assets["policy"]
    if reward_model is None:
        reward_model = one_or_many([str(path) for path in m.reward_models])
    builtin_tokenizer = assets["tokenizer"] if assets and m.policy is None else None
    return ResolvedModels(
        policy=policy,
        tokenizer=str(m.tokenizer or builtin_tokenizer or policy),
        reference=str(m.reference or (m.policy or policy)),
        reward_model=reward_model,
        critic=str(m.critic) if m.critic else None,
        judge=str(m.judge) if m.judge else None,
        teacher=str(m.teacher) if m.teacher else None,
        train_data=assets["train_data"] if assets and cfg.data.builtin else None,
        heldout_data=assets["heldout_data"] if assets and cfg.data.builtin else None,
    )


@flow(name="reward-model", log_prints=True)
def reward_model_flow(config: TrainConfig = TrainConfig()) -> ResolvedModels:  # noqa: B008 - pydantic default is the form's default
    """Warm-start the policy and train the reward model on the built-in task (skipping what is
    already done); with a user's policy or data only the defaults are filled in."""
    cfg = config
    logger = get_run_logger()
    # Tiny models gain nothing from intra-op threads, and on a busy machine extra threads thrash.
    import torch

    torch.set_num_threads(cfg.resources.threads_per_worker)
    # 1. Assets (tiny tokenizer, models, dataset) for the built-in task — idempotent.
    assets = build_assets(cfg) if _needs_assets(cfg) else None
    if not cfg.warm_start:
        return resolve_models(cfg, assets)
    assert assets is not None
    root = cfg.resolved_run_dir / "warmstart"
    sft_dir = root / "sft"
    # 2. Supervised warm start of the built-in policy.
    rep = sft(cfg, assets, sft_dir)
    sft_acc = rep.get("heldout_accuracy")
    policy = str(sft_dir)
    # 3. Reward models on rule-derived preference pairs, unless given or unused.
    rm_paths = [str(path) for path in cfg.models.reward_models]
    accuracies: list[float] = []
    if not rm_paths and cfg.uses_reward_model:
        rm_paths, accuracies = _train_reward_models(cfg, assets, sft_dir, root)
    rm_acc = sum(accuracies) / len(accuracies) if accuracies else None
    logger.info(
        "warm start: sft held-out accuracy=%s, reward-model held-out pair accuracy=%s",
        sft_acc,
        accuracies or None,
    )
    _report(root, policy=policy, sft_acc=sft_acc, rm_paths=rm_paths, accuracies=accuracies)
    resolved = resolve_models(cfg, assets, policy=policy, reward_model=one_or_many(rm_paths))
    return replace(
        resolved,
        sft_accuracy=sft_acc,
        rm_pair_accuracy=rm_acc,
        rm_pair_accuracies=tuple(accuracies),
    )


def _train_reward_models(
    cfg: TrainConfig, assets: dict[str, str], sft_dir: Path, root: Path
) -> tuple[list[str], list[float]]:
    """Train ``warmstart.rm_ensemble`` reward models from the SFT policy, ``rm_workers`` at a
    time (each in a process of its own when more than one trains at once, otherwise one after
    another in this process); their folders and held-out pair accuracies. Fails on one below
    ``min_rm_pair_accuracy``."""
    count, workers = cfg.warmstart.rm_ensemble, rm_workers(cfg)
    outs = [root / ("reward_model" if k == 0 else f"reward_model_{k}") for k in range(count)]
    if workers == 1:
        reports = [reward_model(cfg, assets, sft_dir, out, k) for k, out in enumerate(outs)]
    else:
        reports = []
        for start in range(0, count, workers):
            wave = [
                reward_model.submit(cfg, assets, sft_dir, outs[k], k, own_process=True)
                for k in range(start, min(start + workers, count))
            ]
            reports.extend(future.result() for future in wave)
    paths, accuracies = [], []
    for member, (out, rep) in enumerate(zip(outs, reports)):
        accuracy = rep["heldout_pair_accuracy"]
        if accuracy < cfg.warmstart.min_rm_pair_accuracy:
            raise RuntimeError(
                f"reward model {member} held-out pair accuracy {accuracy:.3f} < "
                f"warmstart.min_rm_pair_accuracy={cfg.warmstart.min_rm_pair_accuracy}: raise "
                "warmstart.rm_steps / rm_max_seconds"
            )
        paths.append(str(out))
        accuracies.append(accuracy)
    return paths, accuracies


def _report(
    root: Path,
    *,
    policy: str,
    sft_acc: float | None,
    rm_paths: list[str],
    accuracies: list[float],
) -> None:
    """The warm start's numbers: ``<root>/report.json`` and the ``reward-model`` artifact."""
    members = [
        {"member": k, "path": path, "heldout_pair_accuracy": accuracies[k] if accuracies else None}
        for k, path in enumerate(rm_paths)
    ]
    report = {"policy": policy, "sft_heldout_accuracy": sft_acc, "reward_models": members}
    (root / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    rows = "".join(
        f"| {m['member']} | `{m['path']}` | {m['heldout_pair_accuracy']} |\n" for m in members
    )
    create_markdown_artifact(
        key="reward-model",
        markdown=(
            "# Warm start\n\n| what | value |\n|---|---|\n"
            f"| policy | `{policy}` |\n| SFT held-out rule accuracy | {sft_acc} |\n\n"
            "| reward model | folder | held-out pair accuracy |\n|---|---|---|\n" + rows
        ),
    )
