"""Reward functions with verl's signature, loaded from users' files and run in a process pool.

A reward function is ``compute_score(data_source, solution_str, ground_truth, extra_info=None,
**kwargs)`` returning a number or a dict with ``score`` (other finite numbers in the dict become
extras, logged as ``reward_extra/<key>``). ``load_reward_function`` finds one from a
``reward.functions[i]`` entry: a ``.py`` file, an importable module, or a built-in rule
(``exact_match``, ``gsm8k``); ``load_function`` is the same lookup for another setting (the
judge's parse function, ``infra.judge``). ``RewardFunctionPool`` runs every function on every
sample in spawned worker processes, each call bounded by ``reward.function_timeout_s`` inside the
worker (SIGALRM) and each chunk of calls bounded again in the parent (a worker stuck in C code
is terminated). Any failure raises ``RewardFunctionError`` for the whole batch.

This module is the workers' import path: it imports the standard library only (no torch).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from multiprocessing import get_context
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, NamedTuple, Protocol

from infra.bounded_calls import (
    CallTimeout,
    PoolOwner,
    call_with_timeout,
    kill_executor,
    spawn_executor,
    wait_until,
)
from infra.text import one_line

__all__ = [
    "BUILTIN_FUNCTIONS",
    "FunctionScores",
    "RewardFunctionError",
    "RewardFunctionLoadError",
    "RewardFunctionPool",
    "RewardSample",
    "check_reward_functions",
    "exact_match",
    "hash_answer_match",
    "load_function",
    "load_reward_function",
    "metrics",
    "parse_hash_answer",
]

ErrorKind = Literal["raised", "timeout", "bad_value", "no_score", "died"]
RewardFn = Callable[..., Any]

_CHUNKS_PER_WORKER = 4  # chunks per worker per batch: few IPC round trips, still balanced
_START_TIMEOUT_S = 120.0  # spawning the workers and loading every function
_REPR_CHARS = 80


# --- the rules behind the built-in functions (string checks, no dependencies) -------------

_HASH_ANSWER = re.compile(r"####\s*([-+]?[0-9][0-9,]*(?:\.[0-9]+)?|[-+]?\.[0-9]+)")


def exact_match(response_text: str, ground_truth: str) -> float:
    """1.0 when the texts are equal after stripping surrounding whitespace, else 0.0."""
    return 1.0 if response_text.strip() == ground_truth.strip() else 0.0


def parse_hash_answer(text: str) -> str | None:
    """The number after the last `#### ` marker (GSM8K format), commas removed; None if absent.

    "so 1,234 in all\\n#### 1,234" → "1234"; "#### -3.5" → "-3.5".
    """
    matches = _HASH_ANSWER.findall(text)
    if not matches:
        return None
    return str(matches[-1]).replace(",", "").lstrip("+")


def _as_number(text: str) -> Decimal | None:
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def hash_answer_match(response_text: str, ground_truth: str) -> float:
    """1.0 when the response's `#### <number>` equals the ground truth's number, else 0.0.

    The ground truth may be a bare number ("1,234") or text in the same `####` format; numbers
    compare by value ("72" matches "72.0"). A response without a `####` answer scores 0.0.
    """
    answer = parse_hash_answer(response_text)
    if answer is None:
        return 0.0
    truth = parse_hash_answer(ground_truth)
    if truth is None:
        truth = ground_truth.strip().replace(",", "")
    answer_value, truth_value = _as_number(answer), _as_number(truth)
    if answer_value is None or truth_value is None:
        return 1.0 if answer == truth else 0.0
    return 1.0 if answer_value == truth_value else 0.0


def _exact_match_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> float:
    return exact_match(solution_str, str(ground_truth))


def _gsm8k_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> float:
    return hash_answer_match(solution_str, str(ground_truth))


BUILTIN_FUNCTIONS: dict[str, RewardFn] = {"exact_match": _exact_match_score, "gsm8k": _gsm8k_score}


# --- errors ------------------------------------------------------------------------------


class RewardFunctionLoadError(ValueError):
    """A reward.functions entry does not name a loadable function (checked before any run)."""


class RewardFunctionError(RuntimeError):
    """A reward-function call failed; ``kind`` says how. Nothing of the batch has a score."""

    def __init__(self, message: str, *, kind: ErrorKind, label: str, key: str) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.label = label
        self.key = key

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (Prefect and Ray may carry it)
        return (_rebuild_error, (str(self), self.kind, self.label, self.key))


def _rebuild_error(message: str, kind: ErrorKind, label: str, key: str) -> RewardFunctionError:
    return RewardFunctionError(message, kind=kind, label=label, key=key)


def _short_repr(value: Any) -> str:
    return one_line(repr(value), _REPR_CHARS)


# --- loading -----------------------------------------------------------------------------


class FunctionSpec(Protocol):
    """What this module reads of a ``RewardFunctionConfig`` (loading uses path and name)."""

    @property
    def path(self) -> str | None: ...

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float: ...


class _Spec(NamedTuple):
    path: str | None
    name: str
    weight: float = 1.0


def _is_file_path(path: str) -> bool:
    return path.endswith(".py") or "/" in path or os.sep in path


def _import_file(path: str, where: str) -> ModuleType:
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise RewardFunctionLoadError(
            f"{where}: no file {path!r} (resolved to {resolved}); set it to an existing .py file "
            f"or an importable module"
        )
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    module_name = f"ppoflow_reward_{digest}_{re.sub(r'[^0-9A-Za-z_]', '_', resolved.stem)}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise RewardFunctionLoadError(f"{where}: {resolved} cannot be loaded as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[module_name]
        raise RewardFunctionLoadError(
            f"{where}: importing {resolved} failed: {type(exc).__name__}: {one_line(str(exc), 200)}"
        ) from exc
    return module


def _import_module(path: str, where: str) -> ModuleType:
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (path == exc.name or path.startswith(exc.name + ".")):
            raise RewardFunctionLoadError(
                f"{where}: no module {path!r} is importable (and it is not a .py path); "
                f"check the name and sys.path"
            ) from exc
        raise RewardFunctionLoadError(
            f"{where}: importing module {path!r} failed: ModuleNotFoundError: {exc}"
        ) from exc
    except (Exception, SystemExit) as exc:
        raise RewardFunctionLoadError(
            f"{where}: importing module {path!r} failed: {type(exc).__name__}: "
            f"{one_line(str(exc), 200)}"
        ) from exc


def load_reward_function(spec: FunctionSpec, index: int) -> RewardFn:
    """The callable that ``reward.functions[index]`` names (``spec.path`` None = a built-in)."""
    return load_function(
        spec.path,
        spec.name,
        setting=f"reward.functions[{index}]",
        builtins=BUILTIN_FUNCTIONS,
        kind="reward function",
    )


def load_function(
    path: str | None,
    name: str,
    *,
    setting: str,
    builtins: Mapping[str, RewardFn],
    kind: str,
) -> RewardFn:
    """The callable ``name`` in ``path`` (a ``.py`` file or an importable module), or the
    built-in ``kind`` (e.g. "reward function") ``name`` when ``path`` is None; errors name
    ``<setting>.path`` / ``<setting>.name`` (``reward.functions[i]``, ``reward.judge.parse``)."""
    where = f"{setting}.name"
    if path is None:
        if name not in builtins:
            raise RewardFunctionLoadError(
                f"{where}: no built-in {kind} {name!r}; choose one of {sorted(builtins)} or set "
                f"{setting}.path"
            )
        return builtins[name]
    if _is_file_path(path):
        module = _import_file(path, f"{setting}.path")
    else:
        module = _import_module(path, f"{setting}.path")
    if not hasattr(module, name):
        defined = sorted(
            n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
        )
        raise RewardFunctionLoadError(
            f"{where}: {path} has no {name!r} (its callables: "
            f"{one_line(', '.join(defined) or 'none', 120)}); set the function's name"
        )
    function: object = getattr(module, name)
    if not callable(function):
        raise RewardFunctionLoadError(
            f"{where}: {name!r} in {path} is not callable "
            f"({type(function).__name__}); name a function"
        )
    return function


def check_reward_functions(specs: Sequence[FunctionSpec]) -> list[RewardFn]:
    """Load every function in this process; raises RewardFunctionLoadError on the first bad one."""
    return [load_reward_function(spec, index) for index, spec in enumerate(specs)]


# --- samples and results -----------------------------------------------------------------


@dataclass(frozen=True)
class RewardSample:
    """One call's inputs: the store key (for errors) and verl's compute_score arguments."""

    key: str
    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FunctionScores:
    """Per-sample results in sample order.

    scores: function label → unweighted score per sample. total: Σ weight_i · score_i per
    sample. extras: metric name (``reward_extra/...``) → value per sample, NaN where absent.
    """

    scores: dict[str, list[float]]
    total: list[float]
    extras: dict[str, list[float]]


def function_names(labels: Sequence[str]) -> list[str]:
    """Short metric names: the function name, prefixed by its file/module stem when repeated."""
    sources = [label.rsplit(":", 1)[0] for label in labels]
    bare = [label.rsplit(":", 1)[-1] for label in labels]
    names = [
        f"{_stem(source)}.{name}" if bare.count(name) > 1 else name
        for source, name in zip(sources, bare)
    ]
    return [name if names.count(name) == 1 else f"{name}#{i}" for i, name in enumerate(names)]


def _stem(source: str) -> str:
    return Path(source).stem if _is_file_path(source) else source.rsplit(".", 1)[-1]


def metrics(fs: FunctionScores) -> dict[str, float]:
    """``reward/fn/<name>/mean`` per function and ``reward_extra/<key>/mean`` (NaN-skipping)."""
    out: dict[str, float] = {}
    for name, values in zip(function_names(list(fs.scores)), fs.scores.values()):
        if values:
            out[f"reward/fn/{name}/mean"] = math.fsum(values) / len(values)
    for extra, values in fs.extras.items():
        present = [v for v in values if not math.isnan(v)]
        if present:
            out[f"{extra}/mean"] = math.fsum(present) / len(present)
    return out


# --- the worker side (runs in the pool's processes) --------------------------------------


class _Problem(NamedTuple):
    kind: ErrorKind
    detail: str


class _Failure(NamedTuple):
    kind: ErrorKind
    function_index: int
    offset: int  # the sample's position in its chunk
    detail: str


@dataclass
class _WorkerState:
    functions: list[RewardFn]
    load_error: str | None
    timeout_s: float
    barrier: Any


_STATE: _WorkerState | None = None  # set once per worker process by _init_worker

Outcome = tuple[float, dict[str, float]]


def _init_worker(specs: list[_Spec], timeout_s: float, barrier: Any) -> None:
    global _STATE
    try:
        functions, error = check_reward_functions(specs), None
    except RewardFunctionLoadError as exc:
        functions, error = [], str(exc)
    _STATE = _WorkerState(functions, error, timeout_s, barrier)


def _worker_ready() -> tuple[int, str | None]:
    """Waits until every worker holds one of these calls, so all are started and loaded."""
    assert _STATE is not None
    _STATE.barrier.wait(_START_TIMEOUT_S)
    return os.getpid(), _STATE.load_error


def _bounded_call(function: RewardFn, sample: RewardSample, state: _WorkerState) -> Any:
    """The call, interrupted after ``timeout_s`` (``infra.bounded_calls``)."""
    return call_with_timeout(
        function,
        state.timeout_s,
        data_source=sample.data_source,
        solution_str=sample.solution_str,
        ground_truth=sample.ground_truth,
        extra_info=sample.extra_info,
    )


def as_finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, NaN, inf, a string)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _parse_value(value: Any) -> Outcome | _Problem:
    if isinstance(value, Mapping):
        if "score" not in value:
            keys = ", ".join(sorted(map(str, value))) or "none"
            return _Problem("no_score", f"a dict with keys: {one_line(keys, _REPR_CHARS)}")
        score = as_finite(value["score"])
        if score is None:
            return _Problem("bad_value", f"score {_short_repr(value['score'])}")
        extras = {str(k): v for k, v in value.items() if k != "score"}
        numbers = {k: as_finite(v) for k, v in extras.items()}
        return score, {k: v for k, v in numbers.items() if v is not None}
    score = as_finite(value)
    return _Problem("bad_value", _short_repr(value)) if score is None else (score, {})


def _call_one(function: RewardFn, sample: RewardSample, state: _WorkerState) -> Outcome | _Problem:
    try:
        value = _bounded_call(function, sample, state)
    except CallTimeout:
        return _Problem("timeout", f"no result in {state.timeout_s:g} s")
    except BaseException as exc:
        return _Problem("raised", f"{type(exc).__name__}: {one_line(str(exc), 200)}")
    return _parse_value(value)


def _run_chunk(samples: list[RewardSample]) -> list[list[Outcome]] | _Failure:
    """Every function on every sample of the chunk; stops at the first failure."""
    state = _STATE
    assert state is not None
    rows: list[list[Outcome]] = []
    for offset, sample in enumerate(samples):
        row: list[Outcome] = []
        for index, function in enumerate(state.functions):
            outcome = _call_one(function, sample, state)
            if isinstance(outcome, _Problem):
                return _Failure(outcome.kind, index, offset, outcome.detail)
            row.append(outcome)
        rows.append(row)
    return rows


# --- the parent side ---------------------------------------------------------------------


class _Chunk(NamedTuple):
    start: int
    samples: list[RewardSample]


def _chunks(samples: Sequence[RewardSample], workers: int) -> list[_Chunk]:
    count = min(len(samples), workers * _CHUNKS_PER_WORKER)
    bounds = [len(samples) * i // count for i in range(count + 1)]
    return [_Chunk(a, list(samples[a:b])) for a, b in zip(bounds, bounds[1:])]


def _keys_text(samples: Sequence[RewardSample], limit: int = 4) -> str:
    shown = ", ".join(repr(s.key) for s in samples[:limit])
    return shown + (f" (+{len(samples) - limit} more)" if len(samples) > limit else "")


class RewardFunctionPool(PoolOwner):
    """Runs ``reward.functions`` on batches of samples in ``workers`` spawned processes.

    The processes start on the first ``score`` (each loads every function once) and are
    recreated on the next call after one died or got stuck. One caller at a time.
    """

    def __init__(
        self,
        specs: Sequence[FunctionSpec],
        *,
        workers: int,
        timeout_s: float,
        backstop_slack_s: float = 10.0,
    ) -> None:
        self._labels = [f"{spec.path or 'builtin'}:{spec.name}" for spec in specs]
        for i, label in enumerate(self._labels):
            if label in self._labels[:i]:
                first = self._labels.index(label)
                raise RewardFunctionLoadError(
                    f"reward.functions[{i}] repeats reward.functions[{first}] ({label}); "
                    f"remove one or merge their weights"
                )
        self._weights = [float(spec.weight) for spec in specs]
        self._specs = [_Spec(_resolved(spec.path), spec.name, spec.weight) for spec in specs]
        self._names = function_names(self._labels)
        self._workers = workers
        self._timeout_s = timeout_s
        self._slack_s = backstop_slack_s
        self._executor = None

    def score(self, samples: Sequence[RewardSample]) -> FunctionScores:
        """Every function on every sample; raises RewardFunctionError if any call fails."""
        rows: list[list[Outcome]] = []
        if samples and self._specs:
            for chunk_rows in self._run_chunks(_chunks(samples, self._workers)):
                rows.extend(chunk_rows)
        else:
            rows = [[] for _ in samples]
        return self._assemble(rows)

    def _start(self) -> ProcessPoolExecutor:
        """Spawns the workers and waits until each holds its functions."""
        if self._executor is not None:
            return self._executor
        barrier = get_context("spawn").Barrier(self._workers)
        executor = spawn_executor(
            self._workers, _init_worker, (self._specs, self._timeout_s, barrier)
        )
        self._executor = executor
        futures = [executor.submit(_worker_ready) for _ in range(self._workers)]
        done, _ = wait(futures, timeout=_START_TIMEOUT_S + 5.0)
        try:
            readies = [f.result() for f in futures if f in done]
        except Exception as exc:
            self._kill()
            raise self._start_error(f"{type(exc).__name__}: {one_line(str(exc), 200)}") from exc
        if len(readies) < len(futures):
            self._kill()
            raise self._start_error(f"not all started within {_START_TIMEOUT_S:g} s")
        for _, load_error in readies:
            if load_error is not None:
                self.close()
                raise RewardFunctionLoadError(load_error)
        return executor

    def _start_error(self, why: str) -> RewardFunctionError:
        return RewardFunctionError(
            f"reward-function workers ({self._workers}, reward.function_workers) did not start: "
            f"{why}; nothing of this batch was written",
            kind="died",
            label=", ".join(self._labels),
            key="",
        )

    def _kill(self) -> None:
        """Terminates the worker processes at once (a stuck call never returns)."""
        executor, self._executor = self._executor, None
        kill_executor(executor)

    def _run_chunks(self, chunks: list[_Chunk]) -> list[list[list[Outcome]]]:
        """Results per chunk, with at most one chunk per worker in flight.

        1. Submit while a worker is free and nothing failed.
        2. Wait for the first result or the earliest chunk deadline (the parent's backstop).
        3. After a failure, drain what is in flight, then raise the earliest sample's failure.
        """
        executor = self._start()
        results: list[Any] = [None] * len(chunks)
        in_flight: dict[Future[Any], tuple[int, float]] = {}
        next_chunk, failed = 0, False
        while in_flight or (next_chunk < len(chunks) and not failed):
            # 1.
            while next_chunk < len(chunks) and not failed and len(in_flight) < self._workers:
                chunk = chunks[next_chunk]
                budget = self._timeout_s * len(chunk.samples) * len(self._specs) + self._slack_s
                future = executor.submit(_run_chunk, chunk.samples)
                in_flight[future] = (next_chunk, time.monotonic() + budget)
                next_chunk += 1
            # 2.
            deadline = min(d for _, d in in_flight.values())
            done, _ = wait_until(in_flight.keys(), deadline, first=True)
            if not done and time.monotonic() >= deadline:
                self._raise_stuck(chunks, in_flight)
            for future in done:
                index, _ = in_flight.pop(future)
                try:
                    results[index] = future.result()
                except BrokenProcessPool as exc:
                    self._raise_died(chunks, [index, *(i for i, _ in in_flight.values())], exc)
                failed = failed or isinstance(results[index], _Failure)
        # 3.
        for chunk, result in zip(chunks, results):
            if isinstance(result, _Failure):
                raise self._call_error(chunk, result)
        return results

    def _raise_stuck(self, chunks: list[_Chunk], in_flight: dict[Future[Any], Any]) -> None:
        index, deadline = min(in_flight.values(), key=lambda item: item[1])
        chunk = chunks[index]
        self._kill()
        first = chunk.samples[0]
        raise RewardFunctionError(
            f"reward functions {', '.join(self._labels)} gave no result for the chunk starting at "
            f"sample {first.key!r} (data_source {first.data_source!r}) within "
            f"reward.function_timeout_s {self._timeout_s:g} s per call + {self._slack_s:g} s: a "
            f"call is stuck outside Python where the timeout cannot stop it; its workers were "
            f"terminated and restart on the next batch; nothing of this batch was written",
            kind="timeout",
            label=self._labels[0],
            key=first.key,
        )

    def _raise_died(self, chunks: list[_Chunk], indices: list[int], exc: BaseException) -> None:
        self._kill()
        samples = [s for i in sorted(indices) for s in chunks[i].samples]
        raise RewardFunctionError(
            f"a reward-function worker process died (os._exit, a signal or a crash in C code) "
            f"while running {', '.join(self._labels)} on samples {_keys_text(samples)}; the "
            f"workers restart on the next batch; nothing of this batch was written",
            kind="died",
            label=", ".join(self._labels),
            key=samples[0].key,
        ) from exc

    def _call_error(self, chunk: _Chunk, failure: _Failure) -> RewardFunctionError:
        sample = chunk.samples[failure.offset]
        label = self._labels[failure.function_index]
        what = {
            "raised": "failed",
            "timeout": "timed out",
            "bad_value": "returned a non-finite or non-number value",
            "no_score": "returned a dict without 'score'",
        }[failure.kind]
        hint = {
            "raised": "",
            "timeout": "; raise reward.function_timeout_s or make the function faster",
            "bad_value": "; return a finite number or a dict with a finite 'score'",
            "no_score": "; return a number or a dict with a 'score' entry",
        }[failure.kind]
        return RewardFunctionError(
            f"reward function {label} {what} on sample {sample.key!r} (data_source "
            f"{sample.data_source!r}): {failure.detail}{hint}; nothing of this batch was written",
            kind=failure.kind,
            label=label,
            key=sample.key,
        )

    def _assemble(self, rows: list[list[Outcome]]) -> FunctionScores:
        scores = {label: [row[f][0] for row in rows] for f, label in enumerate(self._labels)}
        total = [math.fsum(w * s for w, (s, _) in zip(self._weights, row)) for row in rows]
        extras: dict[str, list[float]] = {}
        for i, row in enumerate(rows):
            for f, (_, row_extras) in enumerate(row):
                for key, value in row_extras.items():
                    name = self._extra_name(f, key)
                    extras.setdefault(name, [math.nan] * len(rows))[i] = value
        return FunctionScores(scores=scores, total=total, extras=extras)

    def _extra_name(self, function_index: int, key: str) -> str:
        if len(self._labels) == 1:
            return f"reward_extra/{key}"
        return f"reward_extra/{self._names[function_index]}/{key}"


def _resolved(path: str | None) -> str | None:
    """A file path made absolute (workers must find it whatever their directory)."""
    if path is None or not _is_file_path(path):
        return path
    return str(Path(path).expanduser().resolve())
