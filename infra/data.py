"""The addition task's prompt files, the resumable prompt cursor, and the addition rule.

Prompts are chat messages whose content is ``"ab+cd="`` with a, b in 10..99; the answer is the
decimal sum. ``make_addition_dataset`` writes every pair once (8,100 rows), shuffled by a seed,
the first ``heldout`` of them to ``heldout.parquet`` and the rest to ``train.parquet``; its row
schema is ``uid`` (str), ``raw_prompt`` (list of ``{"role", "content"}``), ``ground_truth`` (str).
``write_addition_verl`` writes the same split in verl's RL layout (read by ``read_rl_rows``).

``PromptDataset`` serves rows (from either reader) in batches; users' files in verl's layout are
read and rendered by ``infra.rl_data``, whose names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from infra.reward_functions import exact_match as addition_rule
from infra.rl_data import (
    DataError,
    PromptRow,
    PromptTooLongError,
    RenderedPrompts,
    chat_prompt_ids,
    read_rl_rows,
    render_prompts,
)

__all__ = [
    "DataError",
    "PromptDataset",
    "PromptRow",
    "PromptTooLongError",
    "RenderedPrompts",
    "addition_prompt",
    "addition_rule",
    "chat_prompt_ids",
    "make_addition_dataset",
    "read_prompt_rows",
    "read_rl_rows",
    "render_prompts",
    "write_addition_prompts",
    "write_addition_verl",
]

OPERAND_RANGE = range(10, 100)

_MESSAGES = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))
_SCHEMA = pa.schema(
    [
        pa.field("uid", pa.string()),
        pa.field("raw_prompt", _MESSAGES),
        pa.field("ground_truth", pa.string()),
    ]
)
_VERL_SCHEMA = pa.schema(
    [
        pa.field("data_source", pa.string()),
        pa.field("prompt", _MESSAGES),
        pa.field("ability", pa.string()),
        pa.field(
            "reward_model",
            pa.struct([pa.field("style", pa.string()), pa.field("ground_truth", pa.string())]),
        ),
        pa.field(
            "extra_info",
            pa.struct([pa.field("split", pa.string()), pa.field("index", pa.int64())]),
        ),
    ]
)


def addition_prompt(a: int, b: int) -> str:
    """The user message for ``a + b``, e.g. ``"12+34="``."""
    return f"{a}+{b}="


def _write_table(path: Path, table: pa.Table) -> None:
    """Write ``table`` to ``path`` atomically (a temporary file, then a rename)."""
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def write_addition_prompts(path: Path, pairs: list[tuple[int, int]]) -> None:
    """Write one prompt row per ``(a, b)`` pair (uid, chat prompt, the sum as ground truth) to
    ``path`` in ppoflow's prompt layout; the folder is made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pydict(
        {
            "uid": [f"add-{a}+{b}" for a, b in pairs],
            "raw_prompt": [[{"role": "user", "content": addition_prompt(a, b)}] for a, b in pairs],
            "ground_truth": [str(a + b) for a, b in pairs],
        },
        schema=_SCHEMA,
    )
    _write_table(path, table)


