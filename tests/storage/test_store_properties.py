"""Property-based tests of the store under random, partly bad input (hypothesis).

A hypothesis state machine drives one fresh partition of a `memory://` and of a `ray://` store
with random sequences of:

- well-formed puts of dense (float, int, bool, bfloat16), jagged (lists of 1-D tensors, tuples,
  `torch.jagged` nested tensors with and without holes, strided nested tensors) and object
  (JSON-like) fields, including identical re-puts, changed values with and without `overwrite`,
  and puts of zero keys;
- bad puts: a dtype, kind or shape other than the field's spec (on whichever shard), a row count
  other than the key count, duplicate keys in one call, keys that are not UTF-8, values that are
  not JSON-like (lone surrogates and too deep nesting among them), unsupported dtypes, sparse and
  meta tensors, and malformed arguments, each mixed with well-formed fields (which must not be
  stored either);
- gets of present and missing keys and fields with a timeout of 0 or 0.01 s, and malformed gets;
- declares (well-formed and malformed), clears of some keys and clears of the whole partition.

Beside the store it keeps a plain-Python model of what the successful operations stored (per key
and field, the row) and checks after every step that:

- whatever an operation raised is a `StoreError`, of the subclass the contract names where it
  names one (SchemaError, ConflictError, StoreTimeout);
- an operation the model calls valid succeeds, and one it calls invalid fails;
- the store holds exactly what the model holds (`kv_list`, `partitions` and a `kv_batch_get` of
  every stored field, compared bit for bit): a failed put changes nothing.

The example tests at the end of this file pin inputs that random runs reach seldom.
"""

from __future__ import annotations

import copy
import functools
import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
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
    registered_spec,
)
from storage.convert import MAX_DEPTH
from storage.ray_shard import shard_of
from storage.urls import parse_store_url

# hypothesis comes with the [test] extra; a venv without it (the dependency floors' run) skips this
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")

# Field names a machine uses: three of the shared vocabulary (their specs are fixed process-wide)
# and three whose spec the first put or declare in a partition fixes.
FIELDS = ("scores", "prompt_ids", "raw_prompt", "pp_a", "pp_b", "pp_c")
# Keys: plain, empty and non-ASCII ones; on a Ray store of 2 shards they land on both shards.
KEYS = ("k0", "k1", "k2", "k3", "k4", "k5", "", "ключ/7")
# KEYS by the shard of a 2-shard Ray store they live on (the test's Ray store has 2 shards).
KEYS_BY_SHARD = tuple(
    tuple(key for key, s in zip(KEYS, shard_of(list(KEYS), 2).tolist()) if s == shard)
    for shard in (0, 1)
)
NEVER_PUT_KEY = "k-never"
NEVER_PUT_FIELD = "pp_never"

# Specs a field outside the vocabulary gets at its first put or declare.
SPECS = (
    FieldSpec.dense(torch.float32),
    FieldSpec.dense(torch.float64, (2,)),
    FieldSpec.dense(torch.int64),
    FieldSpec.dense(torch.bool),
    FieldSpec.dense(torch.bfloat16),
    FieldSpec.jagged(torch.int32),
    FieldSpec.jagged(torch.float32),
    FieldSpec.jagged(torch.bool),
    FieldSpec.objects(),
)
SUPPORTED_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
# Dtypes no field may have.
UNSUPPORTED_DTYPES = (torch.complex64, torch.uint16, torch.uint32, torch.float8_e5m2)

NO_BAD_FIELD = object()  # a malformed put that adds no bad field (its keys or partition are bad)
OWN_PARTITION = object()  # stands for the machine's own partition id where a call takes another
# The expected outcome of an operation whose result the contract leaves open.
EITHER = "success or any StoreError"

# JSON-like values. Strings hold no lone surrogates (not UTF-8: NOT_JSON has them); floats exclude
# NaN, which is not JSON.
_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=4)
_SURROGATES = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2)
_JSON_SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | _TEXT
)
JSON_VALUES = st.recursive(
    _JSON_SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_TEXT, children, max_size=3),
    max_leaves=6,
)


def _deep_list(depth: int) -> list[Any]:
    """`depth` lists, each the only item of the next one out, around an empty list."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


# Values an object field refuses: not JSON-like, nested more than MAX_DEPTH lists deep, holding a
# string that is not UTF-8, or a 0-d tensor.
NOT_JSON = st.one_of(
    st.tuples(JSON_VALUES),
    st.sets(st.integers(-3, 3), max_size=2),
    st.frozensets(st.integers(-3, 3), max_size=2),
    st.binary(max_size=3),
    st.dictionaries(st.integers(-3, 3), JSON_VALUES, min_size=1, max_size=2),
    st.complex_numbers(allow_nan=False, max_magnitude=10),
    st.integers(-5, 5).map(np.int64),
    st.booleans().map(np.bool_),
    st.builds(object),
    st.lists(JSON_VALUES, max_size=2).map(lambda items: [*items, (1, 2)]),
    JSON_VALUES.map(lambda value: {"inner": (value,)}),
    st.just(torch.tensor(1.0)),
    _SURROGATES,
    st.tuples(_TEXT, _SURROGATES).map(lambda pair: [pair[0] + pair[1]]),
    st.tuples(_SURROGATES, JSON_VALUES).map(lambda pair: {pair[0]: pair[1]}),
    st.sampled_from((MAX_DEPTH, MAX_DEPTH + 1, 3000)).map(_deep_list),
    st.sampled_from((MAX_DEPTH, 3000)).map(lambda depth: {"deep": _deep_list(depth)}),
)

_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# -- rows and their comparison --------------------------------------------------------------------


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor viewed as integers of its width, so that equality is bitwise (NaN, -0.0)."""
    if tensor.dtype == torch.bool:
        return tensor.to(torch.uint8)
    return tensor.contiguous().view(_BITS_OF_SIZE[tensor.element_size()])


def _canonical(value: Any) -> str:
    """JSON text that tells apart what JSON tells apart (1, 1.0, true) but not dict key order."""
    return json.dumps(value, sort_keys=True)


