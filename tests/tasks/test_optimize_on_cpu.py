"""Actor/critic training loops on tiny Llama models built in-test (nothing is downloaded).

Invariants: the micro-batch split (1 × 8 vs 8 × 1) and data parallelism (2 workers with summed
gradients and global denominators vs 1 worker) give the same parameters, in float64, for every
aggregation mode. Smoke: two updates change every parameter and keep the losses finite.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

from tasks.batching import PackedBatch, gather_response_logprobs, pack_batch
from tasks.update import (
    AGGREGATIONS,
    ActorUpdateSettings,
    CriticUpdateSettings,
    PolicyLossSettings,
    actor_update,
    count_minibatch_units,
    critic_update,
)

VOCAB = 20


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine every
    parallel op can stall for a scheduler slice; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_config(**extra: object) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        # sdpa keeps float64 models in float64; eager attention takes its softmax in float32,
        # whose rounding depends on the padded width and the CPU's vector units.
        attn_implementation="sdpa",
        **extra,
    )


def tiny_policy(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config()).to(dtype)


def tiny_critic(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    # classifier_dropout 0: the token-classification head otherwise drops out (default 0.1).
    return LlamaForTokenClassification(tiny_config(num_labels=1, classifier_dropout=0.0)).to(dtype)


def make_batch(seed: int, rows: int = 8) -> PackedBatch:
    """Rows with prompts of 1–4 tokens and responses of 0–6 tokens (row 2 is empty)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, 5, (rows,), generator=generator)
    response_lengths = torch.randint(1, 7, (rows,), generator=generator)
    response_lengths[2] = 0
    return pack_batch(
        prompt_ids=[
            torch.randint(1, VOCAB, (int(n),), generator=generator) for n in prompt_lengths
        ],
        response_ids=[
            torch.randint(1, VOCAB, (int(n),), generator=generator) for n in response_lengths
        ],
        pad_id=0,
    )


def actor_inputs(model: nn.Module, batch: PackedBatch, seed: int) -> dict[str, Tensor]:
    """old_logprobs near the model's own (so ratios ≠ 1 and clipping engages), advantages, refs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
        current = gather_response_logprobs(logits=logits, batch=batch).cpu()
    shape, mask = current.shape, batch.response_mask.cpu()
    noise = torch.randn(shape, generator=generator, dtype=current.dtype) * 0.3
    return {
        "old_logprobs": torch.where(mask, current + noise, 0.0),
        "advantages": torch.randn(shape, generator=generator, dtype=current.dtype),
        "ref_logprobs": torch.where(mask, current - noise.abs(), 0.0),
    }


def assert_same_parameters(a: nn.Module, b: nn.Module, atol: float) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def actor_settings(agg: str, micro: int, mini: int = 8, **extra: Any) -> ActorUpdateSettings:
    """Every setting exercised: two epochs, an asymmetric clip, entropy and KL terms. ``extra``
    replaces any of them, a policy loss's (``policy_loss``, ``clip_low``, ...) included."""
    policy: dict[str, Any] = {
        "policy_loss": "ppo",
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dual_clip": 3.0,
        "gspo_clip_low": 3e-4,
        "gspo_clip_high": 4e-4,
        "cispo_clip_low": None,
        "cispo_clip_high": 0.2,
        "sapo_tau_pos": 1.0,
        "sapo_tau_neg": 1.05,
    }
    base: dict[str, Any] = {
        "ppo_epochs": 2,
        "mini_batch_size": mini,
        "micro_batch_size": micro,
        "max_tokens_per_micro_batch": None,
        "padding_free": False,
        "agg": agg,
        "entropy_coef": 0.01,
        "kl_loss_coef": 0.1,
        "kl_loss_kind": "k3",
        "distill_loss_coef": 0.0,
        "max_grad_norm": 0.5,
        "temperature": 0.9,
        "shuffle_seed": None,
        "rollout_correction": "none",
        "correction_cap": 2.0,
        "correction_low": 0.5,
        "correction_high": 2.0,
        "old_is_rollout": False,
    }
    for key, value in extra.items():
        (policy if key in policy else base)[key] = value
    return ActorUpdateSettings(policy=PolicyLossSettings(**policy), **base)


