"""List prices from the repo's price tables: per capacity kind, per region, the system pool and the GKE cluster fee
besides the TPU slices, and "no price" / "not priced" instead of a guess."""

from __future__ import annotations

import pytest

from envspec import machines, zones
from infra.offline import cost, diff, render
from infra.offline.mockrun import run_stack
from tests.infra.conftest import stack_config

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


# ---------------------------------------------------------------- besides the TPU slices

GKE = cost.parse_gke_table({
    "sources": [{"url": "https://example.invalid/gke", "retrieved": "2026-11-01"}],
    "cluster_fee_usd_per_hour": 0.1,
    "machines": {"e2-standard-8": {"us-east5": {"on-demand": 0.25}}},
})
V6E = [{"name": "a", "tpu_type": "v6e", "capacity": "on-demand", "chips": 4}]


def test_the_system_pool_and_the_cluster_fee_are_counted() -> None:
    env = cost.environment_cost(V6E, "us-east5", TABLE, {"machine_type": "e2-standard-8", "nodes": 2}, GKE)
    assert env.tpu_usd_per_hour == pytest.approx(4 * 2.7)
    assert env.usd_per_hour == pytest.approx(4 * 2.7 + 2 * 0.25 + 0.1)
    assert env.usd_per_month == pytest.approx((4 * 2.7 + 2 * 0.25 + 0.1) * 730)
    assert env.line() == ("$11.40/hour, $8,322.00/month at list price (TPU slices $10.80, system pool "
                          "2 x e2-standard-8 $0.50, GKE cluster fee $0.10 per hour)")


def test_a_machine_or_region_the_table_lacks_is_not_priced() -> None:
    for machine, region in (("n2-standard-8", "us-east5"), ("e2-standard-8", "europe-west4")):
        env = cost.environment_cost([], region, TABLE, {"machine_type": machine, "nodes": 3}, GKE)
        [pool, fee] = env.others
        assert pool.usd_per_hour is None and fee.usd_per_hour == pytest.approx(0.1)
        assert env.usd_per_hour == pytest.approx(0.1)  # the fee alone: no neighbouring price stands in
        assert f"system pool 3 x {machine} not priced (no price for {machine} in {region}), not counted" in env.line()


def test_without_a_system_pool_the_slices_alone_are_priced() -> None:
    env = cost.environment_cost(V6E, "us-east5", TABLE)
    assert not env.others and env.line() == "$10.80/hour, $7,884.00/month at list price"


def test_a_shipped_environment_costs_its_slices_pool_and_fee() -> None:
    plan = run_stack("staging", stack_config("staging"))
    env = cost.environment_cost(cost.slice_groups(plan.spec), plan.spec.region, pool=cost.system_pool(plan.spec))
    gke = cost.default_gke_table()
    pool = 2 * gke.machine_rate("e2-standard-8", "us-east5")  # staging: 2 x e2-standard-8 in us-east5
    assert [(o.label, o.usd_per_hour) for o in env.others] == [
        ("system pool 2 x e2-standard-8", pytest.approx(pool)), ("GKE cluster fee", pytest.approx(0.10))]
    assert env.usd_per_hour == pytest.approx(env.tpu_usd_per_hour + pool + 0.10)
    summary = render.summarize(plan)
    assert dict(summary.facts())["Cost"] == env.line()
    assert "system pool 2 x e2-standard-8 $0.54, GKE cluster fee $0.10 per hour" in env.line()


def test_the_plan_says_not_priced_for_a_machine_type_the_table_lacks() -> None:
    raw = stack_config("staging")
    n2 = {**raw, "gke-tpu-rl:cluster": {**raw["gke-tpu-rl:cluster"],
                                        "systemPool": {"machineType": "n2-standard-8", "nodes": 2}}}
    line = dict(render.summarize(run_stack("staging", n2)).facts())["Cost"]
    assert "system pool 2 x n2-standard-8 not priced (no price for n2-standard-8 in us-east5), not counted" in line
    assert line.startswith("$86.50/hour") and "(TPU slices $86.40, GKE cluster fee $0.10 per hour)" in line


