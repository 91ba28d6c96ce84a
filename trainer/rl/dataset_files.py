"""The rows of the `dataset` task: a local JSONL or parquet file, or a folder of splits (what the staging Job writes
for a Hugging Face dataset), kept by a declarative filter and turned into (prompt, answer) pairs.

No code from the config is evaluated: the filter is a list of (field, operator, value) conditions and the prompt
template a `str.format` string of plain field names. Every problem is a ConfigError naming the `task.` key and, where
there is a choice, the allowed values, raised when the task is built (the trainer's preflight, before any device).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.base.config import ConfigError

FORMATS = (".jsonl", ".parquet")
# HF dataset repos shard a split as <split>-00000-of-00003.parquet (also under data/): read as one split.
_SHARD = re.compile(r"^(?P<split>[A-Za-z0-9_.]+?)(?:-\d{5}-of-\d{5})?$")
FILTER_OPS = ("equals", "not_equals", "in", "not_in", "regex")


def files_by_split(root: Path) -> dict[str, list[Path]]:
    """A folder's splits, each a list of files in name order: <split>.jsonl, <split>.parquet or sharded
    <split>-00000-of-00002.parquet, directly or under data/ (a Hub repository's layouts), or any .jsonl/.parquet
    files in a <split>/ subfolder (the Hub's parquet conversion, revision refs/convert/parquet)."""
    found: dict[str, list[Path]] = {}
    for folder in (root, root / "data"):
        if not folder.is_dir():
            continue
        for p in sorted(folder.iterdir()):
            if p.is_file() and p.suffix in FORMATS and (m := _SHARD.match(p.stem)):
                found.setdefault(m.group("split"), []).append(p)
            elif p.is_dir() and p.name != "data" and _SHARD.match(p.name):
                files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in FORMATS)
                if files:
                    found.setdefault(p.name, []).extend(files)
    return found


def split_files(path: str, split: str | None, key: str = "task.split") -> list[Path]:
    """The files `task.path` (and the split `key` names: task.split, or task.eval_split) name, in order. Raises
    ConfigError."""
    p = Path(path)
    if p.is_file():
        if p.suffix not in FORMATS:
            raise ConfigError(f"task.path: {path!r} is neither {' nor '.join(FORMATS)}; allowed: a .jsonl or .parquet "
                              "file, or a folder of splits")
        if split is not None:
            raise ConfigError(f"{key}: {path!r} is a single file, which has no splits; leave {key} unset, "
                              "or point task.path at a folder of splits (<split>.jsonl, <split>.parquet)")
        return [p]
    if not p.is_dir():
        raise ConfigError(f"task.path: no such file or folder {path!r}; expected a .jsonl or .parquet file or a folder "
                          "of splits (with task.hub, the stack's staging Job writes it there)")
    splits = files_by_split(p)
    if not splits:
        raise ConfigError(f"task.path: the folder {path!r} holds no split files (<split>.jsonl, <split>.parquet, "
                          "<split>-00000-of-00001.parquet or <split>/*.parquet, directly or under data/)")
    want = split or "train"
    if want not in splits:
        raise ConfigError(f"{key}: {want!r} is not a split of {path!r}; allowed: {', '.join(sorted(splits))}")
    files = splits[want]
    if len({f.suffix for f in files}) > 1:
        names = ", ".join(f.name for f in files)
        raise ConfigError(f"task.path: split {want!r} of {path!r} is in both formats ({names}); keep one")
    return files


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"task.path: {path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"task.path: {path}:{lineno}: expected a JSON object per line, got "
                                  f"{type(row).__name__}")
            yield row


def _parquet_rows(path: Path, columns: Mapping[str, str]) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # the trainer extra installs it; a bare install may not have it
        raise ConfigError(f"task.path: {path} is parquet, which needs pyarrow (pip install 'gke-tpu-rl[trainer]'); "
                          "or give a .jsonl file") from None
    try:
        pf = pq.ParquetFile(path)
        names = set(pf.schema_arrow.names)
        missing = [c for c in columns if c not in names]
        if missing:
            raise ConfigError(_missing_field(columns[missing[0]], missing[0], path, names))
        for batch in pf.iter_batches(columns=list(columns)):
            yield from batch.to_pylist()
    except ConfigError:
        raise
    except Exception as err:  # pyarrow's ArrowInvalid and friends
        raise ConfigError(f"task.path: {path} is not a readable parquet file: {err}") from None


def _missing_field(key: str, name: str, path: Path, has: set[str] | Mapping[str, Any], where: str = "") -> str:
    return f"{key}: {path}{where} has no field {name!r}; its fields: {', '.join(sorted(has))}"


# ------------------------------------------------------------------------------------------------- the filter


@dataclass(frozen=True)
class Condition:
    field: str
    op: str
    value: Any

    def holds(self, row: Mapping[str, Any]) -> bool:
        v = row[self.field]
        if self.op == "equals":
            return bool(v == self.value)
        if self.op == "not_equals":
            return bool(v != self.value)
        if self.op == "in":
            return v in self.value
        if self.op == "not_in":
            return v not in self.value
        # regex: searched in the field's text (a number as str() writes it)
        return self.value.search(v if isinstance(v, str) else str(v)) is not None


