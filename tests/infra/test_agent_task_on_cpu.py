"""The built-in agentic task's pieces: the tool and its schema, the tokenizer (a call is a few
merged pieces, the template renders tools and tool turns) and the warm start's demonstrations
(ids as the agent loop stores them, the tool turn out of the loss)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.agent_loop import parse_tool_calls
from infra.agent_task import (
    _Tool,
    add,
    build_agent_tokenizer,
    call_text,
    demonstration,
)
from infra.rl_data import chat_prompt_ids
from infra.tools import ToolCall, tool_schemas


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_agent_tokenizer(Path(tmp_path_factory.mktemp("agent")) / "tokenizer")


def test_the_tool_and_its_schema() -> None:
    assert add(1234, 5678) == 6912
    (schema,) = tool_schemas([_Tool()]) or []
    assert schema["function"]["name"] == "add"
    assert set(schema["function"]["parameters"]["properties"]) == {"a", "b"}


def test_a_call_is_thirteen_tokens_and_parses(tokenizer) -> None:
    text = call_text(1234, 5678)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 13 and tokenizer.decode(ids) == text
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1234, "b": 5678})]


def test_the_prompt_is_rendered_with_the_tool(tokenizer) -> None:
    from infra.config import AGENT_PROMPT_TOKENS

    chat = [{"role": "user", "content": "1234+5678="}]
    ids = chat_prompt_ids(tokenizer, chat, tools=tool_schemas([_Tool()]))
    assert tokenizer.decode(ids) == "<bos><|system|>add(a,b)<|user|>1234+5678=<|assistant|>"
    assert len(ids) == AGENT_PROMPT_TOKENS


def test_demonstrations_with_and_without_the_tool(tokenizer) -> None:
    tools = tool_schemas([_Tool()]) or []
    prompt, response, trained = demonstration(tokenizer, 1234, 5678, use_tool=True, tools=tools)
    assert tokenizer.decode(prompt + response) == (
        "<bos><|system|>add(a,b)<|user|>1234+5678=<|assistant|>"
        + call_text(1234, 5678)
        + "<eos><|tool|>6912<|assistant|>6912<eos>"
    )
    # The call and its EOS, then the tool turn (<|tool|> 6912 <|assistant|>) out of the loss.
    assert trained == [True] * 14 + [False] * 6 + [True] * 5
    _, direct, trained = demonstration(tokenizer, 1234, 5678, use_tool=False, tools=tools)
    assert tokenizer.decode(direct) == "6912<eos>" and all(trained)
