"""VLLMEngine against the engine contract; needs vLLM and a CUDA device (skipped otherwise).

Never run in the CPU tier: vLLM is not installed there. On a CUDA machine with vLLM these
check the output layout, logprobs against a transformers forward, seeding, sleep/wake and
weight sync (including weights given while asleep). They use the session ``assets`` (head
dim 32) in bfloat16, which vLLM's CUDA attention backends support; logprobs are compared with
a float32 transformers forward at a bfloat16 tolerance.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from infra.assets import AssetPaths  # noqa: E402
from infra.engines import EngineAsleepError, make_engine  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine(assets: AssetPaths):
    return make_engine(
        "vllm",
        assets.policy,
        dtype="bfloat16",
        gpu_memory_utilization=0.2,
        enforce_eager=True,
    )


@pytest.fixture(scope="module")
def prompts(assets: AssetPaths) -> list[torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(assets.tokenizer)
    return [
        torch.tensor(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        for q in ("1+2=", "12+34=", "123+456=")
    ]


def test_layout_logprobs_and_seed(engine, prompts, assets):
    out = engine.generate(prompts, n=2, max_new_tokens=8, temperature=1.0, seed=3)
    again = engine.generate(prompts, n=2, max_new_tokens=8, temperature=1.0, seed=3)
    assert len(out.response_ids) == 6
    assert all(torch.equal(a, b) for a, b in zip(out.response_ids, again.response_ids))
    model = AutoModelForCausalLM.from_pretrained(assets.policy)
    for row, (ids, logprobs) in enumerate(zip(out.response_ids, out.rollout_logprobs)):
        prompt = prompts[row // 2]
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, ids])[None]).logits[
                0, prompt.numel() - 1 : -1
            ]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs, expected, atol=5e-2, rtol=0)


def test_sleep_wake_and_weight_sync(engine, prompts, assets):
    greedy = engine.generate(prompts, n=1, max_new_tokens=8, temperature=0.0, seed=0)
    engine.sleep()
    with pytest.raises(EngineAsleepError):
        engine.generate(prompts, n=1, max_new_tokens=4, seed=0)
    trainer = AutoModelForCausalLM.from_pretrained(assets.policy)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn_like(param))
    engine.load_weights(trainer.state_dict())  # deferred until wake_up
    engine.wake_up()
    changed = engine.generate(prompts, n=1, max_new_tokens=8, temperature=0.0, seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(greedy.response_ids, changed.response_ids))
    engine.load_weights(AutoModelForCausalLM.from_pretrained(assets.policy).state_dict())
    restored = engine.generate(prompts, n=1, max_new_tokens=8, temperature=0.0, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(greedy.response_ids, restored.response_ids))
