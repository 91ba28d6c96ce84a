"""The post-training service's Kubernetes objects (stack config `service:`): the Tinker-compatible API as a Deployment
on the CPU system pool, its engine as a Kueue-queued JobSet on a TPU slice group, and what they need around them.

- Two Kubernetes service accounts, <service>-api and <service>-engine, each acting as its own Google service account
  through workload identity (Cloud SQL IAM database users must be service accounts; infra/components/database.py makes
  them, their database users and the engine's bucket grant).
- The API (`python -m trainer.service serve --base-model ...`, API only): stateless, `service.apiReplicas` pods
  spread over the system pool's nodes, rolled one at a time; a ClusterIP Service, and with
  access.internalLoadBalancer an internal passthrough Network Load Balancer for the VPC's allowed ranges.
- The engine (`python -m trainer.service engine --config ...`): the same pod contract as the trainer JobSet
  (workloads/jobset.py tpu_jobset on a TpuJob), on one slice of service.sliceGroup. On a multi-host slice its
  processes join jax.distributed through the pod contract (envspec/pod.py: COORDINATOR_ADDRESS, HOST_INDEX, ...).
- Both reach the store (Cloud SQL for PostgreSQL, private IP, IAM database authentication through the Cloud SQL Python
  Connector, trainer/service/store/connection.py cloudsql_settings) through GKE_TPU_RL_CLOUDSQL_INSTANCE, _USER and
  _DATABASE.
- The engine loads the base model from `model_dir` on the bucket. With service.stageModel a staging Job
  (workloads/stage.py) fetches service.base_model there before the engine starts; without it the engine still reads
  that directory, and the team puts the model there itself.
- The API serves the files of external weights downloads (trainer/service/downloads.py) from the paths the engine
  recorded under its storage dir, so its pods mount that folder of the checkpoint bucket read-only at the same path
  (`api_checkpoint_mount`), as the API's Google service account, which holds roles/storage.objectViewer on the bucket
  and nothing on the state bucket (infra/components/database.py).
- NetworkPolicies: who may open a connection to the API's and the engine's pods (see `network_policies`).

With service.suspend the engine JobSet and the staging Job are not rendered: the API keeps taking requests into the
store, and they run when the engine is back.
"""

from __future__ import annotations

import argparse
import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from envspec.config import NAMESPACE, ConfigError, EnvironmentSpec
from envspec.engine_args import parse_engine_args
from envspec.pod import (
    CHECKPOINT_MOUNT,
    CLOUDSQL_CREDENTIALS_ENV,
    CLOUDSQL_DATABASE_ENV,
    CLOUDSQL_INSTANCE_ENV,
    CLOUDSQL_USER_ENV,
)
from envspec.sections.service import ServiceSpec
from envspec.sections.slices import SliceGroupSpec
from workloads import core, stage
from workloads import labels as L
from workloads.jobset import tpu_jobset
from workloads.trainer_pod import (
    CONTAINER_SECURITY,
    TRAINER_UID,
    TpuJob,
    TrainerRefs,
    bucket_volume,
    pod_base,
)

