"""Where an environment departs from the shipped examples (environments/Pulumi.*.yaml) in a way that costs
performance: warnings `plan` and `plan --diff` print, not errors (the config is valid; it is only slower).

Today one: a multi-host multislice group without DRANET networks, where an example gives the same kind of group
(the same TPU type, multi-host, more than one slice) its DRANET networks. Without them the DCN traffic between the
slices (libtpu's megascale transfers) goes over each host's one node NIC with the node's other traffic, rather than
over the extra high-MTU networks whose NICs the pods claim (README: Network, Trainer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from envspec.config import ConfigError, EnvironmentSpec
from envspec.sections.slices import SliceGroupSpec
from infra.base.stack_file import PlanError, env_spec, repo_root, stack_config_dir


@dataclass(frozen=True)
class ExampleGroup:
    """A multi-host multislice group with DRANET networks in an example environment."""

    file: str  # environments/Pulumi.staging.yaml
    group: str
    tpu_type: str
    topology: str
    count: int
    networks: int  # DRANET networks per host


def _multislice(group: SliceGroupSpec) -> bool:
    return group.shape.multi_host and group.count > 1


@functools.cache
def _examples(root: Path, files: tuple[tuple[str, str], ...]) -> tuple[ExampleGroup, ...]:
    # Keyed on the files' texts, so an edited example is read again.
    out = []
    for name, _ in files:
        env = name.removeprefix("Pulumi.").removesuffix(".yaml")
        try:
            spec = env_spec(env, root=root)
        except (ConfigError, PlanError):
            continue  # a broken environment file is its own plan's error, not this one's
        rel = (stack_config_dir(root) / name).relative_to(root).as_posix()
        out += [ExampleGroup(rel, g.name, g.tpu_type, g.topology, g.count, spec.dranet_networks_for(g))
                for g in spec.slices if _multislice(g) and spec.dranet_networks_for(g)]
    return tuple(out)


def example_groups(root: Path | None = None, but: str | None = None) -> list[ExampleGroup]:
    """The multi-host multislice groups with DRANET networks in the environments of `root` (but `but`'s own)."""
    root = root or repo_root()
    paths = sorted(stack_config_dir(root).glob("Pulumi.*.yaml"))
    files = tuple((p.name, p.read_text()) for p in paths if p.name != f"Pulumi.{but}.yaml")
    return list(_examples(root, files))


def warnings(spec: EnvironmentSpec, root: Path | None = None) -> list[str]:
    """One sentence per setting of `spec` that costs performance against the examples, naming the key to change."""
    out = []
    for g in spec.slices:
        if not _multislice(g) or spec.dranet_networks_for(g) or not g.shape.generation.dranet_nics:
            continue
        like = [e for e in example_groups(root, but=spec.env) if e.tpu_type == g.tpu_type]
        if not like:
            continue
        e = min(like, key=lambda e: (e.topology != g.topology, e.file))  # the same topology first
        out.append(
            f"slices: group {g.name!r} ({g.count} x {g.tpu_type} {g.topology}, {g.shape.hosts} hosts per slice) is "
            "multi-host multislice without DRANET networks, so the DCN traffic between its slices shares each "
            f"host's one node NIC; {e.file} gives its {e.count} x {e.tpu_type} {e.topology} group {e.group!r} "
            f"{e.networks} extra high-MTU networks per host. Set network.dranet.enabled: true.")
    return out
