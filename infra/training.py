"""The training engine of a trained role (actor, critic): how its module is wrapped, reduced,
gathered and checkpointed.

``strategy`` is ``"fsdp2"`` (PyTorch's ``fully_shard``: every decoder layer and then the root
are sharded over the default torch.distributed group, so parameters, gradients and optimizer
state are split over the data-parallel workers) or ``"none"`` (a plain module on one worker).

Mixed precision: a trained module keeps float32 master weights. With ``compute_dtype``
bfloat16/float16 an FSDP2 module computes in it through ``MixedPrecisionPolicy`` (parameters
cast for compute, gradients reduced in float32); a plain module runs its forward under
``torch.autocast``. Losses are already divided by the global token or sequence count, so
gradients are SUMMED over workers (the divide factor is 1): N workers take the step one worker
holding the whole batch would.

Checkpoints use ``torch.distributed.checkpoint`` (DCP) with fully qualified parameter names,
so a checkpoint written by N workers loads into M workers (or into a plain module).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "STRATEGIES",
    "full_state_dict",
    "gather_full",
    "gradient_sync",
    "is_sharded",
    "load_sharded",
    "plain_model",
    "prepare_frozen",
    "prepare_trainable",
    "save_sharded",
]

STRATEGIES = ("fsdp2", "none")


def _check_strategy(strategy: str, *, setting: str) -> None:
    """``setting`` is what the error tells the user to change."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of {STRATEGIES}: {setting}")


def _layer_classes(model: nn.Module) -> set[str]:
    """Class names of the model's repeated blocks (transformers' ``_no_split_modules``)."""
    names = getattr(model, "_no_split_modules", None) or []
    return {str(n) for n in names}


def _shard(model: nn.Module, mp_policy: Any) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    layers = _layer_classes(model)
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in layers:
            fully_shard(module, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # A plain SUM (gloo has no pre-multiplied sum): losses carry the global denominators.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def _autocast_forward(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Make ``model.forward`` run under ``torch.autocast(device.type, dtype)``."""
    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device.type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0 (modules and the config's attention dropout), so the
    model computes the same in train mode as in eval mode."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "dropout"):
        if config is not None and isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


def prepare_trainable(
    model: nn.Module,
    *,
    strategy: str,
    compute_dtype: torch.dtype,
    device: torch.device,
    gradient_checkpointing: bool = False,
    role: str = "actor",
) -> nn.Module:
    """``model`` (float32 weights) ready to train under ``strategy``, on ``device``.

    Dropout is off (PPO's ratios need the same function in every pass). Gradient checkpointing
    uses the model's own (``gradient_checkpointing_enable``, non-reentrant), which works only in
    train mode: the model is then left in train mode with dropout at 0, else in eval mode.
    ``role`` (``actor`` or ``critic``) is the config section an error names.
    """
    _check_strategy(strategy, setting=f"set {role}.strategy to one of them")
    model.to(device=device, dtype=torch.float32)
    disable_dropout(model)
    if gradient_checkpointing:
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise ValueError(
                f"{type(model).__name__} has no gradient_checkpointing_enable: set "
                f"{role}.gradient_checkpointing=false"
            )
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        config = getattr(model, "config", None)
        if config is not None:
            config.use_cache = False
        model.train()
    else:
        model.eval()
    low = compute_dtype != torch.float32
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = (
            MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
            if low
            else MixedPrecisionPolicy()
        )
        return _shard(model, policy)
    if low:
        _autocast_forward(model, compute_dtype, device)
    return model


def prepare_frozen(model: nn.Module, *, strategy: str, device: torch.device) -> nn.Module:
    """A frozen model (the reference policy) in its own dtype, sharded under ``fsdp2``."""
    _check_strategy(
        strategy, setting="the reference policy follows actor.strategy: set that to one of them"
    )
    model.to(device)
    model.requires_grad_(False).eval()
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return _shard(model, MixedPrecisionPolicy())
    return model


def is_sharded(model: nn.Module) -> TypeGuard[FSDPModule]:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Inside: an FSDP2 module reduces gradients in backward only when ``enabled`` (the last
    micro-batch of an optimizer step); the others accumulate locally. No-op for plain modules."""
    if enabled or not is_sharded(model):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def gather_full(value: Tensor) -> Tensor:
    """``value`` whole: a sharded ``DTensor`` gathered from every worker (a collective), any
    other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _full(value: Any) -> Any:
    return gather_full(value) if isinstance(value, Tensor) else value


def plain_model(module: nn.Module) -> Any:
    """The transformers model under ``module`` (a peft wrapper's base model), whose
    ``save_pretrained`` writes the plain model's folder."""
    base = getattr(module, "get_base_model", None)
    return base() if callable(base) else module


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every tensor of ``model.state_dict()`` whole (sharded ones gathered: a collective, so
    every worker of the group calls it), detached."""
    return {k: _full(v).detach() for k, v in model.state_dict().items()}


def _states(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Write the model's (and optimizer's) state with DCP to the folder ``path``: each worker
    writes its own shards (every worker of the group calls it)."""
    from torch.distributed.checkpoint.state_dict_saver import save

    save(_states(model, optimizer), checkpoint_id=str(path))


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load what ``save_sharded`` wrote, resharded to this group's workers."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    state = _states(model, optimizer)
    load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