def critic_settings(**extra: object) -> CriticUpdateSettings:
    base: dict[str, object] = {
        "ppo_epochs": 2,
        "mini_batch_size": 8,
        "micro_batch_size": 8,
        "max_tokens_per_micro_batch": None,
        "clip_range": 0.2,
        "agg": "token-mean",
        "max_grad_norm": 0.5,
        "shuffle_seed": None,
    }
    base.update(extra)
    return CriticUpdateSettings(**base)  # type: ignore[arg-type]


def test_actor_update_two_steps_changes_every_parameter() -> None:
    model = tiny_policy(seed=1, dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch = make_batch(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = actor_settings("token-mean", micro=2, mini=4, ppo_epochs=1, kl_loss_coef=0.05)
    for step in range(2):
        metrics = actor_update(
            model=model,
            optimizer=optimizer,
            batch=batch,
            cfg=cfg,
            **actor_inputs(model, batch, step),
        )
        for key in (
            "actor/pg_loss",
            "actor/pg_clipfrac",
            "actor/ppo_kl",
            "actor/entropy",
            "actor/grad_norm",
            "actor/kl_loss",
        ):
            assert key in metrics and torch.isfinite(torch.tensor(metrics[key])), key
        assert metrics["actor/skipped_steps"] == 0.0
    unchanged = [name for name, p in model.named_parameters() if torch.equal(p, before[name])]
    assert unchanged == []


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_actor_micro_batch_split_invariant(agg: str) -> None:
    # Micro-batch 1 × accumulation 8 and micro-batch 8 × accumulation 1 take the same steps.
    batch = make_batch(2)
    reference = tiny_policy(seed=2)
    inputs = actor_inputs(reference, batch, seed=3)
    results = []
    for micro in (1, 8):
        model = copy.deepcopy(reference)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        metrics = actor_update(
            model=model, optimizer=optimizer, batch=batch, cfg=actor_settings(agg, micro), **inputs
        )
        results.append((model, metrics))
    (model_a, metrics_a), (model_b, metrics_b) = results
    assert not torch.equal(next(model_a.parameters()), next(reference.parameters()))
    assert_same_parameters(model_a, model_b, atol=1e-10)
    for key in (
        "actor/pg_loss",
        "actor/entropy",
        "actor/kl_loss",
        "actor/grad_norm",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
    ):
        assert metrics_a[key] == pytest.approx(metrics_b[key], abs=1e-10), key
    assert 0.0 < metrics_a["actor/pg_clipfrac"] < 1.0  # the clip was exercised


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo", "sapo"])
def test_every_policy_loss_takes_the_same_steps_in_any_micro_batch_split(policy_loss: str) -> None:
    # As the test above for ppo: GSPO's row ratio, CISPO's weight and SAPO's gate are per row,
    # so micro-batch 1 × accumulation 8 and 8 × 1 take the same steps.
    batch = make_batch(2)
    reference = tiny_policy(seed=2)
    inputs = actor_inputs(reference, batch, seed=3)
    wide = {"gspo_clip_low": 0.05, "gspo_clip_high": 0.05}  # some rows in, some out of the clip
    results = []
    for micro in (1, 8):
        model = copy.deepcopy(reference)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        cfg = actor_settings("seq-mean-token-mean", micro, policy_loss=policy_loss, **wide)
        metrics = actor_update(model=model, optimizer=optimizer, batch=batch, cfg=cfg, **inputs)
        results.append((model, metrics))
    (model_a, metrics_a), (model_b, metrics_b) = results
    assert not torch.equal(next(model_a.parameters()), next(reference.parameters()))
    assert_same_parameters(model_a, model_b, atol=1e-10)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], abs=1e-10), key
    assert 0.0 < metrics_a["actor/pg_clipfrac"] < 1.0  # the clip (or gate) was exercised


