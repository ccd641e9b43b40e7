"""The flow's state in a checkpoint (``flows.checkpoint.RunState``): one typed record, written
and read back whole."""

from __future__ import annotations

from pathlib import Path

import torch

from flows.checkpoint import RunState, read_state, save_checkpoint
from storage import BatchMeta, open_store
from tasks.context import StageResult


def test_a_run_state_is_read_back_as_it_was_saved(tmp_path: Path) -> None:
    later = BatchMeta("step-000004", ("a/0", "a/1"), ("prompt_ids",))
    produced = StageResult(BatchMeta("step-000004", ("a/0",), ("rm_scores",)), {"score": 0.5})
    state = RunState(
        step=3,
        data={"epoch": 1, "position": 7},
        kl={"value": 0.1},
        submitted={4: later},
        produced={4: produced},
    )
    saved: list[str] = []
    with open_store("memory://") as store:
        store.kv_batch_put(["a/0", "a/1"], "step-000004", {"group_ids": torch.tensor([0, 0])})
        store.kv_batch_put(["b/0"], "step-000009", {"group_ids": torch.tensor([1])})
        path = save_checkpoint(tmp_path, state, save_workers=saved.append, store=store, keep=2)
    assert sorted(p.name for p in (path / "store").iterdir()) == ["step-000004.arrow"]
    assert saved == [str(path.with_name(path.name + ".tmp") / "workers")]  # renamed after
    back = read_state(path)
    assert back == state
    assert back.partitions == ["step-000004"]
