"""The stack builds the trainer image and the JobSet runs exactly what it pushed, by digest."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from infra.components import image as image_module
from infra.offline.mockrun import SECRET_MASK, PlanResult, run_stack
from tests.infra.conftest import raw_inputs, stack_config

IMAGE = "docker-build:index:Image"
JOBSET = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
RAYJOB = "kubernetes:ray.io/v1:RayJob"
ROOT = Path(__file__).resolve().parents[2]


def _jobset_image(plan: PlanResult) -> str:
    """The one image every trainer pod runs: the JobSet's, or the RayJob's head and TPU workers."""
    from tests.k8s_schemas import embedded_pod_templates

    images = {c["image"] for r in plan.of_type(JOBSET) + plan.of_type(RAYJOB)
              for _, t in embedded_pod_templates(r.inputs) for c in t["spec"]["containers"]}
    [image] = images
    return image


def test_stack_builds_and_pushes_the_trainer_image(plans: dict[str, PlanResult]) -> None:
    for env, plan in plans.items():
        [image] = plan.of_type(IMAGE)
        repo = f"{plan.spec.region}-docker.pkg.dev/acme-rl-{env}/rl-{env}/trainer"
        # Relative to infra/, where Pulumi runs the program: the repository root (its .dockerignore keeps trainer/),
        # and trainer.code's stand-in (test_user_code.py).
        assert image.inputs["dockerfile"] == {"location": "../trainer/Dockerfile"}
        assert image.inputs["context"] == {"location": "..",
                                           "named": {"user-code": {"location": "../trainer/no_user_code"}}}
        assert image.inputs["platforms"] == ["linux/amd64"]  # TPU hosts are x86_64
        assert image.inputs["push"] is True and image.inputs["tags"] == [f"{repo}:latest"]
        [registry] = image.inputs["registries"]
        assert registry["password"] == SECRET_MASK  # the token never reaches the plan or the state in clear
        # The push waits for the repository it pushes to.
        [repository] = plan.of_type("gcp:artifactregistry/repository:Repository")
        assert repository.urn in image.options["dependsOn"]
        assert re.fullmatch(re.escape(repo) + r"@sha256:[0-9a-f]{64}", _jobset_image(plan)), env
        assert plan.outputs["trainerImage"] == _jobset_image(plan)


def test_push_authenticates_with_a_short_lived_token() -> None:
    [image] = raw_inputs("staging", stack_config("staging"), IMAGE)
    # The deployer's own OAuth token (gcp getClientConfig), as Artifact Registry's docs log in: no key file.
    assert image["registries"] == [
        {"address": "us-east5-docker.pkg.dev", "username": "oauth2accesstoken", "password": "mock-access-token"}]


def test_jobset_follows_the_built_digest_not_a_tag() -> None:
    # Anything that changes the build changes its digest output, and the JobSet follows it.
    base = run_stack("dev", stack_config("dev"))
    trainer = {**stack_config("dev")["gke-tpu-rl:trainer"], "imageTag": "v2"}
    rebuilt = run_stack("dev", {**stack_config("dev"), "gke-tpu-rl:trainer": trainer})
    [image] = rebuilt.of_type(IMAGE)
    assert image.inputs["tags"] == ["us-east5-docker.pkg.dev/acme-rl-dev/rl-dev/trainer:v2"]
    assert _jobset_image(rebuilt) != _jobset_image(base)
    assert ":v2" not in _jobset_image(rebuilt) and ":latest" not in _jobset_image(base)


def test_a_prebuilt_image_skips_the_build() -> None:
    prebuilt = "europe-docker.pkg.dev/other/images/trainer@sha256:" + "ab" * 32
    trainer = {**stack_config("dev")["gke-tpu-rl:trainer"], "image": prebuilt}
    plan = run_stack("dev", {**stack_config("dev"), "gke-tpu-rl:trainer": trainer})
    assert not plan.of_type(IMAGE)
    assert _jobset_image(plan) == prebuilt and plan.outputs["trainerImage"] == prebuilt


def test_build_paths_are_relative_to_the_folder_pulumi_runs_the_program_in(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Pulumi's engine (getPwdMain) makes a directory `main` the program's working directory, and the provider
    # resolves the build's paths against it: infra/ is where the image component lives.
    main = yaml.safe_load((ROOT / "Pulumi.yaml").read_text())["main"]
    assert (ROOT / main).resolve() == image_module.PROGRAM_DIR
    # So the paths do not depend on where `plan` runs (a diff against another revision compares like with like).
    monkeypatch.chdir(tmp_path)
    [image] = run_stack("staging", stack_config("staging")).of_type(IMAGE)
    assert image.inputs["context"]["location"] == ".."
    dockerfile = os.path.normpath(ROOT / main / image.inputs["dockerfile"]["location"])
    assert dockerfile == str(ROOT / "trainer" / "Dockerfile")