API_PORT = 8000
PORT_NAME = "http"
HEALTHZ = "/api/v1/healthz"  # no key needed; 200 {"status": "ok"} (trainer/service/api/health.py)
ROLES = ("api", "engine")
# One API pod is one uvicorn process (trainer/service/cli.py _serve: one event loop, no workers), so it never uses
# more than about one core; its work is JSON in and out, long-polls and store queries, the TPU work is the engine's.
# Importing it (FastAPI, the tinker SDK's types, SQLAlchemy, the Cloud SQL connector) takes about 320 MiB of resident
# memory (measured here: `python -c "import trainer.service.api, trainer.service.cli, uvicorn, sqlalchemy"`, max RSS
# 329 MB); 1 GiB leaves room for request bodies (a forward_backward carries its tokens and loss inputs) and the
# connector's pool. Requests = limits: Guaranteed QoS, as the Ray head, so the system pool's controllers are never
# squeezed by it (infra/checks/system_pool.py packs every pod pinned there by its requests).
API_RESOURCES = {"cpu": "1", "memory": "1Gi"}
# uvicorn stops within its own graceful-shutdown timeout (trainer/service/cli.py: timeout_graceful_shutdown=3); an
# open long-poll is cut, and the SDK retries it on its own. The preStop pause lets the endpoint controller take the
# pod out of the Services (and the load balancer's backends) before uvicorn stops accepting connections.
# The rollout's one extra pod (maxSurge): during each rollout apiReplicas + 1 API pods run, so the system pool must
# hold them all (infra/checks/system_pool.py counts it) or the new pod stays Pending and `pulumi up` times out.
API_MAX_SURGE = 1
API_GRACE_S = 30
API_PRESTOP_S = 5
SCRATCH = "/tmp"
# The API pods' read-only view of the engine's storage dir on the checkpoint bucket (api_checkpoint_mount), through
# GCS FUSE's sidecar, which GKE's webhook injects into a pod annotated gke-gcsfuse/volumes: "true"
# (gcs-fuse-csi-driver pkg/webhook/mutatingwebhook.go Handle; without it the node plugin refuses the mount,
# pkg/csi_driver/node.go NodePublishVolume "failed to find the sidecar container in Pod spec").
API_CHECKPOINTS_VOLUME = "checkpoints"
# The sidecar's resources, set rather than left to the webhook's defaults (250m CPU, 256Mi memory, 5Gi ephemeral
# storage, requests = limits: cmd/webhook/main.go flags sidecar-*, which GKE's managed webhook may set otherwise;
# pkg/webhook/config.go prepareConfig reads these annotations over them, and populateResource makes a missing request
# or limit equal to the other). It only reads: a download streams one file at a time, with no file cache and nothing
# staged for writes, so its temporary folders stay empty (1Gi covers its logs); 512Mi gives gcsfuse's read buffers
# and metadata caches room over the default. Requests = limits, as the API container's: the pod keeps Guaranteed QoS
# (every container, the native sidecar too, at requests = limits). infra/checks/system_pool.py counts them per API pod.
API_GCSFUSE_SIDECAR = {
    "gke-gcsfuse/cpu-request": "250m",
    "gke-gcsfuse/cpu-limit": "250m",
    "gke-gcsfuse/memory-request": "512Mi",
    "gke-gcsfuse/memory-limit": "512Mi",
    "gke-gcsfuse/ephemeral-storage-request": "1Gi",
    "gke-gcsfuse/ephemeral-storage-limit": "1Gi",
}
# GKE: an internal passthrough Network Load Balancer for a LoadBalancer Service (GKE docs, "LoadBalancer Service
# parameters": the annotation works on every supported version; spec.loadBalancerClass would need GKE subsetting).
ILB_ANNOTATION = "networking.gke.io/load-balancer-type"
HOSTNAME = "kubernetes.io/hostname"
APP_NAME = "app.kubernetes.io/name"
ENGINE_COMMAND = ("python", "-m", "trainer.service", "engine")


@dataclass(frozen=True)
class EngineFacts:
    """What the service's objects need from the engine's trainer config, as the engine's pods load it (service.args
    applied): the base model the API serves and the staging Job fetches, and the storage dir the engine writes the
    users' checkpoints to. The config is the trainer's (trainer/base/config.py), so the caller loads it
    (infra/base/engine_config.py engine_facts): workloads/ does not import the trainer."""

    base_model: str  # service.base_model, e.g. Qwen/Qwen3-8B
    storage_dir: str | None  # service.storage_dir


@dataclass(frozen=True)
class ServiceRefs:
    """What the service's objects point at, created elsewhere in the stack (Pulumi Outputs under `pulumi up`), and
    what they read from the engine's config."""

    image: Any  # the trainer image by digest (it holds trainer.service too)
    bucket: str
    instance: Any  # the Cloud SQL instance connection name PROJECT:REGION:INSTANCE
    database: str  # the database's name
    users: Mapping[str, Any]  # "api" / "engine" -> IAM database user (the GSA's e-mail less .gserviceaccount.com)
    accounts: Mapping[str, Any]  # "api" / "engine" -> Google service account e-mail (workload identity)
    engine: EngineFacts
    hf_secret: str | None = None  # the Hugging Face token for the staging Job (gated repos)
    claim_template: str | None = None  # the engine pods' DRANET claim, when its slice group has NICs to claim


