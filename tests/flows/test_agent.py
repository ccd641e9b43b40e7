"""Multi-turn rollouts with tools, end to end: real Prefect (test harness), real local Ray, the
HF engine, in every mode. The policy is the Qwen2-style one of ``tests/agent_assets.py`` (a
byte-level BPE tokenizer, a Hermes/ChatML template with tools), warm-started here to answer
with a ``<tool_call>`` written one id per character and, after the tool's answer, with "3".

After two steps the saved samples show a multi-turn rollout as the trainer saw it: its
``response_ids`` are the sampled segments (``loss_mask`` True, each the ids of its assistant
turn) and the chat template's tool turns (False) concatenated, and decoding them and
re-tokenizing the text would have given other ids (the drift the agent loop avoids)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from agent_assets import CALL, char_ids, save_agent_policy, warm_start_caller, write_tools

from infra.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAIRS = [(3, 4), (10, 5), (7, 8), (20, 1), (2, 2), (6, 9), (11, 12), (1, 2)]


@pytest.fixture(scope="module")
def agent_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The warm-started caller, its tools file and a prompt file in verl's layout."""
    root = tmp_path_factory.mktemp("agent")
    tools = write_tools(root)
    prompts = [f"What is {a}+{b}?" for a, b in PAIRS]
    policy = warm_start_caller(
        save_agent_policy(root / "init"), root / "policy", tools, prompts[:2]
    )
    data = root / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "data_source": "toy/add",
                    "prompt": [{"role": "user", "content": text}],
                    "reward_model": {"ground_truth": str(a + b)},
                    "extra_info": {"index": i},
                }
            )
            + "\n"
            for i, (text, (a, b)) in enumerate(zip(prompts, PAIRS, strict=True))
        )
    )
    return {"policy": policy, "tools": tools, "data": data}


def _run(setup: dict[str, Path], tmp_path: Path, *extra: str) -> tuple[Path, list[dict[str, Any]]]:
    from flows.train import ppo_train

    cfg = load_config(
        CONFIGS / "tiny.yaml",
        [
            f"models.policy={setup['policy']}",
            f"data.train_files=[{setup['data']}]",
            "data.max_prompt_length=512",
            "reward.functions=[{name: exact_match}]",
            f"rollout.tools=[{{path: {setup['tools']}, name: add}}]",
            "rollout.max_turns=3",
            "rollout.max_new_tokens=96",
            "trainer.total_steps=2",
            "trainer.eval_every=100",
            f"run_dir={tmp_path / 'run'}",
            "resources.num_cpus=4",
            *extra,
        ],
    )
    state = ppo_train(cfg, return_state=True)
    assert state.is_completed(), state.message
    run_dir = cfg.resolved_run_dir
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows


def _runs(ids: list[int], mask: list[bool]) -> list[tuple[bool, list[int]]]:
    """``ids`` split where ``mask`` changes: (sampled?, ids) segments, in order."""
    out: list[tuple[bool, list[int]]] = []
    for token, sampled in zip(ids, mask, strict=True):
        if out and out[-1][0] == sampled:
            out[-1][1].append(token)
        else:
            out.append((sampled, [token]))
    return out


def _check_multi_turn_sample(sample: dict[str, Any], setup: dict[str, Path]) -> None:
    from agent_assets import build_hermes_tokenizer

    from infra.agent_loop import tool_turn_ids
    from infra.tools import tool_schemas

    class _Spec:
        path, name = str(setup["tools"]), "add"

    tok = build_hermes_tokenizer()
    schemas = tool_schemas([_Spec()])
    ids, mask, messages = sample["response_ids"], sample["loss_mask"], sample["messages"]
    segments = _runs(ids, mask)
    assert [sampled for sampled, _ in segments][:3] == [True, False, True]
    # The stored ids are the segments concatenated; each sampled segment is its assistant turn's
    # ids as sampled (one id per character, then EOS), each tool segment the ids the chat
    # template adds for the tool messages after that turn.
    assert [t for _, seg in segments for t in seg] == ids
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert messages[assistants[0]]["content"] == CALL
    assert segments[0][1] == char_ids(tok, CALL) + [tok.eos_token_id]
    first_tool = [m for m in messages[assistants[0] + 1 : assistants[1]] if m["role"] == "tool"]
    assert first_tool == [{"role": "tool", "name": "add", "content": "3"}]
    expected_tool = tool_turn_ids(
        tok, messages[: assistants[0] + 1], first_tool, tools=schemas, eos_text="<|im_end|>"
    )
    assert segments[1][1] == expected_tool
    second = segments[2][1]
    text = tok.decode(second[:-1] if second[-1] == tok.eos_token_id else second)
    assert text == messages[assistants[1]]["content"]
    # Decoding the whole response and tokenizing the text again gives other ids: a trainer
    # that re-tokenized would score tokens the policy never sampled.
    assert tok.encode(tok.decode(ids), add_special_tokens=False) != ids


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("resources.mode=colocate_async", "resources.max_staleness=1"),
        ("resources.mode=separate_async", "algorithm.kl.monitor=false"),
    ],
    ids=["sync", "colocate_async", "separate_async"],
)
def test_tool_calls_train_with_the_sampled_ids(
    prefect_harness, ray_local, agent_setup, tmp_path, extra
) -> None:
    run_dir, rows = _run(agent_setup, tmp_path, *extra)
    assert [r["step"] for r in rows] == [0, 1]
    assert all("actor/pg_loss" in r for r in rows)
    assert max(r["agent/num_turns/mean"] for r in rows) > 1
    assert max(r["agent/tool_calls/mean"] for r in rows) > 0
    assert all(
        "agent/tool_errors/mean" in r and "agent/truncated_tool_responses" in r for r in rows
    )
    samples = [
        json.loads(line)
        for step in (0, 1)
        for line in (run_dir / "samples" / f"step_{step}.jsonl").open()
    ]
    called = [
        s
        for s in samples
        if s["num_turns"] > 1
        and s["messages"][-1]["role"] == "assistant"
        and next(m for m in s["messages"] if m["role"] == "assistant")["content"] == CALL
    ]
    assert called, [s["messages"] for s in samples[:4]]
    for sample in called:
        _check_multi_turn_sample(sample, agent_setup)
