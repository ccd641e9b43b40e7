"""Benchmark: what ``separate_async`` pays for scoring on the training pool
(``reward.pool: colocated``: the reward model, and the judge with ``--judge``, take turns with the
trainer) against a reward pool of their own (``reward.pool: own``: one more device).

Run:  .venv/bin/python benchmarks/separate_reward_pool.py [--steps 8] [--warmup 2] [--rounds 2]
                                                         [--threads 1] [--judge]
                                                         [--wait-load 1.0] [--output PATH]

The work: the pipeline benchmark's GRPO work (``benchmarks/pipeline.py``: a GPT-2 policy of
4 x 256, a GPT-2 reward model of 4 x 128, a character tokenizer, 4 prompts x 4 samples of
exactly 64 tokens, one optimizer step per batch), in ``separate_async`` with
``algorithm.old_logprobs=rollout`` and ``resources.max_staleness=1``: the rollout generates on
its own pool while the trainer updates. ``--judge`` adds an LLM judge: a GPT-2 causal LM of the
reward model's size over the same tokenizer, an inline template, verdicts of at most
``--judge-tokens`` tokens parsed by ``last_number`` (its verdicts are noise: it is here for its
cost, ``reward/judge/parse_failures`` says how many parsed).

Each layout runs ``ppo_train`` alone in its own subprocess (a private Prefect home, every
process at ``--threads`` torch/OpenMP threads), the layouts alternating round by round; the first
``--warmup`` steps are dropped. Per layout, medians over the timed steps of every round: the step
(``timing_s/step``, and generated tokens per second of step), the trainer's wait for the
producer's scored rows (``timing_s/wait_rollout``), the producer's ``generate`` and ``score``,
the trainer's ``update``, and the training pool's wake and sleep seconds of the reward model and
judge (colocated only). ``colocation cost`` = median step colocated / own - 1. On a CPU machine
the pools' processes share the same cores, so the own layout's extra device is one more process
competing for them, not free hardware.

Prints a table and writes ``benchmarks/results/separate-reward-pool.json`` with the load average
of every run (a shared machine makes the numbers noisy). A test never runs this.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline_parts.children import child_env
from pipeline_parts.load import wait_for_load
from pipeline_parts.settings import CHILD_TIMEOUT_S, ROOT
from pipeline_parts.workload import WORK, build_tokenizer, build_work, ppoflow_config

LAYOUTS = ("own", "colocated")
RESULTS = ROOT / "benchmarks" / "results" / "separate-reward-pool.json"
JUDGE_TEMPLATE = "rate 0-9: {{ question }} {{ response }}"
STEP_KEYS = (
    "timing_s/step",
    "timing_s/wait_rollout",
    "timing_s/generate",
    "timing_s/score",
    "timing_s/update",
    "timing_s/wake/reward",
    "timing_s/sleep/reward",
    "timing_s/wake/judge",
    "timing_s/sleep/judge",
    "timing_s/wake/actor",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped first")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each layout")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--judge", action="store_true", help="add the LLM judge")
    parser.add_argument("--judge-tokens", type=int, default=8, help="longest verdict")
    parser.add_argument("--wait-load", type=float, default=None, help="wait for load below")
    parser.add_argument("--wait-max-min", type=float, default=30.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--child", choices=LAYOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


# ---------------------------------------------------------------------------- the child
def build_judge(out: Path) -> dict[str, Any]:
    """A GPT-2 causal LM of the reward model's size over the work's tokenizer, under ``out``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = build_tokenizer()
    torch.manual_seed(WORK.seed + 2)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=256,
        n_embd=128,
        n_head=4,
        n_layer=4,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = GPT2LMHeadModel(config)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, getattr(config, key))
    model.save_pretrained(out)
    tokenizer.model_max_length = 256
    tokenizer.save_pretrained(out)
    return {"judge_params": sum(p.numel() for p in model.parameters())}


def child_main(args: argparse.Namespace) -> None:
    """Inside the subprocess: one ``ppo_train`` run of ``args.child``; prints its metrics rows
    as one JSON line."""
    from flows.train import ppo_train

    total = args.warmup + args.steps + 1  # the last step also evaluates: never timed
    judge = (
        [
            f"models.judge={args.work / 'judge'}",
            f"reward.judge.template='{JUDGE_TEMPLATE}'",
            "reward.judge.parse={name: last_number}",
            f"reward.judge.max_new_tokens={args.judge_tokens}",
        ]
        if args.judge
        else []
    )
    cfg = ppoflow_config(
        "grpo",
        args.work,
        args.work / "runs" / f"{args.child}-{time.time_ns()}",
        total_steps=total,
        threads=args.threads,
        extra=(
            "resources.mode=separate_async",
            "resources.max_staleness=1",
            "algorithm.old_logprobs=rollout",
            f"reward.pool={args.child}",
            *judge,
        ),
    )
    started = time.perf_counter()
    summary = ppo_train(cfg)
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    print(json.dumps({"rows": rows, "wall_s": time.perf_counter() - started}), flush=True)


