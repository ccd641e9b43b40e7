"""The typed per-shard batch and the declared worker steps (tasks.step) over a real
in-process store: the multi-turn ``loss_mask`` becomes the one ``response_mask`` every step
takes; a step reads only what it declares and writes only what it declares, once per name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from infra.config import load_config
from storage import BatchMeta, open_store
from tasks.advantage.stage import compute
from tasks.context import Metrics
from tasks.io import nested, padded
from tasks.plan import StepPlan
from tasks.step import Shard, WorkerStep, read_shard, run_steps, shard_of

PARTITION = "train/step-000001"
KEYS = ("p0/0", "p0/1", "p1/0")
LENGTHS = (3, 2, 4)


class StoreWorker:
    """What ``read_shard`` and ``run_steps`` use of a ``ModelWorker``: its store and config, its
    ``once`` and one model per role."""

    def __init__(self) -> None:
        self.store, self.cfg, self.applied = open_store("memory://"), load_config(None, []), {}
        self.woken: list[str] = []
        self.module: torch.nn.Module = torch.nn.Identity()  # every role's

    def once(self, name: str, apply: Any) -> Any:
        if name not in self.applied:
            self.applied[name] = apply()
        return self.applied[name]

    @contextlib.contextmanager
    def awake(self, role: str) -> Iterator[Any]:
        self.woken.append(role)
        yield type("Model", (), {"module": self.module})()


def _filled(loss_mask: bool, worker: StoreWorker | None = None) -> tuple[StoreWorker, BatchMeta]:
    worker = worker or StoreWorker()
    fields: dict[str, Any] = {
        "prompt_ids": [torch.arange(1, 3) for _ in KEYS],
        "response_ids": [torch.arange(5, 5 + n) for n in LENGTHS],
        "scores": torch.tensor([1.0, 0.0, 0.5]),
        "group_ids": torch.tensor([0, 0, 1]),
    }
    if loss_mask:  # the first sample's last token and the last one's third are a tool's
        fields["loss_mask"] = [
            torch.tensor([True, True, False]),
            torch.tensor([True, True]),
            torch.tensor([True, True, False, True]),
        ]
    worker.store.kv_batch_put(list(KEYS), PARTITION, fields)
    return worker, BatchMeta(PARTITION, KEYS, tuple(fields))


def test_the_response_mask_is_the_loss_mask_when_stored_else_every_response_token() -> None:
    worker, meta = _filled(loss_mask=True)
    shard = read_shard(worker, meta, ("response_ids", "loss_mask"))  # type: ignore[arg-type]
    assert shard.batch_size == torch.Size([3])
    assert padded(shard.need("response_mask"), 4).tolist() == [
        [True, True, False, False],
        [True, True, False, False],
        [True, True, False, True],
    ]
    single = read_shard(worker, meta, ("response_ids",))  # type: ignore[arg-type]
    assert padded(single.need("response_mask"), 4).sum(dim=1).tolist() == list(LENGTHS)


def test_a_field_the_step_did_not_read_is_none_and_needing_it_names_it() -> None:
    worker, meta = _filled(loss_mask=False)
    shard = read_shard(worker, meta, ("scores",))  # type: ignore[arg-type]
    assert shard.response_ids is None and shard.response_mask is None
    with pytest.raises(KeyError, match="'advantages'.*declare it in its reads"):
        shard.need("advantages")
    with pytest.raises(KeyError, match="no field 'extra_info'"):
        shard_of({"scores": torch.zeros(3), "extra_info": [{}, {}, {}]}, 3)
    with pytest.raises(TypeError, match="'scores' is a tensor: take it with Shard.need"):
        shard.objects("scores")


def test_the_score_sits_on_the_last_sampled_token_and_tool_tokens_carry_no_advantage() -> None:
    cfg = load_config(None, ["rollout.max_turns=2", "algorithm.norm_by_std=false"])
    worker, meta = _filled(loss_mask=True)
    counts = {k: torch.ones(3, dtype=torch.int64) for k in ("num_turns", "tool_calls")}
    counts |= {k: torch.zeros(3, dtype=torch.int64) for k in ("tool_errors",)}
    counts["truncated_tool_responses"] = torch.zeros(3, dtype=torch.int64)
    worker.store.kv_batch_put(list(KEYS), PARTITION, counts)
    plan = StepPlan.from_config(cfg)
    shard = read_shard(worker, meta, plan.advantage_reads)  # type: ignore[arg-type]
    out = compute(cfg, shard, plan=plan, kl_coef=0.0)
    mask = out.tensors["response_mask"]
    assert mask.tolist() == padded(shard.need("response_mask"), 4).tolist()
    assert mask.sum().item() == 2 + 2 + 3
    assert out.tensors["token_rewards"][2].tolist() == [0.0, 0.0, 0.0, 0.5]  # last sampled
    assert out.tensors["token_rewards"][0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert not out.tensors["advantages"][~mask].any()  # tool tokens: no signal
    assert out.tensors["advantages"][mask].abs().sum() > 0
    assert out.metrics["agent/tool_calls/mean"] == 1.0


def _double(worker: Any, module: Any, shard: Shard) -> tuple[Shard, Metrics]:
    out = Shard(batch_size=shard.batch_size)
    out.advantages = nested([2.0 * r.float() for r in shard.need("response_ids").unbind()])
    return out, {"calls": 1.0}


def _sum_of_advantages(worker: Any, module: Any, shard: Shard) -> tuple[Shard, Metrics]:
    # a later step sees what an earlier one of the same sequence computed
    return Shard(batch_size=shard.batch_size), {
        "sum": float(shard.need("advantages").values().sum())
    }


def test_run_steps_reads_wakes_computes_and_writes_what_each_step_declares_once() -> None:
    worker, meta = _filled(loss_mask=False)
    steps = (
        WorkerStep("double", ("response_ids",), "actor", _double, ("advantages",)),
        WorkerStep("sum", (), None, _sum_of_advantages, ()),
    )
    first = run_steps(worker, meta, steps, once="double@1").metrics  # type: ignore[arg-type]
    again = run_steps(worker, meta, steps, once="double@1").metrics  # type: ignore[arg-type]
    assert first == again == {"calls": 1.0, "sum": 2.0 * (5 + 6 + 7 + 5 + 6 + 5 + 6 + 7 + 8)}
    assert worker.woken == ["actor"]  # the retry applied nothing
    stored = worker.store.get_fields(meta, ["advantages"], timeout=0)["advantages"]
    assert padded(stored, 4)[2].tolist() == [10.0, 12.0, 14.0, 16.0]
    assert set(worker.store.kv_list(PARTITION)[KEYS[0]]) == {
        "prompt_ids",
        "response_ids",
        "scores",
        "group_ids",
        "advantages",
    }


def test_a_shard_of_a_dict_builds_the_same_mask_as_one_read_from_the_store() -> None:
    worker, meta = _filled(loss_mask=True)
    read = read_shard(worker, meta, ("response_ids", "loss_mask"))  # type: ignore[arg-type]
    data = worker.store.get_fields(meta, ["response_ids", "loss_mask"], timeout=0)
    built = shard_of(data, len(KEYS))
    assert torch.equal(
        padded(read.need("response_mask"), 4), padded(built.need("response_mask"), 4)
    )


def _objects(worker: Any, module: Any, shard: Shard) -> tuple[Shard, Metrics]:
    """Returns each row's prompt text with its ground truth appended (object fields)."""
    texts = [f"{p}={g}" for p, g in zip(shard.objects("raw_prompt"), shard.objects("ground_truth"))]
    return Shard(response_text=texts, batch_size=shard.batch_size), {}


