"""List prices of an environment: its TPU slices from the price table in infra/offline/tpu_prices.yaml, and what it
costs besides them (the CPU system pool's VMs and the GKE cluster management fee) from infra/offline/gke_prices.yaml
and, with a service, its Cloud SQL instance from infra/offline/sql_prices.yaml, all copied from Google's prices with
their source and date. A combination a table lacks has no price: never a guess."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

PRICES = Path(__file__).with_name("tpu_prices.yaml")
GKE_PRICES = Path(__file__).with_name("gke_prices.yaml")
SQL_PRICES = Path(__file__).with_name("sql_prices.yaml")
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
class OtherCost:
    """A cost of the environment besides its TPU slices (the system pool, the GKE cluster fee); usd_per_hour None
    when infra/offline/gke_prices.yaml has no price for it ("not priced")."""

    name: str  # "system pool", "GKE cluster fee"
    detail: str  # what is billed, e.g. "2 x e2-standard-8"; "" when the name says it
    usd_per_hour: float | None
    lacking: str = ""  # what the table lacks when it is not priced, e.g. "e2-standard-8 in us-central2"

    @property
    def label(self) -> str:
        return f"{self.name} {self.detail}".rstrip()


@dataclass(frozen=True)
class EnvironmentCost:
    groups: list[SliceGroupCost]
    others: list[OtherCost] = field(default_factory=list)  # empty: the TPU slices alone were priced
    service: dict[str, Any] | None = None  # the service's record (service_record); None: no service

    @property
    def priced(self) -> list[SliceGroupCost]:
        return [g for g in self.groups if g.usd_per_chip_hour is not None]

    @property
    def unpriced(self) -> list[SliceGroupCost]:
        return [g for g in self.groups if g.usd_per_chip_hour is None]

    @property
    def unpriced_others(self) -> list[OtherCost]:
        return [o for o in self.others if o.usd_per_hour is None]

    @property
    def tpu_usd_per_hour(self) -> float:
        return sum(g.usd_per_hour or 0.0 for g in self.groups)

    @property
    def usd_per_hour(self) -> float:
        return self.tpu_usd_per_hour + sum(o.usd_per_hour or 0.0 for o in self.others)

    @property
    def usd_per_month(self) -> float:
        return self.usd_per_hour * HOURS_PER_MONTH

    def line(self) -> str:
        """One line for the plan summary."""
        if not self.groups and not self.others:
            return "no TPU slices"
        head = f"{usd(self.usd_per_hour)}/hour, {usd(self.usd_per_month)}/month at list price"
        if self.others:
            items = [f"TPU slices {usd(self.tpu_usd_per_hour)}"] + [
                f"{o.label} {usd(o.usd_per_hour)}" for o in self.others if o.usd_per_hour is not None]
            head += f" ({', '.join(items)} per hour)"
        parts = [head]
        if self.unpriced:
            parts.append("no price for " + ", ".join(
                f"{g.group} ({g.tpu_type} {g.capacity} in {g.region})" for g in self.unpriced) + ", not counted")
        parts += [f"{o.label} not priced (no price for {o.lacking}), not counted" for o in self.unpriced_others]
        if any(g.capacity == "flex-start" for g in self.groups):
            parts.append("flex-start pools are billed only while provisioned")
        note = self.suspend_note()
        if note:
            parts.append(note)
        return "; ".join(parts)

    @property
    def engine_group(self) -> SliceGroupCost | None:
        """The slice group the service's engine runs on."""
        name = (self.service or {}).get("slice_group")
        return next((g for g in self.groups if g.group == name), None)

    @property
    def suspended_usd_per_hour(self) -> float | None:
        """The price with the engine suspended (service.suspend): the same as running, but for a flex-start engine
        group the trainer does not share. Every other TPU node pool of this stack has a fixed node count
        (infra/components/slices.py sets node_count to the slice's hosts): its VMs exist, and are billed, whether a pod
        runs on them or not. A flex-start pool is autoscaled from 0 (queued provisioning): without a workload its nodes
        go away. None without a service."""
        group = self.engine_group
        if group is None:
            return None
        return self.usd_per_hour - ((group.usd_per_hour or 0.0) if self._scales_down(group) else 0.0)

    def _scales_down(self, group: SliceGroupCost) -> bool:
        return group.capacity == "flex-start" and not (self.service or {}).get("shared")

    def suspend_note(self) -> str | None:
        """What suspending the service's engine saves, and what not (one clause of the plan's cost line)."""
        group = self.engine_group
        if group is None:
            return None
        suspended = bool((self.service or {}).get("suspend"))
        g = f"the engine's slice group {group.group} ({group.capacity})"
        if self._scales_down(group):
            if suspended:
                return f"service.suspend is on: {g} scales to 0 nodes, billed only while provisioned"
            saved = "" if group.usd_per_hour is None else f" {usd(self.suspended_usd_per_hour or 0.0)}/hour"
            return f"with service.suspend{saved}: {g} scales to 0 nodes without the engine"
        why = ("the trainer runs on it too" if group.capacity == "flex-start"
               else "it has a fixed node count, billed whether the engine runs or not")
        if suspended:
            return f"service.suspend is on: {g} is still billed ({why}); suspending frees the slice, not the bill"
        return (f"with service.suspend the same {usd(self.usd_per_hour)}/hour: {g} is billed all the same ({why}); "
                "suspending frees the slice for other work")


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


