"""The agent loop over the real vLLM engine (CPU build), token in, token out: a tiny policy
warm-started to call the ``add`` tool, then answer, rolls out through ``VLLMEngine`` exactly as
through the transformers engine, and its stored ids are the sampled segments plus the chat
template's tool turn. Marked ``vllm`` (see ``test_vllm_engine.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent_assets import CALL, save_agent_policy, warm_start_caller, write_tools  # noqa: E402

from infra.agent_loop import Trajectory, run_agent_loop  # noqa: E402
from infra.config import RolloutConfig  # noqa: E402
from infra.engines import make_engine  # noqa: E402
from infra.engines.base import GenerationEngine  # noqa: E402
from infra.rl_data import chat_prompt_ids  # noqa: E402
from infra.tools import ToolPool, tool_schemas  # noqa: E402

pytestmark = pytest.mark.vllm
PROMPTS = ["What is 1+2?", "What is 3+4?"]


class _Spec:
    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = str(path), name


def _roll(engine: GenerationEngine, tokenizer, tools_file: Path) -> list[Trajectory]:
    tools = [_Spec(tools_file, "add")]
    schemas = tool_schemas(tools)
    chats = [[{"role": "user", "content": text}] for text in PROMPTS]
    prompt_ids = [torch.tensor(chat_prompt_ids(tokenizer, chat, tools=schemas)) for chat in chats]
    with ToolPool(tools, workers=1, timeout_s=10.0) as pool:
        return run_agent_loop(
            engine,
            tokenizer,
            prompt_ids=prompt_ids,
            raw_prompts=chats,
            n=1,
            seed=0,
            rollout=RolloutConfig(max_turns=3, max_new_tokens=96, max_tool_response_tokens=32),
            temperature=0.0,
            min_new_tokens=0,
            tools=pool,
            tool_schemas=schemas,
            eos_token_ids=[tokenizer.eos_token_id],
        )


def test_a_tool_rollout_through_vllm_stores_the_sampled_ids_and_the_tool_turn(
    require_vllm, tmp_path: Path
) -> None:
    tools_file = write_tools(tmp_path)
    init = save_agent_policy(tmp_path / "init", hidden_size=64)
    policy = warm_start_caller(init, tmp_path / "policy", tools_file, PROMPTS, steps=300)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    vllm = make_engine(
        "vllm",
        policy,
        device="cpu",
        dtype=torch.float32,
        eos_token_id=tokenizer.eos_token_id,
        cpu_kv_cache_gib=0.25,
        enforce_eager=True,
    )
    out = _roll(vllm, tokenizer, tools_file)
    schemas = tool_schemas([_Spec(tools_file, "add")])
    for t in out:
        assert (t.num_turns, t.tool_calls, t.tool_errors) == (2, 1, 0), t.messages
        assert t.messages[1] == {"role": "assistant", "content": CALL}
        # The policy was taught one call, add(1, 2), whatever the prompt.
        assert t.messages[2] == {"role": "tool", "name": "add", "content": "3"}
        assert [kind for kind, _ in t.segments] == ["sampled", "tool", "sampled"]
        # The stored ids are the sampled segments and the template's tool turn, in order.
        assert t.response_ids == [i for _, ids in t.segments for i in ids]
        assert t.loss_mask == [k == "sampled" for k, ids in t.segments for _ in ids]
        whole = list(chat_prompt_ids(tokenizer, t.messages[:-1], tools=schemas))
        assert whole[-len(t.segments[1][1]) :] == t.segments[1][1]
    # Token for token what the transformers engine rolls out with the same weights.
    hf = make_engine("hf", policy, eos_token_id=tokenizer.eos_token_id)
    assert [t.response_ids for t in _roll(hf, tokenizer, tools_file)] == [
        t.response_ids for t in out
    ]
