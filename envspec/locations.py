"""Where things may be: the Cloud Storage locations a bucket may have and the regions the stack may use, in one table,
with the closest valid values for a misspelling (envspec/suggest.py). The environment spec refuses `storage.location`
and `region` values this table does not hold before any resource is registered: `pulumi up` would otherwise find out
at the bucket (or the network), after other resources exist.

Source: Cloud Storage's "Bucket locations" page, https://cloud.google.com/storage/docs/locations ("Available
locations": regions, predefined dual-regions, multi-regions), read 2026-11-29. The stored copies of that page read
here are excerpts (its location types and predefined pairs, not its whole region table), so the regions below are the
union of those excerpts and public copies of the table: speakeasy-sdks/cribl-python
docs/models/shared/outputgooglecloudstorageregion.md (an SDK enum of the table, from before europe-west10,
europe-north2, me-central2, africa-south1, northamerica-south1 and asia-southeast3 opened) and newer region lists that
hold those six. A missing region refuses a real one (the error says how to add it), an extra one only lets a typo
that happens to be a real region name through, so the list errs toward more. The `region` key is also allowed the
regions of envspec/tpu_zones.yaml. A location Google opened after that date: add it here, with the date.

Configurable dual-regions (two regions chosen by the user) are set with a multi-region code plus a placement config,
which the stack does not expose: `storage.location` takes a region, a predefined dual-region or a multi-region.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from envspec import zones
from envspec.suggest import closest, did_you_mean

SOURCE = "https://cloud.google.com/storage/docs/locations"
RETRIEVED = "2026-11-29"
WHERE = f"{Path(__file__).parent.name}/{Path(__file__).name}"

# Cloud Storage regions (lowercase, as Compute Engine names them; Cloud Storage reports them uppercase).
STORAGE_REGIONS = (
    # North America
    "northamerica-northeast1", "northamerica-northeast2", "northamerica-south1",
    "us-central1", "us-east1", "us-east4", "us-east5", "us-south1", "us-west1", "us-west2", "us-west3", "us-west4",
    # South America
    "southamerica-east1", "southamerica-west1",
    # Europe
    "europe-central2", "europe-north1", "europe-north2", "europe-southwest1", "europe-west1", "europe-west2",
    "europe-west3", "europe-west4", "europe-west6", "europe-west8", "europe-west9", "europe-west10", "europe-west12",
    # Asia
    "asia-east1", "asia-east2", "asia-northeast1", "asia-northeast2", "asia-northeast3", "asia-south1", "asia-south2",
    "asia-southeast1", "asia-southeast2", "asia-southeast3",
    # Australia
    "australia-southeast1", "australia-southeast2",
    # Middle East
    "me-central1", "me-central2", "me-west1",
    # Africa
    "africa-south1",
)
# Predefined dual-regions: ASIA1 (Tokyo, Osaka), EUR4 (Finland, Netherlands), NAM4 (Iowa, South Carolina), as the
# copy above lists them, and EUR5 (Belgium, London), EUR7 (London, Frankfurt), EUR8 (Frankfurt, Zurich), added to the
# page since (not in that copy; check them against the page when it is next read).
STORAGE_DUAL_REGIONS = ("ASIA1", "EUR4", "EUR5", "EUR7", "EUR8", "NAM4")
STORAGE_MULTI_REGIONS = ("ASIA", "EU", "US")


@cache
def storage_locations() -> tuple[str, ...]:
    """Every value `storage.location` may take, in the table's spelling (regions lowercase, the rest uppercase)."""
    return STORAGE_REGIONS + STORAGE_DUAL_REGIONS + STORAGE_MULTI_REGIONS


@cache
def regions() -> tuple[str, ...]:
    """Every value `region` may take: the Cloud Storage regions above, and the regions of the TPU zone table
    (envspec/tpu_zones.yaml), which holds zones of regions this page leaves out (us-central2, where v4 is)."""
    table = zones.default_table()
    tpu_regions = {zones.region_of(z) for g in table.zones for z in table.offering(g)}
    return tuple(sorted(set(STORAGE_REGIONS) | tpu_regions))


# The keys that turn the table's check off, for a location Google opened after it was read (as slices[].skipZoneCheck
# does for the TPU zone table): a closed list must not hold a deployed stack hostage to a kit edit.
SKIP_LOCATION_KEY = "storage.skipLocationCheck"
SKIP_REGION_KEY = "skipRegionCheck"


def storage_location_problem(value: str) -> str | None:
    """Why Cloud Storage refuses `value` as a bucket location, naming the closest valid values; None if valid."""
    if value.lower() in {loc.lower() for loc in storage_locations()}:
        return None
    return (f"{value!r} is not a Cloud Storage location: a region (like us-east5), a predefined dual-region "
            f"({', '.join(STORAGE_DUAL_REGIONS)}) or a multi-region ({', '.join(STORAGE_MULTI_REGIONS)}), per the "
            f"table in {WHERE} (from {SOURCE}, read {RETRIEVED}; for a location Google opened since, set "
            f"{SKIP_LOCATION_KEY}: true)"
            f"{did_you_mean(closest(value, storage_locations()))}")


def region_problem(value: str) -> str | None:
    """Why `value` is not a Google Cloud region the table knows, naming the closest ones; None if it is."""
    if value in regions():
        return None
    return (f"{value!r} is not a Google Cloud region in the table in {WHERE} (from {SOURCE}, read {RETRIEVED}; for "
            f"a region Google opened since, set {SKIP_REGION_KEY}: true)"
            f"{did_you_mean(closest(value, regions()))}")
