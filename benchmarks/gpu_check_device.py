"""GPU check of ppoflow's compute stages on one CUDA device, without Ray or Prefect.

Everything runs in this process through ``infra.workers.ModelWorker`` with an in-process
``memory://`` store (as ``benchmarks/gpu_check_scale.py``'s ``child_part`` does). The stage
modules ``tasks.*.stage`` import Ray (through ``tasks.context``'s worker groups), so this script
calls what their worker-side steps call instead: the
engine's ``generate``, the scorer's ``score``, ``tasks.batching.gather_response_logprobs`` (the
gather of ``tasks.logprobs.stage.response_logprobs``) and ``tasks.update.optimize.actor_update``
with ``ActorUpdateSettings`` built from the config by ``tasks.update.settings.actor_settings``
(what the update stage uses; it imports neither Prefect nor Ray). Models are built locally (nothing is downloaded): a Qwen2-style
causal LM from its config alone (random init, ``save_pretrained`` then ``from_pretrained``) with
a byte-level tokenizer (``tokenizers``), and ``infra.assets``' tiny Llama policy and reward model.

Parts (each guarded: a failing part records its error and the others still run):

1. ``rollout_gap``: samples from the HF engine (``TransformersEngine``, role ``rollout``) in
   bfloat16; the trainer's log-probs of the same tokens in bfloat16 (autocast over float32
   masters) and in float32; ``tasks.update.correction.rollout_gap`` between them
   (``rollout_corr/kl_k1``, ``kl_k3``, ``ppl_ratio``, ``is_weight_mean``, ``is_weight_max``), the
   correction mode being the one the step plan resolves for bfloat16 (``token_truncate``). A
   float32 engine against the float32 trainer is the baseline (only kernel rounding).
2. ``colocation``: rollout engine, reward model and actor (+ AdamW) in one ``ModelWorker`` (one
   ``ColocatedGroup``): the peak CUDA memory allocated during a generate → score → update cycle
   against the sum (and the largest) of each part's peak in a worker of its own.
3. ``throughput``: one PPO update of the Qwen2-0.5B-shaped model in bfloat16: tokens/s and
   MFU = 6 · parameters · tokens / seconds / peak, with the H200's dense bfloat16 peak of
   989 TFLOP/s (``H200_BF16_PEAK_FLOPS``; attention's own FLOPs are not counted).
4. ``fsdp2``: ``actor.strategy=fsdp2`` on one rank over NCCL (``ModelWorker.join_group`` on
   ``tcp://127.0.0.1``): one update, its ``actor/pg_loss``, ``actor/entropy`` and
   ``actor/grad_norm`` against the plain module's on the same batch, in float32 and bfloat16
   (tolerances in ``FSDP_RTOL``).
5. ``lora``: ``actor.lora`` (rank 8, all linear layers, ``infra.lora.apply_lora``): one update;
   trainable parameters and peak memory against full fine-tuning on the same batch.
6. ``vllm`` (where vLLM is installed; else recorded as skipped): the vLLM rollout engine
   (``rollout.engine=vllm``) in a ``ModelWorker`` beside the actor, on the device: the
   weight-sync probe against the trainer (``sync/probe_max_abs_diff``, float32 and bfloat16),
   sleep/wake, a sync of updated weights that must pass the probe, a perturbed sync that must
   fail it (``WeightSyncError``), greedy agreement with the transformers engine, and the
   engine–trainer gap of bfloat16 samples (``rollout_corr/*``) as in part 1.

Run on the device machine from the repository root (it has torch, transformers, peft, pyarrow
and pytest; what else ppoflow's imported modules need — pydantic, pydantic-core,
annotated-types, typing-inspection for ``infra.config``, tensordict, cloudpickle, pyvers for the
``memory://`` store — travels as the wheels ``make gpu-wheels`` downloads into ``.gpu-wheels/``,
about 4 MB; ppoflow itself is imported from the checkout, not installed)::

    make gpu-wheels                                   # here, with a registry
    pip install --no-index --find-links .gpu-wheels .gpu-wheels/*.whl   # there
    python benchmarks/gpu_check_device.py             # writes benchmarks/results/gpu-device.json

Well under 8 minutes on one H200. ``--output PATH`` writes the JSON elsewhere; ``--cpu-dry-run``
runs every part on the CPU with tiny models (gloo for FSDP2, MFU null) so CI proves the script
works; without CUDA and without that flag it prints that no CUDA device is present and exits 0.
Prints a table; exits 1 when any part failed.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "gpu-device.json"
H200_BF16_PEAK_FLOPS = 989e12  # NVIDIA H200 SXM, dense bfloat16 tensor-core peak (no sparsity)
GiB = 1024**3
# FSDP2 vs the plain module, relative: float32 computes the same math (only reduction order
# differs: ~1e-7 per op over a few dozen layers); bfloat16 rounds at other points (FSDP2 casts
# the weights to bfloat16 for every op, autocast only feeds bfloat16 to the matmuls) with unit
# roundoff 2^-9 ≈ 2e-3 per op, averaged over thousands of tokens: 2e-2 holds that and still
# catches a wrong gradient reduction or loss normalisation (a factor, not a percent).
FSDP_RTOL = {"float32": 1e-4, "bfloat16": 2e-2}


# ----------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Scale:
    """Model shapes and batch sizes of one kind of run (CUDA, or the CPU dry run)."""

    device: str
    qwen: tuple[tuple[str, int], ...]  # Qwen2Config shape; vocab_size 0 = the tokenizer's size
    tiny_hidden: int  # infra.assets' tiny Llama policy and reward model (colocation part)
    tiny_layers: int
    tiny_positions: int
    prompts: int  # rollout: prompts × samples_per_prompt rows, max_new_tokens each
    samples_per_prompt: int
    max_new_tokens: int
    update_rows: int  # synthetic update batch: rows of prompt_len + response_len tokens
    prompt_len: int
    response_len: int
    micro_batch: int
    timed_updates: int
    threads: int  # resources.threads_per_worker: torch's CPU threads once a worker is built


GPU = Scale(
    device="cuda",
    # Qwen2-0.5B's shape (494M parameters with its padded vocabulary, tied embeddings).
    qwen=(
        ("vocab_size", 151936),
        ("hidden_size", 896),
        ("intermediate_size", 4864),
        ("num_hidden_layers", 24),
        ("num_attention_heads", 14),
        ("num_key_value_heads", 2),
    ),
    tiny_hidden=1024,
    tiny_layers=12,
    tiny_positions=256,
    prompts=16,
    samples_per_prompt=4,
    max_new_tokens=128,
    update_rows=32,
    prompt_len=256,
    response_len=768,
    micro_batch=8,
    timed_updates=3,
    threads=8,
)
CPU = Scale(
    device="cpu",
    qwen=(
        ("vocab_size", 0),
        ("hidden_size", 64),
        ("intermediate_size", 128),
        ("num_hidden_layers", 2),
        ("num_attention_heads", 2),  # head dim 32: vLLM's CPU attention has no kernel for 16
        ("num_key_value_heads", 1),
    ),
    tiny_hidden=64,
    tiny_layers=2,
    tiny_positions=64,
    prompts=2,
    samples_per_prompt=2,
    max_new_tokens=8,
    update_rows=4,
    prompt_len=8,
    response_len=8,
    micro_batch=2,
    timed_updates=1,
    threads=1,
)


# ----------------------------------------------------------------------------- assets
def build_byte_tokenizer(out: Path) -> Any:
    """A byte-level tokenizer (256 byte tokens, no merges) with Qwen's chat markers, saved to
    ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        extra_special_tokens=["<|im_start|>"],
        padding_side="right",
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer.save_pretrained(out)
    return tokenizer


