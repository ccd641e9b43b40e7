"""The multi-turn agent loop with a scripted stand-in engine, the tokenizers of
``tests/agent_assets.py`` (Hermes/Qwen2.5, Qwen3-style reasoning, a declared call format) and a
real tool pool: exact ids (sampled + template tokens, nothing re-tokenized), the loss mask, the
budget, and every kind of bad call as a counted error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent_assets import (  # noqa: E402
    DECLARED_RESPONSE_TEMPLATE,
    DECLARED_TEMPLATE,
    REASONING_TEMPLATE,
    build_hermes_tokenizer,
    write_tools,
)

from infra.agent_loop import (  # noqa: E402
    check_tool_template,
    final_answer,
    parse_declared_calls,
    parse_tool_calls,
    run_agent_loop,
    tool_turn_ids,
)
from infra.config import RolloutConfig  # noqa: E402
from infra.data import chat_prompt_ids  # noqa: E402
from infra.engines.base import GenerationOutput  # noqa: E402
from infra.tools import ToolCall, ToolPool, ToolResult, tool_schemas  # noqa: E402


class _Spec:
    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = str(path), name


@pytest.fixture(scope="module")
def tokenizer():
    return build_hermes_tokenizer()


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tools(tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="module")
def pool(tools_file: Path):
    specs = [_Spec(tools_file, n) for n in ("add", "explode", "hang", "shout")]
    with ToolPool(specs, workers=2, timeout_s=1.0, backstop_slack_s=3.0) as p:
        yield p


def char_ids(tokenizer, text: str) -> list[int]:
    """``text`` as one token per character (the added tokens kept whole): ids a policy may
    sample but that BPE would never produce from the text."""
    out: list[int] = []
    for part in text.replace("</tool_call>", "\0E\0").replace("<tool_call>", "\0S\0").split("\0"):
        if part == "S":
            out.append(tokenizer.convert_tokens_to_ids("<tool_call>"))
        elif part == "E":
            out.append(tokenizer.convert_tokens_to_ids("</tool_call>"))
        else:
            for ch in part:
                out += tokenizer.encode(ch, add_special_tokens=False)
    return out


class ScriptedEngine:
    """Stand-in for a ``GenerationEngine``: turn k of every row answers ``script[k]`` (one id
    per character, then EOS), log-prob -0.5 each; records the inputs of every call."""

    def __init__(self, tokenizer, script: list[str]) -> None:
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def generate(
        self, prompt_ids, *, n, max_new_tokens, temperature=1.0, top_p=1.0, seed, min_new_tokens=0
    ):
        turn = len(self.calls)
        self.calls.append([p.clone() for p in prompt_ids])
        eos = self.tokenizer.eos_token_id
        ids = char_ids(self.tokenizer, self.script[turn]) + [eos]
        ids = torch.tensor(ids[:max_new_tokens], dtype=torch.int64)
        rows = [ids.clone() for _ in prompt_ids for _ in range(n)]
        return GenerationOutput(rows, [torch.full(r.shape, -0.5) for r in rows])

    def load_weights(self, state_dict) -> None: ...
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...

    is_awake = True


def _loop(tokenizer, pool, tools_file, script, *, max_turns=3, budget=400, cut=256):
    schemas = tool_schemas([_Spec(tools_file, "add")])
    prompt = [{"role": "user", "content": "What is 2+3?"}]
    prompt_ids = torch.tensor(chat_prompt_ids(tokenizer, prompt, tools=schemas))
    engine = ScriptedEngine(tokenizer, script)
    out = run_agent_loop(
        engine,
        tokenizer,
        prompt_ids=[prompt_ids],
        raw_prompts=[prompt],
        n=2,
        seed=0,
        rollout=RolloutConfig(
            max_turns=max_turns, max_new_tokens=budget, max_tool_response_tokens=cut
        ),
        temperature=1.0,
        min_new_tokens=0,
        tools=pool,
        tool_schemas=schemas,
        eos_token_ids=[tokenizer.eos_token_id],
    )
    return prompt_ids, engine, out, schemas


CALL = '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 30}}</tool_call>'


def test_ids_are_the_sampled_segments_and_the_templates_tool_turn(tokenizer, pool, tools_file):
    prompt_ids, engine, out, schemas = _loop(tokenizer, pool, tools_file, [CALL, "50"])
    t = out[0]
    assert (t.num_turns, t.tool_calls, t.tool_errors) == (2, 1, 0)
    assert [kind for kind, _ in t.segments] == ["sampled", "tool", "sampled"]
    # The stored ids are the sampled segments and the tool turn, concatenated.
    assert t.response_ids == [i for _, ids in t.segments for i in ids]
    assert t.loss_mask == [k == "sampled" for k, ids in t.segments for _ in ids]
    assert t.rollout_logprobs == [
        (-0.5 if k == "sampled" else 0.0) for k, ids in t.segments for _ in ids
    ]
    # The tool turn is exactly the template's tokens after the sampled EOS ...
    whole = list(chat_prompt_ids(tokenizer, t.messages[:-1], tools=schemas))
    assert whole[-len(t.segments[1][1]) :] == t.segments[1][1]
    assert tokenizer.decode(t.segments[1][1]).startswith("\n<|im_start|>user\n<tool_response>\n50")
    # ... the second turn saw the prompt and every token so far, and the sampled ids were kept
    # as sampled: re-tokenizing the decoded text would give other ids (the drift avoided).
    second = engine.calls[1][0].tolist()
    assert second == prompt_ids.tolist() + t.segments[0][1] + t.segments[1][1]
    decoded = tokenizer.decode(t.response_ids)
    assert tokenizer.encode(decoded, add_special_tokens=False) != t.response_ids
    assert final_answer(t.messages) == "50"
    assert t.messages[2] == {"role": "tool", "name": "add", "content": "50"}


def test_a_turn_is_cut_after_its_tool_call_and_max_turns_ends_the_rollout(
    tokenizer, pool, tools_file
):
    _, engine, out, _ = _loop(
        tokenizer, pool, tools_file, [CALL + " more", CALL, CALL], max_turns=2
    )
    t = out[0]
    first = t.segments[0][1]
    assert first[-1] == tokenizer.convert_tokens_to_ids("</tool_call>")
    assert (t.num_turns, t.tool_calls) == (2, 1)  # the last turn's call is not run
    assert len(engine.calls) == 2


def test_the_budget_covers_the_whole_response(tokenizer, pool, tools_file):
    budget = len(char_ids(tokenizer, CALL)) + 1 + 5  # the call, its EOS, 5 tool tokens
    _, _, out, _ = _loop(tokenizer, pool, tools_file, [CALL, "50"], budget=budget)
    t = out[0]
    assert len(t.response_ids) == budget and t.num_turns == 1
    assert not t.loss_mask[-1]  # cut inside the tool turn


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "not JSON"),
        ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>', "TypeError"),
        ('<tool_call>{"name": "explode", "arguments": {"text": "a"}}</tool_call>', "boom"),
        ('<tool_call>{"name": "hang", "arguments": {"seconds": 30}}</tool_call>', "no result"),
        ('<tool_call>{"arguments": {}}</tool_call>', "a tool call is"),
    ],
    ids=["not_json", "unknown", "wrong_arguments", "raises", "times_out", "no_name"],
)
def test_a_bad_call_is_an_error_message_the_policy_reads(tokenizer, pool, tools_file, call, error):
    _, _, out, _ = _loop(tokenizer, pool, tools_file, [call, "no"])
    t = out[0]
    assert (t.num_turns, t.tool_calls, t.tool_errors) == (2, 1, 1)
    tool = t.messages[2]
    assert tool["role"] == "tool" and error in tool["content"], tool


def test_long_tool_answers_are_cut_and_counted(tokenizer, pool, tools_file):
    call = '<tool_call>{"name": "shout", "arguments": {"text": "hey"}}</tool_call>'
    _, _, out, _ = _loop(tokenizer, pool, tools_file, [call, "ok"], cut=10)
    t = out[0]
    assert t.truncated_tool_responses == 1
    assert len(tokenizer.encode(t.messages[2]["content"], add_special_tokens=False)) <= 10


def test_the_pool_recovers_after_a_timeout(pool):
    slow = ToolCall("hang", {"seconds": 30})
    results = pool.run([slow, ToolCall("add", {"a": 1, "b": 2})])
    assert results[0].error and results[1] == ToolResult("3")
    assert pool.run([ToolCall("add", {"a": 2, "b": 2})]) == [ToolResult("4")]


def test_parse_tool_calls_reads_hermes_calls() -> None:
    text = (
        'a <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> '
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("add", {"a": 3, "b": 4}),
    ]
    assert parse_tool_calls("no call") == []


def test_tool_turn_ids_need_a_template_with_a_tool_role(tokenizer) -> None:
    from infra.agent_loop import AgentTemplateError

    class Plain:
        def apply_chat_template(self, messages, tokenize=False, **kw):
            return "".join(m["content"] for m in messages if m["role"] != "tool")

    with pytest.raises(AgentTemplateError, match="tool"):
        tool_turn_ids(
            Plain(),
            [{"role": "assistant", "content": "x"}],  # type: ignore[arg-type]
            [{"role": "tool", "content": "y"}],
            tools=None,
            eos_text=None,
        )


@pytest.mark.parametrize(
    "thinking",
    [
        "",
        "<think>\nadd the two\n</think>\n\n",
        "<think>\n\n</think>\n\n",  # empty: rendered without it once other messages follow
        "<think>\nadd\n\n</think>\n",  # spaced otherwise than the template writes it
    ],
    ids=["no_reasoning", "reasoning", "empty_reasoning", "reasoning_spaced_otherwise"],
)
def test_a_qwen3_style_template_extends_the_sampled_ids_with_or_without_reasoning(
    pool, tools_file, thinking
):
    """A turn that other messages follow loses its empty reasoning block in this template's
    rendering (and has its reasoning re-spaced); the tool turn is still the template's tokens
    after the sampled ones."""
    tokenizer = build_hermes_tokenizer(REASONING_TEMPLATE)
    prompt_ids, engine, out, schemas = _loop(tokenizer, pool, tools_file, [thinking + CALL, "50"])
    t = out[0]
    assert (t.num_turns, t.tool_calls, t.tool_errors) == (2, 1, 0)
    assert [kind for kind, _ in t.segments] == ["sampled", "tool", "sampled"]
    assert t.response_ids == [i for _, ids in t.segments for i in ids]
    tool = tokenizer.decode(t.segments[1][1])
    assert tool == (
        "\n<|im_start|>user\n<tool_response>\n50\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    whole = list(chat_prompt_ids(tokenizer, t.messages[:-1], tools=schemas))
    assert whole[-len(t.segments[1][1]) :] == t.segments[1][1]
    second = engine.calls[1][0].tolist()
    assert second == prompt_ids.tolist() + t.segments[0][1] + t.segments[1][1]
    check_tool_template(tokenizer, schemas)


DECLARED_CALL = '<function=add>{"a": 20, "b": 30}</function>'


def test_a_declared_call_format_is_read_by_the_tokenizers_response_template(pool, tools_file):
    tokenizer = build_hermes_tokenizer(DECLARED_TEMPLATE, DECLARED_RESPONSE_TEMPLATE)
    script = [DECLARED_CALL + " and more", "50"]
    prompt_ids, engine, out, schemas = _loop(tokenizer, pool, tools_file, script)
    t = out[0]
    assert (t.num_turns, t.tool_calls, t.tool_errors) == (2, 1, 0)
    # Cut right after the format's closing text (sampled one character a token).
    assert tokenizer.decode(t.segments[0][1]) == DECLARED_CALL
    assert t.messages[2] == {"role": "tool", "name": "add", "content": "50"}
    assert tokenizer.decode(t.segments[1][1]) == (
        "<|im_end|>\n<|im_start|>tool\n50<|im_end|>\n<|im_start|>assistant\n"
    )
    second = engine.calls[1][0].tolist()
    assert second == prompt_ids.tolist() + t.segments[0][1] + t.segments[1][1]
    check_tool_template(tokenizer, schemas)
    # The declared format is the one read: a Hermes call is plain text to this policy.
    _, _, hermes, _ = _loop(tokenizer, pool, tools_file, [CALL, "50"])
    assert (hermes[0].num_turns, hermes[0].tool_calls) == (1, 0)


def test_a_declared_call_that_does_not_parse_is_an_error_message(pool, tools_file):
    tokenizer = build_hermes_tokenizer(DECLARED_TEMPLATE, DECLARED_RESPONSE_TEMPLATE)
    _, _, out, _ = _loop(tokenizer, pool, tools_file, ["<function=add>{a: 1,</function>", "no"])
    t = out[0]
    assert (t.num_turns, t.tool_calls, t.tool_errors) == (2, 1, 1)
    assert t.messages[2]["content"].startswith("error: the tool call does not parse (")
    # Arguments are cast by the tool's schema, as transformers' parser does.
    schemas = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                },
            },
        }
    ]
    calls = parse_declared_calls(
        tokenizer, '<function=add>{"a": "7", "b": 2}</function>', prefix="", tools=schemas
    )
    assert calls == [ToolCall("add", {"a": 7, "b": 2})]


# Llama-3.1 style: a tool answer goes through ``tojson`` (quotes and escapes).
TOJSON_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{{ '<|im_start|>ipython\\n' + (message.content | tojson) + '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_tool_answer_the_template_escapes_is_found_and_the_check_renders_one() -> None:
    from infra.agent_loop import CHECK_ANSWER

    tokenizer = build_hermes_tokenizer(TOJSON_TEMPLATE)
    conversation = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": CALL},
    ]
    answer = 'error: a "call" <is>\n{}'
    ids = tool_turn_ids(
        tokenizer,
        conversation,
        [{"role": "tool", "name": "add", "content": answer}],
        tools=None,
        eos_text="<|im_end|>",
    )
    expected = "\n<|im_start|>ipython\n" + json.dumps(answer)  # transformers' tojson
    assert tokenizer.decode(ids) == expected + "<|im_end|>\n<|im_start|>assistant\n"
    assert '"' in CHECK_ANSWER and "\n" in CHECK_ANSWER and "<" in CHECK_ANSWER
    check_tool_template(tokenizer, [{"function": {"name": "add"}}])


def test_the_sampled_turn_repeated_earlier_in_the_conversation_is_not_taken_for_it(tokenizer):
    """The policy's call also stands in the user's prompt (a few-shot example): the tool turn
    starts after the assistant's own text, not after the example."""
    conversation = [
        {"role": "user", "content": f"Call like this: {CALL} What is 2+3?"},
        {"role": "assistant", "content": CALL},
    ]
    ids = tool_turn_ids(
        tokenizer,
        conversation,
        [{"role": "tool", "name": "add", "content": "5"}],
        tools=None,
        eos_text="<|im_end|>",
    )
    assert tokenizer.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_declared_format_the_parser_refuses_is_an_input_error_and_plain_text_no_call(
    tmp_path,
):
    from infra.agent_loop import AgentTemplateError

    broken = build_hermes_tokenizer(
        DECLARED_TEMPLATE, {"fields": {"tool_calls": {"open": "<f>", "close": "</f>"}}}
    )  # no start_anchor: transformers refuses the template
    with pytest.raises(AgentTemplateError, match="response_template does not parse an answer"):
        check_tool_template(broken, [{"function": {"name": "add"}}])
    tokenizer = build_hermes_tokenizer(DECLARED_TEMPLATE, DECLARED_RESPONSE_TEMPLATE)
    # A reply the parser refuses is a failed call only when it closes one.
    assert parse_declared_calls(broken, "just 3", prefix="", tools=None) == []
    bad = parse_declared_calls(broken, "<f>{</f>", prefix="", tools=None)
    assert len(bad) == 1 and isinstance(bad[0], ToolResult) and bad[0].error
    assert parse_declared_calls(tokenizer, "just 3", prefix="", tools=None) == []
