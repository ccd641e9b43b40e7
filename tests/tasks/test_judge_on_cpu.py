"""The LLM judge on the CPU: its parsers, its settings, the score task's judge part (stand-in
scoring workers, in-process store) and the judge model on an in-process worker, taking turns."""

from __future__ import annotations

import pickle
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from judge_assets import PROMPT_TEMPLATE, build_tiny_judge

from flows.inputs import InputError, check_inputs
from infra.config import ConfigError, load_config
from infra.judge import (
    JudgeParseError,
    JudgeTemplateError,
    check_template,
    judge_scores,
    last_number,
    load_parse_function,
    question_text,
    yes_no,
)
from infra.reward_functions import RewardFunctionLoadError
from infra.runtime import Runtime
from infra.workers import ModelWorker, WorkerSpec
from storage import BatchMeta, open_store
from tasks.context import StageContext
from tasks.score.stage import ShardScores, score, score_rows

INLINE = "'Q: {{ question }} A: {{ response }} T: {{ ground_truth }}'"


# ---------------------------------------------------------------------------- parsers
@pytest.mark.parametrize(
    ("verdict", "value"),
    [
        ("yes", 1.0),
        ("Yes, no doubt about it", 1.0),  # the first of the two words decides
        (" NO.", 0.0),
        ("I think no, not yes", 0.0),
        ("yesterday; nobody", None),  # whole words only
        ("", None),
    ],
)
def test_yes_no_takes_the_first_whole_word_yes_or_no(verdict: str, value: float | None) -> None:
    assert yes_no(verdict) == value


@pytest.mark.parametrize(
    ("verdict", "value"),
    [
        ("score: 7", 7.0),
        ("8 of 10", 10.0),
        ("-1,250.5 points", -1250.5),
        ("between .5 and +2", 2.0),
        ("no digits here", None),
    ],
)
def test_last_number_takes_the_last_number(verdict: str, value: float | None) -> None:
    assert last_number(verdict) == value


def test_judge_scores_score_unparsed_verdicts_on_parse_error_and_count_them() -> None:
    judged = judge_scores(
        ["yes", "maybe", "no", "?"],
        ["a/0", "a/1", "b/0", "b/1"],
        parse=yes_no,
        label="builtin:yes_no",
        on_parse_error=-0.5,
    )
    assert judged.values == [1.0, -0.5, 0.0, -0.5]
    assert judged.failed == [False, True, False, True]
    assert judged.failure_fraction == 0.5


def test_a_raising_parse_function_fails_naming_itself_and_the_sample() -> None:
    def parse(verdict: str) -> float | None:
        if verdict == "boom":
            raise KeyError("no such verdict")
        return 1.0

    with pytest.raises(JudgeParseError) as info:
        judge_scores(["ok", "boom"], ["a/0", "a/1"], parse=parse, label="f.py:p", on_parse_error=0)
    message = str(info.value)
    assert "f.py:p" in message and "'a/1'" in message and "KeyError" in message
    assert "\n" not in message and "nothing of this batch was written" in message
    again = pickle.loads(pickle.dumps(info.value))  # Prefect and Ray carry it whole
    assert (str(again), again.label, again.key) == (message, "f.py:p", "a/1")


@pytest.mark.parametrize("bad", ["1.0", float("nan"), [1.0]])
def test_a_parse_function_must_return_a_finite_number_or_none(bad: Any) -> None:
    with pytest.raises(JudgeParseError, match="return a finite number, or None"):
        judge_scores(["x"], ["a/0"], parse=lambda v: bad, label="m:p", on_parse_error=0)


