"""Benchmark: the policy losses ppo, gspo, cispo and sapo on the built-in task, seeds 0-2.

``actor.policy_loss`` is the only difference between the runs of a seed: the same rollouts budget.

Run:  .venv/bin/python benchmarks/policy_losses.py [--seeds 0 1 2] [--losses ppo gspo cispo sapo]
          [--output benchmarks/results/policy-losses.json]

Each run is ``ppoflow train --config <preset> actor.policy_loss=<loss> seed=<s>
run_dir=runs/losses/<loss>-<s>``: ``gspo`` and ``cispo`` run their presets, ``ppo`` and
``sapo`` run ``--config grpo`` with the overrides that make it the same recipe (the exact rule
as the only reward, four optimizer steps of 16 samples per batch of 64). Before any run the
script checks that the four resolved configs differ only in ``name`` and ``actor.policy_loss``:
the same prompts, samples per step, steps and warm start, so the same rollouts budget.

The first loss of a seed trains the supervised warm start; the others get a copy of its
``warmstart/sft`` (the warm start depends on the seed and the warm-start settings only).
Records the held-out rule accuracy (greedy, 200 prompts) after the last update, the samples
generated, and ``actor/pg_clipfrac`` (each loss's own clipped or gated share) averaged over the
steps. Prints a table and writes JSON. A test never runs this.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline_parts.settings import QUIET_ENV

ROOT = Path(__file__).resolve().parents[1]
LOSSES = ("ppo", "gspo", "cispo", "sapo")
# --config grpo as the gspo / cispo presets: the rule as the reward, 4 optimizer steps a batch.
AS_PRESETS = (
    "reward.model_weight=0.0",
    "reward.functions=[{name: exact_match, weight: 1.0}]",
    "actor.mini_batch_size=16",
    "actor.micro_batch_size=16",
)
ARMS: dict[str, list[str]] = {
    "ppo": ["--config", "grpo", *AS_PRESETS],
    "gspo": ["--config", "gspo"],
    "cispo": ["--config", "cispo"],
    "sapo": ["--config", "grpo", *AS_PRESETS],
}
MEANS = ("actor/pg_clipfrac", "actor/ppo_kl")


def arm_args(loss: str) -> list[str]:
    """The ``ppoflow train`` arguments of one loss (its seed and run folder aside)."""
    return [*ARMS[loss], f"actor.policy_loss={loss}"]


def check_same_recipe(losses: list[str]) -> None:
    """The losses' resolved configs differ in ``name`` and ``actor.policy_loss`` only."""
    sys.path.insert(0, str(ROOT))
    from infra.config import load_config

    def resolved(loss: str) -> dict[str, Any]:
        args = arm_args(loss)
        data = load_config(args[1], args[2:]).model_dump(mode="json")
        data.pop("name")
        data["actor"].pop("policy_loss")
        return data

    first, *others = losses
    for loss in others:
        if resolved(loss) != resolved(first):
            raise SystemExit(f"{loss} and {first} differ in more than the policy loss: fix ARMS")


def run_one(loss: str, seed: int, root: Path, warm: Path | None) -> dict[str, Any]:
    """One training run; its final accuracy, samples and mean clipped share."""
    run_dir = root / f"{loss}-{seed}"
    if run_dir.exists():  # a run of its own: an earlier one's steps are not resumed
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    if warm is not None:  # the seed's supervised warm start, trained by an earlier loss
        shutil.copytree(warm, run_dir / "warmstart" / "sft")
    cmd = [
        sys.executable, "-m", "flows.cli", "train", *arm_args(loss),
        f"seed={seed}", f"run_dir={run_dir}", "trainer.progress_bar=false",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(QUIET_ENV, PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = round(time.perf_counter() - started, 1)
    if done.returncode != 0:
        return {"ok": False, "error": done.stderr.strip().splitlines()[-1:], "wall_s": wall}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/rule_accuracy"] for r in rows if "eval/rule_accuracy" in r]
    if not evals:
        return {"ok": False, "error": ["no eval/rule_accuracy logged"], "wall_s": wall}
    means = {
        key: statistics.fmean(r[key] for r in rows if key in r)
        for key in MEANS
        if any(key in r for r in rows)
    }
    return {
        "ok": True,
        "accuracy_first": evals[0],
        "accuracy_last": evals[-1],
        "samples": sum(r.get("rollout/generated_samples", 0) for r in rows),
        "mean": means,
        "wall_s": wall,
    }


def share_warm_start(root: Path, loss: str, seed: int) -> Path | None:
    """A copy of the seed's trained SFT warm start, for the seed's other losses (None: none)."""
    sft = root / f"{loss}-{seed}" / "warmstart" / "sft"
    if not (sft / "report.json").exists():
        return None
    warm = root / f"sft-{seed}"
    if warm.exists():
        shutil.rmtree(warm)
    shutil.copytree(sft, warm)
    return warm


def report(results: dict[str, dict[str, Any]], losses: list[str], seeds: list[int]) -> None:
    """| loss | held-out accuracy per seed | mean actor/pg_clipfrac |"""
    print()
    print("| loss | " + " | ".join(f"seed {s}: held-out" for s in seeds) + " | mean clipfrac |")
    print("|---|" + "---|" * len(seeds) + "---|")
    for loss in losses:
        cells, clip = [], []
        for seed in seeds:
            r = results.get(f"{loss}-{seed}")
            if r is None or not r["ok"]:
                cells.append("—" if r is None else "failed")
                continue
            cells.append(f"{r['accuracy_last']:.3f}")
            if "actor/pg_clipfrac" in r["mean"]:
                clip.append(r["mean"]["actor/pg_clipfrac"])
        mean_clip = f"{statistics.fmean(clip):.3f}" if clip else "—"
        print(f"| `{loss}` | " + " | ".join(cells) + f" | {mean_clip} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "losses")
    parser.add_argument(
        "--output", type=Path, default=ROOT / "benchmarks" / "results" / "policy-losses.json"
    )
    args = parser.parse_args()
    check_same_recipe(args.losses)
    results: dict[str, dict[str, Any]] = {}
    for seed in args.seeds:
        warm: Path | None = None
        for loss in args.losses:
            print(f"  {loss} seed {seed} ...", flush=True)
            result = results[f"{loss}-{seed}"] = run_one(loss, seed, args.root, warm)
            if result["ok"]:
                print(
                    f"  {loss} seed {seed}: held-out {result['accuracy_last']:.3f} after "
                    f"{result['samples']:.0f} samples, {result['wall_s']:.0f} s",
                    flush=True,
                )
            if warm is None:
                warm = share_warm_start(args.root, loss, seed)
    report(results, args.losses, args.seeds)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    arms = {loss: arm_args(loss) for loss in args.losses}
    args.output.write_text(json.dumps({"arms": arms, "results": results}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
