"""Validates Kubernetes objects against upstream schemas that travel with the repository (nothing outside it is read).

CRDs (JobSet, Kueue, KubeRay): jsonschema on the served version's openAPIV3Schema, from the CRD files vendored
byte-for-byte under tests/schemas/crds (their upstream tags, commits and sha256 in tests/schemas/crds/SOURCES.md).
Built-in kinds (core v1, resource.k8s.io/v1, networking.k8s.io/v1, ...): the JSON schemas the kubernetes-validate
package (PyPI, a dev dependency) bundles per Kubernetes release, Kubernetes' own OpenAPI converted to JSON Schema.
Upstream schemas accept unknown fields (the apiserver prunes them), so every object schema that lists properties gets
`additionalProperties: false` unless it preserves unknown fields or embeds a resource: a typo'd field then fails here
instead of silently vanishing on the cluster. kubernetes-validate's conversion lets every optional field be null; the
Kubernetes OpenAPI does not say so (it marks no core field nullable), so null is taken out again: a None that leaks into
an emitted object fails here. CEL rules are not checked.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMAS_DIR = Path(__file__).resolve().parent / "schemas"
CRDS_DIR = SCHEMAS_DIR / "crds"  # <project>/<upstream file name>.yaml, listed in SOURCES.md with their sha256
# The Kubernetes releases whose built-in schemas every object must pass (GKE's DRANET floor is 1.34).
KUBERNETES_VERSIONS = ("v1.34", "v1.35")
KUBERNETES_VERSION = KUBERNETES_VERSIONS[0]
POD_TEMPLATE = "io.k8s.api.core.v1.PodTemplateSpec"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"

_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "not", "additionalProperties", "additionalItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs")


class SchemasMissing(RuntimeError):
    """The vendored CRDs or kubernetes-validate's schemas for a release are not there: nothing can be validated."""


def _crd_files() -> list[Path]:
    return sorted(CRDS_DIR.glob("*/*.yaml"))


def require_schemas() -> Path:
    """The vendored CRD directory, once it and kubernetes-validate's schemas for every release are found."""
    if not (CRDS_DIR / "SOURCES.md").is_file() or not _crd_files():
        raise SchemasMissing(f"vendored CRD schemas not found at {CRDS_DIR}: the checkout is incomplete "
                             f"(they are tracked files; see tests/schemas/crds/SOURCES.md)")
    for kv in KUBERNETES_VERSIONS:
        _definitions_file(kv)
    return CRDS_DIR


def need_schemas() -> Path:
    """For tests: the vendored CRD directory, or a failure that says what is missing."""
    import pytest

    try:
        return require_schemas()
    except SchemasMissing as e:
        missing = str(e)
    pytest.fail(missing, pytrace=False)


def _python_pattern(pattern: str) -> str:
    # Go's RE2 takes `^(?i)...`; Python wants inline flags first: `(?i)^...` means the same.
    m = re.match(r"^\^\(\?([a-zA-Z]+)\)", pattern)
    return f"(?{m.group(1)})^{pattern[m.end():]}" if m else pattern


def _map_subschemas(schema: dict[str, Any], fn: Any) -> dict[str, Any]:
    """A shallow copy of `schema` with `fn` applied to each direct subschema (never to property names)."""
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: fn(v) for k, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [fn(v) for v in out[key]]
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = fn(out[key])
    return out


def strict(schema: Any) -> Any:
    """A copy of `schema` that rejects unknown fields, reads OpenAPI's `nullable: true` as allowing null and
    writes RE2-only pattern syntax the Python way."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, strict)
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


def not_null(schema: Any) -> Any:
    """A copy of `schema` without the null that kubernetes-validate's OpenAPI conversion adds to every optional
    field's type (and enum): Kubernetes' own OpenAPI allows null nowhere in the built-in kinds."""
    if not isinstance(schema, dict):
        return schema
    out = _map_subschemas(schema, not_null)
    if isinstance(out.get("type"), list) and "null" in out["type"]:
        types = [t for t in out["type"] if t != "null"]
        out["type"] = types[0] if len(types) == 1 else types
    if isinstance(out.get("enum"), list) and None in out["enum"]:
        out["enum"] = [v for v in out["enum"] if v is not None]
    return out


def _load_yaml_docs(path: Path) -> list[Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the RayJob CRD is 1.4 MB
    with path.open() as f:
        return [d for d in yaml.load_all(f, Loader=loader) if d]


def _split_api_version(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


@cache
def _crds() -> dict[tuple[str, str, str], dict[str, Any]]:
    """(group, version, kind) -> the served version's openAPIV3Schema, for every vendored CRD."""
    require_schemas()
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in _crd_files():
        for doc in _load_yaml_docs(path):
            if doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for v in spec["versions"]:
                if v.get("served") and "schema" in v:
                    out[(spec["group"], v["name"], spec["names"]["kind"])] = v["schema"]["openAPIV3Schema"]
    return out


