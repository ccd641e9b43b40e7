"""TransformersEngine: greedy parity with ``generate``, logprob parity with a full forward,
determinism, EOS layout, sleep/wake, weight sync, and the sampler's distribution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infra.assets import AssetPaths
from infra.engines import (
    EngineAsleepError,
    GenerationEngine,
    GenerationOutput,
    VLLMUnavailableError,
    is_vllm_available,
    make_engine,
)
from infra.engines.hf import TransformersEngine, sample_next_tokens

QUESTIONS = ["1+2=", "12+34=", "7+80=", "123+456=", "5+5="]


@pytest.fixture(scope="module")
def prompts(tiny_assets: AssetPaths) -> list[torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.tokenizer)
    rows = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
        )
        for q in QUESTIONS
    ]
    assert len({len(row) for row in rows}) > 1  # different lengths: left padding is exercised
    return [torch.tensor(row, dtype=torch.long) for row in rows]


@pytest.fixture(scope="module")
def engine(tiny_assets: AssetPaths) -> TransformersEngine:
    return TransformersEngine(tiny_assets.policy)


def _recompute_logprobs(
    model: torch.nn.Module, prompt: torch.Tensor, response: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Reference: one unpadded forward over prompt+response, log_softmax(logits / T) gathered."""
    ids = torch.cat([prompt, response])[None]  # (1, P+T)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1].double()  # (T, V)
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(-1, response[:, None]).squeeze(-1)


