"""The golden Terraform of every environment against its Pulumi plan: the same resources, the same settings.

Each GCP resource of the plan has its counterpart in the gcp stack, and every setting the program gives it is there
with the same value: names, machine types, topologies, node counts, placement, CIDRs and MTUs, labels, capacity type,
IAM members and roles among them, and nothing more. Where the plan holds a value a provider computes (an id, the
project number, a looked-up GKE version, the image digest), Terraform holds a reference, and the value must match it
with the reference as a wildcard. Every Kubernetes object is the same manifest; each Helm release the same chart.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from infra.offline.mockrun import PlanResult
from infra.offline.plan import is_kubernetes_object, kubernetes_object
from infra.terraform.document import GCP_TYPES, HELM_TYPE, address_of, terraform_values
from tests import k8s_schemas
from tests.infra.conftest import ENVIRONMENTS
from tests.infra.test_terraform import golden_path

# Terraform meta-arguments: what the engine does, compared by the tests that own them, not settings of the resource.
META = {"depends_on", "lifecycle", "timeouts", "provider", "count", "for_each"}
REFERENCE = re.compile(r"(?<!\$)\$\{[^}]*(?:\{[^}]*\}[^}]*)*\}")
# What the issue names as identifying, per Terraform type: each must be among the settings compared.
IDENTIFYING = {
    "google_container_node_pool": ["name", "node_config.machine_type", "node_config.labels", "location"],
    "google_compute_subnetwork": ["name", "ip_cidr_range", "region"],
    "google_project_iam_member": ["member", "role"],
    "google_storage_bucket_iam_member": ["member", "role", "bucket"],
    "google_container_cluster": ["name", "location", "private_cluster_config.master_ipv4_cidr_block",
                                 "resource_labels"],
}
# The capacity type each slice group asks for, as the node pool must carry it.
CAPACITY = {"spot": ("spot", True), "reservation": ("reservation_affinity", {
    "consume_reservation_type": "SPECIFIC_RESERVATION", "key": "compute.googleapis.com/reservation-name"}),
    "flex-start": ("flex_start", True)}


def _key(name: str) -> str:
    """One spelling for both sides: Pulumi's camelCase and pluralised list blocks, Terraform's snake_case."""
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    if snake.endswith("ies"):
        return snake[:-3] + "y"
    return snake[:-1] if snake.endswith("s") else snake


def leaves(value: Any, path: str = "", keyed: bool = True) -> dict[str, Any]:
    """path -> scalar. Map keys (labels, selectors) are kept as written; only argument names are respelled."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(leaves(v, f"{path}.{_key(k) if keyed else k}" if path else (_key(k) if keyed else k),
                              keyed and not _is_map(k)))
        return out
    if isinstance(value, list):
        if len(value) == 1 and isinstance(value[0], dict):
            return leaves(value[0], path, keyed)  # a one-item block: an object on one side, a list on the other
        out = {}
        for i, v in enumerate(value):
            out.update(leaves(v, f"{path}[{i}]", keyed))
        return out
    return {path: value}


MAP_ARGS = {"labels", "resourceLabels", "resource_labels", "userLabels", "user_labels", "nodeSelector",
            "metadata", "values"}


def _is_map(key: str) -> bool:
    return key in MAP_ARGS


def _matches(pulumi_value: Any, tf_value: Any) -> bool:
    if isinstance(tf_value, str) and REFERENCE.search(tf_value):
        pattern = ".+".join(re.escape(part) for part in REFERENCE.split(tf_value))
        return isinstance(pulumi_value, str) and re.fullmatch(pattern, pulumi_value) is not None
    return bool(pulumi_value == tf_value)


