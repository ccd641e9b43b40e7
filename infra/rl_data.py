"""Users' prompt files in verl's RL layout: read them into ``PromptRow``s, render their prompts.

``read_rl_rows`` reads local Parquet (``.parquet``) and JSON Lines (``.jsonl``, ``.json``) files
with pyarrow, concatenated in the given order. verl's layout reads as it is: ``data_source``,
``prompt`` (chat messages), ``ability``, ``reward_model`` (a struct holding ``ground_truth``),
``extra_info`` (a struct). Every key setting of ``DataConfig`` names a column; a dotted key
(``reward_model.ground_truth``) is a column of that literal name if the file has one, else a walk
into struct columns. A prompt may be chat messages or a plain string (one user message).

``render_prompts`` applies the policy tokenizer's chat template (with the generation prompt) and
enforces ``data.max_prompt_length`` by ``data.truncation``.

Every problem with a file is a one-line ``DataError`` naming the file and the setting to change.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from infra.text import first_line

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from infra.config import DataConfig, Truncation

JSON_SUFFIXES = (".jsonl", ".json")
SUFFIXES = (".parquet", *JSON_SUFFIXES)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class DataError(ValueError):
    """A prompt file or row that cannot be used as it is; the message names the setting."""


class PromptTooLongError(DataError):
    """A rendered prompt longer than ``data.max_prompt_length`` with ``data.truncation='error'``."""


@dataclass(frozen=True)
class PromptRow:
    """One prompt: a stable id, its chat messages, and what the rewards check it against.

    ``uid`` never holds a ``/`` (store keys are ``<uid>/<sample>``). ``ground_truth`` is any
    JSON-like value, as read. ``prompt_ids`` are the rendered prompt's token ids (empty until
    ``render_prompts``); ``origin`` says where the row came from, for error messages.
    """

    uid: str
    raw_prompt: list[dict[str, Any]]
    ground_truth: Any
    data_source: str = "addition"
    extra_info: dict[str, Any] = field(default_factory=dict)
    prompt_ids: tuple[int, ...] = ()
    origin: str = ""


@dataclass(frozen=True)
class RenderedPrompts:
    """Rows with ``prompt_ids`` filled; how many were cut (``left``) or skipped (``drop``), and
    the longest kept prompt in tokens."""

    rows: tuple[PromptRow, ...]
    truncated: int
    dropped: int
    longest: int


def read_rl_rows(
    files: Sequence[Path], data: DataConfig, *, setting: str = "data.train_files"
) -> list[PromptRow]:
    """All rows of ``files`` in order; ``setting`` names the config entry that listed them."""
    paths = [Path(file) for file in files]
    if not paths:
        raise DataError(f"{setting} is empty; list at least one .parquet or .jsonl file")
    prefixes = _uid_prefixes(paths)
    rows: list[PromptRow] = []
    for path, prefix in zip(paths, prefixes, strict=True):
        rows.extend(_file_rows(path, _read_table(path, setting), data, prefix=prefix))
    return rows


def _uid_prefixes(paths: list[Path]) -> list[str]:
    """Each file's uid prefix: its stem made key-safe, with the file's index where stems repeat.

    A uid is ``<prefix>-<row>``; prefixes are distinct, so uids are distinct across files.
    """
    stems = [_UNSAFE.sub("_", path.stem) or "file" for path in paths]
    return [
        stem if stems.count(stem) == 1 else f"{stem}~{index}" for index, stem in enumerate(stems)
    ]


def _read_table(path: Path, setting: str) -> pa.Table:
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unknown extension {path.suffix!r} in {setting} (use {SUFFIXES})")
    if not path.is_file():
        raise DataError(f"{path} does not exist; fix the path in {setting}")
    if path.stat().st_size == 0:
        raise DataError(f"{path} is empty; remove it from {setting} or add rows")
    try:
        table = pq.read_table(path) if path.suffix == ".parquet" else pj.read_json(path)
    except (pa.ArrowInvalid, OSError) as err:
        kind = "Parquet" if path.suffix == ".parquet" else "JSON Lines (one object per line)"
        raise DataError(f"{path} is not readable as {kind}: {first_line(err)} ({setting})") from err
    if table.num_rows == 0:
        raise DataError(f"{path} has no rows; remove it from {setting} or add rows")
    return table


def _column(table: pa.Table, key: str) -> list[Any] | None:
    """The values at ``key``: a column of that literal name, else a dotted walk into structs."""
    if key in table.column_names:
        listed: list[Any] = table.column(key).to_pylist()
        return listed
    parts = key.split(".")
    for split in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:split])
        if head in table.column_names:
            values = _struct_path(table.column(head), parts[split:])
            return None if values is None else values.to_pylist()
    return None


def _struct_path(column: pa.ChunkedArray, names: list[str]) -> pa.ChunkedArray | None:
    for name in names:
        if not pa.types.is_struct(column.type) or column.type.get_field_index(name) < 0:
            return None
        column = pc.struct_field(column, [name])
    return column


def _required(table: pa.Table, path: Path, key: str, setting: str) -> list[Any]:
    values = _column(table, key)
    if values is None:
        raise DataError(
            f"{path} has no column {key!r} (columns: {', '.join(table.column_names)}); "
            f"set {setting} to the right column or dotted path"
        )
    return values


def _file_rows(path: Path, table: pa.Table, data: DataConfig, *, prefix: str) -> list[PromptRow]:
    """One file's rows; ``data_source`` defaults to the file's stem, ``extra_info`` to ``{}``."""
    prompts = _required(table, path, data.prompt_key, "data.prompt_key")
    truths = _required(table, path, data.ground_truth_key, "data.ground_truth_key")
    sources = _column(table, data.data_source_key) or [None] * table.num_rows
    extras = _column(table, data.extra_info_key) or [None] * table.num_rows
    rows = []
    for index, (prompt, truth, source, extra) in enumerate(
        zip(prompts, truths, sources, extras, strict=True)
    ):
        origin = f"{path} row {index}"
        rows.append(
            PromptRow(
                uid=f"{prefix}-{index}",
                raw_prompt=_messages(prompt, origin),
                ground_truth=truth,
                data_source=path.stem if source is None else str(source),
                extra_info=_extra_info(extra, origin),
                origin=origin,
            )
        )
    return rows


def _messages(value: Any, origin: str) -> list[dict[str, Any]]:
    """Chat messages from a plain string or a list of ``{role, content}`` (null keys dropped)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value:
        messages = [
            {k: v for k, v in m.items() if v is not None} for m in value if isinstance(m, dict)
        ]
        if len(messages) == len(value) and all(
            isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
        ):
            return messages
    raise DataError(
        f"{origin}: the prompt is neither a string nor a list of {{role, content}} messages "
        f"(got {str(value)[:80]!r}); check data.prompt_key"
    )


