"""The worker that holds every role of one device: turns, weight sync, and data parallelism."""

from __future__ import annotations

import pytest
import torch

from infra.colocate import ColocationError
from infra.config import OptimConfig, RolloutConfig
from infra.transport import Jagged
from infra.workers import PPOWorker, WorkerSpec


def _spec(assets, roles, **kw) -> WorkerSpec:
    return WorkerSpec(
        roles=roles,
        policy_path=str(assets.policy),
        tokenizer_path=str(assets.tokenizer),
        reward_model_path=str(assets.reward_model),
        critic_path=str(assets.critic),
        rollout=RolloutConfig(max_new_tokens=5, n=4),
        actor_optim=OptimConfig(lr=1e-3, mini_batch_size=8, micro_batch_size=4),
        critic_optim=OptimConfig(lr=1e-3, mini_batch_size=8, micro_batch_size=4),
        **kw,
    )


def _prompts(worker: PPOWorker, count: int) -> Jagged:
    tok = worker.tokenizer
    msgs = [[{"role": "user", "content": f"{10 + i}+{20 + i}="}] for i in range(count)]
    ids = [
        torch.tensor(
            tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        for m in msgs
    ]
    return Jagged.from_rows(ids)


@pytest.fixture(scope="module")
def worker(assets) -> PPOWorker:
    return PPOWorker(_spec(assets, ("rollout", "reward", "actor", "ref", "critic")))


def test_a_whole_iteration_takes_turns_and_leaves_everything_asleep(worker: PPOWorker) -> None:
    prompts = _prompts(worker, 2)
    responses, logprobs, version = worker.generate(prompts, n=4, seed=1)
    assert len(responses) == 8 and version == 0
    assert worker.awake_roles() == []
    rep = lambda j: Jagged.from_rows([r for r in j.rows() for _ in range(4)])  # noqa: E731 - prompt per sample
    scores, truncated = worker.score(
        rep(prompts), responses, [[{"role": "user", "content": "x"}]] * 8
    )
    assert scores.shape == (8,) and not truncated.any()
    out = worker.forward(rep(prompts), responses)
    assert set(out) == {"old_logprobs", "ref_logprobs", "values"}
    # Before any update the actor's recomputed log-probs equal the rollout's (same weights, same temperature).
    for a, b in zip(out["old_logprobs"].rows(), logprobs.rows(), strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=1e-4)
    assert worker.awake_roles() == []


def test_update_changes_the_actor_and_syncs_the_rollout_engine(worker: PPOWorker) -> None:
    prompts = _prompts(worker, 2)
    responses, logprobs, _ = worker.generate(prompts, n=4, seed=2)
    rep = Jagged.from_rows([r for r in prompts.rows() for _ in range(4)])
    fwd = worker.forward(rep, responses)
    adv = Jagged.from_rows(
        [torch.full((len(r),), 1.0 if i % 2 else -1.0) for i, r in enumerate(responses.rows())]
    )
    before = worker.parameters_digest()
    metrics = worker.update(
        rep,
        responses,
        {
            "old_logprobs": fwd["old_logprobs"],
            "advantages": adv,
            "values": fwd["values"],
            "returns": adv,
        },
    )
    after = worker.parameters_digest()
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert "actor/pg_loss" in metrics and "critic/vf_loss" in metrics
    assert sum(before[k] != after[k] for k in before) >= len(before) - 2
    assert worker.version == 1
    engine_state = worker.engine.model.state_dict() if hasattr(worker.engine, "model") else None
    if engine_state is not None:
        for k, v in worker.actor.module.state_dict().items():
            assert torch.equal(engine_state[k].cpu(), v.cpu()), k
    assert worker.awake_roles() == []


def test_an_exception_inside_a_stage_leaves_the_reward_model_asleep(worker: PPOWorker) -> None:
    bad = Jagged.from_rows([torch.tensor([10**6])])  # token id out of the vocabulary
    with pytest.raises(Exception):  # noqa: B017 - whatever the model raises
        worker.score(bad, bad, [[{"role": "user", "content": "x"}]])
    assert worker.awake_roles() == []


def test_two_roles_are_never_awake_together(worker: PPOWorker) -> None:
    with (
        worker.group.awake("rollout"),
        pytest.raises(ColocationError, match="rollout"),
        worker.group.awake("reward"),
    ):
        pass
    assert worker.awake_roles() == []


def test_data_parallel_update_equals_one_worker(ray_local, assets) -> None:
    """Two gloo workers on half the batch each make the same update as one worker on all of it."""
    from infra.cluster import create_pool
    from infra.group import WorkerGroup, split, take

    torch.manual_seed(0)
    gen = PPOWorker(_spec(assets, ("rollout",)))
    prompts = _prompts(gen, 4)
    responses, logprobs, _ = gen.generate(prompts, n=2, seed=3)
    rep = Jagged.from_rows([r for r in prompts.rows() for _ in range(2)])
    adv = Jagged.from_rows([torch.randn(len(r)) for r in responses.rows()])
    fields = {"old_logprobs": logprobs, "advantages": adv}
    from tasks.update.stage import SHARED_LOSSES, combine_worker_metrics

    digests, metrics = [], []
    for size in (1, 2):
        pool = create_pool(f"dp{size}", size, accelerator="gpu_slot")
        group = WorkerGroup(pool, _spec(assets, ("actor",)), call_timeout_s=120)
        try:
            shards = [
                (
                    (
                        take(rep, sl),
                        take(responses, sl),
                        {k: take(v, sl) for k, v in fields.items()},
                    ),
                    {},
                )
                for sl in split(len(rep), size)
            ]
            metrics.append(combine_worker_metrics(group.call_sharded(PPOWorker.update, shards)))
            digests.append(group.call(PPOWorker.parameters_digest))
        finally:
            group.shutdown()
            pool.release()
    one, (two_a, two_b) = digests[0][0], digests[1]
    assert two_a == two_b  # the two replicas stay identical
    for key in one:
        assert one[key] == pytest.approx(two_a[key], rel=1e-5, abs=1e-5), key
    # The logged losses of two workers (sums of their shares) are those of one worker.
    for key in SHARED_LOSSES:
        if key in metrics[0]:
            assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5, abs=1e-7), key
    assert metrics[0]["actor/pg_loss"] != 0.0
