"""Users' prompt files in verl's RL layout: reading, key mapping, errors, rendering, the cursor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import PreTrainedTokenizerFast

from infra.assets import build_char_tokenizer
from infra.config import DataConfig
from infra.data import (
    DataError,
    PromptDataset,
    PromptRow,
    PromptTooLongError,
    make_addition_dataset,
    read_prompt_rows,
    read_rl_rows,
    render_prompts,
    write_addition_verl,
)

MESSAGE = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])
VERL_SCHEMA = pa.schema(
    [
        pa.field("data_source", pa.string()),
        pa.field("prompt", pa.list_(MESSAGE)),
        pa.field("ability", pa.string()),
        pa.field(
            "reward_model",
            pa.struct([pa.field("style", pa.string()), pa.field("ground_truth", pa.string())]),
        ),
        pa.field(
            "extra_info",
            pa.struct([pa.field("split", pa.string()), pa.field("index", pa.int64())]),
        ),
    ]
)


def _write_verl(path: Path, contents: list[str], answers: list[str]) -> Path:
    table = pa.Table.from_pydict(
        {
            "data_source": ["openai/gsm8k"] * len(contents),
            "prompt": [
                [{"role": "system", "content": "be brief"}, {"role": "user", "content": c}]
                for c in contents
            ],
            "ability": ["math"] * len(contents),
            "reward_model": [{"style": "rule", "ground_truth": a} for a in answers],
            "extra_info": [{"split": "train", "index": i} for i in range(len(contents))],
        },
        schema=VERL_SCHEMA,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    return build_char_tokenizer(tmp_path_factory.mktemp("char-tokenizer"))


def _user_rows(contents: list[str]) -> list[PromptRow]:
    return [
        PromptRow(
            uid=f"r-{i}",
            raw_prompt=[{"role": "user", "content": c}],
            ground_truth="0",
            origin=f"made.jsonl row {i}",
        )
        for i, c in enumerate(contents)
    ]


# ---------------------------------------------------------------- reading


def test_verl_parquet_reads_as_it_is(tmp_path: Path) -> None:
    path = _write_verl(tmp_path / "gsm.parquet", ["1+1=", "2+2="], ["2", "4"])
    rows = read_rl_rows([path], DataConfig())
    assert [row.uid for row in rows] == ["gsm-0", "gsm-1"]
    first = rows[1]
    assert first.raw_prompt == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2="},
    ]
    assert first.ground_truth == "4"
    assert first.data_source == "openai/gsm8k"
    assert first.extra_info == {"split": "train", "index": 1}
    assert first.prompt_ids == ()
    assert first.origin == f"{path} row 1"


def test_jsonl_with_plain_string_prompts_and_mapped_keys(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "qa.jsonl",
        [{"question": "10+5=", "answer": 15}, {"question": "3+4=", "answer": 7}],
    )
    data = DataConfig(prompt_key="question", ground_truth_key="answer")
    rows = read_rl_rows([path], data)
    assert rows[0].raw_prompt == [{"role": "user", "content": "10+5="}]
    assert [row.ground_truth for row in rows] == [15, 7]  # kept as read: numbers stay numbers
    assert {row.data_source for row in rows} == {"qa"}  # no data_source column: the file's stem
    assert rows[1].extra_info == {}  # no extra_info column
    assert rows[1].origin == f"{path} row 1"


def test_ground_truth_keeps_lists_and_files_concatenate_in_order(tmp_path: Path) -> None:
    multi = _write_jsonl(tmp_path / "multi.json", [{"prompt": "a", "answers": ["x", "y"]}])
    single = _write_jsonl(tmp_path / "single.jsonl", [{"prompt": "b", "answers": ["z"]}])
    rows = read_rl_rows([single, multi], DataConfig(ground_truth_key="answers"))
    assert [row.ground_truth for row in rows] == [["z"], ["x", "y"]]
    assert [row.uid for row in rows] == ["single-0", "multi-0"]


def test_dotted_keys_prefer_a_literal_column_then_walk_structs(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "nested.jsonl",
        [
            {
                "prompt": "q",
                "reward_model.ground_truth": "literal",
                "reward_model": {"ground_truth": "nested"},
                "meta": {"source": {"name": "deep"}, "info": {"level": 3}},
            }
        ],
    )
    (row,) = read_rl_rows([path], DataConfig())
    assert row.ground_truth == "literal"
    data = DataConfig(data_source_key="meta.source.name", extra_info_key="meta.info")
    (row,) = read_rl_rows([path], data)
    assert row.data_source == "deep" and row.extra_info == {"level": 3}
    without_literal = _write_jsonl(
        tmp_path / "plain.jsonl", [{"prompt": "q", "reward_model": {"ground_truth": "nested"}}]
    )
    (row,) = read_rl_rows([without_literal], DataConfig())
    assert row.ground_truth == "nested"


def test_uids_are_distinct_without_slashes_when_stems_repeat(tmp_path: Path) -> None:
    a = _write_verl(tmp_path / "a" / "train.parquet", ["1+1=", "1+2="], ["2", "3"])
    b = _write_verl(tmp_path / "b" / "train.parquet", ["2+1="], ["3"])
    odd = _write_verl(tmp_path / "my data@v2.parquet", ["3+1="], ["4"])
    rows = read_rl_rows([a, b, odd], DataConfig())
    uids = [row.uid for row in rows]
    assert uids == ["train~0-0", "train~0-1", "train~1-0", "my_data_v2-0"]
    assert not any("/" in uid or "@" in uid for uid in uids)
    # Reading again gives the same uids (they are stable per file position and row).
    assert [row.uid for row in read_rl_rows([a, b, odd], DataConfig())] == uids


# ---------------------------------------------------------------- reading errors


def test_missing_columns_name_the_file_and_the_setting(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "qa.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(DataError, match=r"qa\.jsonl has no column 'prompt'.*data\.prompt_key"):
        read_rl_rows([path], DataConfig())
    with pytest.raises(
        DataError, match=r"qa\.jsonl.*'reward_model\.ground_truth'.*ground_truth_key"
    ):
        read_rl_rows([path], DataConfig(prompt_key="question"))


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("absent.parquet", None, r"absent\.parquet does not exist.*data\.val_files"),
        ("prompts.csv", "a,b\n", r"prompts\.csv: unknown extension '\.csv' in data\.val_files"),
        ("empty.jsonl", "", r"empty\.jsonl is empty.*data\.val_files"),
        (
            "array.json",
            '[{"prompt": "x"}]',
            r"array\.json is not readable as JSON Lines.*val_files",
        ),
    ],
)
def test_unusable_files_name_the_file_and_the_setting(
    tmp_path: Path, name: str, content: str | None, expected: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=expected) as caught:
        read_rl_rows([path], DataConfig(), setting="data.val_files")
    assert "\n" not in str(caught.value)


def test_a_parquet_file_without_rows_is_an_error(tmp_path: Path) -> None:
    path = _write_verl(tmp_path / "none.parquet", [], [])
    with pytest.raises(DataError, match=r"none\.parquet has no rows.*data\.train_files"):
        read_rl_rows([path], DataConfig())
    with pytest.raises(DataError, match="data.train_files is empty"):
        read_rl_rows([], DataConfig())


def test_a_prompt_that_is_not_messages_names_its_row(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"prompt": [{"role": "user", "content": "ok"}], "answer": "1"},
            {"prompt": [], "answer": "2"},
        ],
    )
    with pytest.raises(DataError, match=r"bad\.jsonl row 1: the prompt.*data\.prompt_key"):
        read_rl_rows([path], DataConfig(ground_truth_key="answer"))


# ---------------------------------------------------------------- rendering


def test_render_fills_prompt_ids_with_the_chat_template(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    rendered = render_prompts(
        _user_rows(["12+34="]), tokenizer, max_prompt_length=64, truncation="error"
    )
    (row,) = rendered.rows
    # <bos> <|user|> 1 2 + 3 4 = <|assistant|>: the template's markers around 6 characters.
    expected = tokenizer.convert_tokens_to_ids(["<bos>", "<|user|>", *"12+34=", "<|assistant|>"])
    assert list(row.prompt_ids) == expected
    assert (rendered.truncated, rendered.dropped, rendered.longest) == (0, 0, 9)


def test_render_accepts_a_tokenizer_that_returns_a_plain_list() -> None:
    class ListTokenizer:
        chat_template = "any"

        def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> list[int]:
            return [len(m["content"]) for m in messages]

    rendered = render_prompts(
        _user_rows(["abc"]), ListTokenizer(), max_prompt_length=4, truncation="error"
    )
    assert rendered.rows[0].prompt_ids == (3,)


def test_truncation_error_names_the_row_its_length_and_both_settings(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    rows = _user_rows(["1+1=", "12345+67890="])  # 7 and 15 tokens rendered
    with pytest.raises(PromptTooLongError) as caught:
        render_prompts(rows, tokenizer, max_prompt_length=10, truncation="error")
    message = str(caught.value)
    for part in ("made.jsonl row 1", "15 tokens", "data.max_prompt_length=10", "data.truncation"):
        assert part in message


def test_truncation_left_keeps_the_end_and_counts(tokenizer: PreTrainedTokenizerFast) -> None:
    rows = _user_rows(["1+1=", "12345+67890=", "99999+99999="])
    full = render_prompts(rows, tokenizer, max_prompt_length=64, truncation="error").rows
    rendered = render_prompts(rows, tokenizer, max_prompt_length=10, truncation="left")
    assert (rendered.truncated, rendered.dropped, rendered.longest) == (2, 0, 10)
    assert rendered.rows[0].prompt_ids == full[0].prompt_ids  # short prompt untouched
    assert rendered.rows[1].prompt_ids == full[1].prompt_ids[-10:]  # ends on <|assistant|>


def test_truncation_drop_skips_and_counts(tokenizer: PreTrainedTokenizerFast) -> None:
    rows = _user_rows(["1+1=", "12345+67890=", "2+2="])
    rendered = render_prompts(rows, tokenizer, max_prompt_length=10, truncation="drop")
    assert [row.uid for row in rendered.rows] == ["r-0", "r-2"]
    assert (rendered.truncated, rendered.dropped, rendered.longest) == (0, 1, 7)
    with pytest.raises(DataError, match="all 1 prompts of data.val_files"):
        render_prompts(
            rows[1:2], tokenizer, max_prompt_length=10, truncation="drop", setting="data.val_files"
        )


def test_a_tokenizer_without_chat_template_names_the_model_settings(tmp_path: Path) -> None:
    bare = build_char_tokenizer(tmp_path / "bare")
    bare.chat_template = None
    with pytest.raises(DataError, match=r"no chat template.*models\.tokenizer.*models\.policy"):
        render_prompts(_user_rows(["1+1="]), bare, max_prompt_length=8, truncation="error")


# ---------------------------------------------------------------- the cursor over these rows


def _dataset_rows(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> list[PromptRow]:
    path = _write_verl(
        tmp_path / "gsm.parquet", [f"{i}+{i}=" for i in range(7)], [str(2 * i) for i in range(7)]
    )
    rows = read_rl_rows([path], DataConfig())
    return list(render_prompts(rows, tokenizer, max_prompt_length=64, truncation="error").rows)


def test_cursor_resume_serves_the_same_rows(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    rows = _dataset_rows(tmp_path, tokenizer)
    original = PromptDataset.from_rows(rows, seed=5, name="data.train_files")
    for _ in range(4):
        original.next_batch(3)  # 12 rows: ends mid-epoch 1
    resumed = PromptDataset.from_rows(rows, seed=5)
    resumed.load_state_dict(original.state_dict())
    for _ in range(6):
        assert resumed.next_batch(4) == original.next_batch(4)  # every field, prompt_ids too
    with pytest.raises(ValueError, match="seed"):
        PromptDataset.from_rows(rows, seed=6).load_state_dict(original.state_dict())


def test_uids_stay_distinct_across_an_epoch_wrap(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    rows = _dataset_rows(tmp_path, tokenizer)
    dataset = PromptDataset.from_rows(rows, seed=0, shuffle=False, name="gsm")
    assert [row.uid for row in dataset.next_batch(5)] == [f"gsm-{i}" for i in range(5)]
    # 5, 6 end epoch 0; 0, 1, 2 open epoch 1 and carry its tag.
    wrapped = [row.uid for row in dataset.next_batch(5)]
    assert wrapped == ["gsm-5", "gsm-6", "gsm-0@1", "gsm-1@1", "gsm-2@1"]
    for _ in range(20):
        batch = dataset.next_batch(7)  # a whole-dataset batch straddles two epochs every time
        assert len({row.uid for row in batch}) == 7
        assert not any("/" in row.uid for row in batch)
    with pytest.raises(DataError, match=r"batch of 8 prompts is larger than the 7 rows of gsm"):
        dataset.next_batch(8)
    with pytest.raises(DataError, match="empty has no rows"):
        PromptDataset.from_rows([], seed=0, name="empty")


# ---------------------------------------------------------------- the addition task in verl's layout


def test_write_addition_verl_round_trips_with_the_default_keys(tmp_path: Path) -> None:
    train_path, test_path = write_addition_verl(tmp_path / "verl", seed=3, heldout=40)
    assert pq.read_table(test_path).column_names == [
        "data_source",
        "prompt",
        "ability",
        "reward_model",
        "extra_info",
    ]
    assert not list((tmp_path / "verl").glob("*.tmp"))
    _, heldout_path = make_addition_dataset(tmp_path / "plain", seed=3, heldout=40)
    reference = read_prompt_rows(heldout_path)
    test_rows = read_rl_rows([test_path], DataConfig(), setting="data.val_files")
    assert [(r.raw_prompt, r.ground_truth) for r in test_rows] == [
        (r.raw_prompt, r.ground_truth) for r in reference
    ]
    assert test_rows[5].data_source == "addition"
    assert test_rows[5].extra_info == {"split": "test", "index": 5}
    train_rows = read_rl_rows([train_path], DataConfig())
    assert len(train_rows) == 8100 - 40
    assert {r.raw_prompt[0]["content"] for r in train_rows}.isdisjoint(
        r.raw_prompt[0]["content"] for r in test_rows
    )
