"""List prices from the repo's price table: per capacity kind, per region, and "no price" instead of a guess."""

from __future__ import annotations

import pytest

from infra import cost

TABLE = cost.parse_table({
    "sources": [{"url": "https://example.invalid/prices", "retrieved": "2026-11-01"}],
    "prices": {"v6e": {"us-east5": {"on-demand": 2.7, "spot": 1.2, "cud-1y": 1.89},
                       "europe-west4": {"on-demand": 2.97}},
               "v5p": {"us-east5": {"on-demand": 4.2}}},
})


@pytest.mark.parametrize(("tpu", "region", "capacity", "rate", "basis"), [
    ("v6e", "us-east5", "on-demand", 2.7, "on-demand"),
    ("v6e", "us-east5", "spot", 1.2, "spot"),
    ("v6e", "us-east5", "reservation", 1.89, "1-year commitment"),
    ("v5p", "us-east5", "reservation", 4.2, "on-demand rate, no commitment price known"),
    ("v6e", "europe-west4", "on-demand", 2.97, "on-demand"),
])
def test_each_capacity_kind_uses_its_rate(tpu: str, region: str, capacity: str, rate: float, basis: str) -> None:
    c = cost.slice_cost("g", tpu, region, capacity, 32, TABLE)
    assert c.usd_per_chip_hour == rate and c.basis == basis
    assert c.usd_per_hour == pytest.approx(32 * rate)
    assert c.usd_per_month == pytest.approx(32 * rate * 730)


@pytest.mark.parametrize(("tpu", "region", "capacity"), [
    ("v6e", "us-east5", "flex-start"),  # no flex-start column: not the on-demand price
    ("v6e", "asia-east1", "on-demand"),  # a region the table lacks
    ("tpu7x", "us-east5", "on-demand"),  # a generation the table lacks
    ("v5p", "us-east5", "spot"),
])
def test_unknown_combinations_have_no_price(tpu: str, region: str, capacity: str) -> None:
    c = cost.slice_cost("g", tpu, region, capacity, 16, TABLE)
    assert c.usd_per_chip_hour is None and c.usd_per_hour is None


def test_environment_total_counts_what_is_priced_and_names_what_is_not() -> None:
    env = cost.environment_cost([{"name": "a", "tpu_type": "v6e", "capacity": "spot", "chips": 4},
                                 {"name": "b", "tpu_type": "v6e", "capacity": "flex-start", "chips": 64}],
                                "us-east5", TABLE)
    assert env.usd_per_hour == pytest.approx(4.8) and env.usd_per_month == pytest.approx(4.8 * 730)
    line = env.line()
    assert line.startswith("$4.80/hour, $3,504.00/month at list price")
    assert "no price for b (v6e flex-start in us-east5), not counted" in line
    assert "flex-start pools are billed only while provisioned" in line


def test_the_repo_table_cites_its_source_and_is_well_formed() -> None:
    table = cost.default_table()
    assert table.sources and all(s["url"].startswith("https://") and s.get("retrieved") for s in table.sources)
    for gen, regions in table.prices.items():
        assert gen in {"v4", "v5e", "v5p", "v6e", "tpu7x"}, gen
        for region, rates in regions.items():
            assert set(rates) <= set(cost.RATE_LABELS), (gen, region)
            assert all(isinstance(v, int | float) and 0 < v < 100 for v in rates.values()), (gen, region)


def test_usd_formatting() -> None:
    assert cost.usd(1234.5) == "$1,234.50"
    assert cost.usd(86.4, signed=True) == "+$86.40" and cost.usd(-2, signed=True) == "-$2.00"
    assert cost.usd(0, signed=True) == "±$0.00"
