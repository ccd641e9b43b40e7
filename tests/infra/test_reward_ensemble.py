"""Reward-model ensembles: the combination math by hand, the config forms, a two-member ensemble
scored by the scorer and by the score stage on a real in-process worker, and the warm start's
members (own seeds, same held-out pairs)."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from infra.assets import AssetPaths
from infra.config import ConfigError, TrainConfig, WarmstartConfig, load_config
from infra.pretrain import RewardModelSettings, member_seed, train_reward_model
from infra.reward_model import RewardScorer, reward_model_paths
from infra.workers import ModelWorker, WorkerSpec
from storage import BatchMeta, open_store
from tasks.io import nested, rows
from tasks.score.core import ensemble_scores
from tasks.score.stage import score_rows

# --------------------------------------------------------------------------- the math


def test_ensemble_score_is_mean_minus_penalty_times_population_std() -> None:
    members = torch.tensor([[1.0, 3.0], [2.0, 2.0], [-1.0, 0.0]])  # (3, 2)
    out = ensemble_scores(members, uncertainty_penalty=0.5)
    # Row 0: mean (1+3)/2 = 2; deviations ±1, population std sqrt((1+1)/2) = 1; 2 - 0.5*1 = 1.5.
    # Row 1: both 2: mean 2, std 0, score 2.
    # Row 2: -1 and 0: mean -0.5, std 0.5, score -0.5 - 0.25 = -0.75.
    assert out.mean.tolist() == [2.0, 2.0, -0.5]
    assert out.std.tolist() == [1.0, 0.0, 0.5]
    assert out.score.tolist() == [1.5, 2.0, -0.75]


def test_three_members_and_no_penalty_give_the_mean() -> None:
    members = torch.tensor([[0.0, 3.0, 6.0]])  # (1, 3)
    out = ensemble_scores(members, uncertainty_penalty=0.0)
    # Mean 3; deviations -3, 0, 3; population std sqrt(18/3) = sqrt(6).
    assert out.score.tolist() == [3.0]
    assert out.std.item() == pytest.approx(math.sqrt(6.0))
    penalised = ensemble_scores(members, uncertainty_penalty=2.0)
    assert penalised.score.item() == pytest.approx(3.0 - 2.0 * math.sqrt(6.0))


def test_one_member_scores_exactly_its_own_score_whatever_the_penalty() -> None:
    single = torch.tensor([[0.1234567], [-7.5]])  # (2, 1)
    out = ensemble_scores(single, uncertainty_penalty=3.0)
    assert torch.equal(out.score, single[:, 0]) and torch.equal(out.std, torch.zeros(2))


def test_a_non_finite_member_makes_the_score_non_finite() -> None:
    members = torch.tensor([[1.0, float("nan")], [1.0, float("inf")]])
    out = ensemble_scores(members, uncertainty_penalty=0.0)
    assert not torch.isfinite(out.score).any()


def test_bad_shapes_and_penalties_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\(B, M\)"):
        ensemble_scores(torch.zeros(3), uncertainty_penalty=0.0)
    with pytest.raises(ValueError, match="uncertainty_penalty"):
        ensemble_scores(torch.zeros(3, 2), uncertainty_penalty=-1.0)


# --------------------------------------------------------------------------- config forms


def test_config_takes_one_folder_or_a_list() -> None:
    base = ["models.policy=/p"]
    one = load_config(None, [*base, "models.reward_model=/rm"])
    assert one.models.reward_model == Path("/rm") and one.models.reward_models == (Path("/rm"),)
    two = load_config(None, [*base, "models.reward_model=[/a, /b]"])
    assert two.models.reward_models == (Path("/a"), Path("/b"))
    assert two.uses_reward_model
    assert TrainConfig().models.reward_models == ()
    with pytest.raises(ConfigError, match=r"models\.reward_model=\[\]"):
        load_config(None, [*base, "models.reward_model=[]"])
    with pytest.raises(ConfigError, match="rm_ensemble"):
        load_config(None, ["warmstart.rm_ensemble=0"])
    with pytest.raises(ConfigError, match="uncertainty_penalty"):
        load_config(None, ["reward.uncertainty_penalty=-0.1"])
    with pytest.raises(ConfigError, match="rm_workers"):
        load_config(None, ["warmstart.rm_workers=0"])


def test_members_train_side_by_side_as_the_cpus_allow() -> None:
    from flows.reward_model import rm_workers

    cpus = len(os.sched_getaffinity(0))
    three = ["warmstart.rm_ensemble=3"]
    assert rm_workers(load_config(None, three)) == min(3, cpus)
    assert rm_workers(load_config(None, [*three, "resources.threads_per_worker=64"])) == 1
    assert rm_workers(load_config(None, [*three, "warmstart.rm_workers=1"])) == 1
    assert rm_workers(load_config(None, [*three, "warmstart.rm_workers=8"])) == 3
    assert rm_workers(load_config(None, [])) == 1  # one model: trained in the flow's process


def test_reward_model_paths_normalises_every_form() -> None:
    assert reward_model_paths(None) == ()
    assert reward_model_paths("/a") == ("/a",)
    assert reward_model_paths(Path("/a")) == ("/a",)
    assert reward_model_paths(["/a", Path("/b")]) == ("/a", "/b")


# --------------------------------------------------------------------------- scoring


@pytest.fixture(scope="module")
def second_rm(tiny_assets: AssetPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny reward model with seeded noise on every weight: a member that disagrees."""
    out = tmp_path_factory.mktemp("rm-second")
    model = AutoModelForSequenceClassification.from_pretrained(tiny_assets.reward_model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_assets.reward_model).save_pretrained(out)
    return out