def _verdicts(worker: Any, module: Any, shard: Shard) -> tuple[Shard, Metrics]:
    """Writes a verdict per row from the text an earlier step of the sequence returned."""
    verdicts = [f"<{t}>" for t in shard.objects("response_text")]
    return Shard(judge_verdicts=verdicts, batch_size=shard.batch_size), {"rows": 3.0}


def _fails(worker: Any, module: Any, shard: Shard) -> tuple[Shard, Metrics]:
    raise RuntimeError("the scorer failed")


def test_a_step_reads_what_an_earlier_one_returned_from_the_shard_not_the_store() -> None:
    """Object fields go in and out; a field an earlier step computes is not read from the
    store; returned fields come back and are not stored; a failing step writes nothing."""
    from tasks.step import store_reads

    worker, meta = _filled(loss_mask=False)
    worker.store.kv_batch_put(
        list(KEYS), PARTITION, {"raw_prompt": ["a", "b", "c"], "ground_truth": [1, 2, 3]}
    )
    steps = (
        WorkerStep("text", ("raw_prompt", "ground_truth"), None, _objects, (), ("response_text",)),
        WorkerStep("judge", ("response_text",), "judge", _verdicts, ("judge_verdicts",)),
    )
    assert store_reads(steps) == ("raw_prompt", "ground_truth")
    ran = run_steps(worker, meta, steps)  # type: ignore[arg-type]
    assert ran.metrics == {"rows": 3.0} and worker.woken == ["judge"]
    assert ran.returned.objects("response_text") == ["a=1", "b=2", "c=3"]
    assert ran.returned.judge_verdicts is None  # written, not returned
    stored = worker.store.get_fields(meta, ["judge_verdicts"], timeout=0)["judge_verdicts"]
    assert stored == ["<a=1>", "<b=2>", "<c=3>"]
    assert "response_text" not in worker.store.kv_list(PARTITION)[KEYS[0]]
    failing = (
        WorkerStep("double", ("response_ids",), "actor", _double, ("advantages",)),
        WorkerStep("fails", (), None, _fails, ("scores",)),
    )
    with pytest.raises(RuntimeError, match="the scorer failed"):
        run_steps(worker, meta, failing)  # type: ignore[arg-type]
    assert "advantages" not in worker.store.kv_list(PARTITION)[KEYS[0]]


