"""Single-turn runs never touch the agent path: every preset plans no ``loss_mask``, the
generate stage makes one ``generate`` call and writes only ``WRITES``, and where the multi-turn
path would read a ``loss_mask`` that is True everywhere (no tool tokens) the advantage stage and
the update give bit-for-bit what the single-turn path gives."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_optimize_on_cpu import (  # helpers of the fixed-row update tests
    VOCAB,
    actor_settings,
    one_torch_thread,  # noqa: F401  (autouse fixture: one torch thread in this module too)
    tiny_policy,
)
from test_update_stage_on_cpu import StandInWorker

from infra.config import load_config
from infra.engines.base import GenerationOutput
from storage import BatchMeta, open_store
from tasks.advantage.stage import compute
from tasks.generate import stage as generate_stage
from tasks.io import nested
from tasks.plan import AGENT_READS, StepPlan
from tasks.step import run_steps, shard_of
from tasks.update.stage import update_steps

PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "agent"])
@pytest.mark.parametrize("estimator", [None, "gae"])
def test_no_single_turn_preset_plans_the_agent_path(preset: str, estimator: str | None) -> None:
    configs = Path(__file__).resolve().parents[2] / "configs"
    extra = [f"algorithm.estimator={estimator}"] if estimator else []
    cfg = load_config(configs / f"{preset}.yaml", extra)
    plan = StepPlan.from_config(cfg)
    assert not cfg.rollout.multi_turn and not plan.multi_turn
    assert "loss_mask" not in plan.update_reads
    assert not set(AGENT_READS) & set(plan.advantage_reads)


class _Engine:
    """One ``generate`` call's worth of fixed responses; counts its calls."""

    calls = 0

    def generate(self, prompt_ids, *, n, max_new_tokens, **_: Any) -> GenerationOutput:
        self.calls += 1
        ids = [torch.arange(1, 4) for _ in prompt_ids for _ in range(n)]
        return GenerationOutput(ids, [torch.full((3,), -0.5) for _ in ids])


class _GenerateWorker:
    """What ``generate_rows`` uses of a ``ModelWorker``: its config, version and store, and the
    rollout engine."""

    def __init__(self) -> None:
        self.cfg, self.version, self.engine = load_config(None, []), 0, _Engine()
        self.store = open_store("memory://")

    @contextlib.contextmanager
    def awake(self, role: str) -> Iterator[_Engine]:
        assert role == "rollout"
        yield self.engine


def test_single_turn_generate_makes_one_call_and_writes_no_agent_field(monkeypatch) -> None:
    def agent_loop(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a single-turn rollout ran the agent loop")

    monkeypatch.setattr(generate_stage, "run_agent_loop", agent_loop)
    worker = _GenerateWorker()
    prompts = BatchMeta("train/step-000000", ("a/0", "b/0"), ())
    samples = generate_stage.sample_meta(prompts, 2)
    worker.store.kv_batch_put(
        list(samples.keys), samples.partition_id, {"prompt_ids": [torch.arange(5)] * 4}
    )
    generate_stage.generate_rows(worker, prompts, n=2, seed=3, first_group=5)  # type: ignore[arg-type]
    assert worker.engine.calls == 1
    stored = worker.store.kv_list(samples.partition_id)
    assert {k: set(v) for k, v in stored.items()} == {
        k: {"prompt_ids", *generate_stage.WRITES} for k in samples.keys
    }
    got = worker.store.get_fields(samples, ["group_ids", "rollout_version"], timeout=0)
    assert got["group_ids"].tolist() == [5, 5, 6, 6] and got["rollout_version"].tolist() == [0] * 4


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_an_all_true_loss_mask_changes_no_advantage(estimator: str) -> None:
    single = load_config(None, [f"algorithm.estimator={estimator}"])
    multi = load_config(None, [f"algorithm.estimator={estimator}", "rollout.max_turns=2"])
    lengths = [3, 1, 4, 2]
    generator = torch.Generator().manual_seed(0)
    data: dict[str, Any] = {
        "response_ids": nested([torch.ones(n, dtype=torch.int64) for n in lengths]),
        "scores": torch.tensor([1.0, 0.0, 0.5, 0.2]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
    }
    if estimator == "gae":
        data["values"] = nested([torch.randn(n, generator=generator) for n in lengths])
    agent = {
        "loss_mask": nested([torch.ones(n, dtype=torch.bool) for n in lengths]),
        **{k: torch.ones(4, dtype=torch.int64) for k in AGENT_READS if k != "loss_mask"},
    }
    one = compute(single, shard_of(data, 4), plan=StepPlan.from_config(single), kl_coef=0.0)
    two = compute(
        multi, shard_of({**data, **agent}, 4), plan=StepPlan.from_config(multi), kl_coef=0.0
    )
    assert set(one.tensors) == set(two.tensors)
    for name, tensor in one.tensors.items():
        assert torch.equal(tensor, two.tensors[name]), name


def test_an_all_true_loss_mask_changes_no_weight() -> None:
    """The update with a ``loss_mask`` True on every token takes exactly the single-turn step:
    the masks it trains on are ``response_mask``."""
    generator = torch.Generator().manual_seed(5)
    keys = [f"p{i}/0" for i in range(4)]
    response_ids = [torch.randint(2, VOCAB, (int(n),), generator=generator) for n in (3, 4, 2, 5)]
    store = open_store("memory://")
    store.kv_batch_put(
        keys,
        "train/step-000001",
        {
            "prompt_ids": [torch.randint(2, VOCAB, (3,), generator=generator) for _ in keys],
            "response_ids": response_ids,
            "advantages": [torch.randn(r.numel(), generator=generator) for r in response_ids],
            "rollout_logprobs": [-torch.rand(r.numel(), generator=generator) for r in response_ids],
            "loss_mask": [torch.ones(r.numel(), dtype=torch.bool) for r in response_ids],
        },
    )
    reference = tiny_policy(seed=5)
    settings = actor_settings(
        "token-mean", micro=4, ppo_epochs=1, kl_loss_coef=0.0, old_is_rollout=True
    )
    reads = ("prompt_ids", "response_ids", "advantages", "rollout_logprobs")

    def update(extra: tuple[str, ...]) -> torch.nn.Module:
        worker = StandInWorker(store, copy.deepcopy(reference))
        shard = BatchMeta("train/step-000001", tuple(keys), ())
        run_steps(worker, shard, update_steps((*reads, *extra), settings, None))  # type: ignore[arg-type]
        return worker.actor.module

    single, multi = update(()), update(("loss_mask",))
    assert not torch.equal(next(single.parameters()), next(reference.parameters()))
    for (name, a), b in zip(single.named_parameters(), multi.parameters(), strict=True):
        assert torch.equal(a, b), name
