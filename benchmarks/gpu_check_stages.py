"""GPU check of the compute stages: rollout engine, reward scorer and trainable model on CUDA.

Builds tiny-but-not-trivial assets (policy hidden 512, 8 layers) in a temporary folder, then:

1. generates with ``TransformersEngine`` on CUDA (tokens/s; greedy parity with ``generate``),
2. sleeps and wakes the engine, recording ``torch.cuda.memory_allocated`` before/after and
   checking the weights are bit-identical and sampling is unchanged after waking,
3. scores the rollouts with ``RewardScorer`` on CUDA through both tokenizer paths (parity with
   the same scorer on CPU), and sleeps/wakes it,
4. offloads an actor + Adam state with ``TrainableModel`` and runs the three in one
   ``ColocatedGroup``.

Prints a table and writes JSON (``--out``, default ``benchmarks/results/gpu_check_stages.json``).
Without CUDA it prints that it skipped and exits 0. Exits 1 when a check fails.
``--cpu-dry-run`` runs the same code paths on the CPU with the default tiny models (memory
checks become no-ops) to check the script itself on a machine without a GPU.

    python benchmarks/gpu_check_stages.py [--out PATH] [--cpu-dry-run]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DEFAULT_OUT = Path("benchmarks/results/gpu_check_stages.json")
MiB = 1024 * 1024


DEVICE = "cuda"  # "cpu" under --cpu-dry-run


def _allocated_mib() -> float:
    if DEVICE == "cpu":
        return 0.0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / MiB


def _model_mib(module: torch.nn.Module) -> float:
    return sum(t.numel() * t.element_size() for t in module.parameters()) / MiB


def _released_and_restored(awake: float, asleep: float, woken: float, model_mib: float) -> bool:
    """Sleep freed (almost) the model's bytes and wake took them back (CPU dry run: True)."""
    if DEVICE == "cpu":
        return True
    return awake - asleep >= 0.99 * model_mib and abs(woken - awake) <= 0.01 * model_mib + 1.0


def _sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def _prompts(tokenizer: Any, count: int) -> tuple[list[torch.Tensor], list[list[dict[str, str]]]]:
    raw = [[{"role": "user", "content": f"{17 * i % 1000}+{31 * i % 1000}="}] for i in range(count)]
    ids = [
        torch.tensor(
            tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False)
        )
        for m in raw
    ]
    return ids, raw


def check_engine(assets: Any, prompts: list[torch.Tensor]) -> dict[str, Any]:
    """Generation speed, greedy parity, and sleep/wake memory + bit-identity on CUDA."""
    from transformers import AutoTokenizer

    from infra.engines.hf import TransformersEngine

    result: dict[str, Any] = {}
    base = _allocated_mib()
    engine = TransformersEngine(assets.policy, device=DEVICE, eos_token_id=())
    engine.generate(prompts[:4], n=1, max_new_tokens=8, seed=0)  # warm-up
    for batch, new in ((16, 64), (64, 128)):
        _sync()
        start = time.perf_counter()
        out = engine.generate(prompts[:batch], n=4, max_new_tokens=new, seed=1)
        _sync()
        seconds = time.perf_counter() - start
        tokens = sum(r.numel() for r in out.response_ids)
        result[f"tokens_per_s/{batch}x4x{new}"] = tokens / seconds

    tokenizer = AutoTokenizer.from_pretrained(assets.tokenizer, padding_side="left")
    greedy_engine = TransformersEngine(engine.model, device=DEVICE)  # shares weights, uses EOS
    ours = greedy_engine.generate(prompts[:8], n=1, max_new_tokens=16, temperature=0.0, seed=0)
    batch_in = tokenizer.pad({"input_ids": [p.tolist() for p in prompts[:8]]}, return_tensors="pt")
    reference = engine.model.generate(
        **batch_in.to(DEVICE), do_sample=False, max_new_tokens=16, pad_token_id=0
    )[:, batch_in["input_ids"].shape[1] :].cpu()
    matches = 0
    for row, ids in enumerate(ours.response_ids):
        expected = reference[row].tolist()
        if tokenizer.eos_token_id in expected:
            expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
        matches += ids.tolist() == expected
    result["greedy_rows_matching_generate"] = f"{matches}/8"

    before = {k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()}
    sample = engine.generate(prompts[:8], n=2, max_new_tokens=16, seed=5)
    awake = _allocated_mib()
    start = time.perf_counter()
    engine.sleep()
    result["sleep_s"] = time.perf_counter() - start
    asleep = _allocated_mib()
    start = time.perf_counter()
    engine.wake_up()
    result["wake_s"] = time.perf_counter() - start
    woken = _allocated_mib()
    after = engine.model.state_dict()
    result["weights_bit_identical_after_wake"] = all(
        torch.equal(before[k], after[k].cpu()) for k in before
    )
    again = engine.generate(prompts[:8], n=2, max_new_tokens=16, seed=5)
    result["samples_identical_after_wake"] = all(
        torch.equal(a, b) for a, b in zip(sample.response_ids, again.response_ids)
    )
    result.update(mib_baseline=base, mib_awake=awake, mib_asleep=asleep, mib_after_wake=woken)
    result["model_mib"] = _model_mib(engine.model)
    result["memory_released_and_restored"] = _released_and_restored(
        awake, asleep, woken, result["model_mib"]
    )
    result["ok"] = (
        matches == 8
        and result["weights_bit_identical_after_wake"]
        and result["samples_identical_after_wake"]
        and result["memory_released_and_restored"]
    )
    engine.sleep()
    result["_responses"] = sample.response_ids
    return result


