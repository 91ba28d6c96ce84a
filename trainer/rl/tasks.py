"""Tasks: deterministic prompt streams plus the names of the rewards that score them.

`example(index)` depends only on (seed, index), so every process derives the same example for the
same global data position whatever the process count, and a resumed run continues the stream.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from trainer.base.config import ConfigError
from trainer.base.eval_config import EVAL_INDEX_OFFSET
from trainer.rl.dataset_files import load_pairs, parse_filter
from trainer.rl.rewards import REWARDS, extract_answer


@dataclass(frozen=True)
class Example:
    prompt: str
    fields: dict[str, Any]


@runtime_checkable
class Task(Protocol):
    """What the loop reads of a task. A task may also define `eval_example(index)`: its held-out split, which the
    eval (config `eval:`) reads in place of the default, `example(EVAL_INDEX_OFFSET + index)`: indices no training
    step reaches. A task over a finite dataset (one with `__len__`) must define it, since its examples repeat."""

    name: str
    reward_names: tuple[str, ...]

    def example(self, index: int) -> Example: ...


def eval_example(task: Task, index: int) -> Example:
    """Held-out example `index` of `task`: its own `eval_example`, else `example` at an index past any training
    step's (fresh draws for a generated task)."""
    own = getattr(task, "eval_example", None)
    if callable(own):
        return own(index)
    if hasattr(task, "__len__"):
        raise TypeError(f"task {task.name!r} is a finite dataset without an eval_example(index) method, so the "
                        "eval would score examples it trains on; give it a held-out split (docs/own-tasks.md)")
    return task.example(EVAL_INDEX_OFFSET + index)


def _rng(seed: int, index: int) -> np.random.Generator:
    if index < 0:
        raise ValueError(f"example index must be >= 0, got {index}")
    return np.random.default_rng([seed, index])


DIGITS = "0123456789"


# Built-in prompts end with the char the first answer char depends on (no trailing ":"), and are at most
# 7 chars so BOS + prompt fits the demo's 8-token prompt window. Measured on the demo model (GRPO, 60 steps,
# seeds 0-2): "rep 7" reached char_match 0.80-0.96, "rep 7:" about 0.4, since the first answer token then
# has to attend two positions back instead of reading the token right before it.
# Default rewards are char_match only: adding `length` (or another stop/format bonus) collapsed the
# policy's entropy before it learned the content (char_match 0.2-0.7 after 60 steps). Opt in with
# `rewards: [char_match, length]` for runs long enough to learn stopping as well.
BUILTIN_REWARDS: tuple[str, ...] = ("char_match",)


@dataclass(frozen=True)
class RepeatTask:
    """ "rep 7" -> "7777": repeat the prompt's last char `repeat` times. The easiest built-in."""

    seed: int = 0
    repeat: int = 4
    alphabet: str = DIGITS
    name: str = "digits"
    reward_names: tuple[str, ...] = BUILTIN_REWARDS

    def example(self, index: int) -> Example:
        c = self.alphabet[int(_rng(self.seed, index).integers(len(self.alphabet)))]
        return Example(prompt=f"rep {c}", fields={"target": c * self.repeat})


@dataclass(frozen=True)
class CopyTask:
    """ "cp cab" -> "cab" (or "rev cab" -> "bac" when `reverse`): per-position credit."""

    seed: int = 0
    length: int = 3
    alphabet: str = "abcde"
    reverse: bool = False
    name: str = "copy"
    reward_names: tuple[str, ...] = BUILTIN_REWARDS

    def example(self, index: int) -> Example:
        picks = _rng(self.seed, index).integers(len(self.alphabet), size=self.length)
        s = "".join(self.alphabet[int(i)] for i in picks)
        verb = "rev" if self.reverse else "cp"
        return Example(prompt=f"{verb} {s}", fields={"target": s[::-1] if self.reverse else s})


@dataclass(frozen=True)
class AddTask:
    """ "3+4=" -> "7": single-digit addition; harder (needs both operands), still dense via char_match."""

    seed: int = 0
    max_operand: int = 9
    name: str = "add"
    reward_names: tuple[str, ...] = BUILTIN_REWARDS

    def example(self, index: int) -> Example:
        a, b = (int(x) for x in _rng(self.seed, index).integers(self.max_operand + 1, size=2))
        return Example(prompt=f"{a}+{b}=", fields={"target": str(a + b)})


DEFAULT_GSM8K_TEMPLATE = "Question: {question}\nAnswer:"


def _load_jsonl(path: Path) -> tuple[tuple[str, str], ...]:
    rows: list[tuple[str, str]] = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("question"), str)
            or not isinstance(row.get("answer"), str)
        ):
            raise ValueError(f"{path}:{lineno}: expected an object with string 'question' and 'answer'")
        gold = extract_answer(row["answer"])
        if gold is None:
            raise ValueError(f"{path}:{lineno}: answer has no number (expected '... #### 42')")
        rows.append((row["question"], _format_number(gold)))
    if not rows:
        raise ValueError(f"{path}: no examples")
    return tuple(rows)


