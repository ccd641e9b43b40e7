"""Benchmark: who carries a step's sample data, the flow process or the workers.

Run:  .venv/bin/python benchmarks/data_path.py [--samples 512] [--tokens 1024] [--repeats 5]

One training step's data path at a large shape (default 512 samples, responses of 1024 tokens,
64 prompts of 8 samples with prompts of 64..128 tokens), through the real store (`ray://`, one
shard, shared memory on this node) and real Ray actors, with the model compute left out so that
only the moving of data is timed. The five stages read and write the fields they do in a GRPO+KL
step with a critic (generate, score, logprobs, advantage, update); every worker-side step
touches the rows it gets (a multiply per value) so nothing is skipped.

Two paths, taking turns repeat by repeat on the same Ray instance and store:

- `workers read the store` (the pipeline's path): the flow process sends each of 2 workers its
  `BatchMeta` shard; the worker gets its rows from the store, computes and puts its results; only
  handles go out and only small replies (metrics, versions) come back;
- `flow process carries the data` (the path of a controller that does the store traffic
  itself): the flow process gets every field from the store, sends each worker its shard as
  numpy buffers in the Ray call, gets the results back and puts them.

Bytes the flow process moves are counted per step: for the first path the pickled size of the
call arguments and replies; for the second, the arrays it gets from and puts to the store plus
the arrays and pickles of the calls. Prints a table and writes
`benchmarks/results/data_path.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from storage import BatchMeta, open_store  # noqa: E402

WORKERS = 2
N_PER_PROMPT = 8
# stage: (fields read, fields written as (name, kind)); kinds: token-float, token-bool,
# token-int (a new response), dense-float, dense-int.
STAGES: dict[str, tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = {
    "generate": (
        ("prompt_ids",),
        (
            ("response_ids", "token-int"),
            ("rollout_logprobs", "token-float"),
            ("group_ids", "dense-int"),
        ),
    ),
    "score": (("prompt_ids", "response_ids"), (("rm_scores", "token-float"),)),
    "logprobs": (
        ("prompt_ids", "response_ids"),
        (
            ("old_logprobs", "token-float"),
            ("ref_logprobs", "token-float"),
            ("values", "token-float"),
        ),
    ),
    "advantage": (
        ("response_ids", "old_logprobs", "ref_logprobs", "values", "rm_scores"),
        (
            ("response_mask", "token-bool"),
            ("token_rewards", "token-float"),
            ("advantages", "token-float"),
            ("returns", "token-float"),
        ),
    ),
    "update": (
        (
            "prompt_ids",
            "response_ids",
            "old_logprobs",
            "ref_logprobs",
            "advantages",
            "values",
            "returns",
        ),
        (),
    ),
}


def _nested(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def outputs(
    writes: tuple[tuple[str, str], ...], data: dict[str, Any], tokens: int
) -> dict[str, Any]:
    """A stage's results computed from what it read: every value read is touched once."""
    if "response_ids" in data:
        lengths = data["response_ids"].offsets().diff()
        touched = sum(
            float(v.values().float().mul_(0.5).sum()) for v in data.values() if v.is_nested
        )
    else:  # generate: a full-length response per sample of each prompt
        prompts = data["prompt_ids"]
        touched = float(prompts.values().float().sum())
        count = (len(prompts.offsets()) - 1) * N_PER_PROMPT
        lengths = torch.full((count,), tokens, dtype=torch.int64)
    count, total = len(lengths), int(lengths.sum())
    out: dict[str, Any] = {}
    for name, kind in writes:
        if kind == "token-int":
            out[name] = _nested(torch.randint(0, 1000, (total,)), lengths)
        elif kind == "token-float":
            out[name] = _nested(torch.full((total,), touched % 1.0, dtype=torch.float32), lengths)
        elif kind == "token-bool":
            out[name] = _nested(torch.ones(total, dtype=torch.bool), lengths)
        elif kind == "dense-int":
            out[name] = torch.arange(count, dtype=torch.int64)
        else:
            out[name] = torch.zeros(count)
    return out


