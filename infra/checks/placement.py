"""Where the trainer samples and where it updates (placement, issue 43): the trainer config's split checked against
the chips of trainer.slices, by the trainer's own rule (trainer/base/placement.py), before anything is registered;
and the one line `plan` shows for it.

The split lives in the trainer config (trainer.config, or trainer.args `--set placement.mode=split ...`): every pod
of the one JobSet (or RayJob) runs the same `python -m trainer`, which assigns its devices itself. A pod is one host,
one process; a job of several processes splits within each host or by slice (docs/async-rl.md, "Multi-process"), and
a split the trainer cannot run there (groups of unequal size, a training group on one host beside others) is refused
here as the trainer would refuse it after the slices were bought.
"""

from __future__ import annotations

from dataclasses import dataclass

from envspec.config import NAMESPACE, ConfigError, EnvironmentSpec
from infra.base.pod_config import env_job


@dataclass(frozen=True)
class Placement:
    """The trainer's placement on its job, resolved: each group's mesh as slices x fsdp x tensor."""

    mode: str  # colocated | split
    mesh: tuple[int, int, int]  # the update's
    sampler: tuple[int, int, int] | None  # split: the sampler's
    lag: int
    correction: str  # rl.lag_correction
    chips: int  # of the job (at trainer.slices)
    hosts: int  # processes of the job
    by_host: bool = False  # each host holds devices of one group only (by slice on multislice), not of both

    @staticmethod
    def _axes(axes: tuple[int, int, int]) -> str:
        return "x".join(map(str, axes))

    def line(self) -> str | None:
        """How the trainer places sampling and the update, in words; None for the default (colocated, lag 0)."""
        lag = f"lag {self.lag}, {self.correction}"
        if self.sampler is None:
            return None if self.lag == 0 else f"sampling and the update on the same chips (colocated), {lag}"
        n_s, n_m = self.sampler[0] * self.sampler[1] * self.sampler[2], self.mesh[0] * self.mesh[1] * self.mesh[2]
        if self.by_host:
            h_s = self.hosts * n_s // self.chips
            where = f"{h_s} host{'s' if h_s > 1 else ''} ({n_s} chips)"
            rest = f"the other {self.hosts - h_s} host{'s' if self.hosts - h_s > 1 else ''} ({n_m} chips)"
        elif self.hosts > 1:  # within each host
            where = f"{n_s // self.hosts} of each host's {self.chips // self.hosts} chips"
            rest = f"the other {n_m // self.hosts}" if n_s + n_m == self.chips else f"{n_m // self.hosts}"
        else:
            where = f"{n_s} of the {self.chips} chips"
            rest = f"the other {n_m}" if n_s + n_m == self.chips else f"{n_m} others"
        return (f"sampling on {where} (mesh {self._axes(self.sampler)}), training on {rest} "
                f"(mesh {self._axes(self.mesh)}), weights pushed every step, {lag}")


def _where(spec: EnvironmentSpec, slices: int) -> str:
    group = spec.trainer_group
    assert group is not None  # callers check
    shape = group.shape
    return (f"{slices} x {group.name} ({group.topology}) = {slices * shape.hosts} host(s) x {shape.chips_per_host} "
            f"chips = {slices * shape.chips} chips")


def resolve(spec: EnvironmentSpec) -> Placement | None:
    """The trainer's placement on the chips of trainer.slices; None without a trainer. Raises ConfigError naming the
    keys and the numbers for a split the trainer would refuse there (a split under the Ray launcher: always)."""
    from trainer.base.config import ConfigError as TrainerConfigError
    from trainer.base.config import resolve_mesh
    from trainer.base.placement import RAY_SPLIT_REFUSED, job_devices, split_groups

    t, group = spec.trainer, spec.trainer_group
    if not t.enabled or group is None:
        return None
    cfg = env_job(spec).cfg
    if cfg.placement.mode == "colocated":
        m = cfg.mesh
        return Placement("colocated", (m.slices, m.fsdp, m.tensor), None, cfg.rl.lag, cfg.rl.lag_correction,
                         t.slices * group.shape.chips, t.slices * group.shape.hosts)
    if t.launcher == "ray":
        raise ConfigError(f"invalid stack config for environment {spec.env!r}:\n  {NAMESPACE}:trainer.launcher is "
                          f"'ray' and trainer.config ({t.config or 'demo.yaml'}) / trainer.args: {RAY_SPLIT_REFUSED} "
                          "(trainer.launcher: jobset)")
    shape, slices = group.shape, t.slices
    hosts = slices * shape.hosts
    try:
        resolved = resolve_mesh(cfg, slices * shape.chips, exact=hosts > 1)
        mine, _ = split_groups(resolved, job_devices(slices, shape.hosts, shape.chips_per_host), hosts)
    except TrainerConfigError as err:
        args = " ".join(t.args)
        raise ConfigError(
            f"invalid stack config for environment {spec.env!r}:\n  {NAMESPACE}:trainer.config "
            f"({t.config or 'demo.yaml'}) / trainer.args ({args or 'none'}): placement.mode=split on "
            f"{_where(spec, slices)}: {err}") from None
    m, s = resolved.mesh, resolved.placement.sampler
    if not (m.slices == s.slices == slices or m.slices + s.slices == slices):
        # A group's slices axis crosses DCN: it must be the group's own slices, not a number the config kept.
        raise ConfigError(
            f"invalid stack config for environment {spec.env!r}:\n  {NAMESPACE}:trainer.config "
            f"({t.config or 'demo.yaml'}) / trainer.args ({' '.join(t.args) or 'none'}): placement.mode=split on "
            f"{_where(spec, slices)}: mesh.slices ({m.slices}) and placement.sampler.slices ({s.slices}) must both be "
            f"{slices} (each group on every slice: a split within each host) or add up to {slices} (a split by "
            "slice); set them in trainer.args (--set mesh.slices=N)")
    whole_hosts = len(mine) == shape.chips_per_host * len({d.process_index for d in mine})
    return Placement("split", (m.slices, m.fsdp, m.tensor), (s.slices, s.fsdp, s.tensor), resolved.rl.lag,
                     resolved.rl.lag_correction, slices * shape.chips, hosts, by_host=hosts > 1 and whole_hosts)


def check(spec: EnvironmentSpec) -> Placement | None:
    """Refuses a split placement the trainer could not run on the environment's slices (see resolve)."""
    return resolve(spec)


def line(spec: EnvironmentSpec) -> str | None:
    """The placement in words for `plan`'s trainer line; None for the default."""
    found = resolve(spec)
    return None if found is None else found.line()
