"""What every section of the environment spec shares: the base model (camelCase keys, unknown keys refused), the
field checks several sections run (short names, CIDR blocks), and the trainer configs the image bundles, which two
sections are checked against. The underscored names are private to the envspec package, not to this module."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, ValidationInfo
from pydantic.alias_generators import to_camel

from envspec import rules

# Slice group names: RFC 1035 labels short enough that `<group>-<index>` is a GKE node pool name (40 characters).
_GROUP_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,30}[a-z0-9])?$")


@dataclass(frozen=True)
class BundledConfigs:
    """The trainer configs the trainer image bundles (trainer/configs/): what trainer.config and service.config may
    name. The spec sits below the trainer and never imports it, so the caller passes the trainer's own listing
    (trainer.base.config.bundled_configs())."""

    runs: Sequence[str]  # RL training runs
    services: Sequence[str]  # the post-training service's engine configs (a `service` section)


_BUNDLED = "bundled_configs"  # the validation context's key for them (parse_spec sets it)


def _bundled(info: ValidationInfo) -> BundledConfigs:
    configs = (info.context or {}).get(_BUNDLED)
    if not isinstance(configs, BundledConfigs):
        # A programming error, not a config problem: pydantic lets a TypeError through unchanged.
        raise TypeError("the spec names a bundled trainer config; validate it with parse_spec(raw, env, "
                        "bundled_configs) so it can be checked")
    return configs


class _Model(BaseModel):
    # Pulumi stack config is camelCase; unknown keys are typos, so they are errors.
    # NaN and infinity are never a valid setting (YAML's .nan/.inf would otherwise pass a range check).
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True,
                              allow_inf_nan=False)


def _short_name(value: str, why: str) -> str:
    if not _GROUP_NAME.match(value):
        raise ValueError(f"{value!r} must be a lowercase DNS label (a-z, 0-9, '-', starting with a letter), at most "
                         f"32 characters: {why}")
    return value


def _cidr(value: str) -> str:
    if not isinstance(value, str) or "/" not in value:  # a bare address is not a range GCP accepts
        raise ValueError(f"{value!r} is not a CIDR block like 10.0.0.0/20 (address/prefix length)")
    try:
        return str(ipaddress.ip_network(value, strict=True))
    except ValueError as e:
        raise ValueError(f"{value!r} is not a CIDR block like 10.0.0.0/20 ({e})") from None


def _subnet(value: str) -> str:
    cidr = _cidr(value)
    rules.subnet_range(ipaddress.ip_network(cidr))
    return cidr
