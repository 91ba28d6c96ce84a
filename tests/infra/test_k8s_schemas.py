"""The schema validator itself: known-good objects pass, typos and wrong types fail, missing schemas say so, and the
vendored CRDs are the upstream bytes SOURCES.md lists."""

from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path
from typing import Any

import pytest

from tests import k8s_schemas


@pytest.fixture(autouse=True)
def _schemas() -> None:
    k8s_schemas.need_schemas()


JOBSET: dict[str, Any] = {
    "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
    "metadata": {"name": "demo", "namespace": "rl", "labels": {"kueue.x-k8s.io/queue-name": "tpu"}},
    "spec": {"replicatedJobs": [{"name": "slice", "replicas": 2, "template": {"spec": {
        "parallelism": 4, "completions": 4, "backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "c", "image": "busybox", "resources": {"limits": {"google.com/tpu": 4}}}],
        }}}}}]},
}
LOCAL_QUEUE = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
               "metadata": {"name": "tpu", "namespace": "rl"}, "spec": {"clusterQueue": "cq"}}
POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
       "spec": {"containers": [{"name": "c", "image": "busybox", "resources": {"limits": {"cpu": "1"}}}]}}


@pytest.mark.parametrize("kv", k8s_schemas.KUBERNETES_VERSIONS)
@pytest.mark.parametrize("obj", [JOBSET, LOCAL_QUEUE, POD], ids=lambda o: o["kind"])
def test_known_good_objects_pass(obj: dict[str, Any], kv: str) -> None:
    assert k8s_schemas.validate(obj, kv) == []


