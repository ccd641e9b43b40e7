"""Fused activations: the swapped GPT-2 computes the same logits and keeps its state_dict."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.activations import NewGELUActivation

from infra.kernels import fuse_activations


def test_gpt2_with_fused_gelu_matches_and_keeps_its_weights() -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config).eval()
    assert config.activation_function == "gelu_new"
    ids = torch.randint(0, 40, (3, 11))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        keys = list(model.state_dict())
        assert fuse_activations(model) == 2  # one MLP activation per layer
        after = model(input_ids=ids).logits
    assert not any(isinstance(m, NewGELUActivation) for m in model.modules())
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)
    assert fuse_activations(model) == 0  # idempotent
