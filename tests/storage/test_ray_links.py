"""How the Ray store reaches its shards: shared memory on this node, Ray's object store otherwise.

Checks that the local path is really taken (the shards count requests per transport), that the
forced fallback works, that every field kind round-trips bit for bit on both, that reusing an
arena never shows up in stored or returned data, and that no shared memory outlives its use.
"""

from __future__ import annotations

import gc
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from storage import ConflictError, SchemaError, Store, StoreError, StoreTimeout, open_store
from storage.ray_backend import RayStore, _link
from storage.ray_shard import shard_of
from storage.shm import MEMFD_NAME

STORES = ["ray_store", "ray_object_store"]


def _counts(store: Store) -> Counter[str]:
    """Requests the store's shards have served, per verb and transport, summed over shards."""
    import ray

    assert isinstance(store, RayStore)
    total: Counter[str] = Counter()
    for shard in store._shards:
        total.update(json.loads(ray.get(shard.stats.remote(), timeout=30))["counts"])
    return total


def _shard_pids(store: Store) -> list[int]:
    import ray

    assert isinstance(store, RayStore)
    return [json.loads(ray.get(s.stats.remote(), timeout=30))["pid"] for s in store._shards]


def _arena_fds(pid: int | str = "self") -> int:
    """Open descriptors of a process that point at an arena (a live mapping holds one too)."""
    found = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found += f"memfd:{MEMFD_NAME}" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed while listing
            continue
    return found


def _arena_maps(pid: int | str = "self") -> int:
    return Path(f"/proc/{pid}/maps").read_text().count(f"memfd:{MEMFD_NAME}")


def _eventually(check: Callable[[], bool], seconds: float = 15) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def _every_kind(n: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    lengths = [0, *torch.randint(1, 9, (n - 1,), generator=g).tolist()]  # an empty row first
    scores = torch.randn(n, generator=g)
    scores[1], scores[2] = float("nan"), -0.0  # bitwise comparison must keep both
    return {
        "scores": scores,
        "hidden": torch.randn(n, 2, 3, generator=g).to(torch.bfloat16),
        "prompt_ids": [torch.randint(-(2**40), 2**40, (k,), generator=g) for k in lengths],
        "loss_mask": [torch.rand(k, generator=g) > 0.5 for k in lengths],
        "kl_terms": [torch.randn(k, generator=g, dtype=torch.float64) for k in lengths],
        "raw_prompt": [[{"role": "user", "content": f"{i} · ünïcode ✓"}] for i in range(n)],
        "ground_truth": [None if i % 3 == 0 else {"answer": i, "ok": i % 2 == 0} for i in range(n)],
    }


def _bits(tensor: torch.Tensor) -> list[int]:
    """A tensor's elements as integers of the same width (NaN, -0.0 and bfloat16 compared exactly)."""
    wide = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8).tolist()
    return flat.view(wide[flat.element_size()]).tolist()


def _assert_same(got: Any, want: dict[str, Any], order: list[int]) -> None:
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[name].dtype == value.dtype and _bits(got[name]) == _bits(value[order]), name
        elif isinstance(value[0], torch.Tensor):
            rows = [got[name][i] for i in range(len(order))]
            assert [_bits(r) for r in rows] == [_bits(value[i]) for i in order], name
            assert all(r.dtype == value[0].dtype for r in rows), name
        else:
            assert got.get(name).tolist() == [value[i] for i in order], name


def test_shards_on_this_node_are_reached_through_shared_memory(ray_store: Store, pid: str) -> None:
    assert isinstance(ray_store, RayStore) and ray_store.transports == ["shm", "shm"]
    before = _counts(ray_store)
    keys = [f"k{i}" for i in range(20)]  # both shards: a two-phase put
    ray_store.kv_batch_put(keys, pid, {"scores": torch.arange(20.0)})
    ray_store.kv_batch_put(["k0"], pid, {"group_ids": torch.zeros(1, dtype=torch.int64)})
    assert ray_store.kv_batch_get(keys, pid, ["scores"], timeout=5)["scores"].tolist() == list(
        map(float, range(20))
    )
    served = _counts(ray_store) - before
    assert served["prepare:shm"] == 2 and served["commit:shm"] == 2 and served["put:shm"] == 1
    assert served["get:shm"] == 2
    assert not [verb for verb in served if verb.endswith(":object_store")]


