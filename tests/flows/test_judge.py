"""The LLM judge and colocated scoring in ``separate_async``, end to end: real Prefect (test
harness), real local Ray, the tiny assets and a tiny judge built here (tests/judge_assets.py,
``build_marker_judge``). Its prompt (``AGREE_TEMPLATE``) ends with a marker token exactly when
the sample's response holds a character of its ground truth (``agrees``), and the judge answers
"yes" after the marker and "no" after anything else: each sample's verdict is known from that
sample's own response and ground truth, so a judge handed another sample's text answers
wrongly somewhere. The tests check every sample's ``judge`` part and verdict against it, and
that the runs see both verdicts.

A run that ends completed has kept the one-awake rule on every worker: a second model waking
beside another raises ``ColocationError`` and fails the step. ``timing_s/wake/<role>`` comes
from the training pool's workers, so it shows which models took turns there."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from judge_assets import agrees

from flows.samples import prompt_text, read_samples
from infra.config import TrainConfig, load_config
from infra.data import read_prompt_rows

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _run(overrides: list[str], *extra: str) -> tuple[TrainConfig, list[dict[str, Any]]]:
    from flows.train import ppo_train

    cfg = load_config(CONFIGS / "tiny.yaml", [*overrides, *extra])
    state = ppo_train(cfg, return_state=True)
    assert state.is_completed(), state.message
    rows = [
        json.loads(x) for x in (cfg.resolved_run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    return cfg, rows


def _verdict(response: str, ground_truth: object) -> str:
    """The marker judge's verdict on one sample (tests/judge_assets.py)."""
    return "yes" if agrees(response, ground_truth) else "no"


def _assert_judged(
    cfg: TrainConfig, rows: list[dict[str, Any]], steps: int, train_data: Path
) -> Counter[str]:
    """Every step saved all its samples, each with the judge part and verdict its own response
    and ground truth (looked up by prompt in ``train_data``) call for; ``reward/judge/mean`` is
    their mean. Returns the verdicts counted over the run, both of which occur."""
    assert [r["step"] for r in rows] == list(range(steps))
    truths = {prompt_text(p.raw_prompt): p.ground_truth for p in read_prompt_rows(train_data)}
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.n
    assert cfg.trainer.samples_per_step >= per_step  # every sample of a step is saved
    seen: Counter[str] = Counter()
    for r in rows:
        samples = read_samples(cfg.resolved_run_dir, r["step"])
        assert len(samples) == per_step
        for s in samples:
            verdict = _verdict(s["response"], truths[s["prompt"]])
            assert (s["judge_verdict"], s["judge"]) == (verdict, float(verdict == "yes")), s
            seen[verdict] += 1
        assert r["reward/judge/mean"] == sum(s["judge"] for s in samples) / len(samples)
        assert r["reward/judge/parse_failures"] == 0.0
        assert "reward/rm/mean" in r and "actor/pg_loss" in r
    assert seen["yes"] and seen["no"], seen
    return seen


def test_sync_combines_the_judge_a_reward_model_and_a_reward_function(
    prefect_harness, ray_local, assets, tiny_overrides, judge_overrides
) -> None:
    cfg, rows = _run(
        tiny_overrides,
        *judge_overrides,
        "reward.functions=[{name: exact_match, weight: 0.25}]",
        "trainer.total_steps=2",
    )
    _assert_judged(cfg, rows, 2, assets.train_data)
    for r in rows:
        assert "reward/fn/exact_match/mean" in r
        # The judge and the reward model took their turns on the training pool.
        assert r["timing_s/wake/judge"] >= 0 and r["timing_s/wake/reward"] >= 0


