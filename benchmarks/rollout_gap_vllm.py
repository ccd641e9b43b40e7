"""Benchmark: the real engine–trainer gap with the vLLM rollout engine, and what correcting it
does to learning, on the built-in task (the main job's recipe).

Run:  .venv/bin/python benchmarks/rollout_gap_vllm.py --warm-from 'runs/vllm-{seed}/warmstart'
          [--seeds 0 1 2] [--steps 100] [--output benchmarks/results/rollout-gap-vllm.json]

Needs vLLM (``make venv-vllm``). For each seed, the finished warm start of a main-job run with
that seed (``--warm-from``: its SFT policy and reward models; the recipe depends on the seed
and the warm-start settings only) is copied into each variant's run folder, then RL runs as
``ppoflow train seed=S rollout.engine=vllm`` with every combination of

- ``models.dtype``: ``float32`` (engine and trainer in float32: only kernel rounding differs)
  or ``bfloat16`` (the engine holds bfloat16 weights; the trainer autocasts to bfloat16 over
  float32 masters),
- ``resources.mode``: ``sync`` or ``colocate_async`` with ``resources.max_staleness=2``,
- ``algorithm.rollout_correction.mode``: ``none`` or ``auto`` (token_truncate here),

and records held-out rule accuracy (greedy, 200 prompts) after the last update, the
``rollout_corr/*`` metrics averaged over the steps, and ``sync/probe_max_abs_diff``'s largest
value. Prints a table and writes JSON. A test never runs this.
"""

from __future__ import annotations

import argparse
import itertools
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
DTYPES = ("float32", "bfloat16")
MODES = {"sync": (), "colocate_async": ("resources.max_staleness=2",)}
CORRECTIONS = ("none", "auto")
GAP_KEYS = ("rollout_corr/kl_k3", "rollout_corr/ppl_ratio", "rollout_corr/is_weight_max")


def run_one(args: argparse.Namespace, seed: int, dtype: str, mode: str, fix: str) -> dict[str, Any]:
    """One RL run from the seed's warm start; its final accuracy and mean gap metrics."""
    name = f"gap-{seed}-{dtype}-{mode}-{fix}"
    run_dir = ROOT / "runs" / "rollout-gap" / name
    if run_dir.exists():  # a run of its own: an earlier one's steps are not resumed
        shutil.rmtree(run_dir)
    shutil.copytree(Path(args.warm_from.format(seed=seed)), run_dir / "warmstart")
    cmd = [
        sys.executable, "-m", "flows.cli", "train", f"seed={seed}", f"run_dir={run_dir}",
        "rollout.engine=vllm", f"models.dtype={dtype}", f"resources.mode={mode}",
        *MODES[mode], f"algorithm.rollout_correction.mode={fix}",
        f"trainer.total_steps={args.steps}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(QUIET_ENV, PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        # The CLI's own last word ("ppoflow: <Error>: ..."), else the output's last line.
        lines = done.stderr.strip().splitlines()
        said = [line for line in lines if line.startswith("ppoflow: ")]
        return {"ok": False, "error": (said or lines)[-1:], "wall_s": wall}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/rule_accuracy" in r]
    if not evals:
        return {"ok": False, "error": ["no eval/rule_accuracy logged"], "wall_s": wall}
    gap = {
        key: statistics.fmean(r[key] for r in rows if key in r)
        for key in GAP_KEYS
        if any(key in r for r in rows)
    }
    probes = [r["sync/probe_max_abs_diff"] for r in rows if "sync/probe_max_abs_diff" in r]
    return {
        "ok": True,
        "accuracy_first": evals[0]["eval/rule_accuracy"],
        "accuracy_last": evals[-1]["eval/rule_accuracy"],
        "gap_mean": gap,
        "probe_max": max(probes) if probes else None,
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--warm-from", required=True, help="a warmstart folder per seed, {seed}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--steps", type=int, default=100, help="trainer.total_steps (the main job's)"
    )
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument(
        "--output", type=Path, default=ROOT / "benchmarks" / "results" / "rollout-gap-vllm.json"
    )
    args = parser.parse_args()
    # Runs of other seeds or dtypes already in the output file are kept.
    results: dict[str, Any] = {}
    if args.output.exists():
        earlier = json.loads(args.output.read_text())
        if earlier.get("steps") == args.steps:
            results = earlier["results"]
    for seed, dtype, mode, fix in itertools.product(args.seeds, args.dtypes, MODES, CORRECTIONS):
        key = f"seed={seed} dtype={dtype} mode={mode} correction={fix}"
        print(f"  {key} ...", flush=True)
        results[key] = run_one(args, seed, dtype, mode, fix)
        write_report(args, results)  # after every run: an interrupted sweep keeps what it ran
    print(f"\n{'run':<58}{'acc 0':>7}{'acc end':>9}{'kl_k3':>10}{'is_w max':>10}{'probe':>10}")
    for key, r in results.items():
        if not r["ok"]:
            print(f"{key:<58} failed: {r['error']}")
            continue
        gap = r["gap_mean"]
        print(
            f"{key:<58}{r['accuracy_first']:>7.3f}{r['accuracy_last']:>9.3f}"
            f"{gap.get('rollout_corr/kl_k3', float('nan')):>10.2e}"
            f"{gap.get('rollout_corr/is_weight_max', float('nan')):>10.3f}"
            f"{r['probe_max'] if r['probe_max'] is not None else float('nan'):>10.2e}"
        )
    write_report(args, results)
    print(f"wrote {args.output}")


def write_report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {"steps": args.steps, "warm_from": args.warm_from, "results": results}
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
