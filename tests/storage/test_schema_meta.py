"""FieldSpec, the vocabulary, declare_field, BatchMeta, and the package's import surface."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

import storage
from storage import VOCABULARY, BatchMeta, FieldSpec, SchemaError, declare_field, registered_spec


def test_vocabulary_specs_match_the_design() -> None:
    jagged_int = {"prompt_ids", "response_ids"}
    jagged_float = {
        "rollout_logprobs", "old_logprobs", "ref_logprobs", "values",
        "advantages", "returns", "rm_scores",
    }  # fmt: skip
    for name in jagged_int:
        assert VOCABULARY[name] == FieldSpec.jagged(torch.int64)
    for name in jagged_float:
        assert VOCABULARY[name] == FieldSpec.jagged(torch.float32)
    assert VOCABULARY["loss_mask"] == FieldSpec.jagged(torch.bool)
    assert VOCABULARY["raw_prompt"] == VOCABULARY["ground_truth"] == FieldSpec.objects()
    assert VOCABULARY["group_ids"] == FieldSpec.dense(torch.int64, ())
    assert VOCABULARY["rollout_version"] == FieldSpec.dense(torch.int64)
    assert VOCABULARY["scores"] == VOCABULARY["rule_scores"] == FieldSpec.dense(torch.float32)


@pytest.mark.parametrize(
    "spec",
    [FieldSpec.dense(torch.bfloat16, (2, 3)), FieldSpec.jagged(torch.bool), FieldSpec.objects()],
)
def test_field_spec_json_and_pickle_round_trip(spec: FieldSpec) -> None:
    assert FieldSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec


@pytest.mark.parametrize(
    "make",
    [
        lambda: FieldSpec("ragged", torch.int64),  # type: ignore[arg-type]
        lambda: FieldSpec.dense(torch.complex64),
        lambda: FieldSpec("jagged", torch.int64, (2,)),
        lambda: FieldSpec("object", torch.int64),
        lambda: FieldSpec.dense(torch.float32, (-1,)),
        lambda: FieldSpec.dense(np.dtype("float32")),  # a numpy dtype is not a field dtype
        lambda: FieldSpec.jagged("float8"),
    ],
)
def test_bad_field_specs_are_refused(make: object) -> None:
    with pytest.raises(SchemaError):
        make()  # type: ignore[operator]


def test_declare_field_is_idempotent_and_refuses_conflicts() -> None:
    name = f"test_field_{uuid.uuid4().hex[:6]}"
    declare_field(name, FieldSpec.dense(torch.float64, (4,)))
    declare_field(name, FieldSpec.dense(torch.float64, (4,)))
    assert registered_spec(name) == FieldSpec.dense(torch.float64, (4,))
    with pytest.raises(SchemaError, match=name):
        declare_field(name, FieldSpec.dense(torch.float32, (4,)))
    with pytest.raises(SchemaError, match="prompt_ids"):
        declare_field("prompt_ids", FieldSpec.jagged(torch.int32))


def test_batch_meta_is_frozen_picklable_and_json_friendly() -> None:
    meta = BatchMeta("train/step-1", ["a", "b", "c"], ["prompt_ids"])  # type: ignore[arg-type]
    assert meta.keys == ("a", "b", "c") and len(meta) == 3
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert BatchMeta.from_json(json.loads(json.dumps(meta.to_json()))) == meta
    with pytest.raises(AttributeError):
        meta.keys = ("x",)  # type: ignore[misc]
    assert hash(meta) == hash(BatchMeta("train/step-1", ("a", "b", "c"), ("prompt_ids",)))


def test_batch_meta_helpers() -> None:
    meta = BatchMeta("p", ("a", "b", "c"), ("prompt_ids", "scores"))
    assert meta.select("scores").fields == ("scores",)
    assert meta.with_fields("scores", "advantages").fields == ("prompt_ids", "scores", "advantages")
    assert meta.subset(["c", "a"]).keys == ("c", "a")
    assert [m.keys for m in meta.split(2)] == [("a", "b"), ("c",)]
    with pytest.raises(SchemaError, match="advantages"):
        meta.select("advantages")
    with pytest.raises(SchemaError, match="'z'"):
        meta.subset(["z"])
    with pytest.raises(SchemaError):
        BatchMeta("p", "abc")  # type: ignore[arg-type]


def test_public_api_is_exported() -> None:
    for name in ("open_store", "BatchMeta", "FieldSpec", "Store", "StoreError", "SchemaError",
                 "ConflictError", "StoreTimeout", "StoreCorruptError", "declare_field"):  # fmt: skip
        assert hasattr(storage, name), name
    assert issubclass(storage.StoreTimeout, storage.StoreError)
    assert issubclass(storage.StoreTimeout, TimeoutError)


def test_a_spec_holds_its_dtype_by_name_and_gives_the_torch_dtype() -> None:
    spec = FieldSpec.jagged(torch.bfloat16)
    assert spec == FieldSpec.jagged("bfloat16") and spec.dtype_name == "bfloat16"
    assert spec.dtype is torch.bfloat16 and spec.np_dtype == np.uint16
    assert FieldSpec.objects().dtype is None


def test_a_store_shards_modules_do_not_import_torch() -> None:
    """A Ray store shard's process imports storage.ray_shard and reads specs from JSON: no torch."""
    code = (
        "import sys, storage.ray_shard; from storage import FieldSpec, registered_spec; "
        "spec = FieldSpec.from_json({'kind': 'jagged', 'dtype': 'float32', 'shape': []}); "
        "assert spec == registered_spec('old_logprobs') and spec.np_dtype.name == 'float32'; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_importing_storage_does_not_import_ray() -> None:
    code = "import sys, storage; storage.open_store('memory://'); print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
