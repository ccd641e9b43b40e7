"""The typed config tree: defaults, YAML + overrides, and errors that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.config import ConfigError, TrainConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_every_shipped_config_validates() -> None:
    names = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert {"default", "grpo", "ppo", "rloo", "tiny"} <= set(names)
    for name in names:
        cfg = load_config(CONFIGS / f"{name}.yaml")
        assert cfg.batch_size == cfg.rollout.prompts_per_step * cfg.rollout.n


def test_overrides_are_parsed_as_yaml_scalars_and_nested() -> None:
    cfg = load_config(
        CONFIGS / "tiny.yaml",
        ["trainer.total_steps=7", "algorithm.kl.coef=0.05", "resources.mode=colocate_async"],
    )
    assert cfg.trainer.total_steps == 7
    assert cfg.algorithm.kl.coef == pytest.approx(0.05)
    assert cfg.resources.mode == "colocate_async"
    assert cfg.rollout.n == 4  # from the file, untouched


def test_ppo_config_uses_a_critic_and_reference() -> None:
    cfg = load_config(CONFIGS / "ppo.yaml")
    assert cfg.algorithm.use_critic and cfg.algorithm.use_reference
    assert not TrainConfig().algorithm.use_critic


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("rollout.n=0", "rollout.n"),
        ("actor.micro_batch_size=7", "micro_batch_size"),
        ("algorithm.estimator=ppo2", "algorithm.estimator"),
        ("trainer.no_such_field=1", "trainer.no_such_field"),
    ],
)
def test_bad_values_name_the_field(override: str, names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_config(None, [override])


def test_an_unknown_policy_loss_is_one_line_naming_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor.policy_loss=grpo"])
    message = str(err.value)
    assert "actor.policy_loss" in message and "'gspo'" in message and "\n" not in message


def test_the_policy_loss_presets_take_several_steps_per_batch() -> None:
    for name in ("gspo", "cispo"):
        cfg = load_config(name)
        assert cfg.actor.policy_loss == name
        assert cfg.actor.mini_batch_size < cfg.batch_size  # the ratio moves, the clip can act


def test_separate_async_takes_a_colocated_or_an_own_reward_pool() -> None:
    """separate_async: ``colocated`` puts the reward model on the training pool, beside the
    trainer; ``own`` gives it a pool of its own."""
    assert load_config(None, ["resources.mode=separate_async"]).reward.pool == "colocated"
    cfg = load_config(None, ["resources.mode=separate_async", "reward.pool=own"])
    assert cfg.reward.pool == "own"


def test_malformed_override_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["trainer.total_steps"])


@pytest.mark.parametrize("override", ["rollout.tools=[a", "a=b: c: d", 'name="open'])
def test_an_override_whose_value_is_not_yaml_is_one_line_naming_it(override: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    key = override.partition("=")[0]
    assert message.startswith(f"override {override!r}: the value of {key} is not valid YAML (")
    assert "quote the whole value" in message and "\n" not in message


def test_tools_without_a_second_turn_are_refused_naming_max_turns() -> None:
    tools = "rollout.tools=[{path: tools.py, name: add}]"
    with pytest.raises(ConfigError) as err:
        load_config(None, [tools])
    message = str(err.value)
    assert "rollout.max_turns=1" in message and "set rollout.max_turns to 2 or more" in message
    assert "\n" not in message
    assert load_config(None, [tools, "rollout.max_turns=2"]).rollout.multi_turn


def test_batch_must_split_over_workers() -> None:
    with pytest.raises(ConfigError, match="num_workers"):
        load_config(None, ["rollout.prompts_per_step=3", "rollout.n=1", "resources.num_workers=2"])


# ---------------------------------------------------------------- bring your own model, data, reward
def test_a_users_policy_without_any_reward_is_refused_naming_both_settings() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["models.policy=/models/mine"])
    message = str(err.value)
    assert "models.reward_model" in message and "reward.functions" in message
    assert "\n" not in message
    # Either reward is enough, and the warm start never runs against a user's policy.
    with_fn = load_config(None, ["models.policy=/m", "reward.functions=[{name: exact_match}]"])
    assert not with_fn.uses_reward_model and not with_fn.warm_start
    with_rm = load_config(None, ["models.policy=/m", "models.reward_model=/rm"])
    assert with_rm.uses_reward_model and not with_rm.warm_start


def test_the_builtin_task_trains_a_reward_model_only_when_it_is_weighted() -> None:
    assert TrainConfig().warm_start and TrainConfig().uses_reward_model
    cfg = load_config(None, ["reward.model_weight=0", "reward.functions=[{name: exact_match}]"])
    assert cfg.warm_start and not cfg.uses_reward_model
    user_data = load_config(None, ["data.train_files=[p.parquet]", "models.reward_model=/rm"])
    assert not user_data.warm_start and not user_data.data.builtin


def test_separate_async_without_a_reward_model_needs_no_reward_pool() -> None:
    cfg = load_config(
        None,
        ["resources.mode=separate_async", "models.policy=/m", "reward.functions=[{name: gsm8k}]"],
    )
    assert cfg.reward.pool == "colocated" and not cfg.uses_reward_model


def test_verl_estimator_name_and_its_alias() -> None:
    assert load_config(None, ["algorithm.estimator=reinforce_plus_plus"]).algorithm.estimator == (
        "reinforce_plus_plus"
    )
    assert load_config(None, ["algorithm.estimator=reinforce_pp"]).algorithm.estimator == (
        "reinforce_plus_plus"
    )


def test_a_missing_config_file_is_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(err.value) and "no such file" in str(err.value)
    assert "\n" not in str(err.value)


def test_presets_resolve_by_name_from_the_package() -> None:
    assert load_config("grpo").name == "grpo"
    assert load_config("examples/addition-reward-fn").data.train_files


def test_a_tracker_that_is_not_installed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.loggers=[jsonl, mlflow]"])
    assert "ppoflow[mlflow]" in str(err.value) and "trainer.loggers" in str(err.value)


def test_alerts_need_a_bound() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.alerts=[{metric: val-core/x/reward/mean@1}]"])
    assert "trainer.alerts" in str(err.value)


def test_setting_one_critic_field_keeps_the_critics_learning_rate() -> None:
    cfg = load_config(None, ["critic.mini_batch_size=32", "critic.micro_batch_size=32"])
    assert cfg.critic.lr == TrainConfig().critic.lr == 5e-4
    assert cfg.actor.lr == 1e-4
