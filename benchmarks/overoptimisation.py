"""Benchmark: reward overoptimisation on the built-in addition task, and the ensemble remedy.

Run:  .venv/bin/python benchmarks/overoptimisation.py [--seeds 0 1 2] [--steps 80]
          [--rm-steps 100] [--members 3] [--penalty 1.0] [--eval-every 5]
          [--sft-from 'runs/ms-{seed}/warmstart/sft'] [--warm-from 'runs/x-{seed}/warmstart']
          [--root runs/overopt]
          [--set key=value ...] [--output PATH] [--plot PATH]

The setting is the main job (``ppoflow train``: SFT warm start, a reward model on rule-derived
pairs, GRPO with the reward model as the only reward, the rule logged at weight 0) with a weaker
reward model (``warmstart.rm_steps`` = ``--rm-steps``: fewer pairs) and a longer run
(``--steps``). For each seed, three variants share the seed's SFT policy and reward models:

1. ``ensemble``: the warm start trains ``--members`` reward models (each with its own seed and
   data order); the policy learns from their mean (``reward.uncertainty_penalty`` 0);
2. ``single``: member 0 alone (``models.reward_model`` = its folder);
3. ``ensemble+penalty``: every member, scored mean − ``--penalty`` × std.

Each run is ``ppoflow train`` in its own subprocess. ``--sft-from`` copies a finished SFT folder
(with its ``report.json``: the warm start then does not redo it) into the first run of a seed;
the SFT recipe depends on the seed and ``warmstart.sft_steps`` only, so any run of the main job
with the same seed gives the same folder. ``--warm-from`` copies a finished warm start (the SFT
folder and those of the reward models that have a report) when one exists for the seed: it must
come from a run with the same seed and ``warmstart.rm_steps``, which trains the same folders (the
benchmark does not check); the members it lacks are trained. The gold metric is ``eval/rule_accuracy`` (greedy, the
held-out prompts, every ``--eval-every`` steps); the proxy the policy optimises is the training
batch's reward-model score (``reward/rm/mean``; ``reward/rm_mean/mean`` is the members'
mean). Per run: the peak held-out accuracy and its step, the last one, and the drop between them.

Prints a table, writes ``benchmarks/results/overoptimisation.json`` (every curve, the settings,
the load average) and a plot of the curves (``overoptimisation.png``). A test never runs this.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
VARIANTS = ("ensemble", "single", "ensemble+penalty")
CURVE_KEYS = (
    "reward/rm/mean",
    "reward/rm_mean/mean",
    "reward/rm_std/mean",
    "reward/rule/mean",
    "actor/kl_to_ref",
)
QUIET_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=80, help="RL steps per run")
    parser.add_argument("--rm-steps", type=int, default=100, help="warmstart.rm_steps per member")
    parser.add_argument("--members", type=int, default=3, help="reward models in the ensemble")
    parser.add_argument("--penalty", type=float, default=1.0, help="reward.uncertainty_penalty")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--sft-from", default=None, help="an SFT folder per seed, with {seed}")
    parser.add_argument("--warm-from", default=None, help="a warmstart folder per seed, {seed}")
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "overopt")
    parser.add_argument("--set", dest="extra", nargs="*", default=[], help="more key=value")
    parser.add_argument("--output", type=Path, default=RESULTS / "overoptimisation.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "overoptimisation.png")
    parser.add_argument("--replot", action="store_true", help="only redraw --output's curves")
    return parser.parse_args()


# ---------------------------------------------------------------------------- one run
def run_dir(args: argparse.Namespace, seed: int, variant: str) -> Path:
    return args.root / f"seed-{seed}" / variant.replace("+", "-")


def members(args: argparse.Namespace, seed: int) -> list[Path]:
    """The reward models the seed's ``ensemble`` run trained (member 0 first)."""
    warm = run_dir(args, seed, "ensemble") / "warmstart"
    return [warm / ("reward_model" if k == 0 else f"reward_model_{k}") for k in range(args.members)]


