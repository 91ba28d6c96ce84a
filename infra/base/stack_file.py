"""The stack config file on disk: where environments/Pulumi.ENV.yaml is (Pulumi.yaml's stackConfigDir), its `config:`
map, and the validated spec it gives without running the program. What the offline tools (`plan`, `fit`, `synth`)
read; the running program reads the same keys through Pulumi instead (infra/base/stack_config.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from envspec.config import NAMESPACE, EnvironmentSpec, parse_spec
from trainer.base import yamlfile

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class PlanError(Exception):
    """A problem with the plan's inputs (missing or unreadable stack file); the message says which."""


def repo_root(start: Path | None = None) -> Path:
    """The nearest directory at or above `start` (the cwd) holding Pulumi.yaml; else this checkout's root."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "Pulumi.yaml").is_file():
            return d
    return PACKAGE_ROOT


def stack_config_dir(root: Path) -> Path:
    # Follow Pulumi.yaml's stackConfigDir, as the CLI does.
    project = yaml.safe_load((root / "Pulumi.yaml").read_text()) if (root / "Pulumi.yaml").is_file() else {}
    return root / ((project or {}).get("stackConfigDir") or ".")


def available_envs(root: Path) -> list[str]:
    return sorted(p.name[len("Pulumi."):-len(".yaml")] for p in stack_config_dir(root).glob("Pulumi.*.yaml"))


def stack_file(env: str, root: Path) -> Path:
    path = stack_config_dir(root) / f"Pulumi.{env}.yaml"
    if not path.is_file():
        known = ", ".join(available_envs(root)) or "none"
        raise PlanError(f"no stack config for environment {env!r}: {path} does not exist (environments: {known})")
    return path


def load_stack_config(path: Path) -> dict[str, Any]:
    """The `config:` map of a Pulumi stack config file."""
    if not path.is_file():
        raise PlanError(f"cannot read stack config {path}: no such file")
    try:
        doc = yamlfile.load(path)
    except yamlfile.YamlFileError as e:
        raise PlanError(f"stack config is not valid YAML: {e}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("config", {}), dict):
        raise PlanError(f"{path} is not a Pulumi stack config file (expected a mapping with a `config:` map)")
    return doc.get("config") or {}


def env_spec(env: str, config_file: Path | None = None, root: Path | None = None) -> EnvironmentSpec:
    """The validated spec of environments/Pulumi.ENV.yaml (or `config_file`), without running the program."""
    from trainer.base.config import bundled_configs

    raw = load_stack_config(config_file if config_file is not None else stack_file(env, root or repo_root()))
    prefix = NAMESPACE + ":"
    ours = {k.removeprefix(prefix): v for k, v in raw.items() if k.startswith(prefix) or ":" not in k}
    return parse_spec(ours, env, bundled_configs())