def test_parse_functions_load_like_reward_functions(tmp_path: Path) -> None:
    cfg = load_config(None, ["models.judge=/judge", f"reward.judge.template={INLINE}"])
    assert cfg.reward.judge is not None and cfg.reward.judge.parse.path is None
    assert load_parse_function(cfg.reward.judge.parse) is yes_no  # the default, no path needed
    parse = tmp_path / "parse.py"
    parse.write_text("def score_of(verdict):\n    return float(len(verdict))\n")
    spec = load_config(
        None,
        [
            "models.judge=/judge",
            f"reward.judge.template={INLINE}",
            f"reward.judge.parse={{path: {parse}, name: score_of}}",
        ],
    ).reward.judge
    assert spec is not None and load_parse_function(spec.parse)("abc") == 3.0
    unknown = spec.parse.model_copy(update={"path": None, "name": "first_word"})
    with pytest.raises(RewardFunctionLoadError, match=r"reward\.judge\.parse\.name.*last_number"):
        load_parse_function(unknown)


# ---------------------------------------------------------------------------- settings
def test_the_judge_needs_its_model_and_its_settings_together() -> None:
    with pytest.raises(ConfigError, match=r"set models\.judge") as info:
        load_config(None, [f"reward.judge.template={INLINE}"])
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"set reward\.judge\.template"):
        load_config(None, ["models.judge=/judge"])
    with pytest.raises(ConfigError, match=r"reward\.judge\.template"):
        load_config(None, ["models.judge=/judge", "reward.judge.weight=2"])


def test_an_inline_template_must_render_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match="'answer' is undefined"):
        load_config(None, ["models.judge=/judge", "reward.judge.template='{{ answer }}'"])
    with pytest.raises(ConfigError, match="does not compile"):
        load_config(None, ["models.judge=/judge", "reward.judge.template='{{ question '"])
    with pytest.raises(JudgeTemplateError, match="empty message"):
        check_template("{% if false %}{{ question }}{% endif %}")


def test_a_judge_alone_is_a_reward() -> None:
    cfg = load_config(
        None, ["models.policy=/p", "models.judge=/judge", f"reward.judge.template={INLINE}"]
    )
    assert cfg.reward.judge is not None and not cfg.uses_reward_model


def test_a_template_file_is_checked_with_the_inputs(assets: Any, tmp_path: Path) -> None:
    judge = build_tiny_judge(tmp_path / "judge")
    overrides = [f"models.judge={judge}", f"models.reward_model={assets.reward_model}"]
    with pytest.raises(InputError, match=r"reward\.judge\.template=.*no such file"):
        check_inputs(load_config(None, [*overrides, f"reward.judge.template={tmp_path / 'x'}"]))
    template = tmp_path / "judge.jinja"
    template.write_text("{{ question }} {{ reponse }}")
    with pytest.raises(InputError, match="'reponse' is undefined"):
        check_inputs(load_config(None, [*overrides, f"reward.judge.template={template}"]))
    template.write_text(PROMPT_TEMPLATE)
    check_inputs(load_config(None, [*overrides, f"reward.judge.template={template}"]))


def test_the_question_is_the_last_user_message() -> None:
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "1"},
        {"role": "user", "content": "second"},
    ]
    assert question_text(chat) == "second"
    assert question_text("plain text") == "plain text"
    assert question_text([{"role": "system", "content": "only"}]) == "only"


# ---------------------------------------------------------------------------- the score task
class StandInJudges:
    """Stands in for the scoring ``WorkerGroup``: the reward model scores 1 everywhere and the
    judge answers ``verdicts``."""

    def __init__(self, verdicts: list[str]) -> None:
        self.verdicts = verdicts
        self.asked: dict[str, Any] = {}

    def run_on_keys(self, step: Any, meta: BatchMeta, **kwargs: Any) -> list[ShardScores]:
        self.asked = kwargs
        n = len(meta.keys)
        return [
            ShardScores(
                response_lengths=[2] * n,
                response_truncated=[False] * n,
                rm=[1.0] * n,
                rule=[0.0] * n,  # the built-in task's honest metric, at weight 0
                verdicts=list(self.verdicts),
            )
        ]


