"""The `slices` section: TPU slice groups, each `count` identical slices of one shape from the TPU catalog."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from envspec import rules, tpu
from envspec.sections.fields import _Model, _short_name

Capacity = Literal["on-demand", "spot", "reservation", "flex-start"]


class SliceGroupSpec(_Model):
    """`count` identical slices of one shape; each slice becomes one node pool."""

    name: str = Field(description="the group's name; its node pools are <name>-0, <name>-1, ...")
    tpu_type: str = Field(description="TPU generation: a name or alias of the TPU catalog (envspec/tpu.py)")
    topology: str = Field(description="the slice's topology (chips along each axis); one the TPU type offers")
    count: int = Field(1, ge=1, le=64, description="identical slices in the group, one node pool each")
    capacity: Capacity = Field("on-demand", description="how the slices' VMs are obtained: on-demand, spot, a "
                               "reservation (named in reservation), or flex-start (queued provisioning through "
                               "Kueue's ProvisioningRequest)")
    reservation: str | None = Field(None, description="the reservation's name; required with capacity "
                                    "'reservation', and only then")
    skip_zone_check: bool = Field(False, description="skip the check that `zone` offers tpuType (the table in "
                                  "envspec/tpu_zones.yaml, from Google's TPU zone list): for a zone Google opened "
                                  "after that table was read")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _short_name(v, "so its node pools' names (<name>-<index>) fit GKE's 40")

    @field_validator("reservation")
    @classmethod
    def _reservation_name(cls, v: str | None) -> str | None:
        return None if v is None else rules.gcp_name(v, 63, "reservation")

    @field_validator("tpu_type")
    @classmethod
    def _type(cls, v: str) -> str:
        return tpu.canonical_type(v)

    @field_validator("topology")
    @classmethod
    def _topology(cls, v: str, info: Any) -> str:
        if "tpu_type" in info.data:  # else the type error is reported already
            tpu.slice_shape(info.data["tpu_type"], v)
        return v

    @model_validator(mode="after")
    def _reservation(self) -> SliceGroupSpec:
        if (self.capacity == "reservation") != (self.reservation is not None):
            raise ValueError("reservation (a reservation name) is required with capacity 'reservation' "
                             "and only then")
        return self

    @property
    def shape(self) -> tpu.SliceShape:
        return tpu.slice_shape(self.tpu_type, self.topology)

    def pool_names(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.count)]
