"""On-policy distillation end to end (``algorithm.distill``, ``models.teacher``): real Prefect
(test harness), real local Ray, the tiny assets and a teacher built here from the tiny policy
(its weights moved, saved with ``save_pretrained`` and loaded back by the workers).

The teacher wakes where the scoring models do (``reward.pool``) and a run that ends completed
kept the one-awake rule on every worker. ``timing_s/wake/<role>`` comes from the training
pool's workers, so it shows whether the teacher took its turns there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_judge import _run  # noqa: E402  (a tiny run that must complete, and its metrics)

METRICS = (
    "distill/reverse_kl/mean",
    "distill/teacher_logprob/mean",
    "distill/student_logprob/mean",
)


@pytest.fixture(scope="module")
def teacher(assets, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny policy with a sharper output layer (its logits times 4): the same preferences,
    held far more firmly, which the student can learn in a few steps."""
    out = tmp_path_factory.mktemp("teacher") / "teacher"
    model = AutoModelForCausalLM.from_pretrained(assets.policy)
    model.config.tie_word_embeddings = False
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone() * 4.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(assets.tokenizer).save_pretrained(out)
    return out


@pytest.mark.slow
def test_pure_distillation_in_sync_lowers_the_reverse_kl(
    prefect_harness, ray_local, tiny_overrides, teacher: Path
) -> None:
    """No reward at all: the teacher's signal alone trains the student, and its reverse KL to
    the teacher falls."""
    _, rows = _run(
        tiny_overrides,
        f"models.teacher={teacher}",
        "models.reward_model=null",
        "reward.model_weight=0",
        "reward.rule_weight=0",
        "algorithm.distill.coef=1.0",
        "algorithm.gamma=0.0",  # each token's own signal, as on-policy distillation does
        "actor.lr=1e-3",
        "rollout.prompts_per_step=8",
        "rollout.n=8",
        "actor.mini_batch_size=64",
        "actor.micro_batch_size=32",
        "trainer.total_steps=8",
    )
    assert [r["step"] for r in rows] == list(range(8))
    for r in rows:
        assert all(name in r for name in METRICS), sorted(r)
        assert "reward/rm/mean" not in r
        assert r["timing_s/wake/teacher"] >= 0  # colocated on the training pool
    kl = [r["distill/reverse_kl/mean"] for r in rows]
    assert kl[0] > 0.5, kl  # the sharper teacher disagrees with the student at first
    assert (kl[-2] + kl[-1]) < 0.75 * (kl[0] + kl[1]), kl
    entropy = [r["actor/entropy"] for r in rows]
    assert entropy[-1] < entropy[0], entropy  # the student grows sharper, as its teacher is


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ("resources.mode=colocate_async", "algorithm.distill.mode=kl_loss"),
        ("resources.mode=separate_async", "reward.pool=colocated"),
        ("resources.mode=separate_async", "reward.pool=own"),
    ],
    ids=["colocate_async-kl_loss", "separate_async-colocated", "separate_async-own"],
)
def test_distillation_beside_the_reward_model_in_the_async_modes(
    prefect_harness, ray_local, tiny_overrides, teacher: Path, extra: tuple[str, ...]
) -> None:
    cfg, rows = _run(
        tiny_overrides,
        f"models.teacher={teacher}",
        "algorithm.distill.coef=0.5",
        "trainer.total_steps=3",
        *extra,
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert all(name in r for name in METRICS), sorted(r)
        assert "reward/rm/mean" in r  # the reward model scored beside the teacher
        as_loss = cfg.algorithm.distill.mode == "kl_loss"
        assert ("actor/distill_loss" in r) is as_loss and r.get("actor/distill_loss", 1.0) > 0
    on_training_pool = any("timing_s/wake/teacher" in r for r in rows)
    assert on_training_pool == (cfg.reward.pool == "colocated")