def same_row(a: Any, b: Any) -> bool:
    """Whether two rows hold identical content: tensors bit for bit, objects as JSON values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    return _canonical(a) == _canonical(b)


def lookalike(value: Any) -> Any:
    """A value equal to `value` in Python (`==`) that is another JSON value wherever `value`
    holds a bool or a number that has a twin: true -> 1, 1 -> 1.0, 2.0 -> 2, 0.0 -> -0.0."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return float(value) if abs(value) < 2**53 else value
    if isinstance(value, float):
        if value == 0:
            return -value
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    if isinstance(value, list):
        return [lookalike(item) for item in value]
    if isinstance(value, dict):
        return {key: lookalike(item) for key, item in value.items()}
    return value


def describe_row(row: Any) -> str:
    if isinstance(row, torch.Tensor):
        return f"{row.dtype} {row.tolist()!r}"
    return _canonical(row)


@functools.cache
def elements(dtype: torch.dtype) -> st.SearchStrategy[Any]:
    """Python numbers that a tensor of `dtype` holds (floats include NaN, inf and -0.0)."""
    if dtype == torch.bool:
        return st.booleans()
    if dtype.is_floating_point:
        width = {torch.float16: 16, torch.float64: 64}.get(dtype, 32)
        return st.floats(width=width)
    info = torch.iinfo(dtype)
    return st.integers(info.min, info.max)


# Strategies are built once and reused: building and validating one costs more than a draw.
@functools.cache
def numbers(dtype: torch.dtype, min_size: int, max_size: int) -> st.SearchStrategy[list[Any]]:
    return st.lists(elements(dtype), min_size=min_size, max_size=max_size)


@functools.cache
def key_lists(min_size: int, max_size: int) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(KEYS), min_size=min_size, max_size=max_size, unique=True)


@functools.cache
def one_shard_key_lists(min_size: int, max_size: int) -> st.SearchStrategy[list[str]]:
    """Keys that all live on one shard of a 2-shard Ray store (a one-shard put there)."""
    return st.sampled_from(KEYS_BY_SHARD).flatmap(
        lambda group: st.lists(
            st.sampled_from(group), min_size=min_size, max_size=max_size, unique=True
        )
    )


@functools.cache
def name_lists(min_size: int, max_size: int) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(FIELDS), min_size=min_size, max_size=max_size, unique=True)


@functools.cache
def json_lists(size: int) -> st.SearchStrategy[list[Any]]:
    return st.lists(JSON_VALUES, min_size=size, max_size=size)


# keys and fields to get or clear: any of those puts use, and one never put
ANY_KEYS = st.lists(st.sampled_from((*KEYS, NEVER_PUT_KEY)), max_size=4, unique=True)
SELECTS = st.none() | st.lists(st.sampled_from((*FIELDS, NEVER_PUT_FIELD)), max_size=3, unique=True)


