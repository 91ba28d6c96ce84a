"""The `storage` section: the checkpoint bucket."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from envspec import locations
from envspec.sections.fields import _Model


class StorageSpec(_Model):
    location: str | None = Field(None, description="bucket location: a region, a predefined dual-region (NAM4, "
                                 "EUR4, ...) or a multi-region (US, EU, ASIA) of the table in "
                                 "envspec/locations.py; the region when unset")
    skip_location_check: bool = Field(False, description="skip the check of the bucket's location (location, or "
                                      "the region when unset) against the table in envspec/locations.py: for a "
                                      "location Google opened after that table was read")
    protect: bool = Field(True, description="retain the checkpoint bucket on destroy")
    force_destroy: bool = Field(False, description="let the bucket be deleted with its objects in it (needs "
                                "protect: false)")
    versioning: bool = Field(True, description="object versioning on the checkpoint bucket")
    soft_delete_days: int = Field(7, ge=0, le=90, description="days Cloud Storage keeps deleted objects restorable: "
                                  "0 (soft delete off) or 7 to 90")

    @field_validator("soft_delete_days")
    @classmethod
    def _soft_delete(cls, v: int) -> int:
        # Cloud Storage soft delete: 0 (off) or a retention of 7 to 90 days (docs: storage/docs/soft-delete).
        if 0 < v < 7:
            raise ValueError(f"{v} days: Cloud Storage keeps soft-deleted objects 7 to 90 days, or 0 to turn it off")
        return v

    @field_validator("location")
    @classmethod
    def _location(cls, v: str | None) -> str | None:
        # A region (us-east5), dual-region (nam4) or multi-region (US): letters, digits and '-'.
        if v is not None and not re.match(r"^[A-Za-z][-A-Za-z0-9]*[A-Za-z0-9]$", v):
            raise ValueError(f"{v!r} is not a Cloud Storage location like us-east5, nam4 or US")
        return v

    @model_validator(mode="after")
    def _listed(self) -> StorageSpec:
        problem = None if self.location is None or self.skip_location_check else \
            locations.storage_location_problem(self.location)
        if problem:
            raise ValueError(f"storage.location: {problem}")
        return self

    @model_validator(mode="after")
    def _safe(self) -> StorageSpec:
        if self.protect and self.force_destroy:
            raise ValueError("forceDestroy would delete checkpoints on destroy; it needs protect: false")
        return self
