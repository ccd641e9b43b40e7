"""A stalled producer surfaces as StoreTimeout, a Prefect retry, then a failed task naming what stalled."""

from __future__ import annotations

import asyncio

import torch

from infra.config import load_config
from storage import BatchMeta, open_store


def test_a_stage_waiting_for_a_stalled_producer_retries_then_fails_naming_it(
    prefect_harness,
) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client

    from tasks.context import StageContext
    from tasks.score.stage import score

    cfg = load_config(None, ["store.get_timeout_s=0.3"])
    store = open_store("memory://")
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
    ctx = StageContext(cfg=cfg, store=store, tokenizer=None, train_group=None)
    meta = BatchMeta(partition_id=partition, keys=tuple(keys), fields=("prompt_ids",))

    @flow(name="stall-probe")
    def probe() -> dict:
        # Wrapped in a dict so the probe flow itself completes and hands back the task's state.
        return {
            "task": score.with_options(retries=1, retry_delay_seconds=0)(
                ctx, meta, 7, return_state=True
            )
        }

    state = probe()["task"]
    assert state.is_failed()
    assert "StoreTimeout" in state.message or "response_ids" in state.message, state.message
    assert "response_ids" in state.message and partition in state.message

    async def run_count() -> int:
        async with get_client() as client:
            return (await client.read_task_run(state.state_details.task_run_id)).run_count

    assert asyncio.run(run_count()) == 2  # the first try and one retry
    # Nothing stored before the stall was lost, and nothing was half-written.
    listing = store.kv_list(partition)
    assert set(listing) == set(keys)
    assert all(
        set(fields) == {"prompt_ids", "raw_prompt", "ground_truth"} for fields in listing.values()
    )
