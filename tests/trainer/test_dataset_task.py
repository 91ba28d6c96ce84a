"""The `dataset` task (trainer/rl/tasks.py DatasetTask, trainer/rl/dataset_files.py): your own rows from a JSONL or
parquet file or a folder of splits, a declarative filter, a deterministic reshuffled stream, and one ConfigError
naming the key for each way the data or the options can be wrong."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer.base.config import ConfigError, config_from_dict
from trainer.rl.rewards import compute_rewards
from trainer.rl.task_data import load_task_data
from trainer.rl.tasks import DatasetTask, Task, get_task

from .conftest import tiny_train_config

ROWS: list[dict[str, Any]] = [
    {"question": f"What is {a} + {b}?", "answer": a + b, "level": 1 + (a % 3), "topic": "add" if a % 2 else "sum"}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14)]
]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _task(path: Path | str, **kw: Any) -> DatasetTask:
    task = get_task("dataset", path=str(path), **{"prompt_field": "question", **kw})
    assert isinstance(task, DatasetTask)
    return task


def test_a_file_is_a_deterministic_stream_reshuffled_every_epoch(tmp_path: Path) -> None:
    task = _task(_jsonl(tmp_path / "d.jsonl", ROWS))
    assert isinstance(task, Task) and len(task) == 7 and task.reward_names == ("exact_match",)
    stream = [task.example(i) for i in range(21)]
    # Every row once per epoch, in an order that changes between epochs and with the seed.
    for epoch in range(3):
        assert Counter(e.prompt for e in stream[7 * epoch : 7 * epoch + 7]) == Counter(r["question"] for r in ROWS)
    assert [e.prompt for e in stream[:7]] != [e.prompt for e in stream[7:14]]
    assert stream == [_task(tmp_path / "d.jsonl").example(i) for i in range(21)]  # a fresh task: the same stream
    assert task.example(15) == stream[15]  # any index alone, as a resumed run asks for it
    assert stream != [_task(tmp_path / "d.jsonl", seed=1).example(i) for i in range(21)]
    unshuffled = _task(tmp_path / "d.jsonl", shuffle=False)
    assert [unshuffled.example(i).prompt for i in range(8)] == [r["question"] for r in ROWS] + [ROWS[0]["question"]]
    # The answer reaches rewards as text under both names the built-in rewards read; integers keep no ".0".
    ex = unshuffled.example(1)
    assert ex.fields == {"answer": "7", "target": "7"}
    scores = compute_rewards(["exact_match", "numeric_match"], [ex.prompt] * 3, ["7", "3 + 4 = 7.0", "8"],
                             {k: [v] * 3 for k, v in ex.fields.items()})
    assert scores == {"exact_match": [1.0, 0.0, 0.0], "numeric_match": [1.0, 1.0, 0.0]}


def test_parquet_and_jsonl_give_the_same_stream(tmp_path: Path) -> None:
    a = _task(_jsonl(tmp_path / "d.jsonl", ROWS))
    b = _task(_parquet(tmp_path / "d.parquet", ROWS))
    assert [a.example(i) for i in range(14)] == [b.example(i) for i in range(14)]


def test_a_folder_of_splits(tmp_path: Path) -> None:
    """The layouts a staged Hugging Face dataset or a repo has: <split>.jsonl, <split>.parquet, sharded parquet under
    data/; the split defaults to train."""
    root = tmp_path / "ds"
    _jsonl(root / "train.jsonl", ROWS[:4])
    _parquet(root / "data" / "test-00000-of-00002.parquet", ROWS[4:6])
    _parquet(root / "data" / "test-00001-of-00002.parquet", ROWS[6:])
    assert len(_task(root)) == 4
    test = _task(root, split="test", shuffle=False)
    assert [test.example(i).prompt for i in range(3)] == [r["question"] for r in ROWS[4:]]
    with pytest.raises(ConfigError, match=r"^task\.split: 'validation' is not a split of .*; allowed: test, train$"):
        _task(root, split="validation")


def test_the_held_out_split_the_eval_reads(tmp_path: Path) -> None:
    """eval_split: another split of the folder; holdout: rows of the training split that training never sees."""
    root = tmp_path / "ds"
    _jsonl(root / "train.jsonl", ROWS[:4])
    _parquet(root / "test.parquet", ROWS[4:])
    split = _task(root, eval_split="test")
    assert [split.eval_example(i).prompt for i in range(3)] == [r["question"] for r in ROWS[4:]]
    with pytest.raises(IndexError, match="the split has 3"):
        split.eval_example(3)
    with pytest.raises(ConfigError, match=r"^task\.eval_split: 'dev' is not a split of .*; allowed: test, train$"):
        _task(root, eval_split="dev")
    held = _task(_jsonl(tmp_path / "d.jsonl", ROWS), holdout=3)
    trained = {held.example(i).prompt for i in range(4 * len(held))}  # several epochs
    kept_out = {held.eval_example(i).prompt for i in range(3)}
    assert len(held) == 4 and len(kept_out) == 3 and not trained & kept_out
    assert trained | kept_out == {r["question"] for r in ROWS}
    assert held.eval_example(0).fields["answer"] == held.eval_example(0).fields["target"]
    with pytest.raises(TypeError, match="set task.eval_split .* or task.holdout"):
        _task(tmp_path / "d.jsonl").eval_example(0)
    with pytest.raises(ConfigError, match="not both"):
        _task(root, eval_split="test", holdout=1)
    with pytest.raises(ConfigError, match=r"^task\.holdout: 7 must be an integer in \[0, 7\)"):
        _task(tmp_path / "d.jsonl", holdout=7)


@pytest.mark.parametrize(("flt", "kept"), [
    ({"field": "level", "equals": 2}, [1, 7, 13]),
    ({"field": "level", "not_equals": 2}, [3, 5, 9, 11]),
    ({"field": "level", "in": [1, 3]}, [3, 5, 9, 11]),
    ({"field": "topic", "not_in": ["sum"]}, [1, 3, 5, 7, 9, 11, 13]),
    ({"field": "question", "regex": r"\b1\d \+"}, [11, 13]),
    ([{"field": "level", "in": [1, 3]}, {"field": "answer", "regex": "^2"}], [11]),  # all must hold; numbers as text
])
def test_the_filter(tmp_path: Path, flt: Any, kept: list[int]) -> None:
    task = _task(_jsonl(tmp_path / "d.jsonl", ROWS), filter=flt, shuffle=False)
    assert sorted(int(task.example(i).prompt.split()[2]) for i in range(len(task))) == kept


def test_a_prompt_template_fills_plain_fields(tmp_path: Path) -> None:
    task = _task(_jsonl(tmp_path / "d.jsonl", ROWS), prompt_template="Level {level} ({topic}): {question}\nAnswer:",
                 shuffle=False)
    assert task.example(0).prompt == "Level 2 (add): What is 1 + 2?\nAnswer:"


@pytest.mark.parametrize(("options", "error"), [
    ({"prompt_field": "prompt"}, r"^task\.prompt_field: .*d\.jsonl \(row 1\) has no field 'prompt'; its fields: "
                                 r"answer, level, question, topic$"),
    ({"answer_field": "solution"}, r"^task\.answer_field: .* has no field 'solution'"),
    ({"filter": {"field": "lvl", "equals": 1}}, r"^task\.filter\[0\]\.field: .* has no field 'lvl'"),
    ({"filter": {"field": "level", "eq": 1}}, r"^task\.filter\[0\]: unknown operator 'eq'; give exactly one of "
                                              r"equals, not_equals, in, not_in, regex$"),
    ({"filter": [{"field": "level", "equals": 1, "in": [1]}]}, r"^task\.filter\[0\]: 2 operators"),
    ({"filter": {"field": "level", "in": 1}}, r"^task\.filter\[0\]\.in: expected a list"),
    ({"filter": {"field": "question", "regex": "("}}, r"^task\.filter\[0\]\.regex: '\(' is not a valid regular"),
    ({"filter": "level == 1"}, r"^task\.filter: expected a condition"),
    ({"filter": {"field": "level", "equals": 9}}, r"^task\.filter: the filter kept none of the 7 rows of "),
    ({"split": "train"}, r"^task\.split: .* is a single file, which has no splits"),
    ({"prompt_template": "{question.__class__}"}, r"^task\.prompt_template: \{question\.__class__\} is not a plain "
                                                  r"field name"),
    ({"prompt_template": "{level}"}, None),
    ({"prompt_field": "level"}, r"^task\.prompt_field: .*\(row 1\): field 'level' is int, not text$"),
    ({"prompt_template": "{nope}"}, r"^task\.prompt_template: .* has no field 'nope'"),
    ({"prompt_template": "Q {topic}", "answer_field": "topic"}, None),
])
def test_bad_options_name_the_key(tmp_path: Path, options: dict[str, Any], error: str | None) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    if error is None:
        assert len(_task(path, **options)) == 7
        return
    with pytest.raises(ConfigError, match=error):
        _task(path, **options)


def test_bad_files_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^task\.path: no such file or folder .*nope"):
        _task(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"^task\.path: .* is neither \.jsonl nor \.parquet"):
        _task(_jsonl(tmp_path / "d.csv", ROWS))
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": 1}\nnot json\n')
    with pytest.raises(ConfigError, match=r"^task\.path: .*bad\.jsonl:2: not valid JSON"):
        _task(tmp_path / "bad.jsonl")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 nope")
    with pytest.raises(ConfigError, match=r"^task\.path: .*bad\.parquet is not a readable parquet file"):
        _task(tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match=r"^task\.answer_field: .*\(row 1\): 'answer' is None; expected text or a "
                                          r"number$"):
        _task(_jsonl(tmp_path / "none.jsonl", [{"question": "q", "answer": None}]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^task\.path: the folder .* holds no split files"):
        _task(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"^task\.path: .* has no rows$"):
        _task(_jsonl(tmp_path / "nothing.jsonl", []))
    with pytest.raises(ConfigError, match=r"^task\.path: the dataset task needs path"):
        get_task("dataset", prompt_field="q")


def test_the_preflight_passes_the_key_through(tmp_path: Path) -> None:
    """What `python -m trainer` checks before any device: load_task_data, with the task's own key in the message."""
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    raw = tiny_train_config(tmp_path / "run", task={"name": "dataset", "path": str(path), "prompt_field": "question",
                                                    "filter": {"field": "level", "in": [7]}})
    with pytest.raises(ConfigError, match=r"^task\.filter: the filter kept none of the 7 rows"):
        load_task_data(config_from_dict(raw))
    raw["task"]["filter"] = {"field": "level", "in": [2]}
    raw["rewards"] = ["numeric_match", "char_match"]
    data = load_task_data(config_from_dict(raw))
    assert data.reward_names == ("numeric_match", "char_match") and len(data.task) == 3
    # The char tokenizer prepends its BOS when no chat template is in play.
    assert data.prompt_ids("ab") == [data.tokenizer.bos_id, *data.tokenizer.encode("ab")][-8:]