def _judged_ctx(verdicts: list[str], *extra: str) -> tuple[StageContext, StandInJudges]:
    cfg = load_config(
        None,
        [
            "store.get_timeout_s=0.1",
            "models.judge=/judge",
            f"reward.judge.template={INLINE}",
            "reward.judge.weight=0.5",
            "reward.judge.on_parse_error=-1",
            *extra,
        ],
    )
    workers = StandInJudges(verdicts)
    store = open_store("memory://")
    rt = Runtime(store=store, train_group=workers, rollout_group=workers, reward_group=workers)
    return StageContext(cfg=cfg, rt=rt, tokenizer=None), workers


def test_the_score_task_weighs_the_judge_in_and_writes_its_verdicts() -> None:
    verdicts = ["yes", "No.", "maybe", "Yes!"]
    ctx, workers = _judged_ctx(verdicts)
    keys = tuple(f"u{i}/0" for i in range(4))
    out = score(ctx, BatchMeta("train/step-000002", keys, ()), 2)
    assert workers.asked["judge"] is True and workers.asked["model"] is True
    assert {"scores", "reward_parts", "judge_verdicts", "rm_scores"} <= set(out.meta.fields)
    written = ctx.rt.store.get_fields(
        out.meta, ("scores", "reward_parts", "judge_verdicts"), timeout=1.0
    )
    # rm 1.0 at weight 1, judge 1 / 0 / on_parse_error -1 / 1 at weight 0.5.
    torch.testing.assert_close(written["scores"], torch.tensor([1.5, 1.0, 0.5, 1.5]))
    assert [p["judge"] for p in written["reward_parts"]] == [1.0, 0.0, -1.0, 1.0]
    assert written["judge_verdicts"] == verdicts
    assert out.metrics["reward/judge/mean"] == pytest.approx(0.25)
    assert out.metrics["reward/judge/parse_failures"] == pytest.approx(0.25)  # a fraction


def test_a_raising_parse_function_fails_the_score_task_writing_nothing(tmp_path: Path) -> None:
    parse = tmp_path / "strict.py"
    parse.write_text(
        "def strict(verdict):\n"
        "    if verdict not in ('yes', 'no'):\n"
        "        raise ValueError(f'cannot read {verdict!r}')\n"
        "    return 1.0 if verdict == 'yes' else 0.0\n"
    )
    ctx, _ = _judged_ctx(["yes", "perhaps"], f"reward.judge.parse={{path: {parse}, name: strict}}")
    meta = BatchMeta("train/step-000003", ("a/0", "a/1"), ())
    with pytest.raises(JudgeParseError, match=rf"{parse}:strict raised on sample 'a/1'"):
        score(ctx, meta, 3)
    assert ctx.rt.store.kv_list(meta.partition_id) == {}  # nothing written


# ---------------------------------------------------------------------------- on a worker
@pytest.fixture(scope="module")
def judge_worker(assets: Any, tmp_path_factory: pytest.TempPathFactory) -> ModelWorker:
    judge = build_tiny_judge(tmp_path_factory.mktemp("judge") / "judge")
    cfg = load_config(
        None,
        [
            f"models.judge={judge}",
            f"reward.judge.template={INLINE}",
            "reward.judge.max_new_tokens=6",
        ],
    )
    spec = WorkerSpec(
        roles=("rollout", "reward", "judge"),
        cfg=cfg,
        policy_path=str(assets.policy),
        tokenizer_path=str(assets.tokenizer),
        reward_model_path=str(assets.reward_model),
        judge_path=str(judge),
        judge_template=INLINE.strip("'"),
        store_url="memory://test-judge",
    )
    return ModelWorker(spec)


