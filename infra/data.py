"""The addition task: prompt datasets on disk (Parquet), a resumable prompt cursor, and the rule.

Prompts are chat messages whose content is ``"ab+cd="`` with a, b in 10..99; the answer is the
decimal sum. ``make_addition_dataset`` writes every pair once (8,100 rows), shuffled by a seed,
the first ``heldout`` of them to ``heldout.parquet`` and the rest to ``train.parquet``.

Row schema: ``uid`` (str), ``raw_prompt`` (list of ``{"role", "content"}``), ``ground_truth`` (str).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

OPERAND_RANGE = range(10, 100)

_SCHEMA = pa.schema(
    [
        pa.field("uid", pa.string()),
        pa.field(
            "raw_prompt",
            pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])),
        ),
        pa.field("ground_truth", pa.string()),
    ]
)


@dataclass(frozen=True)
class PromptRow:
    """One prompt: a stable id, its chat messages, and the answer the rule checks against."""

    uid: str
    raw_prompt: list[dict[str, str]]
    ground_truth: str


def addition_prompt(a: int, b: int) -> str:
    """The user message for ``a + b``, e.g. ``"12+34="``."""
    return f"{a}+{b}="


def _write_rows(path: Path, pairs: list[tuple[int, int]]) -> None:
    table = pa.Table.from_pydict(
        {
            "uid": [f"add-{a}+{b}" for a, b in pairs],
            "raw_prompt": [[{"role": "user", "content": addition_prompt(a, b)}] for a, b in pairs],
            "ground_truth": [str(a + b) for a, b in pairs],
        },
        schema=_SCHEMA,
    )
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)


def make_addition_dataset(out_dir: Path, *, seed: int = 0, heldout: int = 500) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``heldout.parquet`` under ``out_dir``; return their paths.

    Deterministic in ``seed``; the two files never share a prompt.
    """
    pairs = [(a, b) for a in OPERAND_RANGE for b in OPERAND_RANGE]
    if not 0 < heldout < len(pairs):
        raise ValueError(f"heldout={heldout} must be between 1 and {len(pairs) - 1}")
    order = np.random.default_rng(seed).permutation(len(pairs))
    shuffled = [pairs[i] for i in order]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_path, heldout_path = out_dir / "train.parquet", out_dir / "heldout.parquet"
    _write_rows(heldout_path, shuffled[:heldout])
    _write_rows(train_path, shuffled[heldout:])
    return train_path, heldout_path


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
    """Prompts from a Parquet file, served in batches by a deterministic, resumable cursor.

    The cursor is ``(epoch, index)``. Epoch ``e`` visits the rows in a permutation drawn from
    ``(seed, e)`` (file order when ``shuffle`` is False); batches run across epoch boundaries.
    ``state_dict``/``load_state_dict`` save and restore the cursor, so a resumed dataset returns
    exactly the batches the original would have returned next.
    """

    def __init__(self, path: Path, *, seed: int, shuffle: bool = True) -> None:
        self.path = Path(path)
        self.seed = seed
        self.shuffle = shuffle
        self.rows = read_prompt_rows(self.path)
        if not self.rows:
            raise ValueError(f"{self.path} has no rows")
        self.epoch = 0
        self.index = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self.rows)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def next_batch(self, n: int) -> list[PromptRow]:
        """The next ``n`` rows; wraps into the next epoch (with a fresh permutation) as needed."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        batch: list[PromptRow] = []
        while len(batch) < n:
            if self.index == len(self.rows):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(n - len(batch), len(self.rows) - self.index)
            batch.extend(self.rows[i] for i in self._order[self.index : self.index + take])
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
        """Restore a cursor saved by ``state_dict`` from a dataset with the same file and seed."""
        expected = {"seed": self.seed, "shuffle": self.shuffle, "num_rows": len(self.rows)}
        found = {key: state.get(key) for key in expected}
        if found != expected:
            raise ValueError(
                f"cursor state {found} does not match this dataset {expected} ({self.path}); "
                "open the dataset with the seed and file the state was saved from"
            )
        epoch, index = int(state["epoch"]), int(state["index"])
        if not (epoch >= 0 and 0 <= index <= len(self.rows)):
            raise ValueError(
                f"cursor (epoch={epoch}, index={index}) is out of range for {len(self.rows)} rows"
            )
        self.epoch, self.index = epoch, index
        self._order = self._epoch_order(epoch)


def addition_rule(response_text: str, ground_truth: str) -> float:
    """1.0 when the response, whitespace stripped, is exactly the answer; else 0.0.

    ``response_text`` is the decoded response with special tokens already skipped (an EOS
    closing the answer is therefore invisible here).
    """
    return 1.0 if response_text.strip() == ground_truth.strip() else 0.0
