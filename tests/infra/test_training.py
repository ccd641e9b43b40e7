"""The training engine (infra.training) over real torch.distributed groups on CPU (gloo).

Three jobs of 1, 2 and 1 fresh processes (one torch.distributed group each) run ``TRAINER``'s
named runs in turn: a tiny Llama saved with ``save_pretrained`` is loaded with
``from_pretrained``, wrapped by ``prepare_trainable`` and updated with ``actor_update`` on this
process's shard of one batch (losses divided by the whole batch's token count); the whole state
after the update is written by rank 0.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]

TRAINER = """
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from infra.training import full_state_dict, load_sharded, prepare_trainable, save_sharded
from tasks.batching import pack_batch
from tasks.update.core import PolicyLossSettings
from tasks.update.optimize import ActorUpdateSettings, actor_update

job = json.loads(sys.argv[1])
rank, world = job["rank"], job["world"]
torch.set_num_threads(1)
dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{job['port']}", rank=rank, world_size=world
)
g = torch.Generator().manual_seed(1)
B = 8
prompts = [torch.randint(1, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g) for _ in range(B)]
responses = [torch.randint(1, 64, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g) for _ in range(B)]
advantages = torch.randn(B, 8, generator=g)
whole = pack_batch(prompt_ids=prompts, response_ids=responses, pad_id=0)
rows = slice(rank * B // world, (rank + 1) * B // world)
batch = pack_batch(prompt_ids=prompts[rows], response_ids=responses[rows], pad_id=0)
for run in job["runs"]:
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    model = prepare_trainable(
        model,
        strategy=run["strategy"],
        compute_dtype=getattr(torch, run["dtype"]),
        device=torch.device("cpu"),
        gradient_checkpointing=run["checkpointing"],
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if run.get("load"):
        load_sharded(Path(run["load"]), model, optimizer)
    cfg = ActorUpdateSettings(
        ppo_epochs=1,
        mini_batch_size=B // world,
        micro_batch_size=max(B // world // 2, 1),
        max_tokens_per_micro_batch=None,
        padding_free=False,
        policy=PolicyLossSettings(
            policy_loss="ppo",
            clip_low=0.2,
            clip_high=0.2,
            dual_clip=3.0,
            gspo_clip_low=3e-4,
            gspo_clip_high=4e-4,
            cispo_clip_low=None,
            cispo_clip_high=0.2,
            sapo_tau_pos=1.0,
            sapo_tau_neg=1.05,
        ),
        agg="token-mean",
        entropy_coef=0.0,
        kl_loss_coef=0.0,
        kl_loss_kind="k3",
        distill_loss_coef=0.0,
        max_grad_norm=1.0,
        temperature=1.0,
        shuffle_seed=None,
        rollout_correction="none",
        correction_cap=2.0,
        correction_low=0.5,
        correction_high=2.0,
        old_is_rollout=False,
    )
    for _ in range(run["steps"]):
        actor_update(
            model=model,
            optimizer=optimizer,
            batch=batch,
            old_logprobs=None,
            advantages=advantages[rows, : batch.response_mask.shape[1]],
            cfg=cfg,
            global_tokens=float(whole.response_mask.sum()),
        )
    state = full_state_dict(model)
    if run.get("save"):
        save_sharded(Path(run["save"]), model, optimizer)
    if rank == 0:
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        torch.save({"state": state, "dtypes": dtypes}, run["out"])
# Every rank has finished before any leaves the group. The process then ends without C++ exit
# handlers: torch's distributed threads can still be joinable there, and a joinable
# std::thread's destructor aborts the process ("terminate called without an active exception",
# one run in about ten on a loaded machine) after its work is done and written.
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _job(tmp: Path, world: int, runs: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
    """Run ``TRAINER`` on ``world`` processes (one group) for each named run in turn; returns
    rank 0's output of each."""
    import json

    defaults = {"strategy": "fsdp2" if world > 1 else "none", "dtype": "float32"}
    listed = [
        {**defaults, "checkpointing": False, "steps": 2, **run, "out": str(tmp / f"{name}.pt")}
        for name, run in runs.items()
    ]
    job = {"model": str(tmp / "model"), "world": world, "port": _port(), "runs": listed}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TRAINER, json.dumps({**job, "rank": rank})],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
    return {name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in runs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """Every run the tests compare, in three jobs: one worker, two workers, one worker again
    (resuming the two workers' checkpoint)."""
    tmp = tmp_path_factory.mktemp("training")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(tmp / "model")
    dcp1, dcp2 = str(tmp / "dcp-1"), str(tmp / "dcp-2")
    out = _job(
        tmp,
        1,
        {
            "one": {"save": dcp1},
            "alone": {"strategy": "fsdp2"},  # FSDP2 with a group of one
            "bf16-one": {"dtype": "bfloat16"},
            "ckpt": {"checkpointing": True},
            "straight": {"steps": 4},
        },
    )
    out |= _job(
        tmp,
        2,
        {
            "two": {"save": dcp2},
            "bf16-two": {"dtype": "bfloat16"},
            "ckpt-two": {"checkpointing": True},
            "resumed-1-2": {"load": dcp1},
        },
    )
    out |= _job(tmp, 1, {"resumed-2-1": {"load": dcp2}})
    out["plain"] = {"state": LlamaForCausalLM.from_pretrained(tmp / "model").state_dict()}
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_fsdp2_workers_make_the_update_of_one(runs: dict[str, dict[str, Any]]) -> None:
    assert _max_diff(runs["one"]["state"], runs["two"]["state"]) < 1e-5
    assert _max_diff(runs["one"]["state"], runs["plain"]["state"]) > 1e-3  # it did train
    # FSDP2 on one worker is the same engine with a group of one.
    assert _max_diff(runs["one"]["state"], runs["alone"]["state"]) < 1e-5


def test_bfloat16_compute_keeps_float32_master_weights(runs: dict[str, dict[str, Any]]) -> None:
    for name in ("bf16-one", "bf16-two"):
        assert runs[name]["dtypes"] == ["torch.float32"]
        state = runs[name]["state"]
        assert all(v.dtype == torch.float32 for v in state.values())
        # bf16 compute moves the weights close to, not exactly as, float32 compute.
        assert 0 < _max_diff(state, runs["one"]["state"]) < 0.1


def test_gradient_checkpointing_makes_the_same_update(runs: dict[str, dict[str, Any]]) -> None:
    assert _max_diff(runs["one"]["state"], runs["ckpt"]["state"]) < 1e-6
    assert _max_diff(runs["one"]["state"], runs["ckpt-two"]["state"]) < 1e-5


@pytest.mark.parametrize(("saved", "loaded"), [(2, 1), (1, 2)])
def test_sharded_checkpoint_resumes_on_another_worker_count(
    runs: dict[str, dict[str, Any]], saved: int, loaded: int
) -> None:
    """Two steps, save (DCP), two more steps on another worker count = four uninterrupted steps.
    The optimizer state comes back too: AdamW restarted from the saved weights alone would take
    other steps (its first steps have unit size per coordinate)."""
    resumed = runs[f"resumed-{saved}-{loaded}"]["state"]
    assert _max_diff(resumed, runs["straight"]["state"]) < 1e-5
