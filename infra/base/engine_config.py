"""The post-training service engine's trainer config as its pods load it, and what the service's objects read from it
(workloads/service.py EngineFacts). The config is the trainer's (trainer/base/config.py), so it is read here, with the
very arguments workloads/service.py gives the engine's pods, and handed down: workloads/ never imports the trainer.

On infra/'s bottom floor (imports nothing of infra/): the service component (infra/components/service.py) and the
pod's trainer config for `gke-tpu-rl fit` (infra/base/pod_config.py) both read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from envspec.config import NAMESPACE, ConfigError, EnvironmentSpec
from workloads import service

if TYPE_CHECKING:
    from trainer.base.config import TrainConfig


def _service_config(spec: EnvironmentSpec) -> str:
    assert spec.service is not None  # callers read these only for an environment with a service
    return spec.service.config


def base_model(spec: EnvironmentSpec) -> str:
    """service.base_model of the engine's config, with service.args' overrides: what the API serves and the staging
    Job fetches. Raises ConfigError naming the key when the config does not load."""
    from trainer.base.config import ConfigError as TrainerConfigError
    from trainer.base.config import load_config

    config = _service_config(spec)
    try:
        cfg = load_config(config, service.user_overrides(spec))
    except TrainerConfigError as e:
        raise ConfigError(f"{NAMESPACE}:service.args: the engine config {config} with them does not load: "
                          f"{e}") from None
    assert cfg.service is not None  # service.config is validated to be a bundled config with a service section
    return cfg.service.base_model


def engine_args(spec: EnvironmentSpec) -> list[str]:
    """The arguments the engine's pods get after `python -m trainer.service engine` (workloads/service.py
    engine_args, for the config's base model)."""
    return service.engine_args(spec, base_model(spec))


def engine_config(spec: EnvironmentSpec) -> TrainConfig:
    """The engine's TrainConfig as its pods load it (every `--set` of engine_args, in order). Raises ConfigError."""
    return _engine_config(spec, base_model(spec))


def _engine_config(spec: EnvironmentSpec, base: str) -> TrainConfig:
    from trainer.base.config import ConfigError as TrainerConfigError
    from trainer.base.config import load_config

    config = _service_config(spec)
    try:
        return load_config(config, service.engine_overrides(service.engine_args(spec, base)))
    except TrainerConfigError as e:
        raise ConfigError(f"{NAMESPACE}:service.args: the engine config {config} as its pods load it does not "
                          f"load: {e}") from None


def engine_facts(spec: EnvironmentSpec) -> service.EngineFacts:
    """What the service's objects read from the engine's config (ServiceRefs.engine). Raises ConfigError."""
    base = base_model(spec)
    cfg = _engine_config(spec, base)
    assert cfg.service is not None  # service.config is validated to be a bundled config with a service section
    return service.EngineFacts(base_model=base, storage_dir=cfg.service.storage_dir)
