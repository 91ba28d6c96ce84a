"""The post-training service on the cluster (workloads/service.py, infra/components/service.py): every object passes the
upstream schemas, the engine's pods are the trainer's pods but for the process, the API's and the engine's commands are
what their own parsers take, suspend drops only the engine, the NetworkPolicies select what they mean to, the internal
load balancer exists only for allowed ranges, and the trainer renders as it did without a service."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from envspec.config import ConfigError, EnvironmentSpec, parse_spec
from infra.base.engine_config import base_model, engine_args, engine_config, engine_facts
from infra.components.trainer_job import DELETE_MARGIN_S
from infra.offline.mockrun import PlanResult, run_stack
from infra.offline.plan import kubernetes_objects
from tests import k8s_schemas
from tests.infra.conftest import stack_config
from tests.infra.test_config import _raw
from trainer.base.config import bundled_configs
from trainer.run import distributed
from workloads import jobset, service, trainer_pod
from workloads import labels as L

IMAGE = "registry/trainer@sha256:" + "0" * 64
CONNECTION = "acme-rl-tinker:us-east5:rl-tinker-tinker"
SERVICE = {"config": "qwen3-8b-service-v6e-4x4.yaml"}
# A trainer on the service's slice group, for the pod-contract comparison (a run config, not a service config).
TRAINER = {"enabled": True, "name": "grpo", "config": "qwen3-8b-grpo-v6e-4x4.yaml", "slices": 1}


def _tinker(**service_keys: Any) -> EnvironmentSpec:
    raw = copy.deepcopy(_raw("tinker"))
    raw["service"] = {**raw["service"], **service_keys}
    return parse_spec(raw, "tinker", bundled_configs())


def _with_service(env: str, group: str, trainer: dict[str, Any] | None = None, **service_keys: Any) -> EnvironmentSpec:
    """A shipped environment plus the service on slice group `group`, the trainer moved there too (or as given)."""
    raw = copy.deepcopy(_raw(env))
    raw["trainer"] = {k: v for k, v in raw["trainer"].items() if k not in ("launcher", "minSlices")}
    raw["trainer"].update({"sliceGroup": group, "slices": 1, **(trainer or {})})
    raw["service"] = {**SERVICE, "sliceGroup": group, **service_keys}
    return parse_spec(raw, env, bundled_configs())


# The service's engine on every kind of slice group the shipped environments have, a trainer beside it on the same
# group: tinker's 4-host v6e on spot (host network), staging's 4-host v6e with DRANET (claims, pod network), prod's
# flex-start v6e (queued provisioning) and its reserved v5p, dev's single-host v6e on spot.
CASES = {
    "tinker": lambda: parse_spec({**copy.deepcopy(_raw("tinker")), "trainer": {**TRAINER, "sliceGroup": "v6e-svc"}},
                                 "tinker", bundled_configs()),
    "staging-dranet": lambda: _with_service("staging", "v6e-stg"),
    "prod-flex-start": lambda: _with_service("prod", "v6e-burst"),
    "prod-v5p": lambda: _with_service("prod", "v5p-prod"),
    "dev-single-host": lambda: _with_service("dev", "v6e-dev"),
}


def _refs(spec: EnvironmentSpec, *, claim: str | None = "auto", hf: str | None = "hf") -> service.ServiceRefs:
    group = spec.service_group
    nics = spec.dranet_networks_for(group) if group is not None else 0
    return service.ServiceRefs(
        image=IMAGE, bucket=spec.bucket_name, instance=CONNECTION, database="tinker",
        users={"api": "tinker-tinker-api@acme-rl-tinker.iam", "engine": "tinker-tinker-eng@acme-rl-tinker.iam"},
        accounts={"api": "tinker-tinker-api@acme-rl-tinker.iam.gserviceaccount.com",
                  "engine": "tinker-tinker-eng@acme-rl-tinker.iam.gserviceaccount.com"},
        engine=engine_facts(spec), hf_secret=hf,
        claim_template=("netdev" if nics else None) if claim == "auto" else claim)


def _pod(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _kinds(objects: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(o["kind"], o["metadata"]["name"]) for o in objects]


# ---------------------------------------------------------------- schemas


VARIANTS = {
    **CASES,
    "tinker-ilb": lambda: _tinker(access={"internalLoadBalancer": True, "allowedCidrs": ["10.128.0.0/20"]}),
    "tinker-one-replica-no-staging": lambda: _tinker(apiReplicas=1, stageModel=False),
    "tinker-suspended": lambda: _tinker(suspend=True),
}


@pytest.mark.parametrize("kv", k8s_schemas.KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", sorted(VARIANTS))
def test_every_object_validates_against_kubernetes_and_the_jobset_crd(case: str, kv: str) -> None:
    k8s_schemas.need_schemas()
    objects = service.service_objects(VARIANTS[case](), _refs(VARIANTS[case]()))
    assert objects
    for obj in objects:
        assert k8s_schemas.validate(obj, kv) == [], (obj["kind"], obj["metadata"]["name"])
    for obj in objects:
        if obj["kind"] == "JobSet":  # its pod template is checked against the release's own PodTemplateSpec too
            assert len(k8s_schemas.embedded_pod_templates(obj)) == 1


def test_the_rendered_stack_validates_and_orders_the_engine_after_its_staging() -> None:
    k8s_schemas.need_schemas()
    plan = run_stack("tinker", stack_config("tinker"))
    objects = kubernetes_objects(plan)
    for obj in objects:
        k8s_schemas.assert_valid(obj)
    spec = plan.spec
    ns, api, engine = spec.queues.namespace, spec.service_api_name, spec.service_engine_name
    assert set(_kinds([o for o in objects if o["metadata"].get("namespace") == ns])) >= {
        ("ServiceAccount", api), ("ServiceAccount", engine), ("Deployment", api), ("PodDisruptionBudget", api),
        ("Service", api), ("NetworkPolicy", api), ("NetworkPolicy", engine), ("Job", f"{engine}-stage"),
        ("JobSet", engine)}
    # No trainer in this environment: no trainer JobSet, no trainer account.
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "JobSet"] == [engine]
    assert plan.outputs["serviceApi"] == f"http://{api}.{ns}.svc:{service.API_PORT}"
    assert plan.outputs["servicePortForward"] == f"kubectl -n {ns} port-forward svc/{api} 8000:8000"
    [stage_job] = plan.of_type("kubernetes:batch/v1:Job")
    [engine_set] = plan.of_type("kubernetes:jobset.x-k8s.io/v1alpha2:JobSet")
    [deployment] = plan.of_type("kubernetes:apps/v1:Deployment")
    assert stage_job.urn in engine_set.options["dependsOn"]
    assert stage_job.options["customTimeouts"] == {"create": "180m"} and stage_job.options["deleteBeforeReplace"]
    # The engine: replaced on any change, deleted first, after its pods' grace period (TrainerJob's rules).
    assert engine_set.options["replaceOnChanges"] == ["spec", "metadata"]
    assert engine_set.options["deleteBeforeReplace"] is True
    grace = spec.service.termination_grace_seconds  # type: ignore[union-attr]
    assert engine_set.options["customTimeouts"] == {"delete": f"{grace + DELETE_MARGIN_S}s"}
    # The API: updated in place (rolled by its controller), never replaced.
    assert "replaceOnChanges" not in deployment.options and "deleteBeforeReplace" not in deployment.options
    # The pods start only once what they use exists: the namespace, the slice's node pool, the Cloud SQL user they
    # log in as and the engine account's grant on the bucket (a component's depends_on does not reach its children,
    # so the Service passes its own on).
    [namespace] = [r for r in plan.of_type("kubernetes:core/v1:Namespace") if r.inputs["metadata"]["name"] == ns]
    pool = plan.get("gcp:container/nodePool:NodePool", spec.service_group.pool_names()[0])  # type: ignore[union-attr]
    db_user = next(r for r in plan.of_type("gcp:sql/user:User") if "engine" in r.name)
    grant = next(r for r in plan.of_type("gcp:storage/bucketIAMMember:BucketIAMMember")
                 if r.inputs["member"].startswith("serviceAccount:") and "eng@" in r.inputs["member"])
    for resource in (stage_job, engine_set):
        assert {namespace.urn, pool.urn, db_user.urn, grant.urn} <= set(resource.options["dependsOn"]), resource.name
    assert namespace.urn in deployment.options["dependsOn"]


# ---------------------------------------------------------------- the engine is the trainer's pod contract


def _masked_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """A pod spec less what is the process's own (command, args, env, container name) and what is the workload's own
    by design (its service account and grace period)."""
    out = copy.deepcopy(pod)
    for key in ("serviceAccountName", "terminationGracePeriodSeconds"):
        out.pop(key)
    # The engine's state bucket, mounted as the checkpoint bucket is, and its projected token (checked on their own
    # below).
    own = ("service-state", "ksa-token")
    out["volumes"] = [v for v in out["volumes"] if v["name"] not in own]
    for c in out["containers"]:
        for key in ("command", "args", "env", "name"):
            c.pop(key, None)
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] not in own]
    return out


def _masked_jobset(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["name"] = out["spec"]["network"]["subdomain"] = "NAME"
    out["metadata"]["labels"][L.KUEUE_PRIORITY] = "PRIORITY"
    out["spec"]["failurePolicy"]["maxRestarts"] = 0
    out["spec"]["failurePolicy"]["rules"] = "RULES"  # the engine's restart without limit; the trainer's do not
    job = out["spec"]["replicatedJobs"][0]["template"]["spec"]
    # The engine's own counted restart code is a FailJob rule of its own before the bug rule (checked below).
    job["podFailurePolicy"]["rules"] = job["podFailurePolicy"]["rules"][-1:]
    job["podFailurePolicy"]["rules"][0]["onExitCodes"]["containerName"] = "CONTAINER"
    job["template"]["spec"] = _masked_pod(job["template"]["spec"])
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_pods_are_the_trainers_pods_but_for_the_process(case: str) -> None:
    spec = CASES[case]()
    assert spec.service_group == spec.trainer_group
    refs = _refs(spec)
    engine = service.engine_jobset(spec, refs)
    trainer = jobset.trainer_jobset(spec, trainer_pod.TrainerRefs(
        image=IMAGE, bucket=spec.bucket_name, service_account=spec.trainer.service_account,
        claim_template=refs.claim_template))
    assert _masked_jobset(engine) == _masked_jobset(trainer)
    pod = engine["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    [state] = [v for v in pod["volumes"] if v["name"] == "service-state"]
    [checkpoints] = [v for v in pod["volumes"] if v["name"] == "checkpoints"]
    assert state["csi"]["volumeAttributes"] == {**checkpoints["csi"]["volumeAttributes"],
                                                "bucketName": spec.service_state_bucket}
    assert {"name": "service-state", "mountPath": service.STATE_MOUNT} in pod["containers"][0]["volumeMounts"]
    assert f"service.state_dir={service.STATE_MOUNT}" in pod["containers"][0]["args"]
    assert pod.get("hostNetwork", False) is service.engine_on_host_network(spec)  # what the bucket grants follow
    # What differs is what it should be: the engine's own account, grace, restarts, priority and name.
    svc = spec.service
    assert svc is not None
    pod = _pod(engine)
    assert pod["serviceAccountName"] == spec.service_engine_name
    assert pod["terminationGracePeriodSeconds"] == svc.termination_grace_seconds
    assert engine["spec"]["failurePolicy"]["maxRestarts"] == svc.max_restarts
    assert engine["metadata"]["labels"][L.KUEUE_PRIORITY] == svc.priority
    assert engine["metadata"]["labels"][L.KUEUE_QUEUE] == spec.queues.local_queue
    transient, rule = engine["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    assert rule["onExitCodes"]["containerName"] == pod["containers"][0]["name"] == "engine"
    # 143 (its SIGTERM exit), 42 and every other death by a signal restart it; anything else is a bug. 42 first, as
    # a FailJob of its own that restartOnTransient counts.
    assert {42, 143, 137} <= set(rule["onExitCodes"]["values"]) and rule["onExitCodes"]["operator"] == "NotIn"
    assert transient["onExitCodes"] == {"containerName": "engine", "operator": "In", "values": [42]}
    assert engine["spec"]["replicatedJobs"][0]["replicas"] == 1
    assert trainer["spec"]["failurePolicy"]["rules"] == [jobset.FAIL_ON_BUG]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_engine_restarts_on_preemption_without_limit_and_fails_on_a_bug(case: str) -> None:
    """Review 2026-11-28 #8: an always-on engine on Spot would fail for good at its maxRestarts-th preemption
    (RestartJobSet counts every one into status.restartsCountTowardsMax, which nothing resets), and `pulumi up` would
    not bring it back (no input changed). RestartJobSetAndIgnoreMaxRestarts on BackoffLimitExceeded, after failOnBug:
    preemptions, node loss, signals and transient exits restart it forever; a bug's exit code still fails it."""
    from tests.workloads.test_jobset import BUG, KILLED, NODE_LOST, PREEMPTED, TRANSIENT, _run

    engine = service.engine_jobset(CASES[case](), _refs(CASES[case]()))
    assert engine["spec"]["failurePolicy"]["rules"] == [
        {"name": "restartOnTransient", "action": "RestartJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": ["matching FailJob rule at index 0$"]},
        {"name": "failOnBug", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
        {"name": "restartOnPreemption", "action": "RestartJobSetAndIgnoreMaxRestarts",
         "onJobFailureReasons": ["BackoffLimitExceeded"]}]
    many = [[PREEMPTED], [NODE_LOST], [KILLED]] * 150  # 450 restarts, service.maxRestarts is 100
    assert _run(engine, many) == ("Running", 450, 0)
    assert _run(engine, [*many, [BUG]]) == ("Failed", 450, 0)
    # Its own "restart me" (42) is counted: a misconfiguration that exits 42 at every start ends after maxRestarts.
    assert _run(engine, [*many, *[[TRANSIENT]] * 100]) == ("Running", 550, 100)
    assert _run(engine, [*many, *[[TRANSIENT]] * 101]) == ("Failed", 550, 100)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_engine_host_joins_one_jax_process_group(case: str) -> None:
    """The engine reads the trainer's env contract (trainer/run/distributed.py): every host of its slice resolves to a
    distinct process id, 0 being the coordinator's pod."""
    spec = CASES[case]()
    obj = service.engine_jobset(spec, _refs(spec))
    [rj] = obj["spec"]["replicatedJobs"]
    [container] = rj["template"]["spec"]["template"]["spec"]["containers"]
    hosts = rj["template"]["spec"]["completions"]
    ids = set()
    for host in range(hosts):
        env = {}
        for e in container["env"]:
            if "value" in e:
                env[e["name"]] = e["value"]
                continue
            kind, key = re.fullmatch(r"metadata\.(annotations|labels)\['(.+)'\]",
                                     e["valueFrom"]["fieldRef"]["fieldPath"]).groups()
            env[e["name"]] = {L.JOBSET_JOB_INDEX: "0", L.JOB_COMPLETION_INDEX: str(host),
                              L.JOBSET_NAME: obj["metadata"]["name"]}[key]
        info = distributed.process_info_from_env(env)
        assert info.num_processes == hosts
        ids.add(info.process_id)
        coordinator = env["COORDINATOR_ADDRESS"]
    assert ids == set(range(hosts))
    assert coordinator == f"{spec.service_engine_name}-slice-0-0.{spec.service_engine_name}:{jobset.COORDINATOR_PORT}"


# ---------------------------------------------------------------- commands, config, store


def test_engine_command_is_what_the_service_cli_takes_and_loads_the_staged_model() -> None:
    from trainer.service.cli import build_parser
    from trainer.stage import build_parser as stage_parser

    spec = _tinker(args=["--set", "service.idle_unload_s=1800", "--log-level", "debug"])
    refs = _refs(spec)
    [container] = _pod(service.engine_jobset(spec, refs))["containers"]
    cmd = [*container["command"], *container["args"]]
    assert cmd[:4] == ["python", "-m", "trainer.service", "engine"]
    args = build_parser().parse_args(cmd[3:])
    assert args.command == "engine" and args.config == "qwen3-8b-service-v6e-4x4.yaml" and args.log_level == "debug"
    cfg = engine_config(spec)
    model_dir = "/checkpoints/tinker/models/Qwen3-8B"
    assert cfg.init.path == model_dir and cfg.service.storage_dir == "/checkpoints/tinker/store"
    assert (cfg.mesh.slices, cfg.mesh.tensor) == (1, 4) and cfg.service.idle_unload_s == 1800
    # The staging Job fetches the config's base model into that very directory, as the engine's account.
    job = service.stage_model_job(spec, refs)
    assert job is not None
    stage_cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    staged = stage_parser().parse_args(stage_cmd[3:])
    assert (staged.model, staged.model_to) == (cfg.service.base_model, model_dir)
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == spec.service_engine_name
    assert {e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]} == {"HF_HOME", "HF_TOKEN"}
    # Without staging the engine reads the same directory (the team puts the model there).
    unstaged = _tinker(stageModel=False)
    assert service.stage_model_job(unstaged, _refs(unstaged)) is None
    assert engine_config(unstaged).init.path == model_dir