def _rollout(worker: Any, module: Any, shard: Shard) -> tuple[Shard, Metrics]:
    """Responses of 2, 1 and 3 tokens whose last token is a tool's, as a multi-turn rollout's."""
    out = Shard(batch_size=shard.batch_size)
    out.response_ids = nested([torch.arange(n) for n in (2, 1, 3)])
    out.loss_mask = nested([torch.arange(n) < n - 1 for n in (2, 1, 3)])
    return out, {}


def _sampled_tokens(worker: Any, module: Any, shard: Shard) -> tuple[Shard, Metrics]:
    return Shard(batch_size=shard.batch_size), {
        "sampled": float(shard.need("response_mask").values().sum())
    }


def test_a_step_after_one_that_computes_the_responses_gets_their_response_mask() -> None:
    from tasks.step import store_reads

    worker, meta = _filled(loss_mask=False)  # the stored responses have 3, 2 and 4 tokens
    steps = (
        WorkerStep("rollout", ("prompt_ids",), None, _rollout, (), ("response_ids", "loss_mask")),
        WorkerStep("count", ("response_mask",), None, _sampled_tokens, ()),
    )
    assert store_reads(steps) == ("prompt_ids",)
    assert run_steps(worker, meta, steps).metrics == {"sampled": 1.0 + 0.0 + 2.0}  # type: ignore[arg-type]
    assert store_reads(steps[1:]) == ("response_ids",)  # alone, it reads the stored responses
    assert run_steps(worker, meta, steps[1:]).metrics == {"sampled": 3.0 + 2.0 + 4.0}  # type: ignore[arg-type]


def test_every_shard_field_and_every_declared_read_or_write_is_a_store_field() -> None:
    """The shard speaks the store's vocabulary (aside from the fields no stage stores), and so
    does every declared step, for every plan the presets make."""
    from dataclasses import fields as dataclass_fields
    from pathlib import Path

    from storage.schema import VOCABULARY
    from tasks.advantage.stage import advantage_step
    from tasks.generate.stage import Sampling, sampling_step
    from tasks.logprobs.stage import FORWARD_STEPS, TEACHER_STEP
    from tasks.score.stage import scoring_steps
    from tasks.step import UNSTORED
    from tasks.update.settings import actor_settings, critic_settings
    from tasks.update.stage import update_steps

    fields = {f.name for f in dataclass_fields(Shard)}
    assert len(fields) == 31 and fields - UNSTORED <= set(VOCABULARY)
    assert fields >= UNSTORED and not UNSTORED & set(VOCABULARY)
    unstored = {"response_mask", "rm", "rm_mean", "rm_std", "response_lengths", "response_text"}
    assert unstored == UNSTORED  # the six no stage stores, and no misspelt store field
    presets = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert presets
    for preset in presets:
        cfg = load_config(preset, [])
        plan = StepPlan.from_config(cfg)
        critic = critic_settings(cfg, 1) if plan.critic else None
        steps = (
            *FORWARD_STEPS.values(),
            TEACHER_STEP,
            advantage_step(plan, 0.0),
            *update_steps(plan.update_reads, actor_settings(cfg, 1, plan), critic),
            sampling_step(cfg.rollout, Sampling(2, 0, 1.0, 0, 0)),
            *scoring_steps(
                cfg.rollout.multi_turn, BatchMeta(PARTITION, KEYS, ()), seed=0, rule="exact_match", texts=True,
                model=True, judge=True, teacher=True,
            ),
        )  # fmt: skip
        for step in steps:
            assert set(step.writes) <= set(VOCABULARY), (preset.name, step.name)
            assert set(step.reads) - UNSTORED <= set(VOCABULARY), (preset.name, step.name)
            assert not set(step.writes) & UNSTORED, (preset.name, step.name)
            assert set(step.reads) | set(step.writes) | set(step.returns) <= fields, (
                preset.name,
                step.name,
            )


class GroupMember(StoreWorker):
    """A worker of a two-worker group whose torch.distributed group was never joined (as a
    scoring worker's is not), with a small real causal LM for every role."""

    spec = type("Spec", (), {"world_size": 2, "rank": 0})()
    device, pad_id = torch.device("cpu"), 0

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        )  # fmt: skip
        self.module = LlamaForCausalLM(config).eval()


def test_the_teachers_pass_runs_its_own_micro_batches_and_a_training_pass_agrees_a_count() -> None:
    """The teacher's pass (on scoring workers, which share no collective) computes alone on a
    worker of a group; a training pass on the same worker asks the group for the count."""
    from tasks.logprobs.stage import FORWARD_STEPS, TEACHER_STEP

    member, meta = _filled(loss_mask=False, worker=GroupMember())
    run_steps(member, meta, (TEACHER_STEP,))  # type: ignore[arg-type]
    stored = member.store.get_fields(meta, ["teacher_logprobs"], timeout=0)["teacher_logprobs"]
    rows = stored.unbind()
    assert [len(r) for r in rows] == list(LENGTHS)
    assert all(bool(((r < 0) & r.isfinite()).all()) for r in rows)
    assert member.woken == ["teacher"]
    with pytest.raises((RuntimeError, ValueError), match="process group"):
        run_steps(member, meta, (FORWARD_STEPS["old_logprobs"],))  # type: ignore[arg-type]
