"""Training at scale settings end to end (real Prefect harness, local Ray, tiny models): FSDP2 on
two workers with LoRA, bf16 compute, gradient checkpointing and token-budget micro-batches;
resuming on one worker; ``ppoflow export`` of the result, loaded back and generating."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flows.cli import main as cli
from infra.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

SCALE = [
    "actor.lora={rank: 4, alpha: 8}",
    "models.dtype=bfloat16",
    "actor.gradient_checkpointing=true",
    "data.max_prompt_length=64",
    "actor.max_tokens_per_micro_batch=96",
    "logprobs.max_tokens_per_micro_batch=96",
    "algorithm.kl.loss_coef=0.1",  # the reference (adapter disabled) takes part
    "trainer.total_steps=4",
    "trainer.steps_per_run=2",
    "trainer.checkpoint_every=2",
    "trainer.eval_every=100",
]


def _run(overrides: list[str]) -> dict[str, object]:
    from flows.train import ppo_train

    state = ppo_train(load_config(CONFIGS / "tiny.yaml", overrides), return_state=True)
    assert state.is_completed(), state.message
    result: dict[str, object] = state.result()
    return result


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_fsdp2_lora_run_resumes_on_one_worker_and_exports(
    prefect_harness, ray_local, tiny_overrides, assets, tmp_path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = Path(next(o for o in tiny_overrides if o.startswith("run_dir=")).split("=", 1)[1])
    # 1. Steps 0-1 on two FSDP2 workers (the default strategy there), checkpoint at step 1.
    _run([*tiny_overrides, *SCALE, "resources.num_workers=2"])
    workers = run_dir / "checkpoints" / "step-000001" / "workers"
    assert (workers / "dcp" / "actor" / ".metadata").exists()
    assert (workers / "actor-adapter" / "adapter_config.json").exists()
    # 2. Steps 2-3 on one worker, resumed from the two workers' shards.
    _run([*tiny_overrides, *SCALE, "resources.num_workers=1"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    # 3. Export: merged, and the adapter alone; both load and agree with the checkpoint's folder.
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert cli(["export", str(run_dir), "--out", str(merged)]) == 0
    assert (
        cli(["export", str(run_dir), "--step", "3", "--out", str(adapter), "--adapter-only"]) == 0
    )
    tokenizer = AutoTokenizer.from_pretrained(merged)
    assert tokenizer.chat_template
    policy = AutoModelForCausalLM.from_pretrained(merged)
    assert policy.dtype == torch.bfloat16
    saved = AutoModelForCausalLM.from_pretrained(
        run_dir / "checkpoints" / "step-000003" / "workers" / "actor"
    )
    for (name, a), (_, b) in zip(policy.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(a, b), name
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+34="}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    out = policy.generate(ids, max_new_tokens=4, do_sample=False)
    assert (
        out.shape[1] == ids.shape[1] + 4 or int(out[0, -1]) in policy.generation_config.eos_token_id
    )
    base = AutoModelForCausalLM.from_pretrained(assets.policy, dtype=torch.float32)
    lora = PeftModel.from_pretrained(base, adapter)
    float_policy = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert torch.allclose(_logits(lora, ids), _logits(float_policy, ids), atol=0.1)
    # 4. Bad input: one line naming what to change.
    assert cli(["export", str(run_dir), "--step", "2", "--out", str(tmp_path / "x")]) == 2


@pytest.mark.parametrize("strategy", ["none"])
def test_strategy_none_on_two_workers_is_refused(tiny_overrides, strategy) -> None:
    from infra.config import ConfigError

    with pytest.raises(ConfigError, match="actor.strategy='none'.*num_workers=2"):
        load_config(
            CONFIGS / "tiny.yaml",
            [*tiny_overrides, "resources.num_workers=2", f"actor.strategy={strategy}"],
        )
