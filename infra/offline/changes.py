"""What changed between two resources' inputs, as a reviewer reads it: one (path, old, new) per leaf, in the order of
the document; lists of named things (containers, env, volumes, ports, ...) matched by their Kubernetes merge key, so
a reorder is no change and `env[name=NUM_SLICES]` names what changed; a container's args as the flags that changed
(`args --set rl.group_size: 8 → 16`), not as positions that shift when one flag is added."""

from __future__ import annotations

import difflib
import json
from typing import Any

Leaf = tuple[str, Any, Any]

# A list field's items are matched by these fields: the patchMergeKey (or +listMapKey) each field has in the
# Kubernetes API (core/v1 types.go; JobSet's replicatedJobs, KubeRay's workerGroupSpecs, Kueue's flavors and
# resources), and the name GCP gives each item where the provider's schema has one (secondary ranges). The first
# field every item has is the key; a list whose items lack it, or share a value, is compared by position.
MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",), "initContainers": ("name",), "ephemeralContainers": ("name",),
    "env": ("name",), "volumes": ("name",), "volumeMounts": ("mountPath",), "volumeDevices": ("devicePath",),
    "ports": ("containerPort", "port"),  # a container's ports by containerPort, a Service's by port
    "imagePullSecrets": ("name",), "hostAliases": ("ip",), "resourceClaims": ("name",), "claims": ("name",),
    "topologySpreadConstraints": ("topologyKey",), "readinessGates": ("conditionType",), "conditions": ("type",),
    "replicatedJobs": ("name",), "workerGroupSpecs": ("groupName",),
    "flavors": ("name",), "resources": ("name",), "admissionChecks": ("name",), "requests": ("name",),
    "secondaryIpRanges": ("rangeName",),
}
# No merge key in the API (the list is replaced whole), but order means nothing: matched by what they select.
UNORDERED_KEYS: dict[str, tuple[str, ...]] = {"tolerations": ("key", "operator", "value", "effect"),
                                              "taints": ("key", "value", "effect")}
# Lists of command-line words shown as flags: a container's args and command.
ARGV_FIELDS = ("args", "command")
PRESENT = "(given)"  # the value of a flag given without one (`--resume`)


def _field(path: str) -> str:
    return path.rsplit(".", 1)[-1].split("[", 1)[0]


def _nested(value: Any) -> bool:
    """A non-empty dict, or a list holding dicts or lists: walked leaf by leaf rather than shown whole."""
    return (isinstance(value, dict) and bool(value)) or (
        isinstance(value, list) and any(isinstance(v, dict | list) for v in value))


def _ordered_union(a: list[str], b: list[str]) -> list[str]:
    # The new document's order, then what only the old one had.
    return b + [k for k in a if k not in set(b)]


def _keyed(field: str, items: list[Any]) -> dict[str, Any] | None:
    """{key label: item} when every item is a dict holding the field's merge key with distinct values; else None."""
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    if field in MERGE_KEYS:
        key = next((k for k in MERGE_KEYS[field] if all(k in i for i in items)), None)
        if key is None:
            return None
        labels = [f"{key}={i[key]}" for i in items]
    elif field in UNORDERED_KEYS:
        labels = [",".join(f"{k}={i[k]}" for k in UNORDERED_KEYS[field] if k in i) for i in items]
    else:
        return None
    return dict(zip(labels, items, strict=True)) if len(set(labels)) == len(labels) else None


def argv_flags(words: list[str]) -> dict[str, str]:
    """A command line as {flag: value}, in order: `--set KEY=VALUE` by its KEY (`--set rl.group_size`), `--flag value`
    and `--flag=value` by the flag, a flag without a value as PRESENT, a word before any flag by its position (`[0]`);
    a flag given twice gets its count (`--config #2`)."""
    out: dict[str, str] = {}

    def put(key: str, value: str) -> None:
        n, base = 1, key
        while key in out:
            n += 1
            key = f"{base} #{n}"
        out[key] = value

    i, position = 0, 0
    while i < len(words):
        word = words[i]
        if not word.startswith("-") or word == "-":
            put(f"[{position}]", word)
            position += 1
            i += 1
            continue
        flag, eq, value = word.partition("=")
        if not eq and i + 1 < len(words) and not _is_flag(words[i + 1]):
            value, i = words[i + 1], i + 1
        elif not eq:
            value = PRESENT
        if flag == "--set" and value != PRESENT:
            name, _, value = value.partition("=")
            flag = f"--set {name}"
        put(flag, value)
        i += 1
    return out