def test_service_args_are_read_by_the_engines_own_parser() -> None:
    # An abbreviated --set is one to the engine (argparse), so it is one to the stack too; an option the engine
    # would refuse fails the plan instead of crash-looping the engine.
    from trainer.service.cli import build_parser

    spec = _tinker(args=["--se", "service.idle_unload_s=1800"])
    engine = build_parser().parse_args(["engine", *engine_args(spec)])
    assert engine.overrides[-1] == "service.idle_unload_s=1800"
    assert service.user_overrides(spec) == ["service.idle_unload_s=1800"]
    assert engine_config(spec).service.idle_unload_s == 1800
    with pytest.raises(ConfigError, match=r"service\.args: the engine refuses its arguments: .*--local-processes"):
        service.user_overrides(_tinker(args=["--local-processes", "two"]))
    # What the engine's own parser would refuse at start (exit 2: FailJobSet) fails the plan: an ambiguous
    # abbreviation, an unknown option, a stray argument, -h (which would print the help and exit 0: Complete).
    for bad, reason in ((["--d", "4"], "ambiguous option: --d could match --db, --devices-per-process"),
                        (["--sett", "a=1"], "unrecognized arguments: --sett a=1"),
                        (["stray"], "unrecognized arguments: stray"), (["-h"], "unrecognized arguments: -h")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["engine", "--config", "c.yaml", *bad])
        with pytest.raises(ConfigError, match=f"the engine refuses its arguments: {re.escape(reason)}"):
            service.user_overrides(_tinker(args=bad))


