"""The offline plan: find a stack config file, run the program on it under mocks, write what it would apply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from infra.mockrun import PlanResult, Resource, run_stack
from trainer import yamlfile

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
NON_OBJECT_PREFIXES = ("kubernetes:helm.sh/", "kubernetes:yaml/", "kubernetes:kustomize/")
HEAD_KEYS = ("apiVersion", "kind", "metadata")


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
