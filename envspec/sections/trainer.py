"""The `trainer` section: the training job (a JobSet, or an elastic RayJob) and what a Job stages into the bucket
before it starts."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from envspec import repo, rules
from envspec.sections.fields import _bundled, _Model

# A Hugging Face repo id, ORG/NAME (also what infra/base/pod_config.py checks task.hub against).
HF_REPO = re.compile(r"^[A-Za-z0-9][-\w.]{0,95}/[-\w.]{1,96}$")


class StageSpec(_Model):
    """What a Job stages into the bucket before the trainer starts (python -m trainer.stage, workloads/stage.py):
    the Hugging Face model behind the trainer config's init.path and the dataset file behind its task.path."""

    model: str | None = Field(None, description="Hugging Face model repo (ORG/NAME) downloaded into the trainer "
                              "config's init.path, e.g. Qwen/Qwen3-0.6B; gated repos need gke-tpu-rl:hfToken")
    revision: str | None = Field(None, description="branch, tag or commit of the model repo; its default branch "
                                 "when unset")
    dataset: str | None = Field(None, description="Hugging Face dataset repo (ORG/NAME) one file of which becomes the "
                                "trainer config's task.path, e.g. openai/gsm8k")
    dataset_file: str | None = Field(None, description="that file's path in the dataset repo (.parquet or .jsonl), "
                                     "e.g. main/train-00000-of-00001.parquet")
    timeout_minutes: int = Field(180, ge=5, le=1440, description="how long `pulumi up` waits for the staging Job "
                                 "before it gives up (a 70B model is about 140 GB)")

    @field_validator("model", "dataset")
    @classmethod
    def _repo(cls, v: str | None) -> str | None:
        if v is not None and not HF_REPO.match(v):
            raise ValueError(f"{v!r} is not a Hugging Face repo id like ORG/NAME")
        return v

    @model_validator(mode="after")
    def _pairs(self) -> StageSpec:
        if (self.dataset is None) != (self.dataset_file is None):
            raise ValueError("stage.dataset and stage.datasetFile go together")
        if self.revision is not None and self.model is None:
            raise ValueError("stage.revision needs stage.model")
        if self.model is None and self.dataset is None:
            raise ValueError("stage: set model, or dataset with datasetFile, or leave stage out")
        return self


class TrainerSpec(_Model):
    enabled: bool = Field(True, description="deploy the training job; false: the environment without one")
    name: str = Field("grpo", description="name of the JobSet or RayJob")
    image: str | None = Field(None, description="a prebuilt trainer image; when unset the stack builds "
                              "trainer/Dockerfile, pushes it to the environment's registry and runs it by digest")
    image_tag: str = Field("latest", description="the tag the stack's build pushes (the JobSet uses the digest)")
    config: str | None = Field(None, description="the trainer YAML, passed to the pod as --config: a file name "
                               "under trainer/configs/, or with trainer.code a path inside that folder; the trainer's "
                               "embedded demo config when unset")
    code: str | None = Field(None, description="a folder of this repository (relative to Pulumi.yaml) with your own "
                             "tasks and rewards: a Python project (pyproject.toml) or a folder of modules, built into "
                             "the trainer image; the trainer config names them as MODULE:NAME (docs/own-tasks.md)")
    args: list[str] = Field(default_factory=list, description="arguments appended to the trainer's command line, "
                            "e.g. [\"--set\", \"steps=200\"]")
    slice_group: str | None = Field(None, description="which slice group runs the trainer; the first when unset")
    slices: int = Field(1, ge=1, description="slices of the trainer's group the job runs on, at most the group's "
                        "count; with launcher 'ray', the most it grows to")
    max_restarts: int = Field(3, ge=0, le=100, description="restarts of the whole job before it fails: the JobSet's "
                              "failurePolicy.maxRestarts, or the RayJob's backoffLimit")
    priority: str = Field("default", description="the job's Kueue priority class, a key of queues.priorityClasses")
    termination_grace_seconds: int = Field(600, ge=30, le=3600, description="the trainer pods' termination grace "
                                           "period, the time for the SIGTERM checkpoint; on the JobSet launcher it "
                                           "is refused when below an estimate of that checkpoint's time")
    service_account: str = Field("trainer", description="the trainer's Kubernetes service account, granted the "
                                 "checkpoint bucket through workload identity")
    launcher: Literal["jobset", "ray"] = Field(
        "jobset", description="'jobset': a JobSet restarts every slice from the last checkpoint on any failure; "
        "'ray': a Kueue-queued elastic RayJob whose Ray Train JaxTrainer goes on with the slices left when one is "
        "lost (down to minSlices) and grows back when capacity returns")
    min_slices: int | None = Field(
        None, ge=1, description="launcher 'ray' only: the fewest slices training goes on with (1 when unset); "
        "`slices` is the most")
    max_failures: int = Field(3, ge=0, le=100, description="launcher 'ray' only: Ray Train's FailureConfig, "
                              "worker-group restarts before the run fails")
    stage: StageSpec | None = Field(None, description="stage the model weights and the dataset into the bucket with "
                                    "a Job before the trainer is created (the trainer's pods read them from there)")

    @property
    def config_in_code(self) -> bool:
        """trainer.config names a file inside trainer.code (which wins over a bundled config of the same name)."""
        v = self.config
        return (v is not None and self.code is not None and repo.within_repo(v)
                and (repo.REPO_ROOT / self.code / v).is_file())

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        # The JobSet's or RayJob's name (length checked against the slice count and launcher below).
        if not rules.DNS1035_LABEL.match(v):
            raise ValueError(f"{v!r} is not a JobSet or RayJob name: a-z, 0-9 and '-', starting with a letter")
        return v

    @field_validator("service_account")
    @classmethod
    def _service_account(cls, v: str) -> str:
        return rules.dns_label(v, what="a Kubernetes service account name (DNS-1123 label)")

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        return None if v is None else rules.image_reference(v)

    @field_validator("image_tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        return rules.image_tag(v)

    @field_validator("code")
    @classmethod
    def _code(cls, v: str | None) -> str | None:
        if v is None:
            return None
        repo.repo_folder(v)
        if not (repo.REPO_ROOT / v).is_dir():
            raise ValueError(f"{v!r} is not a folder of this repository ({repo.REPO_ROOT})")
        return v

    @model_validator(mode="after")
    def _code_in_built_image(self) -> TrainerSpec:
        if self.code is not None and self.image is not None:
            raise ValueError("trainer.code is built into the image the stack builds; with trainer.image (a prebuilt "
                             "image) set, install your code in that image and unset trainer.code, or unset "
                             "trainer.image")
        return self

    @model_validator(mode="after")
    def _config(self, info: ValidationInfo) -> TrainerSpec:
        # The image holds the trainer package and trainer.code, so the pod can only name a config in one of them.
        v = self.config
        if v is None or self.config_in_code:
            return self
        bundled = _bundled(info).runs  # a service config is not a run: the trainer refuses it
        if "/" not in v and v in bundled:
            return self
        inside = f", or a file inside trainer.code ({self.code})" if self.code else ""
        raise ValueError(f"trainer.config: {v!r} is not a trainer config under trainer/configs/{inside}; allowed: "
                         f"{', '.join(bundled)}")