@functools.cache
def choice(options: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    return st.sampled_from(options)


def got_rows(spec: FieldSpec, value: Any, n_rows: int) -> list[Any]:
    """The rows of a field a get returned, checking its kind, dtype and shape on the way."""
    if spec.kind == "object":
        rows = list(value.tolist())
    elif spec.kind == "jagged":
        assert isinstance(value, torch.Tensor) and value.layout == torch.jagged, type(value)
        assert value.dtype == spec.dtype
        rows = list(value.unbind())
    else:
        assert isinstance(value, torch.Tensor) and not value.is_nested, type(value)
        assert value.dtype == spec.dtype and tuple(value.shape) == (n_rows, *spec.shape)
        rows = list(value.unbind(0))
    assert len(rows) == n_rows
    return rows


# -- the state machine ----------------------------------------------------------------------------


class StoreMachine(RuleBasedStateMachine):
    """Random operations on one partition of `store`, checked against a model of its content."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        self.pid = f"props/{uuid.uuid4().hex[:12]}"
        self.exists = False  # whether the partition exists (a put or declare made it)
        self.specs: dict[str, FieldSpec] = {}  # specs fixed in the partition (vocabulary aside)
        self.rows: dict[str, dict[str, Any]] = {}  # key -> field -> row

    # -- helpers -----------------------------------------------------------------------------

    def expected_spec(self, name: str) -> FieldSpec | None:
        return self.specs.get(name) or registered_spec(name)

    def run(self, what: str, call: Callable[[], Any], expect: Any) -> tuple[bool, Any]:
        """Calls the store; `expect` is None (must succeed), an error class, or EITHER.

        Returns (succeeded, result or error). Anything raised that is not a StoreError fails.
        """
        try:
            result = call()
        except StoreError as exc:
            if expect is None:
                raise AssertionError(f"{what}: the model expected success, got {exc!r}") from exc
            if expect is not EITHER and not isinstance(exc, expect):
                raise AssertionError(f"{what}: expected {expect.__name__}, got {exc!r}") from exc
            return False, exc
        except Exception as exc:
            raise AssertionError(
                f"{what}: raised {type(exc).__name__}, which is not a StoreError: {exc!r}"
            ) from exc
        if expect is not None and expect is not EITHER:
            raise AssertionError(f"{what}: expected {expect.__name__}, but it succeeded")
        return True, result

    def draw_keys(
        self, data: st.DataObject, min_size: int, max_size: int, one_shard: bool = False
    ) -> list[str]:
        """Distinct keys; with `one_shard`, often keys of one shard only."""
        if one_shard and data.draw(st.booleans()):
            return list(data.draw(one_shard_key_lists(min_size, max_size)))
        return list(data.draw(key_lists(min_size, max_size)))

    def draw_spec(self, data: st.DataObject, name: str) -> FieldSpec:
        """The field's spec, or a random one for a field that has none yet."""
        return self.expected_spec(name) or data.draw(choice(SPECS))

    def fresh_row(self, data: st.DataObject, spec: FieldSpec) -> Any:
        if spec.kind == "object":
            return data.draw(JSON_VALUES)
        assert spec.dtype is not None
        if spec.kind == "dense":
            size = int(np.prod(spec.shape, dtype=np.int64))
            values = data.draw(numbers(spec.dtype, size, size))
            return torch.tensor(values, dtype=spec.dtype).reshape(spec.shape)
        values = data.draw(numbers(spec.dtype, 0, 3))
        return torch.tensor(values, dtype=spec.dtype).reshape(-1)

    @staticmethod
    def different_row(spec: FieldSpec, old: Any) -> Any:
        """A row that differs from `old` (for a conflicting re-put)."""
        if spec.kind == "object":
            return [old, "changed"]
        if spec.kind == "jagged":
            return torch.cat([old, torch.ones(1, dtype=old.dtype)])
        for fill in (0, 1, 2):
            candidate = torch.full_like(old, fill)
            if not same_row(candidate, old):
                return candidate
        raise AssertionError(f"no row differs from {old!r}")

    def draw_rows(
        self, data: st.DataObject, name: str, spec: FieldSpec, keys: Sequence[str], conflicts: bool
    ) -> list[Any]:
        """A row per key. Keys that hold the field get the same row again, or (when `conflicts`)
        a fresh or a surely different one."""
        rows = []
        for key in keys:
            old = self.rows.get(key, {}).get(name)
            if old is None:
                rows.append(self.fresh_row(data, spec))
                continue
            how = "same"
            if conflicts:
                how = data.draw(choice(("same", "fresh", "different", "lookalike")))
            if how == "same" or (how == "lookalike" and spec.kind != "object"):
                row = copy.deepcopy(old) if spec.kind == "object" else old.clone()
            elif how == "different":
                row = self.different_row(spec, old)
            elif how == "lookalike":
                row = lookalike(old)
            else:
                row = self.fresh_row(data, spec)
            rows.append(row)
        return rows

    def draw_value(self, data: st.DataObject, spec: FieldSpec, rows: list[Any]) -> Any:
        """What a put passes for `rows` of a field of `spec`, in one of the accepted forms."""
        if spec.kind == "object":
            return list(rows)
        if spec.kind == "dense":
            assert spec.dtype is not None
            if not rows:
                return torch.zeros((0, *spec.shape), dtype=spec.dtype)
            stacked = torch.stack(rows)
            if data.draw(st.booleans()):  # a non-contiguous view of the same rows
                return torch.repeat_interleave(stacked, 2, dim=0)[::2]
            return stacked
        assert spec.dtype is not None
        if not rows:
            form = data.draw(choice(("list", "njt")))
            if form == "list":
                return []
            empty = torch.zeros(0, dtype=spec.dtype)
            return torch.nested.nested_tensor_from_jagged(empty, torch.zeros(1, dtype=torch.int64))
        form = data.draw(choice(("list", "tuple", "njt", "njt with holes", "strided")))
        if form == "list":
            return list(rows)
        if form == "tuple":
            return tuple(rows)
        if form == "strided":
            return torch.nested.nested_tensor(list(rows))
        lengths = torch.tensor([row.shape[0] for row in rows], dtype=torch.int64)
        if form == "njt":
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
            return torch.nested.nested_tensor_from_jagged(torch.cat(rows), offsets)
        # each row followed by one padding element that `lengths` leaves out
        pad = torch.zeros(1, dtype=spec.dtype)
        values = torch.cat([piece for row in rows for piece in (row, pad)])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), (lengths + 1).cumsum(0)])
        return torch.nested.nested_tensor_from_jagged(values, offsets, lengths=lengths)

    def companions(
        self, data: st.DataObject, keys: Sequence[str], exclude: Sequence[str]
    ) -> dict[str, Any]:
        """Well-formed fields for `keys` that conflict with nothing stored (0 to 2 of them)."""
        chosen = data.draw(name_lists(0, 2))
        fields = {}
        for name in chosen:
            if name in exclude:
                continue
            spec = self.draw_spec(data, name)
            fields[name] = self.draw_value(
                data, spec, self.draw_rows(data, name, spec, keys, conflicts=False)
            )
        return fields

    def bad_put(self, what: str, keys: Any, fields: Any, pid: Any = OWN_PARTITION) -> None:
        """A put the model calls invalid: it must raise SchemaError and store nothing."""
        target = self.pid if pid is OWN_PARTITION else pid
        self.run(what, lambda: self.store.kv_batch_put(keys, target, fields), SchemaError)

    @staticmethod
    def mixed(data: st.DataObject, fields: dict[str, Any], name: Any, value: Any) -> dict[Any, Any]:
        """`fields` plus `name: value`, at a random position."""
        items = [*fields.items(), (name, value)]
        return dict(data.draw(st.permutations(items)))

    def random_dense(
        self, data: st.DataObject, dtype: torch.dtype, shape: tuple[int, ...], n: int
    ) -> torch.Tensor:
        size = n * int(np.prod(shape, dtype=np.int64))
        values = data.draw(numbers(dtype, size, size))
        return torch.tensor(values, dtype=dtype).reshape((n, *shape))

    def random_jagged_rows(self, data: st.DataObject, dtype: torch.dtype, n: int) -> list[Any]:
        return [self.fresh_row(data, FieldSpec.jagged(dtype)) for _ in range(n)]

    # -- puts --------------------------------------------------------------------------------

    @initialize(data=st.data())
    def put_first(self, data: st.DataObject) -> None:
        """Every run starts with some stored rows (a run may leave any rule out)."""
        self.put_well_formed(data, self.draw_keys(data, 2, 5), data.draw(name_lists(1, 3)))

    @rule(data=st.data())
    def put_new(self, data: st.DataObject) -> None:
        """A well-formed put of random keys and fields."""
        keys = self.draw_keys(data, 1, 4, one_shard=True)
        self.put_well_formed(data, keys, data.draw(name_lists(1, 3)))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def put_over_stored(self, data: st.DataObject) -> None:
        """A well-formed put to stored keys and fields (and maybe a new key and field): an
        identical re-put, a conflict, or an overwrite."""
        stored = sorted(self.rows)
        keys = data.draw(st.lists(st.sampled_from(stored), min_size=1, max_size=3, unique=True))
        keys += [key for key in data.draw(key_lists(0, 1)) if key not in keys]
        held = sorted({name for key in keys for name in self.rows.get(key, {})})
        names = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=2, unique=True))
        names += [name for name in data.draw(name_lists(0, 1)) if name not in names]
        self.put_well_formed(data, keys, names)

    def put_well_formed(self, data: st.DataObject, keys: list[str], names: list[str]) -> None:
        """A put of valid fields; it conflicts when it changes a stored row without overwrite."""
        overwrite = data.draw(st.booleans())
        fields, planned = {}, {}
        for name in names:
            spec = self.draw_spec(data, name)
            rows = self.draw_rows(data, name, spec, keys, conflicts=True)
            fields[name] = self.draw_value(data, spec, rows)
            planned[name] = (spec, rows)
        conflict = not overwrite and any(
            name in self.rows.get(key, {}) and not same_row(self.rows[key][name], row)
            for name, (_, rows) in planned.items()
            for key, row in zip(keys, rows)
        )
        ok, meta = self.run(
            f"put {keys} {names} overwrite={overwrite}",
            lambda: self.store.kv_batch_put(keys, self.pid, fields, overwrite=overwrite),
            ConflictError if conflict else None,
        )
        if not ok:
            return
        assert meta.partition_id == self.pid and meta.keys == tuple(keys)
        assert set(meta.fields) == set(names)
        self.exists = True
        for name, (spec, rows) in planned.items():
            self.fix_spec(name, spec)
            for key, row in zip(keys, rows):
                held = self.rows.setdefault(key, {})
                if name not in held or (overwrite and not same_row(held[name], row)):
                    held[name] = row

    def fix_spec(self, name: str, spec: FieldSpec) -> None:
        """Records a spec fixed in the partition (on every shard, whichever keys a put had)."""
        if registered_spec(name) is None:
            self.specs.setdefault(name, spec)

    @rule(data=st.data())
    def put_no_keys(self, data: st.DataObject) -> None:
        """A put of zero rows: fine for fields with a spec (or a 0-row tensor, which has one)."""
        names = data.draw(name_lists(1, 2))
        fields: dict[str, Any] = {}
        new_specs: dict[str, FieldSpec] = {}
        undeclared = False
        for name in names:
            spec = self.expected_spec(name)
            if spec is None:
                spec = data.draw(choice(SPECS))
                if spec.kind == "dense":
                    new_specs[name] = spec
                    fields[name] = self.draw_value(data, spec, [])
                else:
                    undeclared = True  # `[]` says nothing of its spec: refused
                    fields[name] = []
                continue
            fields[name] = self.draw_value(data, spec, [])
        ok, _ = self.run(
            f"put [] {list(fields)}",
            lambda: self.store.kv_batch_put([], self.pid, fields),
            SchemaError if undeclared else None,
        )
        if ok:
            self.exists = True
            for name in fields:
                spec = new_specs.get(name) or self.expected_spec(name)
                assert spec is not None
                self.fix_spec(name, spec)

    @rule(data=st.data())
    def put_bad(self, data: st.DataObject) -> None:
        """A put the store must refuse whole."""
        bad_puts = (
            self.put_wrong_spec,
            self.put_wrong_row_count,
            self.put_duplicate_keys,
            self.put_not_json,
            self.put_malformed,
        )
        data.draw(choice(bad_puts))(data)

    def put_wrong_spec(self, data: st.DataObject) -> None:
        """A field given another dtype, kind or shape than its spec."""
        names = [name for name in FIELDS if self.expected_spec(name) is not None]
        name = data.draw(st.sampled_from(names))
        spec = self.expected_spec(name)
        assert spec is not None
        keys = self.draw_keys(data, 1, 3, one_shard=True)
        n = len(keys)
        forms = {
            "dense": ("dtype", "shape", "jagged", "objects"),
            "jagged": ("dtype", "dense", "objects"),
            "object": ("dense", "jagged"),
        }[spec.kind]
        form = data.draw(st.sampled_from(forms))
        if form == "dtype":
            other = data.draw(st.sampled_from([d for d in SUPPORTED_DTYPES if d != spec.dtype]))
            if spec.kind == "dense":
                value: Any = self.random_dense(data, other, spec.shape, n)
            else:
                value = self.draw_value(
                    data, FieldSpec.jagged(other), self.random_jagged_rows(data, other, n)
                )
        elif form == "shape":
            shape = (2,) if spec.shape == () else (spec.shape[0] + 1,)
            assert spec.dtype is not None
            value = self.random_dense(data, spec.dtype, shape, n)
        elif form == "dense":
            dtype = data.draw(choice(SUPPORTED_DTYPES))
            value = self.random_dense(data, dtype, data.draw(st.sampled_from([(), (2,)])), n)
        elif form == "jagged":
            dtype = data.draw(choice(SUPPORTED_DTYPES))
            value = self.draw_value(
                data, FieldSpec.jagged(dtype), self.random_jagged_rows(data, dtype, n)
            )
        else:
            value = data.draw(json_lists(n))
        fields = self.mixed(data, self.companions(data, keys, [name]), name, value)
        self.bad_put(f"put {keys} with {name} ({spec.describe()}) as {form}", keys, fields)

    def put_wrong_row_count(self, data: st.DataObject) -> None:
        """A field with more or fewer rows than keys."""
        keys = self.draw_keys(data, 0, 3)
        name = data.draw(choice(FIELDS))
        spec = self.draw_spec(data, name)
        n_rows = data.draw(st.integers(0, 4).filter(lambda m: m != len(keys)))
        value = self.draw_value(data, spec, [self.fresh_row(data, spec) for _ in range(n_rows)])
        fields = self.mixed(data, self.companions(data, keys, [name]), name, value)
        self.bad_put(f"put {keys} with {n_rows} rows of {name}", keys, fields)

    def put_duplicate_keys(self, data: st.DataObject) -> None:
        keys = self.draw_keys(data, 1, 3)
        keys = list(data.draw(st.permutations([*keys, data.draw(st.sampled_from(keys))])))
        names = data.draw(name_lists(1, 2))
        fields = {}
        for name in names:  # one row per key as given, the repeated key included
            spec = self.draw_spec(data, name)
            rows = self.draw_rows(data, name, spec, keys, conflicts=False)
            fields[name] = self.draw_value(data, spec, rows)
        self.bad_put(f"put duplicate keys {keys}", keys, fields)

    def put_not_json(self, data: st.DataObject) -> None:
        """An object field with a row that JSON cannot carry unchanged."""
        names = [
            name
            for name in FIELDS
            if (spec := self.expected_spec(name)) is None or spec.kind == "object"
        ]
        name = data.draw(st.sampled_from(names))
        keys = self.draw_keys(data, 1, 3)
        rows = data.draw(json_lists(len(keys)))
        bad = data.draw(st.lists(st.integers(0, len(keys) - 1), min_size=1, unique=True))
        for i in bad:
            rows[i] = data.draw(NOT_JSON)
        fields = self.mixed(data, self.companions(data, keys, [name]), name, rows)
        self.bad_put(f"put {keys} with non-JSON {name} rows {bad}", keys, fields)

    def put_malformed(self, data: st.DataObject) -> None:
        """A put whose keys, partition, fields or values are not what the store takes."""
        case = data.draw(
            st.sampled_from(
                (
                    "keys str",
                    "keys not str",
                    "keys not UTF-8",
                    "keys set",
                    "partition id",
                    "fields list",
                    "fields empty",
                    "field name",
                    "value type",
                    "scalar tensor",
                    "unsupported dense dtype",
                    "unsupported jagged dtype",
                    "sparse or meta tensor",
                    "jagged row not 1-D",
                    "jagged rows of two dtypes",
                    "nested tensor of 2-D rows",
                    "tensors and other values",
                    "nested tensordict",
                )
            )
        )
        keys = self.draw_keys(data, 2 if case == "jagged rows of two dtypes" else 1, 3)
        n = len(keys)
        fields = self.companions(data, keys, [])
        name: Any = "pp_bad"
        bad: Any = NO_BAD_FIELD  # the bad field's value, for the cases that add one
        call_keys: Any = keys
        pid: Any = OWN_PARTITION
        if not fields:
            name0 = data.draw(choice(FIELDS))
            spec0 = self.draw_spec(data, name0)
            fields = {
                name0: self.draw_value(
                    data, spec0, self.draw_rows(data, name0, spec0, keys, conflicts=False)
                )
            }
        if case == "keys str":
            call_keys = keys[0]
        elif case == "keys not str":
            odd = data.draw(st.sampled_from([7, None, b"k0", 1.5, ("k0",)]))
            call_keys = list(data.draw(st.permutations([*keys[1:], odd])))
        elif case == "keys not UTF-8":
            odd = data.draw(_SURROGATES | st.tuples(_TEXT, _SURROGATES).map("".join))
            call_keys = list(data.draw(st.permutations([*keys[1:], odd])))
        elif case == "keys set":
            call_keys = set(keys)
        elif case == "partition id":
            pid = data.draw(st.sampled_from(["", 5, None, b"p", []]))
        elif case == "fields list":
            self.bad_put("put fields as a list", keys, list(fields.items()))
            return
        elif case == "fields empty":
            self.bad_put("put no fields", keys, {})
            return
        elif case == "field name":
            name = data.draw(st.sampled_from(["", "__meta", 3, None]))
            bad = torch.zeros(n)
        elif case == "value type":
            bad = data.draw(
                st.sampled_from([None, 3.5, "text", {"a": [1] * n}, np.zeros(n), b"xy", range(n)])
            )
        elif case == "scalar tensor":
            bad = torch.tensor(1.0)
        elif case == "unsupported dense dtype":
            bad = torch.zeros(n).to(data.draw(st.sampled_from(UNSUPPORTED_DTYPES)))
        elif case == "unsupported jagged dtype":
            dtype = data.draw(st.sampled_from(UNSUPPORTED_DTYPES))
            bad = [torch.zeros(2).to(dtype) for _ in range(n)]
            if data.draw(st.booleans()):
                offsets = torch.arange(n + 1, dtype=torch.int64) * 2
                bad = torch.nested.nested_tensor_from_jagged(torch.cat(bad), offsets)
        elif case == "sparse or meta tensor":
            form = data.draw(st.sampled_from(("sparse", "sparse csr", "meta", "rows")))
            if form == "sparse":
                bad = torch.ones(n, 2).to_sparse()
            elif form == "sparse csr":
                bad = torch.ones(n, 2).to_sparse_csr()
            elif form == "meta":
                bad = torch.zeros(n, device="meta")
            else:  # jagged rows, one of them sparse or on the meta device
                bad = [torch.zeros(2) for _ in range(n)]
                bad[data.draw(st.integers(0, n - 1))] = data.draw(
                    st.sampled_from([torch.ones(2).to_sparse(), torch.zeros(2, device="meta")])
                )
        elif case == "jagged row not 1-D":
            bad = [torch.zeros(2) for _ in range(n)]
            bad[data.draw(st.integers(0, n - 1))] = data.draw(
                st.sampled_from([torch.zeros(2, 2), torch.tensor(1.0)])
            )
        elif case == "jagged rows of two dtypes":
            bad = [torch.zeros(2) for _ in range(n)]
            bad[data.draw(st.integers(1, n - 1))] = torch.zeros(2, dtype=torch.int64)
        elif case == "nested tensor of 2-D rows":
            offsets = torch.arange(n + 1, dtype=torch.int64) * 2
            bad = torch.nested.nested_tensor_from_jagged(torch.zeros(2 * n, 3), offsets)
        elif case == "tensors and other values":
            bad = [torch.zeros(2), *data.draw(json_lists(n))][:n]
            if n == 1:
                bad = [torch.zeros(2), 1]  # two rows for one key: refused either way
        else:
            bad = TensorDict({"x": torch.zeros(n)}, batch_size=[n])
        if bad is not NO_BAD_FIELD:
            fields = self.mixed(data, fields, name, bad)
        self.bad_put(f"put with {case}", call_keys, fields, pid)

    # -- gets --------------------------------------------------------------------------------

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        """A get of present and missing keys and fields with a tiny timeout, or a malformed one."""
        how = data.draw(choice(("stored", "stored", "any", "malformed")))
        if how == "malformed":
            self.get_malformed(data)
            return
        if how == "stored" and self.rows:
            stored = sorted(self.rows)
            keys = data.draw(st.lists(st.sampled_from(stored), min_size=1, max_size=4, unique=True))
            held = sorted({name for key in keys for name in self.rows[key]})
            select = data.draw(
                st.none() | st.lists(st.sampled_from(held), min_size=1, max_size=3, unique=True)
            )
        else:
            keys = list(data.draw(ANY_KEYS))
            select = data.draw(SELECTS)
        timeout = data.draw(choice((0, 0.0, 0.01)))
        missing_keys: set[str] = set()
        missing_fields: set[str] = set()
        if select is None:
            missing_keys = {key for key in keys if key not in self.rows}
            held = [set(self.rows[key]) for key in keys if key in self.rows]
            wanted = set.intersection(*held) if held else set()
        else:
            wanted = set(select)
            for key in keys:
                lacking = {name for name in select if name not in self.rows.get(key, {})}
                if lacking:
                    missing_keys.add(key)
                    missing_fields |= lacking
        if not keys and select is None:
            expect: Any = EITHER  # "the fields all keys hold", of no keys: the backend's choice
        elif not keys:  # zero rows of a field take its spec
            expect = SchemaError if any(self.expected_spec(n) is None for n in select) else None
        else:
            expect = StoreTimeout if missing_keys else None
        ok, result = self.run(
            f"get {keys} {select} timeout={timeout}",
            lambda: self.store.kv_batch_get(keys, self.pid, select, timeout=timeout),
            expect,
        )
        if not ok:
            if expect is StoreTimeout:
                assert result.partition_id == self.pid
                assert set(result.missing_keys) == missing_keys, result
                if select is not None:
                    assert set(result.missing_fields) == missing_fields, result
            return
        assert result.batch_size == torch.Size([len(keys)])
        if keys:
            assert set(result.keys()) == wanted
            self.check_rows(result, keys, sorted(wanted))

    def check_rows(self, td: TensorDict, keys: list[str], names: list[str]) -> None:
        for name in names:
            spec = self.expected_spec(name)
            assert spec is not None
            for key, got in zip(keys, got_rows(spec, td.get(name), len(keys))):
                want = self.rows[key][name]
                assert same_row(got, want), (
                    f"{name}[{key!r}]: stored {describe_row(want)}, got {describe_row(got)}"
                )

    def get_malformed(self, data: st.DataObject) -> None:
        keys = self.draw_keys(data, 1, 3)
        select: Any = [data.draw(choice(FIELDS))]
        timeout: Any = 0
        pid: Any = self.pid
        case = data.draw(
            st.sampled_from(
                (
                    "duplicate keys",
                    "keys not str",
                    "keys not UTF-8",
                    "keys str",
                    "duplicate fields",
                    "field not str",
                    "timeout",
                    "partition id",
                    "kv_list partition id",
                )
            )
        )
        expect: type[StoreError] = SchemaError
        if case == "kv_list partition id":
            bad_pid = data.draw(st.sampled_from(["", 5, None, [], b"p"]))
            self.run(f"kv_list({bad_pid!r})", lambda: self.store.kv_list(bad_pid), SchemaError)
            return
        if case == "duplicate keys":
            keys = [*keys, keys[0]]
        elif case == "keys not str":
            keys = [*keys, 3]
        elif case == "keys not UTF-8":
            keys = [*keys, data.draw(_SURROGATES)]
        elif case == "keys str":
            keys = keys[0]
        elif case == "duplicate fields":
            select = [*select, select[0]]
        elif case == "field not str":
            select = [*select, 3]
        elif case == "timeout":
            timeout = data.draw(st.sampled_from([-1, -0.5, float("nan"), float("inf"), "0", True]))
            expect = StoreError
        else:
            pid = data.draw(st.sampled_from(["", 5, None]))
        self.run(
            f"get with {case}",
            lambda: self.store.kv_batch_get(keys, pid, select, timeout=timeout),
            expect,
        )

    # -- declares and clears -----------------------------------------------------------------

    @rule(data=st.data())
    def declare(self, data: st.DataObject) -> None:
        """Declares specs: a spec other than the one fixed is refused, and nothing changes."""
        if data.draw(st.booleans()):
            self.declare_malformed(data)
            return
        names = data.draw(name_lists(0, 2))
        specs = {}
        for name in names:
            known = self.expected_spec(name)
            choices = SPECS if known is None else (known, *SPECS)
            specs[name] = data.draw(st.sampled_from(choices))
        conflict = any(
            (known := self.expected_spec(name)) is not None and known != spec
            for name, spec in specs.items()
        )
        ok, _ = self.run(
            f"declare {specs}",
            lambda: self.store.declare(self.pid, specs),
            SchemaError if conflict else None,
        )
        if ok:
            self.exists = True
            for name, spec in specs.items():
                self.fix_spec(name, spec)

    def declare_malformed(self, data: st.DataObject) -> None:
        specs = data.draw(
            st.sampled_from(
                [
                    {"pp_a": "dense"},
                    {"": FieldSpec.objects()},
                    {3: FieldSpec.objects()},
                    {"pp_a": None},
                    {"pp_b": FieldSpec.objects(), "pp_a": {"kind": "object"}},
                    [("pp_a", FieldSpec.objects())],
                    (("pp_a", FieldSpec.objects()),),
                    None,
                    "pp_a",
                    FieldSpec.objects(),
                ]
            )
        )
        pid = data.draw(st.sampled_from([self.pid, self.pid, "", 7]))
        self.run(f"declare {specs!r}", lambda: self.store.declare(pid, specs), SchemaError)

    @rule(data=st.data())
    def clear(self, data: st.DataObject) -> None:
        """Clears some keys (often), the whole partition (seldom), or is malformed."""
        how = data.draw(choice(("keys", "keys", "keys", "malformed", "malformed", "partition")))
        if how == "keys":
            self.clear_keys(data)
        elif how == "malformed":
            self.clear_malformed(data)
        else:
            self.clear_partition()

    def clear_keys(self, data: st.DataObject) -> None:
        keys = list(data.draw(ANY_KEYS))
        held = sum(key in self.rows for key in keys)
        ok, count = self.run(f"clear {keys}", lambda: self.store.kv_clear(self.pid, keys), None)
        assert count == held, f"kv_clear returned {count}, the partition held {held} of {keys}"
        for key in keys:
            self.rows.pop(key, None)

    def clear_malformed(self, data: st.DataObject) -> None:
        keys = self.draw_keys(data, 1, 3)
        bad: Any = data.draw(
            st.sampled_from(
                [[*keys, keys[0]], [*keys, 4], [*keys, "\udc80"], keys[0], set(keys), None]
            )
        )
        pid: Any = self.pid
        if bad is None:  # keys=None is the whole partition: give a bad partition id instead
            pid = data.draw(st.sampled_from(["", 5, None]))
        self.run(f"clear {bad!r} of {pid!r}", lambda: self.store.kv_clear(pid, bad), SchemaError)

    def clear_partition(self) -> None:
        ok, count = self.run("clear the partition", lambda: self.store.kv_clear(self.pid), None)
        assert count == len(self.rows), f"kv_clear returned {count}, held {len(self.rows)}"
        self.rows.clear()
        self.specs.clear()
        self.exists = False

    # -- the check after every step ----------------------------------------------------------

    @invariant()
    def store_holds_what_the_model_holds(self) -> None:
        listing = self.store.kv_list(self.pid)
        for key, names in listing.items():
            assert len(set(names)) == len(names), f"kv_list repeats fields of {key!r}: {names}"
        assert {key: set(names) for key, names in listing.items()} == {
            key: set(held) for key, held in self.rows.items()
        }
        assert (self.pid in self.store.partitions()) == self.exists
        by_field: dict[str, list[str]] = {}
        for key, held in self.rows.items():
            for name in held:
                by_field.setdefault(name, []).append(key)
        for name, keys in by_field.items():
            td = self.store.kv_batch_get(keys, self.pid, [name], timeout=0)
            assert td.batch_size == torch.Size([len(keys)]) and list(td.keys()) == [name]
            self.check_rows(td, keys, [name])
        if self.rows:  # every key at once: the fields that all of them hold
            keys = list(self.rows)
            td = self.store.kv_batch_get(keys, self.pid, None, timeout=0)
            common = set.intersection(*(set(self.rows[key]) for key in keys))
            assert set(td.keys()) == common
            self.check_rows(td, keys, sorted(common))

    def teardown(self) -> None:
        self.store.kv_clear(self.pid)


