from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from trainer.model.tokenizer import CharTokenizer
from trainer.rl.rewards import compute_rewards, extract_answer
from trainer.rl.tasks import Example, GSM8KTask, Task, get_task, sample_gsm8k_path


@pytest.mark.parametrize("name", ["digits", "letters", "copy", "reverse", "add"])
def test_builtin_tasks_are_short_deterministic_and_scored(name: str) -> None:
    task = get_task(name)
    assert isinstance(task, Task) and task.name == name
    tok = CharTokenizer()
    examples = [task.example(i) for i in range(200)]
    assert examples == [get_task(name).example(i) for i in range(200)]  # fresh instance, same stream
    assert [task.example(i) for i in (150, 3, 77)] == [examples[150], examples[3], examples[77]]  # any order
    assert len({e.prompt for e in examples}) >= 10  # not a constant stream
    assert examples != [get_task(name, seed=1).example(i) for i in range(200)]
    for ex in examples:
        assert isinstance(ex, Example)
        assert len(ex.prompt) <= 16 and 1 <= len(ex.fields["target"]) <= 8
        assert tok.decode(tok.encode(ex.prompt)) == ex.prompt  # char tokenizer covers it
    # The target itself scores full marks on every reward the task names; an empty completion scores 0.
    prompts = [e.prompt for e in examples]
    targets = [e.fields["target"] for e in examples]
    best = compute_rewards(task.reward_names, prompts, targets, {"target": targets})
    worst = compute_rewards(task.reward_names, prompts, [""] * len(prompts), {"target": targets})
    for r in task.reward_names:
        assert best[r] == [1.0] * len(prompts)
        assert worst[r] == [0.0] * len(prompts)


def test_builtin_task_contents() -> None:
    ex = get_task("digits").example(0)
    assert ex.prompt[:4] == "rep " and len(ex.prompt) == 5 and ex.fields["target"] == ex.prompt[-1] * 4
    counts = Counter(get_task("digits").example(i).fields["target"][0] for i in range(1000))
    assert set(counts) == set("0123456789") and min(counts.values()) > 60  # roughly uniform
    letters = get_task("letters").example(1)
    assert letters.prompt[-1] in "abcdefghij" and letters.fields["target"] == letters.prompt[-1] * 4
    rev = get_task("reverse", length=4).example(5)
    assert rev.prompt.startswith("rev ") and rev.fields["target"] == rev.prompt[4:8][::-1]
    cp = get_task("copy").example(5)
    assert cp.prompt.startswith("cp ") and cp.fields["target"] == cp.prompt[3:6]
    add = get_task("add").example(9)
    a, b = add.prompt[:-1].split("+")
    assert add.fields["target"] == str(int(a) + int(b))
    assert get_task("digits", repeat=6).example(0).fields["target"] == ex.fields["target"][0] * 6
    # Defaults fit BOS + prompt into the demo's 8-token prompt window.
    for name in ("digits", "letters", "copy", "reverse", "add"):
        assert max(len(get_task(name).example(i).prompt) for i in range(100)) <= 7


def test_get_task_errors() -> None:
    with pytest.raises(KeyError, match="unknown task 'nope'.*digits"):
        get_task("nope")
    with pytest.raises(TypeError, match="task 'digits' has no option.*lenght"):
        get_task("digits", lenght=3)
    with pytest.raises(TypeError, match="needs path"):
        get_task("gsm8k")
    with pytest.raises(ValueError, match=">= 0"):
        get_task("copy").example(-1)
    with pytest.raises(KeyError, match="unknown reward"):
        get_task("digits", reward_names=["char_match", "bogus"])


def test_gsm8k_sample_file() -> None:
    path = sample_gsm8k_path()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert 10 <= len(lines) <= 20
    task = get_task("gsm8k", path=str(path))
    assert isinstance(task, GSM8KTask) and task.reward_names == ("gsm8k_answer", "gsm8k_format")
    n = len(lines)
    first_epoch = [task.example(i) for i in range(n)]
    # One epoch visits every question once, in a seeded order; the next epoch reshuffles.
    assert sorted(e.prompt for e in first_epoch) == sorted(f"Question: {r['question']}\nAnswer:" for r in lines)
    assert [e.prompt for e in first_epoch] != [task.example(n + i).prompt for i in range(n)]
    assert [e.prompt for e in first_epoch] == [get_task("gsm8k", path=str(path)).example(i).prompt for i in range(n)]
    gold = {f"Question: {r['question']}\nAnswer:": extract_answer(r["answer"]) for r in lines}
    for e in first_epoch:
        assert float(e.fields["answer"]) == gold[e.prompt]
    # The hand-written sample covers the number formats the extractor must handle.
    assert {"-6", "4.5", "1550", "285"} <= {e.fields["answer"] for e in first_epoch}
    unshuffled = get_task("gsm8k", path=str(path), shuffle=False)
    assert unshuffled.example(1).prompt == f"Question: {lines[1]['question']}\nAnswer:"
    assert unshuffled.example(n + 1) == unshuffled.example(1)


def test_gsm8k_scoring_end_to_end() -> None:
    task = get_task("gsm8k", path=str(sample_gsm8k_path()), shuffle=False)
    exs = [task.example(i) for i in range(3)]  # answers 8, 48, 13
    comps = ["3 + 5 = 8\n#### 8", "4 * 12 = 49", "I do not know"]
    out = compute_rewards(
        task.reward_names, [e.prompt for e in exs], comps, {"answer": [e.fields["answer"] for e in exs]}
    )
    assert out == {"gsm8k_answer": [1.0, 0.0, 0.0], "gsm8k_format": [1.0, 0.5, 0.0]}


def test_gsm8k_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q2"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected an object"):
        get_task("gsm8k", path=str(bad))
    bad.write_text('{"question": "q", "answer": "no number"}\n')
    with pytest.raises(ValueError, match=r":1: answer has no number"):
        get_task("gsm8k", path=str(bad))
    bad.write_text("{oops\n")
    with pytest.raises(ValueError, match=r":1: not valid JSON"):
        get_task("gsm8k", path=str(bad))
    with pytest.raises(FileNotFoundError, match="set task.path"):
        get_task("gsm8k", path=str(tmp_path / "missing.jsonl"))
