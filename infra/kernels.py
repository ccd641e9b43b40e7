"""Fused stand-ins for activation modules that transformers writes out as elementwise Python.

GPT-2-style models use ``NewGELUActivation`` ("gelu_new"): the tanh approximation of GELU as
seven separate tensor ops. ``torch.nn.GELU(approximate="tanh")`` computes the same function in
one fused kernel (faster on the CPU, equal within float32 rounding). The workers
swap it in on every model they load: activations hold no parameters, so weights, checkpoints
and ``state_dict`` names are unchanged.
"""

from __future__ import annotations

from torch import nn

__all__ = ["fuse_activations"]

_TANH_GELU_NAMES = ("NewGELUActivation", "FastGELUActivation")


def fuse_activations(model: nn.Module) -> int:
    """Replace tanh-approximate GELU modules of ``model`` in place; returns how many."""
    swaps = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child).__name__ in _TANH_GELU_NAMES and not isinstance(child, nn.GELU)
    ]
    for parent, name in swaps:
        setattr(parent, name, nn.GELU(approximate="tanh"))
    return len(swaps)