@pytest.mark.parametrize("fixture", STORES)
def test_a_shards_process_holds_rows_without_loading_torch(
    fixture: str, pid: str, request: pytest.FixtureRequest
) -> None:
    """Rows go into and out of a shard as numpy (jagged, dense and object fields, over either
    transport): its process never loads torch."""
    store: Store = request.getfixturevalue(fixture)
    keys = [f"t{i}" for i in range(6)]  # both shards
    ids = torch.nested.nested_tensor([torch.arange(i + 1) for i in range(6)], layout=torch.jagged)
    store.kv_batch_put(keys, pid, {"prompt_ids": ids, "scores": torch.arange(6.0)})
    store.kv_batch_put(keys[:1], pid, {"raw_prompt": ["what is 2+2?"]})
    got = store.kv_batch_get(keys, pid, ["prompt_ids", "scores"], timeout=5)
    assert [row.tolist() for row in got["prompt_ids"].unbind()] == [
        list(range(i + 1)) for i in range(6)
    ]
    for shard_pid in _shard_pids(store):
        maps = Path(f"/proc/{shard_pid}/maps").read_text()
        assert "libtorch" not in maps, f"shard process {shard_pid} loaded torch"


@pytest.mark.parametrize("fixture", STORES)
def test_a_one_shard_put_is_one_request_once_its_specs_hold_on_every_shard(
    fixture: str, pid: str, request: pytest.FixtureRequest
) -> None:
    """The first put of a field goes through every shard (fixing its spec there); later
    one-shard puts of it are one request to that shard."""
    store = request.getfixturevalue(fixture)
    keys = [f"k{i}" for i in range(20)]
    owner = shard_of(keys, 2).tolist()
    left = [key for key, s in zip(keys, owner) if s == 0][:2]
    right = [key for key, s in zip(keys, owner) if s == 1][:1]
    path = "shm" if fixture == "ray_store" else "object_store"
    before = _counts(store)
    store.kv_batch_put(left[:1], pid, {"pp_new": torch.zeros(1)})  # refused by shard 0, then 2PC
    store.kv_batch_put(left[1:], pid, {"pp_new": torch.ones(1)})
    store.kv_batch_put(right, pid, {"pp_new": torch.full((1,), 2.0)})
    served = _counts(store) - before
    assert served[f"put:{path}"] == 3 and served[f"prepare:{path}"] == 2
    got = store.kv_batch_get([*left, *right], pid, ["pp_new"], timeout=5)["pp_new"]
    assert got.tolist() == [0.0, 1.0, 2.0]


def test_the_object_store_path_is_used_when_forced(ray_object_store: Store, pid: str) -> None:
    assert isinstance(ray_object_store, RayStore)
    assert ray_object_store.transports == ["object_store", "object_store"]
    assert ray_object_store.url.endswith("&transport=object_store")  # kept when pickled
    before = _counts(ray_object_store)
    ray_object_store.kv_batch_put(["a"], pid, {"scores": torch.ones(1)})
    assert ray_object_store.kv_batch_get(["a"], pid, ["scores"], timeout=5)["scores"].tolist() == [
        1.0
    ]
    served = _counts(ray_object_store) - before
    assert served["put:object_store"] == 1 and served["get:object_store"] == 1
    assert not [verb for verb in served if verb.endswith(":shm")]


def test_transport_must_be_known_and_shm_can_be_insisted_on(ray_store: Store, pid: str) -> None:
    with pytest.raises(StoreError, match="transport must be one of"):
        open_store("ray://anything?transport=pigeon")
    strict = open_store(ray_store.url + "&transport=shm")
    assert isinstance(strict, RayStore) and strict.transports == ["shm", "shm"]
    strict.kv_batch_put(["a"], pid, {"scores": torch.ones(1)})
    assert ray_store.kv_list(pid) == {"a": ["scores"]}
    strict.close()


@pytest.mark.parametrize(
    ("node", "socket", "why"),
    [("another-node", "ppoflow-x", "another node"), (None, "ppoflow-gone", "socket failed")],
)
def test_shards_out_of_local_reach_fall_back_to_ray_calls(
    ray_store: Store, node: str | None, socket: str, why: str
) -> None:
    import ray

    assert isinstance(ray_store, RayStore)
    here = ray.get_runtime_context().get_node_id()
    config = {"index": 0, "node": node or here, "socket": socket}
    actor = ray_store._shards[0]
    assert _link(actor, config, "auto", "ray://x", 1).transport == "object_store"
    with pytest.raises(StoreError, match=why):
        _link(actor, config, "shm", "ray://x", 1)


@pytest.mark.parametrize("which", STORES)
def test_every_kind_round_trips_bit_for_bit(
    which: str, pid: str, request: pytest.FixtureRequest
) -> None:
    store: Store = request.getfixturevalue(which)
    batch = _every_kind(12, seed=3)
    keys = [f"r{i}" for i in range(12)]
    store.kv_batch_put(keys, pid, batch)
    order = [5, 0, 11, 3, 7, 1, 2, 10, 4, 9, 6, 8]
    got = store.kv_batch_get([keys[i] for i in order], pid, list(batch), timeout=5)
    _assert_same(got, batch, order)
    one = store.kv_batch_get(keys[:1], pid, list(batch), timeout=5)  # the empty rows alone
    assert one["prompt_ids"].offsets().tolist() == [0, 0]