def _format_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


class _RowStream:
    """A task over rows read once (GSM8K, your own dataset): every row once per epoch, reshuffled each epoch from
    (seed, epoch), and a held-out split of rows training never sees."""

    name: str
    seed: int
    shuffle: bool
    _rows: tuple[Row, ...]
    _eval_rows: tuple[Row, ...]
    _held_out_how: str  # the keys that give the task a held-out split, for the error without one

    def __len__(self) -> int:
        return len(self._rows)

    def example(self, index: int) -> Example:
        return self._example(_nth(self._rows, self.seed, index, self.shuffle))

    def eval_example(self, index: int) -> Example:
        """Held-out row `index`, in file order; an index past the split is an IndexError."""
        return self._example(_held(self._eval_rows, index, f"{self.name} task", self._held_out_how))

    def _example(self, row: Row) -> Example:
        raise NotImplementedError


@dataclass(frozen=True)
class GSM8KTask(_RowStream):
    """GSM8K-format JSONL (`{"question": ..., "answer": "... #### 42"}`), reshuffled every epoch.

    The held-out split the eval reads: a second file (`eval_path`, e.g. GSM8K's test split), or `holdout` rows of
    `path` (a fixed seeded pick) that training then never sees."""

    path: str
    seed: int = 0
    shuffle: bool = True
    prompt_template: str = DEFAULT_GSM8K_TEMPLATE
    eval_path: str | None = None
    holdout: int = 0
    name: str = "gsm8k"
    reward_names: tuple[str, ...] = ("gsm8k_answer", "gsm8k_format")
    _rows: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)
    _eval_rows: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        p = Path(self.path)
        if not p.is_file():
            raise FileNotFoundError(f"gsm8k task: no such file {self.path!r} (set task.path)")
        rows = _load_jsonl(p)
        if self.eval_path is not None and self.holdout:
            raise ValueError("gsm8k task: set eval_path (a file of its own) or holdout (rows of path), not both")
        if not isinstance(self.holdout, int) or not 0 <= self.holdout < len(rows):
            raise ValueError(f"gsm8k task: holdout={self.holdout!r} must be an integer in [0, {len(rows)}) (the rows "
                             f"of {self.path})")
        held: tuple[tuple[str, str], ...] = ()
        if self.eval_path is not None:
            if not Path(self.eval_path).is_file():
                raise FileNotFoundError(f"gsm8k task: no such file {self.eval_path!r} (task.eval_path)")
            held = _load_jsonl(Path(self.eval_path))
        elif self.holdout:
            rows, held = _hold_out(rows, self.seed, self.holdout)
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_eval_rows", held)

    _held_out_how = "task.eval_path (e.g. GSM8K's test split) or task.holdout (rows of task.path kept out of training)"

    def _example(self, row: tuple[str, str]) -> Example:
        question, answer = row
        return Example(prompt=self.prompt_template.format(question=question), fields={"answer": answer})


@dataclass(frozen=True)
class DatasetTask(_RowStream):
    """Your own data: a local JSONL or parquet file, or a folder of splits (a Hugging Face dataset the stack staged,
    see docs/own-tasks.md), one prompt and one answer field per row, a declarative filter; reshuffled every epoch.

    The answer reaches the rewards as both `answer` and `target`, so every built-in reward reads it. task.hub,
    hub_config and hub_revision name the Hugging Face dataset the stack's staging Job writes to `path` (a folder of
    splits); the trainer reads only `path`, offline.

    The held-out split the eval reads: another split of `path` (`eval_split`, e.g. test), or `holdout` rows of the
    training split (a fixed seeded pick) that training then never sees."""

    path: str
    split: str | None = None
    eval_split: str | None = None
    holdout: int = 0
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    prompt_template: str | None = None
    filter: Any = None
    hub: str | None = None
    hub_config: str | None = None
    hub_revision: str | None = None
    seed: int = 0
    shuffle: bool = True
    name: str = "dataset"
    reward_names: tuple[str, ...] = ("exact_match",)
    _rows: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)
    _eval_rows: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        for key in ("path", "prompt_field", "answer_field"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ConfigError(f"task.{key}: expected a non-empty string, got {getattr(self, key)!r}")
        for key in ("split", "eval_split", "prompt_template", "hub", "hub_config", "hub_revision"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise ConfigError(f"task.{key}: expected a string, got {getattr(self, key)!r}")
        if self.eval_split is not None and self.holdout:
            raise ConfigError("task.eval_split, task.holdout: set one (a split of its own, or rows of the training "
                              "split), not both")
        rows = load_pairs(self.path, self.split, self.prompt_field, self.answer_field, self.prompt_template,
                          parse_filter(self.filter))
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, int) or not 0 <= self.holdout < len(rows):
            raise ConfigError(f"task.holdout: {self.holdout!r} must be an integer in [0, {len(rows)}) (the rows of "
                              "the training split)")
        held: tuple[tuple[str, str], ...] = ()
        if self.eval_split is not None:
            held = load_pairs(self.path, self.eval_split, self.prompt_field, self.answer_field, self.prompt_template,
                              parse_filter(self.filter), "task.eval_split")
        elif self.holdout:
            rows, held = _hold_out(rows, self.seed, self.holdout)
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_eval_rows", held)

    _held_out_how = ("task.eval_split (another split of task.path, e.g. test) or task.holdout (rows of the training "
                     "split kept out of training)")

    @staticmethod
    def _example(row: tuple[str, str]) -> Example:
        prompt, answer = row
        return Example(prompt=prompt, fields={"answer": answer, "target": answer})


@lru_cache(maxsize=8)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, n]).permutation(n)


