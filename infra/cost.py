"""List prices of an environment's TPU slices, from the price table in infra/tpu_prices.yaml (copied from Google's
public price pages, with their source and date). A combination the table lacks has no price: never a guess."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

PRICES = Path(__file__).with_name("tpu_prices.yaml")
HOURS_PER_MONTH = 730  # Google's price pages convert hourly to monthly with 730 hours
# The price-table columns each capacity kind is billed at, first found wins. A reservation is billed at the
# committed-use rate when a commitment covers it, else at the on-demand rate (Compute Engine reservations);
# flex-start has its own rate, and no fallback: unknown stays "no price".
RATES_FOR_CAPACITY = {"on-demand": ("on-demand",), "spot": ("spot",), "reservation": ("cud-1y", "on-demand"),
                      "flex-start": ("flex-start",)}
RATE_LABELS = {"on-demand": "on-demand", "spot": "spot", "cud-1y": "1-year commitment",
               "cud-3y": "3-year commitment", "flex-start": "flex-start"}


@dataclass(frozen=True)
class PriceTable:
    prices: dict[str, dict[str, dict[str, float]]]  # generation -> region -> rate -> USD per chip-hour
    sources: list[dict[str, Any]]

    def rate(self, generation: str, region: str, rate: str) -> float | None:
        value = self.prices.get(generation, {}).get(region, {}).get(rate)
        return None if value is None else float(value)

    def source_line(self) -> str:
        return "; ".join(f"{s['url']} ({s.get('retrieved', 'date unknown')})" for s in self.sources)


def parse_table(doc: dict[str, Any]) -> PriceTable:
    return PriceTable(prices=doc.get("prices") or {}, sources=list(doc.get("sources") or []))


@cache
def default_table() -> PriceTable:
    return parse_table(yaml.safe_load(PRICES.read_text()))


@dataclass(frozen=True)
class SliceGroupCost:
    """What one slice group costs at list price; usd_per_chip_hour None when the table has no price for it."""

    group: str
    tpu_type: str
    region: str
    capacity: str
    chips: int
    rate: str  # the price-table column used
    usd_per_chip_hour: float | None

    @property
    def usd_per_hour(self) -> float | None:
        return None if self.usd_per_chip_hour is None else self.usd_per_chip_hour * self.chips

    @property
    def usd_per_month(self) -> float | None:
        return None if self.usd_per_hour is None else self.usd_per_hour * HOURS_PER_MONTH

    @property
    def basis(self) -> str:
        if self.capacity == "reservation" and self.rate == "on-demand":
            return "on-demand rate, no commitment price known"
        return RATE_LABELS[self.rate]


@dataclass(frozen=True)
class EnvironmentCost:
    groups: list[SliceGroupCost]

    @property
    def priced(self) -> list[SliceGroupCost]:
        return [g for g in self.groups if g.usd_per_chip_hour is not None]

    @property
    def unpriced(self) -> list[SliceGroupCost]:
        return [g for g in self.groups if g.usd_per_chip_hour is None]

    @property
    def usd_per_hour(self) -> float:
        return sum(g.usd_per_hour or 0.0 for g in self.groups)

    @property
    def usd_per_month(self) -> float:
        return self.usd_per_hour * HOURS_PER_MONTH

    def line(self) -> str:
        """One line for the plan summary."""
        if not self.groups:
            return "no TPU slices"
        parts = [f"{usd(self.usd_per_hour)}/hour, {usd(self.usd_per_month)}/month at list price"]
        if self.unpriced:
            parts.append("no price for " + ", ".join(
                f"{g.group} ({g.tpu_type} {g.capacity} in {g.region})" for g in self.unpriced) + ", not counted")
        if any(g.capacity == "flex-start" for g in self.groups):
            parts.append("flex-start pools are billed only while provisioned")
        return "; ".join(parts)


def slice_cost(group: str, tpu_type: str, region: str, capacity: str, chips: int,
               table: PriceTable | None = None) -> SliceGroupCost:
    table = table or default_table()
    rates = RATES_FOR_CAPACITY[capacity]
    for rate in rates:
        price = table.rate(tpu_type, region, rate)
        if price is not None:
            return SliceGroupCost(group, tpu_type, region, capacity, chips, rate, price)
    return SliceGroupCost(group, tpu_type, region, capacity, chips, rates[0], None)


def slice_groups(spec: Any) -> list[dict[str, Any]]:
    """An EnvironmentSpec's slice groups as the plain records pricing and `plan --diff` compare; chips counts every
    slice of the group. (The diff's runner writes the same record from an older revision's spec.)"""
    return [{"name": g.name, "tpu_type": g.tpu_type, "topology": g.topology, "capacity": g.capacity,
             "count": g.count, "chips": g.count * g.shape.chips} for g in spec.slices]


def environment_cost(slices: list[dict[str, Any]], region: str, table: PriceTable | None = None) -> EnvironmentCost:
    """slices: [{name, tpu_type, capacity, chips}] with chips = every slice of the group."""
    return EnvironmentCost([slice_cost(s["name"], s["tpu_type"], region, s["capacity"], s["chips"], table)
                            for s in slices])


def usd(value: float, signed: bool = False) -> str:
    sign = ("+" if value > 0 else "-" if value < 0 else "±") if signed else ("-" if value < 0 else "")
    return f"{sign}${abs(value):,.2f}"