# ---------------------------------------------------------------------------- the parent
def run_layout(layout: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One subprocess run of ``layout``: its timed rows, or the reason it failed."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", layout, "--work", str(work)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--threads", str(args.threads), "--judge-tokens", str(args.judge_tokens)]
    cmd += ["--judge"] if args.judge else []
    load = os.getloadavg()
    try:
        done = subprocess.run(
            cmd,
            env=child_env(work, args.threads),
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no result within {CHILD_TIMEOUT_S} s", "load": load}
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"rows"')]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"ok": False, "error": " | ".join(tail), "load": load}
    result = json.loads(lines[-1])
    timed = result["rows"][args.warmup : args.warmup + args.steps]
    return {"ok": True, "rows": timed, "wall_s": result["wall_s"], "load": load}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over every timed step of every ok run (keys absent from a row count as 0)."""
    rows = [row for run in runs if run["ok"] for row in run["rows"]]
    if not rows:
        return {"ok": False, "errors": [run.get("error") for run in runs]}
    out: dict[str, Any] = {"ok": True, "steps": len(rows)}
    for key in STEP_KEYS:
        out[key] = statistics.median(row.get(key, 0.0) for row in rows)
    tokens = statistics.median(row["perf/total_num_tokens"] for row in rows)
    out["tokens_per_s"] = tokens / out["timing_s/step"]
    for key in ("reward/rm/mean", "reward/judge/parse_failures"):
        if key in rows[0]:
            out[key] = statistics.median(row[key] for row in rows)
    out["loads"] = [run["load"] for run in runs]
    return out


def print_table(report: dict[str, Any]) -> None:
    layouts = report["layouts"]
    print()
    print(f"separate_async, reward.pool own vs colocated{' + judge' if report['judge'] else ''}")
    header = f"{'':30}" + "".join(f"{layout:>12}" for layout in LAYOUTS)
    print(header)
    for key in ("timing_s/step", "tokens_per_s", *STEP_KEYS[1:]):
        scale, label = (1e3, f"{key} (ms)") if "/wake/" in key or "/sleep/" in key else (1, key)
        cells = [
            f"{scale * layouts[layout].get(key, float('nan')):12.3f}"
            if layouts[layout]["ok"]
            else f"{'failed':>12}"
            for layout in LAYOUTS
        ]
        print(f"{label:30}" + "".join(cells))
    print(f"{'devices':30}" + "".join(f"{report['devices'][layout]:>12}" for layout in LAYOUTS))
    cost = report.get("colocation_cost")
    print(
        f"colocation cost (step time colocated / own - 1): {cost if cost is None else f'{cost:+.1%}'}"
    )


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args)
        return
    # 1. Wait for a quiet machine if asked; build the work once.
    load_wait = wait_for_load(args.wait_load, args.wait_max_min)
    with tempfile.TemporaryDirectory(prefix="ppoflow-bench-reward-pool-") as tmp:
        work = Path(tmp)
        params = build_work(work)
        if args.judge:
            params.update(build_judge(work / "judge"))
        # 2. The layouts alternate, round by round (the order flips every second round).
        runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
        for round_index in range(args.rounds):
            order = LAYOUTS if round_index % 2 == 0 else LAYOUTS[::-1]
            for layout in order:
                print(f"round {round_index + 1}/{args.rounds}: {layout} ...", flush=True)
                runs[layout].append(run_layout(layout, args, work))
    # 3. Medians, the cost, the report.
    layouts = {layout: summarise(runs[layout]) for layout in LAYOUTS}
    cost = None
    if all(layouts[layout]["ok"] for layout in LAYOUTS):
        cost = layouts["colocated"]["timing_s/step"] / layouts["own"]["timing_s/step"] - 1
    report = {
        "work": {
            "pipeline_work": "grpo (benchmarks/pipeline.py)",
            "completions": WORK.completions,
            "response_tokens": WORK.response_tokens,
            **params,
        },
        "settings": {k: str(v) for k, v in vars(args).items() if k not in ("child", "work")},
        "judge": args.judge,
        "devices": {"own": 3, "colocated": 2},  # training + rollout (+ reward) pools, 1 each
        "layouts": layouts,
        "colocation_cost": cost,
        "load_wait": load_wait,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    print_table(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
