"""The pipeline benchmark's report: medians over the timed steps of every round, the flow's
overhead over direct calls and where it goes, ppoflow against TRL, the printed table, and the
description of the method written into the JSON."""

from __future__ import annotations

import statistics
from typing import Any

from .settings import OVERHEAD_TARGET, SPEEDUP_TARGET, STAGES


def pooled(results: list[dict[str, Any]], key: str) -> list[float]:
    return [v for r in results if r.get("ok") and r.get(key) for v in r[key]]


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the timed steps of every round (ms), tokens/s, peak memory, load."""
    ok = [r for r in results if r.get("ok")]
    failures = [r.get("reason") for r in results if not r.get("ok")]
    if not ok:
        return {"ok": False, "reason": "; ".join(str(f) for f in failures)}
    step, tokens = statistics.median(pooled(ok, "step_s")), statistics.median(pooled(ok, "tokens"))
    peaks = [r["peak_rss_mb"] for r in ok]
    out: dict[str, Any] = {
        "ok": True,
        "step_ms": round(1e3 * step, 1),
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / step, 1),
        "cpu_ms_per_step": round(1e3 * statistics.median(r["cpu_s_per_step"] for r in ok), 1),
        "own_turn_cpu_ms_per_step": round(
            1e3
            * statistics.median(r.get("own_turn_cpu_s_per_step", r["cpu_s_per_step"]) for r in ok),
            1,
        ),
        "peak_rss_mb": {k: max(p[k] for p in peaks) for k in peaks[0]},
        "rounds": [
            {
                "step_ms": round(1e3 * statistics.median(r["step_s"]), 1),
                "load_avg_before_after": [
                    round(x, 2) for x in (*r["load_avg"][0], *r["load_avg"][1])
                ],
                "wall_s": round(r["wall_s"], 1),
            }
            for r in ok
        ],
        "failed_rounds": failures,
    }
    if "iteration_s" in ok[0]:
        out["iteration_ms"] = round(1e3 * statistics.median(pooled(ok, "iteration_s")), 1)
        stages = {s: [v for r in ok for v in r["stages_s"][s]] for s in STAGES}
        out["stages_ms"] = {s: round(1e3 * statistics.median(v), 1) for s, v in stages.items()}
        if pooled(ok, "store_s"):
            out["store_ms"] = round(1e3 * statistics.median(pooled(ok, "store_s")), 2)
    for key in ("prompt_width", "peak_rss_self_mb", "versions", "settings"):
        if key in ok[0]:
            out[key] = ok[0][key]
    return out


def overhead(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Flow vs direct on paired steps (step k of each variant ran back to back): the median of
    per-step ratios, and where the difference goes (medians of per-step differences, ms)."""
    rounds = [
        (f, s, d)
        for f, s, d in zip(raw["flow"], raw["ray+store"], raw["direct"])
        if f["ok"] and s["ok"] and d["ok"]
    ]
    if not rounds:
        return {"available": False}

    def median_over_pairs(fn: Any, scale: float = 1e3) -> float:
        values = [fn(f, s, d, k) for f, s, d in rounds for k in range(len(d["step_s"]))]
        return round(scale * statistics.median(values), 1)

    step_pct = median_over_pairs(lambda f, s, d, k: f["step_s"][k] / d["step_s"][k] - 1, 100)

    def median_over_rounds(key: str) -> float:
        return round(100 * statistics.median(f[key] / d[key] - 1 for f, _, d in rounds), 1)

    cpu_pct, own_cpu_pct = (
        median_over_rounds("cpu_s_per_step"),
        median_over_rounds("own_turn_cpu_s_per_step"),
    )
    staged_pct = median_over_pairs(lambda f, s, d, k: s["step_s"][k] / d["step_s"][k] - 1, 100)
    return {
        "available": True,
        "step_pct": step_pct,
        "own_turn_cpu_pct": own_cpu_pct,
        "cpu_pct_upper_bound": cpu_pct,
        "wall_pairing_trusted": staged_pct > -100 * OVERHEAD_TARGET,
        "iteration_pct": median_over_pairs(
            lambda f, s, d, k: f["iteration_s"][k] / d["iteration_s"][k] - 1, 100
        ),
        "ray_store_vs_direct_pct": staged_pct,
        "by_stage_ms": {
            st: median_over_pairs(
                lambda f, s, d, k, st=st: f["stages_s"][st][k] - d["stages_s"][st][k]
            )
            for st in STAGES
        },
        "parts_ms": {
            "store": median_over_pairs(lambda f, s, d, k: s["store_s"][k]),
            "ray_and_loop_bookkeeping": median_over_pairs(
                lambda f, s, d, k: s["iteration_s"][k] - d["iteration_s"][k] - s["store_s"][k]
            ),
            "prefect_tasks": median_over_pairs(
                lambda f, s, d, k: f["iteration_s"][k] - s["iteration_s"][k]
            ),
            "per_step_reporting": median_over_pairs(
                lambda f, s, d, k: f["step_s"][k] - f["iteration_s"][k]
            ),
        },
        "target_pct": 100 * OVERHEAD_TARGET,
        "met": max(step_pct, own_cpu_pct) <= 100 * OVERHEAD_TARGET,
    }


