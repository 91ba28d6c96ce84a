"""IP ranges large enough for every node the environment can have: GCP and GKE refuse nodes past them, which
`pulumi up` would otherwise find out half-way through creating the node pools (issue 17 item 6)."""

from __future__ import annotations

import copy
import ipaddress

import pytest

from envspec import rules
from envspec.config import ConfigError, parse_spec
from tests.infra.test_config import _raw
from trainer.base.config import bundled_configs


def _prod(**network: str) -> dict:
    raw = copy.deepcopy(_raw("prod"))
    raw["network"] = {**raw["network"], **network}
    return raw


def test_capacity_of_a_range() -> None:
    assert rules.nodes_in_subnet(ipaddress.ip_network("10.0.0.0/26")) == 60
    assert rules.nodes_in_pod_range(ipaddress.ip_network("10.16.0.0/14")) == 1024
    assert rules.nodes_in_pod_range(ipaddress.ip_network("10.16.0.0/24")) == 1


def test_prod_needs_room_for_84_nodes() -> None:
    # 3 system nodes + 1 surge + 4 x 16 v5p hosts + 2 x 8 v6e hosts.
    spec = parse_spec(_raw("prod"), "prod", bundled_configs())
    assert spec.cluster.system_pool.nodes + 1 + sum(g.count * g.shape.hosts for g in spec.slices) == 84
    parse_spec(_prod(nodeCidr="10.0.0.0/25"), "prod", bundled_configs())  # 124 nodes: enough
    with pytest.raises(ConfigError, match=r"network\.nodeCidr: 10\.0\.0\.0/26 holds 60 nodes .* has 84"):
        parse_spec(_prod(nodeCidr="10.0.0.0/26"), "prod", bundled_configs())
    with pytest.raises(ConfigError, match=r"network\.podCidr: 10\.32\.0\.0/18 holds the pod ranges of 64 nodes"):
        parse_spec(_prod(podCidr="10.32.0.0/18"), "prod", bundled_configs())


def test_dranet_subnets_hold_their_hosts() -> None:
    # prod's v6e burst group: 2 slices x 8 hosts attach to each DRANET network.
    raw = _prod()
    raw["network"]["dranet"] = {**raw["network"]["dranet"], "cidrs": ["10.200.0.0/28", "10.201.0.0/24"]}
    with pytest.raises(ConfigError, match=r"network\.dranet\.cidrs\[0\]: 10\.200\.0\.0/28 holds 12 nodes, but 16"):
        parse_spec(raw, "prod", bundled_configs())
