"""The store contract, run against both backends (`store` fixture: memory:// and ray://)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from storage import (
    ConflictError,
    FieldSpec,
    SchemaError,
    Store,
    StoreError,
    StoreTimeout,
    open_store,
)

CHAT = [[{"role": "user", "content": f"what is {i}+{i}?"}] for i in range(5)]


def _batch(n: int = 5, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(0, 7, (n,), generator=g)]
    lengths[0] = 0  # an empty row must survive
    return {
        "prompt_ids": [torch.randint(0, 50, (k,), generator=g) for k in lengths],
        "loss_mask": torch.nested.nested_tensor_from_jagged(
            torch.rand(sum(lengths), generator=g) > 0.5,
            torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        ),
        "old_logprobs": [torch.randn(k, generator=g) for k in lengths],
        "raw_prompt": CHAT[:n],
        "ground_truth": [str(2 * i) if i % 2 else i for i in range(n)],
        "group_ids": torch.arange(n) // 2,
        "scores": torch.randn(n, generator=g),
    }


def _keys(n: int = 5, prefix: str = "k") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def _rows(value: Any) -> list[Any]:
    """Per-row plain values of a put or got field, for comparisons."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return [row.tolist() for row in value.unbind()]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "tolist"):
        return list(value.tolist())
    return [row.tolist() if isinstance(row, torch.Tensor) else row for row in value]


def _assert_rows(td: TensorDict, batch: dict[str, Any], order: list[int]) -> None:
    for name, value in batch.items():
        expected = _rows(value)
        assert _rows(td[name]) == [expected[i] for i in order], name


def test_round_trip_returns_every_kind_and_dtype_in_request_order(store: Store, pid: str) -> None:
    batch = _batch()
    store.declare(pid, {"hidden": FieldSpec.dense(torch.bfloat16, (2, 3))})
    batch["hidden"] = torch.randn(5, 2, 3).to(torch.bfloat16)
    batch["kl_terms"] = [
        torch.randn(i, dtype=torch.float64) for i in range(5)
    ]  # fixed by first put
    meta = store.kv_batch_put(_keys(), pid, batch)
    assert (
        meta.partition_id == pid and meta.keys == tuple(_keys()) and set(meta.fields) == set(batch)
    )
    order = [3, 0, 4, 1, 2]
    td = store.kv_batch_get([f"k{i}" for i in order], pid, list(batch), timeout=5)
    assert td.batch_size == torch.Size([5])
    _assert_rows(td, batch, order)
    for name in ("prompt_ids", "loss_mask", "old_logprobs", "kl_terms"):
        assert td[name].layout == torch.jagged
    assert td["prompt_ids"].offsets().diff().tolist() == [
        len(batch["prompt_ids"][i]) for i in order
    ]
    dtypes = {"prompt_ids": torch.int64, "loss_mask": torch.bool, "old_logprobs": torch.float32,
              "kl_terms": torch.float64, "group_ids": torch.int64, "scores": torch.float32,
              "hidden": torch.bfloat16}  # fmt: skip
    assert {name: td[name].dtype for name in dtypes} == dtypes
    assert td["hidden"].shape == (5, 2, 3)
    assert td.get("raw_prompt").tolist() == [CHAT[i] for i in order]


def test_gets_span_several_puts_and_select_fields(store: Store, pid: str) -> None:
    first, second = _batch(5, seed=1), _batch(5, seed=2)
    store.kv_batch_put(_keys(5, "a"), pid, first)
    store.kv_batch_put(_keys(5, "b"), pid, second)
    keys = ["b4", "a0", "b1", "a3"]
    td = store.kv_batch_get(keys, pid, ["scores", "prompt_ids"], timeout=5)
    assert set(td.keys()) == {"scores", "prompt_ids"}
    both = {
        k: v
        for k, v in zip(
            _keys(5, "a") + _keys(5, "b"), _rows(first["prompt_ids"]) + _rows(second["prompt_ids"])
        )
    }
    assert _rows(td["prompt_ids"]) == [both[k] for k in keys]