def overrides(args: argparse.Namespace, seed: int, variant: str) -> list[str]:
    """The ``ppoflow train`` settings of one run."""
    common = [
        f"seed={seed}",
        f"run_dir={run_dir(args, seed, variant)}",
        f"trainer.total_steps={args.steps}",
        f"trainer.eval_every={args.eval_every}",
        f"trainer.checkpoint_every={args.steps}",
        "trainer.progress_bar=false",
        "trainer.save_samples=false",
        f"warmstart.rm_steps={args.rm_steps}",
        f"warmstart.rm_ensemble={args.members}",
        # The recipe docs/results/overoptimisation.md measured: a constant learning rate and
        # advantages divided by their group's std (the main job decays its rate and does not).
        "actor.lr_schedule=constant",
        "algorithm.norm_by_std=true",
        *args.extra,
    ]
    paths = [str(p) for p in members(args, seed)]
    if variant == "ensemble":
        return [*common, "reward.uncertainty_penalty=0.0"]
    if variant == "single":
        return [*common, f"models.reward_model={paths[0]}", "reward.uncertainty_penalty=0.0"]
    return [
        *common,
        f"models.reward_model=[{', '.join(paths)}]",
        f"reward.uncertainty_penalty={args.penalty}",
    ]


def seed_sft(args: argparse.Namespace, seed: int, variant: str) -> None:
    """Copy a finished SFT folder into the run (``--sft-from``, else the seed's ensemble run)."""
    target = run_dir(args, seed, variant) / "warmstart" / "sft"
    if (target / "report.json").exists():
        return
    warm = Path(args.warm_from.format(seed=seed)) if args.warm_from else None
    if variant == "ensemble" and warm is not None and (warm / "sft" / "report.json").exists():
        for folder in ["sft", *(p.name for p in members(args, seed))]:
            if (warm / folder / "report.json").exists():  # the rest are trained by the run
                shutil.copytree(warm / folder, target.parent / folder, dirs_exist_ok=True)
        return
    source = run_dir(args, seed, "ensemble") / "warmstart" / "sft"
    if variant == "ensemble" and args.sft_from:
        source = Path(args.sft_from.format(seed=seed))
    if (source / "report.json").exists():
        shutil.copytree(source, target, dirs_exist_ok=True)


def train(args: argparse.Namespace, seed: int, variant: str) -> dict[str, Any]:
    """One ``ppoflow train`` subprocess; its curves, wall time and load."""
    seed_sft(args, seed, variant)
    cmd = [sys.executable, "-m", "flows.cli", "train", *overrides(args, seed, variant)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(QUIET_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(":")
    load, started = os.getloadavg(), time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    out = run_dir(args, seed, variant)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-5:])
        return {"ok": False, "error": tail, "wall_s": wall, "load": load}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    report = json.loads((out / "warmstart" / "report.json").read_text())
    curves: dict[str, Any] = {
        "eval_steps": [r["step"] for r in rows if "eval/rule_accuracy" in r],
        "eval/rule_accuracy": [r["eval/rule_accuracy"] for r in rows if "eval/rule_accuracy" in r],
        "steps": [r["step"] for r in rows],
    }
    for key in CURVE_KEYS:
        curves[key] = [r.get(key) for r in rows]
    return {
        "ok": True,
        "wall_s": wall,
        "load": load,
        "load_end": os.getloadavg(),
        "overrides": overrides(args, seed, variant),
        "reward_models": report["reward_models"],
        "curves": curves,
        "summary": summarise(curves),
    }


def summarise(curves: dict[str, Any]) -> dict[str, Any]:
    """Peak held-out accuracy, its step, the last one and the drop; the proxy's first and last
    five-step means (the training RM score)."""
    acc, steps = curves["eval/rule_accuracy"], curves["eval_steps"]
    best = max(range(len(acc)), key=lambda i: acc[i])
    proxy = [v for v in curves["reward/rm/mean"] if v is not None]
    return {
        "peak": acc[best],
        "peak_step": steps[best],
        "last": acc[-1],
        "last_step": steps[-1],
        "drop": acc[best] - acc[-1],
        "proxy_first": statistics.fmean(proxy[:5]),
        "proxy_last": statistics.fmean(proxy[-5:]),
    }


