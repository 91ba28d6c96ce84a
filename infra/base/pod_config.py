"""The trainer config as the JobSet's pod loads it (or, in an environment with a service and no trainer, the service
engine's config), and the slice it runs on from the catalog: what the pre-flight checks read (the grace period, the
staging targets, trainer.code's references) and what `gke-tpu-rl fit ENV` compiles.

No JAX here: the compilation itself is trainer/fit/preflight.py, imported only when a fit runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from envspec import tpu
from envspec.config import ConfigError, EnvironmentSpec
from envspec.sections.trainer import HF_REPO
from infra.base import user_code

if TYPE_CHECKING:
    from trainer.base.config import TrainConfig
    from trainer.fit.preflight import Target


@dataclass(frozen=True)
class FitJob:
    """What a fit compiles: the trainer config on its compile target, under a title for the report."""

    title: str
    cfg: TrainConfig
    target: Target


def target(shape: tpu.SliceShape, slices: int) -> Target:
    """The trainer's compile target for `slices` slices of `shape`, every figure from the TPU catalog (a seam the
    tests replace to shrink a chip's HBM)."""
    from trainer.fit.preflight import Target

    return Target.of(shape, slices)


def trainer_config(config: str | None, overrides: list[str]) -> TrainConfig:
    """A trainer config file with overrides, its errors as the stack's (naming the file)."""
    from trainer.base.config import ConfigError as TrainerConfigError
    from trainer.base.config import load_config

    try:
        return load_config(config, overrides)
    except TrainerConfigError as err:
        raise ConfigError(f"trainer config {config or '(embedded demo)'}: {err}") from None


def env_job(spec: EnvironmentSpec, config: str | None = None, overrides: list[str] | None = None) -> FitJob:
    """The environment's trainer: its slice group, and its config loaded from the very arguments the JobSet gives
    the pod (workloads.jobset.trainer_args, parsed by the trainer's own parser), then `overrides`."""
    from trainer.run.cli import build_parser
    from workloads.jobset import trainer_args

    t = spec.trainer
    group = spec.trainer_group
    if not t.enabled and spec.service is not None:
        return service_job(spec, config, overrides)  # a service environment: its engine is what runs on the TPUs
    if not t.enabled or group is None:
        raise ConfigError(f"environment {spec.env!r}: trainer.enabled is false and there is no service; there is "
                          "no trainer to fit")
    split = placement_split(spec, config)
    pod, unknown = build_parser().parse_known_args(trainer_args(spec, split))
    if unknown:
        raise ConfigError(f"environment {spec.env!r}: trainer.args has arguments the trainer does not take: {unknown}")
    name = config or user_code.local_config(spec, pod.config)
    slices, resized = t.slices, []
    if t.launcher == "ray":
        # Ray keeps the global batch when it loses slices, so the fewest slices it may go on with hold the most per
        # chip: that is the size that must fit.
        slices, resized = spec.ray_min_slices, [f"mesh.slices={spec.ray_min_slices}"]
    cfg = trainer_config(name, [*pod.overrides, *resized, *(overrides or [])])
    at = f", at Ray's minimum of {slices} slice{'s' if slices > 1 else ''}" if resized else ""
    title = f"{spec.env} (trainer {t.name}, config {config or t.config or 'demo.yaml'}{at})"
    return FitJob(title, cfg, target(group.shape, slices))


def placement_split(spec: EnvironmentSpec, config: str | None = None) -> bool:
    """Whether the environment's trainer config with trainer.args (`config` in place of trainer.config) places
    sampling apart (placement.mode: split): its pods then get no job mesh (workloads/trainer_pod.py job_mesh, which
    can change neither). False without a trainer."""
    from trainer.run.cli import build_parser
    from workloads.trainer_pod import config_args

    t = spec.trainer
    if not t.enabled or spec.trainer_group is None:
        return False
    own, _ = build_parser().parse_known_args([*config_args(spec), *t.args])  # env_job reports unknown arguments
    return trainer_config(config or user_code.local_config(spec, own.config), own.overrides).placement.mode == "split"


def service_job(spec: EnvironmentSpec, config: str | None = None, overrides: list[str] | None = None) -> FitJob:
    """The environment's service engine: one slice of the service's slice group, and its config loaded from the very
    arguments the engine JobSet gives the pod (workloads.service.engine_args: service.config, the weights' place on
    the bucket, a mesh over the one slice, then service.args), parsed by the service CLI's own `engine` parser, then
    `overrides`; `config` replaces service.config. The estimators size a config with a service section as the
    engine's programs (trainer/fit/preflight.py fit_service)."""
    from infra.base.engine_config import engine_args
    from trainer.service.cli import build_parser

    svc, group = spec.service, spec.service_group
    if svc is None or group is None:
        raise ConfigError(f"environment {spec.env!r}: no service to fit")
    engine, unknown = build_parser().parse_known_args(["engine", *engine_args(spec)])
    if unknown:
        raise ConfigError(f"environment {spec.env!r}: service.args has arguments the engine does not take: {unknown}")
    name = config or engine.config
    cfg = trainer_config(name, [*engine.overrides, *(overrides or [])])
    if cfg.service is None:
        raise ConfigError(f"--config {name}: no service section; the service's engine needs a service config "
                          "(e.g. trainer/configs/qwen3-8b-service-v6e-4x4.yaml)")
    title = f"{spec.env} (service {svc.name} engine on {group.name}, config {name})"
    return FitJob(title, cfg, target(group.shape, 1))  # one slice: the engine JobSet has one replica


@dataclass(frozen=True)
class HubSplits:
    """A Hugging Face dataset the trainer config's dataset task names (task.hub), for the staging Job to put in the
    folder the task reads (task.path)."""

    repo: str
    config: str | None
    revision: str | None
    path: str


def hub_splits(spec: EnvironmentSpec) -> HubSplits | None:
    """The dataset the environment's trainer config names for staging (task: {name: dataset, hub: ...}), or None.
    Raises ConfigError for a key of the wrong type, a bad filter or prompt template (the trainer's preflight checks
    the rest against the data)."""
    if not spec.trainer.enabled or spec.trainer_group is None:
        return None
    task = env_job(spec).cfg.task
    extra = task.model_extra or {}
    if task.name != "dataset":
        return None
    # What can be told without the data (which is in the bucket, or not staged yet): the filter and the template.
    from trainer.base.config import ConfigError as TrainerConfigError
    from trainer.rl.dataset_files import parse_filter, template_fields

    try:
        parse_filter(extra.get("filter"))
        if isinstance(extra.get("prompt_template"), str):
            template_fields(extra["prompt_template"])
    except TrainerConfigError as err:
        raise ConfigError(f"trainer config {err}") from None
    if extra.get("hub") is None:
        return None
    for key in ("hub", "path", "hub_config", "hub_revision"):
        value = extra.get(key)
        if (value is not None or key in ("hub", "path")) and not (isinstance(value, str) and value):
            raise ConfigError(f"trainer config task.{key}: expected a non-empty string, got {value!r}")
    if not HF_REPO.match(extra["hub"]):
        raise ConfigError(f"trainer config task.hub: {extra['hub']!r} is not a Hugging Face dataset repo id like "
                          "ORG/NAME")
    return HubSplits(extra["hub"], extra.get("hub_config"), extra.get("hub_revision"), extra["path"])