def system_pool(spec: Any) -> dict[str, Any]:
    """An EnvironmentSpec's costs besides its TPU slices as the plain record pricing and `plan --diff` compare (the
    diff's runner writes the same record from an older revision's spec): the CPU system pool {machine_type, nodes},
    and with a service its record under "service" (service_record), whose Cloud SQL instance is priced beside the
    pool's VMs."""
    pool = spec.cluster.system_pool
    record: dict[str, Any] = {"machine_type": pool.machine_type, "nodes": pool.nodes}
    service = service_record(spec)
    if service is not None:
        record["service"] = service
    return record


def service_record(spec: Any) -> dict[str, Any] | None:
    """The service's part of the price as a plain record: its engine's slice group (and whether the engine is
    suspended, whether the trainer shares the group) and its Cloud SQL instance. None without a service."""
    svc = getattr(spec, "service", None)
    if svc is None:
        return None
    db, group = svc.database, spec.service_group
    trainer = spec.trainer_group if spec.trainer.enabled else None
    return {"slice_group": group.name, "suspend": svc.suspend,
            "shared": trainer is not None and trainer.name == group.name,
            "database": {"tier": db.tier, "cpus": db.cpus, "memory_gib": db.memory_gib, "disk_gb": db.disk_gb,
                         "availability": db.availability}}


# ---------------------------------------------------------------- besides the TPU slices


@dataclass(frozen=True)
class GkeTable:
    cluster_fee_usd_per_hour: float | None  # GKE's management fee per cluster
    machines: dict[str, dict[str, dict[str, float]]]  # machine type -> region -> rate -> USD per VM-hour
    sources: list[dict[str, Any]]

    def machine_rate(self, machine_type: str, region: str, rate: str = "on-demand") -> float | None:
        value = self.machines.get(machine_type, {}).get(region, {}).get(rate)
        return None if value is None else float(value)


def parse_gke_table(doc: dict[str, Any]) -> GkeTable:
    fee = doc.get("cluster_fee_usd_per_hour")
    return GkeTable(cluster_fee_usd_per_hour=None if fee is None else float(fee), machines=doc.get("machines") or {},
                    sources=list(doc.get("sources") or []))


@cache
def default_gke_table() -> GkeTable:
    return parse_gke_table(yaml.safe_load(GKE_PRICES.read_text()))


