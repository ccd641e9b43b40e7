"""The training engine (infra.training) over real torch.distributed groups on CPU (gloo).

Each case runs ``TRAINER`` in 1 or 2 fresh processes: a tiny Llama saved with
``save_pretrained`` is loaded with ``from_pretrained``, wrapped by ``prepare_trainable`` and
updated with ``actor_update`` on this process's shard of one batch (losses divided by the whole
batch's token count); the whole state after the update is written by rank 0.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]

TRAINER = """
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from infra.training import full_state_dict, load_sharded, prepare_trainable, save_sharded
from tasks.batching import pack_batch
from tasks.update.optimize import ActorUpdateSettings, actor_update

args = json.loads(sys.argv[1])
rank, world = args["rank"], args["world"]
torch.set_num_threads(1)
if args["strategy"] == "fsdp2":
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=rank, world_size=world
    )
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
model = prepare_trainable(
    model,
    strategy=args["strategy"],
    compute_dtype=getattr(torch, args["dtype"]),
    device=torch.device("cpu"),
    gradient_checkpointing=args["checkpointing"],
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
if args.get("load"):
    load_sharded(Path(args["load"]), model, optimizer)
g = torch.Generator().manual_seed(1)
B = 8
prompts = [torch.randint(1, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g) for _ in range(B)]
responses = [torch.randint(1, 64, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g) for _ in range(B)]
advantages = torch.randn(B, 8, generator=g)
whole = pack_batch(prompt_ids=prompts, response_ids=responses, pad_id=0)
rows = slice(rank * B // world, (rank + 1) * B // world)
batch = pack_batch(prompt_ids=prompts[rows], response_ids=responses[rows], pad_id=0)
cfg = ActorUpdateSettings(mini_batch_size=B // world, micro_batch_size=max(B // world // 2, 1))
for _ in range(args["steps"]):
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
if args.get("save"):
    save_sharded(Path(args["save"]), model, optimizer)
if rank == 0:
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    torch.save({"state": state, "dtypes": dtypes}, args["out"])
if dist.is_initialized():
    dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


_RUNS: dict[str, dict[str, object]] = {}


def _train(tmp: Path, name: str, world: int, **options: object) -> dict[str, object]:
    """Run ``TRAINER`` on ``world`` processes; returns rank 0's output (each named run once
    per module)."""
    import json

    if name in _RUNS:
        return _RUNS[name]

    out = tmp / f"{name}.pt"
    settings = {
        "model": str(tmp / "model"),
        "world": world,
        "port": _port(),
        "strategy": "fsdp2" if world > 1 else "none",
        "dtype": "float32",
        "checkpointing": False,
        "steps": 2,
        "out": str(out),
        **options,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TRAINER, json.dumps({**settings, "rank": rank})],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
    result: dict[str, object] = torch.load(out, weights_only=False)
    _RUNS[name] = result
    return result


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("training")
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
    LlamaForCausalLM(config).save_pretrained(root / "model")
    return root


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_fsdp2_workers_make_the_update_of_one(tmp: Path) -> None:
    one = _train(tmp, "one", 1, save=str(tmp / "dcp-1"))
    two = _train(tmp, "two", 2, save=str(tmp / "dcp-2"))
    plain = LlamaForCausalLM.from_pretrained(tmp / "model").state_dict()
    assert _max_diff(one["state"], two["state"]) < 1e-5  # type: ignore[arg-type]
    assert _max_diff(one["state"], plain) > 1e-3  # type: ignore[arg-type]  # it did train
    # FSDP2 on one worker is the same engine with a group of one.
    alone = _train(tmp, "alone", 1, strategy="fsdp2")
    assert _max_diff(one["state"], alone["state"]) < 1e-5  # type: ignore[arg-type]


def test_bfloat16_compute_keeps_float32_master_weights(tmp: Path) -> None:
    one = _train(tmp, "bf16-one", 1, dtype="bfloat16")
    two = _train(tmp, "bf16-two", 2, dtype="bfloat16")
    full = _train(tmp, "one", 1, save=str(tmp / "dcp-1"))
    for run in (one, two):
        assert run["dtypes"] == ["torch.float32"]
        state = run["state"]
        assert all(v.dtype == torch.float32 for v in state.values())  # type: ignore[attr-defined]
        # bf16 compute moves the weights close to, not exactly as, float32 compute.
        assert 0 < _max_diff(state, full["state"]) < 0.1  # type: ignore[arg-type]


def test_gradient_checkpointing_makes_the_same_update(tmp: Path) -> None:
    plain = _train(tmp, "one", 1, save=str(tmp / "dcp-1"))
    recomputed = _train(tmp, "ckpt", 1, checkpointing=True)
    sharded = _train(tmp, "ckpt-two", 2, checkpointing=True)
    assert _max_diff(plain["state"], recomputed["state"]) < 1e-6  # type: ignore[arg-type]
    assert _max_diff(plain["state"], sharded["state"]) < 1e-5  # type: ignore[arg-type]


@pytest.mark.parametrize(("saved", "loaded"), [(2, 1), (1, 2)])
def test_sharded_checkpoint_resumes_on_another_worker_count(
    tmp: Path, saved: int, loaded: int
) -> None:
    """Two steps, save (DCP), two more steps on another worker count = four uninterrupted steps.
    The optimizer state comes back too: AdamW restarted from the saved weights alone would take
    other steps (its first steps have unit size per coordinate)."""
    first = {1: "one", 2: "two"}[saved]
    _train(tmp, first, saved, save=str(tmp / f"dcp-{saved}"))
    resumed = _train(tmp, f"resumed-{saved}-{loaded}", loaded, load=str(tmp / f"dcp-{saved}"))
    straight = _train(tmp, "straight", 1, steps=4)
    assert _max_diff(resumed["state"], straight["state"]) < 1e-5  # type: ignore[arg-type]
