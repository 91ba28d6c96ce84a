"""TrainerImage: builds trainer/Dockerfile and pushes it to the environment's registry; the JobSet runs it by digest."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_docker_build as docker_build
import pulumi_gcp as gcp

from envspec.config import EnvironmentSpec
from infra.base import user_code

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "trainer" / "Dockerfile"
# trainer/Dockerfile copies the environment's trainer.code from this named build context; without trainer.code it is
# this empty stand-in (a folder holding only its README).
USER_CODE_CONTEXT = "user-code"
NO_USER_CODE = ROOT / "trainer" / "no_user_code"
USER_CODE_DIGEST_ARG = "USER_CODE_DIGEST"
# TPU VMs are x86_64; a build on an arm64 laptop needs BuildKit's emulation for this platform.
PLATFORM = docker_build.Platform.LINUX_AMD64
# Artifact Registry takes a short-lived OAuth token with this user name (no JSON keys).
TOKEN_USER = "oauth2accesstoken"


@dataclass(frozen=True)
class TrainerImageArgs:
    spec: EnvironmentSpec
    repository: gcp.artifactregistry.Repository


# Pulumi runs the program with the `main` folder of Pulumi.yaml as its working directory (engine getPwdMain: a
# directory main becomes the pwd), here infra/ (this file's package's parent); the provider resolves the build's paths
# against it.
PROGRAM_DIR = ROOT / "infra"


def _rel(path: Path) -> str:
    # Relative to that folder, not to wherever `plan` is run: the same paths on any machine and from any folder, so
    # `plan --diff` compares like with like.
    return os.path.relpath(path, PROGRAM_DIR)


class TrainerImage(pulumi.ComponentResource):
    image: docker_build.Image
    ref: pulumi.Output[str]  # <registry>/<repo>/trainer@sha256:...: what the JobSet runs

    def __init__(self, name: str, args: TrainerImageArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("gke-tpu-rl:infra:TrainerImage", name, None, opts)
        spec = args.spec
        repo = spec.trainer_image_repository
        code = user_code.folder(spec)
        token = gcp.organizations.get_client_config_output().access_token
        self.image = docker_build.Image(
            f"{name}-trainer",
            # .dockerignore keeps the main context to trainer/ and envspec/; trainer.code comes as the named context
            # user-code.
            context=docker_build.BuildContextArgs(location=_rel(ROOT), named={
                USER_CODE_CONTEXT: docker_build.ContextArgs(location=_rel(code or NO_USER_CODE))}),
            # The provider's context hash misses the named context's files (infra/base/user_code.py): their digest
            # does not.
            build_args={USER_CODE_DIGEST_ARG: user_code.digest(code or NO_USER_CODE)},
            dockerfile=docker_build.DockerfileArgs(location=_rel(DOCKERFILE)),
            platforms=[PLATFORM],
            tags=[f"{repo}:{spec.trainer.image_tag}"],
            push=True,
            # Previews (every pull request) do not need a TPU image built; `pulumi up` builds when the context
            # hash changes, i.e. when pyproject.toml, README.md, envspec/ or trainer/ changed.
            build_on_preview=False,
            # Layers of the last pushed image are reused, so a code-only change rebuilds the last layers only.
            cache_from=[docker_build.CacheFromArgs(registry=docker_build.CacheFromRegistryArgs(
                ref=f"{repo}:{spec.trainer.image_tag}"))],
            cache_to=[docker_build.CacheToArgs(inline=docker_build.CacheToInlineArgs())],
            registries=[docker_build.RegistryArgs(
                address=spec.registry_host, username=TOKEN_USER, password=pulumi.Output.secret(token))],
            labels={"org.opencontainers.image.title": "gke-tpu-rl-trainer",
                    "org.opencontainers.image.source": "trainer/Dockerfile"},
            opts=pulumi.ResourceOptions(parent=self, depends_on=[args.repository]),
        )
        # By digest: a new build changes the JobSet, and a moved tag never swaps the code under a running job.
        self.ref = pulumi.Output.concat(repo, "@", self.image.digest)
        self.register_outputs({"ref": self.ref})
