"""`gke-tpu-rl fit --config YAML --tpu TYPE:TOPOLOGY`: a trainer YAML alone on slices from the catalog, as the CLI
takes it. An environment's own trainer (`fit ENV`) is infra/base/pod_config.py env_job."""

from __future__ import annotations

from envspec import tpu
from envspec.config import ConfigError
from infra.base import pod_config
from workloads.trainer_pod import job_mesh


def parse_tpu(value: str) -> tpu.SliceShape:
    """`--tpu TYPE:TOPOLOGY` (v6e:4x4, v5p:4x4x4, trillium:2x2) -> a catalog slice shape; errors name the flag."""
    kind, sep, topology = value.partition(":")
    if not sep or not kind or not topology:
        raise ConfigError(f"--tpu {value!r}: expected TYPE:TOPOLOGY such as v6e:4x4; types: "
                          f"{', '.join(sorted(tpu.GENERATIONS))}")
    try:
        return tpu.slice_shape(kind, topology)
    except ValueError as err:
        raise ConfigError(f"--tpu {value!r}: {err}") from None


def file_job(config: str, tpu_value: str, slices: int, overrides: list[str] | None = None) -> pod_config.FitJob:
    """A trainer YAML alone on `slices` x `--tpu`, with the mesh overrides a JobSet of that many slices passes first
    (workloads/trainer_pod.py job_mesh: none for placement.mode=split, whose mesh and placement.sampler say how the
    slices divide)."""
    if slices < 1:
        raise ConfigError(f"--slices {slices}: must be 1 or more")
    shape = parse_tpu(tpu_value)
    cfg = pod_config.trainer_config(config, list(overrides or []))
    if mesh := job_mesh(slices, cfg.placement.mode == "split"):
        cfg = pod_config.trainer_config(config, [*mesh, *(overrides or [])])
    title = f"{config} on {slices} x {shape.generation.name} {shape.topology}"
    return pod_config.FitJob(title, cfg, pod_config.target(shape, slices))

