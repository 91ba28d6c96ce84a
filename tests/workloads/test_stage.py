"""The staging Job (trainer.stage): what it runs, where, as whom, and how the stack orders it before the trainer."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from envspec.config import ConfigError, EnvironmentSpec, parse_spec
from infra.checks import system_pool
from infra.components.trainer_job import stage_targets
from infra.offline.mockrun import run_stack
from tests import k8s_schemas
from tests.infra.conftest import stack_config
from tests.infra.test_config import _raw
from trainer.base.config import bundled_configs
from workloads import labels as L
from workloads import stage, trainer_pod


def _spec(env: str, **trainer: Any) -> EnvironmentSpec:
    raw = copy.deepcopy(_raw(env))
    raw["trainer"] = {**raw["trainer"], **trainer}
    return parse_spec(raw, env, bundled_configs())


def _job(spec: EnvironmentSpec) -> dict[str, Any]:
    refs = trainer_pod.TrainerRefs(image="registry/trainer@sha256:" + "0" * 64, bucket=spec.bucket_name,
                                   service_account=spec.trainer.service_account, hf_secret="hf")
    targets = stage_targets(spec)
    assert targets is not None
    return stage.stage_job(spec, refs, targets)


@pytest.mark.parametrize("env", ["dev", "staging", "prod"])
def test_stage_job_fetches_what_the_trainer_config_reads(env: str) -> None:
    spec = parse_spec(_raw(env), env, bundled_configs())
    job = _job(spec)
    k8s_schemas.need_schemas()
    k8s_schemas.assert_valid(job)
    [container] = job["spec"]["template"]["spec"]["containers"]
    cmd = container["command"]
    assert cmd[:3] == ["python", "-m", "trainer.stage"]
    # Into the trainer config's own init.path and task.path, on the bucket's mount.
    from infra.base.pod_config import env_job

    cfg = env_job(spec).cfg
    assert cmd[cmd.index("--model-to") + 1] == cfg.init.path
    assert cmd[cmd.index("--dataset-to") + 1] == cfg.task.path
    assert cmd[cmd.index("--model") + 1] == spec.trainer.stage.model  # type: ignore[union-attr]
    # The stage module's own parser takes the command the Job runs.
    from trainer.stage import build_parser

    build_parser().parse_args(cmd[3:])


def test_stage_job_runs_on_the_system_pool_as_the_trainer_with_the_bucket_writable() -> None:
    spec = parse_spec(_raw("prod"), "prod", bundled_configs())
    job = _job(spec)
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == dict(L.SYSTEM_POOL) and "tolerations" not in pod
    assert pod["serviceAccountName"] == spec.trainer.service_account  # the bucket's one objectUser grant
    assert pod["automountServiceAccountToken"] is False and pod["restartPolicy"] == "Never"
    [volume] = [v for v in pod["volumes"] if v["name"] == "checkpoints"]
    assert volume["csi"]["volumeAttributes"]["bucketName"] == spec.bucket_name and "readOnly" not in volume["csi"]
    assert job["spec"]["template"]["metadata"]["annotations"][L.GCSFUSE_INJECT] == "true"
    [container] = pod["containers"]
    assert {e["name"] for e in container["env"]} == {"HF_TOKEN", "HF_HOME"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # A wrong repo or token (exit 2) fails at once; transient failures (42) and signals are retried.
    [rule] = job["spec"]["podFailurePolicy"]["rules"]
    assert rule == {"action": "FailJob", "onExitCodes": {"containerName": "stage", "operator": "In", "values": [2]}}
    from trainer.run.cli import EXIT_CONFIG  # the code trainer.stage exits with for what a retry cannot fix

    assert stage.EXIT_CONFIG == EXIT_CONFIG
    # Not Kueue's to admit: no queue label, so it does not wait behind the TPU workloads.
    assert L.KUEUE_QUEUE not in job["metadata"]["labels"]


def test_the_trainer_is_created_after_staging_completes() -> None:
    """pulumi-kubernetes awaits a batch/v1 Job until Complete (provider/pkg/await/job.go) within the create timeout;
    the trainer depends on it, so it is created only once the weights and data are in the bucket."""
    plan = run_stack("staging", stack_config("staging"))
    [job] = plan.of_type("kubernetes:batch/v1:Job")
    [jobset] = plan.of_type("kubernetes:jobset.x-k8s.io/v1alpha2:JobSet")
    assert job.urn in jobset.options["dependsOn"]
    assert job.options["customTimeouts"] == {"create": "180m"} and job.options["deleteBeforeReplace"] is True


def test_staging_needs_the_bucket_paths_in_the_trainer_config() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.stage\.model: the trainer config must read a Hugging Face"):
        stage_targets(_spec("dev", config=None, stage={"model": "Qwen/Qwen3-0.6B"}))  # the demo: random init
    with pytest.raises(ConfigError, match=r"trainer\.stage\.dataset: the trainer config's task must read"):
        stage_targets(_spec("dev", config=None, stage={"dataset": "openai/gsm8k", "datasetFile": "x.parquet"}))
    with pytest.raises(ConfigError, match="stage.dataset and stage.datasetFile go together"):
        _spec("dev", stage={"dataset": "openai/gsm8k"})
    assert stage_targets(_spec("dev", stage=None)) is None


def test_the_system_pool_holds_the_staging_pod() -> None:
    names = [p.name for p in system_pool.pinned_pods(parse_spec(_raw("dev"), "dev", bundled_configs()))]
    assert "staging Job" in names
    assert "staging Job" not in [p.name for p in system_pool.pinned_pods(_spec("dev", stage=None))]


HUB_TASK = ["--set", "task.name=dataset", "--set", "task.path=/checkpoints/data/qa", "--set", "task.hub=test-org/qa",
            "--set", "task.hub_config=main", "--set", "task.prompt_field=question"]


def test_a_dataset_the_trainer_config_names_is_staged_into_its_task_path() -> None:
    """task: {name: dataset, hub: ...} in the trainer config (here through trainer.args) asks for the staging Job even
    without trainer.stage; the Job's command, which the stage module's own parser takes, fetches it into task.path."""
    spec = _spec("dev", stage=None, args=HUB_TASK)
    job = _job(spec)
    [container] = job["spec"]["template"]["spec"]["containers"]
    cmd = container["command"]
    assert cmd[3:] == ["--hub-dataset", "test-org/qa", "--hub-config", "main", "--splits-to", "/checkpoints/data/qa"]
    from trainer.stage import build_parser

    args = build_parser().parse_args(cmd[3:])
    assert (args.hub_dataset, args.hub_config, args.hub_revision) == ("test-org/qa", "main", None)
    assert "staging Job" in [p.name for p in system_pool.pinned_pods(spec)]
    # With the model staged too, one Job does both; a pinned revision is passed on.
    spec = _spec("dev", stage={"model": "Qwen/Qwen3-0.6B"}, args=[*HUB_TASK, "--set", "task.hub_revision=abc123"])
    cmd = _job(spec)["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--model-to") + 1] == "/checkpoints/models/Qwen3-0.6B"
    assert cmd[cmd.index("--hub-revision") + 1] == "abc123" and "--dataset" not in cmd
    config = stack_config("dev")
    trainer = config["gke-tpu-rl:trainer"]
    trainer.pop("stage")
    trainer["args"] = [*trainer.get("args", []), *HUB_TASK]
    plan = run_stack("dev", config)
    [job] = plan.of_type("kubernetes:batch/v1:Job")
    assert job.options["customTimeouts"] == {"create": "180m"}


def test_a_named_dataset_needs_a_folder_on_the_bucket_and_one_source() -> None:
    with pytest.raises(ConfigError, match=r"^trainer config task\.path: the dataset task names task\.hub 'test-org/qa'"
                                          r", .* a folder under /checkpoints/; it has '/data/qa'"):
        stage_targets(_spec("dev", stage=None, args=[*HUB_TASK, "--set", "task.path=/data/qa"]))
    with pytest.raises(ConfigError, match=r"trainer\.stage\.dataset: the trainer config's task names its own dataset"):
        stage_targets(_spec("dev", args=HUB_TASK))  # dev stages openai/gsm8k into task.path as well
    with pytest.raises(ConfigError, match=r"^trainer config task\.hub: 'qa' is not a Hugging Face dataset repo id"):
        stage_targets(_spec("dev", stage=None, args=[*HUB_TASK, "--set", "task.hub=qa"]))
    # The plan refuses what can be told without the data: the filter and the prompt template.
    with pytest.raises(ConfigError, match=r"^trainer config task\.filter\[0\]: unknown operator 'eq'; give exactly "
                                          r"one of equals, not_equals, in, not_in, regex$"):
        stage_targets(_spec("dev", stage=None, args=[*HUB_TASK, "--set", "task.filter={field: level, eq: 1}"]))
    with pytest.raises(ConfigError, match=r"^trainer config task\.prompt_template: \{q!r\} is not a plain field"):
        stage_targets(_spec("dev", stage=None, args=[*HUB_TASK, "--set", "task.prompt_template='Q {q!r}'"]))
