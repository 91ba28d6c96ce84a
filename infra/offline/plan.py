"""The offline plan: run the program on a stack config file (infra/base/stack_file.py finds and reads it) under mocks,
and write what it would apply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from infra.base.stack_file import PlanError, load_stack_config, repo_root, stack_file
from infra.offline.mockrun import PlanResult, Resource, run_stack

NON_OBJECT_PREFIXES = ("kubernetes:helm.sh/", "kubernetes:yaml/", "kubernetes:kustomize/")


def plan(env: str, config_file: Path | None = None, root: Path | None = None) -> PlanResult:
    """Runs the stack `env` (environments/Pulumi.ENV.yaml, or `config_file`) under mocks.

    Raises PlanError for a missing/unreadable file and envspec.config.ConfigError for invalid config."""
    path = config_file if config_file is not None else stack_file(env, root or repo_root())
    return run_stack(env, load_stack_config(path))


# ---------------------------------------------------------------- Kubernetes objects


def is_kubernetes_type(type_: str, custom: bool) -> bool:
    """A resource of this type becomes one object on the cluster (Helm releases and providers do not)."""
    return custom and type_.startswith("kubernetes:") and not type_.startswith(NON_OBJECT_PREFIXES)


def is_kubernetes_object(resource: Resource) -> bool:
    return is_kubernetes_type(resource.type, resource.custom)


def _type_gvk(type_: str) -> tuple[str, str]:
    # kubernetes:core/v1:Namespace -> ("v1", "Namespace"); kubernetes:jobset.x-k8s.io/v1alpha2:JobSet -> ...
    _, group_version, kind = type_.split(":")
    group, _, version = group_version.partition("/")
    return (version if group == "core" else group_version), kind


def kubernetes_object(resource: Resource) -> dict[str, Any]:
    """The manifest a resource's inputs describe: apiVersion, kind, metadata first, then the rest by name."""
    api_version, kind = _type_gvk(resource.type)
    inputs = dict(resource.inputs)
    obj: dict[str, Any] = {"apiVersion": inputs.pop("apiVersion", api_version), "kind": inputs.pop("kind", kind),
                           "metadata": inputs.pop("metadata", {"name": resource.name})}
    obj.update(sorted(inputs.items()))
    return obj


def kubernetes_objects(result: PlanResult) -> list[dict[str, Any]]:
    return [kubernetes_object(r) for r in result.resources if is_kubernetes_object(r)]


def manifest_filenames(objects: list[dict[str, Any]]) -> list[str]:
    """kind-name.yaml per object; the namespace joins the name only where two objects would collide."""
    def short(o: dict[str, Any]) -> str:
        return f"{o['kind'].lower()}-{o['metadata'].get('name', 'unnamed')}"

    counts: dict[str, int] = {}
    for o in objects:
        counts[short(o)] = counts.get(short(o), 0) + 1
    names = []
    for o in objects:
        ns = o["metadata"].get("namespace")
        names.append(f"{o['kind'].lower()}-{ns}-{o['metadata'].get('name')}.yaml"
                     if counts[short(o)] > 1 and ns else f"{short(o)}.yaml")
    if len(set(names)) != len(names):
        raise PlanError(f"two Kubernetes objects share kind, namespace and name: {sorted(names)}")
    return names


def _yaml(obj: Any) -> str:
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=120)


def resources_document(result: PlanResult) -> dict[str, Any]:
    return {"stack": result.env, "project": "gke-tpu-rl", "stackUrn": result.stack_urn,
            "resources": [r.to_json() for r in result.resources], "outputs": result.outputs}


def write_out(result: PlanResult, out_dir: Path, markdown: str | None = None) -> list[Path]:
    """Writes one YAML file per Kubernetes object, resources.json (and plan.md when given); returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "resources.json").is_file():  # an earlier plan's output: drop objects that no longer exist
        for stale in out_dir.glob("*.yaml"):
            stale.unlink()
    written = []
    objects = kubernetes_objects(result)
    for name, obj in zip(manifest_filenames(objects), objects, strict=True):
        path = out_dir / name
        path.write_text(_yaml(obj))
        written.append(path)
    path = out_dir / "resources.json"
    path.write_text(json.dumps(resources_document(result), indent=2, sort_keys=True) + "\n")
    written.append(path)
    if markdown is not None:
        (out_dir / "plan.md").write_text(markdown)
        written.append(out_dir / "plan.md")
    return written