@pytest.mark.parametrize("kv", k8s_schemas.KUBERNETES_VERSIONS)
def test_a_jobset_pod_is_checked_against_the_releases_own_pod_schema(kv: str) -> None:
    # The JobSet CRD embeds the pod schema of the release it was built with; the core PodTemplateSpec of each
    # release checks it again, so a pod field that release lacks or types differently is caught.
    bad = copy.deepcopy(JOBSET)
    pod = bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["containers"][0]["resources"]["claims"] = [{"name": 3}]
    errors = k8s_schemas.validate(bad, kv)
    assert errors and all(e.startswith("spec.replicatedJobs[0].template.spec.template.spec.containers[0]")
                          for e in errors)
    core = k8s_schemas._core_validator(k8s_schemas.POD_TEMPLATE, kv)
    assert core.is_valid(JOBSET["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])
    assert not core.is_valid(bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])


def test_a_typo_in_a_crd_field_fails() -> None:
    bad = copy.deepcopy(JOBSET)
    bad["spec"]["replicatedJobs"][0]["replica"] = bad["spec"]["replicatedJobs"][0].pop("replicas")
    [err] = k8s_schemas.validate(bad)
    assert err.startswith("spec.replicatedJobs[0]:") and "'replica' was unexpected" in err


def test_a_typo_deep_in_the_embedded_pod_fails() -> None:
    bad = copy.deepcopy(JOBSET)
    pod = bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["containers"][0]["imagePullPolice"] = "Always"
    [err] = k8s_schemas.validate(bad)
    assert "containers[0]" in err and "imagePullPolice" in err


def test_a_wrong_type_fails() -> None:
    bad = copy.deepcopy(LOCAL_QUEUE)
    bad["spec"]["clusterQueue"] = 3
    assert k8s_schemas.validate(bad) == ["spec.clusterQueue: 3 is not of type 'string'"]
    pod = copy.deepcopy(POD)
    pod["spec"]["containers"][0]["ports"] = [{"containerPort": "http"}]
    assert k8s_schemas.validate(pod) == ["spec.containers[0].ports[0].containerPort: 'http' is not of type 'integer'"]


def test_crd_metadata_is_checked_as_object_meta() -> None:
    bad = copy.deepcopy(LOCAL_QUEUE)
    bad["metadata"]["label"] = {"a": "b"}
    assert k8s_schemas.validate(bad) == ["metadata: Additional properties are not allowed ('label' was unexpected)"]


def test_core_typo_and_unknown_kind_fail() -> None:
    bad = copy.deepcopy(POD)
    bad["spec"]["containers"][0]["imag"] = "x"
    assert any("'imag' was unexpected" in e for e in k8s_schemas.validate(bad))
    [err] = k8s_schemas.validate({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})
    assert "no schema for example.com/v1 Widget" in err
    with pytest.raises(AssertionError, match="does not match its upstream schema"):
        k8s_schemas.assert_valid(bad)


def test_resource_claim_template_validates_against_resource_v1() -> None:
    rct = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
           "metadata": {"name": "netdev", "namespace": "rl"},
           "spec": {"spec": {"devices": {"requests": [
               {"name": "netdev", "exactly": {"deviceClassName": "netdev.google.com", "count": 2}}]}}}}
    assert k8s_schemas.validate(rct) == []
    rct["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = "two"
    assert len(k8s_schemas.validate(rct)) == 1


def test_strict_rules() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "nullable": True},
        "open": {"type": "object", "properties": {"x": {"type": "string"}},
                 "x-kubernetes-preserve-unknown-fields": True},
        "map": {"type": "object", "additionalProperties": {"type": "string"}},
    }}
    s = k8s_schemas.strict(schema)
    assert s["additionalProperties"] is False
    assert s["properties"]["a"]["type"] == ["string", "null"]
    assert "additionalProperties" not in s["properties"]["open"]
    assert s["properties"]["map"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in schema  # the input is left alone
    # Kueue's name patterns use RE2's `^(?i)`; Python needs the flag first.
    pattern = k8s_schemas.strict({"type": "string", "pattern": "^(?i)[a-z]([-a-z0-9]*[a-z0-9])?$"})["pattern"]
    assert pattern == "(?i)^[a-z]([-a-z0-9]*[a-z0-9])?$"


def test_missing_schemas_fail_with_a_clear_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(k8s_schemas, "CRDS_DIR", tmp_path / "nowhere")
    with pytest.raises(k8s_schemas.SchemasMissing, match="vendored CRD schemas not found at .*nowhere"):
        k8s_schemas.require_schemas()
    with pytest.raises(pytest.fail.Exception, match="checkout is incomplete"):
        k8s_schemas.need_schemas()
    with pytest.raises(k8s_schemas.SchemasMissing, match="bundles no schemas for Kubernetes v1.99"):
        k8s_schemas._definitions_file("v1.99")


def _listed_sha256() -> dict[str, str]:
    text = (k8s_schemas.CRDS_DIR / "SOURCES.md").read_text()
    [block] = re.findall(r"^```sha256\n(.*?)^```$", text, re.M | re.S)
    return {name: digest for digest, name in (line.split() for line in block.splitlines())}


def test_vendored_crds_are_the_upstream_bytes_listed_in_sources() -> None:
    listed = _listed_sha256()
    on_disk = {p.relative_to(k8s_schemas.CRDS_DIR).as_posix(): p for p in k8s_schemas.CRDS_DIR.glob("*/*.yaml")}
    assert sorted(on_disk) == sorted(listed)
    for name, path in on_disk.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == listed[name], f"{name} differs from SOURCES.md"
    crd_kinds = {(f"{g}/{v}", k) for g, v, k in k8s_schemas._crds()}
    assert {k for _, k in crd_kinds} == {"JobSet", "RayJob", "AdmissionCheck", "ClusterQueue", "LocalQueue",
                                         "ProvisioningRequestConfig", "ResourceFlavor", "WorkloadPriorityClass"}
    assert crd_kinds <= k8s_schemas.known_kinds()


RAYJOB: dict[str, Any] = {
    "apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "r", "namespace": "rl"},
    "spec": {"entrypoint": "python -m trainer", "rayClusterSpec": {
        "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {
            "containers": [{"name": "head", "image": "ray"}]}}},
        "workerGroupSpecs": [{"groupName": "w", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                              "rayStartParams": {}, "template": {"spec": {
                                  "containers": [{"name": "worker", "image": "ray"}]}}}]}},
}
BUILT_IN: list[dict[str, Any]] = [
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "rl"}},
    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "sa", "namespace": "rl"}},
    {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "rl"}, "type": "Opaque",
     "stringData": {"token": "x"}},
    {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "c", "namespace": "rl"},
     "spec": {"spec": {"devices": {"requests": [{"name": "d", "exactly": {"deviceClassName": "dc"}}]}}}},
    {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "p", "namespace": "rl"},
     "spec": {"podSelector": {}}},
]


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    [(_, template), *_] = k8s_schemas.embedded_pod_templates(obj)
    return template["spec"]


