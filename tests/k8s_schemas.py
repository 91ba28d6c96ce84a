"""Validates Kubernetes objects against the upstream schemas in ../shared/schemas (see its SOURCES.md).

CRDs (JobSet, Kueue, KubeRay): jsonschema on the served version's openAPIV3Schema. Core v1 and
resource.k8s.io/v1: the Kubernetes OpenAPI v3 documents, `{"$ref": "#/components/schemas/<name>"}`.
Upstream schemas accept unknown fields (the apiserver prunes them), so every object schema that lists
properties gets `additionalProperties: false` unless it preserves unknown fields or embeds a resource:
a typo'd field then fails here instead of silently vanishing on the cluster. CEL rules are not checked.
"""

from __future__ import annotations

import copy
import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
# Override the location with GKE_TPU_RL_SCHEMAS; missing schemas fail tests unless this is "1":
ALLOW_MISSING_ENV = "GKE_TPU_RL_ALLOW_NO_SCHEMAS"
# The Kubernetes releases whose core schemas every object must pass (GKE's DRANET floor is 1.34).
KUBERNETES_VERSIONS = ("v1.34", "v1.35")
KUBERNETES_VERSION = KUBERNETES_VERSIONS[0]
POD_TEMPLATE = "io.k8s.api.core.v1.PodTemplateSpec"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"

_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "not", "additionalProperties", "additionalItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs")


class SchemasMissing(RuntimeError):
    """../shared/schemas (or $GKE_TPU_RL_SCHEMAS) is not there, so nothing can be validated."""


def schemas_dir() -> Path:
    return Path(os.environ.get("GKE_TPU_RL_SCHEMAS") or REPO_ROOT.parent / "shared" / "schemas")


def require_schemas() -> Path:
    d = schemas_dir()
    if not (d / "SOURCES.md").is_file():
        raise SchemasMissing(
            f"upstream Kubernetes/CRD schemas not found at {d}: Kubernetes objects cannot be validated. "
            f"Provide ../shared/schemas next to the repository (or set GKE_TPU_RL_SCHEMAS to its path); "
            f"set {ALLOW_MISSING_ENV}=1 to skip these checks knowingly.")
    return d


def need_schemas() -> Path:
    """For tests: the schemas directory, or a failure that says why (a skip only when asked for)."""
    import pytest

    try:
        return require_schemas()
    except SchemasMissing as e:
        if os.environ.get(ALLOW_MISSING_ENV) == "1":
            pytest.skip(str(e))
        pytest.fail(str(e), pytrace=False)
        raise  # unreachable; pytest.fail raises


def _python_pattern(pattern: str) -> str:
    # Go's RE2 takes `^(?i)...`; Python wants inline flags first: `(?i)^...` means the same.
    m = re.match(r"^\^\(\?([a-zA-Z]+)\)", pattern)
    return f"(?{m.group(1)})^{pattern[m.end():]}" if m else pattern


def strict(schema: Any) -> Any:
    """A copy of `schema` that rejects unknown fields, reads OpenAPI's `nullable: true` as allowing null and
    writes RE2-only pattern syntax the Python way."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict(v) for v in out[key]]
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    if isinstance(out.get("components"), dict) and isinstance(out["components"].get("schemas"), dict):
        out["components"] = {**out["components"],
                             "schemas": {k: strict(v) for k, v in out["components"]["schemas"].items()}}
    open_ended = out.get("x-kubernetes-preserve-unknown-fields") or out.get("x-kubernetes-embedded-resource")
    if "properties" in out and "additionalProperties" not in out and not open_ended:
        out["additionalProperties"] = False
    if isinstance(out.get("pattern"), str):
        out["pattern"] = _python_pattern(out["pattern"])
    if out.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _load_yaml_docs(path: Path) -> list[Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the JobSet CRD is 800 KB
    with path.open() as f:
        return [d for d in yaml.load_all(f, Loader=loader) if d]


def _split_api_version(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


@cache
def _crds() -> dict[tuple[str, str, str], dict[str, Any]]:
    """(group, version, kind) -> the served version's openAPIV3Schema, for every CRD under the schemas dir."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in sorted(require_schemas().glob("*/*.yaml")):
        for doc in _load_yaml_docs(path):
            if doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for v in spec["versions"]:
                if v.get("served") and "schema" in v:
                    out[(spec["group"], v["name"], spec["names"]["kind"])] = v["schema"]["openAPIV3Schema"]
    return out


@cache
def _openapi_docs(kv: str = KUBERNETES_VERSION) -> list[dict[str, Any]]:
    d = require_schemas() / "kubernetes" / kv
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))]


@cache
def _openapi_index(kv: str = KUBERNETES_VERSION) -> dict[tuple[str, str, str], tuple[int, str]]:
    """(group, version, kind) -> (document index, schema name) from x-kubernetes-group-version-kind."""
    out: dict[tuple[str, str, str], tuple[int, str]] = {}
    for i, doc in enumerate(_openapi_docs(kv)):
        for name, schema in doc["components"]["schemas"].items():
            for gvk in schema.get("x-kubernetes-group-version-kind", []):
                key = (gvk["group"], gvk["version"], gvk["kind"])
                # DeleteOptions/WatchEvent list many GVKs; the kind's own schema is named after it.
                if key not in out or name.endswith("." + gvk["kind"]):
                    out[key] = (i, name)
    return out