def _service(spec: EnvironmentSpec) -> ServiceSpec:
    assert spec.service is not None  # callers build these only for an environment with a service
    return spec.service


def _group(spec: EnvironmentSpec) -> SliceGroupSpec:
    group = spec.service_group
    assert group is not None  # spec validation rejects a service.sliceGroup that is no slice group
    return group


def api_labels(spec: EnvironmentSpec) -> dict[str, str]:
    """The API's pods: what the Deployment, its Services, PDB and NetworkPolicy select."""
    return {APP_NAME: spec.service_api_name}


def engine_selector(spec: EnvironmentSpec) -> dict[str, str]:
    """The engine's pods, by the label the JobSet controller puts on every pod of the JobSet."""
    return {L.JOBSET_NAME: spec.service_engine_name}


# ---------------------------------------------------------------- the engine's config and paths


def service_dir(spec: EnvironmentSpec) -> str:
    """The service's directory on the bucket's mount (CHECKPOINT_DIR of the engine's pods)."""
    return f"{CHECKPOINT_MOUNT}/{_service(spec).name}"


# The service's state bucket (infra/components/storage.py) in the engine's pods: each model's latest state snapshot.
STATE_MOUNT = "/service-state"


def storage_dir(spec: EnvironmentSpec) -> str:
    """Where the engine writes the users' checkpoints (service.storage_dir)."""
    return f"{service_dir(spec)}/store"


def _parsed(argv: list[str]) -> argparse.Namespace:
    """An engine command line as the engine reads it. Raises ConfigError where the engine would refuse it."""
    try:
        return parse_engine_args(argv)
    except ValueError as e:
        raise ConfigError(f"{NAMESPACE}:service.args: the engine refuses its arguments: {e}") from None


def engine_overrides(argv: list[str]) -> list[str]:
    """The `--set KEY=VALUE` items of an engine command line, in order, read by the engine's own parser (its other
    options are not the config's). Raises ConfigError where the engine would refuse an option."""
    return list(_parsed(argv).overrides)


# Engine options the stack itself sets, with what a team sets instead: the same option again in service.args would win
# in the engine's pods (the last one counts) while the API's pods, the staging Job and the plan went on reading the
# stack's (another base model, another checkpoint folder than the API mounts, another database than the API's).
_STACK_OWNED = {"config": "service.config", "storage": "--set service.storage_dir=DIR",
                "db": "nothing: the stack gives both the API and the engine its Cloud SQL database"}


def user_overrides(spec: EnvironmentSpec) -> list[str]:
    """The `--set` items of service.args. Raises ConfigError for an engine option the stack sets itself."""
    parsed = _parsed(list(_service(spec).args))
    for dest, instead in _STACK_OWNED.items():
        if getattr(parsed, dest, None) is not None:
            raise ConfigError(f"{NAMESPACE}:service.args: --{dest} is the stack's to set (the API and the engine "
                              f"must read the same one); use {instead}")
    return list(parsed.overrides)


def model_dir(spec: EnvironmentSpec, base_model: str) -> str:
    """The base model's directory on the bucket (the engine's init.path): models/<repo name> in the service's
    directory. Staged there by the staging Job with service.stageModel; put there by hand without it."""
    return f"{service_dir(spec)}/models/{base_model.rsplit('/', 1)[-1]}"


def engine_args(spec: EnvironmentSpec, base_model: str) -> list[str]:
    """After `python -m trainer.service engine`: the bundled config, its storage and weights (of `base_model`, the
    config's service.base_model with service.args' overrides) on the bucket, a mesh over the one slice; service.args
    last, so they can override any of it."""
    svc = _service(spec)
    return ["--config", svc.config, "--set", f"service.storage_dir={storage_dir(spec)}",
            "--set", f"service.state_dir={STATE_MOUNT}",
            "--set", f"init.path={model_dir(spec, base_model)}", "--set", "mesh.slices=1", "--set", "mesh.fsdp=-1",
            *svc.args]