@pytest.mark.parametrize(("args", "instead"), [(["--config", "x.yaml"], "service.config"),
                                               (["--stor", "/tmp/x"], "--set service.storage_dir=DIR"),
                                               (["--db", "sqlite:///x.db"], "the stack gives both")])
def test_service_args_cannot_repoint_what_the_api_reads_too(args: list[str], instead: str) -> None:
    # The engine would take the last --config/--storage/--db; the API, the staging Job and the plan read the stack's.
    with pytest.raises(ConfigError, match=rf"service\.args: --\w+ is the stack's to set .*{re.escape(instead)}"):
        service.user_overrides(_tinker(args=args))


def test_service_args_overriding_the_base_model_move_what_is_staged_and_served() -> None:
    spec = _tinker(args=["--set", "service.base_model=Qwen/Qwen3-4B"])
    assert base_model(spec) == engine_facts(spec).base_model == "Qwen/Qwen3-4B"
    assert service.model_dir(spec, base_model(spec)) == "/checkpoints/tinker/models/Qwen3-4B"
    assert "Qwen/Qwen3-4B" in service.api_deployment(spec, _refs(spec))["spec"]["template"]["spec"]["containers"][0][
        "command"]
    assert engine_config(spec).init.path == "/checkpoints/tinker/models/Qwen3-4B"
    with pytest.raises(ConfigError, match=r"service\.args: .*does not load"):
        engine_config(_tinker(args=["--set", "service.max_batch_tokens=-1"]))