Row = tuple[str, str]


def _nth(rows: tuple[Row, ...], seed: int, index: int, shuffle: bool) -> Row:
    """Row `index` of the stream: every row once per epoch, reshuffled each epoch from (seed, epoch)."""
    if index < 0:
        raise ValueError(f"example index must be >= 0, got {index}")
    epoch, pos = divmod(index, len(rows))
    return rows[_permutation(seed, epoch, len(rows))[pos] if shuffle else pos]


def _hold_out(rows: tuple[Row, ...], seed: int, n: int) -> tuple[tuple[Row, ...], tuple[Row, ...]]:
    """(training rows, n held-out rows): a pick of its own (not epoch 0's order), fixed by the seed; both parts keep
    the file's order."""
    out = set(np.random.default_rng([seed, len(rows), n]).permutation(len(rows))[:n].tolist())
    return (tuple(r for i, r in enumerate(rows) if i not in out), tuple(r for i, r in enumerate(rows) if i in out))


def _held(held: tuple[Row, ...], index: int, task: str, how: str) -> Row:
    if not held:
        raise TypeError(f"{task} has no held-out split: set {how}")
    if not 0 <= index < len(held):
        raise IndexError(f"{task}: held-out example {index} asked, the split has {len(held)}")
    return held[index]


_TASKS: dict[str, tuple[type, dict[str, Any]]] = {
    "digits": (RepeatTask, {}),
    "letters": (RepeatTask, {"alphabet": "abcdefghij", "name": "letters"}),
    "copy": (CopyTask, {}),
    "reverse": (CopyTask, {"reverse": True, "name": "reverse"}),
    "add": (AddTask, {}),
    "gsm8k": (GSM8KTask, {}),
    "dataset": (DatasetTask, {}),
}
TASK_NAMES: tuple[str, ...] = tuple(_TASKS)


def get_task(name: str, **kwargs: Any) -> Task:
    """Build a task by name, or the user's own as MODULE:FACTORY called with the task's options (a class or a
    function; trainer/base/user_code.py); unknown names and unknown options raise errors that name them."""
    if ":" in name:
        return _user_task(name, kwargs)
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}, or MODULE:FACTORY of your "
                       "own code")
    cls, preset = _TASKS[name]
    allowed = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")} - {"name"}
    bad = sorted(set(kwargs) - allowed)
    if bad:
        raise TypeError(f"task {name!r} has no option(s) {', '.join(bad)}; options: {', '.join(sorted(allowed))}")
    if "reward_names" in kwargs:
        kwargs["reward_names"] = tuple(kwargs["reward_names"])
        unknown = [r for r in kwargs["reward_names"] if r not in REWARDS]
        if unknown:
            raise KeyError(f"task {name!r}: unknown reward(s) {', '.join(unknown)}")
    if name == "gsm8k" and "path" not in kwargs:
        raise TypeError("task 'gsm8k' needs path=<jsonl file>")
    if name == "dataset" and "path" not in kwargs:
        raise ConfigError("task.path: the dataset task needs path: a .jsonl or .parquet file, or a folder of splits")
    return cls(**{**preset, **kwargs})


def _user_task(ref: str, options: dict[str, Any]) -> Task:
    import inspect

    from trainer.base.user_code import resolve

    factory = resolve(ref)
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as err:
        raise TypeError(f"task {ref!r} does not take the options {sorted(options)}: {err}") from None
    except ValueError:
        pass  # no signature to check (a builtin): the call below says what is wrong
    task = factory(**options)
    if not callable(getattr(task, "example", None)):
        raise TypeError(f"task {ref!r} returned a {type(task).__name__} without an example(index) method")
    names = getattr(task, "reward_names", ())
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"task {ref!r}: reward_names must be a list of reward names, got {names!r}")
    return task


def sample_gsm8k_path() -> Path:
    """The small hand-written GSM8K-format file shipped with the trainer (for tests and demos)."""
    return Path(__file__).parents[1] / "data" / "gsm8k_sample.jsonl"
