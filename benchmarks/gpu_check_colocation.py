"""GPU check: one colocated PPO iteration's peak CUDA memory vs the components side by side.

The point of colocation: the rollout engine, the reward model, the actor (with optimizer state),
the reference and the critic take turns on one device, so the peak is about the largest of them,
not their sum. This script builds a small policy and reward model (transformers, saved and loaded
back with from_pretrained), then on one CUDA device:

1. "side by side": loads every role awake at once and runs the same iteration; records the peak.
2. "colocated": a ``ModelWorker`` whose roles sleep (weights and optimizer state offloaded to CPU)
   except the one working; records the peak of generate → score → logprobs/values → update.

    python benchmarks/gpu_check_colocation.py [--out benchmarks/results/gpu_check_colocation.json]

Without CUDA it prints that it skipped and exits 0. Well under 10 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _build(root: Path, hidden: int, layers: int) -> Any:
    from infra.assets import TinyModelSpec, build_tiny_assets

    spec = TinyModelSpec(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=8,
        intermediate_size=4 * hidden,
        max_positions=128,
    )
    return build_tiny_assets(root, seed=0, policy=spec, reward=spec)


def _iteration(
    worker: Any, prompts: Any, samples: Any, n: int, prompt_fields: dict[str, Any]
) -> dict[str, float]:
    """One iteration of the stages' worker-side steps through the worker's in-process store,
    from the sample rows holding only their prompts' fields."""
    from tasks.generate.stage import generate_rows
    from tasks.io import nested, rows
    from tasks.logprobs.stage import forward_rows
    from tasks.score.stage import score_rows
    from tasks.update.stage import actor_settings, critic_settings, update_rows

    keys, partition = list(samples.keys), samples.partition_id
    worker.store.kv_clear(partition, keys)
    worker.store.kv_batch_put(keys, partition, prompt_fields)
    t0 = time.perf_counter()
    worker.run(generate_rows, prompts, n=n, seed=0, first_group=0)
    worker.run(score_rows, samples, rule=None, texts=False)
    worker.run(forward_rows, samples, names=("old_logprobs", "ref_logprobs", "values"))
    responses = worker.store.kv_batch_get(keys, partition, ["response_ids"])["response_ids"]
    adv = nested([torch.ones(len(r)) for r in rows(responses)])
    worker.store.kv_batch_put(keys, partition, {"advantages": adv, "returns": adv})
    names = ("prompt_ids", "response_ids", "old_logprobs", "ref_logprobs", "advantages")
    worker.run(
        update_rows,
        samples,
        step=worker.version,
        reads=(*names, "values", "returns"),
        actor=actor_settings(worker.cfg, 1),
        critic=critic_settings(worker.cfg, 1),
    )
    torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - t0}


def _measure(assets: Any, *, colocated: bool, prompts_n: int, n: int) -> dict[str, float]:
    from infra.config import load_config
    from infra.workers import ModelWorker, WorkerSpec
    from storage import BatchMeta, open_store
    from tasks.generate.stage import sample_meta
    from tasks.io import nested

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    batch = prompts_n * n
    cfg = load_config(
        None,
        [
            "resources.device=cuda",
            "rollout.max_new_tokens=64",
            "rollout.min_new_tokens=64",
            f"rollout.n={n}",
            "algorithm.estimator=gae",
            "algorithm.kl.loss_coef=0.01",
            f"actor.mini_batch_size={batch}",
            f"actor.micro_batch_size={batch}",
            f"critic.mini_batch_size={batch}",
            f"critic.micro_batch_size={batch}",
        ],
    )
    store = open_store("memory://gpu-check")
    spec = WorkerSpec(
        roles=("rollout", "reward", "actor", "ref", "critic"),
        cfg=cfg,
        policy_path=str(assets.policy),
        tokenizer_path=str(assets.tokenizer),
        reward_model_path=str(assets.reward_model),
        critic_path=str(assets.critic),
        store_url=store.url,
    )
    worker = ModelWorker(spec)
    if not colocated:  # every role awake at once: what separate processes/devices would hold
        for role in spec.roles:
            worker.group._models[role].wake_up()  # noqa: SLF001 - deliberate: bypass the turn-taking
        worker.group = _AllAwake(worker.group)
    tok = worker.tokenizer
    messages = [[{"role": "user", "content": f"{10 + i}+{20 + i}="}] for i in range(prompts_n)]
    ids = [
        torch.tensor(
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        for m in messages
    ]
    prompts = BatchMeta("gpu-check", tuple(f"p{i}/0" for i in range(prompts_n)))
    samples = sample_meta(prompts, n)
    prompt_fields = {
        "prompt_ids": nested([p for p in ids for _ in range(n)]),
        "raw_prompt": [m for m in messages for _ in range(n)],
    }
    _iteration(worker, prompts, samples, n, prompt_fields)  # warm-up (allocator, kernels)
    torch.cuda.reset_peak_memory_stats()
    timing = _iteration(worker, prompts, samples, n, prompt_fields)
    peak = torch.cuda.max_memory_allocated() - base
    del worker
    store.close()
    torch.cuda.empty_cache()
    return {"peak_gib": peak / 2**30, **timing}


class _AllAwake:
    """A stand-in group whose ``awake`` keeps every model on the device (no turn-taking)."""

    def __init__(self, group: Any) -> None:
        self.inner = group
        self.stats: dict[str, float] = {}

    def awake(self, role: str) -> Any:
        from contextlib import nullcontext

        return nullcontext(self.inner._models[role])  # noqa: SLF001

    def awake_roles(self) -> list[str]:
        return list(self.inner._models)  # noqa: SLF001

    def pop_stats(self) -> dict[str, float]:
        return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check_colocation.json"
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check_colocation: no CUDA device; skipped")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        assets = _build(Path(tmp), args.hidden, args.layers)
        side = _measure(assets, colocated=False, prompts_n=8, n=4)
        colo = _measure(assets, colocated=True, prompts_n=8, n=4)
    params = {"hidden": args.hidden, "layers": args.layers, "device": torch.cuda.get_device_name(0)}
    result = {
        "params": params,
        "side_by_side": side,
        "colocated": colo,
        "ratio": colo["peak_gib"] / side["peak_gib"],
    }
    print(f"{'run':<14}{'peak GiB':>10}{'iteration s':>13}")
    for name in ("side_by_side", "colocated"):
        print(f"{name:<14}{result[name]['peak_gib']:>10.3f}{result[name]['seconds']:>13.2f}")
    print(f"colocated / side-by-side peak: {result['ratio']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