def summing_reducers(world: int) -> list[Callable[[nn.Module], None]]:
    """Grad reducers for `world` workers running in threads: every worker ends with the sum."""
    barrier = threading.Barrier(world)
    grads: dict[int, list[Tensor]] = {}

    def make(rank: int) -> Callable[[nn.Module], None]:
        def reduce(model: nn.Module) -> None:
            params = list(model.parameters())
            grads[rank] = [
                p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params
            ]
            barrier.wait()
            total = [sum(grads[r][i] for r in range(world)) for i in range(len(params))]
            barrier.wait()  # everyone has read before anyone writes the next step's grads
            for p, g in zip(params, total):
                p.grad = g

        return reduce

    return [make(rank) for rank in range(world)]


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_actor_data_parallel_invariant(agg: str) -> None:
    # Worker 0 holds rows 0–3, worker 1 rows 4–7, each with 2 mini-batches of 2 rows; together
    # they must equal one worker whose mini-batches are {0, 1, 4, 5} and {2, 3, 6, 7}.
    batch = make_batch(4)
    reference = tiny_policy(seed=4)
    inputs = actor_inputs(reference, batch, seed=5)
    shards = [torch.arange(0, 4), torch.arange(4, 8)]
    local_counts = [
        count_minibatch_units(response_mask=batch.response_mask[rows], mini_batch_size=2, agg=agg)
        for rows in shards
    ]
    global_counts = [a + b for a, b in zip(*local_counts)]
    workers = [copy.deepcopy(reference) for _ in shards]
    reducers = summing_reducers(len(shards))
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        rows = shards[rank]
        try:
            actor_update(
                model=workers[rank],
                optimizer=torch.optim.SGD(workers[rank].parameters(), lr=0.5),
                batch=batch.select(rows),
                cfg=actor_settings(agg, micro=1, mini=2),
                grad_reducer=reducers[rank],
                global_tokens=global_counts,
                global_seqs=global_counts,
                **{
                    k: v[rows, : int(batch.response_lengths[rows].max())] for k, v in inputs.items()
                },
            )
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(shards))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    order = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])
    single = copy.deepcopy(reference)
    actor_update(
        model=single,
        optimizer=torch.optim.SGD(single.parameters(), lr=0.5),
        batch=batch.select(order),
        cfg=actor_settings(agg, micro=2, mini=4),
        **{k: v[order] for k, v in inputs.items()},
    )
    assert_same_parameters(workers[0], workers[1], atol=0.0)
    assert_same_parameters(workers[0], single, atol=1e-10)


def test_global_count_errors_are_clear() -> None:
    batch = make_batch(6)
    model = tiny_policy(seed=6)
    inputs = actor_inputs(model, batch, seed=6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="one global count per mini-batch"):
        actor_update(
            model=model,
            optimizer=optimizer,
            batch=batch,
            cfg=actor_settings("token-mean", 2, mini=4),
            global_tokens=1e6,
            **inputs,
        )
    with pytest.raises(ValueError, match="2 mini-batches"):
        actor_update(
            model=model,
            optimizer=optimizer,
            batch=batch,
            cfg=actor_settings("token-mean", 2, mini=4),
            global_tokens=[5.0],
            **inputs,
        )
    with pytest.raises(ValueError, match="old_logprobs"):
        actor_update(
            model=model,
            optimizer=optimizer,
            batch=batch,
            cfg=actor_settings("token-mean", 2),
            old_logprobs=inputs["old_logprobs"][:, :1],
            advantages=inputs["advantages"],
        )
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        actor_settings("token-mean", micro=4, mini=6)
    with pytest.raises(ValueError, match="agg"):
        critic_settings(agg="sum")


@pytest.mark.parametrize("agg", sorted(AGGREGATIONS))
def test_critic_micro_batch_split_invariant(agg: str) -> None:
    batch = make_batch(7)
    reference = tiny_critic(seed=7)
    generator = torch.Generator().manual_seed(8)
    shape = batch.response_mask.shape
    old_values = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.1
    returns = torch.randn(shape, generator=generator, dtype=torch.float64)
    results = []
    for micro in (1, 8):
        model = copy.deepcopy(reference)
        cfg = critic_settings(micro_batch_size=micro, agg=agg)
        metrics = critic_update(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            batch=batch,
            old_values=old_values,
            returns=returns,
            cfg=cfg,
        )
        results.append((model, metrics))
    (model_a, metrics_a), (model_b, metrics_b) = results
    assert_same_parameters(model_a, model_b, atol=1e-10)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"):
        assert key in metrics_a and metrics_a[key] == pytest.approx(metrics_b[key], abs=1e-10), key
    assert not torch.equal(model_a.score.weight, reference.score.weight)


