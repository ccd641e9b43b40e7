"""Dynamic sampling end to end (real Prefect harness, real local Ray, the tiny models): groups
whose metric does not spread leave the step, further prompts refill it, in every mode and with
the colocated reward model; an injected failure in a refill round is retried without applying
anything twice."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
from cli_runs import filtering, lucky_reward

from infra.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# The reward function of cli_runs.LUCKY, 1 for about one sample in five: many groups of four
# have no spread (all 0), so most steps need a refill round. zlib.crc32: the same in every process.
def _lucky(text: str) -> float:
    return float(zlib.crc32(text.encode()) % 5 == 0)


def _run(tiny_overrides: list[str], tmp_path: Path, *extra: str):
    from flows.train import ppo_train

    cfg = load_config(
        CONFIGS / "tiny.yaml",
        [
            *tiny_overrides,
            *filtering(lucky_reward(tmp_path)),
            "trainer.total_steps=3",
            "trainer.eval_every=100",
            *extra,
        ],
    )
    state = ppo_train(cfg, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, run_dir, rows, state.state_details.flow_run_id


def _check_steps(cfg, run_dir: Path, rows: list[dict]) -> None:
    """Every step logs its cut, never keeps more than it wants, and trains only on groups whose
    metric spreads (the saved samples are the rows the update read)."""
    assert [r["step"] for r in rows] == [0, 1, 2]
    want, n = cfg.rollout.prompts_per_step, cfg.rollout.n
    for row in rows:
        assert 0 <= row["filter/kept_groups"] <= want
        assert 1 <= row["filter/rounds"] <= cfg.algorithm.filter_groups.max_rounds
        if row["filter/kept_groups"] < want:  # short only when every round ran
            assert row["filter/rounds"] == cfg.algorithm.filter_groups.max_rounds
        samples = [
            json.loads(x) for x in (run_dir / "samples" / f"step_{row['step']}.jsonl").open()
        ]
        assert len(samples) == row["filter/kept_groups"] * n
        groups: dict[int, set[float]] = {}
        for s in samples:
            assert s["fn/lucky"] == _lucky(s["response"])  # the stored part is the function's
            groups.setdefault(s["group"], set()).add(s["fn/lucky"])
        assert all(len(values) == 2 for values in groups.values()), groups
    assert any(r["filter/rounds"] > 1 for r in rows), "no step needed a refill: pick other seeds"
    assert sum(r["filter/dropped_groups"] for r in rows) > 0


def test_sync_with_the_colocated_reward_model_refills_and_retries_a_failed_round(
    prefect_harness, ray_local, tiny_overrides, tmp_path
) -> None:
    """A refill round's generate fails once (an injected raise); the task is retried and the
    step goes on: its rows are generated once (no key twice), its cut is the same."""
    from test_train_flow import _task_run_names

    cfg, run_dir, rows, flow_run_id = _run(
        tiny_overrides,
        tmp_path,
        "faults=[{stage: generate, step: 0, round: 1, action: raise}]",
    )
    assert cfg.reward.pool == "colocated" and cfg.uses_reward_model
    _check_steps(cfg, run_dir, rows)
    assert rows[0]["filter/rounds"] > 1, "the fault's round did not run"
    expected = {"filter[step=0, round=0]", "generate[step=0, round=1]", "score[step=0, round=1]"}
    names = _task_run_names(flow_run_id, expected)
    assert expected <= names, sorted(names)


@pytest.mark.parametrize(
    "extra",
    [
        ("resources.mode=colocate_async", "resources.max_staleness=1"),
        ("resources.mode=separate_async", "reward.pool=own", "algorithm.kl.monitor=false"),
        ("resources.mode=separate_async", "reward.pool=colocated"),
    ],
    ids=["colocate_async", "separate_async", "separate_async_colocated_rm"],
)
def test_async_modes_refill(prefect_harness, ray_local, tiny_overrides, tmp_path, extra) -> None:
    cfg, run_dir, rows, _ = _run(tiny_overrides, tmp_path, *extra)
    _check_steps(cfg, run_dir, rows)
    assert max(r["rollout/staleness"] for r in rows) <= cfg.resources.max_staleness


def test_a_step_that_keeps_no_group_updates_nothing_and_says_so(
    prefect_harness, ray_local, tiny_overrides, tmp_path
) -> None:
    """The untrained tiny policy never answers right: on the rule, no group spreads, every
    round drops everything, and the step logs that it trained on nothing."""
    cfg, run_dir, rows, _ = _run(
        tiny_overrides,
        tmp_path,
        "algorithm.filter_groups.metric=rule",
        "algorithm.filter_groups.max_rounds=2",
        "trainer.total_steps=2",
    )
    for row in rows:
        assert row["filter/kept_groups"] == 0 and row["filter/rounds"] == 2
        assert row["filter/dropped_groups"] >= cfg.rollout.prompts_per_step
        assert row["filter/skipped_update"] == 1.0 and "actor/pg_loss" not in row
        assert row["rollout/generated_samples"] > cfg.batch_size  # the refill ran
        assert (run_dir / "samples" / f"step_{row['step']}.jsonl").read_text() == ""