def test_the_diff_shows_a_system_pool_machine_change_per_hour() -> None:
    raw = stack_config("staging")
    bigger = {**raw, "gke-tpu-rl:cluster": {**raw["gke-tpu-rl:cluster"],
                                            "systemPool": {"machineType": "e2-standard-16", "nodes": 2}}}
    d = diff.compare("staging", "base", diff.snapshot(run_stack("staging", raw)),
                     diff.snapshot(run_stack("staging", bigger)))
    gke = cost.default_gke_table()
    delta = 2 * (gke.machine_rate("e2-standard-16", "us-east5") - gke.machine_rate("e2-standard-8", "us-east5"))
    before, after = d.cost_delta()
    assert after.usd_per_hour - before.usd_per_hour == pytest.approx(delta)
    [price] = [line for line in diff.headline(d) if line.startswith("List price:")]
    assert price.startswith(f"List price: +${delta:,.2f}/hour")
    assert "System pool: 2 x e2-standard-8 $0.54 → 2 x e2-standard-16 $1.07 per hour." in price
    assert "TPU chips: no change." in diff.headline(d)


def test_a_new_environment_counts_no_cluster_before_it() -> None:
    new = diff.snapshot(run_stack("staging", stack_config("staging")))
    d = diff.compare("staging", "base", diff.Snapshot("", [], {}, missing="no stack file"), new)
    before, after = d.cost_delta()
    assert before.usd_per_hour == 0 and not before.others
    assert after.usd_per_hour == pytest.approx(after.tpu_usd_per_hour + sum(o.usd_per_hour or 0 for o in after.others))


def test_the_gke_table_cites_its_sources_and_is_well_formed() -> None:
    table = cost.default_gke_table()
    assert table.sources and all(s["url"].startswith("https://") and s.get("retrieved") for s in table.sources)
    assert "https://cloud.google.com/kubernetes-engine/pricing" in {s["url"] for s in table.sources}
    assert table.cluster_fee_usd_per_hour == 0.10  # GKE Standard: $0.10 per cluster per hour
    for name, regions in table.machines.items():
        m = machines.machine(name)  # a type the system-pool check accepts
        for region, rates in regions.items():
            assert set(rates) == {"on-demand"}, (name, region)
            # E2 bills per vCPU and GiB, so within a region a type costs its vCPUs' share of e2-standard-2: a copying
            # slip shows here (the source rounds to 5 decimals).
            two = table.machines["e2-standard-2"][region]["on-demand"]
            assert rates["on-demand"] == pytest.approx(two * m.vcpus / 2, rel=5e-4), (name, region)


def test_every_region_with_a_tpu_zone_prices_the_system_pool() -> None:
    regions = {zones.region_of(z) for gen in zones.default_table().zones.values() for listed in gen.values()
               for z in listed}
    table = cost.default_gke_table()
    missing = {(name, r) for name in table.machines for r in regions if table.machine_rate(name, r) is None}
    assert missing == {(name, "us-central2") for name in table.machines}  # the source has no E2 rows there


# ---------------------------------------------------------------- the service's Cloud SQL instance and its engine

SQL = cost.parse_sql_table({
    "sources": [{"url": "https://example.invalid/sql", "retrieved": "2026-11-01"}],
    "regions": {"us-east5": {"vcpu_hour": 0.05, "memory_gib_hour": 0.01, "ssd_gb_month": 0.2}},
})
DB = {"tier": "db-custom-2-7680", "cpus": 2, "memory_gib": 7.5, "disk_gb": 73, "availability": "zonal"}


