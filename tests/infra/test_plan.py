"""The offline plan: the mock harness, the tree/summary/markdown renderings, golden plans, emitted objects."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pulumi
import pytest
import yaml
from pulumi.runtime import config as runtime_config_module
from pulumi.runtime import settings

from envspec.config import ConfigError
from infra.offline import mockrun, render
from infra.offline.mockrun import SECRET_MASK, PlanResult, RecordingMonitor, run_stack
from infra.offline.plan import (
    is_kubernetes_object,
    kubernetes_object,
    kubernetes_objects,
    manifest_filenames,
    write_out,
)
from tests import k8s_schemas
from tests.infra.conftest import ENVIRONMENTS, ROOT, stack_config

GOLDEN = ROOT / "tests" / "golden"


def _line(tree_text: str, name: str, type_: str) -> str:
    [line] = [ln for ln in tree_text.splitlines() if f" {name}  {type_}" in ln]
    return line


# ---------------------------------------------------------------- the harness


def test_runtime_config_matches_what_the_cli_hands_the_program() -> None:
    values, secrets = mockrun.runtime_config({
        "gke-tpu-rl:project": "p", "zone": "us-east5-b", "gke-tpu-rl:cluster": {"rayOperator": True},
        "gke-tpu-rl:flag": False, "gcp:project": "other", "gke-tpu-rl:hfToken": {"secure": "v1:abc"},
    }, secret_keys=["plainToken"])
    assert values == {
        "gke-tpu-rl:project": "p", "gke-tpu-rl:zone": "us-east5-b",
        "gke-tpu-rl:cluster": '{"rayOperator": true}', "gke-tpu-rl:flag": "false", "gcp:project": "other",
        "gke-tpu-rl:hfToken": mockrun.SECURE_PLACEHOLDER}
    assert secrets == ["gke-tpu-rl:hfToken", "gke-tpu-rl:plainToken"]


def test_clean_masks_secrets_keeping_shape_and_restores_ints() -> None:
    secret = pulumi.runtime.rpc.wrap_rpc_secret({"token": "hf_abc", "n": 3.0})
    got = mockrun.clean({"b": 4.0, "a": 0.5, "flag": True, "s": secret, "__defaults": [], "l": [1.0, "x"]})
    assert got == {"a": 0.5, "b": 4, "flag": True, "l": [1, "x"], "s": {"n": SECRET_MASK, "token": SECRET_MASK}}
    assert type(got["b"]) is int and got["flag"] is True
    assert list(got) == sorted(got)  # reproducible order


def test_resources_form_one_tree_under_the_stack(plans: dict[str, PlanResult]) -> None:
    for plan in plans.values():
        urns = {r.urn for r in plan.resources}
        assert len(urns) == len(plan.resources)
        assert all(r.parent == plan.stack_urn or r.parent in urns for r in plan.resources)
        seen = {plan.stack_urn}
        for r in plan.resources:  # depth-first: a parent is listed before its children
            assert r.parent in seen
            seen.add(r.urn)
        assert plan.stack_urn == f"urn:pulumi:{plan.env}::gke-tpu-rl::pulumi:pulumi:Stack::gke-tpu-rl-{plan.env}"


def test_environments_plan_independently_in_one_process(plans: dict[str, PlanResult]) -> None:
    stack_before, config_before = settings.get_stack(), dict(runtime_config_module.CONFIG.get())
    root_before = settings.get_root_resource()
    again = run_stack("dev", stack_config("dev"))
    # The same program on the same config registers the same thing, whatever ran before it.
    assert [r.to_json() for r in again.resources] == [r.to_json() for r in plans["dev"].resources]
    assert again.outputs == plans["dev"].outputs
    assert all(r.urn.startswith("urn:pulumi:dev::") for r in again.resources)
    # ...and leaves the caller's Pulumi runtime (stack, config, root resource) as it found it.
    assert settings.get_stack() == stack_before
    assert runtime_config_module.CONFIG.get() == config_before
    assert settings.get_root_resource() is root_before


def test_bad_config_registers_nothing_and_raises_config_error() -> None:
    config = stack_config("staging")
    config["gke-tpu-rl:slices"] = [{**config["gke-tpu-rl:slices"][0], "topology": "4x3"}]
    monitor = RecordingMonitor(mockrun.PlanMocks())
    with pytest.raises(ConfigError, match=r"slices\[0\]\.topology.*4x3.*allowed: 1x1, 2x2"):
        run_stack("staging", config, monitor=monitor)
    assert monitor.registrations == []


# ---------------------------------------------------------------- summary, tree, markdown


def test_staging_summary(plans: dict[str, PlanResult]) -> None:
    s = render.summarize(plans["staging"])
    assert (s.total_slices, s.total_hosts, s.total_chips, s.chips_by_type) == (2, 8, 32, {"v6e": 32})
    [row] = s.slices
    assert (row.machine_type, row.hosts_per_slice, row.chips_per_host, row.capacity) == (
        "ct6e-standard-4t", 4, 4, "on-demand")
    assert any("mtu 8896" in n for n in s.networks) and len(s.networks) == 3
    assert s.buckets == ["gs://acme-rl-staging-staging-checkpoints (US-EAST5, kept on destroy)"]
    assert ("ClusterQueue tpu-cluster-queue [v6e-4x4:google.com/tpu=32, v6e-4x4:gke-tpu-rl/netdev=16]"
            in s.queues)
    assert "LocalQueue rl/tpu" in s.queues
    assert s.controllers == ["jobset 0.12.0", "kueue 0.19.2"]
    facts = dict(s.facts())
    assert facts["TPU"].startswith("2 slices, 8 hosts, 32 chips (v6e: 32)")


def test_prod_and_dev_summaries(plans: dict[str, PlanResult]) -> None:
    prod = render.summarize(plans["prod"])
    assert prod.chips_by_type == {"v5p": 256, "v6e": 64}
    assert (prod.total_slices, prod.total_hosts) == (6, 4 * 16 + 2 * 8)
    assert [r.capacity for r in prod.slices] == ["reservation:rl-v5p-prod", "flex-start"]
    assert len([n for n in prod.networks if "mtu 8896" in n]) == 2  # the v6e group's 2 NICs; v5p gets none
    dev = render.summarize(plans["dev"])
    assert (dev.total_slices, dev.total_hosts, dev.chips_by_type) == (2, 2, {"v6e": 8})
    assert dev.slices[0].capacity == "spot"
    assert dev.buckets[0].endswith("force-destroy)")
    assert dev.trainer is not None
    assert "RayJob rl/grpo-dev (elastic): 1..2 x v6e-dev (2x2), at most 2 pods x 4 chips" in dev.trainer


def test_tree_lists_every_resource_with_the_settings_that_matter(plans: dict[str, PlanResult]) -> None:
    plan = plans["staging"]
    tree = render.plain(render.resource_tree(plan))
    assert len(tree.splitlines()) == len(plan.resources) + 1  # one line each, plus the stack
    pool = _line(tree, "v6e-stg-0", "gcp:container/nodePool:NodePool")
    for fact in ("machine=ct6e-standard-4t", "nodes=4", "placement=COMPACT", "topology=4x4", "capacity=on-demand",
                 "extraNetworks=[staging-network-dranet-0, staging-network-dranet-1]", "gvnic=true"):
        assert fact in pool
    assert "mtu=8896" in _line(tree, "staging-network-dranet-0", "gcp:compute/network:Network")
    bucket = _line(tree, "staging-storage-checkpoints", "gcp:storage/bucket:Bucket")
    assert "publicAccessPrevention=enforced" in bucket and "retainOnDelete=true" in bucket
    iam = _line(tree, "staging-storage-trainer-object-user", "gcp:storage/bucketIAMMember:BucketIAMMember")
    assert "role=roles/storage.objectUser" in iam and "member=principal://" in iam
    assert "version=0.19.2" in _line(tree, "staging-controllers-kueue", "kubernetes:helm.sh/v3:Release")
    cq = _line(tree, "clusterqueue-tpu-cluster-queue", "kubernetes:kueue.x-k8s.io/v1beta2:ClusterQueue")
    assert "quota=[v6e-4x4:google.com/tpu=32, v6e-4x4:gke-tpu-rl/netdev=16]" in cq
    js = _line(tree, "jobset-rl-grpo-stg", "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet")
    assert "replicas=2" in js and "parallelism=4" in js and "queue=tpu" in js and "tpuPerPod=4" in js


def test_prod_tree_shows_capacity_kinds(plans: dict[str, PlanResult]) -> None:
    tree = render.plain(render.resource_tree(plans["prod"]))
    v5p = _line(tree, "v5p-prod-0", "gcp:container/nodePool:NodePool")
    assert "capacity=reservation:rl-v5p-prod" in v5p and "topology=4x4x4" in v5p and "nodes=16" in v5p
    burst = _line(tree, "v6e-burst-0", "gcp:container/nodePool:NodePool")
    assert "capacity=flex-start" in burst and "queuedProvisioning=true" in burst and "maxNodes=8" in burst


def test_markdown_is_a_pr_comment(plans: dict[str, PlanResult]) -> None:
    md = render.markdown(plans["prod"])
    assert md.startswith("### gke-tpu-rl plan: `prod`")
    assert "| v5p-prod | v5p | 4x4x4 | ct5p-hightpu-4t | 4 | 16 | 4 | 64 | 256 | reservation:rl-v5p-prod |" in md
    assert "| v6e-burst | v6e | 4x8 | ct6e-standard-4t | 2 | 8 | 4 | 32 | 64 | flex-start |" in md
    assert "- **TPU**: 6 slices, 80 hosts, 320 chips (v5p: 256, v6e: 64)" in md
    assert md.count("<details>") == md.count("</details>") == 2
    assert "`kubeconfig`: `[secret]`" in md


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_golden_markdown_plan(plans: dict[str, PlanResult], env: str) -> None:
    """tests/golden/plan-ENV.md is the reviewed plan; `UPDATE_GOLDEN=1 pytest` (or `make golden`) rewrites it."""
    got = render.markdown(plans[env])
    path = GOLDEN / f"plan-{env}.md"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
    assert path.is_file(), f"{path} is missing; run UPDATE_GOLDEN=1 pytest {__file__}"
    assert got == path.read_text(), f"the {env} plan changed; review it and run `make golden` to accept"


# ---------------------------------------------------------------- Kubernetes objects and --out


def test_kubernetes_objects_are_manifests(plans: dict[str, PlanResult]) -> None:
    plan = plans["staging"]
    objects = kubernetes_objects(plan)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(["Namespace", "ClusterQueue", "LocalQueue", "ResourceFlavor", "WorkloadPriorityClass",
                            "WorkloadPriorityClass", "WorkloadPriorityClass", "ServiceAccount", "JobSet", "Job",
                            "ResourceClaimTemplate"])
    for o in objects:
        assert list(o)[:3] == ["apiVersion", "kind", "metadata"]
    # Helm releases and the provider are resources, not objects the stack applies itself.
    assert not any(is_kubernetes_object(r) for r in plan.of_type("kubernetes:helm.sh/v3:Release"))
    assert not any(is_kubernetes_object(r) for r in plan.of_type("pulumi:providers:kubernetes"))


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_every_emitted_object_matches_its_upstream_schema(plans: dict[str, PlanResult], env: str) -> None:
    k8s_schemas.need_schemas()
    objects = kubernetes_objects(plans[env])
    assert objects
    for obj in objects:
        k8s_schemas.assert_valid(obj)


def test_manifest_filenames_disambiguate_only_collisions() -> None:
    objs = [{"kind": "ServiceAccount", "metadata": {"name": "trainer", "namespace": "a"}},
            {"kind": "ServiceAccount", "metadata": {"name": "trainer", "namespace": "b"}},
            {"kind": "Namespace", "metadata": {"name": "rl"}}]
    assert manifest_filenames(objs) == ["serviceaccount-a-trainer.yaml", "serviceaccount-b-trainer.yaml",
                                        "namespace-rl.yaml"]


def test_write_out_writes_each_object_and_resources_json(plans: dict[str, PlanResult], tmp_path: Path) -> None:
    plan = plans["prod"]
    (tmp_path / "resources.json").write_text("{}")
    (tmp_path / "jobset-gone.yaml").write_text("stale: true\n")  # from an earlier plan: removed
    write_out(plan, tmp_path, markdown="md")
    objects = [r for r in plan.resources if is_kubernetes_object(r)]
    yamls = sorted(tmp_path.glob("*.yaml"))
    assert len(yamls) == len(objects)
    by_file = {p.name: yaml.safe_load(p.read_text()) for p in yamls}
    assert sorted(by_file.values(), key=json.dumps) == sorted(
        (kubernetes_object(r) for r in objects), key=json.dumps)
    assert "jobset-grpo-prod.yaml" in by_file and "clusterqueue-tpu-cluster-queue.yaml" in by_file
    doc = json.loads((tmp_path / "resources.json").read_text())
    assert doc["stack"] == "prod" and doc["outputs"]["kubeconfig"] == SECRET_MASK
    assert [(e["type"], e["name"], e["parent"], e["inputs"]) for e in doc["resources"]] == [
        (r.type, r.name, r.parent, r.inputs) for r in plan.resources]
    releases = [e for e in doc["resources"] if e["type"] == "kubernetes:helm.sh/v3:Release"]
    assert sorted(e["inputs"]["chart"] for e in releases) == [
        "oci://registry.k8s.io/jobset/charts/jobset", "oci://registry.k8s.io/kueue/charts/kueue"]
    assert (tmp_path / "plan.md").read_text() == "md"


# ---------------------------------------------------------------- secrets


def _everything_written(plan: PlanResult, out: Path) -> str:
    write_out(plan, out, markdown=render.markdown(plan))
    files = "".join(p.read_text() for p in sorted(out.iterdir()))
    return files + render.text(plan) + json.dumps([r.to_json() for r in plan.resources]) + json.dumps(plan.outputs)


def test_secret_values_never_reach_any_output(tmp_path: Path) -> None:
    token = "hf_PLAN_TEST_TOKEN_0123456789"
    config: dict[str, Any] = {**stack_config("staging"), "gke-tpu-rl:hfToken": token}
    plan = run_stack("staging", config, secret_keys=["hfToken"])
    secret = plan.get("kubernetes:core/v1:Secret", "secret-rl-grpo-stg-hf-token")
    assert secret.inputs["stringData"] == {"token": SECRET_MASK}
    k8s_schemas.need_schemas()
    [secret_obj] = [o for o in kubernetes_objects(plan) if o["kind"] == "Secret"]
    k8s_schemas.assert_valid(secret_obj)
    everything = _everything_written(plan, tmp_path)
    assert token not in everything
    assert SECRET_MASK in everything


def test_kubeconfig_output_is_masked(plans: dict[str, PlanResult]) -> None:
    for plan in plans.values():
        assert "kubeconfig" in plan.secret_outputs
        assert plan.outputs["kubeconfig"] == SECRET_MASK
        assert mockrun.MOCK_CA not in json.dumps(plan.outputs)


def test_golden_files_hold_no_secret_placeholder_values() -> None:
    for env in ENVIRONMENTS:
        path = GOLDEN / f"plan-{env}.md"
        if path.is_file():
            assert mockrun.SECURE_PLACEHOLDER not in path.read_text()
