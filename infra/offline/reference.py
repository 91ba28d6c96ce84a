"""The config references, docs/stack-config.md and docs/trainer-config.md, generated from the typed specs.

Every key comes from walking the pydantic models (envspec/config.py EnvironmentSpec, trainer/base/config.py
TrainConfig): its name as a user writes it (the alias), type, default, allowed values (Literal choices, numeric bounds,
list and mapping shapes) and the Field's description. Values that validators check against a catalog (TPU types, chart
versions, bundled trainer configs, tasks, rewards) are read from that catalog. `gke-tpu-rl reference --write`
rewrites both files; tests/test_reference.py fails when the committed ones differ.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

REGENERATE = "gke-tpu-rl reference --write"
STACK_DOC = "docs/stack-config.md"
TRAINER_DOC = "docs/trainer-config.md"
SECTION = "section"
LIST_OF_MAPPINGS = "list of mappings, each with the `[i]` keys"
# What each secret key (envspec/config.py SECRET_KEYS: read outside the typed spec) does.
SECRET_DESCRIPTIONS = {
    "hfToken": "the Hugging Face token: the stack puts it in a Kubernetes Secret the trainer pods read as "
    "HF_TOKEN. Set it with `pulumi config set --secret gke-tpu-rl:hfToken hf_...`",
}
_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}


@dataclass(frozen=True)
class Key:
    """One config key, as a row of the reference."""

    name: str  # as written in the file, without the stack namespace: `cluster.systemPool.machineType`
    type: str
    default: str
    allowed: str
    description: str

    @property
    def top(self) -> str:
        """The top-level key it is under."""
        return self.name.split(".")[0].split("[")[0]


def _strip_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else Union[tuple(args)]  # noqa: UP007
    return annotation


def _model(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _type(annotation: Any) -> str:
    t = _strip_none(annotation)
    if get_origin(t) is Annotated:  # an optional one keeps its Annotated wrapper inside the union
        t = get_args(t)[0]
    origin = get_origin(t)
    if origin is Literal:
        return _TYPES.get(type(get_args(t)[0]), "value")
    if origin is list:
        item = _type(get_args(t)[0])
        return f"list of {item}s" if item in _TYPES.values() else f"list of {item}"
    if origin is dict:
        key, value = get_args(t)
        return f"mapping of {_type(key)} to {_type(value)}"
    if _model(t) is not None:
        return "mapping"
    return _TYPES.get(t, getattr(t, "__name__", str(t)))


def _number(v: float) -> str:
    if isinstance(v, int) and abs(v) >= 2**31 and abs(v) & (abs(v) - 1) == 0:  # int64 bounds: 2^63
        return ("-" if v < 0 else "") + f"2^{abs(v).bit_length() - 1}"
    return str(v)


def _bounds(metadata: list[Any]) -> list[str]:
    """`0 to 90` (both inclusive), else the lower bound and the upper one: `> 0, <= 1`."""
    found = {type(m).__name__: m for m in metadata}
    out = []
    if "Ge" in found and "Le" in found:
        out.append(f"{_number(found['Ge'].ge)} to {_number(found['Le'].le)}")
    else:
        lower = [f">= {_number(found['Ge'].ge)}"] if "Ge" in found else []
        lower += [f"> {_number(found['Gt'].gt)}"] if "Gt" in found else []
        upper = [f"<= {_number(found['Le'].le)}"] if "Le" in found else []
        upper += [f"< {_number(found['Lt'].lt)}"] if "Lt" in found else []
        if lower or upper:
            out.append(", ".join(lower + upper))
    for m in metadata:
        if isinstance(m, at.MinLen) and m.min_length:
            out.append("non-empty" if m.min_length == 1 else f"at least {m.min_length} long")
        elif isinstance(m, at.MaxLen):
            out.append(f"at most {m.max_length} long")
    return out


def _value(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    if isinstance(v, list | dict):
        return f"`{yaml.safe_dump(v, default_flow_style=True, sort_keys=False, width=1000).strip()}`"
    return f"`{v}`"


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return "" if isinstance(value, BaseModel) else _value(value)


def _allowed(annotation: Any, field: FieldInfo) -> list[str]:
    t = _strip_none(annotation)
    out = []
    if get_origin(t) is Literal:
        out.append(", ".join(f"`{a}`" for a in get_args(t)))
    elif get_origin(t) is list and get_origin(get_args(t)[0]) is Literal:
        out.append("each one of " + ", ".join(f"`{a}`" for a in get_args(get_args(t)[0])))
    bounds = _bounds(field.metadata)
    if get_origin(t) is list:
        bounds = [b.replace("non-empty", "at least 1 item") for b in bounds]
    return out + bounds


def walk(model: type[BaseModel], extra: dict[str, Callable[[], str]] | None = None, prefix: str = "",
         skip: tuple[str, ...] = ()) -> list[Key]:
    """Every key of `model`, depth first in field order: a row per section (a nested model), per list of models
    (its items' keys follow as `name[i].key`) and per value. `extra`: allowed values a validator checks, by key."""
    extra = extra or {}
    keys = []
    for name, field in model.model_fields.items():
        written = field.alias or name
        if written in skip:
            continue
        key = prefix + written
        inner = _strip_none(field.annotation)
        allowed = _allowed(field.annotation, field) + ([extra[key]()] if key in extra else [])
        description = field.description or ""
        section = _model(inner)
        item = _model(get_args(inner)[0]) if get_origin(inner) is list else None
        if section is not None:
            keys.append(Key(key, SECTION, _default(field), "; ".join(allowed), description))
            keys += walk(section, extra, key + ".")
        elif item is not None:
            keys.append(Key(key, LIST_OF_MAPPINGS, _default(field), "; ".join(allowed), description))
            keys += walk(item, extra, key + "[i].")
        else:
            keys.append(Key(key, _type(field.annotation), _default(field), "; ".join(allowed), description))
    if model.model_config.get("extra") == "allow":
        keys.append(Key(prefix + "<option>", "any", "", "", "any other key of this section, passed on as an option"))
    return keys


def _codes(values: Any) -> str:
    return ", ".join(f"`{v}`" for v in values)


def _stack_extra() -> dict[str, Callable[[], str]]:
    from envspec import config, machines, tpu

    def machine_types() -> str:
        kinds = sorted({k for f in machines.MACHINE_FAMILIES.values() for k in f})
        return (f"`<family>-<{'|'.join(kinds)}>-<vCPUs>` of the families "
                f"{_codes(sorted(machines.MACHINE_FAMILIES))}")

    def jobset_versions() -> str:
        from infra.checks.system_pool import JOBSET_CHART_PODS

        return _codes(JOBSET_CHART_PODS)

    def trainer_configs() -> str:
        from trainer.base.config import bundled_configs

        return "a file under trainer/configs/: " + _codes(bundled_configs().runs)

    return {
        "cluster.systemPool.machineType": machine_types,
        "slices[i].tpuType": lambda: f"{_codes(tpu.GENERATIONS)} (aliases: {_codes(sorted(tpu.ALIASES))})",
        "slices[i].topology": lambda: "per TPU type, in the table below",
        "controllers.jobsetVersion": jobset_versions,
        "controllers.kueueVersion": lambda: _codes(config.KUEUE_CHART_VERSIONS),
        "trainer.config": trainer_configs,
    }


def stack_keys() -> list[Key]:
    """Every key of a stack file (without the `gke-tpu-rl:` namespace), the secret keys after the top level ones."""
    from envspec.config import SECRET_KEYS, EnvironmentSpec

    # `env` is the stack's name (parse_spec sets it), not a key a stack file sets.
    keys = walk(EnvironmentSpec, _stack_extra(), skip=("env",))
    secrets = [Key(k, "string, **Pulumi secret**", "unset", "", SECRET_DESCRIPTIONS.get(k, "")) for k in SECRET_KEYS]
    top = sum(1 for k in keys if "." not in k.name and k.type != SECTION)
    return keys[:top] + secrets + keys[top:]


def trainer_keys() -> list[Key]:
    """Every key of a trainer YAML config, as written there (aliases such as `init.from`)."""
    from trainer.base.config import TrainConfig
    from trainer.rl.rewards import REWARDS
    from trainer.rl.tasks import TASK_NAMES

    return walk(TrainConfig, {"task.name": lambda: _codes(TASK_NAMES) + ", or `MODULE:FACTORY` of your own code",
                              "rewards": lambda: "each one of " + _codes(sorted(REWARDS))
                              + ", or `MODULE:FUNCTION` of your own code"})


def _cell(text: str) -> str:
    """Table-safe: no line breaks, `|` escaped, and `<` outside code spans escaped (`<run_dir>` is no HTML tag)."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    return "`".join(p if i % 2 else re.sub(r"<(?=[A-Za-z/!?])", "&lt;", p) for i, p in enumerate(parts))


def _tables(keys: list[Key], render: Callable[[str], str], sections: dict[str, str]) -> list[str]:
    """A table of the top-level values, then one per top-level section or list of mappings, its own row first."""
    head = ["| key | type | default | allowed | what it sets |", "|---|---|---|---|---|"]

    def rows(group: list[Key]) -> list[str]:
        return [f"| {render(k.name)} | {_cell(k.type)} | {_cell(k.default)} | {_cell(k.allowed)} | "
                f"{_cell(k.description)} |" for k in group]

    top = [k for k in keys if k.name == k.top and k.type not in (SECTION, LIST_OF_MAPPINGS)]
    out = ["## Top level", "", *head, *rows(top), ""]
    for k in keys:
        if k.name != k.top or k in top:
            continue
        out += [f"## {k.name}", "", *head, *rows([g for g in keys if g.top == k.name]), ""]
        out += sections.get(k.name, "").splitlines() + ([""] if k.name in sections else [])
    return out


def _topologies() -> str:
    from envspec import tpu

    lines = ["TPU types and the topologies each offers (`slices[i].topology`), from the TPU catalog "
             "(envspec/tpu.py):", "", "| tpuType | topologies |", "|---|---|"]
    lines += [f"| `{name}` | {', '.join(g.topologies)} |" for name, g in tpu.GENERATIONS.items()]
    return "\n".join(lines)


def stack_markdown() -> str:
    keys = stack_keys()
    lines = [
        "# Stack config reference",
        "",
        f"<!-- Generated from envspec/config.py by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "Every key of an environment's stack file, `environments/Pulumi.<env>.yaml`, all under the `gke-tpu-rl:` "
        "namespace. A dotted key is a nested mapping in the file: `gke-tpu-rl:cluster.systemPool.machineType` is",
        "",
        "```yaml",
        "config:",
        "  gke-tpu-rl:cluster:",
        "    systemPool:",
        "      machineType: e2-standard-8",
        "```",
        "",
        "and `[i]` is every item of a list (`gke-tpu-rl:slices[0].topology` is the first group's). Unknown keys are "
        "errors (naming the closest allowed keys), and so is a value outside what the table allows; validation names "
        "the key, the value and what is allowed, before any resource is registered. The environment's name is the "
        "stack's name (`pulumi stack init ENV`), not a key. \"required\": the key has no default and must be set; "
        "\"unset\": leave the key out (or `null`) and the description says what happens then.",
        "",
        f"{len(keys)} keys, {sum(k.type == SECTION for k in keys)} of them sections.",
        "",
    ]
    lines += _tables(keys, lambda name: f"`gke-tpu-rl:{name}`", {"slices": _topologies()})
    return "\n".join(lines).rstrip() + "\n"


def trainer_markdown() -> str:
    keys = trainer_keys()
    lines = [
        "# Trainer config reference",
        "",
        f"<!-- Generated from trainer/base/config.py by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "Every key of the trainer's YAML config (the files under `trainer/configs/`, or any file given to "
        "`--config`). A dotted key is a nested mapping in the file: `compute.remat` is `remat:` under `compute:`. "
        "The trainer's `--set KEY=VALUE` overrides one (e.g. `--set rl.group_size=16`); in a stack, "
        "`gke-tpu-rl:trainer.config` names the file and `gke-tpu-rl:trainer.args` can pass `--set`. Unknown keys "
        "are errors. \"required\": the key has no default and must be set (in a section that is there); "
        "\"unset\": leave the key out (or `null`) and the description says what happens then.",
        "",
        f"{len(keys)} keys, {sum(k.type == SECTION for k in keys)} of them sections.",
        "",
    ]
    lines += _tables(keys, lambda name: f"`{name}`", {})
    return "\n".join(lines).rstrip() + "\n"


DOCS: dict[str, tuple[str, Callable[[], str]]] = {
    "stack": (STACK_DOC, stack_markdown),
    "trainer": (TRAINER_DOC, trainer_markdown),
}


def write(root: Path, which: list[str] | None = None) -> list[Path]:
    """Rewrites the references under `root` (the repository); returns the files written."""
    written = []
    for name in which or list(DOCS):
        path, render = DOCS[name]
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render())
        written.append(target)
    return written
