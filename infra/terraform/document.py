"""The environment as Terraform, from the Pulumi program itself.

The program runs under mocks (infra/offline/mockrun.py) whose provider-computed values (ids, the cluster's endpoint, the
project number, the image digest) are references; each resource it registers becomes its Terraform counterpart in
one of three stacks, applied in order: `gcp` (the GCP resources), `controllers` (the Helm releases, which need the
cluster) and `workloads` (every Kubernetes object as a `kubernetes_manifest`, which needs the controllers' CRDs at
plan time). Nothing here restates what a resource is: only the Terraform type of each Pulumi type, and the stack.
The document this returns is what infra/terraform/cdktf_app.py, in the isolated cdktf venv, turns into cdk.tf.json.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pulumi.runtime import mocks as pmocks

from envspec.config import EnvironmentSpec
from envspec.sections.cluster import gke_version_tuple
from infra.offline.mockrun import (
    IMAGE_TYPE,
    MOCK_VERSION_SUFFIX,
    PlanMocks,
    PlanResult,
    RecordingMonitor,
    Resource,
    run_stack,
)
from infra.offline.plan import is_kubernetes_object, is_kubernetes_type, kubernetes_object
from infra.terraform.refs import REF, STAGES, ref, references

# pulumi-gcp is bridged from terraform-provider-google: each type token names one Terraform resource type.
GCP_TYPES = {
    "gcp:artifactregistry/repository:Repository": "google_artifact_registry_repository",
    "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember": "google_artifact_registry_repository_iam_member",
    "gcp:compute/firewall:Firewall": "google_compute_firewall",
    "gcp:compute/globalAddress:GlobalAddress": "google_compute_global_address",
    "gcp:compute/network:Network": "google_compute_network",
    "gcp:compute/router:Router": "google_compute_router",
    "gcp:compute/routerNat:RouterNat": "google_compute_router_nat",
    "gcp:compute/subnetwork:Subnetwork": "google_compute_subnetwork",
    "gcp:container/cluster:Cluster": "google_container_cluster",
    "gcp:container/nodePool:NodePool": "google_container_node_pool",
    "gcp:projects/iAMMember:IAMMember": "google_project_iam_member",
    "gcp:serviceaccount/account:Account": "google_service_account",
    "gcp:serviceaccount/iAMMember:IAMMember": "google_service_account_iam_member",
    "gcp:servicenetworking/connection:Connection": "google_service_networking_connection",
    "gcp:sql/database:Database": "google_sql_database",
    "gcp:sql/databaseInstance:DatabaseInstance": "google_sql_database_instance",
    "gcp:sql/user:User": "google_sql_user",
    "gcp:storage/bucket:Bucket": "google_storage_bucket",
    "gcp:storage/bucketIAMMember:BucketIAMMember": "google_storage_bucket_iam_member",
}
DATA_SOURCES = {
    "gcp:organizations/getProject:getProject": "google_project",
    "gcp:container/getEngineVersions:getEngineVersions": "google_container_engine_versions",
    "gcp:organizations/getClientConfig:getClientConfig": "google_client_config",
}
# Arguments the Pulumi program sets that cdktf's google bindings (frozen at provider 6.50) lack: the renderer writes
# them as raw overrides and pins the provider to 7.x, which has them.
OVERRIDES = (
    ("google_sql_database_instance", "settings.dataApiAccess"),
    ("google_sql_user", "databaseRoles"),
)
# Values pulumi-gcp takes that hashicorp/google does not, as the nearest value it does: (Terraform type, argument)
# -> {Pulumi value: Terraform value}. REMOVE_PEERING (pulumi-gcp 10.2 servicenetworking.Connection) is in no
# hashicorp/google release: up to 7.32 StringInSlice(["ABANDON", ""]) refuses it at plan, from 7.33 the universal
# deletion_policy (tpgresource.DeletionPolicyPreDelete) takes any string and treats it as DELETE, which fails while
# Cloud SQL still uses the peering (hashicorp/terraform-provider-google#16275). ABANDON means the same on both sides
# of 7.33: the connection is left as it is; docs/terraform.md says how to remove the peering by hand.
TERRAFORM_VALUES: dict[tuple[str, str], dict[Any, Any]] = {
    ("google_service_networking_connection", "deletionPolicy"): {"REMOVE_PEERING": "ABANDON"},
}
HELM_TYPE = "kubernetes:helm.sh/v3:Release"
MANIFEST = "kubernetes_manifest"
# What the provider computes and the program reads, besides every resource's id and a GCP resource's selfLink.
COMPUTED = {"gcp:container/cluster:Cluster": (
    "endpoint", "masterVersion", "masterAuth.clusterCaCertificate",
    "controlPlaneEndpointsConfig.dnsEndpointConfig.endpoint")}
# helm.v3.Release inputs -> helm_release arguments; an input not here fails the synth rather than vanish.
HELM_ARGS = {"name": "name", "chart": "chart", "version": "version", "namespace": "namespace",
             "createNamespace": "create_namespace", "atomic": "atomic", "timeout": "timeout",
             "skipCrds": "skip_crds", "waitForJobs": "wait_for_jobs"}
HELM_IGNORED = ("compat",)  # the Pulumi SDK's own marker, no Helm setting
# How `pulumi up` waits on these kinds (pulumi-kubernetes await: a Job until it completes, a Deployment until its
# rollout is done); kubernetes_manifest waits only when told.
WAITS: dict[str, dict[str, Any]] = {
    "batch/v1:Job": {"condition": [{"type": "Complete", "status": "True"}]},
    "apps/v1:Deployment": {"rollout": True},
}
LATEST_SUFFIX = "-gke.9999"  # and the channel's index: each mock version is one field's
IMAGE_DIGEST_VAR = "trainer_image_digest"
HF_TOKEN_VAR = "hf_token"

class TerraformError(Exception):
    """The program registered something with no Terraform counterpart here; the message names it."""


def tf_name(name: str) -> str:
    """A Pulumi resource name as a Terraform name (letters, digits, '_' and '-'; not starting with a digit)."""
    out = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    return out if re.match(r"[A-Za-z_]", out) else f"_{out}"


def address_of(type_: str, name: str) -> str | None:
    if type_ in GCP_TYPES:
        return f"{GCP_TYPES[type_]}.{tf_name(name)}"
    if type_ == HELM_TYPE:
        return f"helm_release.{tf_name(name)}"
    if is_kubernetes_type(type_, custom=True):  # one object on the cluster, as the plan counts them
        return f"{MANIFEST}.{tf_name(name)}"
    return None


def _set_path(state: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = state
    for key in parents:
        child = node.get(key)
        if not isinstance(child, dict):
            return  # not in this resource (the cluster's DNS endpoint, say)
        node = child
    if leaf in node:
        node[leaf] = value


class TerraformMocks(PlanMocks):
    """PlanMocks whose provider-computed values are references to the Terraform resource or data source."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.data: dict[str, dict[str, Any]] = {}  # address -> {type, args}
        self.substitutions: dict[str, str] = {}  # a value the program must read as itself -> its reference

    def new_resource(self, args: pmocks.MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
        mock_id, state = super().new_resource(args)
        if args.typ == IMAGE_TYPE:
            state.update(digest=ref(f"var.{IMAGE_DIGEST_VAR}"))
            return mock_id, state
        address = address_of(args.typ, args.name)
        if address is None:
            return mock_id, state
        for path in (*COMPUTED.get(args.typ, ()), "selfLink"):
            _set_path(state, path, ref(address, path))
        return ref(address, "id"), state

    # A plain dict, as mockrun.PlanMocks.call returns (MockMonitor.Invoke cannot take (result, None)).
    def call(self, args: pmocks.MockCallArgs) -> dict[str, Any]:  # type: ignore[override]
        out = super().call(args)
        type_ = DATA_SOURCES.get(args.token)
        if type_ is None:
            raise TerraformError(f"the program looks up {args.token}, which has no Terraform data source here")
        call_args = dict(args.args)
        name = "this_" + hashlib.sha256(json.dumps(call_args, sort_keys=True).encode()).hexdigest()[:8]
        address = f"data.{type_}.{name}"
        with self._lock:
            self.data[address] = {"type": type_, "args": call_args}
        if type_ == "google_project":
            out["number"] = ref(address, "number")
        elif type_ == "google_client_config":
            out["accessToken"] = ref(address, "accessToken")
        elif type_ == "google_container_engine_versions":
            # The program chooses among these and checks them against a floor, so they stay versions; the one it
            # chooses (a mock version, "...-gke.99999") is swapped for the lookup's reference afterwards.
            # The channel's newest version under a prefix and its default may be the same mock version: keep them
            # apart so each swaps back to its own field.
            out["releaseChannelLatestVersion"] = {
                channel: version.replace(MOCK_VERSION_SUFFIX, f"{LATEST_SUFFIX}{i}")
                for i, (channel, version) in enumerate(sorted((out.get("releaseChannelLatestVersion") or {}).items()))}
            with self._lock:
                for field in ("releaseChannelLatestVersion", "releaseChannelDefaultVersion"):
                    for channel, version in (out.get(field) or {}).items():
                        reference = ref(address, f"{field}[{channel}]")
                        if self.substitutions.setdefault(version, reference) != reference:
                            raise TerraformError(f"two looked-up values are both {version}")
        return out


@dataclass(frozen=True)
class Synthesis:
    """What the renderer gets (`document`), and the mocked run it came from (`plan`: its spec and resources)."""

    document: dict[str, Any]
    plan: PlanResult


def _walk(value: Any, fn: Any) -> Any:
    if isinstance(value, dict):
        return {k: _walk(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, fn) for v in value]
    return fn(value)


def _stage(resource: Resource) -> str:
    if resource.type in GCP_TYPES:
        return "gcp"
    if resource.type == HELM_TYPE:
        return "controllers"
    return "workloads"


def _helm_args(resource: Resource) -> dict[str, Any]:
    inputs = dict(resource.inputs)
    values = inputs.pop("values", None)
    args: dict[str, Any] = {}
    for key, value in inputs.items():
        if key in HELM_IGNORED:
            continue
        if key not in HELM_ARGS:
            raise TerraformError(f"{resource.name}: the Helm release's input {key!r} has no helm_release argument "
                                 f"here (known: {', '.join(sorted(HELM_ARGS))})")
        args[HELM_ARGS[key]] = value
    if values:
        # helm_release takes values as YAML documents; JSON is YAML, and keys keep their order and spelling.
        args["values"] = [json.dumps(values, sort_keys=True, indent=2)]
    return args


def _at(obj: Mapping[str, Any], path: str) -> Any:
    node: Any = obj
    for key in path.split("."):
        node = node.get(key) if isinstance(node, Mapping) else None
    return node


def _secret_data(manifest: dict[str, Any]) -> dict[str, Any]:
    """A Secret's stringData as data: the API server never returns stringData (it is write-only), so a
    kubernetes_manifest holding it fails every apply with "inconsistent result" (terraform-provider-kubernetes
    issues 1684, 2184). Values Terraform supplies are encoded by Terraform."""
    if manifest.get("kind") != "Secret" or not manifest.get("stringData"):
        return manifest
    manifest = dict(manifest)
    data = dict(manifest.get("data") or {})
    for key, value in manifest.pop("stringData").items():
        data[key] = (REF.sub(lambda m: ref(m.group(1), f"{m.group(2)}#base64encode"), value) if REF.fullmatch(value)
                     else base64.b64encode(value.encode()).decode())
    manifest["data"] = data
    return manifest


def _manifest_entry(resource: Resource) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    manifest = _secret_data(kubernetes_object(resource))
    entry: dict[str, Any] = {"args": {"manifest": manifest}, "naming": "terraform"}
    gv_kind = f"{manifest['apiVersion']}:{manifest['kind']}"
    if gv_kind in WAITS:
        entry["args"]["wait"] = WAITS[gv_kind]
    extra: list[dict[str, Any]] = []
    replace = resource.options.get("replaceOnChanges")
    if replace:
        # Terraform's replace_triggered_by needs a resource to watch: a terraform_data holding the watched fields.
        trigger = tf_name(f"{resource.name}-replace-on")
        extra.append({"type": "terraform_data", "name": trigger, "naming": "terraform",
                      "args": {"input": {path: _at(manifest, path) for path in replace}}})
        entry.setdefault("lifecycle", {})["replace_triggered_by"] = [f"terraform_data.{trigger}"]
    return entry, extra


def _lifecycle(resource: Resource) -> dict[str, Any]:
    opts = resource.options
    life: dict[str, Any] = {}
    # Terraform has no retain-on-delete: a resource that must outlive the stack refuses `destroy` instead, until it
    # is taken out of the state (the README says how).
    if opts.get("protect") or opts.get("retainOnDelete"):
        life["prevent_destroy"] = True
    if opts.get("ignoreChanges"):
        life["ignore_changes"] = list(opts["ignoreChanges"])
    if resource.type in GCP_TYPES and opts.get("replaceOnChanges"):
        raise TerraformError(f"{resource.name}: replaceOnChanges on a GCP resource has no translation here")
    return life


def terraform_values(tf_type: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """A GCP resource's top-level arguments with TERRAFORM_VALUES' translations made."""
    out = dict(args)
    for (type_, key), table in TERRAFORM_VALUES.items():
        if type_ == tf_type and key in out:
            out[key] = table.get(out[key], out[key])
    return out


def _substitute(value: Any, substitutions: Mapping[str, str]) -> Any:
    return _walk(value, lambda v: substitutions.get(v, v) if isinstance(v, str) else v)


def _image(resource: Resource, spec: EnvironmentSpec) -> dict[str, Any]:
    """How to build and push the trainer image (Terraform does not build it): the same inputs the program's build
    takes, as one `docker buildx build` command run from infra/ (where the program's relative paths start)."""
    inputs = resource.inputs
    context = inputs.get("context") or {}
    cmd = ["docker", "buildx", "build", "--push", "--platform", ",".join(inputs.get("platforms") or [])]
    cmd += ["--file", inputs.get("dockerfile", {}).get("location", "")]
    for name, named in sorted((context.get("named") or {}).items()):
        cmd += ["--build-context", f"{name}={named.get('location')}"]
    for key, value in sorted((inputs.get("buildArgs") or {}).items()):
        cmd += ["--build-arg", f"{key}={value}"]
    for tag in inputs.get("tags") or []:
        cmd += ["--tag", tag]
    cmd.append(context.get("location", "."))
    return {"repository": spec.trainer_image_repository, "tags": list(inputs.get("tags") or []), "command": cmd,
            "workdir": "infra"}


def _providers(spec: EnvironmentSpec) -> dict[str, Any]:
    return {"google": {"project": spec.project, "region": spec.region},
            "cluster": {"name": spec.cluster_name, "location": spec.zone, "project": spec.project,
                        "dns_endpoint": spec.cluster.control_plane_endpoint == "dns"}}


def synthesize(env: str, config: Mapping[str, Any], state_bucket: str | None = None) -> Synthesis:
    """The Terraform document of stack `env` (a stack file's `config:` map), and the mocked run it came from."""
    config = dict(config)
    token_keys = [k for k in config if k.split(":")[-1] == "hfToken"]
    for key in token_keys:
        config[key] = ref(f"var.{HF_TOKEN_VAR}")
    mocks = TerraformMocks()
    result = run_stack(env, config, secret_keys=token_keys, monitor=RecordingMonitor(mocks), mask_secrets=False)
    spec = result.spec
    addresses = {r.urn: address_of(r.type, r.name) for r in result.resources if r.custom}
    named = [a for a in addresses.values() if a is not None]
    if len(set(named)) != len(named):  # two Pulumi names that differ only in characters Terraform names cannot hold
        raise TerraformError(f"two resources would share a Terraform address: "
                             f"{sorted({a for a in named if named.count(a) > 1})}")
    stacks: dict[str, dict[str, Any]] = {s: {"resources": [], "data": {}, "variables": {}, "outputs": {}}
                                         for s in STAGES}
    stage_of: dict[str, str] = {}
    image: dict[str, Any] | None = None
    for r in result.resources:
        if not r.custom or r.type.startswith("pulumi:providers:"):
            continue
        if r.type == IMAGE_TYPE:
            image = _image(r, spec)
            continue
        address = addresses[r.urn]
        if address is None:
            raise TerraformError(f"{r.name}: {r.type} has no Terraform counterpart here")
        stage = _stage(r)
        stage_of[address] = stage
        extra: list[dict[str, Any]] = []
        if r.type in GCP_TYPES:
            args = terraform_values(GCP_TYPES[r.type], _substitute(r.inputs, mocks.substitutions))
            entry: dict[str, Any] = {"args": args, "naming": "pulumi"}
        elif r.type == HELM_TYPE:
            entry = {"args": _helm_args(r), "naming": "terraform"}
        elif is_kubernetes_object(r):
            entry, extra = _manifest_entry(r)
        else:
            raise TerraformError(f"{r.name}: {r.type} has no Terraform counterpart here")
        type_, name = address.split(".", 1)
        entry.update(type=type_, name=name, urn=r.urn, autoname=r.name)
        life = {**_lifecycle(r), **entry.get("lifecycle", {})}
        if life:
            entry["lifecycle"] = life
        if r.options.get("customTimeouts"):
            entry["timeouts"] = dict(r.options["customTimeouts"])
        if r.type == "gcp:container/cluster:Cluster":
            entry.setdefault("lifecycle", {}).update(_version_floor(spec, mocks, stacks["gcp"]["data"]))
        entry["depends_on"] = sorted(
            a for urn in r.options.get("dependsOn", ()) if (a := addresses.get(urn)) and a != address)
        stacks[stage]["resources"].extend([*extra, entry])
    for stage, stack in stacks.items():
        # Dependencies across stacks are the order the stacks are applied in.
        for entry in stack["resources"]:
            if "depends_on" in entry:
                entry["depends_on"] = [a for a in entry["depends_on"] if stage_of.get(a) == stage]
            for address in references(entry["args"]):
                if not _declare(stack, address, mocks, image) and address not in stage_of:
                    raise TerraformError(f"{entry['name']} refers to {address}, which nothing declares")
    for key, value in result.outputs.items():
        if key in result.secret_outputs:
            continue  # the kubeconfig: Terraform users get credentials from gcloud
        value = _substitute(value, mocks.substitutions)
        # The image digest is the workloads stack's variable; an output that shows it lives there too.
        stages = {"workloads" if a.startswith("var.") else stage_of.get(a, "gcp")
                  for a in references(value) if not a.startswith("data.")}
        stage = max(stages, key=STAGES.index) if stages else "gcp"
        for address in references(value):
            _declare(stacks[stage], address, mocks, image)
        stacks[stage]["outputs"][key] = value
    bucket = state_bucket or f"{spec.project}-tfstate"
    document = {"env": env, "backend": {"bucket": bucket, "prefix": f"gke-tpu-rl/{env}"},
                "providers": _providers(spec), "image": image, "overrides": [list(o) for o in OVERRIDES],
                "stacks": stacks}
    return Synthesis(document=document, plan=result)


def _declare(stack: dict[str, Any], address: str, mocks: TerraformMocks, image: dict[str, Any] | None) -> bool:
    """Declares in `stack` the data source or variable `address` names; False for a resource's address."""
    if address.startswith("data."):
        stack["data"][address] = mocks.data[address]
    elif address.startswith("var."):
        stack["variables"][address[4:]] = _variable(address[4:], image)
    else:
        return False
    return True


def _version_floor(spec: EnvironmentSpec, mocks: TerraformMocks, data: dict[str, Any]) -> dict[str, Any]:
    """The deploy-time check the program makes (infra/components/cluster.py choose_version) as the cluster's
    precondition: the version the channel resolves to is at least the environment's floor (managed DRANET's minimum)."""
    floor = spec.gke_version_floor
    lookups = sorted(a for a, d in mocks.data.items() if d["type"] == "google_container_engine_versions")
    if not floor or not lookups:
        return {}
    c = spec.cluster
    field = "release_channel_latest_version" if c.version_prefix else "release_channel_default_version"
    version = f'{lookups[0]}.{field}["{c.release_channel}"]'
    data[lookups[0]] = mocks.data[lookups[0]]
    # 1.34.1-gke.1829001 -> ((1 * 1000 + 34) * 1000 + 1) * 10^8 + 1829001, as envspec.sections.cluster.gke_version_tuple
    # orders versions: Terraform has no version ordering of its own.
    release = f'split(".", split("-", {version})[0])'
    key = (f"((tonumber({release}[0]) * 1000 + tonumber({release}[1])) * 1000 + tonumber({release}[2])) * 100000000"
           f' + tonumber(try(split("-gke.", {version})[1], "0"))')
    major, minor, patch, build = gke_version_tuple(floor)
    condition = f"{key} >= {((major * 1000 + minor) * 1000 + patch) * 100000000 + build}"
    where = f"cluster.versionPrefix {c.version_prefix!r}" if c.version_prefix else "default"
    return {"precondition": [{"condition": condition, "error_message": (
        f"the {c.release_channel} channel's {where} version is older than {floor}, which managed DRANET needs; "
        "set gke-tpu-rl:cluster.versionPrefix to '1.34.' or later")}]}


def _variable(name: str, image: dict[str, Any] | None) -> dict[str, Any]:
    if name == IMAGE_DIGEST_VAR:
        where = image["repository"] if image else "the registry"
        return {"type": "string", "description": f"the trainer image's digest in {where}: build and push it first "
                "(build-image.sh beside this stack's folder), then pass the digest it prints (sha256:...)",
                "validation": {"condition": f"can(regex(\"^sha256:[0-9a-f]{{64}}$\", var.{name}))",
                               "error_message": f"{name} must be an image digest, sha256: and 64 hex digits"}}
    if name == HF_TOKEN_VAR:
        return {"type": "string", "sensitive": True,
                "description": "the Hugging Face token the trainer's and the engine's staging Jobs read (gated repos)"}
    raise TerraformError(f"no Terraform variable is defined for {name!r}")