def _is_flag(word: str) -> bool:
    # `-1` is a value (`--seed -1`); `-m` and `--x` are flags.
    return word.startswith("--") or (word.startswith("-") and len(word) > 1 and not word[1].isdigit())


def _argv_like(field: str, a: Any, b: Any) -> bool:
    sides = [v for v in (a, b) if v is not None]
    return field in ARGV_FIELDS and all(isinstance(v, list) and all(isinstance(w, str) for w in v) for v in sides) \
        and any(_is_flag(w) for v in sides for w in v)


def _scalar_list(path: str, old: list[Any], new: list[Any]) -> list[Leaf]:
    """The elements of a list of scalars (CIDR lists, tags) that changed, by index, rather than the whole list."""
    out: list[Leaf] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        for k in range(max(i2 - i1, j2 - j1)):
            a = old[i1 + k] if i1 + k < i2 else None
            b = new[j1 + k] if j1 + k < j2 else None
            out.append((f"{path}[{(j1 + k) if b is not None else (i1 + k)}]", a, b))
    return out


def _walk(path: str, a: Any, b: Any, out: list[Leaf]) -> None:
    if a == b:
        return
    field = _field(path)
    if _argv_like(field, a, b):
        fa, fb = argv_flags(a or []), argv_flags(b or [])
        out += [(f"{path} {k}", fa.get(k), fb.get(k)) for k in _ordered_union(list(fa), list(fb))
                if fa.get(k) != fb.get(k)]
        # Order is meaning on a command line (a later --set overrides an earlier one on the same key): flags both
        # sides have, given in another order, are a change of their own.
        both_a, both_b = [k for k in fa if k in fb], [k for k in fb if k in fa]
        if both_a != both_b:
            out.append((f"{path} (order)", " ".join(both_a), " ".join(both_b)))
        return
    if _nested(a) or _nested(b):
        _walk_nested(path, field, a, b, out)
        return
    if isinstance(a, list) and isinstance(b, list):
        out += _scalar_list(path, a, b)
        return
    out.append((path, a, b))


def _walk_nested(path: str, field: str, a: Any, b: Any, out: list[Leaf]) -> None:
    if all(v is None or isinstance(v, dict) for v in (a, b)):
        a, b = a or {}, b or {}
        for k in _ordered_union(list(a), list(b)):
            _walk(f"{path}.{k}" if path else str(k), a.get(k), b.get(k), out)
        return
    if all(v is None or isinstance(v, list) for v in (a, b)):
        a, b = a or [], b or []
        ka, kb = _keyed(field, a), _keyed(field, b)
        if (ka is not None or not a) and (kb is not None or not b):
            ka, kb = ka or {}, kb or {}
            for k in _ordered_union(list(ka), list(kb)):
                if k in ka and k in kb:
                    _walk(f"{path}[{k}]", ka[k], kb[k], out)
                else:  # a named item added or removed: one line, the item whole
                    out.append((f"{path}[{k}]", ka.get(k), kb.get(k)))
        else:
            for i in range(max(len(a), len(b))):
                _walk(f"{path}[{i}]", a[i] if i < len(a) else None, b[i] if i < len(b) else None, out)
        return
    out.append((path, a, b))  # a dict on one side, a list or a scalar on the other: shown whole


def changed_inputs(old: dict[str, Any], new: dict[str, Any]) -> list[Leaf]:
    """(path, old, new) for every leaf that differs, in document order; a missing side is None."""
    out: list[Leaf] = []
    _walk("", old, new, out)
    return out


def show(value: Any) -> str:
    """A leaf as the diff prints it: a string as is, anything else as JSON, a missing side as ∅."""
    return "∅" if value is None else value if isinstance(value, str) else json.dumps(value, sort_keys=True)