def test_reusing_an_arena_never_reaches_stored_or_returned_rows(ray_store: Store, pid: str) -> None:
    first, second = _every_kind(8, seed=1), _every_kind(8, seed=2)
    a_keys, b_keys = [f"a{i}" for i in range(8)], [f"b{i}" for i in range(8)]
    ray_store.kv_batch_put(a_keys, pid, first)
    ray_store.kv_batch_put(b_keys, pid, second)  # written over the same arena bytes
    got_a = ray_store.kv_batch_get(a_keys, pid, list(first), timeout=5)
    got_b = ray_store.kv_batch_get(b_keys, pid, list(second), timeout=5)  # ditto, on the way out
    _assert_same(got_a, first, list(range(8)))
    _assert_same(got_b, second, list(range(8)))
    got_a["scores"].fill_(7.0)  # the caller owns what it got: writable, shared with no one
    again = ray_store.kv_batch_get(a_keys, pid, ["scores"], timeout=5)
    assert _bits(again["scores"]) == _bits(first["scores"])


def test_no_shared_memory_outlives_puts_gets_errors_timeouts_and_close(
    ray_local: object, pid: str
) -> None:
    owner = open_store(f"ray://leaks-{uuid.uuid4().hex[:6]}?shards=2&timeout=5")
    shard_pids = _shard_pids(owner)
    baseline = {p: (_arena_fds(p), _arena_maps(p)) for p in shard_pids}  # the owner's connections
    mine = (_arena_fds(), _arena_maps())
    guest = open_store(owner.url)
    assert isinstance(guest, RayStore)
    keys = [f"k{i}" for i in range(10)]
    guest.kv_batch_put(keys, pid, _every_kind(10, seed=4))
    assert all(_arena_fds(p) > baseline[p][0] for p in shard_pids)  # the guest's connections
    guest.kv_batch_get(keys, pid, ["prompt_ids", "raw_prompt"], timeout=5)
    with pytest.raises(ConflictError):
        guest.kv_batch_put(keys, pid, {"scores": torch.zeros(10)})
    with pytest.raises(SchemaError):
        guest.kv_batch_put(keys, pid, {"scores": torch.zeros(10, dtype=torch.int32)})
    with pytest.raises(StoreTimeout):
        guest.kv_batch_get(["nowhere"], pid, ["scores"], timeout=0.2)
    stuck = guest._links[0].get(pid, ["nowhere"], ["scores"], 1.0)  # the shard waits 1 s ...
    with pytest.raises(StoreTimeout, match="did not answer"):
        stuck.result(0.05, pid)  # ... the client gives up first and drops the connection
    guest.close()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("ppoflow")]
    gc.collect()
    assert (_arena_fds(), _arena_maps()) == mine
    for p in shard_pids:  # the shards closed every connection of the guest, the stuck one too
        assert _eventually(lambda p=p: (_arena_fds(p), _arena_maps(p)) == baseline[p]), p
    owner.close()


def test_gets_waiting_on_both_transports_hold_no_pool_and_wake_on_a_put(
    ray_store: Store, pid: str
) -> None:
    """A shard's waiting gets, on its socket threads and on its event loop, hold no worker pool:
    with 24 gets waiting for data that does not come, 24 more are answered by a put on either
    path while the first 24 still wait."""
    from concurrent.futures import ThreadPoolExecutor

    over_ray = open_store(f"{ray_store.url}&transport=object_store")
    before = _counts(ray_store)
    late, soon = [f"late{i}" for i in range(4)], [f"soon{i}" for i in range(4)]

    def wait(store: Store, keys: list[str]) -> list[float]:
        return store.kv_batch_get(keys, pid, ["scores"], timeout=60)["scores"].tolist()

    def asked(keys: list[str]) -> int:  # requests per get: one per shard holding a key
        return 12 * len(set(shard_of(keys, 2).tolist()))

    with ThreadPoolExecutor(max_workers=48) as pool:
        stores = [ray_store, over_ray] * 12
        waiting = [pool.submit(wait, s, late) for s in stores]
        answered = [pool.submit(wait, s, soon) for s in stores]
        deadline = time.monotonic() + 30
        while True:
            served = _counts(ray_store) - before
            if served["get:object_store"] == served["get:shm"] == asked(late) + asked(soon):
                break
            assert time.monotonic() < deadline, f"the gets did not reach the shards: {served}"
            time.sleep(0.05)
        over_ray.kv_batch_put(soon, pid, {"scores": torch.arange(4.0)})
        assert all(f.result(timeout=30) == [0.0, 1.0, 2.0, 3.0] for f in answered)
        assert not any(f.done() for f in waiting)  # still waiting, yet they blocked no one
        ray_store.kv_batch_put(late, pid, {"scores": torch.ones(4)})
        assert all(f.result(timeout=30) == [1.0] * 4 for f in waiting)
    over_ray.close()