def test_cloud_sql_is_priced_per_vcpu_memory_and_ssd_and_twice_for_high_availability() -> None:
    zonal = cost.database_cost(DB, "us-east5", SQL)
    per_hour = 2 * 0.05 + 7.5 * 0.01 + 73 * 0.2 / 730
    assert zonal.usd_per_hour == pytest.approx(per_hour)
    assert zonal.label == "Cloud SQL db-custom-2-7680 zonal, 73 GB SSD"
    regional = cost.database_cost({**DB, "availability": "regional"}, "us-east5", SQL)
    assert regional.usd_per_hour == pytest.approx(2 * per_hour)  # a standby of the same size in a second zone
    missing = cost.database_cost(DB, "europe-west4", SQL)
    assert missing.usd_per_hour is None and missing.lacking == "Cloud SQL Enterprise in europe-west4"


def test_the_repo_sql_table_cites_its_sources_and_matches_them() -> None:
    table = cost.default_sql_table()
    assert table.sources and all(s["url"].startswith("https://") and s.get("retrieved") for s in table.sources)
    rates = table.rates("us-central1")
    assert rates == {"vcpu_hour": 0.0413, "memory_gib_hour": 0.0070, "ssd_gb_month": 0.17}
    # The infracost golden file it cites: db-custom-1-3840 zonal is $30.15 + $19.16 + $1.70 a month (10 GB SSD).
    one = cost.database_cost({"tier": "db-custom-1-3840", "cpus": 1, "memory_gib": 3.75, "disk_gb": 10,
                              "availability": "zonal"}, "us-central1")
    assert one.usd_per_hour * cost.HOURS_PER_MONTH == pytest.approx(30.15 + 19.16 + 1.70, abs=0.02)
    for region, found in table.regions.items():
        assert table.rates(region) is not None and all(0 < v < 1 for v in found.values()), region


def _service(group: str = "a", suspend: bool = False, shared: bool = False) -> dict:
    return {"machine_type": "e2-standard-8", "nodes": 2,
            "service": {"slice_group": group, "suspend": suspend, "shared": shared, "database": DB}}


def test_the_service_adds_its_database_beside_the_pool_and_the_fee() -> None:
    env = cost.environment_cost(V6E, "us-east5", TABLE, _service(), GKE, SQL)
    db = 2 * 0.05 + 7.5 * 0.01 + 73 * 0.2 / 730
    assert [o.name for o in env.others] == ["system pool", "GKE cluster fee", "Cloud SQL"]
    assert env.usd_per_hour == pytest.approx(4 * 2.7 + 2 * 0.25 + 0.1 + db)
    assert f"Cloud SQL db-custom-2-7680 zonal, 73 GB SSD {cost.usd(db)}" in env.line()
    # A region the table lacks: named, not counted, never a neighbour's price.
    west = cost.environment_cost([], "europe-west4", TABLE, _service(), GKE, SQL)
    assert ("Cloud SQL db-custom-2-7680 zonal, 73 GB SSD not priced (no price for Cloud SQL Enterprise in "
            "europe-west4), not counted") in west.line()


def test_suspending_an_engine_on_a_fixed_size_pool_saves_nothing() -> None:
    # Every non-flex-start TPU pool has a fixed node count (infra/components/slices.py node_count = the slice's hosts).
    running = cost.environment_cost(V6E, "us-east5", TABLE, _service(), GKE, SQL)
    assert running.suspended_usd_per_hour == pytest.approx(running.usd_per_hour)
    assert (f"with service.suspend the same {cost.usd(running.usd_per_hour)}/hour: the engine's slice group a "
            "(on-demand) is billed all the same (it has a fixed node count, billed whether the engine runs or not); "
            "suspending frees the slice for other work") in running.line()
    suspended = cost.environment_cost(V6E, "us-east5", TABLE, _service(suspend=True), GKE, SQL)
    assert suspended.usd_per_hour == pytest.approx(running.usd_per_hour)
    assert ("service.suspend is on: the engine's slice group a (on-demand) is still billed (it has a fixed node "
            "count, billed whether the engine runs or not); suspending frees the slice, not the bill"
            ) in suspended.line()


