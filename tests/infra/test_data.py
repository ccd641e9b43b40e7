"""The addition dataset on disk, the resumable prompt cursor, and the rule."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from infra.data import (
    DataError,
    PromptDataset,
    PromptRow,
    addition_rule,
    make_addition_dataset,
)


@pytest.fixture(scope="module")
def dataset_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_addition_dataset(tmp_path_factory.mktemp("data"), seed=0, heldout=500)


def _uids(rows: list[PromptRow]) -> list[str]:
    return [row.uid for row in rows]


def test_dataset_rows_split_and_schema(dataset_files: tuple[Path, Path]) -> None:
    train_path, heldout_path = dataset_files
    train, heldout = pq.read_table(train_path), pq.read_table(heldout_path)
    # a, b in 10..99 gives 90 * 90 = 8100 prompts; 500 are held out.
    assert (train.num_rows, heldout.num_rows) == (7600, 500)
    assert train.column_names == ["uid", "raw_prompt", "ground_truth"]
    train_uids = set(train.column("uid").to_pylist())
    assert len(train_uids) == 7600 and not train_uids & set(heldout.column("uid").to_pylist())
    row = heldout.slice(0, 1).to_pylist()[0]
    (message,) = row["raw_prompt"]
    assert message["role"] == "user"
    a, b = message["content"].removesuffix("=").split("+")
    assert message["content"].endswith("=") and row["ground_truth"] == str(int(a) + int(b))


def test_dataset_is_deterministic_in_seed(tmp_path: Path, dataset_files: tuple[Path, Path]) -> None:
    _, heldout_again = make_addition_dataset(tmp_path / "again", seed=0)
    _, heldout_other = make_addition_dataset(tmp_path / "other", seed=1)
    reference = pq.read_table(dataset_files[1])
    assert pq.read_table(heldout_again).equals(reference)
    assert not pq.read_table(heldout_other).equals(reference)
    with pytest.raises(ValueError, match="heldout"):
        make_addition_dataset(tmp_path / "bad", heldout=0)


def test_cursor_is_deterministic_and_seed_dependent(dataset_files: tuple[Path, Path]) -> None:
    path = dataset_files[1]
    a, b = PromptDataset(path, seed=7), PromptDataset(path, seed=7)
    other = PromptDataset(path, seed=8)
    first = _uids(a.next_batch(64))
    assert first == _uids(b.next_batch(64))
    assert first != _uids(other.next_batch(64))
    plain = PromptDataset(path, seed=7, shuffle=False)
    assert _uids(plain.next_batch(3)) == _uids(plain.rows[:3])
    assert len(a) == 500


def test_cursor_wraps_epochs_visiting_every_row_once_per_epoch(
    dataset_files: tuple[Path, Path],
) -> None:
    dataset = PromptDataset(dataset_files[1], seed=0)
    epoch0 = _uids(dataset.next_batch(300)) + _uids(dataset.next_batch(300))  # crosses into epoch 1
    assert sorted(epoch0[:500]) == sorted(_uids(dataset.rows))
    assert dataset.state_dict()["epoch"] == 1 and dataset.state_dict()["index"] == 100
    assert all(uid.endswith("@1") for uid in epoch0[500:])  # epoch 1 tags its uids
    assert [uid.removesuffix("@1") for uid in epoch0[500:]] != epoch0[:100]  # own permutation
    assert len(set(epoch0[300:])) == 300  # the batch that wrapped holds distinct uids
    with pytest.raises(DataError, match="rollout.prompts_per_step"):
        dataset.next_batch(501)  # more than the dataset in one batch
    assert dataset.next_batch(0) == []


def test_resume_from_state_dict_gives_the_same_next_batches(
    dataset_files: tuple[Path, Path],
) -> None:
    original = PromptDataset(dataset_files[1], seed=3)
    for _ in range(7):
        original.next_batch(96)  # ends mid-epoch 1
    state = original.state_dict()
    resumed = PromptDataset(dataset_files[1], seed=3)
    resumed.load_state_dict(state)
    for _ in range(10):
        assert _uids(resumed.next_batch(64)) == _uids(original.next_batch(64))


def test_load_state_dict_refuses_a_different_dataset(dataset_files: tuple[Path, Path]) -> None:
    state = PromptDataset(dataset_files[1], seed=3).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PromptDataset(dataset_files[1], seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        PromptDataset(dataset_files[1], seed=3).load_state_dict({**state, "index": 501})


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("46", "46", 1.0),
        (" 46\n", "46", 1.0),  # whitespace is stripped
        ("47", "46", 0.0),
        ("466", "46", 0.0),
        ("4", "46", 0.0),
        ("", "46", 0.0),
        ("46=", "46", 0.0),
        ("4 6", "46", 0.0),
        ("046", "46", 0.0),  # exact text, not numeric equality
    ],
)
def test_addition_rule(response: str, truth: str, expected: float) -> None:
    assert addition_rule(response, truth) == expected