# -- running it on both backends ------------------------------------------------------------------

# Examples and steps per backend: the Ray store costs more per call.
RUNS = {"memory": (100, 16), "ray": (25, 12)}


@pytest.fixture(params=["memory", "ray"])
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[str, Store]]:
    """The embedded store (fresh per test) and the session's Ray store (2 shards)."""
    if request.param == "memory":
        store = open_store("memory://", default_timeout=30)
        yield "memory", store
        store.close()
    else:
        yield "ray", request.getfixturevalue("ray_store")


def n_shards(store: Store) -> int:
    return parse_store_url(store.url).shards if store.url.startswith("ray://") else 1


def test_random_operations_keep_the_store_equal_to_its_model(backend: tuple[str, Store]) -> None:
    """Random valid and bad operations raise only typed errors and never change what is stored
    but as the model says."""
    name, store = backend
    examples, steps = RUNS[name]
    run_state_machine_as_test(
        lambda: StoreMachine(store),
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            suppress_health_check=[
                HealthCheck.function_scoped_fixture,
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
            ],
        ),
    )


# -- examples the random runs reach seldom -------------------------------------------------------


def _float8_rows() -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(
        torch.zeros(2).to(torch.float8_e4m3fn), torch.tensor([0, 2])
    )


_BAD_INPUT = [
    pytest.param(
        lambda s, p: s.kv_batch_put(["a"], p, {"x": [torch.zeros(2).to(torch.float8_e4m3fn)]}),
        id="jagged float8 rows as a list",
    ),
    pytest.param(
        lambda s, p: s.kv_batch_put(["a"], p, {"x": _float8_rows()}),
        id="jagged float8 rows as a nested tensor",
    ),
    pytest.param(
        lambda s, p: s.kv_batch_put(["a"], p, {"o": ["\ud800"]}),
        id="lone surrogate in an object value",
    ),
    pytest.param(
        lambda s, p: s.kv_batch_put(["a", "b"], p, {"o": ["fine", {"\udfff": 1}]}),
        id="lone surrogate in an object key",
    ),
    pytest.param(
        lambda s, p: s.kv_batch_put(["a"], p, {"o": [10**5000]}),
        id="int too long for JSON text",
    ),
    pytest.param(
        lambda s, p: s.kv_batch_put(["a"], p, {"o": [_deep_list(3000)]}),
        id="deeply nested object value",
    ),
    pytest.param(
        lambda s, p: s.kv_batch_put(["a"], p, {"o": [_deep_list(MAX_DEPTH)]}),
        id="object value one level too deep",
    ),
    pytest.param(
        lambda s, p: s.kv_batch_put(["a"], p, {"x": torch.zeros(1, 2).to_sparse()}),
        id="sparse tensor",
    ),
    pytest.param(
        lambda s, p: s.kv_batch_put(["a"], p, {"x": [torch.ones(2).to_sparse()]}),
        id="sparse jagged row",
    ),
    pytest.param(
        lambda s, p: s.kv_batch_put(["a"], p, {"x": torch.zeros(1, device="meta")}),
        id="meta-device tensor",
    ),
    pytest.param(
        lambda s, p: s.kv_batch_put(["a"], p, {"x": [torch.zeros(2, device="meta")]}),
        id="meta-device jagged row",
    ),
    pytest.param(
        lambda s, p: s.declare(p, [("x", FieldSpec.objects())]),
        id="declare with a list of pairs",
    ),
    pytest.param(lambda s, p: s.declare(p, None), id="declare with None"),
]