def build_qwen2(root: Path, scale: Scale) -> Path:
    """A Qwen2 causal LM of ``scale.qwen``'s shape, random init (seed 0), saved with
    ``save_pretrained`` beside its tokenizer; returns the folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = root / "qwen2"
    tokenizer = build_byte_tokenizer(out)
    shape = dict(scale.qwen)
    shape["vocab_size"] = shape["vocab_size"] or len(tokenizer)
    config = Qwen2Config(
        **shape,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    return out


@functools.cache
def qwen_path(root: Path, scale: Scale) -> Path:
    return build_qwen2(root, scale)


@functools.cache
def tiny_assets(root: Path, scale: Scale) -> Any:
    from infra.assets import TinyModelSpec, build_tiny_assets

    spec = TinyModelSpec(
        hidden_size=scale.tiny_hidden,
        num_layers=scale.tiny_layers,
        num_heads=8,
        intermediate_size=4 * scale.tiny_hidden,
        max_positions=scale.tiny_positions,
    )
    return build_tiny_assets(root / "tiny", seed=0, policy=spec, reward=spec)


# ----------------------------------------------------------------------------- workers
_STORES = iter(range(10**6))


def make_config(scale: Scale, dtype: str, rows: int, *extra: str) -> Any:
    from infra.config import load_config

    return load_config(
        None,
        [
            f"resources.device={scale.device}",
            f"resources.threads_per_worker={scale.threads}",
            f"models.dtype={dtype}",
            f"actor.mini_batch_size={rows}",
            f"actor.micro_batch_size={min(scale.micro_batch, rows)}",
            *extra,
        ],
    )


def make_worker(cfg: Any, roles: tuple[str, ...], policy: Path, reward: Path | None = None) -> Any:
    """A ``ModelWorker`` holding ``roles`` (each registered asleep in its ``ColocatedGroup``)."""
    from infra.workers import ModelWorker, WorkerSpec

    spec = WorkerSpec(
        roles=roles,  # type: ignore[arg-type]
        cfg=cfg,
        policy_path=str(policy),
        tokenizer_path=str(policy),
        reward_model_path=None if reward is None else str(reward),
        store_url=f"memory://gpu-device-{next(_STORES)}",
    )
    return ModelWorker(spec)


def release(*workers: Any) -> None:
    """Close the workers' stores and give their device memory back."""
    for worker in workers:
        worker.store.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def actor_settings(cfg: Any) -> Any:
    """One worker's ``ActorUpdateSettings`` from ``cfg``, as the update stage builds them."""
    from tasks.update.settings import actor_settings as settings

    return settings(cfg, 1)