def _columns(value: Any) -> list[np.ndarray]:
    if isinstance(value, torch.Tensor) and value.is_nested:
        return [value.values().numpy(), value.offsets().numpy()]
    return [value.numpy()] if isinstance(value, torch.Tensor) else []


def _from_columns(cols: list[np.ndarray]) -> Any:
    if len(cols) == 2:
        return torch.nested.nested_tensor_from_jagged(
            torch.from_numpy(cols[0].copy()), torch.from_numpy(cols[1].copy())
        )
    return torch.from_numpy(cols[0].copy())


def _take(value: Any, sl: slice) -> list[np.ndarray]:
    """A shard of a store value as numpy columns (what a controller would ship)."""
    if value.is_nested:
        offsets = value.offsets().numpy()
        lo, hi = int(offsets[sl.start]), int(offsets[sl.stop])
        return [value.values().numpy()[lo:hi], offsets[sl.start : sl.stop + 1] - lo]
    return [value.numpy()[sl]]


def _concat(parts: list[list[np.ndarray]]) -> Any:
    if len(parts[0]) == 1:
        return torch.from_numpy(np.concatenate([p[0] for p in parts]))
    values = np.concatenate([p[0] for p in parts])
    offsets, base = [np.zeros(1, dtype=np.int64)], 0
    for p in parts:
        offsets.append(p[1][1:] + base)
        base += int(p[1][-1])
    return _nested(torch.from_numpy(values), torch.from_numpy(np.diff(np.concatenate(offsets))))


class DataWorker:
    """A worker with the store handle; the model compute is replaced by ``outputs``."""

    def __init__(self, url: str, tokens: int) -> None:
        torch.set_num_threads(1)
        self.store = open_store(url)
        self.tokens = tokens

    def step(self, meta: BatchMeta, stage: str, write_keys: tuple[str, ...]) -> dict[str, float]:
        reads, writes = STAGES[stage]
        td = self.store.kv_batch_get(list(meta.keys), meta.partition_id, list(reads), timeout=60)
        out = outputs(writes, {name: td[name] for name in reads}, self.tokens)
        if out:
            self.store.kv_batch_put(list(write_keys), meta.partition_id, out)
        return {"rows": float(len(meta.keys))}

    def step_carried(
        self, columns: dict[str, list[np.ndarray]], stage: str
    ) -> dict[str, list[np.ndarray]]:
        reads, writes = STAGES[stage]
        data = {name: _from_columns(columns[name]) for name in reads}
        return {name: _columns(value) for name, value in outputs(writes, data, self.tokens).items()}


def _nbytes(obj: Any) -> int:
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return sum(int(c.nbytes) for c in _columns(obj))
    return len(pickle.dumps(obj))