@pytest.mark.parametrize("call", _BAD_INPUT)
def test_bad_input_raises_schema_error_and_changes_nothing(
    backend: tuple[str, Store], pid: str, call: Callable[[Store, str], Any]
) -> None:
    _, store = backend
    with pytest.raises(SchemaError, match=pid):
        call(store, pid)
    assert store.kv_list(pid) == {}
    assert pid not in store.partitions()


def test_object_value_nested_to_the_limit_comes_back(backend: tuple[str, Store], pid: str) -> None:
    _, store = backend
    deepest = _deep_list(MAX_DEPTH - 1)  # MAX_DEPTH lists, one inside the other
    store.kv_batch_put(["a"], pid, {"o": [deepest]})
    assert store.kv_batch_get(["a"], pid, ["o"], timeout=0).get("o").tolist() == [deepest]


@pytest.mark.parametrize("bad", ["", [], None, 5])
def test_kv_list_of_a_bad_partition_id(backend: tuple[str, Store], bad: Any) -> None:
    _, store = backend
    with pytest.raises(SchemaError, match="partition_id"):
        store.kv_list(bad)


def test_a_key_that_is_not_utf8_is_refused(backend: tuple[str, Store], pid: str) -> None:
    """Both backends refuse a key with a lone surrogate, naming it, in every verb."""
    _, store = backend
    key = "\ud800"
    with pytest.raises(SchemaError, match="UTF-8"):
        store.kv_batch_put(["fine", key], pid, {"scores": torch.ones(2)})
    with pytest.raises(SchemaError, match="UTF-8"):
        store.kv_batch_get([key], pid, ["scores"], timeout=0)
    with pytest.raises(SchemaError, match="UTF-8"):
        store.kv_clear(pid, [key])
    assert store.kv_list(pid) == {}