@cache
def _strict_components(doc_index: int, kv: str = KUBERNETES_VERSION) -> dict[str, Any]:
    return strict({"components": _openapi_docs(kv)[doc_index]["components"]})["components"]


@cache
def _validator(group: str, version: str, kind: str, kv: str = KUBERNETES_VERSION) -> jsonschema.protocols.Validator:
    crd = _crds().get((group, version, kind))
    if crd is not None:
        schema = strict(copy.deepcopy(crd))
    elif (group, version, kind) in _openapi_index(kv):
        doc_index, name = _openapi_index(kv)[(group, version, kind)]
        schema = {"$ref": f"#/components/schemas/{name}", "components": _strict_components(doc_index, kv)}
    else:
        raise KeyError(kind)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


@cache
def _core_validator(name: str, kv: str = KUBERNETES_VERSION) -> jsonschema.protocols.Validator:
    """A core type by schema name, e.g. ObjectMeta for CRD metadata (CRDs declare it as a bare object), or the
    PodTemplateSpec a JobSet embeds (its CRD carries the pod schema of the release it was built against)."""
    for i, doc in enumerate(_openapi_docs(kv)):
        if name in doc["components"]["schemas"]:
            schema = {"$ref": f"#/components/schemas/{name}", "components": _strict_components(i, kv)}
            return jsonschema.Draft202012Validator(schema)
    raise SchemasMissing(f"{name} not found in the Kubernetes {kv} OpenAPI documents")


def known_kinds(kv: str = KUBERNETES_VERSION) -> set[tuple[str, str]]:
    """Every (apiVersion, kind) this module can validate."""
    keys = set(_crds()) | set(_openapi_index(kv))
    return {(f"{g}/{v}" if g else v, k) for g, v, k in keys}


def _format(err: jsonschema.ValidationError, prefix: tuple[str, ...] = ()) -> str:
    parts = (*prefix, *err.absolute_path)
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".") or "."
    msg = err.message if len(err.message) <= 300 else err.message[:297] + "..."
    return f"{path}: {msg}"


def validate(obj: dict[str, Any], kv: str = KUBERNETES_VERSION) -> list[str]:
    """Every schema error in one Kubernetes object for Kubernetes release `kv` (empty when it is valid), each as
    `path: message`."""
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        return [".: apiVersion and kind are required"]
    group, version = _split_api_version(api_version)
    try:
        validator = _validator(group, version, kind, kv)
    except KeyError:
        if group in BUNDLED_GROUPS:
            return _validate_bundled(obj, kv)
        return [f".: no schema for {api_version} {kind} under {schemas_dir()}"]
    errors = [_format(e) for e in validator.iter_errors(obj)]
    if (group, version, kind) in _crds() and isinstance(obj.get("metadata"), dict):
        errors += [_format(e, ("metadata",)) for e in _core_validator(OBJECT_META, kv).iter_errors(obj["metadata"])]
    for prefix, template in embedded_pod_templates(obj):
        errors += [_format(e, prefix) for e in _core_validator(POD_TEMPLATE, kv).iter_errors(template)]
    return sorted(set(errors))


def embedded_pod_templates(obj: dict[str, Any]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """(path, PodTemplateSpec) of every pod template a JobSet, RayJob or RayCluster embeds: their CRDs carry the pod
    schema of the release they were built against, so each is also checked against each release's own."""
    spec = obj.get("spec") or {}
    found: list[tuple[tuple[Any, ...], Any]] = []
    if obj.get("kind") == "JobSet":
        for i, rj in enumerate(spec.get("replicatedJobs") or []):
            found.append((("spec", "replicatedJobs", i, "template", "spec", "template"),
                          ((rj.get("template") or {}).get("spec") or {}).get("template")))
    cluster, at = (spec.get("rayClusterSpec"), ("spec", "rayClusterSpec")) if obj.get("kind") == "RayJob" else (
        spec, ("spec",)) if obj.get("kind") == "RayCluster" else (None, ())
    if isinstance(cluster, dict):
        found.append(((*at, "headGroupSpec", "template"), (cluster.get("headGroupSpec") or {}).get("template")))
        for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
            found.append(((*at, "workerGroupSpecs", i, "template"), group.get("template")))
    return [(path, t) for path, t in found if isinstance(t, dict)]


# Built-in API groups ../shared/schemas does not carry: their strict schemas come from the kubernetes-validate
# package (PyPI; Kubernetes' own OpenAPI converted per release, unknown fields refused in its -strict set).
BUNDLED_GROUPS = ("networking.k8s.io",)


def _validate_bundled(obj: dict[str, Any], kv: str) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, kv.removeprefix("v") + ".0", strict=True)
    except kubernetes_validate.ValidationError as err:
        return [f"{'.'.join(str(p) for p in err.path) or '.'}: {err.message}"]
    return []


def assert_valid(obj: dict[str, Any], versions: tuple[str, ...] = KUBERNETES_VERSIONS) -> None:
    """The object passes its schema for every Kubernetes release in `versions`."""
    for kv in versions:
        errors = validate(obj, kv)
        if errors:
            meta = obj.get("metadata") or {}
            raise AssertionError(f"{obj.get('apiVersion')} {obj.get('kind')} {meta.get('name')!r} does not match "
                                 f"its upstream schema for Kubernetes {kv}:\n  " + "\n  ".join(errors))
