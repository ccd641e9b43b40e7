"""Benchmark: put and get through ppoflow's store, its Ray backend, raw Ray, and TransferQueue.

Run:  .venv/bin/python benchmarks/store.py [--repeats 15] [--skip-tq]

Batches hold `prompt_ids` (jagged int64 token ids) and `old_logprobs` (jagged float32 of the
same lengths), passed as `torch.jagged` nested tensors:

    a: 256 rows, lengths uniform in 64..1024      b: 2048 such rows
    c: 256 rows, lengths uniform in 4096..16384

Systems, all in one run (medians of repeats, each repeat a fresh partition; the Ray-side systems
take turns repeat by repeat, so the ratios between them see the same machine):

- memcpy bound: `torch.cat` of the same rows, both fields (what any copy costs);
- embedded: `memory://` put and get;
- ray 2 shards / ray 1 shard: `ray://`, driven from a separate process (a Ray actor client) on
  the shards' node, so data goes through shared memory (`transport=auto`);
- ray 1 shard, object store: the same with `transport=object_store`, the path clients on other
  nodes take (Ray actor calls, data through Ray's object store);
- raw ray: one packed numpy buffer (both fields' values and offsets) through the object store:
  `ray.put` in the client, and `ray.get` in the client of a buffer another process put
  (a zero-copy view: the floor for any Ray transfer);
- raw ray, back to back: the same put and get, each timed in a tight loop of its own rather than
  taking turns with the other systems (warm caches: raw Ray's best case, the way earlier runs
  measured it);
- raw ray get + TensorDict: that get, then the TensorDict a store get returns (both fields as
  `torch.jagged` nested tensors) built over the fetched buffer without copying it, by the store's
  own `to_tensordict`: what returning the store's types costs on top of the floor (no put row);
- embedded, in the Ray client: a `memory://` store in the client actor's process, taking turns
  with the systems above: the same lookup, copy and TensorDict as any store get, with no
  cross-process step at all. Its get against raw Ray's is the ceiling for any Ray-backend get
  with the store's contract (private, writable tensors in a TensorDict of the requested keys);
- transferqueue 0.1.11: runs in its own venv, `benchmarks/.venvs/tq` (built on first use:
  `python3 -m venv`, `pip install torch==2.13.0 numpy`, then `transferqueue==0.1.11`), as a
  subprocess of that venv that prints JSON. If it cannot be installed or run in bounded time,
  the table says why and the rest is still measured.

Prints a table and writes `benchmarks/results/store.json`. Numbers on a shared machine are
noisy: the JSON records the load average next to them.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TQ_VENV = ROOT / "benchmarks" / ".venvs" / "tq"
TQ_VERSION = "0.1.11"
RESULTS = ROOT / "benchmarks" / "results" / "store.json"
CASES = {"a": (256, 64, 1024), "b": (2048, 64, 1024), "c": (256, 4096, 16384)}
FIELDS = ("prompt_ids", "old_logprobs")
Timings = dict[str, dict[str, float]]  # case -> {"put": s, "get": s, "bytes": n}


# -- data and timing (imported by the peer venv too: stdlib + torch only) -------------------------


def make_batch(case: str, seed: int = 0) -> dict[str, Any]:
    """The case's fields as NJTs, plus its keys and byte count."""
    import torch

    rows, low, high = CASES[case]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (rows,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    total = int(offsets[-1])
    ids = torch.randint(0, 50_000, (total,), generator=g)
    logprobs = -torch.rand(total, generator=g)
    njt = torch.nested.nested_tensor_from_jagged
    return {
        "fields": {"prompt_ids": njt(ids, offsets), "old_logprobs": njt(logprobs, offsets)},
        "lengths": lengths.tolist(),
        "bytes": total * (8 + 4) + 2 * offsets.numel() * 8,
    }


def median_time(run: Callable[[int], float], repeats: int, warmup: int = 2) -> float:
    """Median of `run(i)`, which returns the seconds of its timed section."""
    for i in range(warmup):
        run(-1 - i)
    return statistics.median(run(i) for i in range(repeats))


def time_put_get(
    put: Callable[[int], object],
    get: Callable[[int], object],
    clear: Callable[[int], object],
    repeats: int,
) -> dict[str, float]:
    """Median put and get seconds; repeat i puts, gets, then (untimed) clears partition i."""
    puts, gets = [], []
    for i in range(-2, repeats):  # two warm-up repeats
        start = time.perf_counter()
        put(i)
        middle = time.perf_counter()
        get(i)
        puts.append(middle - start)
        gets.append(time.perf_counter() - middle)
        clear(i)
    return {"put": statistics.median(puts[2:]), "get": statistics.median(gets[2:])}


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


# -- systems in this venv -----------------------------------------------------------------------


def _memcpy_case(case: str, repeats: int) -> dict[str, float]:
    import torch

    batch = make_batch(case)
    rows = [list(value.unbind()) for value in batch["fields"].values()]

    def copy_rows(_: int) -> float:
        return _timed(lambda: [torch.cat(parts) for parts in rows])

    seconds = median_time(copy_rows, repeats)
    return {"put": seconds, "get": seconds, "bytes": batch["bytes"]}


def bench_memcpy(repeats: int) -> Timings:
    return {case: _memcpy_case(case, repeats) for case in CASES}


def _store_case(store: Any, case: str, repeats: int) -> dict[str, float]:
    batch = make_batch(case)
    trial = _store_trial(store, case, batch)
    assert trial.put is not None
    return {**time_put_get(trial.put, trial.get, trial.clear, repeats), "bytes": batch["bytes"]}


def bench_store(url: str, repeats: int) -> Timings:
    """put/get medians of a store URL, in this process."""
    from storage import open_store

    store = open_store(url)
    return {case: _store_case(store, case, repeats) for case in CASES}


def _check(meta: Any, store: Any, batch: dict[str, Any]) -> None:
    """A benchmark that returns wrong data measures nothing: compare once per case."""
    import torch

    td = store.kv_batch_get(list(meta.keys), meta.partition_id, FIELDS, timeout=60)
    for name in FIELDS:
        assert torch.equal(td[name].values(), batch["fields"][name].values()), name
        assert td[name].offsets().diff().tolist() == batch["lengths"], name


@dataclass
class Trial:
    """How one system puts, gets and clears repeat i of a case (`put` None: it has no put)."""

    put: Callable[[int], object] | None
    get: Callable[[int], object]
    clear: Callable[[int], object] = lambda i: None


def interleaved(systems: dict[str, Trial], repeats: int) -> dict[str, dict[str, float | None]]:
    """Median put and get seconds per system; each repeat runs every system once, in turn.

    Taking turns repeat by repeat, not system after system, gives every system the same share of
    the machine's slow and fast spells (its speed drifts by 15-20 % over minutes), so the ratios
    between systems hold even when the absolute numbers move between runs.
    """
    puts: dict[str, list[float]] = {name: [] for name in systems}
    gets: dict[str, list[float]] = {name: [] for name in systems}
    for i in range(-2, repeats):  # two warm-up repeats
        for name, trial in systems.items():
            if trial.put is not None:
                start = time.perf_counter()
                trial.put(i)
                puts[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            trial.get(i)
            gets[name].append(time.perf_counter() - start)
            trial.clear(i)
    return {
        name: {
            "put": statistics.median(puts[name][2:]) if puts[name] else None,
            "get": statistics.median(gets[name][2:]),
        }
        for name in systems
    }


def _store_trial(store: Any, case: str, batch: dict[str, Any]) -> Trial:
    keys = [f"sample-{j}" for j in range(len(batch["lengths"]))]
    _check(store.kv_batch_put(keys, "bench/check", batch["fields"]), store, batch)
    store.kv_clear("bench/check")
    return Trial(
        lambda i: store.kv_batch_put(keys, f"bench/{case}/{i}", batch["fields"]),
        lambda i: store.kv_batch_get(keys, f"bench/{case}/{i}", FIELDS, timeout=60),
        lambda i: store.kv_clear(f"bench/{case}/{i}"),
    )


def _raw_trials(
    batch: dict[str, Any], repeats: int, holder: Any
) -> tuple[dict[str, Trial], Callable[[], dict[str, float]]]:
    """Raw Ray: `ray.put` of one packed buffer here, `ray.get` here of a copy `holder` put; and
    that get followed by the store's TensorDict of the batch, built over the buffer (no copy).
    Also raw Ray's put and get timed back to back, each in a loop of its own."""
    import warnings

    import numpy as np
    import ray

    from storage.columnar import Column
    from storage.convert import to_tensordict
    from storage.schema import FieldSpec

    parts, layout, start = [], [], 0
    for value in batch["fields"].values():
        for array in (value.values().numpy(), value.offsets().numpy()):
            parts.append(array.view(np.uint8))
            layout.append((start, array.dtype, array.size))
            start += array.nbytes
    packed = np.concatenate(parts)
    specs = [FieldSpec.jagged(value.dtype) for value in batch["fields"].values()]
    refs = [ray.get(holder.hold_copy.remote(packed), timeout=60)[0] for _ in range(repeats + 2)]
    more = [ray.get(holder.hold_copy.remote(packed), timeout=60)[0] for _ in range(repeats + 2)]

    def get_as_tensordict(i: int) -> Any:
        buffer = ray.get(more[i], timeout=60)
        views = [np.frombuffer(buffer, dtype, n, offset) for offset, dtype, n in layout]
        columns = {
            name: Column(spec, views[2 * j], views[2 * j + 1])
            for j, (name, spec) in enumerate(zip(FIELDS, specs))
        }
        with warnings.catch_warnings():  # Ray's buffers are read-only; torch warns once
            warnings.simplefilter("ignore")
            return to_tensordict(columns, len(batch["lengths"]))

    def back_to_back() -> dict[str, float]:
        """Raw Ray's put and get each in a tight loop of its own (warm caches: its best case)."""
        put = median_time(lambda _: _timed(lambda: ray.put(packed)), repeats)
        hot = [ray.get(holder.hold_copy.remote(packed), timeout=60)[0] for _ in range(repeats + 2)]
        get = median_time(lambda i: _timed(lambda: ray.get(hot[i], timeout=60)), repeats)
        return {"put": put, "get": get}

    td = get_as_tensordict(-1)
    assert td["old_logprobs"].offsets().diff().tolist() == batch["lengths"]
    trials = {
        "raw ray": Trial(lambda i: ray.put(packed), lambda i: ray.get(refs[i], timeout=60)),
        "raw ray get + TensorDict": Trial(None, get_as_tensordict),
    }
    return trials, back_to_back


def bench_ray_side(repeats: int) -> dict[str, Timings]:
    """The Ray backend (2 and 1 shards, the object-store path) and raw Ray, driven from a client
    actor in another process, taking turns repeat by repeat (`interleaved`)."""
    import ray

    sys.path.insert(0, str(ROOT))
    from storage import open_store

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        holder = ray.remote(num_cpus=0)(_Holder).remote()
        client = ray.remote(num_cpus=0)(_Client).remote(str(ROOT))
        stores, urls = [], {}
        for shards, transport, name in (
            (2, "auto", "ray 2 shards"),
            (1, "auto", "ray 1 shard"),
            (1, "object_store", "ray 1 shard, object store"),
        ):
            url = f"ray://bench-{shards}-{transport}?shards={shards}&timeout=120"
            stores.append(open_store(f"{url}&transport={transport}"))
            urls[name] = stores[-1].url
        by_case = {
            case: ray.get(client.run.remote(urls, case, repeats, holder), timeout=1800)
            for case in CASES
        }
        for store in stores:
            store.close()
        return {name: {case: by_case[case][name] for case in CASES} for name in by_case["a"]}
    finally:
        ray.shutdown()


class _Holder:
    """Puts buffers from its own process, so the client's ray.get reads a foreign object."""

    def hold_copy(self, array: Any) -> list[Any]:
        import numpy as np
        import ray

        return [ray.put(np.array(array))]


class _Client:
    """Runs the Ray-side measurements in a process of its own."""

    def __init__(self, root: str) -> None:
        sys.path.insert(0, root)

    def run(self, urls: dict[str, str], case: str, repeats: int, holder: Any) -> Timings:
        from storage import open_store

        batch = make_batch(case)
        trials = {name: _store_trial(open_store(url), case, batch) for name, url in urls.items()}
        trials["embedded, in the Ray client"] = _store_trial(open_store("memory://"), case, batch)
        raw, back_to_back = _raw_trials(batch, repeats, holder)
        timings = interleaved({**trials, **raw}, repeats)
        timings["raw ray, back to back"] = {**back_to_back()}
        return {name: {**t, "bytes": batch["bytes"]} for name, t in timings.items()}


# -- TransferQueue in its own venv -----------------------------------------------------------------


def _run(cmd: list[str], timeout: float) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout)[-800:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({done.returncode}): {tail}")


def ensure_tq_venv() -> Path:
    """The TQ venv's python, building the venv on first use (bounded by timeouts)."""
    python = TQ_VENV / "bin" / "python"
    marker = TQ_VENV / ".installed"
    if marker.exists():
        return python
    _run([sys.executable, "-m", "venv", str(TQ_VENV)], timeout=300)
    pip = [str(python), "-m", "pip", "install", "-q"]
    _run(pip + ["torch==2.13.0", "numpy"], timeout=1800)
    _run(pip + [f"transferqueue=={TQ_VERSION}"], timeout=1800)
    marker.write_text(TQ_VERSION)
    return python


def bench_tq(repeats: int) -> dict[str, Any]:
    """TransferQueue's timings, or why it is unavailable."""
    try:
        python = ensure_tq_venv()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "tq.json"
            cmd = [str(python), __file__, "--tq-peer", str(out), "--repeats", str(repeats)]
            _run(cmd, timeout=900)
            return {"available": True, "timings": json.loads(out.read_text())}
    except (RuntimeError, OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:1000]}


def _tq_case(tq: Any, case: str, repeats: int) -> dict[str, float]:
    from tensordict import TensorDict

    batch = make_batch(case)
    keys = [f"sample-{j}" for j in range(len(batch["lengths"]))]
    fields = TensorDict(batch["fields"], batch_size=[len(keys)])
    timings = time_put_get(
        lambda i: tq.kv_batch_put(keys=keys, partition_id=f"bench-{case}-{i}", fields=fields),
        lambda i: tq.kv_batch_get(
            keys=keys, partition_id=f"bench-{case}-{i}", select_fields=list(FIELDS)
        ),
        lambda i: tq.kv_clear(keys=keys, partition_id=f"bench-{case}-{i}"),
        repeats,
    )
    return {**timings, "bytes": batch["bytes"]}


def tq_peer(out: Path, repeats: int) -> None:
    """Runs inside the TQ venv: time TransferQueue's KV API on the same batches."""
    import ray
    import transfer_queue as tq

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    tq.init()
    try:
        out.write_text(json.dumps({case: _tq_case(tq, case, repeats) for case in CASES}))
    finally:
        tq.close()
        ray.shutdown()


# -- report -------------------------------------------------------------------------------------


def targets(systems: dict[str, Any]) -> dict[str, Any]:
    """Each target of the issue with the measured ratio and whether it is met."""
    tq = systems["transferqueue"].get("timings")
    raw = systems["raw ray"]["a"]
    found: dict[str, Any] = {}

    def ratio(name: str, value: float, goal: float) -> None:
        found[name] = {"ratio": round(value, 2), "goal": goal, "met": value >= goal}

    for op in ("put", "get"):
        if tq:
            ratio(
                f"embedded {op} vs TQ on (a), x faster",
                tq["a"][op] / systems["embedded"]["a"][op],
                20,
            )
    for name in ("ray 2 shards", "ray 1 shard"):
        mine = systems[name]["a"]
        for op in ("put", "get"):
            if tq:
                ratio(f"{name} {op} vs TQ on (a), x faster", tq["a"][op] / mine[op], 5)
            ratio(f"{name} {op} vs raw ray on (a), speed ratio", raw[op] / mine[op], 0.7)
        warm = systems["raw ray, back to back"]["a"]["get"]
        ratio(f"{name} get vs raw ray back to back on (a), speed ratio", warm / mine["get"], 0.7)
        same_type = systems["raw ray get + TensorDict"]["a"]["get"]
        ratio(
            f"{name} get vs raw ray get + TensorDict on (a), speed ratio",
            same_type / mine["get"],
            0.7,
        )
        trip = (raw["put"] + raw["get"]) / (mine["put"] + mine["get"])
        ratio(f"{name} put+get vs raw ray on (a), speed ratio", trip, 0.7)
    ceiling = systems["embedded, in the Ray client"]["a"]["get"]
    ratio(
        "ceiling: embedded get in the Ray client vs raw ray on (a), speed ratio",
        raw["get"] / ceiling,
        0.7,
    )
    for name in ("memcpy bound", "embedded", "ray 2 shards", "ray 1 shard"):
        t = systems[name]
        for op in ("put", "get"):
            per_byte = (t["b"][op] / t["b"]["bytes"]) / (t["a"][op] / t["a"]["bytes"])
            found[f"{name} {op}: (b) per byte / (a) per byte"] = {
                "ratio": round(per_byte, 2), "goal": "<= 2", "met": per_byte <= 2,
            }  # fmt: skip
    return found


def _ms(seconds: float | None) -> str:
    return f"{'-':>11}" if seconds is None else f"{seconds * 1e3:>11.2f}"


def table(systems: dict[str, Any]) -> str:
    lines = [
        f"{'system':<30}" + "".join(f"{c + ' put':>11}{c + ' get':>11}" for c in CASES) + "   (ms)"
    ]
    for name, timings in systems.items():
        if name == "transferqueue":
            if not timings["available"]:
                lines.append(f"{name:<30}unavailable: {timings['reason'][:120]}")
                continue
            timings = timings["timings"]
        cells = "".join(f"{_ms(timings[c]['put'])}{_ms(timings[c]['get'])}" for c in CASES)
        lines.append(f"{name:<30}{cells}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--skip-tq", action="store_true")
    parser.add_argument("--tq-peer", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tq_peer:
        tq_peer(args.tq_peer, args.repeats)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.path.insert(0, str(ROOT))
    systems: dict[str, Any] = {"memcpy bound": bench_memcpy(args.repeats)}
    systems["embedded"] = bench_store("memory://", args.repeats)
    systems.update(bench_ray_side(args.repeats))
    skipped = {"available": False, "reason": "skipped (--skip-tq)"}
    systems["transferqueue"] = skipped if args.skip_tq else bench_tq(args.repeats)
    report = {
        "cases": {c: dict(zip(("rows", "min_len", "max_len"), v)) for c, v in CASES.items()},
        "repeats": args.repeats,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg": os.getloadavg(),
        },
        "seconds": systems,
        "targets": targets(systems),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(table(systems))
    for name, target in report["targets"].items():
        print(
            f"{'met ' if target['met'] else 'MISS'}  {name}: {target['ratio']} (goal {target['goal']})"
        )
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
