"""The training flow end to end: real Prefect (test harness), real local Ray, real tiny models."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from infra.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STAGES = ("generate", "score", "logprobs", "advantage", "update")


def _task_run_names(flow_run_id, expected: set[str], timeout: float = 60.0) -> set[str]:
    """Task-run names of the flow run once ``expected`` are all recorded (or the timeout ends):
    the server records task runs from events it processes after the flow has returned."""
    deadline = time.monotonic() + timeout
    while True:
        names = set(_read_task_run_names(flow_run_id))
        if expected <= names or time.monotonic() > deadline:
            return names
        time.sleep(0.2)


def _read_task_run_names(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read() -> list[str]:
        async with get_client() as client:
            # The stage tasks run inside the ppo-train flow run itself.
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200
            )
            return [r.name for r in runs]

    return asyncio.run(read())


def _run(overrides: list[str], *extra: str):
    from flows.train import ppo_train

    cfg = load_config(CONFIGS / "tiny.yaml", [*overrides, *extra])
    state = ppo_train(cfg, return_state=True)
    assert state.is_completed(), state.message
    return cfg, state.result(), state.state_details.flow_run_id


def test_tiny_sync_run_records_every_stage_of_every_step(
    prefect_harness, ray_local, tiny_overrides
) -> None:
    cfg, summary, flow_run_id = _run(tiny_overrides)
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "actor/pg_loss",
        "critic/score/mean",
        "response_length/mean",
        "perf/throughput",
        "timing_s/update",
        "actor/kl_to_ref",  # one on-policy step: logged by the update from its own forward pass
    ):
        assert all(key in r for r in rows), key
    assert "eval/rule_accuracy" in rows[0] and "eval/rule_accuracy" in rows[-1]
    # The weight-sync probe ran at every step's first wake of the engine: the transformers
    # engine holds exactly the trainer's float32 weights.
    assert [r["sync/probe_max_abs_diff"] for r in rows] == [0.0, 0.0, 0.0]
    assert all(r["sync/bytes"] > 0 for r in rows)
    assert summary["checkpoint"] and Path(summary["checkpoint"], "state.json").exists()
    assert Path(summary["plot"]).stat().st_size > 0
    names = _task_run_names(flow_run_id, {f"{s}[step={k}]" for s in STAGES for k in range(3)})
    for step in range(3):
        for stage in STAGES:
            assert f"{stage}[step={step}]" in names, (stage, step, sorted(names))


@pytest.mark.parametrize(
    "extra",
    [
        ("resources.mode=colocate_async", "resources.max_staleness=1"),
        ("algorithm.estimator=gae", "algorithm.kl.in_reward=true", "algorithm.kl.coef=0.01"),
        ("algorithm.estimator=rloo", "algorithm.kl.loss_coef=0.01"),
    ],
    ids=["colocate_async", "ppo_gae_kl", "rloo_kl_loss"],
)
def test_modes_and_estimators_complete(prefect_harness, ray_local, tiny_overrides, extra) -> None:
    cfg, summary, _ = _run(tiny_overrides, *extra, "trainer.total_steps=3")
    rows = [
        json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 3
    staleness = [r["rollout/staleness"] for r in rows]
    assert max(staleness) <= cfg.resources.max_staleness
    if cfg.resources.mode == "colocate_async":
        assert staleness == [0.0, 1.0, 0.0]  # steps 0 and 1 generated together, then step 2
    if cfg.algorithm.use_critic:
        assert all("critic/vf_loss" in r for r in rows)


def test_a_broken_weight_sync_fails_the_next_generate_with_weight_sync_error(
    prefect_harness, ray_local, tiny_overrides
) -> None:
    from flows.train import ppo_train
    from infra.engines.probe import WeightSyncError

    fault = "faults=[{stage: update, step: 1, action: corrupt_sync}]"
    cfg = load_config(CONFIGS / "tiny.yaml", [*tiny_overrides, fault])
    state = ppo_train(cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(WeightSyncError, match=r"policy version 2: .* differ from the trainer's"):
        state.result()
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]  # step 2 generated nothing


def test_resume_auto_continues_after_the_last_checkpoint(
    prefect_harness, ray_local, tiny_overrides
) -> None:
    _, first, _ = _run(tiny_overrides, "trainer.total_steps=4", "trainer.steps_per_run=2")
    assert (first["first_step"], first["last_step"]) == (0, 1)
    _, second, _ = _run(tiny_overrides, "trainer.total_steps=4", "trainer.steps_per_run=2")
    assert (second["first_step"], second["last_step"]) == (2, 3)
    rows = [
        json.loads(x) for x in (Path(second["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]


def test_one_on_policy_step_without_reference_skips_the_logprobs_task(
    prefect_harness, ray_local, tiny_overrides, tmp_path
) -> None:
    """GRPO, sync, one optimizer step, no reference: nothing for logprobs to compute, so the
    step runs four tasks; with old_logprobs=recompute the task is back."""
    _, summary, flow_run_id = _run(
        tiny_overrides, "algorithm.kl.monitor=false", "trainer.total_steps=2"
    )
    four = {"generate[step=1]", "score[step=1]", "advantage[step=1]", "update[step=1]"}
    names = _task_run_names(flow_run_id, four)
    assert four <= names
    assert not any(n.startswith("logprobs[") for n in names), sorted(names)
    _, _, flow_run_id = _run(
        tiny_overrides,
        "algorithm.kl.monitor=false",
        "algorithm.old_logprobs=recompute",
        "trainer.total_steps=1",
        f"run_dir={tmp_path / 'recompute'}",
    )
    assert "logprobs[step=0]" in _task_run_names(flow_run_id, {"logprobs[step=0]"})


def test_separate_async_producer_runs_generate_and_score_as_tasks_of_the_flow_run(
    prefect_harness, ray_local, tiny_overrides
) -> None:
    """separate_async completes within its staleness bound; the producer thread's generate and
    score tasks belong to the flow run (the UI shows them beside the trainer's tasks), their
    seconds reach the metrics, and with old_logprobs=rollout and no reference there is no
    logprobs task at all."""
    cfg, summary, flow_run_id = _run(
        tiny_overrides,
        "resources.mode=separate_async",
        "reward.pool=own",
        "algorithm.old_logprobs=rollout",
        "algorithm.kl.monitor=false",
        "trainer.total_steps=3",
    )
    rows = [
        json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("timing_s/generate", "timing_s/score", "timing_s/wait_rollout", "actor/pg_loss"):
        assert all(key in r for r in rows), key
    assert max(r["rollout/staleness"] for r in rows) <= cfg.resources.max_staleness
    expected = {
        f"{s}[step={k}]" for s in ("generate", "score", "advantage", "update") for k in (0, 1, 2)
    }
    names = _task_run_names(flow_run_id, expected)
    assert expected <= names, sorted(expected - names)
    assert not any(n.startswith("logprobs[") for n in names), sorted(names)


def test_separate_async_producer_failure_fails_the_run_at_once_naming_it(
    prefect_harness, ray_local, tiny_overrides, assets, tmp_path
) -> None:
    """A reward model that returns NaN fails the producer's score task; the training loop
    raises that failure instead of waiting out store.get_timeout_s."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from flows.train import ppo_train

    broken = AutoModelForSequenceClassification.from_pretrained(assets.reward_model)
    with torch.no_grad():
        for p in broken.score.parameters():
            p.fill_(float("nan"))
    broken.save_pretrained(tmp_path / "nan-rm")
    AutoTokenizer.from_pretrained(assets.reward_model).save_pretrained(tmp_path / "nan-rm")
    cfg = load_config(
        CONFIGS / "tiny.yaml",
        [
            *tiny_overrides,
            "resources.mode=separate_async",
            "reward.pool=own",
            f"models.reward_model={tmp_path / 'nan-rm'}",
            "orchestration.retries=0",
            "store.get_timeout_s=600",
        ],
    )
    state = ppo_train(cfg, return_state=True)
    assert state.is_failed()
    assert "producer failed" in state.message and "non-finite" in state.message, state.message