def test_suspending_an_engine_on_a_flex_start_pool_saves_its_slices() -> None:
    flex = cost.parse_table({"prices": {"v6e": {"us-east5": {"on-demand": 2.7, "flex-start": 1.5}}}})
    slices = [{"name": "a", "tpu_type": "v6e", "capacity": "flex-start", "chips": 16}]
    env = cost.environment_cost(slices, "us-east5", flex, _service(), GKE, SQL)
    assert env.suspended_usd_per_hour == pytest.approx(env.usd_per_hour - 16 * 1.5)
    assert (f"with service.suspend {cost.usd(env.usd_per_hour - 24)}/hour: the engine's slice group a (flex-start) "
            "scales to 0 nodes without the engine") in env.line()
    on = cost.environment_cost(slices, "us-east5", flex, _service(suspend=True), GKE, SQL)
    assert "service.suspend is on: the engine's slice group a (flex-start) scales to 0 nodes" in on.line()
    # The trainer on the same flex-start group may keep its nodes: no saving promised.
    shared = cost.environment_cost(slices, "us-east5", flex, _service(shared=True), GKE, SQL)
    assert shared.suspended_usd_per_hour == pytest.approx(shared.usd_per_hour)
    assert "(the trainer runs on it too)" in shared.line()
    # No flex-start price in the table: the slices are not counted, so suspending changes no total.
    unpriced = cost.environment_cost(slices, "us-east5", TABLE, _service(), GKE, SQL)
    assert "with service.suspend: the engine's slice group a (flex-start) scales to 0 nodes" in unpriced.line()


def test_the_tinker_plan_prices_its_database_and_says_what_suspending_saves() -> None:
    plan = run_stack("tinker", stack_config("tinker"))
    record = cost.system_pool(plan.spec)
    assert record["service"] == {"slice_group": "v6e-svc", "suspend": False, "shared": False, "database": {
        "tier": "db-custom-1-3840", "cpus": 1, "memory_gib": 3.75, "disk_gb": 10, "availability": "zonal"}}
    line = dict(render.summarize(plan).facts())["Cost"]
    env = cost.environment_cost(cost.slice_groups(plan.spec), "us-central1", pool=record)
    assert line == env.line()
    # 1 vCPU, 3.75 GiB and 10 GB of SSD at infra/offline/sql_prices.yaml's us-central1 rates.
    sql_hour = 0.0413 + 3.75 * 0.0070 + 10 * 0.17 / 730
    assert f"Cloud SQL db-custom-1-3840 zonal, 10 GB SSD ${sql_hour:.2f} per hour" in line
    assert "the engine's slice group v6e-svc (spot) is billed all the same (it has a fixed node count" in line
    # A region the table lacks is named, not counted (never priced from a neighbouring region).
    elsewhere = cost.environment_cost(cost.slice_groups(plan.spec), "us-east5", pool=record)
    assert ("Cloud SQL db-custom-1-3840 zonal, 10 GB SSD not priced (no price for Cloud SQL Enterprise in us-east5), "
            "not counted") in elsewhere.line()


def test_the_diff_shows_a_database_change_per_hour() -> None:
    raw = stack_config("tinker")
    bigger = {**raw, "gke-tpu-rl:service": {**raw["gke-tpu-rl:service"],
                                            "database": {"tier": "db-custom-2-7680", "availability": "regional"}}}
    d = diff.compare("tinker", "base", diff.snapshot(run_stack("tinker", raw)),
                     diff.snapshot(run_stack("tinker", bigger)))
    [price] = [line for line in diff.headline(d) if line.startswith("List price:")]
    # Twice the vCPUs and memory, and twice again for the standby of a regional instance.
    before = 0.0413 + 3.75 * 0.0070 + 10 * 0.17 / 730
    after = 2 * (2 * 0.0413 + 7.5 * 0.0070 + 10 * 0.17 / 730)
    assert (f"Cloud SQL: db-custom-1-3840 zonal, 10 GB SSD ${before:.2f} → db-custom-2-7680 regional, 10 GB SSD "
            f"${after:.2f} per hour.") in price
    assert f"+${after - before:.2f}/hour" in price