def test_api_command_is_what_the_service_cli_takes_and_its_probe_answers_without_a_key(tmp_path: Any) -> None:
    from fastapi.testclient import TestClient

    from trainer.service.api import create_app
    from trainer.service.cli import build_parser, server_config
    from trainer.service.store import Store

    spec = _tinker()
    deployment = service.api_deployment(spec, _refs(spec))
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"][:3] == ["python", "-m", "trainer.service"] and "args" not in container
    args = build_parser().parse_args(container["command"][3:])
    assert (args.command, args.host, args.port, args.config) == ("serve", "0.0.0.0", service.API_PORT, None)
    config = server_config(args)  # the API alone: the base model it serves is the engine config's
    assert [m.name for m in config.base_models] == [engine_config(spec).service.base_model]
    # Every probe asks the route that needs no key, on the port the container opens.
    [port] = container["ports"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": service.HEALTHZ, "port": port["name"]}
    assert port["containerPort"] == service.API_PORT
    store = Store(f"sqlite:///{tmp_path / 'service.db'}")
    try:
        with TestClient(create_app(store, config)) as client:
            response = client.get(service.HEALTHZ)
        assert response.status_code == 200 and response.json() == {"status": "ok"}
    finally:
        store.close()


def test_api_pods_mount_the_engines_storage_dir_read_only_where_the_engine_writes_it() -> None:
    """External weights downloads are served by the API pods from the storage paths the engine recorded
    (trainer/service/downloads.py): the API mounts the engine's storage dir of the checkpoint bucket, at the very path
    the engine writes it, read-only, through a GCS FUSE sidecar GKE's webhook injects (the annotation on the pod
    template: gcs-fuse-csi-driver pkg/webhook/mutatingwebhook.go Handle mutates pods)."""
    spec = _tinker()
    refs = _refs(spec)
    template = service.api_deployment(spec, refs)["spec"]["template"]
    pod = template["spec"]
    [container] = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    [mount] = [m for m in container["volumeMounts"] if m["name"] == service.API_CHECKPOINTS_VOLUME]
    csi = volumes[service.API_CHECKPOINTS_VOLUME]["csi"]
    assert csi["driver"] == L.GCSFUSE_DRIVER and csi["volumeAttributes"]["bucketName"] == spec.bucket_name
    # Read-only twice over: the CSI volume (the driver's `ro` kernel mount) and the container's mount.
    assert csi["readOnly"] is True and mount["readOnly"] is True
    # Where the engine writes (its pods' config, service.args applied) and nothing above it: only-dir is that folder.
    engine_dir = engine_config(spec).service.storage_dir
    assert mount["mountPath"] == engine_dir == service.storage_dir(spec) == "/checkpoints/tinker/store"
    engine_pod = _pod(service.engine_jobset(spec, refs))
    [engine_checkpoints] = [m for m in engine_pod["containers"][0]["volumeMounts"] if m["name"] == "checkpoints"]
    assert engine_dir.startswith(engine_checkpoints["mountPath"] + "/")
    options = dict(o.partition("=")[::2] for o in csi["volumeAttributes"]["mountOptions"].split(","))
    assert options["only-dir"] == engine_dir.removeprefix(engine_checkpoints["mountPath"] + "/") == "tinker/store"
    assert "implicit-dirs" in options and options["uid"] == options["gid"] == str(trainer_pod.TRAINER_UID)
    assert "rename-dir-limit" not in options and "rw" not in options
    assert "hostNetworkPodKSA" not in csi["volumeAttributes"] and not pod.get("hostNetwork")  # the pod network
    # The sidecar: injected (the annotation is on the pods, not the Deployment), requests = limits as the API
    # container's, so the pod keeps Guaranteed QoS.
    ann = template["metadata"]["annotations"]
    assert ann[L.GCSFUSE_INJECT] == "true"
    for resource in ("cpu", "memory", "ephemeral-storage"):
        assert ann[f"gke-gcsfuse/{resource}-request"] == ann[f"gke-gcsfuse/{resource}-limit"] != "0"
    # The API's Kubernetes account acts as the API's Google account: the one infra/components/database.py grants the
    # viewer role.
    assert pod["serviceAccountName"] == spec.service_api_name


def test_service_args_moving_the_storage_dir_move_the_api_mount_and_off_the_bucket_are_refused() -> None:
    from infra.components.service import check

    spec = _tinker(args=["--set", "service.storage_dir=/checkpoints/elsewhere/ckpts"])
    pod = service.api_deployment(spec, _refs(spec))["spec"]["template"]["spec"]
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == service.API_CHECKPOINTS_VOLUME]
    assert mount["mountPath"] == "/checkpoints/elsewhere/ckpts"
    [volume] = [v for v in pod["volumes"] if v["name"] == service.API_CHECKPOINTS_VOLUME]
    assert volume["csi"]["volumeAttributes"]["mountOptions"].endswith(",only-dir=elsewhere/ckpts")
    for where in ("/tmp/ckpts", "/checkpoints", "/checkpoints/../etc", "/service-state/x"):
        bad = _tinker(args=["--set", f"service.storage_dir={where}"])
        with pytest.raises(ConfigError, match=r"service\.args: service\.storage_dir=.* is not in the checkpoint "):
            check(bad)


