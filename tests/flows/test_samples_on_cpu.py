"""Every rollout visible: a step's samples read from a real in-process store and decoded with the
tiny character tokenizer, the jsonl files (atomic, limited, read back), ``ppoflow samples``, the
``<name>-samples`` table artifact on the test harness API, and (slow) the tiny deployment run's
files and artifact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from prefect import flow
from prefect.artifacts import Artifact

from flows.cli import main
from flows.report import SAMPLE_ROWS, RunReport
from flows.samples import (
    TABLE_TEXT_CHARS,
    chosen_rows,
    collect_samples,
    drop_samples_from,
    read_samples,
    samples_path,
    samples_table,
    save_step_samples,
    saved_steps,
    write_samples,
)
from infra.config import ConfigError, TrainConfig, build_config, load_config
from infra.runtime import Runtime
from storage import BatchMeta, open_store
from tasks.context import StageContext

PARTITION = "train/step-000007"
CONTRACT_KEYS = {
    "step",
    "uid",
    "group",
    "data_source",
    "prompt",
    "response",
    "messages",
    "response_ids",
    "loss_mask",
    "score",
    "num_turns",
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from infra.assets import build_char_tokenizer

    return build_char_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def context(tokenizer: Any, *overrides: str) -> StageContext:
    """A stage context over a fresh in-process store (no worker groups: nothing here runs one)."""
    store = open_store("memory://")
    rt = Runtime(store=store, train_group=None, rollout_group=None)  # type: ignore[arg-type]
    return StageContext(cfg=load_config(None, list(overrides)), rt=rt, tokenizer=tokenizer)


def put_batch(ctx: StageContext, tokenizer: Any, **extra: Any) -> BatchMeta:
    """Three groups of two, interleaved in batch order (a0 b0 a1 b1 c0 c1), as the generate and
    score stages leave them; responses end in EOS."""
    keys = ["a/0", "b/0", "a/1", "b/1", "c/0", "c/1"]
    texts = ["12", "7", "13", "8", "100", ""]
    eos = tokenizer.eos_token_id
    ids = [torch.tensor([*tokenizer.encode(t, add_special_tokens=False), eos]) for t in texts]
    prompts = {"a": "5+7=?", "b": "3+4=?", "c": "50+50=?"}
    fields = {
        "raw_prompt": [[{"role": "user", "content": prompts[k[0]]}] for k in keys],
        "data_source": ["addition"] * 6,
        "group_ids": torch.tensor([0, 1, 0, 1, 2, 2]),
        "response_ids": ids,
        "scores": torch.tensor([1.0, 1.0, 0.25, 0.0, 0.5, -1.0]),
        **extra,
    }
    ctx.rt.store.kv_batch_put(keys, PARTITION, fields)
    return BatchMeta(PARTITION, tuple(keys), tuple(fields))


# ---------------------------------------------------------------------- from the store
def test_whole_groups_come_first_in_batch_order() -> None:
    # Groups appear in the order 0, 1, 2: group 0 is rows 0 and 2, group 1 rows 1 and 3.
    groups = [0, 1, 0, 1, 2, 2]
    assert chosen_rows(groups, 6) == [0, 2, 1, 3, 4, 5]
    assert chosen_rows(groups, 3) == [0, 2, 1]
    assert chosen_rows(groups, 100) == chosen_rows(groups, 6)


def test_collect_samples_reads_decodes_and_keeps_the_stored_scores(tokenizer: Any) -> None:
    ctx = context(tokenizer)
    parts = [{"rm": s, "rule": 1.0, "overlong_penalty": 0.0} for s in (1.0, 1.0, 0.25, 0, 0.5, -1)]
    meta = put_batch(ctx, tokenizer, reward_parts=parts)
    samples = collect_samples(ctx, meta, 7, limit=3)
    assert [s["uid"] for s in samples] == ["a/0", "a/1", "b/0"]  # group 0 whole, then group 1
    first = samples[0]
    assert CONTRACT_KEYS | {"rm", "rule", "overlong_penalty", "rewards"} == set(first)
    assert first["step"] == 7 and first["group"] == 0 and first["data_source"] == "addition"
    assert [s["score"] for s in samples] == [1.0, 0.25, 1.0]  # the stored scores
    assert (first["rm"], first["rule"], first["overlong_penalty"]) == (1.0, 1.0, 0.0)
    assert first["rewards"] == {"rm": 1.0, "rule": 1.0, "overlong_penalty": 0.0}
    assert first["prompt"] == "5+7=?" and first["response"] == "12"  # EOS skipped
    assert first["messages"] == [
        {"role": "user", "content": "5+7=?"},
        {"role": "assistant", "content": "12"},
    ]
    assert first["response_ids"][-1] == tokenizer.eos_token_id and len(first["response_ids"]) == 3
    assert first["loss_mask"] == [True, True, True]  # single turn: every token
    assert first["num_turns"] == 1 and "judge_verdict" not in first
    json.dumps(samples)  # plain JSON values only


def test_fields_the_partition_holds_are_used_and_absent_ones_skipped(tokenizer: Any) -> None:
    ctx = context(tokenizer)
    masks = [torch.tensor([True] * (n - 1) + [False]) for n in (3, 2, 3, 2, 4, 1)]
    meta = put_batch(
        ctx,
        tokenizer,
        loss_mask=masks,
        num_turns=torch.tensor([1, 1, 2, 1, 3, 1]),
        judge_verdicts=["yes", "no", "yes", "no", "maybe", "no"],
    )
    samples = collect_samples(ctx, meta, 7, limit=6)
    by_uid = {s["uid"]: s for s in samples}
    assert by_uid["a/0"]["loss_mask"] == [True, True, False]
    assert by_uid["a/1"]["num_turns"] == 2 and by_uid["c/0"]["num_turns"] == 3
    assert by_uid["c/0"]["judge_verdict"] == "maybe"
    assert by_uid["c/1"]["response"] == "" and by_uid["c/1"]["response_ids"] != []
    assert "rewards" in by_uid["a/0"] and by_uid["a/0"]["rewards"] == {}  # no reward_parts


def test_save_step_samples_follows_the_config(tokenizer: Any, tmp_path: Path) -> None:
    ctx = context(tokenizer, "trainer.samples_per_step=4")
    meta = put_batch(ctx, tokenizer)
    path = save_step_samples(ctx, meta, 7, tmp_path)
    assert path == tmp_path / "samples" / "step_7.jsonl"
    assert [s["uid"] for s in read_samples(tmp_path, 7)] == ["a/0", "a/1", "b/0", "b/1"]
    # A step that kept no group (dynamic sampling): an empty file, printed as such.
    assert collect_samples(ctx, BatchMeta(PARTITION, ()), 8, limit=4) == []
    assert save_step_samples(ctx, BatchMeta(PARTITION, ()), 8, tmp_path) is not None
    assert read_samples(tmp_path) == [] and saved_steps(tmp_path) == [7, 8]
    off = context(tokenizer, "trainer.save_samples=false")
    assert save_step_samples(off, put_batch(off, tokenizer), 7, tmp_path / "off") is None
    assert not (tmp_path / "off").exists()


def test_config_defaults_and_bounds() -> None:
    trainer = TrainConfig().trainer
    assert trainer.save_samples is True and trainer.samples_per_step == 64
    with pytest.raises(ConfigError, match="samples_per_step"):
        load_config(None, ["trainer.samples_per_step=0"])


# ---------------------------------------------------------------------- files
def fake_samples(step: int, n: int, *, text: str = "x") -> list[dict[str, Any]]:
    return [
        {
            "step": step,
            "uid": f"p{i // 2}/{i % 2}",
            "group": i // 2,
            "data_source": "addition",
            "score": 0.5 * i,
            "rewards": {"rm": 0.5 * i},
            "rm": 0.5 * i,
            "num_turns": 1,
            "prompt": f"prompt {i}",
            "response": f"{text} {i}",
            "messages": [],
            "response_ids": [i],
            "loss_mask": [True],
        }
        for i in range(n)
    ]


def test_write_then_read_with_a_limit_and_the_latest_step(tmp_path: Path) -> None:
    write_samples(tmp_path, 3, fake_samples(3, 5))
    path = write_samples(tmp_path, 12, fake_samples(12, 4))
    assert path.name == "step_12.jsonl" and path == samples_path(tmp_path, 12)
    assert saved_steps(tmp_path) == [3, 12]
    assert read_samples(tmp_path) == fake_samples(12, 4)  # the latest
    assert read_samples(tmp_path, 3, limit=2) == fake_samples(3, 2)
    assert len(path.read_text().splitlines()) == 4  # one JSON object a line


def test_rewriting_a_step_replaces_the_file_whole(tmp_path: Path) -> None:
    path = write_samples(tmp_path, 2, fake_samples(2, 6, text="first"))
    once = path.read_bytes()
    # A write that died midway leaves only its temporary file, which nothing reads.
    path.with_name(path.name + ".tmp").write_text('{"step": 2, "uid": "half')
    assert read_samples(tmp_path) == fake_samples(2, 6, text="first")
    # The retried step writes the same samples: the same bytes, no temporary file left.
    write_samples(tmp_path, 2, fake_samples(2, 6, text="first"))
    assert path.read_bytes() == once
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    write_samples(tmp_path, 2, fake_samples(2, 3, text="second"))
    assert read_samples(tmp_path, 2) == fake_samples(2, 3, text="second")


def test_files_of_an_interrupted_attempt_are_dropped_on_resume(tmp_path: Path) -> None:
    for step in range(4):
        write_samples(tmp_path, step, fake_samples(step, 1))
    drop_samples_from(tmp_path, 2)
    assert saved_steps(tmp_path) == [0, 1]


def test_samples_table_cuts_long_texts() -> None:
    (row,) = samples_table(fake_samples(0, 1, text="y" * 1000))
    assert set(row) == {"prompt", "response", "score", "turns"}
    assert len(row["response"]) == TABLE_TEXT_CHARS and row["response"].endswith("…")
    assert row["prompt"] == "prompt 0" and row["turns"] == 1


# ---------------------------------------------------------------------- ppoflow samples
def test_cli_prints_the_latest_step_or_the_one_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_samples(tmp_path, 0, fake_samples(0, 3))
    write_samples(tmp_path, 1, fake_samples(1, 3, text="later"))
    assert main(["samples", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 1: 3 sample(s)") and "later 2" in out
    assert "p0/1  group 0  score 0.5 (rm 0.5)  turns 1" in out
    assert "prompt:   prompt 1" in out and "response: later 1" in out
    assert main(["samples", str(tmp_path), "--step", "0", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 0: 1 sample(s)") and "x 0" in out and "x 1" not in out


def test_cli_missing_run_dir_or_step_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["samples", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such run folder" in err
    assert main(["samples", str(tmp_path)]) == 2
    assert "no samples saved" in capsys.readouterr().err
    write_samples(tmp_path, 4, fake_samples(4, 1))
    assert main(["samples", str(tmp_path), "--step", "9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no samples of step 9 (saved: steps 4-4)" in err


# ---------------------------------------------------------------------- the artifact
def test_samples_artifact_shows_the_latest_step(prefect_harness: None, tmp_path: Path) -> None:
    @flow(name="report-samples")
    def run() -> None:
        report = RunReport(
            tmp_path, "Samples_Run", 3, start_step=0, progress_bar=False, artifact_interval_s=3600
        )
        report.start(0)
        for step in range(3):
            write_samples(tmp_path, step, fake_samples(step, SAMPLE_ROWS + 8, text=f"s{step}"))
            report.log(step, {"critic/score/mean": float(step)})
        report.close()

    run()
    table = Artifact.get("samples-run-samples")
    assert table is not None and table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert len(rows) == SAMPLE_ROWS
    assert set(rows[0]) == {"prompt", "response", "score", "turns"}
    assert rows[1]["response"] == "s2 1" and rows[1]["score"] == 0.5  # the last step's


# ---------------------------------------------------------------------- a real run (slow)
@pytest.mark.slow
def test_tiny_run_writes_every_steps_samples(prefect_api: Any, tiny_run: Any) -> None:
    cfg = build_config(tiny_run.parameters["config"])
    metrics = {
        row["step"]: row
        for row in map(json.loads, (tiny_run.run_dir / "metrics.jsonl").read_text().splitlines())
    }
    assert {0, 1} <= set(saved_steps(tiny_run.run_dir))
    for step in (0, 1):
        samples = read_samples(tiny_run.run_dir, step)
        assert len(samples) == min(cfg.batch_size, cfg.trainer.samples_per_step)
        for s in samples:
            assert set(s) >= CONTRACT_KEYS and s["step"] == step
            assert s["messages"][-1] == {"role": "assistant", "content": s["response"]}
            assert len(s["loss_mask"]) == len(s["response_ids"]) and s["num_turns"] == 1
            if "rm" in s:  # the stored score is the weighted sum of the stored parts
                weighted = cfg.reward.model_weight * s["rm"] - s["overlong_penalty"]
                weighted += cfg.reward.rule_weight * s.get("rule", 0.0)
                assert s["score"] == pytest.approx(weighted, abs=1e-5)
        # Every sample of the step: their mean is the score task's critic/score/mean.
        mean = sum(s["score"] for s in samples) / len(samples)
        assert mean == pytest.approx(metrics[step]["critic/score/mean"], abs=1e-5)
    table = Artifact.get(f"{tiny_run.run_name}-samples")
    assert table is not None and table.flow_run_id is not None and table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert rows and set(rows[0]) == {"prompt", "response", "score", "turns"}
