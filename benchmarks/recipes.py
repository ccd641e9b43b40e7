"""Experiment: the DAPO preset against GRPO with the same reward function, off-policy
correction in ``colocate_async``, and on-policy distillation, on the built-in task, seeds 0, 1,
2.

Run:  .venv/bin/python benchmarks/recipes.py [--seeds 0 1 2] [--arms dapo grpo async-none async-auto distill]

Arms (each a real ``ppoflow train`` run in its own process and run folder):

- ``dapo``: ``--config dapo`` (the exact rule as a reward function, no reward model, dynamic
  sampling on the rule, clip-higher 0.28, token-mean loss, overlong buffer);
- ``grpo``: ``--config grpo`` with the same reward function and no reward model;
- ``async-none`` / ``async-auto``: ``dapo`` in ``resources.mode=colocate_async`` with
  ``resources.max_staleness=2``, ``algorithm.rollout_correction.mode`` none / auto;
- ``distill``: ``--config distill``: its warm start trains the teacher (``dapo`` from the
  seed's SFT student), then the same SFT student learns from the teacher's log-probs alone
  (no reward); the teacher's own curve is reported beside it (``distill-teacher``).

Every arm of a seed starts from the same supervised warm start (the first arm trains it, the
others get a copy of ``warmstart/sft``). Held-out accuracy is ``eval/rule_accuracy`` (200
held-out prompts, greedy), logged before steps 0, 5, ... and after the last; the generated
samples before an evaluation count every response generated up to it (refill rounds included:
``rollout/generated_samples``). Prints a table, writes ``benchmarks/results/recipes.json`` and
plots accuracy against generated samples to ``benchmarks/results/recipes.png``.
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RULE_FN = "reward.functions=[{name: exact_match, weight: 1.0}]"
ARMS: dict[str, list[str]] = {
    "dapo": ["--config", "dapo"],
    "grpo": ["--config", "grpo", "reward.model_weight=0.0", RULE_FN],
    "async-none": [
        "--config",
        "dapo",
        "resources.mode=colocate_async",
        "resources.max_staleness=2",
        "algorithm.rollout_correction.mode=none",
    ],
    "async-auto": [
        "--config",
        "dapo",
        "resources.mode=colocate_async",
        "resources.max_staleness=2",
        "algorithm.rollout_correction.mode=auto",
    ],
    "distill": ["--config", "distill"],
}
MISMATCH = (
    "rollout_corr/kl_k1",
    "rollout_corr/kl_k3",
    "rollout_corr/ppl_ratio",
    "rollout_corr/is_weight_mean",
    "rollout_corr/is_weight_max",
    "rollout_corr/clipped_fraction",
    "rollout_corr/masked_fraction",
)


def run_arm(arm: str, seed: int, root: Path, warm: Path | None) -> dict[str, Any]:
    """One training run; returns its curve and summary."""
    run_dir = root / f"seed-{seed}" / arm
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    if warm is not None:  # the seed's supervised warm start, trained by an earlier arm
        shutil.copytree(warm, run_dir / "warmstart" / "sft")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "flows.cli", "train", *ARMS[arm]]
    command += [f"seed={seed}", f"run_dir={run_dir}", "trainer.progress_bar=false"]
    t0 = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {"arm": arm, "seed": seed, "seconds": seconds, **summarize(rows)}
    teacher = run_dir / "warmstart" / "teacher" / "metrics.jsonl"
    if teacher.exists():  # the distill preset's teacher, trained from the same SFT student
        lines = [json.loads(x) for x in teacher.read_text().splitlines()]
        out["teacher"] = summarize(lines)
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The held-out curve against generated samples, the final accuracy, the mismatch means."""
    curve, generated = [], 0.0
    for i, row in enumerate(rows):
        last = i == len(rows) - 1
        if "eval/rule_accuracy" in row and not last:  # evaluated before this step's rollout
            curve.append(
                {"step": row["step"], "samples": generated, "acc": row["eval/rule_accuracy"]}
            )
        generated += row["rollout/generated_samples"]
        if "eval/rule_accuracy" in row and last:  # the evaluation after the last update
            curve.append(
                {"step": row["step"] + 1, "samples": generated, "acc": row["eval/rule_accuracy"]}
            )
    out: dict[str, Any] = {"curve": curve, "final_accuracy": curve[-1]["acc"], "samples": generated}
    for key in ("filter/kept_groups", "filter/rounds", "response/truncated_fraction", *MISMATCH):
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = statistics.fmean(values)
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "dapo": "tab:blue",
        "grpo": "tab:orange",
        "async-none": "tab:red",
        "async-auto": "tab:green",
        "distill": "tab:purple",
        "distill-teacher": "tab:brown",
    }
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        xs = [p["samples"] for p in r["curve"]]
        ys = [p["acc"] for p in r["curve"]]
        label = r["arm"] if r["seed"] == min(x["seed"] for x in results) else None
        ax.plot(
            xs, ys, color=colors.get(r["arm"], "gray"), alpha=0.8, marker="o", ms=3, label=label
        )
    ax.set_xlabel("generated samples")
    ax.set_ylabel("held-out rule accuracy (greedy, 200 prompts)")
    ax.axhline(0.9, color="gray", lw=0.8, ls="--")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "recipes")
    parser.add_argument("--out", type=Path, default=RESULTS / "recipes.json")
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        warm: Path | None = None
        for arm in args.arms:
            result = run_arm(arm, seed, args.root, warm)
            results.append(result)
            if "teacher" in result:
                results.append({"arm": f"{arm}-teacher", "seed": seed, **result.pop("teacher")})
            print(
                f"{arm:<11} seed {seed}: held-out {result['final_accuracy']:.3f} after "
                f"{result['samples']:.0f} samples, {result['seconds']:.0f} s",
                flush=True,
            )
            sft = args.root / f"seed-{seed}" / arm / "warmstart" / "sft"
            if warm is None and (sft / "report.json").exists():
                warm = args.root / f"seed-{seed}" / "sft"
                if warm.exists():
                    shutil.rmtree(warm)
                shutil.copytree(sft, warm)
    report(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"arms": ARMS, "results": results}, indent=1))
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def _mean(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.2e}" if xs else "—"


def report(results: list[dict[str, Any]]) -> None:
    seeds = sorted({r["seed"] for r in results})
    print()
    print(
        "| arm | "
        + " | ".join(f"seed {s}: held-out / samples" for s in seeds)
        + " | kl_k3 | is_weight_mean |"
    )
    print("|---|" + "---|" * len(seeds) + "---|---|")
    for arm in dict.fromkeys(r["arm"] for r in results):
        cells, k3, w = [], [], []
        for s in seeds:
            r = next((x for x in results if x["arm"] == arm and x["seed"] == s), None)
            cells.append("—" if r is None else f"{r['final_accuracy']:.3f} / {r['samples']:.0f}")
            if r is not None and "rollout_corr/kl_k3" in r:
                k3.append(r["rollout_corr/kl_k3"])
                w.append(r["rollout_corr/is_weight_mean"])
        print(f"| {arm} | " + " | ".join(cells) + f" | {_mean(k3)} | {_mean(w)} |")


if __name__ == "__main__":
    main()
