"""LoRA adapters on the actor, with peft.

``apply_lora`` wraps a transformers causal LM in a peft model whose only trainable parameters
are the adapters. The frozen base weights double as the reference policy: inside
``adapter_disabled(model)`` the model computes as the base model, so no second copy is held.
For the rollout engine and for export the adapter is folded into the base weights:

    model = apply_lora(model, cfg.actor.lora)
    with adapter_disabled(model):
        ref_logits = model(input_ids).logits           # the base (reference) policy
    engine_weights = merged_state_dict(model)          # plain HF keys, W + scale * B @ A
    save_adapter(model, run_dir / "adapter")           # peft folder (PeftModel.from_pretrained)
    merged_model(model).save_pretrained(run_dir / "merged")

``merged_state_dict`` and ``adapter_state_dict`` read the model's tensors through ``full`` (for
FSDP2 DTensors, ``lambda t: t.full_tensor()``), compute the merge on those tensors, and never
write to the model's parameters.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import cast

from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import Embedding as LoraEmbedding
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

from infra.config import LoraConfig

ALL_LINEAR = "all-linear"
# What peft names the adapter's own tensors (lora_A, lora_B, lora_embedding_A, ...).
ADAPTER_KEY_MARK = "lora_"
_SETTING = "actor.lora.target_modules"
_MAX_LISTED_NAMES = 10


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (carries adapters)."""
    return isinstance(model, PeftModel)


def _is_adapter_key(name: str) -> bool:
    return ADAPTER_KEY_MARK in name


def _adaptable_leaf_names(model: nn.Module) -> list[str]:
    """Distinct last name parts of the linear and embedding modules, in model order."""
    names: dict[str, None] = {}
    for name, module in model.named_modules():
        if name and isinstance(module, nn.Linear | nn.Embedding):
            names.setdefault(name.rsplit(".", 1)[-1], None)
    return list(names)


def _check_target_modules(model: nn.Module, target: list[str] | str) -> None:
    """Raise a one-line ``ValueError`` when a target name (or the pattern) matches no module.

    The matching is peft's: a string other than "all-linear" is a regular expression that must
    match a whole module name; a list entry matches a module whose name is the entry or ends in
    ``.entry``.
    """
    module_names = [name for name, _ in model.named_modules() if name]
    if isinstance(target, str):
        if target.lower() == ALL_LINEAR:
            return
        missing = [] if any(re.fullmatch(target, name) for name in module_names) else [target]
    else:
        missing = [
            entry
            for entry in target
            if not any(name == entry or name.endswith(f".{entry}") for name in module_names)
        ]
    if not missing:
        return
    known = _adaptable_leaf_names(model)
    listed = ", ".join(known[:_MAX_LISTED_NAMES]) + (
        ", ..." if len(known) > _MAX_LISTED_NAMES else ""
    )
    raise ValueError(
        f"{_SETTING}: {', '.join(repr(m) for m in missing)} matches no module of "
        f"{type(model).__name__}; its linear/embedding modules include: {listed} "
        f"(or use '{ALL_LINEAR}')"
    )


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap a transformers causal LM with LoRA adapters; only the adapters require grad.

    peft injects the adapter layers into ``model`` itself (its linear modules are replaced), so
    the returned peft model shares — and owns — ``model``'s base weights. "all-linear" is every
    linear layer except the output head.
    """
    if is_lora(model):
        raise ValueError(f"{type(model).__name__} already carries LoRA adapters")
    target = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    _check_target_modules(model, target)
    peft_model = get_peft_model(
        model,
        PeftLoraConfig(
            r=cfg.rank,
            lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # peft scales by alpha / r in float
            lora_dropout=cfg.dropout,
            target_modules=target,
            task_type="CAUSAL_LM",
        ),
    )
    for name, parameter in peft_model.named_parameters():
        parameter.requires_grad_(_is_adapter_key(name))
    return peft_model


@contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[None]:
    """A context in which ``model`` computes as its base model; a no-op for a non-LoRA model."""
    with cast(PeftModel, model).disable_adapter() if is_lora(model) else nullcontext():
        yield


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft model (``model`` itself when it is not one)."""
    return cast(PeftModel, model).get_base_model() if is_lora(model) else model


def _lora_layer_of(key: str, layers: dict[str, LoraLayer]) -> str | None:
    """The name of the LoRA layer a state-dict key belongs to, if any (its longest prefix)."""
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in layers:
            return prefix
    return None