def test_both_containers_reach_the_store_as_their_own_accounts() -> None:
    from trainer.service import store

    spec = _tinker()
    refs = _refs(spec)
    api_env = service.api_deployment(spec, refs)["spec"]["template"]["spec"]["containers"][0]["env"]
    engine_env = _pod(service.engine_jobset(spec, refs))["containers"][0]["env"]
    for role, env in (("api", api_env), ("engine", engine_env)):
        values = {e["name"]: e.get("value") for e in env}
        assert values[store.CLOUDSQL_INSTANCE_ENV] == CONNECTION
        assert values[store.CLOUDSQL_USER_ENV] == refs.users[role]
        assert values[store.CLOUDSQL_DATABASE_ENV] == "tinker"
    # ...which their Kubernetes accounts act as through workload identity, with no token mounted.
    accounts = {o["metadata"]["name"]: o for o in service.service_accounts(spec, refs)}
    for role, name in (("api", spec.service_api_name), ("engine", spec.service_engine_name)):
        assert accounts[name]["metadata"]["annotations"] == {L.WORKLOAD_IDENTITY_GSA: refs.accounts[role]}
        assert accounts[name]["automountServiceAccountToken"] is False
    api_pod = service.api_deployment(spec, refs)["spec"]["template"]["spec"]
    assert api_pod["serviceAccountName"] == spec.service_api_name
    assert _pod(service.engine_jobset(spec, refs))["serviceAccountName"] == spec.service_engine_name


