"""Ray-specific behaviour: named attach, ownership on close, routing, cross-shard atomicity."""

from __future__ import annotations

import time
import uuid
import zlib

import pytest
import torch

from storage import ConflictError, SchemaError, Store, StoreError, open_store
from storage.ray_backend import RayStore
from storage.ray_shard import actor_name, shard_of


def _keys_on(shard: int, n: int, prefix: str = "k") -> list[str]:
    """The first n keys `prefix<i>` that hash to `shard` of 2."""
    keys = [f"{prefix}{i}" for i in range(200)]
    return [k for k, s in zip(keys, shard_of(keys, 2).tolist()) if s == shard][:n]


def test_routing_is_a_stable_crc32() -> None:
    keys = ["a", "prompt-7/3", "é"]
    assert shard_of(keys, 3).tolist() == [zlib.crc32(k.encode()) % 3 for k in keys]


def test_a_failed_cross_shard_put_stores_nothing_on_any_shard(ray_store: Store, pid: str) -> None:
    left, right = _keys_on(0, 3), _keys_on(1, 3)
    ray_store.kv_batch_put(right[:1], pid, {"scores": torch.tensor([1.0])})
    keys = left + right
    with pytest.raises(ConflictError, match=right[0]):
        ray_store.kv_batch_put(keys, pid, {"scores": torch.zeros(6)})
    assert list(ray_store.kv_list(pid)) == right[:1]  # shard 0 staged its rows, then aborted
    with pytest.raises(SchemaError):
        ray_store.kv_batch_put(keys, pid, {"scores": torch.zeros(6, dtype=torch.float64)})
    assert list(ray_store.kv_list(pid)) == right[:1]


def test_named_store_is_shared_and_closed_by_its_creator(ray_local: object) -> None:
    import ray

    name = f"shared-{uuid.uuid4().hex[:6]}"
    owner = open_store(f"ray://{name}?shards=2&timeout=20")
    assert isinstance(owner, RayStore)
    guest = open_store(owner.url)
    guest.kv_batch_put(["a", "b", "c"], "p", {"scores": torch.arange(3.0)})
    assert owner.kv_batch_get(["c", "a"], "p", ["scores"], timeout=5)["scores"].tolist() == [
        2.0,
        0.0,
    ]
    with pytest.raises(StoreError, match="2 shards"):
        open_store(f"ray://{name}?shards=3")
    guest.close()  # an attached handle leaves the shards running
    assert owner.kv_list("p") != {}
    owner.close()
    for i in range(2):  # ray.kill is asynchronous: the name goes once the actor is dead
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ray.get_actor(actor_name(name, i), namespace="ppoflow")
            except ValueError:
                break
            time.sleep(0.05)
        with pytest.raises(ValueError):
            ray.get_actor(actor_name(name, i), namespace="ppoflow")
    with pytest.raises(StoreError, match="closed"):
        owner.kv_list("p")


def test_open_needs_a_running_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(StoreError, match="ray.init"):
        open_store("ray://nowhere")


def test_a_pickled_handle_attaches_by_url_and_cannot_kill_the_shards(
    ray_store: Store, pid: str
) -> None:
    import pickle

    copy = pickle.loads(pickle.dumps(ray_store))
    assert copy.url == ray_store.url
    copy.kv_batch_put(["a"], pid, {"scores": torch.ones(1)})
    copy.close()
    assert ray_store.kv_list(pid) == {"a": ["scores"]}


def test_memory_stores_refuse_to_be_pickled() -> None:
    import pickle

    with pytest.raises(StoreError, match="ray://"):
        pickle.dumps(open_store("memory://"))


@pytest.mark.parametrize("transport", ["auto", "object_store"])
def test_a_lost_shard_names_its_partition_and_keys_and_recover_makes_it_anew(
    ray_local: object, transport: str
) -> None:
    import pickle

    from storage import ShardLost, StoreTimeout

    store = open_store(
        f"ray://lost-{uuid.uuid4().hex[:6]}?shards=2&timeout=20&transport={transport}"
    )
    assert isinstance(store, RayStore)
    left, right = _keys_on(0, 3), _keys_on(1, 3)
    pid = "train/step-000002"
    store.kv_batch_put(left + right, pid, {"scores": torch.arange(6.0)})
    store.kill_shard(1)
    with pytest.raises(ShardLost) as lost:
        store.kv_batch_get(left + right, pid, ["scores"], timeout=5)
    err = lost.value
    assert (err.shard, err.partition_id, sorted(err.keys)) == (1, pid, sorted(right))
    assert "shard 1 is lost" in str(err) and repr(right[0]) in str(err), str(err)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)  # crosses a Ray task as itself
    with pytest.raises(ShardLost, match="shard 1"):
        store.kv_batch_put(right[:1], "other", {"scores": torch.ones(1)})
    with pytest.raises(ShardLost):
        store.kv_list(pid)
    # shard 0 keeps its rows; recover() makes shard 1 anew, empty
    assert store.kv_batch_get(left, pid, ["scores"], timeout=5)["scores"].tolist() == [0, 1, 2]
    assert store.recover() == [1]
    assert store.recover() == []
    with pytest.raises(StoreTimeout):  # the lost rows are missing, never made up
        store.kv_batch_get(right, pid, ["scores"], timeout=0)
    store.kv_batch_put(right, pid, {"scores": torch.tensor([3.0, 4.0, 5.0])})
    guest = open_store(store.url)  # a worker opening the URL reaches the new shard
    got = guest.kv_batch_get(left + right, pid, ["scores"], timeout=5)["scores"]
    assert got.tolist() == [0, 1, 2, 3, 4, 5]
    guest.close()
    store.close()