# Each path (a CRD, a built-in kind, ObjectMeta of a CRD, a pod template embedded in a CRD) refuses an unknown field,
# a wrong type and a null, for both releases.
@pytest.mark.parametrize("kv", k8s_schemas.KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("obj", "at"), [
    *(pytest.param(o, lambda o: o["metadata"], id=o["kind"]) for o in BUILT_IN),
    pytest.param(LOCAL_QUEUE, lambda o: o["spec"], id="LocalQueue"),
    pytest.param(LOCAL_QUEUE, lambda o: o["metadata"], id="LocalQueue-metadata"),
    pytest.param(JOBSET, lambda o: _pod_spec(o)["containers"][0], id="JobSet-pod"),
    pytest.param(RAYJOB, lambda o: _pod_spec(o)["containers"][0], id="RayJob-pod"),
    pytest.param(RAYJOB, lambda o: o["spec"], id="RayJob"),
])
def test_every_path_refuses_unknown_fields_wrong_types_and_nulls(obj: dict[str, Any], at: Any, kv: str) -> None:
    assert k8s_schemas.validate(obj, kv) == []
    typo = copy.deepcopy(obj)
    at(typo)["nmae"] = "x"
    assert any("'nmae' was unexpected" in e for e in k8s_schemas.validate(typo, kv)), k8s_schemas.validate(typo, kv)
    for value, message in ((["a"], "is not of type"), (None, "None is not of type")):
        wrong = copy.deepcopy(obj)
        field = next(k for k in ("name", "clusterQueue", "entrypoint") if k in at(wrong))
        at(wrong)[field] = value
        assert any(message in e for e in k8s_schemas.validate(wrong, kv)), (field, k8s_schemas.validate(wrong, kv))


def test_not_null_removes_only_null() -> None:
    schema = {"type": ["object", "null"], "properties": {
        "a": {"type": ["string", "null"], "enum": ["x", None]},
        "type": {"type": ["integer", "null"]},
        "b": {"oneOf": [{"type": ["string", "null"]}, {"type": ["integer", "null"]}]},
        "c": {"type": ["string", "integer", "null"]},
    }}
    out = k8s_schemas.not_null(schema)
    assert out == {"type": "object", "properties": {
        "a": {"type": "string", "enum": ["x"]}, "type": {"type": "integer"},
        "b": {"oneOf": [{"type": "string"}, {"type": "integer"}]}, "c": {"type": ["string", "integer"]}}}
    assert schema["properties"]["a"]["type"] == ["string", "null"]  # the input is left alone


def test_network_policy_validates_strictly_from_the_bundled_schemas() -> None:
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "metadata": {"name": "p", "namespace": "n"},
              "spec": {"podSelector": {"matchLabels": {"a": "b"}}, "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels": {"a": "b"}}}]}]}}
    k8s_schemas.assert_valid(policy)
    typo = {**policy, "spec": {**policy["spec"], "ingres": []}}
    assert any("ingres" in e for e in k8s_schemas.validate(typo))
    wrong = {**policy, "spec": {**policy["spec"], "policyTypes": "Ingress"}}
    assert k8s_schemas.validate(wrong)
