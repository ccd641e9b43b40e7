"""The agent loop through ``VLLMEngine.generate`` (token-in/token-out), with stand-ins for
``vllm.LLM``, ``SamplingParams`` and ``TokensPrompt`` (vLLM is not needed on the CPU tier)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agent_assets import build_hermes_tokenizer, write_tools  # noqa: E402
from test_agent_loop import CALL, _Spec, char_ids  # noqa: E402

from infra.agent_loop import run_agent_loop  # noqa: E402
from infra.config import RolloutConfig  # noqa: E402
from infra.data import chat_prompt_ids  # noqa: E402
from infra.engines.vllm_engine import VLLMEngine  # noqa: E402
from infra.tools import ToolPool, tool_schemas  # noqa: E402


class _LLM:
    """``vllm.LLM.generate`` over token prompts: turn k answers ``script[k]`` + EOS."""

    def __init__(self, tokenizer, script: list[str]) -> None:
        self.tokenizer, self.script, self.prompts = tokenizer, script, []

    def generate(self, prompts, params, use_tqdm=False):
        turn = len(self.prompts)
        self.prompts.append([p["prompt_token_ids"] for p in prompts])
        ids = char_ids(self.tokenizer, self.script[turn]) + [self.tokenizer.eos_token_id]
        out = []
        for p in params:
            ids_p = ids[: p.max_tokens]
            completions = [
                SimpleNamespace(
                    index=i,
                    token_ids=ids_p,
                    logprobs=[{t: SimpleNamespace(logprob=-0.25)} for t in ids_p],
                )
                for i in range(p.n)
            ]
            out.append(SimpleNamespace(outputs=completions))
        return out


@pytest.fixture()
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: kw  # type: ignore[attr-defined]
    exceptions = types.ModuleType("vllm.exceptions")
    exceptions.VLLMClientError = type("VLLMClientError", (Exception,), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "vllm.exceptions", exceptions)


def test_the_loop_runs_through_the_vllm_engines_generate(fake_vllm, tmp_path: Path) -> None:
    tokenizer = build_hermes_tokenizer()
    tools = [_Spec(write_tools(tmp_path), "add")]
    schemas = tool_schemas(tools)
    prompt = [{"role": "user", "content": "What is 20+30?"}]
    prompt_ids = torch.tensor(chat_prompt_ids(tokenizer, prompt, tools=schemas))
    engine = object.__new__(VLLMEngine)
    llm = _LLM(tokenizer, [CALL, "50"])
    engine._llm, engine._awake, engine._stop_token_ids = llm, True, [tokenizer.eos_token_id]
    engine._failed = None
    with ToolPool(tools, workers=1, timeout_s=5.0) as pool:
        out = run_agent_loop(
            engine,
            tokenizer,
            prompt_ids=[prompt_ids],
            raw_prompts=[prompt],
            n=2,
            seed=0,
            rollout=RolloutConfig(max_turns=2, max_new_tokens=300, max_tool_response_tokens=32),
            temperature=1.0,
            min_new_tokens=0,
            tools=pool,
            tool_schemas=schemas,
            eos_token_ids=[tokenizer.eos_token_id],
        )
    assert len(out) == 2
    for t in out:
        assert (t.num_turns, t.tool_calls, t.tool_errors) == (2, 1, 0)
        assert t.messages[-1] == {"role": "assistant", "content": "50"}
        sampled = [lp for lp, m in zip(t.rollout_logprobs, t.loss_mask) if m]
        assert sampled == [-0.25] * len(sampled)
    # The second turn's prompts are the first prompt + each row's ids so far, token for token.
    assert llm.prompts[1] == [prompt_ids.tolist() + t.response_ids[:-3] for t in out]
