"""LoRA on the actor (infra.lora): what trains, the base model behind ``adapter_disabled``, the
merged weights under plain keys, and the adapter and merged-model exports, on tiny models."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import cast

import pytest
import torch
from peft import PeftModel
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from transformers import (
    AutoModelForCausalLM,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from infra.assets import AssetPaths
from infra.config import LoraConfig
from infra.lora import (
    adapter_disabled,
    adapter_state_dict,
    apply_lora,
    is_lora,
    merged_model,
    merged_state_dict,
    save_adapter,
)

LINEAR_NAMES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 causal LM with an untied output head, saved with save_pretrained."""
    out = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tiny_assets: AssetPaths, qwen2_dir: Path) -> Path:
    """The project's tiny Llama policy (tied embeddings) or the tiny Qwen2 (untied head)."""
    return tiny_assets.policy if request.param == "llama" else qwen2_dir


def _load(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path).eval()


def _lora(target_modules: list[str] | str = "all-linear") -> LoraConfig:
    return LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=target_modules)


def _tokens(model: nn.Module, rows: int = 2, length: int = 10) -> Tensor:
    vocab = int(cast(PretrainedConfig, model.config).vocab_size)
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(1))


def _logits(model: nn.Module, ids: Tensor) -> Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _train(model: nn.Module, ids: Tensor, steps: int = 3) -> None:
    """A few AdamW steps of the language-modelling loss on the trainable parameters."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def _snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_same(before: dict[str, Tensor], model: nn.Module, names: set[str]) -> None:
    now = dict(model.named_parameters())
    for name in names:
        assert torch.equal(before[name], now[name]), name


def test_only_adapters_train_and_base_weights_stay_bit_identical(model_dir: Path) -> None:
    model = apply_lora(_load(model_dir), _lora())
    assert is_lora(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all("lora_" not in n for n in frozen)
    before = _snapshot(model)
    _train(model, _tokens(model))
    now = dict(model.named_parameters())
    assert all(not torch.equal(before[n], now[n]) for n in trainable)
    _assert_same(before, model, frozen)


def test_all_linear_wraps_every_linear_layer_but_the_head(model_dir: Path) -> None:
    model = apply_lora(_load(model_dir), _lora())
    wrapped = {n for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert {n.rsplit(".", 1)[-1] for n in wrapped} == LINEAR_NAMES
    assert not any(n.endswith("lm_head") for n in wrapped)


def test_adapter_disabled_computes_the_base_model(model_dir: Path) -> None:
    base = _load(model_dir)
    model = apply_lora(_load(model_dir), _lora())
    ids = _tokens(model)
    expected = _logits(base, ids)
    with adapter_disabled(model):
        assert torch.equal(_logits(model, ids), expected)
    _train(model, ids)
    with adapter_disabled(model):
        assert torch.equal(_logits(model, ids), expected)
    assert not torch.allclose(_logits(model, ids), expected, atol=1e-4)
    with adapter_disabled(base):  # no adapter: a no-op
        assert torch.equal(_logits(base, ids), expected)


@pytest.mark.parametrize(
    ("kind", "targets"),
    [
        ("llama", "all-linear"),
        ("qwen2", "all-linear"),
        # An adapter on the embedding (the untied model: the head is a weight of its own).
        ("qwen2", ["embed_tokens", "q_proj", "down_proj"]),
    ],
)
def test_merged_state_dict_loads_into_a_plain_model(
    tiny_assets: AssetPaths, qwen2_dir: Path, kind: str, targets: list[str] | str
) -> None:
    model_dir = tiny_assets.policy if kind == "llama" else qwen2_dir
    model = apply_lora(_load(model_dir), _lora(target_modules=targets))
    ids = _tokens(model)
    _train(model, ids)
    before = _snapshot(model)
    read: set[int] = set()

    def full(t: Tensor) -> Tensor:
        read.add(t.data_ptr())
        return t.clone()

    merged = merged_state_dict(model, full)
    _assert_same(before, model, set(before))
    plain = _load(model_dir)
    assert list(merged) == list(plain.state_dict())
    # Every tensor was read through ``full``, and what comes back is full's output.
    own = {p.data_ptr() for p in model.parameters()}
    assert own <= read
    assert not own & {t.data_ptr() for t in merged.values()}
    plain.load_state_dict(merged, strict=True)
    torch.testing.assert_close(_logits(plain, ids), _logits(model, ids), atol=1e-5, rtol=0)
    if plain.config.tie_word_embeddings:
        assert torch.equal(merged["lm_head.weight"], merged["model.embed_tokens.weight"])


def test_merged_state_dict_refuses_an_adapter_on_a_tied_head(tiny_assets: AssetPaths) -> None:
    model = apply_lora(_load(tiny_assets.policy), _lora(target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="tied"):
        merged_state_dict(model)


@pytest.mark.parametrize("with_state", [False, True])
def test_save_adapter_loads_with_peft(model_dir: Path, tmp_path: Path, with_state: bool) -> None:
    model = apply_lora(_load(model_dir), _lora())
    ids = _tokens(model)
    _train(model, ids)
    state = adapter_state_dict(model, lambda t: t.clone()) if with_state else None
    save_adapter(model, tmp_path / "adapter", state)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (tmp_path / "adapter").iterdir()
    }
    loaded = PeftModel.from_pretrained(_load(model_dir), tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=1e-6, rtol=0)


def test_merged_model_saves_and_loads_as_a_plain_model(model_dir: Path, tmp_path: Path) -> None:
    model = apply_lora(_load(model_dir), _lora())
    ids = _tokens(model)
    _train(model, ids)
    expected = _logits(model, ids)
    before = _snapshot(model)
    cast(PreTrainedModel, merged_model(model)).save_pretrained(tmp_path / "merged")
    assert is_lora(model)
    _assert_same(before, model, set(before))
    loaded = _load(tmp_path / "merged")
    assert not is_lora(loaded)
    assert not any("lora_" in k or "base_layer" in k for k in loaded.state_dict())
    torch.testing.assert_close(_logits(loaded, ids), expected, atol=1e-5, rtol=0)
    generate = cast(GenerationMixin, loaded).generate
    generated = generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, ids.shape[1] + 4)


@pytest.mark.parametrize("targets", [["q_proj", "qkv"], "layers\\.\\d+\\.attn_out"])
def test_a_target_that_matches_nothing_names_the_setting(
    tiny_assets: AssetPaths, targets: list[str] | str
) -> None:
    with pytest.raises(ValueError, match="actor.lora.target_modules") as error:
        apply_lora(_load(tiny_assets.policy), _lora(target_modules=targets))
    message = str(error.value)
    assert "\n" not in message
    assert "q_proj" in message and "down_proj" in message
    assert ("qkv" if isinstance(targets, list) else "attn_out") in message


def _fsdp2_rank(rank: int, world: int, init: str, out: str) -> None:
    """One rank of the FSDP2 check: train the sharded LoRA model, then merge and save through
    ``full_tensor``; rank 0 writes what it measured to ``out``."""
    import json

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    config = Qwen2Config(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(config).eval()
    torch.manual_seed(0)
    model = apply_lora(Qwen2ForCausalLM(config), _lora())
    for layer in cast(Qwen2ForCausalLM, cast(PeftModel, model).get_base_model()).model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(3, 48, (2, 8), generator=torch.Generator().manual_seed(1))
    _train(model, ids, steps=2)
    lora_logits = _logits(model, ids)
    with adapter_disabled(model):
        disabled_is_base = torch.equal(_logits(model, ids), _logits(base, ids))
    # The state_dict hands out the local shards (DTensors), also right after a forward.
    shards = {k: cast(DTensor, t).to_local().clone() for k, t in model.state_dict().items()}

    def full(t: Tensor) -> Tensor:
        return cast(DTensor, t).full_tensor()

    merged = merged_state_dict(model, full)
    adapter = adapter_state_dict(model, full)
    untouched = all(
        torch.equal(shards[k], cast(DTensor, t).to_local()) for k, t in model.state_dict().items()
    )
    plain = Qwen2ForCausalLM(config).eval()
    plain.load_state_dict(merged, strict=True)
    merged_error = (_logits(plain, ids) - lora_logits).abs().max().item()
    if rank == 0:
        folder = Path(out).parent / "adapter"
        save_adapter(model, folder, adapter)
        torch.manual_seed(0)
        loaded = PeftModel.from_pretrained(Qwen2ForCausalLM(config), folder).eval()
        adapter_error = (_logits(loaded, ids) - lora_logits).abs().max().item()
        Path(out).write_text(
            json.dumps(
                {
                    "disabled_is_base": disabled_is_base,
                    "untouched": untouched,
                    "merged_error": merged_error,
                    "adapter_error": adapter_error,
                }
            )
        )
    # Every rank has finished before any leaves the group; the process then ends without C++
    # exit handlers, where a joinable distributed thread would abort it after its work is done
    # (as tests/infra/test_training.py's ranks do).
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_fsdp2_sharded_lora_merges_and_saves_through_full_tensor(tmp_path: Path) -> None:
    import json

    import torch.multiprocessing as mp

    out = tmp_path / "result.json"
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_fsdp2_rank, args=(2, init, str(out)), nprocs=2)
    result = json.loads(out.read_text())
    assert result["disabled_is_base"] and result["untouched"]
    assert result["merged_error"] < 1e-5 and result["adapter_error"] < 1e-6