def _unescape(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("$${", "${").replace("%%{", "%{")
    if isinstance(value, dict):
        return {k: _unescape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unescape(v) for v in value]
    return value


def golden(env: str, stack: str) -> dict[str, Any]:
    return json.loads(golden_path(env, stack).read_text())


def _body(tf: dict[str, Any], address: str) -> dict[str, Any]:
    type_, name = address.split(".", 1)
    resources = tf.get("resource", {}).get(type_, {})
    assert name in resources, f"no {address} in the Terraform"
    return resources[name]


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_every_gcp_resource_has_its_counterpart_with_the_same_settings(
        plans: dict[str, PlanResult], env: str) -> None:
    tf = golden(env, "gcp")
    seen: set[str] = set()
    for r in plans[env].resources:
        if r.type not in GCP_TYPES:
            continue
        address = address_of(r.type, r.name)
        assert address is not None
        body = {k: v for k, v in _body(tf, address).items() if k not in META}
        seen.add(address)
        # A value hashicorp/google lacks is written as its nearest one (infra/terraform/document.py TERRAFORM_VALUES).
        want, got = leaves(terraform_values(GCP_TYPES[r.type], r.inputs)), leaves(body)
        if "name" not in want and "name" in got:
            want["name"] = r.name  # Pulumi names it (plus a random suffix); Terraform takes this name
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want))
        assert not missing and not extra, f"{env} {address}: missing {missing}, extra {extra}"
        wrong = {p: (want[p], got[p]) for p in want if not _matches(want[p], got[p])}
        assert not wrong, f"{env} {address}: {wrong}"
        for path in IDENTIFYING.get(address.split(".")[0], []):
            key = ".".join(_key(part) for part in path.split("."))
            assert any(p == key or p.startswith(f"{key}.") for p in got), f"{env} {address}: no {path}"
    pools = tf["resource"]["google_container_node_pool"]
    for group in plans[env].spec.slices:
        for i in range(group.count):
            pool = pools[f"{group.name}-{i}"]
            config = pool["node_config"]
            assert config["machine_type"] == group.shape.machine_type
            # Every host of the slice, or (a flex-start or queued group) none until the slice is granted whole.
            sizes = (pool.get("node_count"), (pool.get("autoscaling") or {}).get("total_max_node_count"))
            assert group.shape.hosts in sizes, f"{env} {group.name}-{i}: {sizes}"
            if group.shape.hosts > 1:
                assert pool["placement_policy"]["tpu_topology"] == group.shape.topology
            if group.capacity in CAPACITY:
                field, value = CAPACITY[group.capacity]
                got_value = config[field]
                assert got_value == value or (isinstance(value, dict) and value.items() <= got_value.items()), (
                    f"{env} {group.name}-{i}: {field}")
            else:
                assert not {"spot", "flex_start", "reservation_affinity"} & set(config), f"{env} {group.name}-{i}"
    declared = {f"{t}.{n}" for t, named in tf["resource"].items() for n in named}
    assert declared == seen, f"{env}: Terraform declares what the plan does not: {sorted(declared - seen)}"


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_every_kubernetes_object_is_the_same_manifest(plans: dict[str, PlanResult], env: str) -> None:
    tf = golden(env, "workloads")
    manifests = tf["resource"]["kubernetes_manifest"]
    names = set()
    for r in plans[env].resources:
        if not is_kubernetes_object(r):
            continue
        address = address_of(r.type, r.name)
        assert address is not None
        name = address.split(".", 1)[1]
        names.add(name)
        obj = kubernetes_object(r)
        if obj["kind"] == "Secret" and "stringData" in obj:
            # Terraform writes it as data (write-only stringData never settles); the plan masks the values.
            obj["data"] = {k: "[secret]" for k in obj.pop("stringData")}
            manifests[name]["manifest"]["data"] = {k: "[secret]" for k in manifests[name]["manifest"]["data"]}
        want = json.dumps(obj, sort_keys=True)
        got = json.dumps(_unescape(manifests[name]["manifest"]), sort_keys=True)
        # The plan holds the mock build's digest where Terraform takes the digest variable.
        want = re.sub(r"@sha256:[0-9a-f]{64}", "@${var.trainer_image_digest}", want)
        assert got == want, f"{env} {name}"
    assert set(manifests) == names


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_every_helm_release_is_the_same_chart_with_the_same_values(plans: dict[str, PlanResult], env: str) -> None:
    releases = golden(env, "controllers")["resource"]["helm_release"]
    want = {r.name: r.inputs for r in plans[env].resources if r.type == HELM_TYPE}
    assert len(releases) == len(want) > 0
    for name, inputs in want.items():
        got = releases[name]
        assert (got["name"], got["chart"], got["version"], got["namespace"]) == (
            inputs["name"], inputs["chart"], inputs["version"], inputs["namespace"])
        assert got["create_namespace"] is inputs["createNamespace"] and got["atomic"] is inputs["atomic"]
        assert [json.loads(v) for v in got["values"]] == [inputs["values"]]


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_every_manifest_terraform_applies_matches_its_upstream_schema(env: str) -> None:
    # What the API server gets once Terraform has filled in its references (a digest for the image's).
    k8s_schemas.need_schemas()
    manifests = golden(env, "workloads")["resource"]["kubernetes_manifest"]
    assert manifests
    for body in manifests.values():
        text = json.dumps(_unescape(body["manifest"])).replace("${var.trainer_image_digest}", "sha256:" + "0" * 64)
        assert not REFERENCE.search(text), f"{env}: a reference left unfilled in {text[:200]}"
        k8s_schemas.assert_valid(json.loads(text))


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_no_terraform_value_is_a_name_the_mocks_made_up_review_2026_11_28_6(
        plans: dict[str, PlanResult], env: str) -> None:
    """A GCP resource the program gives no `name` gets its Pulumi resource name as the mocks' `name` output
    (infra/offline/mockrun.py _fake_state); the provider computes the real one (a service account's is
    projects/P/serviceAccounts/EMAIL). A Terraform value equal to such a resource name is that made-up output
    copied as a literal, unless Terraform names the resource so itself (the synth gives an autonamed resource its
    Pulumi name). Refer to an output Terraform computes instead (the account's id)."""
    made_up = {r.name: address_of(r.type, r.name) for r in plans[env].resources
               if r.type in GCP_TYPES and "name" not in r.inputs}
    tf = golden(env, "gcp")
    for type_, named in tf["resource"].items():
        for name, body in named.items():
            for path, value in leaves({k: v for k, v in body.items() if k not in META}).items():
                owner = made_up.get(value) if isinstance(value, str) else None
                if owner is None or (owner == f"{type_}.{name}" and path == "name"):
                    continue
                assert _body(tf, owner).get("name") == value, (
                    f"{env} {type_}.{name} {path} = {value!r}: {owner}'s name as the mocks made it up")


def test_the_peering_connection_is_abandoned_as_hashicorp_google_understands_review_2026_11_28_9() -> None:
    """pulumi-gcp's REMOVE_PEERING is no hashicorp/google value: refused at plan up to 7.32, read as DELETE from
    7.33. ABANDON leaves the connection on both sides of 7.33 (docs/terraform.md: removing the peering by hand)."""
    connections = golden("tinker", "gcp")["resource"]["google_service_networking_connection"]
    assert [c["deletion_policy"] for c in connections.values()] == ["ABANDON"]
    for env in ENVIRONMENTS:
        assert "REMOVE_PEERING" not in json.dumps(golden(env, "gcp")), env
