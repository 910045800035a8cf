"""Row normalization (OpenAI, ShareGPT, pre-tokenized), rejection reasons, and the input readers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hiddenstates.errors import ConfigError, ExtractionError
from hiddenstates.extract.data import (
    Conversation,
    DataSource,
    Pretokenized,
    RowRejected,
    normalize_row,
    open_data,
    reason_code,
)

ROWS = [
    {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "hello"},
        ]
    },
    {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
]


def test_openai_messages() -> None:
    c = normalize_row(ROWS[0])
    assert isinstance(c, Conversation)
    assert c.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert c.meta == {"row_id": "a"}


@pytest.mark.parametrize(
    "user, assistant",
    [("human", "gpt"), ("user", "assistant"), ("Human", "ChatGPT"), ("prompter", "bot"), ("human", "model")],
)
def test_sharegpt_role_variants(user: str, assistant: str) -> None:
    c = normalize_row(
        {
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": user, "value": "q"},
                {"from": assistant, "value": "a"},
            ]
        }
    )
    assert isinstance(c, Conversation)
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant"]


def test_text_parts_are_joined() -> None:
    c = normalize_row(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "ok"},
            ]
        }
    )
    assert isinstance(c, Conversation) and c.messages[0]["content"] == "ab"


def test_pretokenized() -> None:
    p = normalize_row(ROWS[2])
    assert isinstance(p, Pretokenized)
    assert p.input_ids == [1, 2, 3] and p.loss_mask == [False, True, True]


@pytest.mark.parametrize(
    "row, code",
    [
        ({"messages": []}, "empty_conversation"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no_assistant_turn"),
        (
            {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
            "unknown_role",
        ),
        ({"messages": [{"content": "x"}]}, "unknown_role"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 3}]},
            "non_string_content",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": "u"}]},
                    {"role": "assistant", "content": "y"},
                ]
            },
            "non_string_content",
        ),
        (
            {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]},
            "non_string_content",
        ),
        ({"messages": "hello"}, "bad_messages"),
        ({"messages": ["hello"]}, "bad_messages"),
        ({"text": "plain"}, "unrecognized_row"),
        ([1, 2], "not_an_object"),
        ({"input_ids": [1, 2], "loss_mask": [0, 0]}, "all_zero_mask"),
        ({"input_ids": [1, 2]}, "bad_pretokenized"),
        ({"input_ids": [1, 2], "loss_mask": [1]}, "bad_pretokenized"),
        ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "bad_pretokenized"),
        ({"input_ids": [], "loss_mask": []}, "empty_conversation"),
        ({"input_ids": ["a"], "loss_mask": [1]}, "bad_pretokenized"),
    ],
)
def test_rejections_carry_a_reason(row: object, code: str) -> None:
    with pytest.raises(RowRejected) as e:
        normalize_row(row)
    assert e.value.code == code
    assert reason_code(e.value.reason) == code and e.value.detail


def _write_jsonl(path: Path, rows: list, bad_line: bool = False) -> None:
    lines = [json.dumps(r) for r in rows]
    if bad_line:
        lines.insert(1, "{not json")
    path.write_text("\n".join(lines) + "\n")


def test_jsonl_rows_are_line_numbers_and_bad_json_is_a_reject(tmp_path: Path) -> None:
    p = tmp_path / "chats.jsonl"
    _write_jsonl(p, ROWS, bad_line=True)
    src = open_data(p)
    assert src.name == "chats" and src.kind == "jsonl" and src.num_rows() == 4
    got = list(src)
    assert [r for r, _ in got] == [0, 1, 2, 3]
    with pytest.raises(RowRejected) as e:
        DataSource.unwrap(got[1][1])
    assert e.value.code == "invalid_json"
    assert DataSource.unwrap(got[0][1]) == ROWS[0]


def test_parquet_json_array_and_datasets_folder_agree(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = ROWS[:2]
    pq.write_table(
        pa.Table.from_pylist(
            [{"messages": r.get("messages"), "conversations": r.get("conversations")} for r in rows]
        ),
        tmp_path / "d.parquet",
    )
    (tmp_path / "d.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list([{"messages": r["messages"]} for r in rows[:1]] * 3).save_to_disk(
        str(tmp_path / "disk")
    )
    for path, kind, n in (
        (tmp_path / "d.parquet", "parquet", 2),
        (tmp_path / "d.json", "json", 2),
        (tmp_path / "disk", "datasets-disk", 3),
    ):
        src = open_data(path)
        assert src.kind == kind
        convs = [normalize_row(DataSource.unwrap(rec)) for _, rec in src]
        assert len(convs) == n
        assert all(isinstance(c, Conversation) and c.messages[-1]["content"] == "hello" for c in convs)


def test_datasets_dict_folder_needs_existing_split(tmp_path: Path) -> None:
    import datasets

    d = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([ROWS[0]]), "test": datasets.Dataset.from_list([ROWS[0]])}
    )
    d.save_to_disk(str(tmp_path / "dd"))
    assert open_data(tmp_path / "dd", split="test").name == "dd:test"
    with pytest.raises(ConfigError, match="splits"):
        open_data(tmp_path / "dd", split="validation")


def test_folder_of_files_is_concatenated_in_name_order(tmp_path: Path) -> None:
    d = tmp_path / "parts"
    d.mkdir()
    _write_jsonl(d / "b.jsonl", ROWS[1:2])
    _write_jsonl(d / "a.jsonl", ROWS[:1])
    src = open_data(d)
    assert src.name == "parts" and src.num_rows() == 2
    assert [DataSource.unwrap(r).get("id") for _, r in src] == ["a", None]


def test_hub_dataset_offline_gives_a_clear_error() -> None:
    with pytest.raises(ExtractionError, match="Offline mode is on"):
        open_data("someorg/definitely-not-cached-dataset")


def test_missing_path_is_not_taken_for_a_hub_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        open_data(str(tmp_path / "nope.jsonl"))


def test_default_data_ships_varied_conversations() -> None:
    src = open_data(None)
    rows = [DataSource.unwrap(r) for _, r in src]
    assert 200 <= len(rows) <= 1000
    good, codes = [], set()
    for r in rows:
        try:
            good.append(normalize_row(r))
        except RowRejected as e:
            codes.add(e.code)
    assert codes == {"no_assistant_turn", "unknown_role", "non_string_content", "empty_conversation"}
    turns = {sum(m["role"] == "assistant" for m in c.messages) for c in good if isinstance(c, Conversation)}
    assert {1, 2, 3} <= turns
    assert any(c.messages[0]["role"] == "system" for c in good if isinstance(c, Conversation))
    assert any("conversations" in r for r in rows) and any("messages" in r for r in rows)
