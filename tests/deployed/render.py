"""An environment's objects as `pulumi up` would create them: the plan's Kubernetes objects in its order, and which
of them waits for which (the program's dependsOn)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra.base.stack_file import stack_file
from infra.offline.mockrun import PlanResult
from infra.offline.plan import is_kubernetes_object, kubernetes_object, plan

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Rendered:
    result: PlanResult
    objects: list[dict[str, Any]]
    depends_on: dict[str, list[str]]  # "<kind>/<name>" -> the "<kind>/<name>" it waits for

    def get(self, kind: str, name: str) -> dict[str, Any]:
        for obj in self.objects:
            if obj["kind"] == kind and obj["metadata"]["name"] == name:
                return obj
        raise KeyError(f"{kind}/{name}")

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]


def _key(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def render(env: str, config_file: Path | None = None) -> Rendered:
    result = plan(env, config_file, ROOT)
    by_urn = {r.urn: r for r in result.resources if is_kubernetes_object(r)}
    objects, depends_on = [], {}
    for r in result.resources:
        if not is_kubernetes_object(r):
            continue
        obj = kubernetes_object(r)
        objects.append(obj)
        depends_on[_key(obj)] = [_key(kubernetes_object(by_urn[u])) for u in r.options.get("dependsOn", [])
                                 if u in by_urn]
    return Rendered(result, objects, depends_on)


def user_copy(env: str, folder: Path, name: str, changes: dict[str, Any]) -> Path:
    """A user's copy of a shipped environment's stack file, with `changes` (top-level keys under gke-tpu-rl:,
    merged one level deep into mappings): what a team does to try an environment on its own terms."""
    doc = yaml.safe_load(stack_file(env, ROOT).read_text())
    config = doc["config"]
    for key, value in changes.items():
        full = f"gke-tpu-rl:{key}"
        if isinstance(value, dict) and isinstance(config.get(full), dict):
            config[full] = {**config[full], **value}
        else:
            config[full] = value
    path = folder / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path