def db_env(refs: ServiceRefs, role: str) -> list[dict[str, Any]]:
    """The store's connection for `role` ("api" or "engine"): no password anywhere, the connector logs in as the
    pod's Google service account (IAM database authentication)."""
    return [{"name": CLOUDSQL_INSTANCE_ENV, "value": refs.instance},
            {"name": CLOUDSQL_USER_ENV, "value": refs.users[role]},
            {"name": CLOUDSQL_DATABASE_ENV, "value": refs.database}]


# The engine's Kubernetes service account token for Google's Security Token Service (its audience is the cluster's
# workload identity pool), projected into its pods, and where.
KSA_TOKEN_DIR = "/var/run/secrets/gke-tpu-rl/ksa"
KSA_TOKEN_FILE = "token"
STS_URL = "https://sts.googleapis.com/v1/token"
IAM_CREDENTIALS_URL = "https://iamcredentials.googleapis.com/v1/projects/-/serviceAccounts/{}:generateAccessToken"


def engine_on_host_network(spec: EnvironmentSpec) -> bool:
    """Whether the engine's pods run on the host network: a multi-host slice without DRANET NICs, as a trainer JobSet
    of that shape does (workloads/jobset.py host_network)."""
    group = _group(spec)
    return group.shape.multi_host and not spec.dranet_networks_for(group)


def engine_credentials(spec: EnvironmentSpec) -> dict[str, Any]:
    """The engine's Google identity as a google-auth credential configuration (external_account, identity_pool).

    Its pods run on the host network on a multi-host slice without DRANET, where the GKE metadata server cannot tell
    a pod from its node (the "restrictions of Workload Identity Federation for GKE" gcs-fuse-csi-driver's
    docs/authentication.md cites) and Application Default Credentials would be the node's account. So the pod
    exchanges its own service account token, projected with the pool as audience, at STS for a federated token
    (audience identitynamespace:<pool>:<the cluster's identity provider>, as gcs-fuse-csi-driver does for host-network
    pods: pkg/cloud_provider/auth/token_sources.go FetchIdentityBindingToken), and impersonates the engine's Google
    service account with it (roles/iam.workloadIdentityUser, infra/components/database.py), the account Cloud SQL knows
    as an IAM user. The same works on the pod network, so the engine always uses it."""
    pool = f"{spec.project}.svc.id.goog"
    provider = f"https://container.googleapis.com/v1/projects/{spec.project}/locations/{spec.zone}/clusters/" \
               f"{spec.cluster_name}"
    email = f"{spec.service_gcp_accounts['engine']}@{spec.project}.iam.gserviceaccount.com"
    return {"type": "external_account", "audience": f"identitynamespace:{pool}:{provider}",
            "subject_token_type": "urn:ietf:params:oauth:token-type:jwt", "token_url": STS_URL,
            "credential_source": {"file": f"{KSA_TOKEN_DIR}/{KSA_TOKEN_FILE}"},
            "service_account_impersonation_url": IAM_CREDENTIALS_URL.format(email)}


