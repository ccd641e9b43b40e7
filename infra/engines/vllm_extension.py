"""Weight sync into vLLM's workers: the extension vLLM mixes into each worker, and its data file.

``VLLMEngine`` builds its ``vllm.LLM`` with ``worker_extension_cls=WORKER_EXTENSION``; vLLM then
adds ``WeightSync`` as a base class of its GPU worker, so ``WeightSync``'s methods run inside
every worker process (one per tensor-parallel rank, in the engine's own process or in vLLM's
worker processes), called by name with ``llm.collective_rpc(LOAD_METHOD, args=(path,))``.

vLLM asks that ``collective_rpc`` carry control messages, not bulk data, so only a file path
travels through it. The weights go through a safetensors file that ``write_weights`` writes once
in the engine's process (under ``/dev/shm`` when it has room, so the file lives in memory) and
that every worker reads memory-mapped, one tensor at a time. Each worker hands the full tensors
to vLLM's in-place reload (the worker's ``reload_weights``: it loads checkpoint-format tensors,
keeps the slice of its own tensor-parallel rank, and redoes the processing vLLM applies after
loading, such as the CPU backend's packed GEMM weights); a worker without it hands them to its
model's ``load_weights``.

Nothing here imports vLLM: the engine's process and the CPU tests import this module without it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["LOAD_METHOD", "WORKER_EXTENSION", "WeightSync", "scratch_dir", "write_weights"]

WORKER_EXTENSION = f"{__name__}.WeightSync"
# The names vLLM's worker gets from the extension; prefixed so none collides with its own.
LOAD_METHOD = "ppoflow_load_weights"

SHARED_MEMORY = Path("/dev/shm")


def scratch_dir(nbytes: int) -> Path:
    """Where a weights file of ``nbytes`` goes: ``/dev/shm`` when it is writable and has twice
    that free (container defaults are often tiny), else the temporary folder."""
    usable = SHARED_MEMORY.is_dir() and os.access(SHARED_MEMORY, os.W_OK)
    if usable and shutil.disk_usage(SHARED_MEMORY).free >= 2 * nbytes:
        return SHARED_MEMORY
    return Path(tempfile.gettempdir())


def _whole_cpu_copy(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    """A contiguous CPU tensor with its own storage (a sharded DTensor is gathered first)."""
    full_tensor = getattr(tensor, "full_tensor", None)
    if callable(full_tensor):  # torch.distributed DTensor: a collective over its mesh
        tensor = full_tensor()
    target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(device="cpu", dtype=target, copy=True).contiguous()


def write_weights(
    state_dict: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
    directory: Path | None = None,
) -> Path:
    """Write ``state_dict`` (HF parameter names) to a new safetensors file and return its path.

    Floating tensors are cast to ``dtype`` when given (the engine's dtype: the file then holds
    what the engine stores). Tied parameters are written once per name, each with its own copy.
    ``directory`` defaults to ``scratch_dir``; the caller deletes the file once loaded.
    """
    tensors = {name: _whole_cpu_copy(value, dtype) for name, value in state_dict.items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    folder = directory if directory is not None else scratch_dir(nbytes)
    handle, name = tempfile.mkstemp(prefix="ppoflow-weights-", suffix=".safetensors", dir=folder)
    os.close(handle)
    path = Path(name)
    try:
        from safetensors.torch import save_file

        save_file(tensors, str(path))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _tensors(path: str) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` pairs of a safetensors file, read one at a time."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as reader:
        for name in reader.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
            yield name, reader.get_tensor(name)


class WeightSync:
    """Mixed into vLLM's worker (``worker_extension_cls``); ``self`` is that worker.

    Uses vLLM's worker method ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``
    where the worker has it, else ``self.model_runner.model.load_weights(weights=...)``: both
    take full HF-named tensors.
    """

    model_runner: Any  # provided by vLLM's worker

    def ppoflow_load_weights(self, path: str) -> int:
        """Load every tensor of the safetensors file at ``path``; returns how many were read."""
        count = 0

        def counted() -> Iterator[tuple[str, Tensor]]:
            nonlocal count
            for item in _tensors(path):
                count += 1
                yield item

        reload = getattr(self, "reload_weights", None)
        if callable(reload):
            reload(weights_iterator=counted(), is_checkpoint_format=True)
        else:
            self.model_runner.model.load_weights(weights=counted())
        return count
