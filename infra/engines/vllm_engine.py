"""Rollout with vLLM on CUDA, behind the same ``GenerationEngine`` interface as the HF engine.

vLLM is imported lazily: this module imports (and ``is_vllm_available()`` answers) on machines
without it. The engine uses vLLM's sleep mode so it can share devices with the reward model and
the trainer: ``sleep()`` is ``llm.sleep(level=1)`` (weights offloaded to CPU, KV cache dropped)
and ``wake_up()`` is ``llm.wake_up()``.

Weight sync calls the in-process model's ``load_weights``; for that the engine sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (unless already set) so the model lives in this process.
Weights given while asleep are kept as a CPU copy and loaded during the next ``wake_up()``,
after the weights and before the KV cache are restored.

Logprobs come from ``logprobs_mode="processed_logprobs"`` (temperature applied), which matches
the contract of ``infra.engines.base`` when ``top_p == 1``; vLLM versions whose processed
logprobs include the top-p mask return renormalised logprobs when ``top_p < 1``.

Not exercised in this repository's CPU test tier (vLLM is not installed there); the tests in
``tests/infra/test_vllm_engine.py`` run on a CUDA machine with vLLM.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from infra.engines.base import EngineAsleepError, GenerationOutput, check_generate_args

__all__ = ["VLLMEngine", "VLLMUnavailableError", "is_vllm_available"]


class VLLMUnavailableError(ImportError):
    """vLLM was asked for but is not installed."""


def is_vllm_available() -> bool:
    """True when the ``vllm`` package can be imported (nothing is imported here)."""
    return importlib.util.find_spec("vllm") is not None


class VLLMEngine:
    """A ``GenerationEngine`` over ``vllm.LLM`` with sleep mode enabled.

    ``device`` must be a CUDA device (vLLM places the model itself; the argument exists so both
    engines take the same keywords). ``eos_token_id`` adds stop tokens on top of the model's own
    EOS; ``pad_token_id`` is accepted and unused (vLLM never pads). ``llm_kwargs`` go to
    ``vllm.LLM`` unchanged (e.g. ``max_model_len``, ``enforce_eager``).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | torch.device = "cuda",
        dtype: torch.dtype | str = "auto",
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        if not is_vllm_available():
            raise VLLMUnavailableError(
                "VLLMEngine needs vLLM, which is not installed: install the 'gpu' extra "
                "(pip install 'ppoflow[gpu]') or use the transformers engine (kind='hf')"
            )
        del pad_token_id  # vLLM never pads
        if torch.device(device).type != "cuda":
            raise ValueError(f"VLLMEngine runs on CUDA only, got device={device!r}; use kind='hf'")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        options: dict[str, Any] = {
            "model": str(model_path),
            "dtype": dtype,
            "enable_sleep_mode": True,
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            "seed": seed,
            "logprobs_mode": "processed_logprobs",
        }
        options.update(llm_kwargs)
        self._llm = LLM(**options)
        if eos_token_id is None:
            self._stop_token_ids: list[int] = []
        elif isinstance(eos_token_id, int):
            self._stop_token_ids = [eos_token_id]
        else:
            self._stop_token_ids = [int(e) for e in eos_token_id]
        self._awake = True
        self._pending_weights: dict[str, Tensor] | None = None

    @property
    def is_awake(self) -> bool:
        return self._awake

    def sleep(self) -> None:
        """Offload weights to CPU and drop the KV cache (vLLM sleep level 1). Idempotent."""
        if self._awake:
            self._llm.sleep(level=1)
            self._awake = False

    def wake_up(self) -> None:
        """Restore weights (then any weights synced while asleep) and the KV cache. Idempotent."""
        if self._awake:
            return
        if self._pending_weights is None:
            self._llm.wake_up()
        else:
            self._llm.wake_up(tags=["weights"])
            self._load_now(self._pending_weights)
            self._pending_weights = None
            self._llm.wake_up(tags=["kv_cache"])
        self._awake = True

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Sync the trainer's weights (HF parameter names); deferred to ``wake_up`` if asleep."""
        if self._awake:
            self._load_now(state_dict)
        else:  # copy: the trainer may update its tensors in place before we wake
            self._pending_weights = {
                k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()
            }

    def _load_now(self, state_dict: Mapping[str, Tensor]) -> None:
        _driver_model(self._llm).load_weights(weights=list(state_dict.items()))

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
    ) -> GenerationOutput:
        """Sample ``n`` responses per prompt (prompt-major rows); prompt i uses seed ``seed + i``."""
        if not self._awake:
            raise EngineAsleepError("VLLMEngine.generate() while asleep: call wake_up() first")
        check_generate_args(
            prompt_ids, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p
        )
        if not prompt_ids or max_new_tokens == 0:  # vLLM refuses max_tokens=0
            empty = [torch.zeros(0, dtype=torch.long) for _ in range(len(prompt_ids) * n)]
            return GenerationOutput(empty, [torch.zeros(0, dtype=torch.float32) for _ in empty])
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                min_tokens=min_new_tokens,
                seed=seed + index,
                logprobs=0,
                stop_token_ids=self._stop_token_ids,
            )
            for index in range(len(prompt_ids))
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids.tolist()) for ids in prompt_ids]
        results = self._llm.generate(prompts, params, use_tqdm=False)
        response_ids: list[Tensor] = []
        rollout_logprobs: list[Tensor] = []
        for result in results:  # vLLM returns requests in input order
            for completion in sorted(result.outputs, key=lambda c: c.index):
                tokens = list(completion.token_ids)
                response_ids.append(torch.tensor(tokens, dtype=torch.long))
                rollout_logprobs.append(
                    torch.tensor(
                        [step[token].logprob for token, step in zip(tokens, completion.logprobs)],
                        dtype=torch.float32,
                    )
                )
        return GenerationOutput(response_ids, rollout_logprobs)


def _driver_model(llm: Any) -> Any:
    """The in-process ``nn.Module`` vLLM runs (V1 without multiprocessing, or V0)."""
    executor = llm.llm_engine.model_executor
    worker = getattr(executor, "driver_worker", None)
    for path in (("worker", "model_runner", "model"), ("model_runner", "model")):
        node = worker
        for attribute in path:
            node = getattr(node, attribute, None)
        if node is not None:
            return node
    raise RuntimeError(
        "cannot reach vLLM's in-process model for weight sync; run with "
        "VLLM_ENABLE_V1_MULTIPROCESSING=0 and tensor_parallel_size=1"
    )
