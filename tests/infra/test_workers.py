"""The worker that holds every role of one device, running the stages' worker-side steps: each
reads its rows from the store and writes its results back; turns, weight sync, data parallelism."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from infra.colocate import ColocationError
from infra.config import load_config
from infra.workers import ModelWorker, WorkerSpec
from storage import BatchMeta, open_store
from tasks.generate.stage import generate_rows, sample_meta
from tasks.io import nested, rows
from tasks.logprobs.stage import forward_rows
from tasks.score.stage import NonFiniteScoreError, score_rows
from tasks.update.stage import actor_settings, critic_settings, update_rows

OVERRIDES = [
    "rollout.max_new_tokens=5",
    "rollout.n=4",
    "actor.lr=1e-3",
    "actor.mini_batch_size=8",
    "actor.micro_batch_size=4",
    "critic.lr=1e-3",
    "critic.mini_batch_size=8",
    "critic.micro_batch_size=4",
]


def _spec(assets, roles, store_url: str) -> WorkerSpec:
    return WorkerSpec(
        roles=roles,
        cfg=load_config(None, OVERRIDES),
        policy_path=str(assets.policy),
        tokenizer_path=str(assets.tokenizer),
        reward_model_path=str(assets.reward_model),
        critic_path=str(assets.critic),
        store_url=store_url,
    )


def _submit(store, tokenizer, partition: str, count: int, n: int) -> tuple[BatchMeta, BatchMeta]:
    """Put ``count`` prompts for ``n`` samples each; returns (prompt keys, sample keys)."""
    msgs = [[{"role": "user", "content": f"{10 + i}+{20 + i}="}] for i in range(count)]
    ids = [
        torch.tensor(
            tokenizer.apply_chat_template(
                m, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for m in msgs
    ]
    prompts = BatchMeta(partition, tuple(f"p{i}/0" for i in range(count)))
    samples = sample_meta(prompts, n)
    store.kv_batch_put(
        list(samples.keys),
        partition,
        {
            "prompt_ids": nested([p for p in ids for _ in range(n)]),
            "raw_prompt": [m for m in msgs for _ in range(n)],
        },
    )
    return prompts, samples


@pytest.fixture(scope="module")
def store():
    handle = open_store("memory://test-workers")
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def worker(assets, store) -> ModelWorker:
    roles = ("rollout", "reward", "actor", "ref", "critic")
    return ModelWorker(_spec(assets, roles, "memory://test-workers"))


def test_a_whole_iteration_takes_turns_through_the_store_and_leaves_everything_asleep(
    worker: ModelWorker, store
) -> None:
    prompts, samples = _submit(store, worker.tokenizer, "iter/1", 2, 4)
    assert worker.run(generate_rows, prompts, n=4, seed=1, first_group=0) == 0
    assert worker.awake_roles() == []
    got = store.kv_batch_get(list(samples.keys), "iter/1", ["group_ids", "rollout_version"])
    assert got["group_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    reply = worker.run(score_rows, samples, rule=None, texts=True)
    assert len(reply.rm) == 8 and reply.truncated == 0 and len(reply.texts) == 8
    rm = store.kv_batch_get(list(samples.keys), "iter/1", ["rm_scores", "response_ids"])
    assert rm["rm_scores"].offsets().tolist() == rm["response_ids"].offsets().tolist()
    worker.run(forward_rows, samples, names=("old_logprobs", "ref_logprobs", "values"))
    out = store.kv_batch_get(list(samples.keys), "iter/1", ["old_logprobs", "rollout_logprobs"])
    # Before any update the actor's recomputed log-probs equal the rollout's (same weights, same temperature).
    for a, b in zip(rows(out["old_logprobs"]), rows(out["rollout_logprobs"]), strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=1e-4)
    assert worker.awake_roles() == []


def test_update_changes_the_actor_and_syncs_the_rollout_engine(worker: ModelWorker, store) -> None:
    prompts, samples = _submit(store, worker.tokenizer, "iter/2", 2, 4)
    worker.run(generate_rows, prompts, n=4, seed=2, first_group=0)
    worker.run(forward_rows, samples, names=("old_logprobs", "values"))
    lengths = store.kv_batch_get(list(samples.keys), "iter/2", ["response_ids"])["response_ids"]
    adv = nested(
        [torch.full((len(r),), 1.0 if i % 2 else -1.0) for i, r in enumerate(rows(lengths))]
    )
    store.kv_batch_put(list(samples.keys), "iter/2", {"advantages": adv, "returns": adv})
    before = worker.parameters_digest()
    metrics = worker.run(
        update_rows,
        samples,
        step=0,
        reads=("prompt_ids", "response_ids", "old_logprobs", "advantages", "values", "returns"),
        actor=actor_settings(worker.cfg, 1),
        critic=critic_settings(worker.cfg, 1),
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


def test_an_exception_inside_a_step_leaves_the_reward_model_asleep(
    worker: ModelWorker, store
) -> None:
    bad = BatchMeta("iter/3", ("x/0",))
    token = [torch.tensor([10**6])]  # a token id out of the vocabulary
    store.kv_batch_put(
        ["x/0"], "iter/3", {"prompt_ids": token, "response_ids": token, "raw_prompt": ["x"]}
    )
    with pytest.raises(Exception):  # noqa: B017 - whatever the model raises
        worker.run(score_rows, bad, rule=None, texts=False)
    assert worker.awake_roles() == []
    assert "rm_scores" not in store.kv_list("iter/3")["x/0"]


def test_a_non_finite_reward_model_score_names_the_keys_and_writes_nothing(
    worker: ModelWorker, store, monkeypatch
) -> None:
    prompts, samples = _submit(store, worker.tokenizer, "iter/4", 1, 2)
    worker.run(generate_rows, prompts, n=2, seed=4, first_group=0)
    real = worker.scorer.score

    def poisoned(**kw):
        out = real(**kw)
        out.member_scores[1, 0] = float("nan")
        return out

    monkeypatch.setattr(worker.scorer, "score", poisoned)
    with pytest.raises(NonFiniteScoreError, match=r"p0/1.*nothing was written"):
        worker.run(score_rows, samples, rule=None, texts=False)
    assert all("rm_scores" not in f for f in store.kv_list("iter/4").values())
    assert worker.awake_roles() == []


def test_two_roles_are_never_awake_together(worker: ModelWorker) -> None:
    with (
        worker.awake("rollout"),
        pytest.raises(ColocationError, match="rollout"),
        worker.awake("reward"),
    ):
        pass
    assert worker.awake_roles() == []


@pytest.mark.parametrize("reference", ["policy", "another folder"])
def test_a_lora_actor_is_the_reference_unless_another_folder_is_given(
    assets, tmp_path, reference: str
) -> None:
    """A flow always names the reference folder (``models.reference`` resolves to the policy's):
    with LoRA the policy's own folder means the actor with its adapter disabled and no second
    model; another folder is loaded as a reference model of its own."""
    import shutil

    folder = assets.policy
    if reference != "policy":
        folder = tmp_path / "reference"
        shutil.copytree(assets.policy, folder)
    spec = WorkerSpec(
        roles=("actor", "ref"),
        cfg=load_config(None, [*OVERRIDES, "actor.lora={rank: 4, alpha: 8}"]),
        policy_path=str(assets.policy),
        tokenizer_path=str(assets.tokenizer),
        reference_path=str(folder),
        store_url="memory://",
    )
    worker = ModelWorker(spec)
    alone = reference == "policy"
    assert worker.reference_is_actor is alone
    assert hasattr(worker, "ref") is not alone
    with worker.reference() as ref:
        assert (ref is worker.actor.module) is alone
    assert worker.awake_roles() == []


def test_data_parallel_update_equals_one_worker(ray_local, assets) -> None:
    """Two gloo workers, each reading half the batch from a Ray store, make the same update as
    one worker on all of it."""
    from infra.cluster import create_pool
    from infra.group import WorkerGroup
    from tasks.update.stage import SHARED_LOSSES, combine_worker_metrics

    torch.manual_seed(0)
    store = open_store("ray://test-dp?shards=1")
    try:
        gen = ModelWorker(_spec(assets, ("rollout",), store.url))
        prompts, samples = _submit(store, gen.tokenizer, "dp/1", 4, 2)
        gen.run(generate_rows, prompts, n=2, seed=3, first_group=0)
        responses = store.kv_batch_get(list(samples.keys), "dp/1", ["response_ids"])["response_ids"]
        adv = nested([torch.randn(len(r)) for r in rows(responses)])
        store.kv_batch_put(list(samples.keys), "dp/1", {"advantages": adv})
        digests, metrics = [], []
        for size in (1, 2):
            pool = create_pool(f"dp{size}", size, accelerator="gpu_slot")
            group = WorkerGroup(pool, _spec(assets, ("actor",), store.url), call_timeout_s=120)
            try:
                kwargs = {
                    "reads": ("prompt_ids", "response_ids", "rollout_logprobs", "advantages"),
                    # π_old: the rollout's log-probs
                    "actor": replace(actor_settings(gen.cfg, size), old_is_rollout=True),
                    "critic": None,
                }
                metrics.append(
                    combine_worker_metrics(
                        group.run_sharded(update_rows, samples, step=0, **kwargs)
                    )
                )
                digests.append(group.call(ModelWorker.parameters_digest))
            finally:
                group.shutdown()
                pool.release()
    finally:
        store.close()
    one, (two_a, two_b) = digests[0][0], digests[1]
    assert two_a == two_b  # the two replicas stay identical
    for key in one:
        assert one[key] == pytest.approx(two_a[key], rel=1e-5, abs=1e-5), key
    # The logged losses of two workers (sums of their shares) are those of one worker.
    for key in SHARED_LOSSES:
        if key in metrics[0]:
            assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5, abs=1e-7), key
    assert metrics[0]["actor/pg_loss"] != 0.0
