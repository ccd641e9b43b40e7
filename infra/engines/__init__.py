"""Rollout engines: one ``GenerationEngine`` interface, a transformers and a vLLM backend.

``make_engine("hf", path)`` works everywhere (CPU or GPU); ``make_engine("vllm", path)`` needs
vLLM on a CUDA machine and says so when it is missing. Backends are imported on demand, so
importing this package never imports vLLM. ``engine_options(cfg.rollout)`` gives the keywords a
run's config adds for its engine kind (vLLM's memory share, tensor parallelism, length cap).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from infra.engines.base import (
    EngineAsleepError,
    GenerationEngine,
    GenerationOutput,
    Sleepable,
)
from infra.engines.vllm_engine import VLLMUnavailableError, is_vllm_available

if TYPE_CHECKING:
    from infra.config import RolloutConfig

__all__ = [
    "EngineAsleepError",
    "GenerationEngine",
    "GenerationOutput",
    "Sleepable",
    "VLLMUnavailableError",
    "engine_options",
    "is_vllm_available",
    "make_engine",
]

EngineKind = Literal["hf", "vllm"]


def engine_options(rollout: RolloutConfig) -> dict[str, Any]:
    """The keywords ``rollout`` (a run's ``rollout`` section) adds to ``make_engine`` for its
    engine kind: for vLLM ``gpu_memory_utilization``, ``tensor_parallel_size`` and
    ``max_model_len``; nothing for the transformers engine."""
    if rollout.engine != "vllm":
        return {}
    return {
        "gpu_memory_utilization": rollout.gpu_memory_utilization,
        "tensor_parallel_size": rollout.tensor_parallel_size,
        "max_model_len": rollout.max_model_len,
    }


def make_engine(kind: EngineKind, model_path: str | Path, **kw: Any) -> GenerationEngine:
    """Build the rollout engine ``kind`` for the model at ``model_path``.

    ``kw`` goes to the backend: ``TransformersEngine(device=, dtype=, eos_token_id=,
    pad_token_id=)`` or ``VLLMEngine(dtype=, gpu_memory_utilization=, tensor_parallel_size=,
    max_model_len=, ...)``.
    Raises VLLMUnavailableError for ``"vllm"`` without vLLM, ValueError for an unknown kind.
    """
    if kind == "hf":
        from infra.engines.hf import TransformersEngine

        return TransformersEngine(model_path, **kw)
    if kind == "vllm":
        if not is_vllm_available():
            raise VLLMUnavailableError(
                "engine kind 'vllm' needs vLLM, which is not installed: install the 'gpu' extra "
                "(pip install 'ppoflow[gpu]') on a CUDA machine, or set the engine kind to 'hf'"
            )
        from infra.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, **kw)
    raise ValueError(f"unknown engine kind {kind!r}; expected 'hf' or 'vllm'")