def _batch(tokenizer, count: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    msgs = [[{"role": "user", "content": f"{11 + i}+{23 + 2 * i}="}] for i in range(count)]
    prompts = [
        torch.tensor(
            tokenizer.apply_chat_template(
                m, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for m in msgs
    ]
    responses = [torch.tensor(tokenizer(str(34 + 3 * i))["input_ids"]) for i in range(count)]
    return prompts, responses, msgs


def test_each_member_scores_as_it_would_alone_in_order(
    tiny_assets: AssetPaths, second_rm: Path
) -> None:
    members = [tiny_assets.reward_model, second_rm, tiny_assets.reward_model_alt]
    ensemble = RewardScorer(members, policy_tokenizer_path=tiny_assets.tokenizer, batch_size=2)
    prompts, responses, msgs = _batch(ensemble.policy_tokenizer, 5)
    out = ensemble.score(prompt_ids=prompts, response_ids=responses, raw_prompt=msgs)
    assert out.member_scores.shape == (5, 3)
    for column, path in enumerate(members):
        alone = RewardScorer(path, policy_tokenizer_path=tiny_assets.tokenizer)
        expected = alone.score(prompt_ids=prompts, response_ids=responses, raw_prompt=msgs)
        torch.testing.assert_close(out.member_scores[:, column], expected.scores)
    torch.testing.assert_close(out.scores, out.member_scores.mean(dim=1))
    # The members disagree (the second's weights were perturbed), so the std is not zero.
    assert ensemble_scores(out.member_scores, uncertainty_penalty=1.0).std.min() > 0


def test_members_wake_and_sleep_together(tiny_assets: AssetPaths, second_rm: Path) -> None:
    ensemble = RewardScorer(
        [tiny_assets.reward_model, second_rm], policy_tokenizer_path=tiny_assets.tokenizer
    )
    ensemble.sleep()
    assert not ensemble.is_awake and all(not m.residency.is_awake for m in ensemble.members)
    ensemble.wake_up()
    assert all(m.residency.is_awake for m in ensemble.members)
    sizes = ensemble.parameter_bytes()
    assert len(sizes) == 2 and sizes[0] == sizes[1] > 0


OVERRIDES = ["rollout.max_new_tokens=5", "rollout.n=2", "reward.uncertainty_penalty=0.5"]


def test_score_rows_on_a_worker_writes_the_penalised_ensemble_score(
    tiny_assets: AssetPaths, second_rm: Path
) -> None:
    url = "memory://test-reward-ensemble"
    store = open_store(url)
    try:
        spec = WorkerSpec(
            roles=("rollout", "reward"),
            cfg=load_config(None, OVERRIDES),
            policy_path=str(tiny_assets.policy),
            tokenizer_path=str(tiny_assets.tokenizer),
            reward_model_path=(str(tiny_assets.reward_model), str(second_rm)),
            store_url=url,
        )
        worker = ModelWorker(spec)
        prompts, responses, msgs = _batch(worker.tokenizer, 3)
        meta = BatchMeta("ens/0", tuple(f"k{i}" for i in range(3)))
        store.kv_batch_put(
            list(meta.keys),
            meta.partition_id,
            {
                "prompt_ids": nested(prompts),
                "response_ids": nested(responses),
                "raw_prompt": msgs,
            },
        )
        out = worker.run(score_rows, meta, rule=None, texts=False)
        assert worker.awake_roles() == []
        singles = [
            RewardScorer(path, policy_tokenizer_path=tiny_assets.tokenizer).score(
                prompt_ids=prompts, response_ids=responses, raw_prompt=msgs
            )
            for path in (tiny_assets.reward_model, second_rm)
        ]
        a, b = singles[0].scores, singles[1].scores  # (3,), (3,)
        mean, std = (a + b) / 2, (a - b).abs() / 2  # population std of two values
        assert out.rm_members == 2
        torch.testing.assert_close(torch.tensor(out.rm_mean), mean)
        torch.testing.assert_close(torch.tensor(out.rm_std), std)
        torch.testing.assert_close(torch.tensor(out.rm), mean - 0.5 * std)
        stored = rows(worker.store.get_fields(meta, ["rm_scores"], timeout=0)["rm_scores"])
        last = torch.stack([row[-1] for row in stored])  # the score sits on the last token
        torch.testing.assert_close(last, mean - 0.5 * std)
    finally:
        store.close()


# --------------------------------------------------------------------------- warm start


def test_members_train_with_their_own_seed_on_the_same_heldout_pairs(
    tiny_assets: AssetPaths, tmp_path: Path
) -> None:
    settings = replace(
        RewardModelSettings.from_config(WarmstartConfig()),
        steps=3,
        max_seconds=None,
        pairs_per_step=8,
        samples_per_prompt=1,
    )
    reports, weights = [], []
    for member in (0, 1):
        out = tmp_path / f"m{member}"
        reports.append(
            train_reward_model(
                init_path=tiny_assets.policy,
                tokenizer_path=tiny_assets.tokenizer,
                train_path=tiny_assets.train_data,
                heldout_path=tiny_assets.heldout_data,
                out_path=out,
                settings=settings,
                seed=3,
                member=member,
            )
        )
        model = AutoModelForSequenceClassification.from_pretrained(out)
        weights.append(model.score.weight.detach().clone())
    assert [r.member for r in reports] == [0, 1]
    assert [r.seed for r in reports] == [3, member_seed(3, 1)] and member_seed(3, 1) != 3
    assert reports[0].heldout_pairs == reports[1].heldout_pairs  # the same held-out pairs
    assert not torch.equal(weights[0], weights[1])  # own head init and data order