def compare(
    ours: dict[str, Any], theirs: dict[str, Any], target: float = SPEEDUP_TARGET
) -> dict[str, Any]:
    if not (ours.get("ok") and theirs.get("ok")):
        return {"speedup": None, "met": None, "reason": theirs.get("reason") or ours.get("reason")}
    speedup = ours["tokens_per_s"] / theirs["tokens_per_s"]
    return {
        "cpu_speedup_own_turns": round(
            theirs["cpu_ms_per_step"] / ours["own_turn_cpu_ms_per_step"], 2
        ),
        "cpu_speedup_with_background": round(
            theirs["cpu_ms_per_step"] / ours["cpu_ms_per_step"], 2
        ),
        "speedup": round(speedup, 2),
        "target": target,
        "met": speedup >= target,
    }


def best(rows: dict[str, dict[str, Any]]) -> tuple[str | None, dict[str, Any]]:
    """The row with the most tokens/s (name, row); (None, a failed row) when none ran."""
    done = {name: row for name, row in rows.items() if row.get("ok")}
    if not done:
        return None, {"ok": False, "reason": "no run of this side finished"}
    name = max(done, key=lambda n: done[n]["tokens_per_s"])
    return name, done[name]


def fmt(value: Any, spec: str = ".0f", width: int = 9) -> str:
    return f"{value:>{width}{spec}}" if isinstance(value, int | float) else f"{'-':>{width}}"


def print_report(report: dict[str, Any]) -> None:
    s = report["settings"]
    print(
        f"\nms; medians of {s['steps']} steps x {s['rounds']} rounds after {s['warmup']} warm-up; "
        f"torch threads {s['torch_threads']}; RSS = driver + ModelWorker actors, tree = all processes"
    )
    head = "".join(f"{name[:9]:>10}" for name in STAGES)
    print(
        f"{'mode':<5}{'system':<11}{head}{'iter':>7}{'step':>7}{'cpuOwn':>7}{'cpuAll':>7}{'tok/s':>7}"
        f"{'RSS MB':>8}{'tree MB':>8}"
    )
    for mode, block in report["results"].items():
        if "ppoflow" not in block:  # the variable-length mode: its own table below
            continue
        machine = block.get("machine", {})
        rows = [*block["ppoflow"].items(), (block["trl_name"], block["trl"])]
        rows += [*machine.get("ppoflow", {}).items()]
        rows += [("trl@all", machine["trl@all"])] if machine else []
        for name, row in rows:
            if not row.get("ok"):
                print(f"{mode:<5}{name:<11}failed: {row.get('reason')}")
                continue
            stages = "".join(fmt(row.get("stages_ms", {}).get(n), width=10) for n in STAGES)
            mem = row["peak_rss_mb"]
            print(
                f"{mode:<5}{name:<11}{stages}{fmt(row.get('iteration_ms'), width=7)}"
                f"{fmt(row['step_ms'], width=7)}{fmt(row['own_turn_cpu_ms_per_step'], width=7)}"
                f"{fmt(row['cpu_ms_per_step'], width=7)}"
                f"{fmt(row['tokens_per_s'], width=7)}"
                f"{fmt(mem.get('system'), width=8)}{fmt(mem.get('tree'), width=8)}"
            )
    for mode, block in report["results"].items():
        if "ppoflow" not in block:
            print_varlen(mode, block)
            continue
        o, c = block["overhead"], block["vs_trl"]
        if o["available"]:
            print(
                f"{mode}: flow vs direct per step: wall {o['step_pct']:+.1f}%, CPU in own turns "
                f"{o['own_turn_cpu_pct']:+.1f}%, CPU with background {o['cpu_pct_upper_bound']:+.1f}%; "
                f"target <= {o['target_pct']:.0f}%: {o['met']}; ms: {o['parts_ms']}"
                + (
                    ""
                    if o["wall_pairing_trusted"]
                    else "; direct slower than ray+store: wall disturbed"
                )
            )
        print(
            f"{mode}: ppoflow flow tokens/s / TRL = {c['speedup']} (CPU/step: {c.get('cpu_speedup_own_turns')} own turns, "
            f"{c.get('cpu_speedup_with_background')} with background) "
            f"(target >= {SPEEDUP_TARGET}: {c['met']}{'; ' + str(c.get('reason')) if c.get('reason') else ''})"
        )
        if "machine" in block:
            m = block["machine"]
            print(
                f"{mode}: each run alone ({m['threads']} CPUs): best ppoflow ({m['best_ppoflow']}) "
                f"tokens/s / best TRL ({m['best_trl']}) = {m['vs_trl']['speedup']} "
                f"(target >= {SPEEDUP_TARGET}: {m['vs_trl']['met']})"
            )