@pytest.mark.parametrize("pool", ["colocated", "own"])
def test_separate_async_scores_with_the_judge_and_the_reward_model(
    prefect_harness, ray_local, assets, tiny_overrides, judge_overrides, pool
) -> None:
    """``colocated``: the reward model and the judge take turns with the trainer on the
    training pool while the rollout generates on its own; ``own``: they keep a pool apart."""
    cfg, rows = _run(
        tiny_overrides,
        *judge_overrides,
        "resources.mode=separate_async",
        f"reward.pool={pool}",
        "trainer.total_steps=3",
    )
    _assert_judged(cfg, rows, 3, assets.train_data)
    assert max(r["rollout/staleness"] for r in rows) <= cfg.resources.max_staleness
    # The training pool's wake timings are collected once a step, whichever step's score woke
    # them (the producer runs ahead): some row has them when the judge shares that pool.
    for role in ("judge", "reward"):
        on_training_pool = any(f"timing_s/wake/{role}" in r for r in rows)
        assert on_training_pool == (pool == "colocated"), role


def test_the_producers_score_and_the_trainer_take_turns_on_one_training_pool(
    ray_local, assets, tiny_overrides, judge_overrides
) -> None:
    """``separate_async`` with ``reward.pool: colocated``, stage by stage on real Ray workers:
    the score task (judge and reward model on the training pool) runs in one thread while
    another keeps the same workers' actor awake in a loop; neither sees a second model awake,
    and each sample's verdict, the one its own response and ground truth call for, reaches the
    store as ``judge_verdicts`` and its ``judge`` part."""
    from flows.reward_model import resolve_models
    from flows.runtime import build_runtime
    from infra.workers import ModelWorker
    from tasks.context import StageContext
    from tasks.generate.stage import generate_partition, submit_prompts
    from tasks.io import rows as jagged_rows
    from tasks.score.stage import score

    cfg = load_config(
        CONFIGS / "tiny.yaml",
        [*tiny_overrides, *judge_overrides, "resources.mode=separate_async"],
    )
    models = resolve_models(cfg, {k: str(v) for k, v in vars(assets).items()})
    rt = build_runtime(cfg, models)
    try:
        assert rt.reward_group is rt.train_group and rt.rollout_group is not rt.train_group
        assert {"reward", "judge", "actor"} <= set(rt.train_group.roles)
        from transformers import AutoTokenizer

        ctx = StageContext(
            cfg=cfg, rt=rt, tokenizer=AutoTokenizer.from_pretrained(models.tokenizer)
        )
        rows = read_prompt_rows(Path(models.train_data or ""))[:4]
        meta = submit_prompts(ctx, partition_id="train/step-000000", rows=rows)
        meta = generate_partition(ctx, meta, seed=0)

        def trainer_turn(worker: Any) -> list[str]:
            with worker.awake("actor"):
                seen = worker.awake_roles()
                threading.Event().wait(0.05)
            return seen

        seen: list[list[str]] = []
        stop = threading.Event()

        def trainer() -> None:
            while not stop.is_set():
                seen.extend(rt.train_group.run(trainer_turn))

        thread = threading.Thread(target=trainer)
        thread.start()
        try:
            scored = score(ctx, meta, 0)
        finally:
            stop.set()
            thread.join(timeout=60)
        assert seen and all(s == ["actor"] for s in seen)
        fields = ("response_ids", "ground_truth", "judge_verdicts", "reward_parts")
        stored = rt.store.get_fields(scored.meta, fields, timeout=5)
        responses = ctx.tokenizer.batch_decode(
            [r.tolist() for r in jagged_rows(stored["response_ids"])], skip_special_tokens=True
        )
        verdicts = [_verdict(*x) for x in zip(responses, stored["ground_truth"], strict=True)]
        assert len(verdicts) == len(meta.keys) and {"yes", "no"} <= set(verdicts), verdicts
        assert stored["judge_verdicts"] == verdicts
        parts = stored["reward_parts"]
        assert [p["judge"] for p in parts] == [float(v == "yes") for v in verdicts]
        assert all("rm" in p for p in parts)
        assert scored.metrics["reward/judge/mean"] == verdicts.count("yes") / len(verdicts)
        assert rt.train_group.call(ModelWorker.awake_roles) == [[]] * rt.train_group.size
    finally:
        rt.shutdown()
