"""Benchmark: ppoflow's GAE and GRPO against verl's `core_algos` on B=1024, T=1024 (CPU).

Run:  .venv/bin/python benchmarks/algos.py [--repeats 9] [--threads 1] [--skip-verl]

verl runs in its own virtual environment, `benchmarks/.venvs/verl`, built on first use
(`python3 -m venv`, then `pip install torch==2.13.0 numpy` first so the CPU torch build is kept,
then `verl==0.9.1`). Both sides get the same inputs through a temporary .pt file; verl runs in a
subprocess of its venv and sends its outputs back the same way. Results are compared on real
tokens (to 1e-5, computed in float64 so the check is not float32 rounding), timings are medians
of repeats on float32 inputs, a table is printed and
`benchmarks/results/algos.json` is written. If verl's venv cannot be built or run, ppoflow is
still timed and the JSON says why verl is missing.
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
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.advantage import AdvantageOutput, gae, grpo_advantage  # noqa: E402
from tasks.score import lengths_to_mask, place_scores  # noqa: E402

VERL_VENV = ROOT / "benchmarks" / ".venvs" / "verl"
VERL_VERSION = "0.9.1"
RESULTS = ROOT / "benchmarks" / "results" / "algos.json"
GAMMA, LAM, GROUP_SIZE, TOLERANCE, GAE_TARGET = 1.0, 0.95, 8, 1e-5, 3.0

# Runs inside verl's venv: time verl's functions on the saved inputs and save their outputs.
VERL_RUNNER = textwrap.dedent(
    """
    import statistics, sys, time
    import torch
    from verl.trainer.ppo.core_algos import (
        compute_gae_advantage_return, compute_grpo_outcome_advantage)

    inputs, out_path, repeats = torch.load(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(int(sys.argv[4]))

    def cast(dtype):
        return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in inputs.items()}

    def timed(fn):  # fn(dtype) -> outputs; float32 timed, float64 kept for the parity check
        fn(torch.float32)
        wall, cpu = [], []
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            fn(torch.float32)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        return fn(torch.float64), (statistics.median(wall), statistics.median(cpu))

    def gae(case):
        def run(dtype):
            x = cast(dtype)
            return compute_gae_advantage_return(
                token_level_rewards=x["token_rewards"], values=x["values"],
                response_mask=x[case + "_mask"].to(dtype), gamma=x["gamma"], lam=x["lam"])
        return run

    def grpo(dtype):
        x = cast(dtype)
        return compute_grpo_outcome_advantage(
            token_level_rewards=x["outcome_rewards"], response_mask=x["gae_mask"].to(dtype),
            index=x["group_ids"].numpy())

    out = {}
    for case in ("gae", "gae_holes"):
        (adv, ret), (wall, cpu) = timed(gae(case))
        out[case] = {"advantages": adv, "returns": ret, "seconds": wall, "cpu_seconds": cpu}
    (adv, _), (wall, cpu) = timed(grpo)
    out["grpo"] = {"advantages": adv, "seconds": wall, "cpu_seconds": cpu}
    torch.save(out, out_path)
    """
)


def ensure_verl_venv(*, log_path: Path) -> tuple[Path | None, str]:
    """verl's venv python, building the venv on first use; (None, reason) when that fails."""
    python = VERL_VENV / "bin" / "python"
    probe = [str(python), "-c", "import verl.trainer.ppo.core_algos"]
    if python.exists() and subprocess.run(probe, capture_output=True, timeout=600).returncode == 0:
        return python, "reused"
    steps = [
        ["python3", "-m", "venv", str(VERL_VENV)],
        [str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "numpy"],
        [str(python), "-m", "pip", "install", "-q", f"verl=={VERL_VERSION}"],
        probe,
    ]
    with log_path.open("w") as log:
        for step in steps:
            try:
                done = subprocess.run(step, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
            except (OSError, subprocess.TimeoutExpired) as error:
                return None, f"{' '.join(step[:4])} failed: {error}"
            if done.returncode != 0:
                return None, f"{' '.join(step[:4])} exited {done.returncode} (see {log_path})"
    return python, "built"


def make_inputs(*, batch: int, width: int, seed: int) -> dict[str, Tensor | float]:
    """Right-padded responses of T/4…T tokens; dense small rewards plus a score on the last token;
    groups of 8; a second mask with ~10% holes punched into the real tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 4, width + 1, (batch,), generator=generator)  # (B,)
    mask = lengths_to_mask(lengths, width)  # (B, T)
    holes = mask & (torch.rand(batch, width, generator=generator) > 0.1)  # (B, T)
    holes[:, 0] = mask[:, 0]
    scores = torch.randn(batch, generator=generator)  # (B,)
    dense = torch.randn(batch, width, generator=generator) * 0.01 * mask  # (B, T)
    return {
        "token_rewards": dense + place_scores(scores, lengths, width),
        "values": torch.randn(batch, width, generator=generator),
        "gae_mask": mask,
        "gae_holes_mask": holes,
        "scores": scores,
        "outcome_rewards": place_scores(scores, lengths, width),
        "group_ids": torch.arange(batch) // GROUP_SIZE,
        "gamma": GAMMA,
        "lam": LAM,
    }


def median_seconds(fn: Callable[[], object], *, repeats: int) -> dict[str, float]:
    """Median wall-clock and CPU (process) seconds of `repeats` calls after a warm-up."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"seconds": statistics.median(wall), "cpu_seconds": statistics.median(cpu)}


Case = dict[str, Tensor | float]  # output tensors by name, plus "seconds" and "cpu_seconds"


def run_ppoflow(inputs: dict[str, Tensor | float], *, repeats: int) -> dict[str, Case]:
    """Our float64 outputs (for parity) and float32 median times, named as in the verl runner."""

    def cast(dtype: torch.dtype) -> dict[str, Tensor]:
        return {
            k: v.to(dtype) if v.is_floating_point() else v
            for k, v in inputs.items()
            if isinstance(v, Tensor)
        }

    inputs32, inputs64 = cast(torch.float32), cast(torch.float64)
    out: dict[str, Case] = {}
    for case in ("gae", "gae_holes"):

        def run(x: dict[str, Tensor], mask_name: str = case + "_mask") -> AdvantageOutput:
            return gae(
                token_rewards=x["token_rewards"],
                values=x["values"],
                response_mask=x[mask_name],
                gamma=GAMMA,
                lam=LAM,
            )

        result = run(inputs64)
        times = median_seconds(lambda run=run: run(inputs32), repeats=repeats)
        out[case] = {"advantages": result.advantages, "returns": result.returns, **times}

    def run_grpo(x: dict[str, Tensor]) -> Tensor:
        return grpo_advantage(
            scores=x["scores"], group_ids=x["group_ids"], response_mask=x["gae_mask"]
        ).advantages

    times = median_seconds(lambda: run_grpo(inputs32), repeats=repeats)
    out["grpo"] = {"advantages": run_grpo(inputs64), **times}
    return out


def run_verl(
    python: Path, inputs: dict[str, Tensor | float], *, repeats: int, threads: int
) -> dict[str, Case]:
    """verl's outputs and median times, from a subprocess of its venv."""
    with tempfile.TemporaryDirectory(prefix="ppoflow-bench-") as tmp:
        in_path, out_path, script = Path(tmp) / "in.pt", Path(tmp) / "out.pt", Path(tmp) / "run.py"
        torch.save(inputs, in_path)
        script.write_text(VERL_RUNNER)
        done = subprocess.run(
            [str(python), str(script), str(in_path), str(out_path), str(repeats), str(threads)],
            capture_output=True,
            text=True,
            timeout=1800,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        if done.returncode != 0:
            raise RuntimeError(f"verl runner exited {done.returncode}: {done.stderr[-2000:]}")
        loaded: dict[str, Case] = torch.load(out_path)
        return loaded


def max_diff(ours: Tensor | float, theirs: Tensor | float, mask: Tensor | float) -> float:
    """Largest |difference| over real tokens (verl leaves carried values on masked positions)."""
    assert isinstance(ours, Tensor) and isinstance(theirs, Tensor) and isinstance(mask, Tensor)
    return float((ours.double() - theirs.double())[mask].abs().max())


def compare(
    ours: dict[str, Case], verl: dict[str, Case], inputs: dict[str, Tensor | float]
) -> dict[str, float]:
    """Max |diff| per case over real tokens: advantages (and returns for GAE)."""
    diffs = {}
    for case in ("gae", "gae_holes", "grpo"):
        mask = inputs["gae_mask" if case == "grpo" else case + "_mask"]
        names = ("advantages",) if case == "grpo" else ("advantages", "returns")
        diffs[case] = max(max_diff(ours[case][n], verl[case][n], mask) for n in names)
    return diffs


def table_rows(
    ours: dict[str, Case], verl: dict[str, Case] | None, diffs: dict[str, float]
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for case in ("gae", "gae_holes", "grpo"):
        mine, mine_cpu = float(ours[case]["seconds"]), float(ours[case]["cpu_seconds"])
        theirs = float(verl[case]["seconds"]) if verl is not None else None
        theirs_cpu = float(verl[case]["cpu_seconds"]) if verl is not None else None
        rows.append(
            {
                "case": case,
                "ppoflow_ms": round(mine * 1e3, 3),
                "verl_ms": round(theirs * 1e3, 3) if theirs is not None else None,
                "speedup": round(theirs / mine, 2) if theirs is not None else None,
                "ppoflow_cpu_ms": round(mine_cpu * 1e3, 3),
                "verl_cpu_ms": round(theirs_cpu * 1e3, 3) if theirs_cpu is not None else None,
                "cpu_speedup": round(theirs_cpu / mine_cpu, 2) if theirs_cpu else None,
                "max_abs_diff": diffs.get(case),
                "parity_ok": diffs[case] <= TOLERANCE if case in diffs else None,
            }
        )
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    header = ["case", "ppoflow ms", "verl ms", "speedup", "cpu speedup", "max |diff|"]
    print(
        f"{header[0]:<11}{header[1]:>12}{header[2]:>10}{header[3]:>9}{header[4]:>13}{header[5]:>12}  parity"
    )
    for row in rows:
        cells = [
            f"{row['case']:<11}",
            f"{row['ppoflow_ms']:>12.2f}",
            f"{row['verl_ms']:>10.2f}" if row["verl_ms"] is not None else f"{'-':>10}",
            f"{row['speedup']:>8.1f}x" if row["speedup"] is not None else f"{'-':>9}",
            f"{row['cpu_speedup']:>12.1f}x" if row["cpu_speedup"] is not None else f"{'-':>13}",
            f"{row['max_abs_diff']:>12.1e}" if row["max_abs_diff"] is not None else f"{'-':>12}",
            f"  {row['parity_ok']}",
        ]
        print("".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads on both sides (1 is the most repeatable on a shared machine)",
    )
    parser.add_argument("--skip-verl", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    # 1. Inputs, and ppoflow's timings (the machine may be shared: its load is recorded).
    torch.set_num_threads(args.threads)
    load_start = round(os.getloadavg()[0], 2)
    inputs = make_inputs(batch=args.batch, width=args.width, seed=0)
    ours = run_ppoflow(inputs, repeats=args.repeats)
    # 2. verl in its own venv, on the same inputs.
    verl: dict[str, Case] | None = None
    reason = "skipped (--skip-verl)"
    if not args.skip_verl:
        python, reason = ensure_verl_venv(log_path=VERL_VENV.parent / "verl-install.log")
        if python is not None:
            try:
                verl = run_verl(python, inputs, repeats=args.repeats, threads=args.threads)
                reason = f"verl {VERL_VERSION} ({reason} venv)"
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                reason = f"verl runner failed: {error}"
    # 3. ppoflow again after verl (machine load drifts); keep the lower of the two medians.
    again = run_ppoflow(inputs, repeats=args.repeats)
    for case, result in ours.items():
        for key in ("seconds", "cpu_seconds"):
            result[key] = min(float(result[key]), float(again[case][key]))
    # 4. Parity, table, JSON.
    diffs = compare(ours, verl, inputs) if verl is not None else {}
    rows = table_rows(ours, verl, diffs)
    gae_speedup = rows[0]["speedup"]
    met = isinstance(gae_speedup, float) and gae_speedup >= GAE_TARGET
    report = {
        "shape": {"B": args.batch, "T": args.width, "group_size": GROUP_SIZE},
        "gamma": GAMMA,
        "lam": LAM,
        "repeats": args.repeats,
        "timing": "median wall-clock (and CPU process time) of repeats after a warm-up, float32; "
        "ppoflow timed before and after verl, the lower median kept",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "load_average_1m_start_end": [load_start, round(os.getloadavg()[0], 2)],
        },
        "verl": {"available": verl is not None, "detail": reason},
        "tolerance": TOLERANCE,
        "results": rows,
        "target": {"gae_speedup_at_least": GAE_TARGET, "met": met},
    }
    print(f"B={args.batch} T={args.width}; {reason}")
    print_table(rows)
    print(f"GAE >= {GAE_TARGET}x faster than verl: {met}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