METHOD = (
    "ppoflow's three variants start together and take turns step by step (direct, ray+store, "
    "flow, direct, ...); a step is timed from taking the turn to its end (flow: its metrics row "
    "logged); overhead = median over paired steps of flow / direct - 1. TRL runs alone (before "
    "ppoflow in every second round); its step is the time between consecutive on_step_end. "
    "Medians pool --rounds rounds. iteration = ppoflow's timing_s/step (no per-step reporting). "
    "tokens/s = generated tokens per step / median step. cpu = CPU seconds per timed step of "
    "the whole process tree (user + system, reaped children included, from /proc): robust to "
    "load, and it charges a system for the work it leaves running between its steps (Prefect's "
    "server, Ray's daemons), which wall time on paired turns hands to the next variant. Peak "
    "RSS sampled every 0.5 s from /proc: system = driver + Ray ModelWorker actors (TRL: its "
    "process), tree = every descendant process (Ray daemons, idle Ray workers, Prefect's "
    "temporary server)."
)


def length_stats(lengths: list[int]) -> dict[str, float]:
    """Mean, median, 90th percentile, min, max of response lengths, and how many hit the cap."""
    ordered = sorted(lengths)
    if not ordered:
        return {}
    at = lambda q: ordered[min(int(q * len(ordered)), len(ordered) - 1)]  # noqa: E731
    return {
        "count": len(ordered),
        "mean": round(statistics.fmean(ordered), 1),
        "p50": statistics.median(ordered),
        "p90": at(0.9),
        "min": ordered[0],
        "max": ordered[-1],
    }


def _mean_s(values: list[float]) -> float:
    return round(statistics.fmean(values), 3) if values else 0.0


def ppoflow_breakdown(ok: list[dict[str, Any]], asynchronous: bool) -> dict[str, Any]:
    """Mean seconds per timed step of each stage (``timing_s/*``). Sync: generate, score,
    logprobs, advantage, update in turn. ``separate_async``: the training loop waits for the
    producer (``wait_rollout``) and runs logprobs, advantage, update, while generate and score
    of the next step run on the producer's thread (``overlapped``, not on the step's path).
    ``other`` = step - the stages on the path (reporting, the flow's bookkeeping, weight sync
    outside the update's timing)."""
    stages = {s: _mean_s([v for r in ok for v in r["stages_s"].get(s, [])]) for s in STAGES}
    wait = _mean_s([v for r in ok for v in r["stages_s"].get("wait_rollout", [])])
    step = _mean_s(pooled(ok, "step_s"))
    if asynchronous:
        path = {"wait_rollout": wait, **{s: stages[s] for s in STAGES[2:]}}
        overlapped = {s: stages[s] for s in STAGES[:2]}
    else:
        path, overlapped = stages, {}
    other = round(step - sum(path.values()), 3)
    return {"step": step, "path": {**path, "other": other}, "overlapped": overlapped}


