"""Which zones offer each TPU generation, from the table in envspec/tpu_zones.yaml (Google's TPU regions-and-zones page
and the Cloud TPU API's zone-by-zone listing, with their sources and dates). The environment spec refuses a slice group
whose TPU type no source lists in its zone, before anything is created: `pulumi up` would otherwise find out when the
node pool is created, after the network and the cluster."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import yaml

ZONES = Path(__file__).with_name("tpu_zones.yaml")


class SliceGroup(Protocol):
    """What the check reads of a slice group (sections/slices.py SliceGroupSpec)."""

    @property
    def tpu_type(self) -> str: ...

    @property
    def skip_zone_check(self) -> bool: ...


@dataclass(frozen=True)
class ZoneTable:
    zones: dict[str, dict[str, list[str]]]  # generation -> source id -> zones that source lists
    sources: dict[str, dict[str, Any]]  # source id -> url, retrieved, note
    unchecked: dict[str, str]  # generation -> why a zone it is missing from is not refused

    def offering(self, generation: str) -> list[str]:
        """Every zone any source lists for the generation."""
        return sorted({z for listed in self.zones.get(generation, {}).values() for z in listed})

    def listed_by(self, generation: str, zone: str) -> list[str]:
        """The ids of the sources that list the zone for the generation."""
        return [s for s, listed in self.zones.get(generation, {}).items() if zone in listed]

    def checks(self, generation: str) -> bool:
        return generation in self.zones and generation not in self.unchecked

    def retrieved(self) -> str:
        return ", ".join(sorted({str(s.get("retrieved", "date unknown")) for s in self.sources.values()}))


def parse_table(doc: dict[str, Any]) -> ZoneTable:
    return ZoneTable(zones=doc.get("zones") or {}, sources=doc.get("sources") or {},
                     unchecked=doc.get("unchecked") or {})


@cache
def default_table() -> ZoneTable:
    return parse_table(yaml.safe_load(ZONES.read_text()))


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def zone_problem(tpu_type: str, zone: str, table: ZoneTable | None = None) -> str | None:
    """Why the table says `zone` does not offer `tpu_type` (a catalog name), naming the zones that do; None when a
    source lists it there, or the table does not check that generation."""
    table = table or default_table()
    if not table.checks(tpu_type) or table.listed_by(tpu_type, zone):
        return None
    offering, region = table.offering(tpu_type), region_of(zone)
    nearby = [z for z in offering if region_of(z) == region]
    where = (f"in {region} it is offered in {', '.join(nearby)}" if nearby
             else f"no zone of {region} offers it")
    return (f"{tpu_type} is not offered in zone {zone!r} according to {ZONES.parent.name}/{ZONES.name} (read "
            f"{table.retrieved()}); {where}; every zone that offers {tpu_type}: {', '.join(offering)}")


def check_slice_zones(groups: Iterable[SliceGroup], zone: str, table: ZoneTable | None = None) -> None:
    """Raises ValueError naming the first slice group whose TPU type the table says `zone` does not offer (the
    EnvironmentSpec's cross-checks call it); a group with skip_zone_check set is not checked."""
    for i, group in enumerate(groups):
        if group.skip_zone_check:
            continue
        problem = zone_problem(group.tpu_type, zone, table)
        if problem:
            raise ValueError(f"slices[{i}].tpuType: {problem}. Use a zone that offers it (zone, and region to "
                             f"match), or set slices[{i}].skipZoneCheck: true if Google opened it in {zone} after the "
                             "table was read")