def update(worker: Any, batch: Any, **tensors: torch.Tensor | None) -> dict[str, float]:
    """One ``actor_update`` of the worker's actor on ``batch`` (its turn in the group)."""
    from infra.training import gradient_sync
    from tasks.update.optimize import actor_update

    with worker.awake("actor") as actor:
        metrics: dict[str, float] = actor_update(
            model=actor.module,
            optimizer=actor.optimizer,
            scheduler=actor.scheduler,
            batch=batch,
            old_logprobs=tensors.get("old_logprobs"),
            advantages=tensors["advantages"],  # type: ignore[arg-type]
            rollout_logprobs=tensors.get("rollout_logprobs"),
            cfg=actor_settings(worker.cfg),
            grad_sync=functools.partial(gradient_sync, actor.module),
        )
    worker.publish_policy()
    return metrics


@torch.no_grad()
def trainer_logprobs(worker: Any, batch: Any) -> torch.Tensor:
    """The actor's log-probs (B, T) of the batch's response tokens at the rollout temperature,
    in runs of ``actor.micro_batch_size`` rows (``tasks.logprobs.stage.response_logprobs``)."""
    from tasks.batching import gather_response_logprobs

    micro, temperature = worker.cfg.actor.micro_batch_size, worker.cfg.rollout.temperature or 1.0
    parts = []
    with worker.awake("actor") as actor:
        for start in range(0, batch.batch_size, micro):
            mb = batch.slice(start, start + micro)
            logits = actor.module(
                input_ids=mb.input_ids.to(worker.device),
                attention_mask=mb.attention_mask.long().to(worker.device),
            ).logits  # (b, L, V)
            logprobs = gather_response_logprobs(logits=logits, batch=mb, temperature=temperature)
            parts.append(logprobs.float().cpu())
    return torch.cat(parts)  # (B, T)


def padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)  # (B, T)
    for index, row in enumerate(rows):
        out[index, : row.numel()] = row.float()
    return out