def check_reward(
    assets: Any, prompts: list[torch.Tensor], raw: list, responses: list
) -> dict[str, Any]:
    """Both tokenizer paths on CUDA agree with CPU; sleep releases and wake restores memory."""
    from infra.reward_model import RewardScorer

    result: dict[str, Any] = {}
    rows = {
        "prompt_ids": [prompts[i // 2] for i in range(len(responses))],
        "response_ids": responses,
        "raw_prompt": [raw[i // 2] for i in range(len(responses))],
    }
    ok = True
    for label, folder in (
        ("same_tokenizer", assets.reward_model),
        ("other_tokenizer", assets.reward_model_alt),
    ):
        base = _allocated_mib()
        gpu = RewardScorer(
            folder, policy_tokenizer_path=assets.tokenizer, device=DEVICE, batch_size=8
        )
        cpu = RewardScorer(folder, policy_tokenizer_path=assets.tokenizer, batch_size=8)
        start = time.perf_counter()
        scores = gpu.score(**rows).scores
        result[f"{label}/score_s"] = time.perf_counter() - start
        diff = float((scores - cpu.score(**rows).scores).abs().max())
        result[f"{label}/max_abs_diff_vs_cpu"] = diff
        awake = _allocated_mib()
        gpu.sleep()
        asleep = _allocated_mib()
        gpu.wake_up()
        woken = _allocated_mib()
        same_after = torch.equal(gpu.score(**rows).scores, scores)
        result[f"{label}/mib_awake_asleep_woken"] = [awake - base, asleep - base, woken - base]
        result[f"{label}/scores_identical_after_wake"] = same_after
        ok &= (
            diff < 1e-3
            and _released_and_restored(awake, asleep, woken, _model_mib(gpu.model))
            and same_after
            and gpu.same_tokenizer == (label == "same_tokenizer")
        )
        gpu.sleep()
    result["ok"] = ok
    return result


def check_trainable_and_group(
    assets: Any, prompts: list[torch.Tensor], raw: list
) -> dict[str, Any]:
    """Actor + Adam offload, then rollout -> reward -> actor turns in one ColocatedGroup."""
    from transformers import AutoModelForCausalLM

    from infra.colocate import ColocatedGroup, TrainableModel
    from infra.engines.hf import TransformersEngine
    from infra.reward_model import RewardScorer

    result: dict[str, Any] = {}
    base = _allocated_mib()
    actor = AutoModelForCausalLM.from_pretrained(assets.policy).to(DEVICE)
    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-4)
    group = ColocatedGroup("gpu-check")
    group.register("actor", TrainableModel(actor, optimizer, device=DEVICE))
    group.put_all_to_sleep()
    group.register("rollout", TransformersEngine(assets.policy, device=DEVICE))
    group.put_all_to_sleep()
    group.register(
        "reward",
        RewardScorer(
            assets.reward_model_alt, policy_tokenizer_path=assets.tokenizer, device=DEVICE
        ),
    )
    group.put_all_to_sleep()
    result["mib_all_asleep_initial"] = _allocated_mib() - base
    with group.awake("rollout") as engine:
        out = engine.generate(prompts[:8], n=2, max_new_tokens=32, seed=0)
    with group.awake("reward") as scorer:
        scores = scorer.score(
            prompt_ids=[prompts[i // 2] for i in range(16)],
            response_ids=out.response_ids,
            raw_prompt=[raw[i // 2] for i in range(16)],
        ).scores
    with group.awake("actor") as trainable:
        ids = torch.cat([prompts[0], out.response_ids[0]])[None].to(DEVICE)
        trainable.module(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        weight = next(actor.parameters()).detach().cpu().clone()
        result["mib_actor_awake_with_adam"] = _allocated_mib() - base
    result["mib_all_asleep_after_turns"] = _allocated_mib() - base
    with group.awake("actor"):
        result["actor_bit_identical_after_wake"] = torch.equal(
            next(actor.parameters()).detach().cpu(), weight
        )
        optimizer.step()  # state came back to the device
    result["timings"] = group.pop_stats()
    result["scores_finite"] = bool(torch.isfinite(scores).all())
    result["ok"] = (
        (DEVICE == "cpu" or result["mib_all_asleep_after_turns"] < 1.0)
        and result["actor_bit_identical_after_wake"]
        and result["scores_finite"]
    )
    return result


def _run(name: str, check: Callable[[], dict[str, Any]], report: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        result = check()
    except Exception:  # one failing check must not hide the others' results
        result = {"ok": False, "error": traceback.format_exc()}
    result["check_s"] = time.perf_counter() - start
    report[name] = {k: v for k, v in result.items() if not k.startswith("_")}
    return result


def _print_table(report: dict[str, Any]) -> None:
    print(f"{'check':<14} {'metric':<44} value")
    for name, result in report.items():
        if not isinstance(result, dict):
            continue
        for key, value in result.items():
            if key == "error":
                value = value.strip().splitlines()[-1]
            elif isinstance(value, float):
                value = f"{value:.4g}"
            print(f"{name:<14} {key:<44} {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="exercise the script on the CPU (tiny models)"
    )
    args = parser.parse_args(argv)
    global DEVICE
    if args.cpu_dry_run:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("gpu_check_stages: skipped (no CUDA device); nothing written")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from transformers import AutoTokenizer

    from infra.assets import TinyModelSpec, build_tiny_assets

    if DEVICE == "cuda":  # cuBLAS keeps a workspace once used: allocate it before any baseline
        torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory(prefix="ppoflow-gpu-check-") as tmp:
        spec = TinyModelSpec(
            hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1376, max_positions=512
        )
        if DEVICE == "cpu":
            spec = TinyModelSpec()
        assets = build_tiny_assets(Path(tmp), seed=0, policy=spec, reward=spec)
        tokenizer = AutoTokenizer.from_pretrained(assets.tokenizer)
        prompts, raw = _prompts(tokenizer, 64)
        engine = _run("engine", lambda: check_engine(assets, prompts), report)
        responses = engine.get("_responses") or [torch.tensor([tokenizer.eos_token_id])] * 16
        _run("reward", lambda: check_reward(assets, prompts, raw, responses), report)
        _run("colocate", lambda: check_trainable_and_group(assets, prompts, raw), report)
    report["ok"] = all(r.get("ok") for r in report.values() if isinstance(r, dict))
    _print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.out}; all ok: {report['ok']}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