def ksa_token_volume(spec: EnvironmentSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The projected token engine_credentials reads (the kubelet refreshes it before it expires)."""
    volume = {"name": "ksa-token", "projected": {"sources": [{"serviceAccountToken": {
        "audience": f"{spec.project}.svc.id.goog", "expirationSeconds": 3600, "path": KSA_TOKEN_FILE}}]}}
    return volume, {"name": "ksa-token", "mountPath": KSA_TOKEN_DIR, "readOnly": True}


def _tpu_refs(spec: EnvironmentSpec, refs: ServiceRefs, *, hf: bool = False) -> TrainerRefs:
    """The trainer-pod refs of the engine's pods (and its staging Job's: with `hf`, the token)."""
    return TrainerRefs(image=refs.image, bucket=refs.bucket, service_account=spec.service_engine_name,
                       hf_secret=refs.hf_secret if hf else None, claim_template=None if hf else refs.claim_template)


def engine_job(spec: EnvironmentSpec, refs: ServiceRefs) -> TpuJob:
    """The engine as a TpuJob: the trainer's pod contract on one slice of service.sliceGroup. It exits 143 on SIGTERM
    (a preemption) and, like the trainer, is restarted on 42, any death by a signal (jobset.RESTART_EXIT_CODES) and a
    pod lost with its node, but without limit (jobset.RESTART_UNLIMITED: an always-on service would otherwise be lost
    after its maxRestarts-th Spot preemption); a bug's exit code still fails it. Every restart restores the users'
    models from the bucket."""
    svc = _service(spec)
    return TpuJob(name=spec.service_engine_name, group=_group(spec), service_account=spec.service_engine_name,
                  priority=svc.priority, max_restarts=svc.max_restarts,
                  termination_grace_seconds=svc.termination_grace_seconds, checkpoint_dir=service_dir(spec), slices=1,
                  container="engine", command=ENGINE_COMMAND, args=tuple(engine_args(spec, refs.engine.base_model)),
                  env=(*db_env(refs, "engine"),
                       {"name": CLOUDSQL_CREDENTIALS_ENV, "value": json.dumps(engine_credentials(spec))}),
                  buckets=(("service-state", spec.service_state_bucket, STATE_MOUNT),),
                  volumes=(ksa_token_volume(spec),), restart_without_limit=True)


def engine_jobset(spec: EnvironmentSpec, refs: ServiceRefs) -> dict[str, Any]:
    return tpu_jobset(spec, engine_job(spec, refs), _tpu_refs(spec, refs))


def stage_model_job(spec: EnvironmentSpec, refs: ServiceRefs) -> dict[str, Any] | None:
    """The staging Job that fetches service.base_model into model_dir, as the engine's account (its grant on the
    bucket is what it needs); None without service.stageModel."""
    svc = _service(spec)
    if not svc.stage_model:
        return None
    base = refs.engine.base_model
    fetch = stage.Fetch(model=base, model_to=model_dir(spec, base))
    return stage.fetch_job(f"{spec.service_engine_name}-stage", spec.queues.namespace, _tpu_refs(spec, refs, hf=True),
                           fetch, svc.termination_grace_seconds)


# ---------------------------------------------------------------- accounts and the API


def service_accounts(spec: EnvironmentSpec, refs: ServiceRefs) -> list[dict[str, Any]]:
    """The API's and the engine's Kubernetes accounts, each annotated with its Google service account. No token is
    mounted by default: neither calls the Kubernetes API (workload identity tokens come from the GKE metadata
    server)."""
    names = {"api": spec.service_api_name, "engine": spec.service_engine_name}
    out = []
    for role in ROLES:
        obj = core.service_account(names[role], spec.queues.namespace, refs.accounts[role])
        obj["automountServiceAccountToken"] = False
        out.append(obj)
    return out


def api_command(spec: EnvironmentSpec, base_model: str) -> list[str]:
    """The API alone (no --config: the engine runs elsewhere on the same store) serving `base_model` (the engine
    config's), on every address of the pod."""
    return ["python", "-m", "trainer.service", "serve", "--base-model", base_model, "--host", "0.0.0.0",
            "--port", str(API_PORT)]


def _probe(period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": HEALTHZ, "port": PORT_NAME}, "periodSeconds": period_s, "timeoutSeconds": 3,
            "failureThreshold": failures}


def api_storage_dir(spec: EnvironmentSpec, engine: EngineFacts) -> str:
    """The engine's storage dir as its pods load it (service.storage_dir of its config: service.args may move it),
    normalized. Raises ConfigError naming service.args when it is not on the checkpoint bucket's mount: the API pods
    could not read what the engine saves there (and the engine's saves would die with its pod)."""
    where = engine.storage_dir
    path = posixpath.normpath(where or "")
    if not where or not path.startswith(f"{CHECKPOINT_MOUNT}/"):
        raise ConfigError(f"{NAMESPACE}:service.args: service.storage_dir={where} is not in the checkpoint bucket's "
                          f"mount {CHECKPOINT_MOUNT}/: the API pods serve downloads from the engine's storage dir "
                          "through their own mount of that bucket, and the engine's saves must outlive its pods")
    return path


def api_checkpoint_mount(spec: EnvironmentSpec, refs: ServiceRefs) -> tuple[dict[str, Any], dict[str, Any]]:
    """The API pods' volume and mount of the engine's storage dir: the checkpoint bucket through GCS FUSE, that folder
    only, read-only, at the very path the engine writes (so every storage path the engine records resolves here).

    - readOnly on the CSI volume: the kubelet passes it to NodePublishVolume, the driver turns it into the FUSE
      mount's `ro` (gcs-fuse-csi-driver pkg/csi_driver/utils.go parseRequestArguments; pkg/util/util.go
      prepareMountOptions keeps `ro`/`rw` for the kernel mount, not for gcsfuse), so the kernel refuses every write
      (EROFS) whatever the process does; the container's volumeMount says readOnly too.
    - only-dir: gcsfuse shows only that prefix of the bucket (gcsfuse internal/gcsx/bucket_manager.go NewPrefixBucket;
      a prefix with no objects yet mounts as an empty folder: internal/storage/storage_handle.go
      verifyNonHNSBucketAccess takes NotFound as access), so the API does not see the base model, the trainer's
      checkpoints or other services' folders, even though its IAM grant is on the whole bucket: the CSI driver's
      own access check lists the bucket with no prefix (pkg/cloud_provider/storage/storage.go CheckBucketExists,
      GetStorageLayout, storage.objects.list), which a grant conditioned on an object prefix would refuse.
    - implicit-dirs and uid/gid as the engine's mount (trainer_pod.CHECKPOINT_MOUNT_OPTIONS): folders the engine
      made show as folders, and every file as the image's user's; modes that say read-only too (they override the
      driver's fsGroup defaults file-mode=664,dir-mode=775: pkg/csi_driver/utils.go joinMountOptions lets later
      gid/file-mode/dir-mode win). No rename-dir-limit: nothing is renamed here.
    - On the pod network (the system pool) the driver acts as the Google service account the API's Kubernetes
      account names (pkg/cloud_provider/auth/token_sources.go fetchGCPSAToken): the API's, granted
      roles/storage.objectViewer on the checkpoint bucket by infra/components/database.py."""
    path = api_storage_dir(spec, refs.engine)
    only_dir = path.removeprefix(f"{CHECKPOINT_MOUNT}/")
    volume = bucket_volume(API_CHECKPOINTS_VOLUME, refs.bucket, read_only=True, mount_options=(
        f"implicit-dirs,uid={TRAINER_UID},gid={TRAINER_UID},file-mode=444,dir-mode=555,only-dir={only_dir}"))
    return volume, {"name": API_CHECKPOINTS_VOLUME, "mountPath": path, "readOnly": True}


def api_deployment(spec: EnvironmentSpec, refs: ServiceRefs) -> dict[str, Any]:
    svc, labels = _service(spec), api_labels(spec)
    checkpoints, checkpoints_mount = api_checkpoint_mount(spec, refs)
    container = {
        "name": "api",
        "image": refs.image,
        # The image's ENTRYPOINT is the trainer (trainer/Dockerfile): the command replaces it.
        "command": api_command(spec, refs.engine.base_model),
        # A read-only image: anything that caches under $HOME (google-auth, huggingface_hub) gets the emptyDir.
        "env": [*db_env(refs, "api"), {"name": "HOME", "value": SCRATCH}],
        "ports": [{"name": PORT_NAME, "containerPort": API_PORT, "protocol": "TCP"}],
        # Startup: the imports take seconds on a busy node; liveness only after it, and slow to give up (a pod
        # restart loses nothing but drops its long-polls); readiness fast, so a stuck pod leaves the Services.
        "startupProbe": _probe(2, 60),
        "livenessProbe": _probe(10, 6),
        "readinessProbe": _probe(5, 2),
        "lifecycle": {"preStop": {"sleep": {"seconds": API_PRESTOP_S}}},
        "resources": {"requests": dict(API_RESOURCES), "limits": dict(API_RESOURCES)},
        # As the trainer's containers, and a read-only image: Python's temporary files go to an emptyDir.
        "securityContext": {**CONTAINER_SECURITY, "readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": "tmp", "mountPath": SCRATCH}, checkpoints_mount],
    }
    pod = pod_base(spec.service_api_name, API_GRACE_S, [container], [{"name": "tmp", "emptyDir": {}}, checkpoints])
    pod["restartPolicy"] = "Always"  # a Deployment's pods restart in place (the only policy it accepts)
    pod["nodeSelector"] = dict(L.SYSTEM_POOL)
    # One replica per node where the pool has the room: a node upgrade or loss then leaves the others serving. A
    # preference only (ScheduleAnyway): a one-node pool still runs every replica.
    pod["topologySpreadConstraints"] = [{"maxSkew": 1, "topologyKey": HOSTNAME, "whenUnsatisfiable": "ScheduleAnyway",
                                         "labelSelector": {"matchLabels": dict(labels)}}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        # No Kueue queue-name label: Kueue (its deployment integration on, manageJobsWithoutQueueName off by
        # default) leaves the Deployment alone, so the API never waits behind TPU workloads for admission.
        "metadata": {"name": spec.service_api_name, "namespace": spec.queues.namespace,
                     "labels": {**L.MANAGED_BY, **labels}},
        "spec": {
            "replicas": svc.api_replicas,
            "selector": {"matchLabels": dict(labels)},
            # A new pod is Ready before an old one goes: the API never drops below its replica count.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": API_MAX_SURGE}},
            # The annotations on the pod template: the webhook mutates pods, not Deployments.
            "template": {"metadata": {"labels": dict(labels),
                                      "annotations": {L.GCSFUSE_INJECT: "true", **API_GCSFUSE_SIDECAR}},
                         "spec": pod},
        },
    }