def test_api_runs_on_the_system_pool_like_a_trainer_pod_and_rolls_without_downtime() -> None:
    spec = _tinker()
    deployment = service.api_deployment(spec, _refs(spec))
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == L.SYSTEM_POOL and "tolerations" not in pod
    assert pod["securityContext"] == trainer_pod.pod_security()
    [container] = pod["containers"]
    assert container["securityContext"] == {**trainer_pod.CONTAINER_SECURITY, "readOnlyRootFilesystem": True}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert container["resources"]["requests"] == container["resources"]["limits"] == service.API_RESOURCES
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    [spread] = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert L.KUEUE_QUEUE not in deployment["metadata"]["labels"]  # Kueue leaves the API alone
    pdb = service.api_disruption_budget(spec)
    assert pdb is not None and pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    assert service.api_disruption_budget(_tinker(apiReplicas=1)) is None  # a budget of 1 would block every drain


# ---------------------------------------------------------------- suspend


def test_suspend_removes_the_engine_and_its_staging_and_keeps_the_api() -> None:
    running, suspended = _tinker(), _tinker(suspend=True)
    kept = _kinds(service.service_objects(suspended, _refs(suspended)))
    full = _kinds(service.service_objects(running, _refs(running)))
    assert set(full) - set(kept) == {("JobSet", "tinker-engine"), ("Job", "tinker-engine-stage")}
    assert set(kept) <= set(full)
    # The stack too: no engine, no staging Job, no DRANET claim or token for them; the API and its policies stay.
    config = stack_config("tinker")
    config["gke-tpu-rl:service"] = {**config["gke-tpu-rl:service"], "suspend": True}
    plan = run_stack("tinker", config)
    kinds = {o["kind"] for o in kubernetes_objects(plan)}
    assert not kinds & {"JobSet", "Job", "ResourceClaimTemplate"}
    assert {"Deployment", "Service", "NetworkPolicy", "ServiceAccount", "PodDisruptionBudget"} <= kinds
    assert plan.outputs["serviceApi"].startswith("http://tinker-api.")


