"""Field specs and the field vocabulary shared by every stage.

A field is one named column of a partition. Its `FieldSpec` says what each row holds:

- `dense`: a tensor of a fixed per-sample `shape` (a batch is `(B, *shape)`);
- `jagged`: a 1-D tensor of variable length per row (a batch is a `torch.jagged` nested tensor);
- `object`: a JSON-like Python value (chat messages, strings, numbers, lists, dicts).

`VOCABULARY` fixes the specs of the names used across ppoflow (DESIGN.md). Other names are
declared once, process-wide with `declare_field`, per partition with `Store.declare`, or are fixed
by their first put into a partition.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from storage.errors import SchemaError

if TYPE_CHECKING:
    import torch

Kind = Literal["dense", "jagged", "object"]
KINDS: tuple[Kind, ...] = ("dense", "jagged", "object")

# a dtype's name (torch's, without "torch.") -> the numpy dtype that holds its bits (bfloat16 has
# no numpy twin: uint16 keeps its bits). Specs hold names, so a process that only stores rows (a
# Ray store shard) never imports torch.
_NUMPY_OF: dict[str, np.dtype[Any]] = {
    "bool": np.dtype(np.bool_),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


def dtype_name(dtype: torch.dtype | str) -> str:
    """`torch.int64` (or `"int64"`) -> `"int64"`."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, init=False)