def api_disruption_budget(spec: EnvironmentSpec) -> dict[str, Any] | None:
    """With more than one replica, a node drain (GKE upgrades the system pool one node at a time) never evicts the
    last serving API pod. None with one replica: a budget of 1 would then block every drain."""
    if _service(spec).api_replicas <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": spec.service_api_name, "namespace": spec.queues.namespace, "labels": dict(L.MANAGED_BY)},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": api_labels(spec)}},
    }


def _port() -> dict[str, Any]:
    return {"name": PORT_NAME, "port": API_PORT, "targetPort": PORT_NAME, "protocol": "TCP"}


def api_services(spec: EnvironmentSpec) -> list[dict[str, Any]]:
    """The API's ClusterIP Service (what `kubectl port-forward svc/<api>` picks a pod through), and with
    access.internalLoadBalancer an internal passthrough Network Load Balancer in the VPC, open to
    access.allowedCidrs only."""
    svc, ns, labels = _service(spec), spec.queues.namespace, api_labels(spec)
    meta = {"namespace": ns, "labels": {**L.MANAGED_BY, **labels}}
    out = [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": spec.service_api_name, **meta},
            "spec": {"type": "ClusterIP", "selector": dict(labels), "ports": [_port()]}}]
    if svc.access.internal_load_balancer:
        out.append({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"{spec.service_api_name}-ilb", **meta, "annotations": {ILB_ANNOTATION: "Internal"}},
            "spec": {
                "type": "LoadBalancer", "selector": dict(labels), "ports": [_port()],
                # GKE makes VPC firewall rules that admit only these sources (GKE docs, "LoadBalancer Service
                # parameters": spec.loadBalancerSourceRanges).
                "loadBalancerSourceRanges": list(svc.access.allowed_cidrs),
                # Local: the load balancer sends only to nodes that run an API pod, which get the packet with the
                # client's own source address (GKE docs, "LoadBalancer Service concepts", effect of
                # externalTrafficPolicy). With Cluster a node would forward it to a pod elsewhere from its own
                # address, and the NetworkPolicy's ipBlock (the same ranges) would refuse it.
                "externalTrafficPolicy": "Local",
            },
        })
    return out