def submit(store: Any, partition: str, samples: int, seed: int) -> tuple[BatchMeta, BatchMeta]:
    """Prompts for ``samples // 8`` groups: (prompt keys, sample keys)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = samples // N_PER_PROMPT
    keys = [f"u{i}/{j}" for i in range(prompts) for j in range(N_PER_PROMPT)]
    lengths = torch.randint(64, 129, (prompts,), generator=gen).repeat_interleave(N_PER_PROMPT)
    ids = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
    store.kv_batch_put(keys, partition, {"prompt_ids": _nested(ids, lengths)})
    return BatchMeta(partition, tuple(keys[::N_PER_PROMPT])), BatchMeta(partition, tuple(keys))


def step_workers(
    ray: Any, workers: list[Any], prompts: BatchMeta, samples: BatchMeta
) -> tuple[float, int]:
    """One step where each worker reads and writes its own rows; (seconds, driver bytes)."""
    start, moved = time.perf_counter(), 0
    for stage in STAGES:
        source = prompts if stage == "generate" else samples
        calls = []
        for w, shard in zip(workers, source.shards(len(workers)), strict=True):
            keys = tuple(
                f"{k.rsplit('/', 1)[0]}/{j}" for k in shard.keys for j in range(N_PER_PROMPT)
            )
            args = (shard, stage, keys if stage == "generate" else shard.keys)
            moved += len(pickle.dumps(args))
            calls.append(w.step.remote(*args))
        replies = ray.get(calls, timeout=600)
        moved += len(pickle.dumps(replies))
    return time.perf_counter() - start, moved


def step_carried(
    ray: Any, store: Any, workers: list[Any], prompts: BatchMeta, samples: BatchMeta
) -> tuple[float, int]:
    """One step where the flow process does every store get and put; (seconds, driver bytes)."""
    start, moved = time.perf_counter(), 0
    for stage, (reads, writes) in STAGES.items():
        source = prompts if stage == "generate" else samples
        td = store.kv_batch_get(list(source.keys), source.partition_id, list(reads), timeout=60)
        data = {name: td[name] for name in reads}
        moved += _nbytes(data)
        size, extra = divmod(len(source.keys), len(workers))
        bounds = [0]
        for i in range(len(workers)):
            bounds.append(bounds[-1] + size + (1 if i < extra else 0))
        calls = []
        for i, w in enumerate(workers):
            sl = slice(bounds[i], bounds[i + 1])
            shard = {name: _take(value, sl) for name, value in data.items()}
            moved += _nbytes(shard)
            calls.append(w.step_carried.remote(shard, stage))
        results = ray.get(calls, timeout=600)
        moved += _nbytes(results)
        if writes:
            out = {name: _concat([r[name] for r in results]) for name, _ in writes}
            moved += _nbytes(out)
            store.kv_batch_put(list(samples.keys), samples.partition_id, out)
    return time.perf_counter() - start, moved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "data_path.json"
    )
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    tmp = tempfile.mkdtemp(prefix="ppoflow-datapath-")
    ray.init(
        address="local", num_cpus=4, include_dashboard=False, _temp_dir=tmp, log_to_driver=False
    )
    store = open_store("ray://bench-datapath?shards=1")
    try:
        remote = ray.remote(num_cpus=1)(DataWorker)
        workers = [remote.remote(store.url, args.tokens) for _ in range(WORKERS)]
        paths = {
            "workers read the store": lambda p, s: step_workers(ray, workers, p, s),
            "flow process carries the data": lambda p, s: step_carried(ray, store, workers, p, s),
        }
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        moved: dict[str, list[int]] = {name: [] for name in paths}
        for repeat in range(args.repeats + 1):  # the first repeat warms up and is not kept
            for index, (name, run) in enumerate(paths.items()):
                partition = f"bench/{repeat}-{index}"
                prompts, samples = submit(store, partition, args.samples, seed=repeat)
                took, count = run(prompts, samples)
                store.kv_clear(partition)
                if repeat:
                    seconds[name].append(took)
                    moved[name].append(count)
    finally:
        store.close()
        ray.shutdown()
    rows = {
        name: {
            "step_s_median": statistics.median(seconds[name]),
            "step_s": seconds[name],
            "driver_bytes_per_step": statistics.median(moved[name]),
        }
        for name in seconds
    }
    carried, own = rows["flow process carries the data"], rows["workers read the store"]
    result = {
        "shape": {"samples": args.samples, "response_tokens": args.tokens, "workers": WORKERS},
        "stages": {
            k: {"reads": list(r), "writes": [n for n, _ in w]} for k, (r, w) in STAGES.items()
        },
        "paths": rows,
        "speedup": carried["step_s_median"] / own["step_s_median"],
        "driver_bytes_ratio": carried["driver_bytes_per_step"] / own["driver_bytes_per_step"],
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load": os.getloadavg(),
        },
    }
    print(
        f"{args.samples} samples x {args.tokens} response tokens, {WORKERS} workers, {args.repeats} repeats"
    )
    print(f"{'path':<32}{'step ms':>10}{'driver MB/step':>16}")
    for name, row in rows.items():
        print(
            f"{name:<32}{row['step_s_median'] * 1e3:>10.1f}{row['driver_bytes_per_step'] / 2**20:>16.3f}"
        )
    print(
        f"step time: carried / own reads = {result['speedup']:.2f}; driver bytes ratio {result['driver_bytes_ratio']:.0f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