def _definitions_file(kv: str) -> Any:
    """kubernetes-validate's strict definitions for release `kv` ("v1.34"): every built-in type, by OpenAPI name."""
    f = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"{kv}.0-local-strict" / "_definitions.json"
    if not f.is_file():
        raise SchemasMissing(f"kubernetes-validate {importlib.metadata.version('kubernetes-validate')} bundles no "
                             f"schemas for Kubernetes {kv}: install a release that does (pip install -U "
                             f"kubernetes-validate, or `make install`)")
    return f


@cache
def _definitions(kv: str = KUBERNETES_VERSION) -> dict[str, Any]:
    """Release `kv`'s built-in schemas, `$ref`s as `#/$defs/<name>`, strict and without null."""
    defs = json.loads(_definitions_file(kv).read_text())["$defs"]
    return {name: strict(not_null(schema)) for name, schema in defs.items()}


@cache
def _kind_index(kv: str = KUBERNETES_VERSION) -> dict[tuple[str, str, str], str]:
    """(group, version, kind) -> schema name, from x-kubernetes-group-version-kind."""
    out: dict[tuple[str, str, str], str] = {}
    for name, schema in _definitions(kv).items():
        for gvk in schema.get("x-kubernetes-group-version-kind", []):
            key = (gvk["group"], gvk["version"], gvk["kind"])
            # DeleteOptions/WatchEvent list many GVKs; the kind's own schema is named after it.
            if key not in out or name.endswith("." + gvk["kind"]):
                out[key] = name
    return out


@cache
def _core_validator(name: str, kv: str = KUBERNETES_VERSION) -> jsonschema.protocols.Validator:
    """A built-in type by schema name, e.g. ObjectMeta for CRD metadata (CRDs declare it as a bare object), or the
    PodTemplateSpec a JobSet embeds (its CRD carries the pod schema of the release it was built against)."""
    defs = _definitions(kv)
    if name not in defs:
        raise SchemasMissing(f"{name} not found in kubernetes-validate's Kubernetes {kv} schemas")
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$ref": f"#/$defs/{name}", "$defs": defs}
    return jsonschema.Draft202012Validator(schema)


@cache
def _validator(group: str, version: str, kind: str, kv: str = KUBERNETES_VERSION) -> jsonschema.protocols.Validator:
    crd = _crds().get((group, version, kind))
    if crd is not None:
        schema = strict(copy.deepcopy(crd))
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        return cls(schema)
    if (group, version, kind) in _kind_index(kv):
        return _core_validator(_kind_index(kv)[(group, version, kind)], kv)
    raise KeyError(kind)


def known_kinds(kv: str = KUBERNETES_VERSION) -> set[tuple[str, str]]:
    """Every (apiVersion, kind) this module can validate."""
    keys = set(_crds()) | set(_kind_index(kv))
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
        return [f".: no schema for {api_version} {kind}: not a vendored CRD under {CRDS_DIR} nor a built-in kind of "
                f"Kubernetes {kv}"]
    errors = [_format(e) for e in validator.iter_errors(obj)]
    if (group, version, kind) in _crds() and isinstance(obj.get("metadata"), dict):
        errors += [_format(e, ("metadata",)) for e in _core_validator(OBJECT_META, kv).iter_errors(obj["metadata"])]
    for prefix, template in embedded_pod_templates(obj):
        errors += [_format(e, prefix) for e in _core_validator(POD_TEMPLATE, kv).iter_errors(template)]
    return sorted(set(errors))


def _at(obj: Any, *keys: str) -> Any:
    """obj[k1][k2]..., or None where a level is missing or not a mapping (the schema reports wrong types)."""
    for key in keys:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def embedded_pod_templates(obj: dict[str, Any]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """(path, PodTemplateSpec) of every pod template a JobSet, RayJob or RayCluster embeds: their CRDs carry the pod
    schema of the release they were built against, so each is also checked against each release's own."""
    found: list[tuple[tuple[Any, ...], Any]] = []
    if obj.get("kind") == "JobSet":
        for i, rj in enumerate(_items(_at(obj, "spec", "replicatedJobs"))):
            found.append((("spec", "replicatedJobs", i, "template", "spec", "template"),
                          _at(rj, "template", "spec", "template")))
    at = {"RayJob": ("spec", "rayClusterSpec"), "RayCluster": ("spec",)}.get(obj.get("kind"))
    if at is not None:
        cluster = _at(obj, *at)
        found.append(((*at, "headGroupSpec", "template"), _at(cluster, "headGroupSpec", "template")))
        for i, group in enumerate(_items(_at(cluster, "workerGroupSpecs"))):
            found.append(((*at, "workerGroupSpecs", i, "template"), _at(group, "template")))
    return [(path, t) for path, t in found if isinstance(t, dict)]


def assert_valid(obj: dict[str, Any], versions: tuple[str, ...] = KUBERNETES_VERSIONS) -> None:
    """The object passes its schema for every Kubernetes release in `versions`."""
    for kv in versions:
        errors = validate(obj, kv)
        if errors:
            meta = obj.get("metadata") or {}
            raise AssertionError(f"{obj.get('apiVersion')} {obj.get('kind')} {meta.get('name')!r} does not match "
                                 f"its upstream schema for Kubernetes {kv}:\n  " + "\n  ".join(errors))