# ---------------------------------------------------------------- network policies and the load balancer


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def _pod_labels(spec: EnvironmentSpec) -> dict[str, dict[str, str]]:
    """The labels each kind of pod carries on the cluster: the Deployment's template labels, and the JobSet's, to
    which the JobSet controller adds jobset.sigs.k8s.io/jobset-name (its pod labels; FACTS: JobSet labels)."""
    refs = _refs(spec)
    api = service.api_deployment(spec, refs)["spec"]["template"]["metadata"]["labels"]
    engine_obj = service.engine_jobset(spec, refs)
    engine = {**engine_obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"].get("metadata", {}).get(
        "labels", {}), L.JOBSET_NAME: engine_obj["metadata"]["name"]}
    trainer = {L.JOBSET_NAME: spec.trainer.name}
    return {"api": api, "engine": engine, "trainer": trainer}


@pytest.mark.parametrize("ilb", [False, True])
def test_network_policies_select_the_right_pods_and_admit_only_what_they_mean_to(ilb: bool) -> None:
    access = {"internalLoadBalancer": True, "allowedCidrs": ["10.128.0.0/20", "192.168.4.0/24"]} if ilb else {}
    spec = _tinker(access=access)
    pods = _pod_labels(spec)
    api_policy, engine_policy = service.network_policies(spec)
    assert [p for p, labels in pods.items() if _selects(api_policy["spec"]["podSelector"], labels)] == ["api"]
    assert [p for p, labels in pods.items() if _selects(engine_policy["spec"]["podSelector"], labels)] == ["engine"]
    for policy in (api_policy, engine_policy):
        assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress open: Cloud SQL, GCS, the metadata server
    # The API: nothing in the cluster; with the load balancer, its allowed ranges on the API's port only.
    if ilb:
        [rule] = api_policy["spec"]["ingress"]
        assert rule["from"] == [{"ipBlock": {"cidr": "10.128.0.0/20"}}, {"ipBlock": {"cidr": "192.168.4.0/24"}}]
        container = service.api_deployment(spec, _refs(spec))["spec"]["template"]["spec"]["containers"][0]
        assert rule["ports"] == [{"protocol": "TCP", "port": container["ports"][0]["containerPort"]}]
    else:
        assert api_policy["spec"]["ingress"] == []
    # The engine: its own pods, nothing else (not the API, not a trainer in the same namespace).
    [rule] = engine_policy["spec"]["ingress"]
    [peer] = rule["from"]
    assert "ports" not in rule and set(peer) == {"podSelector"}
    assert [p for p, labels in pods.items() if _selects(peer["podSelector"], labels)] == ["engine"]