class FieldSpec:
    """What one row of a field holds.

    Attributes:
        kind: "dense", "jagged" or "object".
        dtype_name: element dtype of dense and jagged fields, by name (`"int64"`); None for
            object fields. `dtype` is the torch dtype of that name.
        shape: per-sample shape of a dense field (`()` for one number per sample); jagged rows
            are 1-D, so their shape is always `()`.
    """

    kind: Kind
    dtype_name: str | None
    shape: tuple[int, ...]

    def __init__(
        self, kind: Kind, dtype: torch.dtype | str | None = None, shape: tuple[int, ...] = ()
    ) -> None:
        """``dtype``: a torch dtype or its name (`torch.int64` or `"int64"`)."""
        name = None if dtype is None else dtype_name(dtype)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "dtype_name", name)
        object.__setattr__(self, "shape", tuple(int(n) for n in shape))
        if kind not in KINDS:
            raise SchemaError(f"field kind must be one of {KINDS}, got {kind!r}")
        if kind == "object":
            if dtype is not None or self.shape:
                raise SchemaError("an object field has no dtype and no shape")
            return
        named = isinstance(dtype, str) or str(dtype).startswith("torch.")
        if not named or name not in _NUMPY_OF:
            raise SchemaError(f"{kind} field dtype must be one of {sorted(_NUMPY_OF)}, got {dtype}")
        if kind == "jagged" and self.shape:
            raise SchemaError("jagged rows are 1-D: a jagged FieldSpec takes no shape")
        if any(n < 0 for n in self.shape):
            raise SchemaError(f"dense shape must be non-negative, got {self.shape}")

    @classmethod
    def dense(cls, dtype: torch.dtype | str, shape: tuple[int, ...] = ()) -> FieldSpec:
        """A fixed-shape tensor per sample: a batch is `(B, *shape)`."""
        return cls("dense", dtype, shape)

    @classmethod
    def jagged(cls, dtype: torch.dtype | str) -> FieldSpec:
        """A variable-length 1-D tensor per sample."""
        return cls("jagged", dtype)

    @classmethod
    def objects(cls) -> FieldSpec:
        """A JSON-like Python value per sample."""
        return cls("object")

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype of dense and jagged elements (imports torch); None for objects."""
        if self.dtype_name is None:
            return None
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype

    @property
    def np_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of stored elements (uint8 UTF-8 JSON bytes for object fields)."""
        return np.dtype(np.uint8) if self.dtype_name is None else _NUMPY_OF[self.dtype_name]

    def describe(self) -> str:
        """Short text for messages: `jagged int64`, `dense float32 (3,)`, `object`."""
        if self.dtype_name is None:
            return self.kind
        text = f"{self.kind} {self.dtype_name}"
        return f"{text} {self.shape}" if self.shape else text

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly dict; `FieldSpec.from_json` reverses it."""
        return {"kind": self.kind, "dtype": self.dtype_name, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FieldSpec:
        """Rebuilds a spec from `to_json` output; unknown kinds or dtypes raise SchemaError."""
        try:
            name = data["dtype"]
            if name is not None and name not in _NUMPY_OF:
                raise SchemaError(f"unknown dtype {name!r} in field spec {dict(data)}")
            return cls(cast(Kind, data["kind"]), name, tuple(data.get("shape", ())))
        except (KeyError, TypeError) as exc:
            raise SchemaError(f"malformed field spec {data!r}: {exc}") from exc


VOCABULARY: Mapping[str, FieldSpec] = MappingProxyType(
    {
        "prompt_ids": FieldSpec.jagged("int64"),
        "response_ids": FieldSpec.jagged("int64"),
        "raw_prompt": FieldSpec.objects(),
        "ground_truth": FieldSpec.objects(),
        "data_source": FieldSpec.objects(),
        "extra_info": FieldSpec.objects(),
        "group_ids": FieldSpec.dense("int64"),
        "rollout_logprobs": FieldSpec.jagged("float32"),
        "old_logprobs": FieldSpec.jagged("float32"),
        "ref_logprobs": FieldSpec.jagged("float32"),
        "teacher_logprobs": FieldSpec.jagged("float32"),  # on-policy distillation's teacher
        "values": FieldSpec.jagged("float32"),
        "advantages": FieldSpec.jagged("float32"),
        "returns": FieldSpec.jagged("float32"),
        "rm_scores": FieldSpec.jagged("float32"),
        "scores": FieldSpec.dense("float32"),
        "rule_scores": FieldSpec.dense("float32"),
        "rollout_version": FieldSpec.dense("int64"),
        "truncated": FieldSpec.dense("bool"),  # the response was cut at the token cap
        "reward_parts": FieldSpec.objects(),  # {part: unweighted value}: rm, rule, fn/<name>, ...
        "judge_verdicts": FieldSpec.objects(),  # the LLM judge's verdict text per sample
        "loss_mask": FieldSpec.jagged("bool"),  # True on sampled tokens, False on tool tokens
        "messages": FieldSpec.objects(),  # a multi-turn sample's whole conversation
        "num_turns": FieldSpec.dense("int64"),  # assistant turns the policy generated
        "tool_calls": FieldSpec.dense("int64"),  # tool calls the sample asked for
        "tool_errors": FieldSpec.dense("int64"),  # of those, the ones that failed
        "truncated_tool_responses": FieldSpec.dense("int64"),  # tool answers cut
    }
)

_declared: dict[str, FieldSpec] = {}
_declared_lock = threading.Lock()


def declare_field(name: str, spec: FieldSpec) -> None:
    """Declares a field name for this process; re-declaring the same spec is a no-op.

    Raises:
        SchemaError: the name already has a different spec (vocabulary or earlier declaration).
    """
    if not isinstance(spec, FieldSpec):
        raise SchemaError(f"declare_field({name!r}, ...) needs a FieldSpec, got {spec!r}")
    with _declared_lock:
        known = VOCABULARY.get(name) or _declared.get(name)
        if known is not None and known != spec:
            raise SchemaError(
                f"field {name!r} is already declared as {known.describe()}; "
                f"cannot redeclare it as {spec.describe()} (pick another name)"
            )
        _declared[name] = spec


def registered_spec(name: str) -> FieldSpec | None:
    """The process-wide spec of a field name (vocabulary or `declare_field`), if any."""
    return VOCABULARY.get(name) or _declared.get(name)
