"""save/load through real Arrow IPC files: exact round trips, torn and foreign files, atomicity."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch

from storage import FieldSpec, Store, StoreCorruptError, StoreError, open_store
from storage.arrow_io import file_name


def _fill(store: Store, pid: str) -> dict[str, object]:
    store.declare(
        pid,
        {"hidden": FieldSpec.dense(torch.bfloat16, (2, 2)), "unused": FieldSpec.jagged(torch.int8)},
    )
    fields = {
        "prompt_ids": [torch.arange(k) for k in (3, 0, 5, 1)],
        "loss_mask": [torch.tensor([True, False])[: k % 3] for k in range(4)],
        "raw_prompt": [[{"role": "user", "content": "hé"}], "text", None, {"n": [1, 2.5]}],
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "hidden": torch.randn(4, 2, 2).to(torch.bfloat16),
    }
    store.kv_batch_put(["a", "b", "c", "d"], pid, fields)
    store.kv_batch_put(["a", "c"], pid, {"scores": torch.tensor([float("nan"), -0.0])})
    return fields


def _snapshot(store: Store, pid: str) -> dict[str, list[object]]:
    """Every stored value of a partition, as plain lists keyed by field, then key."""
    out: dict[str, list[object]] = {}
    for key, fields in sorted(store.kv_list(pid).items()):
        td = store.kv_batch_get([key], pid, fields, timeout=0)
        for name in fields:
            value = td.get(name)
            if isinstance(value, torch.Tensor):
                value = (
                    value.dtype,
                    value.unbind()[0]
                    .view(torch.uint8 if value.dtype == torch.bool else value.dtype)
                    .tolist()
                    if value.is_nested
                    else value.float().tolist(),
                )
            else:
                value = value.tolist()
            out.setdefault(name, []).append((key, repr(value)))
    return out


def test_save_load_round_trips_every_kind(store: Store, pid: str, tmp_path: Path) -> None:
    _fill(store, pid)
    before, listing = _snapshot(store, pid), store.kv_list(pid)
    [path] = store.save(tmp_path, [pid])
    assert path == tmp_path / file_name(pid) and "/" not in path.name
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp files left
    target = open_store("memory://") if store.url.startswith("memory") else store
    if target is store:
        store.kv_clear(pid)
    [meta] = target.load(tmp_path)
    assert meta.partition_id == pid and set(meta.keys) == set(listing)
    assert target.kv_list(pid) == listing and _snapshot(target, pid) == before
    with pytest.raises(Exception, match="unused"):  # the declared spec came back too
        target.kv_batch_put(["z"], pid, {"unused": [torch.zeros(1)]})


def test_save_takes_a_subset_and_refuses_unknown_partitions(
    store: Store, pid: str, tmp_path: Path
) -> None:
    store.kv_batch_put(["a"], pid, {"scores": torch.ones(1)})
    store.kv_batch_put(["a"], pid + "-other", {"scores": torch.ones(1)})
    store.save(tmp_path, [pid])
    assert [p.name for p in tmp_path.iterdir()] == [file_name(pid)]
    with pytest.raises(StoreError, match="nope"):
        store.save(tmp_path, ["nope"])


def test_load_refuses_existing_partitions_unless_replace(
    store: Store, pid: str, tmp_path: Path
) -> None:
    store.kv_batch_put(["a"], pid, {"scores": torch.ones(1)})
    store.save(tmp_path, [pid])
    store.kv_batch_put(["b"], pid, {"scores": torch.ones(1)})
    with pytest.raises(StoreError, match="replace=True"):
        store.load(tmp_path)
    assert sorted(store.kv_list(pid)) == ["a", "b"]
    store.load(tmp_path, replace=True)
    assert sorted(store.kv_list(pid)) == ["a"]


def _write_foreign(path: Path) -> None:
    table = pa.table({"__key__": pa.array(["a"], pa.large_string()), "x": [1]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


@pytest.mark.parametrize("damage", ["torn", "foreign", "garbage"])
def test_bad_files_raise_corrupt_error_naming_the_file_and_change_nothing(
    pid: str, tmp_path: Path, damage: str
) -> None:
    source = open_store("memory://")
    source.kv_batch_put(["a", "b"], pid, {"prompt_ids": [torch.arange(300), torch.arange(9)]})
    source.kv_batch_put(["a"], "good", {"scores": torch.ones(1)})
    source.save(tmp_path)
    bad = tmp_path / file_name(pid)
    if damage == "torn":
        bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    elif damage == "foreign":
        _write_foreign(bad)
    else:
        bad.write_bytes(b"not arrow at all")
    target = open_store("memory://")
    target.kv_batch_put(["x"], "existing", {"scores": torch.zeros(1)})
    with pytest.raises(StoreCorruptError, match=bad.name):
        target.load(tmp_path)
    assert target.partitions() == ["existing"]  # the good file was not loaded either
    assert target.load(tmp_path, ["good"])[0].keys == ("a",)


def test_save_overwrites_atomically(pid: str, tmp_path: Path) -> None:
    store = open_store("memory://")
    store.kv_batch_put(["a"], pid, {"scores": torch.ones(1)})
    store.save(tmp_path)
    store.kv_batch_put(["b"], pid, {"scores": torch.ones(1)})
    store.save(tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
    fresh = open_store("memory://")
    fresh.load(tmp_path)
    assert sorted(fresh.kv_list(pid)) == ["a", "b"]
    with pytest.raises(StoreError, match="not a directory"):
        fresh.load(tmp_path / "missing")