def chat_prompts(tokenizer: Any, count: int) -> tuple[list[torch.Tensor], list[Any]]:
    raw = [[{"role": "user", "content": f"{17 * i % 100}+{31 * i % 100}="}] for i in range(count)]
    ids = [
        torch.tensor(
            tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False)
        )
        for m in raw
    ]
    return ids, raw


def synthetic_batch(scale: Scale, vocab: int, pad_id: int, seed: int = 0) -> tuple[Any, Any]:
    """``update_rows`` rows of random tokens (prompt_len + response_len) and (B, T) advantages."""
    from tasks.batching import pack_batch

    gen = torch.Generator().manual_seed(seed)
    rows = scale.update_rows
    prompts = [torch.randint(0, vocab, (scale.prompt_len,), generator=gen) for _ in range(rows)]
    responses = [torch.randint(0, vocab, (scale.response_len,), generator=gen) for _ in range(rows)]
    batch = pack_batch(prompt_ids=prompts, response_ids=responses, pad_id=pad_id)
    advantages = torch.randn(rows, 1, generator=gen).expand(rows, scale.response_len).clone()
    return batch, advantages  # advantages (B, T): one per row, as an outcome reward gives


@contextmanager
def peak_gib(device: str) -> Iterator[dict[str, float | None]]:
    """``{"gib": ...}`` after the block: the most CUDA memory allocated during it above what was
    allocated at its start (None on the CPU)."""
    out: dict[str, float | None] = {"gib": None}
    if device != "cuda":
        yield out
        return
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    yield out
    torch.cuda.synchronize()
    out["gib"] = (torch.cuda.max_memory_allocated() - base) / GiB


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- parts
def engine_gap(
    scale: Scale, policy: Path, batch: Any, behaviour: torch.Tensor, engine_cfg: Any, dtype: str
) -> dict[str, Any]:
    """The trainer in ``dtype`` scores ``batch``; its gap to the engine's log-probs
    ``behaviour`` (B, T) with the correction a run with ``engine_cfg`` resolves."""
    from tasks.update.correction import rollout_correction, rollout_gap

    trainer = make_worker(make_config(scale, dtype, batch.batch_size), ("actor",), policy)
    old = trainer_logprobs(trainer, batch)  # (B, T)
    settings = actor_settings(trainer.cfg)
    release(trainer)
    mode = actor_settings(engine_cfg).rollout_correction  # as the run would resolve it
    correction = rollout_correction(
        old_logprobs=old,
        rollout_logprobs=behaviour,
        response_mask=batch.response_mask,
        mode=mode,
        cap=settings.correction_cap,
        low=settings.correction_low,
        high=settings.correction_high,
    )
    gap = rollout_gap(
        old_logprobs=old,
        rollout_logprobs=behaviour,
        response_mask=batch.response_mask,
        correction=correction,
    )
    return {"mode": mode, **gap.metrics()}


def part_rollout_gap(scale: Scale, root: Path) -> dict[str, Any]:
    """1. The train–inference gap: engine samples vs the trainer's log-probs of them."""
    from tasks.batching import pack_batch

    policy = qwen_path(root, scale)
    rows = scale.prompts * scale.samples_per_prompt

    def sample_and_score(engine_dtype: str, trainer_dtypes: tuple[str, ...]) -> dict[str, Any]:
        cfg = make_config(scale, engine_dtype, rows)
        worker = make_worker(cfg, ("rollout",), policy)
        prompts, _ = chat_prompts(worker.tokenizer, scale.prompts)
        with worker.awake("rollout") as engine:  # no min_new_tokens: its log-probs omit EOS
            out = engine.generate(
                prompts, n=scale.samples_per_prompt, max_new_tokens=scale.max_new_tokens, seed=1
            )
        pad_id = worker.pad_id
        release(worker)
        repeated = [p for p in prompts for _ in range(scale.samples_per_prompt)]
        batch = pack_batch(prompt_ids=repeated, response_ids=out.response_ids, pad_id=pad_id)
        behaviour = padded(out.rollout_logprobs, batch.response_mask.shape[1])  # (B, T)
        gaps = {
            f"engine_{engine_dtype}_vs_trainer_{dtype}": engine_gap(
                scale, policy, batch, behaviour, cfg, dtype
            )
            for dtype in trainer_dtypes
        }
        gaps["tokens"] = int(batch.response_mask.sum())
        return gaps

    bf16 = sample_and_score("bfloat16", ("bfloat16", "float32"))
    fp32 = sample_and_score("float32", ("float32",))
    return {"tokens": bf16.pop("tokens") + fp32.pop("tokens"), **bf16, **fp32}