def test_the_judge_answers_on_its_worker_after_the_reward_model_sleeps(
    judge_worker: ModelWorker,
) -> None:
    store = open_store("memory://test-judge")
    keys = ("p0/0", "p0/1", "p1/0")
    prompt = judge_worker.tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+34="}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    store.kv_batch_put(
        list(keys),
        "judge/1",
        {
            "prompt_ids": [torch.tensor(prompt)] * 3,
            "response_ids": [
                torch.tensor([7, 8]),
                torch.tensor([9]),
                torch.tensor([], dtype=torch.int64),
            ],
            "raw_prompt": [[{"role": "user", "content": "12+34="}]] * 3,
            "ground_truth": ["46", "46", "46"],
            "data_source": ["addition"] * 3,
        },
    )
    reply = judge_worker.run(
        score_rows, BatchMeta("judge/1", keys), rule="exact_match", texts=True, judge=True
    )
    # The tiny judge answers "yes" whatever it reads (tests/judge_assets.py).
    assert reply.verdicts == ["yes", "yes", "yes"] and reply.rm is not None
    assert reply.rule is not None and len(reply.texts or ()) == 3
    assert judge_worker.awake_roles() == []
    stats = judge_worker.timing()
    assert "timing_s/wake/judge" in stats and "timing_s/wake/reward" in stats


def test_a_worker_without_a_judge_refuses_to_judge(judge_worker: ModelWorker) -> None:
    spec = judge_worker.spec
    judge_worker.spec = replace(spec, roles=("rollout",))
    try:
        with pytest.raises(ValueError, match="holds none"):
            score_rows(
                judge_worker, BatchMeta("judge/2", ("x/0",)), rule=None, texts=False, judge=True
            )
    finally:
        judge_worker.spec = spec


def test_two_callers_in_one_worker_take_turns(judge_worker: ModelWorker) -> None:
    """Two threads wake two roles of one worker at once (as the producer's score and the
    trainer's update would on a threaded actor): each waits for the other's block to end, and
    never sees another model awake."""
    seen: dict[str, list[list[str]]] = {"reward": [], "judge": []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def turns(role: Any) -> None:
        try:
            start.wait()
            for _ in range(5):
                with judge_worker.awake(role):
                    time.sleep(0.01)
                    seen[role].append(judge_worker.awake_roles())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=turns, args=(role,)) for role in seen]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert seen == {"reward": [["reward"]] * 5, "judge": [["judge"]] * 5}
    assert judge_worker.awake_roles() == []


# ---------------------------------------------------------------------------- where it runs
@pytest.mark.parametrize(
    ("mode", "pool", "train_roles", "own_pool"),
    [
        ("sync", "colocated", ("rollout", "reward", "judge", "actor", "ref"), ()),
        ("sync", "own", ("rollout", "actor", "ref"), ("reward", "judge")),
        ("separate_async", "colocated", ("reward", "judge", "actor", "ref"), ()),
        ("separate_async", "own", ("actor", "ref"), ("reward", "judge")),
    ],
)
def test_the_judge_wakes_where_the_reward_model_does(
    mode: str, pool: str, train_roles: tuple[str, ...], own_pool: tuple[str, ...]
) -> None:
    """separate_async never puts a scoring model beside the rollout: colocated, the reward model
    and the judge join the training pool; own, they get a pool of their own."""
    from flows.runtime import _reward_roles, _train_roles

    cfg = load_config(
        None,
        [
            "models.reward_model=/rm",
            "models.judge=/judge",
            f"reward.judge.template={INLINE}",
            f"resources.mode={mode}",
            f"reward.pool={pool}",
        ],
    )
    assert _train_roles(cfg) == train_roles
    assert (_reward_roles(cfg) if pool == "own" else ()) == own_pool


def test_validation_and_saved_samples_name_the_parts_alike() -> None:
    from tasks.score.stage import Scores

    scores = Scores(
        total=torch.tensor([1.0, 0.0]),
        response_lengths=torch.tensor([2, 3]),
        response_truncated=torch.tensor([False, False]),
        named={
            "rm": torch.tensor([0.5, -0.5]),
            "judge": torch.tensor([1.0, 0.0]),
            "rule": torch.tensor([1.0, 1.0]),
        },
    )
    # validation reports named_parts; a saved sample's reward_parts hold the same, per sample
    assert scores.named_parts() == {"rm": [0.5, -0.5], "judge": [1.0, 0.0], "rule": [1.0, 1.0]}
    assert scores.parts()[1] == {"rm": -0.5, "judge": 0.0, "rule": 1.0}