def test_internal_load_balancer_only_with_allowed_ranges() -> None:
    plain = _tinker()
    [cluster_ip] = service.api_services(plain)
    assert cluster_ip["spec"]["type"] == "ClusterIP" and "annotations" not in cluster_ip["metadata"]
    cidrs = ["10.128.0.0/20"]
    spec = _tinker(access={"internalLoadBalancer": True, "allowedCidrs": cidrs})
    cluster_ip, ilb = service.api_services(spec)
    assert cluster_ip == service.api_services(plain)[0]
    assert ilb["metadata"]["annotations"] == {"networking.gke.io/load-balancer-type": "Internal"}
    assert ilb["spec"]["type"] == "LoadBalancer" and ilb["spec"]["loadBalancerSourceRanges"] == cidrs
    assert ilb["spec"]["externalTrafficPolicy"] == "Local"  # the pods see the client's address the policy admits
    deployment = service.api_deployment(spec, _refs(spec))
    for svc in (cluster_ip, ilb):
        assert svc["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        [port] = svc["spec"]["ports"]
        assert port["port"] == service.API_PORT and port["targetPort"] == port["name"] == "http"
    # The config refuses a load balancer open to no one, and ranges without a load balancer.
    with pytest.raises(ConfigError, match="internalLoadBalancer needs access.allowedCidrs"):
        _tinker(access={"internalLoadBalancer": True})
    with pytest.raises(ConfigError, match="allowedCidrs admits clients through the internal load balancer"):
        _tinker(access={"allowedCidrs": cidrs})


# ---------------------------------------------------------------- the trainer is left alone


def _trainer_objects(plan: PlanResult) -> list[dict[str, Any]]:
    name = plan.spec.trainer.name
    return [o for o in kubernetes_objects(plan) if o["metadata"]["name"].startswith(name)]


def test_adding_the_service_leaves_the_trainers_objects_as_they_were() -> None:
    """Staging's trainer (multislice, DRANET, staging Job), with and without a service on its slice group."""
    config = stack_config("staging")
    plain = run_stack("staging", config)
    with_service = run_stack("staging", {**config, "gke-tpu-rl:service": {**SERVICE, "sliceGroup": "v6e-stg"}})
    before, after = _trainer_objects(plain), _trainer_objects(with_service)
    assert {"JobSet", "Job", "ResourceClaimTemplate"} <= {o["kind"] for o in before}
    assert after == before
    # ...and the service got its own claim template, on the same DRANET networks.
    claims = {o["metadata"]["name"]: o for o in kubernetes_objects(with_service)
              if o["kind"] == "ResourceClaimTemplate"}
    assert set(claims) == {"grpo-stg-netdev", "tinker-engine-netdev"}
    assert claims["grpo-stg-netdev"]["spec"] == claims["tinker-engine-netdev"]["spec"]
    engine = next(o for o in kubernetes_objects(with_service) if o["kind"] == "JobSet" and
                  o["metadata"]["name"] == "tinker-engine")
    assert _pod(engine)["resourceClaims"] == [{"name": "netdev", "resourceClaimTemplateName": "tinker-engine-netdev"}]
