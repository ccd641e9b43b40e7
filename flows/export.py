"""``ppoflow export RUN_DIR [--step N] --out DIR [--adapter-only]``: the policy of a checkpoint
as one ``save_pretrained`` folder.

The weights are consolidated from the checkpoint's sharded actor state (``workers/dcp/actor``,
written by any number of workers) into the model described by the checkpoint's actor folder
(``workers/actor/config.json``), cast to that folder's dtype, and saved with the policy's
tokenizer (chat template included) and generation config: a folder transformers and vLLM load.
A LoRA policy (``workers/actor-adapter/`` present) is exported with its adapter merged, or with
``adapter_only`` as the adapter alone (``adapter_config.json`` + ``adapter_model.safetensors``,
for ``peft.PeftModel.from_pretrained`` over the base policy).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from flows.checkpoint import checkpoint_dir, latest_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["ExportError", "export_policy"]


class ExportError(ValueError):
    """The run, step or output folder asked for cannot be exported; the message says which."""


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    if not run_dir.is_dir():
        raise ExportError(f"run directory {run_dir} does not exist: pass the run_dir of a run")
    if step is None:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise ExportError(f"{run_dir} has no complete checkpoint: train until one is written")
        return found
    path = checkpoint_dir(run_dir, step)
    if not (path / "state.json").exists():
        steps = sorted(
            int(p.name.split("-")[1])
            for p in (run_dir / "checkpoints").glob("step-*")
            if (p / "state.json").exists()
        )
        raise ExportError(f"{run_dir} has no checkpoint of step {step}; --step is one of {steps}")
    return path


def _skeleton(actor_dir: Path, adapter_dir: Path | None) -> PreTrainedModel:
    """The trained module's shape, empty-initialised: the policy model (wrapped with its LoRA
    adapter when the run had one), float32 like the sharded state."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(actor_dir)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, dtype=torch.float32
    )
    if adapter_dir is None:
        return model
    from peft import PeftConfig, get_peft_model

    peft_model: PreTrainedModel = get_peft_model(
        model, PeftConfig.from_pretrained(str(adapter_dir))
    )
    return peft_model


def export_policy(
    run_dir: Path, *, out: Path, step: int | None = None, adapter_only: bool = False
) -> Path:
    """Write the policy of ``run_dir``'s checkpoint ``step`` (None = the latest) to ``out``;
    returns ``out``."""
    from transformers import AutoTokenizer

    from infra.lora import merged_model, save_adapter
    from infra.training import load_sharded

    ckpt = _checkpoint(run_dir, step)
    workers = ckpt / "workers"
    actor_dir, sharded = workers / "actor", workers / "dcp" / "actor"
    adapter_dir = workers / "actor-adapter"
    if not (actor_dir / "config.json").exists() or not sharded.is_dir():
        raise ExportError(f"{ckpt} holds no actor state (workers/actor, workers/dcp/actor)")
    lora = adapter_dir.is_dir()
    if adapter_only and not lora:
        raise ExportError(
            f"{ckpt} is of a run without LoRA (no workers/actor-adapter): drop --adapter-only"
        )
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out} is not empty: pass a new or empty folder")
    model = _skeleton(actor_dir, adapter_dir if lora else None)
    load_sharded(sharded, model, None)
    out.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        save_adapter(model, out)
        return out
    plain = cast("PreTrainedModel", merged_model(model)) if lora else model
    plain.to(_folder_dtype(actor_dir))
    plain.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(actor_dir).save_pretrained(out)
    generation = actor_dir / "generation_config.json"
    if generation.exists():
        shutil.copy(generation, out / "generation_config.json")
    return out


def _folder_dtype(actor_dir: Path) -> Any:
    """The dtype the checkpoint's actor folder was saved in (``models.dtype``)."""
    import json

    import torch

    config = json.loads((actor_dir / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, str(name))
