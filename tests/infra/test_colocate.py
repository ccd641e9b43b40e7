"""ColocatedGroup turn-taking (one awake model per pool, always asleep after a turn) and the
TrainableModel wrapper; a last test runs a real engine and reward model through one group."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from infra.assets import AssetPaths
from infra.colocate import ColocatedGroup, ColocationError, TrainableModel
from infra.engines.hf import TransformersEngine
from infra.reward_model import RewardScorer


class FakeModel:
    """Implements only the Sleepable interface and records the calls it gets."""

    def __init__(self, awake: bool = False) -> None:
        self.is_awake = awake
        self.calls: list[str] = []

    def sleep(self) -> None:
        self.calls.append("sleep")
        self.is_awake = False

    def wake_up(self) -> None:
        self.calls.append("wake_up")
        self.is_awake = True


@pytest.fixture
def group() -> ColocatedGroup:
    group = ColocatedGroup("pool-0")
    group.register("rollout", FakeModel())
    group.register("reward", FakeModel())
    return group


def test_awake_wakes_yields_and_sleeps_with_timings(group):
    with group.awake("rollout") as model:
        assert model.is_awake
        assert group.awake_roles() == ["rollout"]
    assert not model.is_awake and model.calls == ["wake_up", "sleep"]
    assert group.awake_roles() == []
    stats = group.pop_stats()
    assert set(stats) == {"timing_s/wake/rollout", "timing_s/sleep/rollout"}
    assert all(seconds >= 0 for seconds in stats.values())
    assert group.stats == {}


def test_second_awake_role_is_refused_naming_the_awake_one():
    group, reward = ColocatedGroup("pool-0"), FakeModel()
    group.register("rollout", FakeModel())
    group.register("reward", reward)
    with group.awake("rollout"):
        with pytest.raises(ColocationError, match="'rollout' is awake"), group.awake("reward"):
            pass  # pragma: no cover
        with pytest.raises(ColocationError, match="already awake"), group.awake("rollout"):
            pass  # pragma: no cover
    assert reward.calls == []  # refused before anything was woken
    # A model woken behind the group's back is caught too: the check asks the models.
    reward.wake_up()
    with pytest.raises(ColocationError, match="'reward' is awake"), group.awake("rollout"):
        pass  # pragma: no cover
    assert group.awake_roles() == ["reward"]
    group.put_all_to_sleep()
    assert group.awake_roles() == []


def test_exception_inside_awake_leaves_the_model_asleep(group):
    with pytest.raises(ZeroDivisionError), group.awake("reward") as model:
        assert model.is_awake
        raise ZeroDivisionError
    assert not model.is_awake
    with group.awake("rollout"):  # the pool is free again
        pass


def test_register_checks(group):
    with pytest.raises(ColocationError, match="no role 'critic'"), group.awake("critic"):
        pass  # pragma: no cover
    with pytest.raises(ColocationError, match="already registered"):
        group.register("rollout", FakeModel())
    with pytest.raises(TypeError):
        group.register("actor", object())  # type: ignore[arg-type]
    group.register("actor", FakeModel(awake=True))  # the only awake model: allowed
    with pytest.raises(ColocationError, match="'actor' is awake"):
        group.register("critic", FakeModel(awake=True))


def test_trainable_model_on_cpu_keeps_training_across_turns():
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()
    trainable = TrainableModel(module, optimizer)
    params = [p.clone() for p in module.parameters()]
    state = {k: v.clone() for k, v in optimizer.state[module.weight].items()}

    group = ColocatedGroup("pool-0")
    group.register("actor", trainable)
    group.put_all_to_sleep()
    assert not trainable.is_awake
    with group.awake("actor") as actor:
        assert all(torch.equal(a, b) for a, b in zip(params, actor.module.parameters()))
        assert all(torch.equal(v, optimizer.state[module.weight][k]) for k, v in state.items())
        actor.require_awake()
        optimizer.zero_grad()
        module(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
    assert not all(torch.equal(a, b) for a, b in zip(params, module.parameters()))
    with pytest.raises(RuntimeError, match="asleep"):
        trainable.require_awake()


def test_engine_and_reward_model_take_turns(tiny_assets: AssetPaths):
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.tokenizer)
    messages = [{"role": "user", "content": "12+34="}]
    prompt = torch.tensor(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    )
    group = ColocatedGroup("pool-0")
    group.register("rollout", TransformersEngine(tiny_assets.policy))
    group.put_all_to_sleep()
    group.register(
        "reward",
        RewardScorer(tiny_assets.reward_model_alt, policy_tokenizer_path=tiny_assets.tokenizer),
    )
    group.put_all_to_sleep()
    with group.awake("rollout") as engine:
        out = engine.generate([prompt], n=3, max_new_tokens=6, seed=0)
    with group.awake("reward") as scorer:
        scores = scorer.score(
            prompt_ids=[prompt] * 3, response_ids=out.response_ids, raw_prompt=[messages] * 3
        ).scores
    assert scores.shape == (3,) and torch.isfinite(scores).all()
    assert group.awake_roles() == []
    assert {"timing_s/wake/rollout", "timing_s/wake/reward"} <= set(group.stats)


@pytest.mark.gpu
def test_trainable_model_offloads_params_and_optimizer_state_on_cuda():
    module = torch.nn.Linear(256, 256).cuda()
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.randn(4, 256, device="cuda")).sum().backward()
    optimizer.step()
    trainable = TrainableModel(module, optimizer, device="cuda")
    weight = module.weight.detach().cpu().clone()
    awake_bytes = torch.cuda.memory_allocated()
    trainable.sleep()
    assert torch.cuda.memory_allocated() < awake_bytes
    assert module.weight.device.type == "cpu"
    assert optimizer.state[module.weight]["exp_avg"].device.type == "cpu"
    trainable.wake_up()
    assert module.weight.device.type == "cuda"
    assert optimizer.state[module.weight]["exp_avg"].device.type == "cuda"
    assert torch.equal(module.weight.detach().cpu(), weight)
    optimizer.step()  # still works: same Parameter objects, state back on their devices