def test_get_of_no_fields_needs_no_partition(backend: tuple[str, Store], pid: str) -> None:
    """`select_fields=[]` waits for nothing, whether or not the partition exists."""
    _, store = backend
    td = store.kv_batch_get(["a", "b"], pid, [], timeout=0)
    assert td.batch_size == torch.Size([2]) and list(td.keys()) == []
    store.kv_batch_put(["c"], pid, {"scores": torch.ones(1)})
    td = store.kv_batch_get(["a", "b"], pid, [], timeout=0)
    assert td.batch_size == torch.Size([2]) and list(td.keys()) == []


def _keys_on_two_shards(store: Store) -> tuple[str, str]:
    """Two keys on different shards (any two keys for the embedded store)."""
    shards = n_shards(store)
    if shards == 1:
        return "k0", "k1"
    keys = [f"k{i}" for i in range(16)]
    owner = shard_of(keys, shards).tolist()
    return keys[owner.index(0)], keys[owner.index(1)]


@pytest.mark.parametrize("first_on", [0, 1], ids=["first put on shard 0", "first put on shard 1"])
def test_spec_fixed_by_a_put_holds_on_every_shard(
    backend: tuple[str, Store], pid: str, first_on: int
) -> None:
    """A field's first put fixes its spec in the partition, whichever shard a later put reaches."""
    _, store = backend
    keys = _keys_on_two_shards(store)
    first, second = keys[first_on], keys[1 - first_on]
    store.kv_batch_put([first], pid, {"pp_x": torch.zeros(1)})
    with pytest.raises(SchemaError, match="pp_x"):
        store.kv_batch_put([second], pid, {"pp_x": torch.zeros(1, dtype=torch.int64)})
    assert list(store.kv_list(pid)) == [first]
    store.kv_batch_put([second], pid, {"pp_x": torch.ones(1)})
    got = store.kv_batch_get([first, second], pid, ["pp_x"], timeout=0)
    assert got["pp_x"].tolist() == [0.0, 1.0]


