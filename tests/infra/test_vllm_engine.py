"""VLLMEngine against the engine contract; needs vLLM and a CUDA device (skipped otherwise).

Never run in the CPU tier: vLLM is not installed there (``test_vllm_on_cpu.py`` covers the parts
that run without it). On a CUDA machine with vLLM these check the output layout, logprobs
against a transformers forward, seeding, that sleep frees device memory, and weight sync through
``collective_rpc`` and the worker extension at tensor parallelism 1, awake and asleep (weights
given while asleep load on wake-up): each sync must change seeded samples when the weights are
perturbed and bring them back with the originals. They use the session ``assets`` (head dim 32)
in bfloat16, which vLLM's CUDA attention backends support; logprobs are compared with a float32
transformers forward at a bfloat16 tolerance.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from infra.assets import AssetPaths  # noqa: E402
from infra.engines import EngineAsleepError, make_engine  # noqa: E402
from infra.engines.vllm_extension import LOAD_METHOD, write_weights  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine(assets: AssetPaths):
    return make_engine(
        "vllm",
        assets.policy,
        dtype="bfloat16",
        gpu_memory_utilization=0.2,
        tensor_parallel_size=1,
        max_model_len=64,
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


def _perturbed(assets: AssetPaths) -> torch.nn.Module:
    trainer = AutoModelForCausalLM.from_pretrained(assets.policy)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn_like(param))
    return trainer


def _samples(engine, prompts):
    """Seeded samples: a function of the weights (an untrained tied model's greedy output
    repeats the last token whatever the weights, so greedy decoding would not tell)."""
    return engine.generate(prompts, n=2, max_new_tokens=8, temperature=1.0, seed=7)


def _differ(a, b) -> bool:
    return any(
        not torch.equal(ids_a, ids_b) or float((lp_a - lp_b).abs().max()) > 0.05
        for ids_a, ids_b, lp_a, lp_b in zip(
            a.response_ids, b.response_ids, a.rollout_logprobs, b.rollout_logprobs
        )
    )


def _same(a, b) -> bool:
    return all(
        torch.equal(ids_a, ids_b) and torch.allclose(lp_a, lp_b, atol=2e-2, rtol=0)
        for ids_a, ids_b, lp_a, lp_b in zip(
            a.response_ids, b.response_ids, a.rollout_logprobs, b.rollout_logprobs
        )
    )


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


def test_weight_sync_through_collective_rpc_at_tp1(engine, prompts, assets, tmp_path):
    original = AutoModelForCausalLM.from_pretrained(assets.policy).state_dict()
    before = _samples(engine, prompts)
    # The extension is mixed into the one worker and loads every tensor of the file.
    path = write_weights(_perturbed(assets).state_dict(), directory=tmp_path)
    assert engine.llm.collective_rpc(LOAD_METHOD, args=(str(path),)) == [len(original)]
    engine.llm.reset_prefix_cache()
    assert _differ(before, _samples(engine, prompts))
    engine.load_weights(original)  # the engine's own path: the same RPC
    assert _same(before, _samples(engine, prompts))


def test_sleep_frees_memory_and_weights_given_asleep_load_on_wake(engine, prompts, assets):
    before = _samples(engine, prompts)
    free_awake, _ = torch.cuda.mem_get_info()
    engine.sleep()
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep > free_awake  # weights offloaded and the KV cache released
    with pytest.raises(EngineAsleepError):
        engine.generate(prompts, n=1, max_new_tokens=4, seed=0)
    engine.load_weights(_perturbed(assets).state_dict())  # deferred until wake_up
    engine.wake_up()
    assert _differ(before, _samples(engine, prompts))
    engine.load_weights(AutoModelForCausalLM.from_pretrained(assets.policy).state_dict())
    assert _same(before, _samples(engine, prompts))
