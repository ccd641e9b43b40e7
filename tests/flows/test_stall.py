"""A stalled producer surfaces as StoreTimeout in the worker that waits for its rows, a Prefect
retry, then a failed task naming what stalled."""

from __future__ import annotations

import asyncio

import torch

from infra.config import load_config
from storage import BatchMeta, open_store


def test_a_stage_waiting_for_a_stalled_producer_retries_then_fails_naming_it(
    prefect_harness, ray_local, assets
) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client

    from flows.stages import score
    from infra.cluster import create_pool
    from infra.group import WorkerGroup
    from infra.runtime import Runtime
    from infra.workers import WorkerSpec
    from tasks.context import StageContext

    cfg = load_config(None, ["store.get_timeout_s=0.3"])
    store = open_store("ray://test-stall?shards=1")
    pool = create_pool("stall", 1, accelerator="gpu_slot")
    spec = WorkerSpec(
        roles=("rollout",),
        cfg=cfg,
        policy_path=str(assets.policy),
        tokenizer_path=str(assets.tokenizer),
        store_url=store.url,
    )
    group = WorkerGroup(pool, spec, call_timeout_s=60)
    partition = "train/step-000007"
    keys = ["u1/0", "u1/1"]
    # The prompts are there; the generate stage (the producer) never writes response_ids.
    store.kv_batch_put(
        keys,
        partition,
        {
            "prompt_ids": [torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3])],
            "raw_prompt": [[{"role": "user", "content": "1+2="}]] * 2,
            "ground_truth": ["3", "3"],
        },
    )
    rt = Runtime(store=store, train_group=group, rollout_group=group)
    ctx = StageContext(cfg=cfg, rt=rt, tokenizer=None)
    meta = BatchMeta(partition_id=partition, keys=tuple(keys), fields=("prompt_ids",))

    @flow(name="stall-probe")
    def probe() -> dict:
        # Wrapped in a dict so the probe flow itself completes and hands back the task's state.
        return {
            "task": score.with_options(retries=1, retry_delay_seconds=0)(
                ctx, meta, 7, return_state=True
            )
        }

    try:
        state = probe()["task"]
        listing = store.kv_list(partition)
    finally:
        group.shutdown()
        pool.release()
        store.close()
    assert state.is_failed()
    assert "StoreTimeout" in state.message or "response_ids" in state.message, state.message
    assert "response_ids" in state.message and partition in state.message

    async def run_count() -> int:
        async with get_client() as client:
            return (await client.read_task_run(state.state_details.task_run_id)).run_count

    assert asyncio.run(run_count()) == 2  # the first try and one retry
    # Nothing stored before the stall was lost, and nothing was half-written.
    assert set(listing) == set(keys)
    assert all(
        set(fields) == {"prompt_ids", "raw_prompt", "ground_truth"} for fields in listing.values()
    )
