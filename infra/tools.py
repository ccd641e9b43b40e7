"""Tools for multi-turn rollouts: loaded from ``rollout.tools``, described by JSON schemas, run in
a bounded process pool.

A tool is a plain Python function given as ``{path, name}`` (a ``.py`` file or an importable
module and the function's name, loaded as reward functions are). Its JSON schema — the format
chat templates take through ``tools=`` — comes from its signature and docstring
(``tool_schemas``, transformers' ``get_json_schema``). ``ToolPool`` runs calls in ``workers``
spawned processes, each call bounded by ``timeout_s`` inside the worker and again in the parent
(a call stuck in C code has its workers killed). A failing call never raises: it comes back as
an error ``ToolResult`` whose text the policy reads on its next turn.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Protocol

from infra.bounded_calls import (
    CallTimeout,
    PoolOwner,
    call_with_timeout,
    kill_executor,
    spawn_executor,
    wait_until,
)
from infra.reward_functions import _resolved, load_function

__all__ = [
    "ToolCall",
    "ToolLoadError",
    "ToolPool",
    "ToolResult",
    "ToolSpec",
    "check_tools",
    "load_tools",
    "tool_schemas",
]

ToolFn = Callable[..., Any]
_START_TIMEOUT_S = 120.0  # spawning the workers and importing the tools


class ToolSpec(Protocol):
    """What this module reads of a ``rollout.tools`` entry."""

    @property
    def path(self) -> str: ...

    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class ToolCall:
    """One call the policy asked for: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: the text of the ``tool`` message, and whether it is an error."""

    content: str
    error: bool = False


def load_tools(specs: Sequence[ToolSpec]) -> dict[str, ToolFn]:
    """Each tool by its name; raises ``RewardFunctionLoadError`` naming ``rollout.tools[i]``."""
    tools: dict[str, ToolFn] = {}
    for index, spec in enumerate(specs):
        if spec.name in tools:
            raise ValueError(
                f"rollout.tools[{index}].name: a second tool named {spec.name!r}; tool names "
                "must be unique"
            )
        tools[spec.name] = load_function(
            _resolved(spec.path),
            spec.name,
            setting=f"rollout.tools[{index}]",
            builtins={},
            kind="tool",
        )
    return tools


class ToolLoadError(ValueError):
    """A ``rollout.tools`` entry has no JSON schema (checked before any run; see the message)."""


def check_tools(specs: Sequence[ToolSpec]) -> None:
    """Load every tool in this process and build its JSON schema; raises on the first bad one
    (``RewardFunctionLoadError`` for a file, module or name, ``ToolLoadError`` for a signature
    or docstring ``get_json_schema`` cannot read), naming ``rollout.tools[i]``."""
    from transformers.utils.chat_template_utils import get_json_schema

    for index, function in enumerate(load_tools(specs).values()):
        try:
            get_json_schema(function)
        except Exception as exc:
            raise ToolLoadError(
                f"rollout.tools[{index}].name: {specs[index].name} has no JSON schema "
                f"({type(exc).__name__}: {' '.join(str(exc).split())}); give it type hints and a Google-style "
                "docstring with an Args: line per argument"
            ) from exc


@functools.lru_cache(maxsize=8)
def _schemas(entries: tuple[tuple[str, str], ...]) -> tuple[dict[str, Any], ...]:
    from transformers.utils.chat_template_utils import get_json_schema

    specs = [_Entry(path, name) for path, name in entries]
    return tuple(get_json_schema(fn) for fn in load_tools(specs).values())


@dataclass(frozen=True)
class _Entry:
    path: str
    name: str


def tool_schemas(specs: Sequence[ToolSpec]) -> list[dict[str, Any]] | None:
    """The tools' JSON schemas for ``apply_chat_template(tools=...)``; None without tools."""
    if not specs:
        return None
    return list(_schemas(tuple((spec.path, spec.name) for spec in specs)))


# --- the worker side ---------------------------------------------------------------------

_TOOLS: dict[str, ToolFn] = {}  # set once per worker process by _init_worker
_TIMEOUT_S = [0.0]


def _init_worker(entries: list[tuple[str, str]], timeout_s: float) -> None:
    _TOOLS.update(load_tools([_Entry(path, name) for path, name in entries]))
    _TIMEOUT_S[0] = timeout_s


def _ready() -> bool:
    return True


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _run_call(call: ToolCall) -> ToolResult:
    function = _TOOLS[call.name]
    try:
        value = call_with_timeout(function, _TIMEOUT_S[0], **call.arguments)
    except CallTimeout:
        return ToolResult(f"error: {call.name} gave no result in {_TIMEOUT_S[0]:g} s", True)
    except BaseException as exc:
        return ToolResult(f"error: {call.name} raised {type(exc).__name__}: {exc}", True)
    return ToolResult(_as_text(value))


# --- the parent side ---------------------------------------------------------------------


class ToolPool(PoolOwner):
    """Runs tool calls in ``workers`` spawned processes (started on the first call, recreated
    after a call got stuck or a worker died). One caller at a time."""

    def __init__(
        self,
        specs: Sequence[ToolSpec],
        *,
        workers: int,
        timeout_s: float,
        backstop_slack_s: float = 5.0,
    ) -> None:
        self._entries = [(str(_resolved(spec.path)), spec.name) for spec in specs]
        self._names = {name for _, name in self._entries}
        self._workers = workers
        self._timeout_s = timeout_s
        self._slack_s = backstop_slack_s
        self._executor = None

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in order; unknown tools and bad arguments are error results."""
        results: list[ToolResult | None] = [self._precheck(call) for call in calls]
        todo = [i for i, r in enumerate(results) if r is None]
        for start in range(0, len(todo), self._workers):
            wave = todo[start : start + self._workers]
            for index, result in zip(wave, self._run_wave([calls[i] for i in wave])):
                results[index] = result
        return [r if r is not None else ToolResult("error: no result", True) for r in results]

    def _precheck(self, call: ToolCall) -> ToolResult | None:
        if call.name not in self._names:
            known = ", ".join(sorted(self._names)) or "none"
            return ToolResult(f"error: unknown tool {call.name!r} (tools: {known})", True)
        if not isinstance(call.arguments, Mapping):
            return ToolResult(f"error: arguments of {call.name} must be a JSON object", True)
        return None

    def _run_wave(self, calls: list[ToolCall]) -> list[ToolResult]:
        """At most one call per worker; what is not back by the deadline is a timeout, and the
        workers are killed (a call stuck in C code never returns)."""
        if self._executor is None:
            self._executor = spawn_executor(
                self._workers, _init_worker, (self._entries, self._timeout_s)
            )
            # Started (and the tools imported) before any call's clock runs.
            wait([self._executor.submit(_ready) for _ in range(self._workers)], _START_TIMEOUT_S)
        futures: list[Future[ToolResult]] = [self._executor.submit(_run_call, c) for c in calls]
        _, pending = wait_until(
            futures, time.monotonic() + self._timeout_s + self._slack_s, first=False
        )
        out: list[ToolResult] = []
        broken = False
        for call, future in zip(calls, futures):
            if future in pending:
                out.append(ToolResult(f"error: {call.name} gave no result in time", True))
                continue
            try:
                out.append(future.result())
            except BrokenProcessPool:
                broken = True
                out.append(ToolResult(f"error: {call.name} ended its process", True))
        if pending or broken:
            executor, self._executor = self._executor, None
            kill_executor(executor)
        return out
