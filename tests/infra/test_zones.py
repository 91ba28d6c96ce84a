"""A TPU type the zone does not offer (envspec/tpu_zones.yaml, from Google's zone list) is refused before any resource,
naming the keys, the zone and the zones that do offer it; skipZoneCheck lets a zone newer than the table through."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import yaml

from envspec import tpu, zones
from envspec.config import ConfigError, parse_spec
from tests.infra.conftest import stack_config
from trainer.base.config import bundled_configs

ENVS = ("dev", "staging", "prod")


def _raw(env: str) -> dict[str, Any]:
    return copy.deepcopy({k.split(":", 1)[1]: v for k, v in stack_config(env).items()})


def _dev_with(group: dict[str, Any], zone: str | None = None) -> dict[str, Any]:
    raw = _raw("dev")
    raw["slices"] = [{"name": "g", "count": 2, "capacity": "on-demand", **group}]
    if zone is not None:
        raw["region"], raw["zone"] = zone.rsplit("-", 1)[0], zone
    return raw


@pytest.mark.parametrize("env", ENVS)
def test_the_shipped_environments_use_zones_a_source_lists(env: str) -> None:
    spec = parse_spec(_raw(env), env, bundled_configs())
    table = zones.default_table()
    for group in spec.slices:
        assert not group.skip_zone_check
        assert table.listed_by(group.tpu_type, spec.zone), (env, group.name, group.tpu_type, spec.zone)


def test_a_zone_without_the_tpu_is_refused_with_the_zones_that_have_it() -> None:
    # v4 is only in us-central2-b; dev's zone is us-east5-b.
    with pytest.raises(ConfigError) as e:
        parse_spec(_dev_with({"tpuType": "v4", "topology": "2x2x1"}), "dev", bundled_configs())
    msg = str(e.value)
    assert "gke-tpu-rl:slices[0].tpuType: v4 is not offered in zone 'us-east5-b'" in msg
    assert "no zone of us-east5 offers it; every zone that offers v4: us-central2-b" in msg
    assert "envspec/tpu_zones.yaml (read 2026-11-23)" in msg
    assert "set slices[0].skipZoneCheck: true" in msg


def test_the_error_names_the_group_and_the_zones_of_the_same_region() -> None:
    # prod's groups in us-central1-b: v5p is offered in us-central1-a only; v6e (the second group) is offered there.
    raw = _raw("prod")
    raw["region"], raw["zone"] = "us-central1", "us-central1-b"
    raw["slices"] = list(reversed(raw["slices"]))  # v6e first (fine), then v5p: the message names slices[1]
    with pytest.raises(ConfigError, match=re.escape(
            "gke-tpu-rl:slices[1].tpuType: v5p is not offered in zone 'us-central1-b'")) as e:
        parse_spec(raw, "prod", bundled_configs())
    assert "in us-central1 it is offered in us-central1-a;" in str(e.value)


def test_skip_zone_check_lets_a_zone_newer_than_the_table_through() -> None:
    raw = _dev_with({"tpuType": "v4", "topology": "2x2x1", "skipZoneCheck": True})
    spec = parse_spec(raw, "dev", bundled_configs())
    assert spec.slices[0].skip_zone_check and spec.zone == "us-east5-b"


def test_a_zone_that_only_the_api_lists_passes() -> None:
    # v6e in us-east4-a: not on Google's page (the generally available zones) but in the Cloud TPU API's listing.
    table = zones.default_table()
    assert table.listed_by("v6e", "us-east4-a") == ["api"]
    spec = parse_spec(_dev_with({"tpuType": "v6e", "topology": "2x2"}, "us-east4-a"), "dev", bundled_configs())
    assert spec.zone == "us-east4-a"


def test_ironwood_is_checked_and_an_unchecked_generation_is_not_refused() -> None:
    # Ironwood: only the page lists it (us-central1); it is checked like the rest.
    assert zones.zone_problem("tpu7x", "us-central1-c") is None
    assert "tpu7x is not offered in zone 'us-east5-b'" in (zones.zone_problem("tpu7x", "us-east5-b") or "")
    # A generation the table marks unchecked (with why) passes in any zone; the others are still refused.
    doc = yaml.safe_load(zones.ZONES.read_text())
    table = zones.parse_table({**doc, "unchecked": {"tpu7x": "zones still being added"}})
    assert not table.checks("tpu7x") and zones.zone_problem("tpu7x", "us-east5-b", table) is None
    assert zones.zone_problem("v6e", "us-west4-a", table) is not None


def test_the_table_cites_its_sources_and_matches_the_tpu_catalog() -> None:
    table = zones.default_table()
    assert set(table.zones) == set(tpu.GENERATIONS)  # the same generation names as the catalog and the price table
    assert set(table.unchecked) <= set(table.zones)
    for source in table.sources.values():
        assert source["url"].startswith("https://") and re.fullmatch(r"\d{4}-\d{2}-\d{2}", source["retrieved"])
    for gen, listed in table.zones.items():
        assert listed and set(listed) <= set(table.sources), gen
        for zone_list in listed.values():
            assert len(set(zone_list)) == len(zone_list), gen
            assert all(re.fullmatch(r"[a-z]+-[a-z]+[0-9]+-[a-z0-9]+", z) for z in zone_list), gen