def network_policies(spec: EnvironmentSpec) -> list[dict[str, Any]]:
    """Who may open a connection to the service's pods (GKE Dataplane V2, i.e. Cilium, enforces NetworkPolicy on
    every cluster with it; infra/components/cluster.py turns it on).

    The API: TCP 8000 from access.allowedCidrs when the internal load balancer is on, and from nothing else, in the
    cluster or out. Two paths stay open without a rule. `kubectl port-forward` is not pod network traffic: the API
    server streams to the kubelet, whose container runtime dials localhost:8000 inside the pod's own network
    namespace (containerd internal/cri/server/sandbox_portforward_linux.go portForward/dialLocalhost), over the
    pod's loopback, which no policy sees. The kubelet's probes come from the node itself, which Cilium always lets
    reach the pods on that node in Kubernetes mode (cilium daemon: "Kubernetes demands that the localhost can always
    reach local pods", --allow-localhost auto becomes always); the same holds for containerd's fallback dial to the
    pod IP from the host's namespace. In-cluster clients (other pods) are refused: the API takes users' keys, and no
    other workload here needs it.

    The engine: only its own pods (jax.distributed's coordinator, libtpu's multislice and inter-host traffic; by
    peer, not by port, so no port libtpu picks is shut). Nothing else calls it: the API and the engine meet in the
    store. On a multi-host slice without DRANET its pods run on the host network (workloads/jobset.py host_network),
    where they are no pod endpoints and no NetworkPolicy applies to them: this policy then covers the engine only
    where it runs on the pod network.

    Egress stays open for both: the store is Cloud SQL on its private IP (from the private services range), reached
    through the connector, which first calls the Cloud SQL Admin API; the engine reads and writes the buckets and the
    API reads the checkpoint bucket (GCS FUSE's sidecar in each pod calls storage.googleapis.com, with the pod's
    workload identity tokens); both get tokens from the GKE metadata server; the staging Job reaches the Hugging
    Face Hub. Those addresses are Google's and change; a policy of IP ranges would only break them. No policy here
    has policyTypes Egress, so none of it is filtered.
    """
    ns = spec.queues.namespace
    svc = _service(spec)
    api_rules: list[dict[str, Any]] = []
    if svc.access.internal_load_balancer:
        api_rules.append({"from": [{"ipBlock": {"cidr": c}} for c in svc.access.allowed_cidrs],
                          "ports": [{"protocol": "TCP", "port": API_PORT}]})
    def engine() -> dict[str, Any]:
        return {"podSelector": {"matchLabels": engine_selector(spec)}}

    return [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
         "metadata": {"name": spec.service_api_name, "namespace": ns, "labels": dict(L.MANAGED_BY)},
         "spec": {"podSelector": {"matchLabels": api_labels(spec)}, "policyTypes": ["Ingress"],
                  "ingress": api_rules}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
         "metadata": {"name": spec.service_engine_name, "namespace": ns, "labels": dict(L.MANAGED_BY)},
         "spec": {**engine(), "policyTypes": ["Ingress"], "ingress": [{"from": [engine()]}]}},
    ]


def api_address(spec: EnvironmentSpec) -> str:
    """The API inside the cluster (its ClusterIP Service)."""
    return f"http://{spec.service_api_name}.{spec.queues.namespace}.svc:{API_PORT}"


def port_forward_hint(spec: EnvironmentSpec) -> str:
    return f"kubectl -n {spec.queues.namespace} port-forward svc/{spec.service_api_name} {API_PORT}:{API_PORT}"


def service_objects(spec: EnvironmentSpec, refs: ServiceRefs) -> list[dict[str, Any]]:
    """Every object of the service, in the order they are applied; without the engine and its staging Job under
    service.suspend."""
    out = [*service_accounts(spec, refs), api_deployment(spec, refs)]
    if (pdb := api_disruption_budget(spec)) is not None:
        out.append(pdb)
    out += [*api_services(spec), *network_policies(spec)]
    if not _service(spec).suspend:
        if (job := stage_model_job(spec, refs)) is not None:
            out.append(job)
        out.append(engine_jobset(spec, refs))
    return out
