"""Benchmark: what a reward-model ensemble's turn holds, by member count.

Run:  .venv/bin/python benchmarks/reward_ensemble_memory.py FOLDER [FOLDER ...] [--batch 64]
          [--output PATH]

The members of an ensemble wake and sleep together (``infra.reward_model.RewardScorer``: one
``Sleepable`` in the colocated group), so the reward model's turn holds every member's weights at
once. For k = 1 .. len(FOLDER), a fresh subprocess loads the first k folders as one scorer,
scores ``--batch`` built-in prompts with a short answer each, and reports the members' parameter
bytes (what a wake-up puts on the device), the process's peak RSS, and the scoring time. Prints
a table and writes ``benchmarks/results/reward-ensemble-memory.json``. A test never runs this.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "reward-ensemble-memory.json"


def child(folders: list[str], batch: int) -> dict[str, Any]:
    """Inside the subprocess: load, score once to warm up, score again timed; the numbers."""
    import torch

    from infra.reward_model import RewardScorer

    torch.set_num_threads(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scorer = RewardScorer(folders, policy_tokenizer_path=folders[0], batch_size=batch)
    tokenizer = scorer.policy_tokenizer
    prompts = [
        torch.tensor(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{10 + i % 80}+{11 + i % 70}="}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for i in range(batch)
    ]
    answers = [torch.tensor(tokenizer(str(21 + i % 150))["input_ids"]) for i in range(batch)]
    raw = [None] * batch
    scorer.score(prompt_ids=prompts, response_ids=answers, raw_prompt=raw)
    started = time.perf_counter()
    scorer.score(prompt_ids=prompts, response_ids=answers, raw_prompt=raw)
    seconds = time.perf_counter() - started
    return {
        "members": len(folders),
        "parameter_bytes": scorer.parameter_bytes(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_before_load_mib": before / 1024,
        "score_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.folders, args.batch)))
        return
    rows = []
    for k in range(1, len(args.folders) + 1):
        cmd = [sys.executable, __file__, "--child", "--batch", str(args.batch), *args.folders[:k]]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT, env=env)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'members':>8}{'param MiB':>11}{'peak RSS MiB':>14}{'score s':>9}")
    for row in rows:
        mib = sum(row["parameter_bytes"]) / 2**20
        print(f"{row['members']:>8}{mib:11.2f}{row['peak_rss_mib']:14.1f}{row['score_s']:9.3f}")
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "batch": args.batch,
        "wake": "together: the scorer is one Sleepable, every member awake in its turn",
        "rows": rows,
        "load_avg": os.getloadavg(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
