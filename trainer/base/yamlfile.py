"""YAML files read strictly: a key given twice in one mapping is an error naming the file and both lines.

PyYAML keeps the last of duplicate keys silently; the Pulumi CLI (go-yaml v3) refuses them ("mapping key already
defined"), so the offline plan and the trainer refuse them too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class YamlFileError(ValueError):
    """The file cannot be read or parsed; the message names the file and, where known, the line."""


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key; the base class reports it
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {first})", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def loads(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise YamlFileError(f"{where}: {err.problem or err}") from None
    except yaml.YAMLError as err:
        raise YamlFileError(f"{source}: {err}") from None


def load(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as err:
        raise YamlFileError(f"cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise YamlFileError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    return loads(text, str(path))