def _addition_split(seed: int, heldout: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Every ``(a, b)`` pair once, shuffled by ``seed``: ``(train, heldout)``."""
    pairs = [(a, b) for a in OPERAND_RANGE for b in OPERAND_RANGE]
    if not 0 < heldout < len(pairs):
        raise ValueError(f"heldout={heldout} must be between 1 and {len(pairs) - 1}")
    order = np.random.default_rng(seed).permutation(len(pairs))
    shuffled = [pairs[i] for i in order]
    return shuffled[heldout:], shuffled[:heldout]


def make_addition_dataset(out_dir: Path, *, seed: int = 0, heldout: int = 500) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``heldout.parquet`` under ``out_dir``; return their paths.

    Deterministic in ``seed``; the two files never share a prompt.
    """
    train_pairs, heldout_pairs = _addition_split(seed, heldout)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, heldout_path = out_dir / "train.parquet", out_dir / "heldout.parquet"
    write_addition_prompts(heldout_path, heldout_pairs)
    write_addition_prompts(train_path, train_pairs)
    return train_path, heldout_path


def _write_verl_rows(path: Path, pairs: list[tuple[int, int]], split: str) -> None:
    table = pa.Table.from_pydict(
        {
            "data_source": ["addition"] * len(pairs),
            "prompt": [[{"role": "user", "content": addition_prompt(a, b)}] for a, b in pairs],
            "ability": ["arithmetic"] * len(pairs),
            "reward_model": [{"style": "rule", "ground_truth": str(a + b)} for a, b in pairs],
            "extra_info": [{"split": split, "index": i} for i in range(len(pairs))],
        },
        schema=_VERL_SCHEMA,
    )
    _write_table(path, table)


def write_addition_verl(out_dir: Path, *, seed: int = 0, heldout: int = 500) -> tuple[Path, Path]:
    """Write the addition split of ``make_addition_dataset`` (same ``seed``, same rows) in verl's
    RL layout as ``train.parquet`` and ``test.parquet`` under ``out_dir``; return their paths."""
    train_pairs, heldout_pairs = _addition_split(seed, heldout)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, test_path = out_dir / "train.parquet", out_dir / "test.parquet"
    _write_verl_rows(test_path, heldout_pairs, "test")
    _write_verl_rows(train_path, train_pairs, "train")
    return train_path, test_path


def read_prompt_rows(path: Path) -> list[PromptRow]:
    """All rows of a prompt Parquet file, in file order."""
    table = pq.read_table(path)
    return [
        PromptRow(
            uid=row["uid"], raw_prompt=list(row["raw_prompt"]), ground_truth=row["ground_truth"]
        )
        for row in table.to_pylist()
    ]


class PromptDataset:
    """Prompt rows served in batches by a deterministic, resumable cursor.

    The cursor is ``(epoch, index)``. Epoch ``e`` visits the rows in a permutation drawn from
    ``(seed, e)`` (row order when ``shuffle`` is False); batches run across epoch boundaries.
    ``state_dict``/``load_state_dict`` save and restore the cursor, so a resumed dataset returns
    exactly the batches the original would have returned next.

    A row served in epoch ``e > 0`` has uid ``f"{uid}@{e}"`` (epoch 0 serves the uids as read),
    so the uids of one batch are distinct even when the batch wraps into the next epoch.
    """

    def __init__(self, path: Path, *, seed: int, shuffle: bool = True) -> None:
        self.path: Path | None = Path(path)
        self._setup(read_prompt_rows(self.path), seed=seed, shuffle=shuffle, name=str(self.path))

    @classmethod
    def from_rows(
        cls, rows: Sequence[PromptRow], *, seed: int, shuffle: bool = True, name: str = "prompts"
    ) -> PromptDataset:
        """A dataset over ``rows`` (e.g. from ``render_prompts``); ``name`` appears in errors."""
        dataset = cls.__new__(cls)
        dataset.path = None
        dataset._setup(list(rows), seed=seed, shuffle=shuffle, name=name)
        return dataset

    def _setup(self, rows: list[PromptRow], *, seed: int, shuffle: bool, name: str) -> None:
        if not rows:
            raise DataError(f"{name} has no rows")
        self.rows, self.seed, self.shuffle, self.name = rows, seed, shuffle, name
        self.epoch = 0
        self.index = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.rows)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def _served(self, position: int) -> PromptRow:
        row = self.rows[int(self._order[position])]
        return row if self.epoch == 0 else replace(row, uid=f"{row.uid}@{self.epoch}")

    def next_batch(self, n: int) -> list[PromptRow]:
        """The next ``n`` rows; wraps into the next epoch (with a fresh permutation) as needed."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        if n > len(self.rows):
            raise DataError(
                f"a batch of {n} prompts is larger than the {len(self.rows)} rows of {self.name}; "
                "lower the batch (rollout.prompts_per_step, trainer.eval_prompts) or add prompts"
            )
        batch: list[PromptRow] = []
        while len(batch) < n:
            if self.index == len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(batch), len(self.rows) - self.index)
            batch.extend(self._served(i) for i in range(self.index, self.index + take))
            self.index += take
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The cursor plus what it depends on (checked on load)."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.rows),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by ``state_dict`` from a dataset with the same rows and seed."""
        expected = {"seed": self.seed, "shuffle": self.shuffle, "num_rows": len(self.rows)}
        found = {key: state.get(key) for key in expected}
        if found != expected:
            raise ValueError(
                f"cursor state {found} does not match this dataset {expected} ({self.name}); "
                "open the dataset with the seed and rows the state was saved from"
            )
        epoch, index = int(state["epoch"]), int(state["index"])
        if not (epoch >= 0 and 0 <= index <= len(self.rows)):
            raise ValueError(
                f"cursor (epoch={epoch}, index={index}) is out of range for {len(self.rows)} rows"
            )
        self.epoch, self.index = epoch, index
        self._order = self._epoch_order(epoch)