def part_colocation(scale: Scale, root: Path) -> dict[str, Any]:
    """2. One worker holding rollout + reward + actor: peak of a cycle vs the parts alone."""
    from tasks.batching import pack_batch

    assets = tiny_assets(root, scale)
    rows = scale.prompts * scale.samples_per_prompt
    cfg = make_config(scale, "bfloat16", rows, f"rollout.max_new_tokens={scale.max_new_tokens}")

    def generate(worker: Any, prompts: list[torch.Tensor]) -> Any:
        with worker.awake("rollout") as engine:
            return engine.generate(
                prompts,
                n=scale.samples_per_prompt,
                max_new_tokens=scale.max_new_tokens,
                min_new_tokens=scale.max_new_tokens,
                seed=0,
            )

    def score(worker: Any, prompts: list[torch.Tensor], raw: list[Any], out: Any) -> None:
        n = scale.samples_per_prompt
        with worker.awake("reward") as scorer:
            scorer.score(
                prompt_ids=[p for p in prompts for _ in range(n)],
                response_ids=out.response_ids,
                raw_prompt=[m for m in raw for _ in range(n)],
            )

    def train(worker: Any, prompts: list[torch.Tensor], out: Any) -> None:
        repeated = [p for p in prompts for _ in range(scale.samples_per_prompt)]
        batch = pack_batch(prompt_ids=repeated, response_ids=out.response_ids, pad_id=worker.pad_id)
        width = batch.response_mask.shape[1]
        advantages = torch.linspace(-1, 1, rows).unsqueeze(1).expand(rows, width).clone()
        update(
            worker,
            batch,
            advantages=advantages,
            rollout_logprobs=padded(out.rollout_logprobs, width),
        )

    def measure(roles: tuple[str, ...], given: Any | None) -> tuple[dict[str, Any], Any]:
        worker = make_worker(cfg, roles, assets.policy, assets.reward_model)
        prompts, raw = chat_prompts(worker.tokenizer, scale.prompts)
        out = given
        for _ in range(2):  # the first cycle warms up (kernels, AdamW's lazily built state)
            worker.timing()  # wake/sleep seconds of the measured cycle only
            start = time.perf_counter()
            with peak_gib(scale.device) as peak:
                if "rollout" in roles:
                    out = generate(worker, prompts)
                if "reward" in roles:
                    score(worker, prompts, raw, out)
                if "actor" in roles:
                    train(worker, prompts, out)
            sync(scale.device)
            seconds = time.perf_counter() - start
        result = {"peak_gib": peak["gib"], "seconds": seconds, **worker.timing()}
        release(worker)
        return result, out

    colocated, out = measure(("rollout", "reward", "actor"), None)
    alone = {role: measure((role,), out)[0] for role in ("rollout", "reward", "actor")}
    peaks = [a["peak_gib"] for a in alone.values()]
    known = None not in peaks and colocated["peak_gib"] is not None
    parts_sum = sum(peaks) if known else None  # type: ignore[arg-type]
    return {
        "colocated": colocated,
        "alone": alone,
        "sum_of_parts_gib": parts_sum,
        "largest_part_gib": max(peaks) if known else None,  # type: ignore[type-var]
        "colocated_over_sum": colocated["peak_gib"] / parts_sum if known and parts_sum else None,
    }


