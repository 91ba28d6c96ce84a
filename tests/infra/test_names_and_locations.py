"""Configs GCP would refuse only at `pulumi up`: a project id or a derived bucket name with a word Google reserves, a
bucket location or region that does not exist, a misspelled key. Each stops before any resource is registered, with
an error naming the key, the value, the rule and a fix (or the closest valid values)."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from envspec import locations, rules, zones
from envspec.config import ConfigError, parse_spec
from infra.offline.mockrun import PlanMocks, RecordingMonitor, run_stack
from tests.infra.conftest import stack_config
from trainer.base.config import bundled_configs


def _raw(env: str) -> dict[str, Any]:
    return copy.deepcopy({k.split(":", 1)[1]: v for k, v in stack_config(env).items()})


def _error(raw: dict[str, Any], env: str = "dev") -> str:
    with pytest.raises(ConfigError) as e:
        parse_spec(raw, env, bundled_configs())
    return str(e.value)


def _registers_nothing(raw: dict[str, Any], env: str, message: str) -> None:
    monitor = RecordingMonitor(PlanMocks())
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_stack(env, {f"gke-tpu-rl:{k}": v for k, v in raw.items()}, monitor=monitor)
    assert monitor.registrations == []


# ---------------------------------------------------------------- reserved words in project ids and bucket names

def test_a_project_id_with_google_is_refused() -> None:
    raw = _raw("dev")
    raw["project"] = "acme-google-rl"
    msg = _error(raw)
    assert "gke-tpu-rl:project: 'acme-google-rl' contains 'google': GCP project ids cannot contain it" in msg
    assert rules.PROJECT_ID_RULES in msg and rules.BUCKET_NAMING in msg  # the rules, with their sources
    assert "set the id of the project to deploy to" in msg  # a fix
    _registers_nothing(raw, "dev", "gke-tpu-rl:project: 'acme-google-rl' contains 'google'")


def test_a_bucket_name_beginning_with_goog_names_the_project_key() -> None:
    raw = _raw("dev")
    raw["project"] = "googly-rl"  # a valid project id, but the checkpoint bucket begins with it
    msg = _error(raw)
    assert ("gke-tpu-rl:project: 'googly-rl' makes the checkpoint bucket name 'googly-rl-dev-checkpoints' "
            "(<project>-<stack>-checkpoints), which Cloud Storage refuses: bucket names cannot begin with 'goog' "
            f"({rules.BUCKET_NAMING}); the stack names its buckets after the project id, so deploy to a project "
            "whose id does not begin with 'goog' nor contain 'google'") in msg
    _registers_nothing(raw, "dev", "gke-tpu-rl:project: 'googly-rl' makes the checkpoint bucket name")


def test_a_close_misspelling_of_google_in_a_bucket_name_is_refused() -> None:
    raw = _raw("dev")
    raw["project"] = "acme-g00gle-rl"  # GCP's project rule names "google" only; Cloud Storage's misspellings too
    msg = _error(raw)
    assert ("gke-tpu-rl:project: 'acme-g00gle-rl' makes the checkpoint bucket name "
            "'acme-g00gle-rl-dev-checkpoints'") in msg
    assert "bucket names cannot contain 'google' or a close misspelling such as 'g00gle' (here 'g00gle')" in msg


def test_the_stack_name_that_brings_google_into_a_bucket_name_is_named() -> None:
    msg = _error(_raw("dev"), env="google")
    assert ("stack name: 'google' makes the checkpoint bucket name 'acme-rl-dev-google-checkpoints' "
            "(<project>-<stack>-checkpoints), which Cloud Storage refuses: bucket names cannot contain 'google'") in msg
    assert "use a stack name without it" in msg


def test_the_service_state_bucket_is_checked_too() -> None:
    raw = _raw("tinker")
    raw["service"]["name"] = "g00gle"
    msg = _error(raw, env="tinker")
    assert ("gke-tpu-rl:service.name: 'g00gle' makes the service's state bucket name "
            "'acme-rl-tinker-tinker-g00gle-state' (<project>-<stack>-<service>-state), which Cloud Storage refuses: "
            "bucket names cannot contain 'google' or a close misspelling") in msg
    assert "use a service name without it" in msg


@pytest.mark.parametrize(("part", "first", "refused"), [
    ("goog-rl", True, True), ("goog-rl", False, False),  # only the prefix of the whole name counts
    ("acme-google", False, True), ("acme-g00gle", False, True), ("acme-goog1e", False, True),
    ("googol", True, True), ("acme-goggles", False, False), ("acme-rl", True, False),
])
def test_the_reserved_words_of_bucket_names(part: str, first: bool, refused: bool) -> None:
    assert (rules.bucket_reserved_word(part, first=first) is not None) == refused


# ---------------------------------------------------------------- locations from the table

def test_a_misspelled_storage_location_is_refused_with_the_closest_one() -> None:
    raw = _raw("dev")
    raw.setdefault("storage", {})["location"] = "europe-wst4"
    msg = _error(raw)
    assert "gke-tpu-rl:storage.location: 'europe-wst4' is not a Cloud Storage location" in msg
    assert f"per the table in envspec/locations.py (from {locations.SOURCE}, read {locations.RETRIEVED}" in msg
    assert msg.endswith("; did you mean europe-west4?")
    _registers_nothing(raw, "dev", "gke-tpu-rl:storage.location: 'europe-wst4' is not a Cloud Storage location")


def test_a_misspelled_dual_region_gets_suggestions_in_its_case() -> None:
    raw = _raw("dev")
    raw.setdefault("storage", {})["location"] = "NAM5"
    assert _error(raw).endswith("; did you mean NAM4?")


@pytest.mark.parametrize("location", ["us-east5", "US-EAST5", "europe-west4", "nam4", "EUR4", "US", "eu", "asia"])
def test_every_kind_of_storage_location_passes(location: str) -> None:
    raw = _raw("dev")
    raw.setdefault("storage", {})["location"] = location
    assert parse_spec(raw, "dev", bundled_configs()).storage.location == location


def test_a_misspelled_region_is_refused_with_the_closest_one() -> None:
    raw = _raw("dev")
    raw["region"], raw["zone"] = "us-eest5", "us-eest5-b"
    msg = _error(raw)
    assert "gke-tpu-rl:region: 'us-eest5' is not a Google Cloud region in the table in envspec/locations.py" in msg
    assert msg.endswith("; did you mean us-east5?")


def test_a_region_without_a_bucket_location_needs_storage_location() -> None:
    # us-central2 runs TPU v4 but is no Cloud Storage location: the bucket, in the region by default, would fail
    # after the network and the cluster exist.
    raw = _raw("dev")
    raw["region"], raw["zone"] = "us-central2", "us-central2-b"
    for group in raw["slices"]:
        group["skipZoneCheck"] = True  # dev's v6e is not offered there; the bucket is what this test is about
    raw.setdefault("storage", {}).pop("location", None)
    msg = _error(raw)
    assert msg.startswith("invalid stack config for environment 'dev':\n  gke-tpu-rl:storage.location: unset, so the "
                          "bucket would be in the region, and "
                          "'us-central2' is not a Cloud Storage location") and msg.endswith("did you mean us-central1?")
    raw["storage"]["location"] = "US"
    assert parse_spec(raw, "dev", bundled_configs()).storage.location == "US"


def test_a_location_or_region_opened_after_the_table_passes_with_its_skip_key() -> None:
    # As slices[].skipZoneCheck does for the TPU zone table: a closed list must not hold a deployed stack hostage.
    raw = _raw("dev")
    raw.setdefault("storage", {})["location"] = "europe-north9"
    assert "for a location Google opened since, set storage.skipLocationCheck: true)" in _error(raw)
    raw["storage"]["skipLocationCheck"] = True
    assert parse_spec(raw, "dev", bundled_configs()).storage.location == "europe-north9"
    raw["region"], raw["zone"] = "europe-north9", "europe-north9-a"
    for group in raw["slices"]:
        group["skipZoneCheck"] = True
    assert "for a region Google opened since, set skipRegionCheck: true)" in _error(raw)
    raw["skipRegionCheck"] = True
    assert parse_spec(raw, "dev", bundled_configs()).region == "europe-north9"


def test_every_region_of_the_tpu_zone_table_is_a_region() -> None:
    # us-central2 (v4's only zone) is not a Cloud Storage region, but the stack may run there.
    table = zones.default_table()
    tpu_regions = {zones.region_of(z) for g in table.zones for z in table.offering(g)}
    assert "us-central2" in tpu_regions and tpu_regions <= set(locations.regions())
    assert set(locations.STORAGE_REGIONS) <= set(locations.regions())


# ---------------------------------------------------------------- "did you mean" for unknown keys

@pytest.mark.parametrize(("env", "path", "expect"), [
    ("dev", ("storage", "locaton"), "gke-tpu-rl:storage.locaton: unknown key; did you mean storage.location?"),
    ("dev", ("storag",), "gke-tpu-rl:storag: unknown key; did you mean storage?"),
    ("dev", ("slices", 0, "tpuTyp"), "gke-tpu-rl:slices[0].tpuTyp: unknown key; did you mean slices[0].tpuType?"),
    ("dev", ("trainer", "maxRestart"), "gke-tpu-rl:trainer.maxRestart: unknown key; did you mean trainer.maxRestarts?"),
    ("dev", ("hfTokn",), "gke-tpu-rl:hfTokn: unknown key; did you mean hfToken?"),  # a secret key, read beside the spec
    ("tinker", ("service", "database", "tierr"),
     "gke-tpu-rl:service.database.tierr: unknown key; did you mean service.database.tier?"),
])
def test_an_unknown_key_names_the_closest_allowed_key(env: str, path: tuple[Any, ...], expect: str) -> None:
    raw = _raw(env)
    node: Any = raw
    for p in path[:-1]:
        node = node.setdefault(p, {}) if isinstance(p, str) else node[p]
    node[path[-1]] = 1
    lines = _error(raw, env).splitlines()
    assert f"  {expect}" in lines, lines


def test_an_unknown_key_like_no_allowed_one_gets_no_guess() -> None:
    raw = _raw("dev")
    raw["storage"] = {**raw.get("storage", {}), "qqqzzz": 1}
    assert "  gke-tpu-rl:storage.qqqzzz: unknown key" in _error(raw).splitlines()
