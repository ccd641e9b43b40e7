"""The generation-engine contract shared by every rollout backend, plus device-offload helpers.

A rollout engine turns prompts (token ids) into sampled responses with the log-probabilities the
sampler used. Engines share their devices with the reward model and the trainer, so each one can
``sleep()`` (release device memory, keep the weights on the CPU) and ``wake_up()`` (bring the very
same weights back). ``infra.colocate.ColocatedGroup`` drives these turns.

Output layout (``GenerationOutput``)::

    prompts p0, p1 with n=2  ->  rows [p0 s0, p0 s1, p1 s0, p1 s1]   (prompt-major)
    response_ids[i]      (T_i,) int64    ends with EOS when EOS was emitted, nothing after it
    rollout_logprobs[i]  (T_i,) float32  log p(token) under softmax(logits / temperature)

The logprobs are those of the *tempered* distribution without top-p renormalisation: top-p only
decides which tokens may be drawn. With temperature 0 (greedy) they are taken at temperature 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

__all__ = [
    "EngineAsleepError",
    "GenerationEngine",
    "GenerationOutput",
    "ModuleResidency",
    "Sleepable",
    "check_generate_args",
    "eos_ids",
    "offload_module",
    "onload_module",
    "pad_id",
]


def eos_ids(*sources: int | Sequence[int] | None) -> tuple[int, ...]:
    """The ids that end a response: every id the sources name (one id, several, or None), in
    order, each once."""
    ids: list[int] = []
    for source in sources:
        for value in [source] if isinstance(source, int) else list(source or ()):
            if int(value) not in ids:
                ids.append(int(value))
    return tuple(ids)


def pad_id(*candidates: int | None, eos: Sequence[int]) -> int:
    """The first candidate that is set, else the first EOS id, else 0: a pad id only fills slots
    that are masked or cut off, so a model without one (Llama-3 style) pads with EOS."""
    for candidate in (*candidates, *eos[:1]):
        if candidate is not None:
            return int(candidate)
    return 0


class EngineAsleepError(RuntimeError):
    """A sleeping engine or scorer was asked to compute; call ``wake_up()`` first."""


class EngineFailedError(RuntimeError):
    """An engine failed in an earlier call and serves no more: the worker that holds it is
    replaced as a dead one is (``infra.group.WorkerGroup.get`` raises ``WorkerDied``)."""


@dataclass(frozen=True)
class GenerationOutput:
    """Sampled responses, prompt-major: prompt ``i`` owns rows ``i*n .. i*n+n-1``.

    ``response_ids[r]`` is 1-D int64 (T_r,), including the EOS token when one was emitted and
    nothing after it; ``rollout_logprobs[r]`` is 1-D float32 of the same length.
    """

    response_ids: list[Tensor]
    rollout_logprobs: list[Tensor]

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.rollout_logprobs):
            raise ValueError(
                f"{len(self.response_ids)} response rows but {len(self.rollout_logprobs)} "
                "logprob rows"
            )
        for row, (ids, logprobs) in enumerate(zip(self.response_ids, self.rollout_logprobs)):
            if ids.shape != logprobs.shape:
                raise ValueError(
                    f"row {row}: response_ids shape {tuple(ids.shape)} != rollout_logprobs "
                    f"shape {tuple(logprobs.shape)}"
                )


@runtime_checkable
class Sleepable(Protocol):
    """Something that can give its device memory back and take it again (both idempotent)."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    @property
    def is_awake(self) -> bool: ...


@runtime_checkable
class GenerationEngine(Sleepable, Protocol):
    """A rollout backend: samples ``n`` responses per prompt and syncs weights from the trainer."""

    def generate(
        self,
        prompt_ids: list[Tensor],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int,
        min_new_tokens: int = 0,
    ) -> GenerationOutput: ...

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None: ...

    def probe_logprobs(self, ids: Tensor) -> Tensor:
        """``log p(ids[t] | ids[:t])`` for t = 1 .. L-1 at temperature 1, ``(L-1,)`` float32 on
        the CPU: the engine's side of the weight-sync probe (``infra.engines.probe``)."""
        ...


def check_generate_args(
    prompt_ids: list[Tensor], *, n: int, max_new_tokens: int, temperature: float, top_p: float
) -> None:
    """Raise ValueError, naming the argument, for inputs no engine can honour."""
    if n < 1:
        raise ValueError(f"n must be >= 1 (samples per prompt), got {n}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    for row, ids in enumerate(prompt_ids):
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(
                f"prompt_ids[{row}] must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}"
            )


class ModuleResidency:
    """Where a module's weights live: on its device while awake, on the CPU while asleep.

    On CUDA, ``sleep()`` moves parameters, gradients and buffers to pinned CPU memory and empties
    the CUDA cache; ``wake_up()`` moves them back (bit-identical). On a CPU device the weights
    never move and only the flag changes. Both calls are idempotent. Engines, the reward scorer
    and trainable models delegate their ``Sleepable`` methods to one of these.
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self.is_awake = True

    @property
    def offloads(self) -> bool:
        """True when sleeping really frees device memory (CUDA devices)."""
        return self.device.type == "cuda"

    def sleep(self) -> None:
        if self.offloads:
            offload_module(self.module, pin_memory=True)
            torch.cuda.empty_cache()
        self.is_awake = False

    def wake_up(self) -> None:
        if self.offloads:
            onload_module(self.module, self.device)
        self.is_awake = True

    def require_awake(self, what: str) -> None:
        """Raise EngineAsleepError naming ``what`` unless awake."""
        if not self.is_awake:
            raise EngineAsleepError(f"{what} called while asleep: call wake_up() first")


def offload_module(module: nn.Module, *, pin_memory: bool) -> None:
    """Move every parameter, gradient and buffer of ``module`` to the CPU, in place.

    Parameter objects are kept (only ``.data`` changes), so optimizers holding them stay valid.
    With ``pin_memory`` the CPU copies are page-locked, which makes the next wake-up faster.
    """
    module.to("cpu")
    if not pin_memory:
        return
    for tensor in _module_tensors(module):
        if not tensor.is_pinned():
            tensor.data = tensor.data.pin_memory()


def onload_module(module: nn.Module, device: torch.device) -> None:
    """Move ``module`` back to ``device``; values are copied bit for bit."""
    module.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _module_tensors(module: nn.Module) -> list[Tensor]:
    tensors: list[Tensor] = []
    for param in module.parameters():
        tensors.append(param)
        if param.grad is not None:
            tensors.append(param.grad)
    tensors.extend(module.buffers())
    return tensors