def test_spec_fixed_by_a_put_of_no_keys_holds_on_every_shard(
    backend: tuple[str, Store], pid: str
) -> None:
    _, store = backend
    first, second = _keys_on_two_shards(store)
    store.kv_batch_put([], pid, {"pp_x": torch.zeros(0, 2)})
    for key in (first, second):
        with pytest.raises(SchemaError, match="pp_x"):
            store.kv_batch_put([key], pid, {"pp_x": torch.zeros(1)})
    assert store.kv_list(pid) == {}


@pytest.mark.parametrize(
    "rows", [[torch.arange(3)], [{"a": 1}], torch.zeros(1, 2)], ids=["jagged", "object", "dense"]
)
def test_put_of_no_keys_for_a_field_fixed_by_a_put(
    backend: tuple[str, Store], pid: str, rows: Any
) -> None:
    """Zero rows of a field whose spec a put fixed are `[]`, as for a vocabulary field."""
    _, store = backend
    store.kv_batch_put(["a"], pid, {"pp_rows": rows})
    meta = store.kv_batch_put([], pid, {"pp_rows": [], "prompt_ids": []})
    assert meta.keys == () and set(meta.fields) == {"pp_rows", "prompt_ids"}
    assert store.kv_list(pid) == {"a": ["pp_rows"]}
    with pytest.raises(SchemaError, match="pp_never"):
        store.kv_batch_put([], pid, {"pp_never": []})


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "no overwrite"])
@pytest.mark.parametrize(
    ("old", "new"),
    [(1, True), (1, 1.0), (0.0, -0.0), ([1], [True]), ({"a": 1, "b": 2}, {"b": 2, "a": 1.0})],
    ids=repr,
)
def test_object_put_of_an_equal_but_different_json_value(
    backend: tuple[str, Store], pid: str, old: Any, new: Any, overwrite: bool
) -> None:
    """Another JSON value is stored with overwrite and conflicts without it."""
    _, store = backend
    store.kv_batch_put(["a"], pid, {"pp_obj": [old]})
    try:
        store.kv_batch_put(["a"], pid, {"pp_obj": [new]}, overwrite=overwrite)
    except ConflictError:
        assert not overwrite
        return
    if not overwrite:
        raise AssertionError(f"a put of {new!r} over {old!r} without overwrite succeeded")
    got = store.kv_batch_get(["a"], pid, ["pp_obj"], timeout=0).get("pp_obj").tolist()
    assert json.dumps(got) == json.dumps([new]), f"stored {got!r} after overwriting with {new!r}"


def test_object_put_with_other_dict_key_order_is_identical(
    backend: tuple[str, Store], pid: str
) -> None:
    _, store = backend
    store.kv_batch_put(["a"], pid, {"pp_obj": [{"a": 1, "b": [2.0]}]})
    store.kv_batch_put(["a"], pid, {"pp_obj": [{"b": [2.0], "a": 1}]})  # no ConflictError
    got = store.kv_batch_get(["a"], pid, ["pp_obj"], timeout=0).get("pp_obj").tolist()
    assert got == [{"a": 1, "b": [2.0]}]