# ---------------------------------------------------------------------------- report
def print_table(report: dict[str, Any]) -> None:
    print()
    print(
        f"overoptimisation: rm_steps={report['settings']['rm_steps']}, "
        f"{report['settings']['steps']} steps, {report['settings']['members']} members, "
        f"penalty {report['settings']['penalty']}"
    )
    head = f"{'variant':18}{'seed':>5}{'peak':>7}{'@step':>7}{'last':>7}{'drop':>7}"
    print(head + f"{'RM first':>10}{'RM last':>9}{'wall s':>8}")
    for variant, by_seed in report["runs"].items():
        for seed, run in by_seed.items():
            if not run["ok"]:
                print(f"{variant:18}{seed:>5}  failed: {run['error'][:80]}")
                continue
            s = run["summary"]
            print(
                f"{variant:18}{seed:>5}{s['peak']:7.3f}{s['peak_step']:7d}{s['last']:7.3f}"
                f"{s['drop']:7.3f}{s['proxy_first']:10.3f}{s['proxy_last']:9.3f}{run['wall_s']:8.0f}"
            )
        drops = [r["summary"]["drop"] for r in by_seed.values() if r["ok"]]
        if drops:
            print(f"{variant:18}{'mean':>5}{'':21}{statistics.fmean(drops):7.3f}")


def plot(report: dict[str, Any], path: Path) -> None:
    """Held-out rule accuracy (left) and the training RM score (right) per step: each seed thin,
    the mean over seeds thick, one colour per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"single": "tab:red", "ensemble": "tab:blue", "ensemble+penalty": "tab:green"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for variant, by_seed in report["runs"].items():
        runs = [r for r in by_seed.values() if r["ok"]]
        for run in runs:
            c = run["curves"]
            left.plot(c["eval_steps"], c["eval/rule_accuracy"], color=colours[variant], lw=0.6)
            right.plot(c["steps"], c["reward/rm/mean"], color=colours[variant], lw=0.6)
        if runs:
            steps = runs[0]["curves"]["eval_steps"]
            mean = [
                statistics.fmean(r["curves"]["eval/rule_accuracy"][i] for r in runs)
                for i in range(len(steps))
            ]
            left.plot(steps, mean, color=colours[variant], lw=2.2, label=variant)
            right.plot([], [], color=colours[variant], lw=2.2, label=variant)
    left.set(xlabel="step", ylabel="held-out rule accuracy (greedy)", ylim=(0, 1))
    right.set(xlabel="step", ylabel="training reward-model score (mean of batch)")
    left.legend(loc="lower right")
    right.legend(loc="lower right")
    s = report["settings"]
    seeds = sorted({seed for by_seed in report["runs"].values() for seed in by_seed})
    fig.suptitle(
        f"rm_steps={s['rm_steps']}, {s['members']} members, penalty {s['penalty']}: "
        f"seeds {', '.join(seeds)} (thin), their mean (thick)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    if args.replot:
        report = json.loads(args.output.read_text())
        plot(report, args.plot)
        print_table(report)
        return
    settings = {
        "seeds": args.seeds,
        "steps": args.steps,
        "rm_steps": args.rm_steps,
        "members": args.members,
        "penalty": args.penalty,
        "eval_every": args.eval_every,
        "extra": args.extra,
        "sft_from": args.sft_from,
        "warm_from": args.warm_from,
    }
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "settings": settings,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "runs": {v: {} for v in VARIANTS if v in args.variants},
    }
    # The ensemble run trains the members the other two variants load: it goes first.
    order = [v for v in VARIANTS if v in args.variants]
    for seed in args.seeds:
        for variant in order:
            run = train(args, seed, variant)
            report["runs"][variant][str(seed)] = run
            state = "ok" if run["ok"] else f"failed: {run['error'][:200]}"
            print(f"seed {seed} {variant}: {state} ({run['wall_s']:.0f} s)", flush=True)
            args.output.parent.mkdir(parents=True, exist_ok=True)
            # Paths relative to the repository: a result file names no machine's folders.
            text = json.dumps(report, indent=1).replace(f"{ROOT}/", "")
            args.output.write_text(text + "\n")
    plot(report, args.plot)
    print_table(report)


if __name__ == "__main__":
    main()