def cluster_costs(pool: dict[str, Any], region: str, table: GkeTable | None = None,
                  sql: SqlTable | None = None) -> list[OtherCost]:
    """The system pool's VMs (on-demand: the pool takes no spot or reservation setting), the cluster's management
    fee and, with a service, its Cloud SQL instance. pool: {machine_type, nodes, service?}, as system_pool() gives
    it."""
    table = table or default_gke_table()
    machine, nodes = pool["machine_type"], pool["nodes"]
    rate = table.machine_rate(machine, region)
    out = [OtherCost("system pool", f"{nodes} x {machine}", None if rate is None else rate * nodes,
                     f"{machine} in {region}"),
           OtherCost("GKE cluster fee", "", table.cluster_fee_usd_per_hour, "the cluster fee")]
    database = (pool.get("service") or {}).get("database")
    if database is not None:
        out.append(database_cost(database, region, sql))
    return out


def environment_cost(slices: list[dict[str, Any]], region: str, table: PriceTable | None = None,
                     pool: dict[str, Any] | None = None, gke: GkeTable | None = None,
                     sql: SqlTable | None = None) -> EnvironmentCost:
    """slices: [{name, tpu_type, capacity, chips}] with chips = every slice of the group. With `pool` (the system
    pool's record, and the service's in it) the environment's costs besides the TPU slices are counted too; without
    it, the slices alone."""
    return EnvironmentCost([slice_cost(s["name"], s["tpu_type"], region, s["capacity"], s["chips"], table)
                            for s in slices],
                           [] if pool is None else cluster_costs(pool, region, gke, sql),
                           None if pool is None else pool.get("service"))


# ---------------------------------------------------------------- the service's Cloud SQL instance

# A regional (high-availability) instance has a standby in a second zone with the same vCPUs, memory and disk, billed
# as much again (infra/offline/sql_prices.yaml).
SQL_AVAILABILITY_FACTOR = {"zonal": 1, "regional": 2}


@dataclass(frozen=True)
class SqlTable:
    regions: dict[str, dict[str, float]]  # region -> {vcpu_hour, memory_gib_hour, ssd_gb_month}, zonal, Enterprise
    sources: list[dict[str, Any]]

    def rates(self, region: str) -> dict[str, float] | None:
        found = self.regions.get(region)
        if not found or not {"vcpu_hour", "memory_gib_hour", "ssd_gb_month"} <= set(found):
            return None
        return {k: float(v) for k, v in found.items()}


def parse_sql_table(doc: dict[str, Any]) -> SqlTable:
    return SqlTable(regions=doc.get("regions") or {}, sources=list(doc.get("sources") or []))


@cache
def default_sql_table() -> SqlTable:
    return parse_sql_table(yaml.safe_load(SQL_PRICES.read_text()))


def database_cost(db: dict[str, Any], region: str, table: SqlTable | None = None) -> OtherCost:
    """The instance's vCPUs, memory and SSD (the configured disk_gb; autoresize may grow it), twice for a regional
    instance. Backups, point-in-time-recovery logs and egress are not counted (infra/offline/sql_prices.yaml).
    db: {tier, cpus, memory_gib, disk_gb, availability}, as service_record() gives it."""
    table = table or default_sql_table()
    detail = f"{db['tier']} {db['availability']}, {db['disk_gb']} GB SSD"
    rates = table.rates(region)
    if rates is None:
        return OtherCost("Cloud SQL", detail, None, f"Cloud SQL Enterprise in {region}")
    per_hour = (db["cpus"] * rates["vcpu_hour"] + db["memory_gib"] * rates["memory_gib_hour"]
                + db["disk_gb"] * rates["ssd_gb_month"] / HOURS_PER_MONTH)
    return OtherCost("Cloud SQL", detail, per_hour * SQL_AVAILABILITY_FACTOR[db["availability"]])


def usd(value: float, signed: bool = False) -> str:
    sign = ("+" if value > 0 else "-" if value < 0 else "±") if signed else ("-" if value < 0 else "")
    return f"{sign}${abs(value):,.2f}"