def trl_breakdown(ok: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean seconds per timed step of GRPOTrainer's phases (see ``peers/trl_grpo.py``):
    generate, score (reward model), rollout_other (the rest of ``_generate_and_score_completions``),
    loss_forward, backward (``training_step`` less the rollout and loss forward), and
    optimizer_and_rest (the step less ``training_step``: optimizer, callbacks, logging)."""

    def phase(name: str) -> list[float]:
        return [v for r in ok for v in r.get("phases_s", {}).get(name, [])]

    step = pooled(ok, "step_s")
    gen, score, rollout = phase("generate"), phase("score"), phase("rollout")
    forward, train_step = phase("loss_forward"), phase("training_step")
    if not (gen and rollout and train_step):
        return {"step": _mean_s(step), "path": {}}
    path = {
        "generate": _mean_s(gen),
        "score": _mean_s(score),
        "rollout_other": _mean_s([r - g - s for r, g, s in zip(rollout, gen, score)]),
        "loss_forward": _mean_s(forward),
        "backward": _mean_s([t - r - f for t, r, f in zip(train_step, rollout, forward)]),
        "optimizer_and_rest": _mean_s([s - t for s, t in zip(step, train_step)]),
    }
    return {"step": _mean_s(step), "path": path, "overlapped": {}}


def summarise_varlen(results: list[dict[str, Any]], *, system: str) -> dict[str, Any]:
    """``summarise`` plus what the variable-length mode reports: tokens/s as all generated
    response tokens (EOS included, no padding) over all timed steps' wall seconds, the length
    statistics of every timed response, and where a step's time goes (mean seconds)."""
    out = summarise(results)
    ok = [r for r in results if r.get("ok")]
    if not out.get("ok"):
        return out
    tokens, seconds = sum(pooled(ok, "tokens")), sum(pooled(ok, "step_s"))
    out["tokens_per_s_median_step"] = out["tokens_per_s"]
    out["tokens_per_s"] = round(tokens / seconds, 1)
    out["tokens_total"], out["seconds_total"] = tokens, round(seconds, 2)
    out["tokens_per_step"] = round(tokens / len(pooled(ok, "step_s")), 1)
    out["lengths"] = length_stats([n for r in ok for step in r.get("lengths") or [] for n in step])
    if system == "trl":
        out["time_s"] = trl_breakdown(ok)
        widths = pooled(ok, "decoded_width")
        out["decode_steps_per_generate"] = round(statistics.fmean(widths), 1) if widths else None
    else:
        out["time_s"] = ppoflow_breakdown(ok, asynchronous="async" in system)
    return out


def print_varlen(mode: str, block: dict[str, Any]) -> None:
    """The variable-length mode's table: per system its step, tokens/s, response lengths and
    where the step's time goes; then the ratio of the best of each side."""
    m = block["machine"]
    rows = [*m["ppoflow"].items(), *m["trl"].items()]
    print(
        f"\n{mode}: {'system':<16}{'step s':>8}{'tok/step':>9}{'tok/s':>8}"
        f"{'len mean':>9}{'p50':>6}{'p90':>6}{'max':>6}  time per step (s)"
    )
    for name, row in rows:
        if not row.get("ok"):
            print(f"{mode}: {name:<16}failed: {row.get('reason')}")
            continue
        lengths, time_s = row.get("lengths", {}), row.get("time_s", {})
        parts = ", ".join(f"{k} {v:.2f}" for k, v in time_s.get("path", {}).items())
        if time_s.get("overlapped"):
            parts += "; overlapped: " + ", ".join(
                f"{k} {v:.2f}" for k, v in time_s["overlapped"].items()
            )
        print(
            f"{mode}: {name:<16}{time_s.get('step', 0):>8.2f}"
            f"{fmt(row['tokens_per_step'], width=9)}{fmt(row['tokens_per_s'], width=8)}"
            f"{fmt(lengths.get('mean'), '.1f')}{fmt(lengths.get('p50'), width=6)}"
            f"{fmt(lengths.get('p90'), width=6)}{fmt(lengths.get('max'), width=6)}  {parts}"
        )
    for key, best_key in (("vs_trl", "best_trl"), ("vs_trl_vllm", "best_trl_vllm")):
        c = m.get(key)
        if c is None:
            continue
        why = "" if c.get("speedup") is not None else f"; {c.get('reason')}"
        print(
            f"{mode}: each run alone ({m['threads']} CPUs): best ppoflow ({m['best_ppoflow']}) "
            f"tokens/s / best {best_key.removeprefix('best_')} ({m.get(best_key)}) = "
            f"{c.get('speedup')} (target >= {VARLEN_TARGETS[key]}: {c.get('met')}{why})"
        )


# grpo-varlen's goals: ppoflow's best against TRL with transformers' generate, and against TRL
# with vLLM generating.
VARLEN_TARGETS = {"vs_trl": 3.0, "vs_trl_vllm": 1.5}

VARLEN_METHOD = (
    "Variable-length mode: each system runs alone with the whole machine; tokens/s = all "
    "generated response tokens of the timed steps (up to and including EOS, no padding) / "
    "their summed wall seconds (a step: from one step's end to the next, ppoflow's from taking "
    "the turn to its metrics row; TRL's between consecutive on_step_end). Lengths are every "
    "timed response's (ppoflow: as its score task sees them; TRL: its generate output cut at "
    "the first EOS). Time per step = mean seconds: ppoflow's timing_s/* stage times (other = "
    "step - stages on the step's path); TRL's phases timed by wrapping the policy's generate, "
    "_calculate_rewards, _generate_and_score_completions, compute_loss and training_step."
)