def _extra_info(value: Any, origin: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    raise DataError(
        f"{origin}: extra_info must be a struct/object, got {type(value).__name__}; "
        "check data.extra_info_key"
    )


def render_prompts(
    rows: Sequence[PromptRow],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_length: int,
    truncation: Truncation,
    setting: str = "data.train_files",
    tools: list[dict[str, Any]] | None = None,
) -> RenderedPrompts:
    """Fill each row's ``prompt_ids`` with its chat-templated prompt, enforcing the length limit.

    ``truncation``: ``error`` raises ``PromptTooLongError`` on the first long prompt, ``left``
    keeps its last ``max_prompt_length`` tokens, ``drop`` skips the row. ``setting`` names the
    files the rows came from (for the error when every row is dropped); ``tools`` the tools'
    JSON schemas the template renders (``rollout.tools``).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "the policy tokenizer has no chat template; set models.tokenizer (or models.policy) "
            "to a folder whose tokenizer_config.json defines chat_template"
        )
    kept: list[PromptRow] = []
    truncated = dropped = 0
    for row in rows:
        ids = _prompt_ids(tokenizer, row, tools)
        if len(ids) > max_prompt_length:
            if truncation == "error":
                raise PromptTooLongError(
                    f"{row.origin or row.uid}: prompt is {len(ids)} tokens, over "
                    f"data.max_prompt_length={max_prompt_length}; raise it or set "
                    "data.truncation to 'left' or 'drop'"
                )
            if truncation == "drop":
                dropped += 1
                continue
            ids, truncated = ids[-max_prompt_length:], truncated + 1
        kept.append(replace(row, prompt_ids=ids))
    if not kept:
        raise DataError(
            f"all {len(rows)} prompts of {setting} are longer than "
            f"data.max_prompt_length={max_prompt_length}; raise it or set data.truncation='left'"
        )
    longest = max(len(row.prompt_ids) for row in kept)
    return RenderedPrompts(rows=tuple(kept), truncated=truncated, dropped=dropped, longest=longest)


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Any,
    *,
    tools: Sequence[dict[str, Any]] | None = None,
) -> tuple[int, ...]:
    """The tokenizer's chat template over ``messages`` with the generation prompt (and the tools'
    JSON schemas, ``rollout.tools``), as ids (transformers returns a list, or ``input_ids`` of a
    dict)."""
    out = tokenizer.apply_chat_template(
        messages, tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=True
    )
    # One conversation, tokenized: a list of ids (the stub's return type covers every mode).
    ids = out["input_ids"] if isinstance(out, Mapping) else cast(list[int], out)
    return tuple(int(token) for token in ids)


def _prompt_ids(
    tokenizer: PreTrainedTokenizerBase, row: PromptRow, tools: list[dict[str, Any]] | None
) -> tuple[int, ...]:
    """``chat_prompt_ids`` of a row; a template error names the row and the settings."""
    try:
        return chat_prompt_ids(tokenizer, row.raw_prompt, tools=tools)
    except Exception as err:  # a template error names neither the row nor the setting
        raise DataError(
            f"{row.origin or row.uid}: the chat template failed on this prompt "
            f"({first_line(err)}); "
            "check data.prompt_key or models.tokenizer"
        ) from err