@pytest.mark.gpu
def test_actor_and_critic_update_on_cuda_with_a_cpu_batch() -> None:
    # Workers keep the packed batch on the CPU; micro-batches must move to the model's device.
    device = torch.device("cuda")
    model = tiny_policy(seed=9, dtype=torch.float32).to(device)
    batch = make_batch(9)
    inputs = {k: v.float().cpu() for k, v in actor_inputs(model, batch.to(device), seed=9).items()}
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = actor_update(
        model=model,
        optimizer=optimizer,
        batch=batch,
        cfg=actor_settings("token-mean", micro=2, mini=4, ppo_epochs=1),
        **inputs,
    )
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    critic = tiny_critic(seed=9, dtype=torch.bfloat16).to(device)
    zeros = torch.zeros(batch.response_mask.shape)
    metrics = critic_update(
        model=critic,
        optimizer=torch.optim.AdamW(critic.parameters(), lr=1e-3),
        batch=batch,
        old_values=zeros,
        returns=zeros + 1,
        cfg=critic_settings(ppo_epochs=1),
    )
    assert torch.isfinite(torch.tensor(metrics["critic/vf_loss"]))


def test_one_step_without_old_logprobs_equals_recomputed_old_logprobs() -> None:
    """old_logprobs=None uses the step's own detached forward pass: for one optimizer step this
    is the same old policy a recompute gives, so the parameters match (float64), and the k1
    KL to the reference is logged from the same numbers. One micro-batch of the whole batch:
    a forward of rows trimmed to a narrower width differs in the last float64 bits."""
    cfg = actor_settings("token-mean", micro=8, ppo_epochs=1, kl_loss_coef=0.0)
    batch = make_batch(3)
    inputs = actor_inputs(tiny_policy(seed=3), batch, seed=3)
    with torch.no_grad():
        model = tiny_policy(seed=3)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits
        recomputed = gather_response_logprobs(logits=logits, batch=batch, temperature=0.9)
    results = []
    for old in (recomputed, None):
        model = tiny_policy(seed=3)
        metrics = actor_update(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            batch=batch,
            old_logprobs=old,
            advantages=inputs["advantages"],
            ref_logprobs=inputs["ref_logprobs"],
            cfg=cfg,
        )
        results.append((model, metrics))
    assert_same_parameters(results[0][0], results[1][0], atol=1e-12)
    assert results[1][1]["actor/pg_clipfrac"] == 0.0  # ratio exactly 1
    mask = batch.response_mask
    expected = float((recomputed - inputs["ref_logprobs"])[mask].mean())
    assert results[1][1]["actor/kl_to_ref"] == pytest.approx(expected, abs=1e-9)
    assert "actor/kl_to_ref" not in results[0][1]


@pytest.mark.parametrize("extra", [{"ppo_epochs": 2}, {"mini_batch_size": 4}])
def test_old_logprobs_none_refused_for_more_than_one_step(extra: dict[str, int]) -> None:
    cfg = actor_settings("token-mean", micro=4, **{"ppo_epochs": 1, **extra})
    batch = make_batch(4)
    model = tiny_policy(seed=4)
    inputs = actor_inputs(model, batch, seed=4)
    with pytest.raises(ValueError, match="recompute old_logprobs"):
        actor_update(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            batch=batch,
            old_logprobs=None,
            advantages=inputs["advantages"],
            cfg=cfg,
        )


def test_the_distillation_loss_is_half_the_squared_gap_and_moves_towards_the_teacher() -> None:
    """``distill_loss_coef`` (``algorithm.distill.mode: kl_loss``): with no advantage, entropy
    or KL term, the only gradient is the k2 gap's, which raises the log-probs of the tokens the
    teacher likes more than the student does."""
    batch = make_batch(4)
    reference = tiny_policy(seed=4)
    with torch.no_grad():
        logits = reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long())
        current = gather_response_logprobs(logits=logits.logits, batch=batch).cpu()
    mask = batch.response_mask.cpu()
    teacher = torch.where(mask, current + 1.0, 0.0)  # every sampled token one nat likelier
    inputs = {"old_logprobs": current, "advantages": torch.zeros_like(current)}
    model = copy.deepcopy(reference)
    cfg = actor_settings(
        "token-mean",
        8,
        ppo_epochs=1,
        entropy_coef=0.0,
        kl_loss_coef=0.0,
        distill_loss_coef=1.0,
        temperature=1.0,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics = actor_update(
        model=model, optimizer=optimizer, batch=batch, cfg=cfg, teacher_logprobs=teacher, **inputs
    )
    assert metrics["actor/distill_loss"] == pytest.approx(0.5)  # ½ · 1² on every token
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long())
        after = gather_response_logprobs(logits=logits.logits, batch=batch).cpu()
    assert float((after - current)[mask].mean()) > 0  # towards the teacher
    with pytest.raises(ValueError, match="teacher_logprobs"):
        actor_update(model=model, optimizer=optimizer, batch=batch, cfg=cfg, **inputs)
