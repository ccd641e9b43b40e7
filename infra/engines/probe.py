"""The weight-sync probe: after a sync the engine and the trainer score one fixed sequence.

A rollout engine that keeps serving old weights after a sync or a wake says nothing by itself:
its samples look like any other. So after every sync the worker that holds the engine asks it
for the log-probabilities of a fixed probe sequence (``probe_ids``) and compares them with the
trainer's for the same tokens (``trainer_probe_logprobs``, computed from the very weights that
were sent). The largest absolute difference is the step's ``sync/probe_max_abs_diff``; above
the tolerance (``rollout.sync_tolerance``, default ``default_sync_tolerance(models.dtype)``)
the step fails with ``WeightSyncError`` before the engine generates anything with them.

Both sides score at temperature 1 (plain ``log_softmax`` of the logits): the probe checks
weights, not sampling settings. A stale engine is caught whenever the update moved the probe's
log-probabilities by more than the tolerance.

Torch only: this module imports neither vLLM nor the store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "PROBE_LENGTH",
    "ProbeExpectation",
    "WeightSyncError",
    "default_sync_tolerance",
    "probe_ids",
    "probe_max_abs_diff",
    "trainer_probe_logprobs",
]

PROBE_LENGTH = 48
_PROBE_SEED = 20_261_204

# Largest |engine - trainer| log-probability difference accepted per engine dtype: a float32
# engine matches the trainer up to kernel rounding. Half-precision engines round every
# activation and logit; on the probe's random, mostly improbable tokens single differences
# spike, more as training sharpens the policy (docs/guides/vllm.md has the measured ones). Their
# bounds catch a gross break (a tensor not loaded or garbled), not an engine one small update
# behind.
_TOLERANCE = {"float32": 1e-3, "float16": 1.0, "bfloat16": 4.0}


class WeightSyncError(RuntimeError):
    """The rollout engine's log-probs of the probe differ from the trainer's after a sync."""


@dataclass(frozen=True)
class ProbeExpectation:
    """What the trainer says the probe's log-probs are under policy ``version`` (``(L-1,)``
    float32: token t given tokens < t, for t = 1 .. L-1)."""

    version: int
    logprobs: Tensor


def default_sync_tolerance(dtype: str) -> float:
    """The default ``rollout.sync_tolerance`` for an engine holding weights in ``dtype``."""
    return _TOLERANCE.get(dtype, _TOLERANCE["bfloat16"])


def probe_ids(vocab_size: int, length: int = PROBE_LENGTH) -> Tensor:
    """The fixed probe: ``length`` token ids drawn with a fixed seed from ``[0, vocab_size)``
    (the same on every worker and every run with that vocabulary)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    generator = torch.Generator().manual_seed(_PROBE_SEED)
    return torch.randint(0, vocab_size, (length,), generator=generator)  # (L,)


@torch.no_grad()
def trainer_probe_logprobs(module: nn.Module, ids: Tensor) -> Tensor:
    """``log p(ids[t] | ids[:t])`` for t = 1 .. L-1 under ``module`` (a causal LM as the
    trainer holds it: sharded, LoRA-wrapped or autocast), float32 on the CPU."""
    device = next(module.parameters()).device
    logits: Tensor = module(input_ids=ids[None].to(device)).logits[0, :-1].float()  # (L-1, V)
    logprobs = logits.log_softmax(-1).gather(-1, ids[1:, None].to(device))[:, 0]  # (L-1,)
    return logprobs.cpu()


def probe_max_abs_diff(engine_logprobs: Tensor, expected: ProbeExpectation) -> float:
    """The largest absolute difference between the engine's and the trainer's probe scores."""
    if engine_logprobs.shape != expected.logprobs.shape:
        raise WeightSyncError(
            f"policy version {expected.version}: the engine scored {tuple(engine_logprobs.shape)} "
            f"probe tokens, the trainer {tuple(expected.logprobs.shape)}"
        )
    return float((engine_logprobs.float() - expected.logprobs.float()).abs().max())