def test_the_worked_config_in_the_docs(tmp_path: Path) -> None:
    """docs/own-tasks.md's dataset config, its bucket paths pointed at local stand-ins (the sample GSM8K rows as the
    staged train split, the tiny Qwen3 tokenizer with its chat template): it validates, and its filter, fields,
    template and rewards work together."""
    import re

    import yaml

    from trainer.rl.tasks import sample_gsm8k_path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "own-tasks.md").read_text()
    section = doc[doc.index("## Your own data: the `dataset` task"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    worked = yaml.safe_load(block.group(1))
    assert worked["task"]["hub"] == "openai/gsm8k" and worked["task"]["chat_template"] is True
    splits = tmp_path / "gsm8k"
    splits.mkdir()
    (splits / "train.jsonl").write_bytes(sample_gsm8k_path().read_bytes())
    tokenizer = str(Path(__file__).resolve().parents[1] / "fixtures" / "tiny_qwen3")
    raw = tiny_train_config(tmp_path / "run", task={**worked["task"], "path": str(splits)}, tokenizer=tokenizer,
                            rewards=worked["rewards"])
    raw["model"] = {**raw["model"], "vocab_size": 1088, "max_seq_len": 512}
    raw["sampling"]["max_prompt_len"] = 400
    data = load_task_data(config_from_dict(raw))
    ex = data.task.example(0)
    text = data.prompt_text(ex.prompt)
    assert text.startswith("<|im_start|>system\nSolve the problem") and ex.prompt in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking: false
    gold = ex.fields["answer"]
    assert compute_rewards(data.reward_names, [ex.prompt], [f"so {gold[-40:]}"], {"answer": [gold]}) == {
        "numeric_match": [1.0], "gsm8k_format": [1.0]}


def test_a_template_refuses_a_cell_that_is_neither_text_nor_a_number(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"question": ["a", "b"], "answer": 1}])
    with pytest.raises(ConfigError, match=r"^task\.prompt_template: .*\(row 1\): field 'question' is list, not text "
                                          r"or a number$"):
        _task(path, prompt_template="Q: {question}")