def _bad_puts() -> list[tuple[str, dict[str, Any], list[str], str]]:
    good = {"scores": torch.zeros(2)}
    return [
        ("dtype", {**good, "prompt_ids": [torch.zeros(2), torch.zeros(1)]}, ["x", "y"], "jagged int64"),
        ("kind", {**good, "group_ids": [torch.arange(2), torch.arange(1)]}, ["x", "y"], "dense int64"),
        ("rows", {**good, "prompt_ids": [torch.arange(2)]}, ["x", "y"], "1 rows for 2 keys"),
        ("duplicates", good, ["x", "x"], "duplicate keys"),
        ("spec fixed by first put", {**good, "extra": torch.zeros(2, dtype=torch.int32)}, ["x", "y"], "float16"),
        ("shape", {"scores": torch.zeros(2, 1)}, ["x", "y"], r"dense float32"),
        ("not json", {**good, "raw_prompt": [("a",), "b"]}, ["x", "y"], "tuple"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", _bad_puts(), ids=lambda case: case[0])
def test_bad_puts_raise_schema_error_and_store_nothing(
    store: Store, pid: str, case: tuple[Any, ...]
) -> None:
    _, fields, keys, expected = case
    store.kv_batch_put(
        ["k0"], pid, {"extra": torch.zeros(1, dtype=torch.float16), "scores": torch.ones(1)}
    )
    before = store.kv_list(pid)
    with pytest.raises(SchemaError, match=expected) as info:
        store.kv_batch_put(keys, pid, fields)
    assert pid in str(info.value)
    assert store.kv_list(pid) == before  # nothing of the call was stored, not even good fields
    assert store.kv_batch_get(["k0"], pid, ["scores"], timeout=0)["scores"].tolist() == [1.0]


def test_repeated_identical_put_is_a_no_op(store: Store, pid: str) -> None:
    batch = _batch()
    store.kv_batch_put(_keys(), pid, batch)
    listing = store.kv_list(pid)
    store.kv_batch_put(_keys(), pid, _batch())  # a retried stage recomputes the same values
    assert store.kv_list(pid) == listing
    _assert_rows(store.kv_batch_get(_keys(), pid, list(batch), timeout=0), batch, list(range(5)))


def test_different_content_conflicts_unless_overwrite(store: Store, pid: str) -> None:
    store.kv_batch_put(["a", "b"], pid, {"scores": torch.tensor([1.0, 2.0])})
    with pytest.raises(ConflictError) as info:
        store.kv_batch_put(["b", "c"], pid, {"scores": torch.tensor([9.0, 3.0])})
    assert pid in str(info.value) and "'b'" in str(info.value) and "scores" in str(info.value)
    assert set(store.kv_list(pid)) == {"a", "b"}  # c was not stored either
    store.kv_batch_put(["b", "c"], pid, {"scores": torch.tensor([2.0, 3.0])})  # b identical: ok
    store.kv_batch_put(["b", "c"], pid, {"scores": torch.tensor([9.0, 3.0])}, overwrite=True)
    got = store.kv_batch_get(["a", "b", "c"], pid, ["scores"], timeout=0)
    assert got["scores"].tolist() == [1.0, 9.0, 3.0]


def test_fields_arrive_separately_and_a_waiting_get_gets_them(store: Store, pid: str) -> None:
    batch = _batch()
    results: list[Any] = []

    def consume() -> None:
        try:
            results.append(store.kv_batch_get(_keys(), pid, ["prompt_ids", "scores"], timeout=20))
        except Exception as exc:  # surfaced by the assert below
            results.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    store.kv_batch_put(_keys(), pid, {"prompt_ids": batch["prompt_ids"]})
    store.kv_batch_put(_keys()[:3], pid, {"scores": batch["scores"][:3]})
    store.kv_batch_put(_keys()[3:], pid, {"scores": batch["scores"][3:]})
    consumer.join(timeout=30)
    assert not consumer.is_alive() and len(results) == 1
    assert isinstance(results[0], TensorDict), results[0]
    _assert_rows(
        results[0], {"prompt_ids": batch["prompt_ids"], "scores": batch["scores"]}, list(range(5))
    )


def test_timeout_names_partition_missing_keys_fields_and_wait(store: Store, pid: str) -> None:
    store.kv_batch_put(["have"], pid, {"scores": torch.ones(1)})
    keys = ["have"] + [f"missing{i}" for i in range(30)]
    with pytest.raises(StoreTimeout) as info:
        store.kv_batch_get(keys, pid, ["scores", "advantages"], timeout=0.3)
    err = info.value
    assert isinstance(err, TimeoutError) and isinstance(err, StoreError)
    assert err.partition_id == pid and set(err.missing_keys) == set(keys)
    assert set(err.missing_fields) == {"scores", "advantages"}
    assert err.waited_s >= 0.3
    message = str(err)
    assert pid in message and "missing0" in message and "and 23 more" in message
    assert "advantages: 31" in message and "scores: 30" in message


def test_timeout_zero_checks_once(store: Store, pid: str) -> None:
    with pytest.raises(StoreTimeout):
        store.kv_batch_get(["a"], pid, ["scores"], timeout=0)
    store.kv_batch_put(["a"], pid, {"scores": torch.ones(1)})
    assert store.kv_batch_get(["a"], pid, ["scores"], timeout=0)["scores"].tolist() == [1.0]


def test_timeout_none_uses_the_default_from_the_url(store: Store, pid: str) -> None:
    quick = (
        open_store(store.url.split("?")[0] + "?timeout=0.2")
        if store.url.startswith("memory")
        else open_store(store.url, default_timeout=0.2)
    )
    assert quick.default_timeout == 0.2 and open_store("memory://").default_timeout == 300
    with pytest.raises(StoreTimeout):
        quick.kv_batch_get(["a"], pid, ["scores"], timeout=None)
    with pytest.raises(StoreError):
        store.kv_batch_get(["a"], pid, ["scores"], timeout=-1)


def test_list_clear_and_partitions(store: Store, pid: str) -> None:
    store.kv_batch_put(["a", "b", "c"], pid, {"scores": torch.zeros(3)})
    store.kv_batch_put(["a"], pid, {"group_ids": torch.zeros(1, dtype=torch.int64)})
    assert store.kv_list(pid) == {"a": ["scores", "group_ids"], "b": ["scores"], "c": ["scores"]}
    assert pid in store.partitions()
    assert store.kv_clear(pid, ["a", "zzz"]) == 1
    assert sorted(store.kv_list(pid)) == ["b", "c"]
    with pytest.raises(StoreTimeout):
        store.kv_batch_get(["a"], pid, ["scores"], timeout=0)
    assert store.kv_clear(pid) == 2
    assert store.kv_list(pid) == {} and pid not in store.partitions()


def test_select_fields_none_returns_what_every_key_holds(store: Store, pid: str) -> None:
    store.kv_batch_put(
        ["a", "b"], pid, {"scores": torch.zeros(2), "group_ids": torch.zeros(2, dtype=torch.int64)}
    )
    store.kv_batch_put(["a"], pid, {"rule_scores": torch.zeros(1)})
    assert set(store.kv_batch_get(["a", "b"], pid, None, timeout=0).keys()) == {
        "scores",
        "group_ids",
    }
    with pytest.raises(StoreTimeout):
        store.kv_batch_get(["a", "nope"], pid, None, timeout=0)


def test_declare_fixes_specs_and_refuses_conflicts(store: Store, pid: str) -> None:
    store.declare(pid, {"reward_terms": FieldSpec.jagged(torch.float64)})
    with pytest.raises(SchemaError, match="reward_terms"):
        store.kv_batch_put(["a"], pid, {"reward_terms": [torch.zeros(2)]})
    with pytest.raises(SchemaError, match="reward_terms"):
        store.declare(pid, {"reward_terms": FieldSpec.jagged(torch.float32)})
    with pytest.raises(SchemaError, match="prompt_ids"):
        store.declare(pid, {"prompt_ids": FieldSpec.jagged(torch.int32)})
    store.kv_batch_put(["a"], pid, {"reward_terms": [torch.zeros(2, dtype=torch.float64)]})


def test_empty_batches(store: Store, pid: str) -> None:
    store.kv_batch_put([], pid, {"scores": torch.zeros(0), "prompt_ids": []})
    td = store.kv_batch_get([], pid, ["scores", "prompt_ids"], timeout=0)
    assert td.batch_size == torch.Size([0]) and td["prompt_ids"].layout == torch.jagged
    with pytest.raises(SchemaError, match="declare"):
        store.kv_batch_put([], pid, {"made_up": []})


def test_jagged_fields_of_equal_lengths_share_one_ragged_dim(store: Store, pid: str) -> None:
    """Fields with the same row lengths come back combinable elementwise (one nested int);
    fields with other lengths keep their own."""
    keys = ["a", "b", "c"]
    lengths = [3, 0, 2]
    store.kv_batch_put(
        keys,
        pid,
        {
            "old_logprobs": [torch.full((n,), 1.0) for n in lengths],
            "ref_logprobs": [torch.full((n,), 0.25) for n in lengths],
            "prompt_ids": [torch.arange(n + 1) for n in lengths],
        },
    )
    td = store.kv_batch_get(["c", "a", "b"], pid)
    kl = td["old_logprobs"] - td["ref_logprobs"]  # raises if the ragged dims differ
    assert kl.values().tolist() == [0.75] * 5
    assert kl.offsets().tolist() == [0, 2, 5, 5]
    assert td["prompt_ids"].offsets().tolist() == [0, 3, 7, 8]
    with pytest.raises(RuntimeError):
        td["old_logprobs"] + td["prompt_ids"]