def test_greedy_matches_transformers_generate(engine, prompts, tiny_assets):
    out = engine.generate(prompts, n=1, max_new_tokens=12, temperature=0.0, seed=0)

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.tokenizer, padding_side="left")
    batch = tokenizer.pad({"input_ids": [p.tolist() for p in prompts]}, return_tensors="pt")
    reference = engine.model.generate(
        **batch, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id
    )[:, batch["input_ids"].shape[1] :]
    eos = tokenizer.eos_token_id
    for row, ours in enumerate(out.response_ids):
        expected = reference[row].tolist()
        if eos in expected:
            expected = expected[: expected.index(eos) + 1]
        assert ours.tolist() == expected, f"row {row}"
    assert sum(r.numel() for r in out.response_ids) > len(prompts)  # not all empty/one-token


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 1.0), (0.0, 1.0)])
def test_logprobs_match_full_forward_and_rows_are_prompt_major(engine, prompts, temperature, top_p):
    n = 3
    out = engine.generate(
        prompts, n=n, max_new_tokens=10, temperature=temperature, top_p=top_p, seed=7
    )
    assert len(out.response_ids) == len(prompts) * n
    for row, (ids, logprobs) in enumerate(zip(out.response_ids, out.rollout_logprobs)):
        assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
        # Row r belongs to prompt r // n: recomputing with any other prompt would not match.
        expected = _recompute_logprobs(engine.model, prompts[row // n], ids, temperature)
        torch.testing.assert_close(logprobs.double(), expected, atol=1e-5, rtol=0)


def test_rows_stop_at_eos_and_some_stop_early(engine, prompts):
    eos = engine.eos_token_ids[0]
    out = engine.generate(prompts, n=4, max_new_tokens=16, temperature=1.0, seed=3)
    early = 0
    for ids in out.response_ids:
        eos_positions = (ids == eos).nonzero().flatten().tolist()
        if eos_positions:
            assert eos_positions == [ids.numel() - 1]  # EOS is last, nothing after it
            early += ids.numel() < 16
        else:
            assert ids.numel() == 16
    assert early >= 2  # rows finish at different steps: the batch compaction path ran


def test_same_seed_same_output_other_seed_differs(engine, prompts):
    def run(seed: int) -> GenerationOutput:
        return engine.generate(prompts, n=2, max_new_tokens=12, temperature=1.0, seed=seed)

    first, again, other = run(11), run(11), run(12)
    for a, b in zip(
        first.response_ids + first.rollout_logprobs, again.response_ids + again.rollout_logprobs
    ):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(first.response_ids, other.response_ids))


def test_tiny_top_p_is_greedy(engine, prompts):
    greedy = engine.generate(prompts, n=1, max_new_tokens=8, temperature=0.0, seed=0)
    nucleus = engine.generate(prompts, n=1, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=5)
    for a, b in zip(greedy.response_ids, nucleus.response_ids):
        assert torch.equal(a, b)


def test_sampler_frequencies_follow_tempered_softmax_and_nucleus():
    # probs [0.5, 0.3, 0.15, 0.05]; top_p=0.8 keeps {0, 1} (mass before token 2 is 0.8 >= 0.8),
    # so the draws follow 0.5/0.8 = 0.625 and 0.3/0.8 = 0.375, while the reported logprob stays
    # log of the un-renormalised probability.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)  # (B, V)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_next_tokens(logits, temperature=1.0, top_p=0.8, generator=generator)
    freq = torch.bincount(tokens, minlength=4).double() / tokens.numel()
    torch.testing.assert_close(
        freq, torch.tensor([0.625, 0.375, 0.0, 0.0]).double(), atol=0.015, rtol=0
    )
    torch.testing.assert_close(logprobs, probs.log()[tokens], atol=1e-6, rtol=0)
    # Temperature 2 flattens: p_i ∝ sqrt(probs_i).
    tokens, _ = sample_next_tokens(logits, temperature=2.0, top_p=1.0, generator=generator)
    freq = torch.bincount(tokens, minlength=4).double() / tokens.numel()
    expected = probs.double().sqrt() / probs.double().sqrt().sum()
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_sleep_refuses_generate_and_wake_restores_bit_identical(tiny_assets, prompts):
    engine = TransformersEngine(tiny_assets.policy)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    reference = engine.generate(prompts, n=2, max_new_tokens=8, seed=1)
    engine.sleep()
    engine.sleep()  # idempotent
    assert not engine.is_awake
    with pytest.raises(EngineAsleepError):
        engine.generate(prompts, n=1, max_new_tokens=4, seed=0)
    engine.wake_up()
    assert engine.is_awake
    after = engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    again = engine.generate(prompts, n=2, max_new_tokens=8, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(reference.response_ids, again.response_ids))


def test_load_weights_syncs_and_validates_names(tiny_assets, prompts):
    engine = TransformersEngine(tiny_assets.policy)
    trainer = AutoModelForCausalLM.from_pretrained(tiny_assets.policy)
    original = {k: v.clone() for k, v in trainer.state_dict().items()}
    base = engine.generate(prompts, n=1, max_new_tokens=8, temperature=0.0, seed=0)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    engine.sleep()
    engine.load_weights(trainer.state_dict())  # allowed while asleep
    engine.wake_up()
    for name, param in trainer.named_parameters():
        assert torch.equal(engine.model.get_parameter(name), param)
    changed = engine.generate(prompts, n=1, max_new_tokens=8, temperature=0.0, seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(base.response_ids, changed.response_ids))
    engine.load_weights(original)
    restored = engine.generate(prompts, n=1, max_new_tokens=8, temperature=0.0, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(base.response_ids, restored.response_ids))

    with pytest.raises(KeyError, match="not in the rollout model"):
        engine.load_weights({**original, "model.extra.weight": torch.zeros(1)})
    partial = dict(original)
    partial.pop("model.norm.weight")
    with pytest.raises(KeyError, match="missing"):
        engine.load_weights(partial)


def test_argument_checks_and_empty_cases(engine, prompts):
    with pytest.raises(ValueError, match="n must be"):
        engine.generate(prompts, n=0, max_new_tokens=4, seed=0)
    with pytest.raises(ValueError, match="prompt_ids\\[1\\]"):
        engine.generate(
            [prompts[0], torch.zeros(0, dtype=torch.long)], n=1, max_new_tokens=4, seed=0
        )
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(prompts, n=1, max_new_tokens=4, top_p=0.0, seed=0)
    out = engine.generate(prompts, n=2, max_new_tokens=0, seed=0)
    assert [r.numel() for r in out.response_ids] == [0] * (2 * len(prompts))
    assert engine.generate([], n=2, max_new_tokens=4, seed=0).response_ids == []
    with pytest.raises(ValueError, match="shape"):
        GenerationOutput([torch.zeros(2, dtype=torch.long)], [torch.zeros(3)])


def test_make_engine(tiny_assets: AssetPaths, tmp_path: Path):
    engine = make_engine("hf", tiny_assets.policy)
    assert isinstance(engine, TransformersEngine)
    assert isinstance(engine, GenerationEngine)
    with pytest.raises(ValueError, match="unknown engine kind"):
        make_engine("sglang", tiny_assets.policy)  # type: ignore[arg-type]
    if not is_vllm_available():
        with pytest.raises(VLLMUnavailableError, match="hf"):
            make_engine("vllm", tiny_assets.policy)


@pytest.mark.gpu
def test_cuda_sleep_releases_memory_and_wake_restores(tiny_assets, prompts):
    engine = TransformersEngine(tiny_assets.policy, device="cuda")
    before = {k: v.cpu().clone() for k, v in engine.model.state_dict().items()}
    reference = engine.generate(prompts, n=2, max_new_tokens=8, seed=1)
    awake_bytes = torch.cuda.memory_allocated()
    engine.sleep()
    assert torch.cuda.memory_allocated() < awake_bytes
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    engine.wake_up()
    after = engine.model.state_dict()
    assert all(torch.equal(before[k], after[k].cpu()) for k in before)
    again = engine.generate(prompts, n=2, max_new_tokens=8, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(reference.response_ids, again.response_ids))


def test_growing_cache_layer_holds_what_transformers_layer_holds():
    """Prefill, repeat per sample, decode past the first capacity, drop rows, crop: after every
    operation the in-place layer holds exactly the concatenating layer's keys and values."""
    from transformers.cache_utils import DynamicLayer

    from infra.engines.hf import GrowingLayer

    torch.manual_seed(0)
    ours, theirs = GrowingLayer(), DynamicLayer()

    def step(length: int, batch: int) -> None:
        k, v = torch.randn(batch, 2, length, 8), torch.randn(batch, 2, length, 8)
        got, want = ours.update(k, v), theirs.update(k, v)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)

    step(5, 3)  # prefill
    ours.batch_repeat_interleave(2), theirs.batch_repeat_interleave(2)
    for _ in range(70):  # past the first capacity (64): the buffer grows
        step(1, 6)
    keep = torch.tensor([0, 2, 5])
    ours.batch_select_indices(keep), theirs.batch_select_indices(keep)
    step(1, 3)
    ours.crop(-4), theirs.crop(-4)
    step(2, 3)
    assert ours.get_seq_length() == theirs.get_seq_length() == 5 + 70 + 1 - 4 + 2


def test_one_rule_names_the_stop_and_pad_ids_of_every_engine(tiny_assets: AssetPaths):
    from infra.engines import pad_token_id, stop_token_ids
    from infra.engines.base import eos_ids, pad_id

    assert eos_ids(2, [2, 7], None, (9,)) == (2, 7, 9)
    assert eos_ids(None) == () and eos_ids(()) == ()
    assert pad_id(None, 5, eos=(2,)) == 5
    assert pad_id(None, eos=(2, 7)) == 2
    assert pad_id(None, eos=()) == 0
    # The workers' ids (from the tokenizer and the saved generation config) and the engine's
    # own defaults (from the model) agree on a model whose files say the same.
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets.tokenizer)
    engine = TransformersEngine(tiny_assets.policy)
    assert stop_token_ids(tokenizer, str(tiny_assets.policy))[0] == engine.eos_token_ids[0]
    assert pad_token_id(tokenizer) == engine.pad_token_id
    pinned = TransformersEngine(engine.model, eos_token_id=[3, 3, 4], pad_token_id=None)
    assert pinned.eos_token_ids == (3, 4)