def parse_filter(spec: Any) -> tuple[Condition, ...]:
    """`task.filter`: one condition or a list of them, all of which a row must meet, each {field: NAME, OP: VALUE}
    with OP one of FILTER_OPS. Raises ConfigError."""
    if spec is None:
        return ()
    items = [spec] if isinstance(spec, dict) else spec
    if not isinstance(items, list):
        raise ConfigError(f"task.filter: expected a condition {{field: NAME, OP: VALUE}} or a list of them, got "
                          f"{type(spec).__name__}; OP is one of {', '.join(FILTER_OPS)}")
    out: list[Condition] = []
    for i, item in enumerate(items):
        key = f"task.filter[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("field"), str):
            raise ConfigError(f"{key}: expected {{field: NAME, OP: VALUE}} with OP one of {', '.join(FILTER_OPS)}; "
                              f"got {item!r}")
        ops = [k for k in item if k != "field"]
        unknown = [k for k in ops if k not in FILTER_OPS]
        if unknown or len(ops) != 1:
            what = f"unknown operator {unknown[0]!r}" if unknown else f"{len(ops)} operators"
            raise ConfigError(f"{key}: {what}; give exactly one of {', '.join(FILTER_OPS)}")
        op, value = ops[0], item[ops[0]]
        if op in ("in", "not_in") and not isinstance(value, list):
            raise ConfigError(f"{key}.{op}: expected a list of values, got {value!r}")
        if op == "regex":
            if not isinstance(value, str):
                raise ConfigError(f"{key}.regex: expected a regular expression (a string), got {value!r}")
            try:
                value = re.compile(value)
            except re.error as e:
                raise ConfigError(f"{key}.regex: {value!r} is not a valid regular expression ({e})") from None
        out.append(Condition(item["field"], op, value))
    return tuple(out)


# ------------------------------------------------------------------------------------------------- the template


def template_fields(template: str) -> tuple[str, ...]:
    """The plain field names of a `str.format` prompt template; anything else (attributes, indexes, conversions)
    is refused, so a template reads the row and nothing else. Raises ConfigError."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ConfigError(f"task.prompt_template: {template!r} is not a format string ({e}); write fields as "
                          "{name} and a literal brace as {{ or }}") from None
    for _, name, spec, conv in parsed:
        if name is None:
            continue
        if not name.isidentifier() or conv or spec:
            raise ConfigError(f"task.prompt_template: {{{name}{'!' + conv if conv else ''}"
                              f"{':' + spec if spec else ''}}} is not a plain field name; allowed: {{FIELD}} with "
                              "FIELD a column of the data set")
        names.append(name)
    if not names:
        raise ConfigError(f"task.prompt_template: {template!r} names no field; write the prompt's field as {{NAME}}")
    return tuple(dict.fromkeys(names))


def answer_text(value: Any) -> str | None:
    """An answer cell as the text rewards compare: strings as they are, integers (and integral floats) without a
    decimal point; None for a missing or empty cell."""
    if isinstance(value, bool):
        return str(value).lower()  # JSON's spelling
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return value if value.strip() else None
    return None


def load_pairs(path: str, split: str | None, prompt_field: str, answer_field: str, prompt_template: str | None,
               conditions: Sequence[Condition], split_key: str = "task.split") -> tuple[tuple[str, str], ...]:
    """(prompt, answer) for every row of the split that meets every condition, in file order. The prompt is the
    prompt_field's text, or prompt_template filled from the row. Raises ConfigError."""
    fields = template_fields(prompt_template) if prompt_template is not None else (prompt_field,)
    # Each column the task reads, and the key that named it (for the error when a row lacks it).
    columns: dict[str, str] = {}
    for name, key in [*((f, "task.prompt_template" if prompt_template is not None else "task.prompt_field")
                        for f in fields), (answer_field, "task.answer_field"),
                      *((c.field, f"task.filter[{i}].field") for i, c in enumerate(conditions))]:
        columns.setdefault(name, key)
    pairs: list[tuple[str, str]] = []
    seen = 0
    for file in split_files(path, split, split_key):
        rows = _parquet_rows(file, columns) if file.suffix == ".parquet" else _jsonl_rows(file)
        for n, row in enumerate(rows, start=1):
            seen += 1
            where = f" (row {n})"
            missing = next((c for c in columns if c not in row), None)
            if missing is not None:
                raise ConfigError(_missing_field(columns[missing], missing, file, row, where))
            if not all(c.holds(row) for c in conditions):
                continue
            for f in fields:
                # A template may put numbers in the prompt; the prompt field itself must be text.
                ok = isinstance(row[f], str) or (prompt_template is not None and isinstance(row[f], (int, float)))
                if not ok or isinstance(row[f], bool):
                    raise ConfigError(f"{columns[f]}: {file}{where}: field {f!r} is {type(row[f]).__name__}, not "
                                      f"{'text' if prompt_template is None else 'text or a number'}")
            prompt = row[prompt_field] if prompt_template is None else prompt_template.format_map(
                {f: row[f] for f in fields})
            answer = answer_text(row[answer_field])
            if answer is None:
                raise ConfigError(f"task.answer_field: {file}{where}: {answer_field!r} is {row[answer_field]!r}; "
                                  "expected text or a number")
            pairs.append((prompt, answer))
    if not pairs:
        where = f"{path!r}" + (f" split {split!r}" if split else "")
        if seen:
            raise ConfigError(f"task.filter: the filter kept none of the {seen} rows of {where}; loosen task.filter")
        raise ConfigError(f"task.path: {where} has no rows")
    return tuple(pairs)