def _delta(
    layer: LoraLayer,
    name: str,
    adapter: str,
    state: dict[str, Tensor],
    full: Callable[[Tensor], Tensor],
) -> Tensor:
    """``scale * B @ A`` of one adapter of the LoRA layer ``name``, in float32, shaped as its
    base weight; A and B are read from ``state`` (the base model's ``state_dict``)."""
    if getattr(layer, "lora_variant", {}).get(adapter) is not None or getattr(
        layer, "use_dora", {}
    ).get(adapter, False):
        raise NotImplementedError(f"merging a LoRA variant (DoRA, ...) of {name}")
    if getattr(layer, "lora_bias", {}).get(adapter, False):
        raise NotImplementedError(f"merging an adapter with lora_bias ({name})")
    if isinstance(layer, LoraLinear):
        a = full(state[f"{name}.lora_A.{adapter}.weight"].detach()).float()
        b = full(state[f"{name}.lora_B.{adapter}.weight"].detach()).float()
        delta = b @ a  # (out, in), as nn.Linear's weight
        if layer.fan_in_fan_out:
            delta = delta.T
    elif isinstance(layer, LoraEmbedding):
        a = full(state[f"{name}.lora_embedding_A.{adapter}"].detach()).float()
        b = full(state[f"{name}.lora_embedding_B.{adapter}"].detach()).float()
        delta = (b @ a).T  # (num_embeddings, embedding_dim)
    else:
        raise NotImplementedError(f"merging a LoRA layer of type {type(layer).__name__} ({name})")
    scale: float = layer.scaling[adapter]  # lora_alpha / r (peft leaves the dict untyped)
    return delta * scale


def merged_state_dict(
    model: nn.Module, full: Callable[[Tensor], Tensor] = _identity
) -> dict[str, Tensor]:
    """The base model's weights with the active adapters merged in (``W + scale * B @ A``).

    Keys are the plain transformers model's own ``state_dict`` keys (``base_layer.`` dropped,
    adapter tensors left out, tied weights under each of their names), so a plain model of the
    same config takes the result with ``load_state_dict(strict=True)``. Every tensor comes from
    the model's ``state_dict`` (under FSDP2 its pre-hook hands out the sharded parameters even
    right after a forward) and is read through ``full`` once, in a fixed order, so a collective
    such as ``DTensor.full_tensor`` runs the same on every rank. The merge is computed in float32
    on new tensors and cast to the base weight's dtype; the model's parameters are not written.
    Adapters are merged whether or not ``adapter_disabled`` is in effect. For a non-LoRA model
    this is its ``state_dict`` read through ``full``.
    """
    base = _base_model(model)
    state = base.state_dict(keep_vars=True)
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    gathered: dict[int, Tensor] = {}

    def read(tensor: Tensor) -> Tensor:
        if id(tensor) not in gathered:
            gathered[id(tensor)] = full(tensor.detach())
        return gathered[id(tensor)]

    # 1. The merged weight of each LoRA layer, by the identity of its base weight.
    merged: dict[int, Tensor] = {}
    for name, layer in layers.items():
        weight = state[f"{name}.base_layer.weight"]
        adapters = [
            a
            for a in layer.active_adapters
            if a in layer.scaling and a not in layer.merged_adapters
        ]
        if not adapters:
            continue
        # Read directly, not through the cache: only the merged tensor is kept.
        plain_weight = full(weight.detach())
        total = plain_weight.float()
        for adapter in adapters:
            total = total + _delta(layer, name, adapter, state, full)
        merged[id(weight)] = total.to(plain_weight.dtype)
        del plain_weight, total

    # 2. Every state-dict entry under its plain-model name.
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        owner = _lora_layer_of(key, layers)
        if owner is None:
            if id(tensor) in merged:
                raise ValueError(
                    f"{_SETTING}: {key} is tied to an adapted weight; a merged model cannot hold "
                    f"both (leave the tied embedding/head out of {_SETTING})"
                )
            out[key] = read(tensor)
            continue
        local = key[len(owner) + 1 :]
        if _is_adapter_key(local):
            continue
        if not local.startswith("base_layer."):
            raise ValueError(f"unexpected entry {key} in LoRA layer {owner}")
        plain = f"{owner}.{local.removeprefix('base_layer.')}"
        out[plain] = merged[id(tensor)] if id(tensor) in merged else read(tensor)
    return out


def adapter_state_dict(
    model: nn.Module, full: Callable[[Tensor], Tensor] = _identity
) -> dict[str, Tensor]:
    """The adapter's tensors read through ``full``, under the peft model's ``state_dict`` keys
    (e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``): the
    ``state`` that ``save_adapter`` takes for a sharded model."""
    return {
        key: full(tensor.detach())
        for key, tensor in model.state_dict(keep_vars=True).items()
        if _is_adapter_key(key)
    }


def save_adapter(model: nn.Module, out: Path, state: dict[str, Tensor] | None = None) -> None:
    """Write a peft adapter folder (adapter_config.json + adapter_model.safetensors) to ``out``.

    ``PeftModel.from_pretrained(base, out)`` loads it. ``state`` gives the adapter's full
    tensors under the peft model's ``state_dict`` keys (``adapter_state_dict``; entries that are
    not the adapter's are ignored); without it they are read from the model, which then must
    hold plain (unsharded) tensors.
    """
    if not is_lora(model):
        raise ValueError(f"{type(model).__name__} carries no LoRA adapter to save")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    peft_model = cast(PeftModel, model)
    if state is None:
        peft_model.save_pretrained(str(out))
    else:
        peft_model.save_pretrained(str(out), state_dict=state)


def merged_model(model: nn.Module) -> nn.Module:
    """A plain transformers model (a copy) with the adapters merged, for ``save_pretrained``.

    ``model`` itself is left as it is. The copy is made with ``copy.deepcopy``, so ``model``
    must hold plain (unsharded) parameters.
    """
    if not is_lora(model):
        return copy.deepcopy(model)
    return cast(nn.Module, copy.deepcopy(cast(PeftModel, model)).merge_and_unload())