def part_throughput(scale: Scale, root: Path) -> dict[str, Any]:
    """3. One bfloat16 update of the Qwen2 model: tokens/s and MFU."""
    policy = qwen_path(root, scale)
    cfg = make_config(
        scale, "bfloat16", scale.update_rows, "algorithm.rollout_correction.mode=none"
    )
    worker = make_worker(cfg, ("actor",), policy)
    with worker.awake("actor") as actor:
        params = sum(p.numel() for p in actor.module.parameters())
        vocab = int(actor.module.config.vocab_size)
    batch, advantages = synthetic_batch(scale, vocab, worker.pad_id)
    tokens = int(batch.attention_mask.sum())
    update(worker, batch, advantages=advantages)  # warm-up
    seconds = []
    with peak_gib(scale.device) as peak:
        for _ in range(scale.timed_updates):
            sync(scale.device)
            start = time.perf_counter()
            update(worker, batch, advantages=advantages)
            sync(scale.device)
            seconds.append(time.perf_counter() - start)
    release(worker)
    best = min(seconds)
    flops = 6 * params * tokens / best
    return {
        "parameters": params,
        "tokens_per_update": tokens,
        "update_s": best,
        "tokens_per_s": tokens / best,
        "model_tflops_per_s": flops / 1e12,
        "peak_bf16_tflops": H200_BF16_PEAK_FLOPS / 1e12,
        "mfu": flops / H200_BF16_PEAK_FLOPS if scale.device == "cuda" else None,
        "peak_gib": peak["gib"],
        "note": "MFU = 6*parameters*tokens/s / peak; update includes wake/sleep of the actor",
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def part_fsdp2(scale: Scale, root: Path) -> dict[str, Any]:
    """4. FSDP2 on one rank vs the plain module: one update's loss, entropy and grad norm."""
    import torch.distributed as dist

    policy = qwen_path(root, scale)
    keys = ("actor/pg_loss", "actor/entropy", "actor/grad_norm")
    result: dict[str, Any] = {"backend": "nccl" if scale.device == "cuda" else "gloo"}
    for dtype in ("float32", "bfloat16"):
        extra = ("algorithm.rollout_correction.mode=none",)
        plain = make_worker(
            make_config(scale, dtype, scale.update_rows, *extra), ("actor",), policy
        )
        batch, advantages = synthetic_batch(scale, plain.tokenizer.vocab_size, plain.pad_id, 1)
        # π_old a little off the current policy, so the clipped loss depends on the model.
        noise = 0.1 * torch.randn(
            batch.response_mask.shape, generator=torch.Generator().manual_seed(2)
        )
        old = (trainer_logprobs(plain, batch) + noise) * batch.response_mask
        tensors = {"old_logprobs": old, "advantages": advantages}
        reference = update(plain, batch, **tensors)
        release(plain)
        cfg = make_config(scale, dtype, scale.update_rows, *extra, "actor.strategy=fsdp2")
        sharded = make_worker(cfg, ("actor",), policy)
        sharded.join_group(f"127.0.0.1:{free_port()}")  # init_process_group, then builds the actor
        try:
            got = update(sharded, batch, **tensors)
        finally:
            release(sharded)
            dist.destroy_process_group()
        rel = {k: abs(got[k] - reference[k]) / max(abs(reference[k]), 1e-12) for k in keys}
        result[dtype] = {
            "plain": {k: reference[k] for k in keys},
            "fsdp2": {k: got[k] for k in keys},
            "max_rel_diff": max(rel.values()),
            "rtol": FSDP_RTOL[dtype],
            "match": max(rel.values()) <= FSDP_RTOL[dtype],
        }
    if not all(result[d]["match"] for d in FSDP_RTOL):
        raise AssertionError(
            "FSDP2 and the plain module disagree beyond FSDP_RTOL: "
            + ", ".join(f"{d} {result[d]['max_rel_diff']:.2e}" for d in FSDP_RTOL)
        )
    return result


def part_lora(scale: Scale, root: Path) -> dict[str, Any]:
    """5. LoRA vs full fine-tuning: trainable parameters and one update's peak memory."""
    policy = qwen_path(root, scale)
    result: dict[str, Any] = {}
    for name, extra in (("full", ()), ("lora", ("actor.lora={rank: 8}",))):
        cfg = make_config(
            scale, "bfloat16", scale.update_rows, "algorithm.rollout_correction.mode=none", *extra
        )
        with peak_gib(scale.device) as peak:  # building included: AdamW's state is in the peak
            worker = make_worker(cfg, ("actor",), policy)
            with worker.awake("actor") as actor:
                params = list(actor.module.parameters())
            batch, advantages = synthetic_batch(scale, worker.tokenizer.vocab_size, worker.pad_id)
            start = time.perf_counter()
            metrics = update(worker, batch, advantages=advantages)
            sync(scale.device)
            seconds = time.perf_counter() - start
        release(worker)
        result[name] = {
            "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
            "parameters": sum(p.numel() for p in params),
            "peak_gib": peak["gib"],
            "update_s": seconds,
            "pg_loss": metrics["actor/pg_loss"],
        }
    full, lora = result["full"], result["lora"]
    result["trainable_ratio"] = lora["trainable_parameters"] / full["trainable_parameters"]
    if full["peak_gib"] and lora["peak_gib"] is not None:
        result["peak_ratio"] = lora["peak_gib"] / full["peak_gib"]
    return result


def part_vllm(scale: Scale, root: Path) -> dict[str, Any]:
    """6. The vLLM engine beside the trainer: probe, sleep/wake, sync, broken sync, greedy."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed (make venv-vllm, or the vllm extra on CUDA)"}
    from infra.engines.probe import WeightSyncError
    from tasks.batching import pack_batch

    policy = qwen_path(root, scale)
    rows = scale.prompts * scale.samples_per_prompt
    out: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        cfg = make_config(scale, dtype, rows, "rollout.engine=vllm", "rollout.cpu_kv_cache_gib=1")
        worker = make_worker(cfg, ("rollout", "actor"), policy)
        prompts, _ = chat_prompts(worker.tokenizer, scale.prompts)
        with worker.awake("rollout") as engine:  # the first wake checks the loaded weights
            greedy = engine.generate(prompts, n=1, max_new_tokens=16, temperature=0.0, seed=0)
            sampled = engine.generate(
                prompts, n=scale.samples_per_prompt, max_new_tokens=scale.max_new_tokens, seed=1
            )
        first = worker.pop_sync_stats()
        with worker.awake("actor") as actor:  # a visible change: one optimizer-free nudge
            with torch.no_grad():
                for param in actor.module.parameters():
                    param.mul_(1.01)
            probe = worker.trainer_probe(actor.module)
        worker.publish_policy(probe)
        with worker.awake("rollout"):
            pass
        synced = worker.pop_sync_stats()
        worker.corrupt_next_sync = True
        worker.publish_policy(probe)
        try:
            with worker.awake("rollout"):
                pass
            caught = None
        except WeightSyncError as error:
            caught = str(error)
        batch = pack_batch(
            prompt_ids=[p for p in prompts for _ in range(scale.samples_per_prompt)],
            response_ids=sampled.response_ids,
            pad_id=worker.pad_id,
        )
        release(worker)
        behaviour = padded(sampled.rollout_logprobs, batch.response_mask.shape[1])  # (B, T)
        gap = engine_gap(scale, policy, batch, behaviour, cfg, "float32")
        hf_cfg = make_config(scale, dtype, rows)
        hf = make_worker(hf_cfg, ("rollout",), policy)
        with hf.awake("rollout") as engine:
            reference = engine.generate(prompts, n=1, max_new_tokens=16, temperature=0.0, seed=0)
        release(hf)
        agree = [
            a.tolist() == b.tolist() for a, b in zip(greedy.response_ids, reference.response_ids)
        ]
        out[dtype] = {
            "initial_probe_max_abs_diff": first.get("sync/probe_max_abs_diff"),
            "synced_probe_max_abs_diff": synced.get("sync/probe_max_abs_diff"),
            "sync_seconds": synced.get("sync/seconds"),
            "sync_bytes": synced.get("sync/bytes"),
            "tolerance": cfg.sync_tolerance,
            "broken_sync_caught": caught,
            "greedy_agreement_with_hf": sum(agree) / len(agree),
            "gap_vs_float32_trainer": gap,
        }
    return out


PARTS: dict[str, Callable[[Scale, Path], dict[str, Any]]] = {
    "rollout_gap": part_rollout_gap,
    "colocation": part_colocation,
    "throughput": part_throughput,
    "fsdp2": part_fsdp2,
    "lora": part_lora,
    "vllm": part_vllm,
}


# ----------------------------------------------------------------------------- report
def headline(name: str, r: dict[str, Any]) -> str:
    """One line of a part's main numbers for the table."""

    def f(value: Any, spec: str = ".3g") -> str:
        return "null" if value is None else format(value, spec)

    if name == "rollout_gap":
        gap = r["engine_bfloat16_vs_trainer_bfloat16"]
        base = r["engine_float32_vs_trainer_float32"]
        return (
            f"bf16: kl_k1={f(gap['rollout_corr/kl_k1'])} kl_k3={f(gap['rollout_corr/kl_k3'])} "
            f"ppl_ratio={f(gap['rollout_corr/ppl_ratio'], '.5f')} "
            f"is_w mean={f(gap['rollout_corr/is_weight_mean'], '.4f')} "
            f"max={f(gap['rollout_corr/is_weight_max'], '.3f')}; "
            f"fp32 baseline kl_k3={f(base['rollout_corr/kl_k3'])}"
        )
    if name == "colocation":
        return (
            f"colocated peak={f(r['colocated']['peak_gib'])} GiB, "
            f"sum of parts={f(r['sum_of_parts_gib'])} GiB, largest={f(r['largest_part_gib'])} "
            f"GiB, ratio={f(r['colocated_over_sum'])}"
        )
    if name == "throughput":
        return (
            f"{r['parameters'] / 1e6:.1f}M params, {r['tokens_per_s']:.0f} tok/s, "
            f"{r['model_tflops_per_s']:.3g} TFLOP/s, MFU={f(r['mfu'])} "
            f"(peak {r['peak_bf16_tflops']:.0f} TFLOP/s)"
        )
    if name == "fsdp2":
        return (
            ", ".join(
                f"{d}: rel diff {r[d]['max_rel_diff']:.1e} (rtol {r[d]['rtol']:.0e})"
                for d in FSDP_RTOL
            )
            + f" over {r['backend']}"
        )
    if name == "vllm":
        if "skipped" in r:
            return f"skipped: {r['skipped']}"
        return "; ".join(
            f"{d}: probe {f(v['synced_probe_max_abs_diff'])} (tol {f(v['tolerance'])}), broken "
            f"sync {'caught' if v['broken_sync_caught'] else 'MISSED'}, greedy = hf "
            f"{v['greedy_agreement_with_hf']:.2f}, kl_k3 {f(v['gap_vs_float32_trainer']['rollout_corr/kl_k3'])}"
            for d, v in r.items()
            if isinstance(v, dict)
        )
    if name == "lora":
        return (
            f"trainable {r['lora']['trainable_parameters']:,} vs {r['full']['trainable_parameters']:,}"
            f" ({r['trainable_ratio']:.2%}); peak {f(r['lora']['peak_gib'])} vs "
            f"{f(r['full']['peak_gib'])} GiB"
        )
    return ""


def run_part(name: str, scale: Scale, root: Path) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        result = {"ok": True, "error": None, **PARTS[name](scale, root)}
    except Exception as exc:  # noqa: BLE001 - recorded; the other parts still run
        traceback.print_exc()
        line = f"{type(exc).__name__}: {exc}".splitlines()[0]
        result = {"ok": False, "error": line}
    result["seconds"] = time.perf_counter() - start
    release()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--cpu-dry-run", action="store_true", help="every part on the CPU, tiny")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(
            "gpu_check_device: no CUDA device is present; nothing run (--cpu-dry-run runs on CPU)"
        )
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    scale = CPU if args.cpu_dry_run else GPU
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-device-") as tmp:
        parts = {name: run_part(name, scale, Path(tmp)) for name in PARTS}
    report = {
        "device": torch.cuda.get_device_name(0) if scale.device == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "scale": asdict(scale),
        "peak_bf16_flops": H200_BF16_PEAK_FLOPS,
        "seconds": time.perf_counter() - start,
        "parts": parts,
    }
    print(f"\n{'part':<12} {'ok':<4} {'s':>6}  result")
    for name, r in parts.items():
        line = headline(name, r) if r["ok"] else r["error"]
        print(f"{name:<12} {'yes' if r['ok'] else 'NO':<4} {r['seconds']:>6.1f}  {line}")
    print(f"total {report['seconds']:.1f} s on {report['device']}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {args.output}")
    return 0 if all(r["ok"] for r in parts.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
