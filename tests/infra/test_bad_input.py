"""A careless or hostile user's stack configs: hundreds of bad values generated from the real environment files.

Each case must end the offline plan (what `pulumi up` runs, under mocks) with exit 2, no traceback, the key named
(`gke-tpu-rl:` path, the stack name, or file:line) and not one resource registered. Every generated value is bad
by the backend's own rule, built so by construction (not by asking our validator).
"""

from __future__ import annotations

import contextlib
import copy
import io
import ipaddress
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra import cli
from infra.offline import mockrun
from tests.infra.conftest import ENVIRONMENTS, stack_config

NS = "gke-tpu-rl:"
STACK_CASES = 300


@dataclass
class Case:
    kind: str
    env: str
    doc: dict[str, Any]  # the stack file's `config:` map
    expect: str  # must appear in the error
    stack_name: str | None = None  # run as this stack name instead of env
    duplicate: str | None = None  # a `config:` line appended again (duplicate key)


def _get(doc: dict[str, Any], path: str) -> Any:
    top, *rest = path.split(".")
    node = doc[NS + top]
    for p in rest:
        node = node[int(p)] if p.isdigit() else node[p]
    return node


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    top, *rest = path.split(".")
    if not rest:
        doc[NS + top] = value
        return
    node = doc.setdefault(NS + top, {})
    for p in rest[:-1]:
        node = node[int(p)] if p.isdigit() else node.setdefault(p, {})
    last = rest[-1]
    node[int(last) if last.isdigit() else last] = value


def _key(path: str) -> str:
    """`slices.0.count` -> `gke-tpu-rl:slices[0].count`, as errors name it."""
    out = ""
    for p in path.split("."):
        out += f"[{p}]" if p.isdigit() else ("." if out else "") + p
    return NS + out


# ---------------------------------------------------------------- values bad by construction

# Kubernetes names (DNS-1123 label): no capitals, no '_', '.', or other characters, no leading or trailing '-',
# not empty, at most 63 characters.
BAD_LABEL = st.one_of(
    st.from_regex(r"\A[a-z]{1,8}[A-Z][a-z]{0,4}\Z"),
    st.from_regex(r"\A[a-z]{1,8}[_.!@ /:][a-z]{1,8}\Z"),
    st.from_regex(r"\A-[a-z]{1,8}\Z"),
    st.from_regex(r"\A[a-z]{1,8}-\Z"),
    st.just(""),
    st.integers(64, 90).map(lambda n: "a" * n),
)
# DNS-1123 subdomain: as above but '.' separates labels, so it is bad only next to another '.' or at an end.
BAD_SUBDOMAIN = st.one_of(
    st.from_regex(r"\A[a-z]{1,8}[A-Z][a-z]{0,4}\Z"),
    st.from_regex(r"\A[a-z]{1,8}[_!@ /:][a-z]{1,8}\Z"),
    st.from_regex(r"\A[a-z]{1,8}\.\.[a-z]{1,8}\Z"),
    st.from_regex(r"\A-[a-z]{1,8}\Z"),
    st.just(""),
    st.integers(254, 300).map(lambda n: "a" * n),
)
# JobSet names (DNS-1035): also not starting with a digit; 48 characters leave no room for the pod names.
BAD_JOBSET_NAME = st.one_of(BAD_LABEL, st.from_regex(r"\A[0-9][a-z]{1,6}\Z"),
                            st.integers(48, 70).map(lambda n: "a" * n))
BAD_PROJECT = st.one_of(
    st.from_regex(r"\A[a-z][a-z0-9]{0,3}\Z"),  # under 6 characters
    st.from_regex(r"\A[a-z][a-z0-9]{3,10}[A-Z_.][a-z]{1,4}\Z"),
    st.from_regex(r"\A[0-9][a-z0-9]{5,10}\Z"),
    st.from_regex(r"\A[a-z][a-z0-9]{5,10}-\Z"),
    st.integers(31, 40).map(lambda n: "p" * n),
)
BAD_LABEL_KEY = st.one_of(
    st.from_regex(r"\A[a-z]{1,6}[A-Z.\/ :][a-z]{0,4}\Z"),
    st.from_regex(r"\A[0-9_-][a-z]{0,6}\Z"),
    st.integers(64, 80).map(lambda n: "k" * n),
)
BAD_LABEL_VALUE = st.one_of(
    st.from_regex(r"\A[a-z]{0,6}[A-Z.\/ :@][a-z]{0,4}\Z"),
    st.integers(64, 80).map(lambda n: "v" * n),
)
BAD_IMAGE = st.one_of(
    st.from_regex(r"\Aus-docker\.pkg\.dev/[a-z]{3,8}/[a-z]{1,6}[A-Z][a-z]{0,4}:v1\Z"),  # capitals in the path
    st.from_regex(r"\A[a-z]{3,8}:[a-z]{1,4}:[a-z]{1,4}\Z"),  # two tags
    st.from_regex(r"\A[a-z]{3,8}/[a-z]{3,8}:\Z"),  # empty tag
    st.from_regex(r"\A[a-z]{3,8} [a-z]{3,8}\Z"),
    st.from_regex(r"\A[a-z]{3,8}@sha256:[a-f0-9]{1,31}\Z"),  # short digest
    st.from_regex(r"\A[-_.][a-z]{3,8}\Z"),
    st.just(""),
)
BAD_TAG = st.one_of(
    st.from_regex(r"\A[.-][a-z0-9]{0,8}\Z"),
    st.from_regex(r"\A[a-z]{1,6}[ /:@+][a-z]{1,6}\Z"),
    st.integers(129, 140).map(lambda n: "t" * n),
    st.just(""),
)
BAD_SEMVER = st.one_of(
    st.sampled_from(["latest", "", "main"]),
    st.from_regex(r"\Av[0-9]\.[0-9]{1,2}\.[0-9]\Z"),
    st.from_regex(r"\A[0-9]\.[0-9]{1,2}\Z"),
    st.from_regex(r"\A[0-9]\.[0-9]\.[0-9]\.[0-9]\Z"),
    st.from_regex(r"\A0[0-9]\.[0-9]\.[0-9]\Z"),
)
NOT_A_CIDR = st.one_of(
    st.sampled_from(["10.0.0.0", "abc", "10.0.0.0/33", "300.1.0.0/16", "10.0.0.0/-1", ""]),
    st.integers(1, 255).map(lambda h: f"10.9.8.{h}/24"),  # host bits set
)
PROHIBITED = st.sampled_from(["127.0.0.0/16", "169.254.0.0/20", "224.0.0.0/16", "0.0.0.0/16", "239.1.0.0/24"])


def _prefix_out_of_range(p: int) -> str:
    return str(ipaddress.ip_network(f"10.0.0.0/{p}", strict=False))


BAD_SUBNET = st.one_of(NOT_A_CIDR, PROHIBITED, st.sampled_from([1, 2, 5, 7, 30, 31, 32]).map(_prefix_out_of_range))
RANGE_KEYS = ("network.nodeCidr", "network.podCidr", "network.serviceCidr", "network.masterCidr")
WRONG_TYPE = st.one_of(st.just([1, 2]), st.just({"a": 1}), st.from_regex(r"\A[a-z]{3,8}\Z"))


# ---------------------------------------------------------------- mutations


@st.composite
def stack_cases(draw: st.DrawFn, kind: str) -> Case:
    env = draw(st.sampled_from(ENVIRONMENTS))
    doc = copy.deepcopy(stack_config(env))
    return _MUTATIONS[kind](draw, env, doc, kind)


def _one(path: str, values: st.SearchStrategy[Any]) -> Any:
    def mutate(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
        _set(doc, path, draw(values))
        return Case(kind, env, doc, _key(path))
    return mutate


def _slice_field(field: str, values: st.SearchStrategy[Any]) -> Any:
    def mutate(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
        i = draw(st.integers(0, len(doc[NS + "slices"]) - 1))
        _set(doc, f"slices.{i}.{field}", draw(values))
        return Case(kind, env, doc, _key(f"slices.{i}.{field}"))
    return mutate


def _unknown_key(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
    section = draw(st.sampled_from(["", "network", "cluster", "storage", "trainer", "queues", "controllers",
                                    "cluster.systemPool", "network.dranet", "slices.0"]))
    key = draw(st.from_regex(r"\A[a-z]{2,6}[A-Z][a-z]{2,6}\Z").filter(lambda k: k not in ("versionPrefix",)))
    path = f"{section}.{key}" if section else key
    _set(doc, path, draw(st.one_of(st.integers(), st.text(max_size=5))))
    return Case(kind, env, doc, f"{_key(path)}: unknown key")


def _overlap(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
    """One range moved inside (or around) another."""
    a, b = draw(st.permutations(RANGE_KEYS))[:2]
    net = doc.get(NS + "network", {})
    current = {k: ipaddress.ip_network(net.get(k.split(".")[1], _DEFAULTS[k])) for k in RANGE_KEYS}
    target = current[a]
    if b == "network.masterCidr":
        new = next(target.subnets(new_prefix=28)) if target.prefixlen <= 28 else target.supernet(new_prefix=28)
    elif a == "network.masterCidr":
        new = target.supernet(new_prefix=draw(st.integers(16, 27)))
    else:
        new = target if target.prefixlen >= 20 else next(target.subnets(new_prefix=draw(st.integers(
            target.prefixlen, 29))))
    _set(doc, b, str(new))
    return Case(kind, env, doc, _key(b))


def _overlap_dranet(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
    """A cluster range over the DRANET subnets the stack derives (10.200.0.0/16, ...), where DRANET is on."""
    net = doc.get(NS + "network", {})
    if not net.get("dranet", {}).get("enabled"):
        return _overlap(draw, env, doc, "overlapping ranges")
    key = draw(st.sampled_from(RANGE_KEYS[:3]))
    for other in RANGE_KEYS[:3]:  # keep the cluster's own ranges apart, so the DRANET clash is the first
        if other != key and ipaddress.ip_network(net.get(other.split(".")[1], _DEFAULTS[other])).overlaps(
                ipaddress.ip_network("10.192.0.0/10")):
            return _overlap(draw, env, doc, "overlapping ranges")
    _set(doc, key, draw(st.sampled_from(["10.192.0.0/10", "10.200.0.0/20", "10.201.64.0/18", "10.128.0.0/9"])))
    return Case(kind, env, doc, "network.dranet.cidrs[")


_DEFAULTS = {"network.nodeCidr": "10.0.0.0/20", "network.podCidr": "10.16.0.0/14",
             "network.serviceCidr": "10.20.0.0/20", "network.masterCidr": "172.16.0.0/28"}


def _master_not_28(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
    p = draw(st.integers(8, 32).filter(lambda p: p != 28))
    _set(doc, "network.masterCidr", str(ipaddress.ip_network(f"172.16.0.0/{p}", strict=False)))
    return Case(kind, env, doc, _key("network.masterCidr"))


def _bad_labels(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
    labels = dict(doc.get(NS + "labels", {}))
    how = draw(st.sampled_from(["key", "value", "count"]))
    if how == "key":
        labels[draw(BAD_LABEL_KEY)] = "x"
    elif how == "value":
        labels[draw(st.sampled_from(["team", "owner", "cost-center"]))] = draw(BAD_LABEL_VALUE)
    else:
        labels.update({f"l{i}": "v" for i in range(draw(st.integers(65, 80)))})
    doc[NS + "labels"] = labels
    return Case(kind, env, doc, NS + "labels")


def _priority(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
    value = draw(st.one_of(st.integers(min_value=2**31), st.integers(max_value=-(2**31) - 1)))
    classes = {"low": 100, "default": 500, "high": 1000, draw(st.sampled_from(["low", "urgent"])): value}
    _set(doc, "queues.priorityClasses", classes)
    return Case(kind, env, doc, _key("queues.priorityClasses"))


def _priority_name(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
    _set(doc, "queues.priorityClasses", {"low": 100, "default": 500, "high": 1000, draw(BAD_LABEL): 7})
    return Case(kind, env, doc, _key("queues.priorityClasses"))


def _stack_name(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
    name = draw(st.one_of(BAD_LABEL.filter(bool), st.from_regex(r"\A[0-9][a-z]{1,5}\Z"),
                          st.integers(22, 40).map(lambda n: "e" * n)))
    return Case(kind, env, doc, "stack name", stack_name=name)


def _duplicate(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
    key = draw(st.sampled_from(sorted(k for k, v in doc.items() if not isinstance(v, dict | list))))
    return Case(kind, env, doc, "duplicate key", duplicate=f"  {key}: {yaml.safe_dump(doc[key]).splitlines()[0]}")


def _trainer_name_too_long(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
    # <name>-slice-<slices-1>-<hosts-1>-abcde must fit 63 characters (JobSet's webhook); checked for a trainer that
    # is deployed.
    _set(doc, "trainer.name", "t" * draw(st.integers(50, 63)))
    _set(doc, "trainer.enabled", True)
    return Case(kind, env, doc, _key("trainer.name"))


def _service_one(path: str, values: st.SearchStrategy[Any]) -> Any:
    """A bad service setting, in the environment that runs the service."""
    def mutate(draw: st.DrawFn, env: str, doc: dict[str, Any], kind: str) -> Case:
        doc = copy.deepcopy(stack_config("tinker"))
        _set(doc, path, draw(values))
        return Case(kind, "tinker", doc, _key(path))
    return mutate


_MUTATIONS: dict[str, Any] = {
    "unknown key": _unknown_key,
    "overlapping ranges": _overlap,
    "range over the derived DRANET subnets": _overlap_dranet,
    "control plane not a /28": _master_not_28,
    "bad node range": _one("network.nodeCidr", BAD_SUBNET),
    "bad pod range": _one("network.podCidr", BAD_SUBNET),
    "bad service range": _one("network.serviceCidr", BAD_SUBNET),
    "bad master range": _one("network.masterCidr", st.one_of(NOT_A_CIDR, st.just("127.0.0.0/28"))),
    "bad DRANET range": _one("network.dranet.cidrs", BAD_SUBNET.map(lambda c: [c, "10.210.0.0/16"])),
    "bad labels": _bad_labels,
    "bad project": _one("project", BAD_PROJECT),
    "bad region": _one("region", st.from_regex(r"\A[a-z]{3,8}[0-9]?\Z")),
    "zone outside region": _one("zone", st.sampled_from(["europe-west4-a", "asia-east1-b", "us-central1-c"])),
    "stack name": _stack_name,
    "duplicate key": _duplicate,
    "queue namespace": _one("queues.namespace", BAD_LABEL),
    "local queue": _one("queues.localQueue", BAD_LABEL),
    "cluster queue": _one("queues.clusterQueue", BAD_SUBDOMAIN),
    "priority out of int32": _priority,
    "priority class name": _priority_name,
    "controllers namespace": _one("controllers.namespace", BAD_LABEL),
    "jobset chart version": _one("controllers.jobsetVersion", BAD_SEMVER),
    "kueue chart version": _one("controllers.kueueVersion", BAD_SEMVER),
    "trainer name": _one("trainer.name", BAD_JOBSET_NAME),
    "trainer name too long for pods": _trainer_name_too_long,
    "trainer service account": _one("trainer.serviceAccount", BAD_LABEL),
    "trainer image": _one("trainer.image", BAD_IMAGE),
    "trainer image tag": _one("trainer.imageTag", BAD_TAG),
    "soft delete days": _one("storage.softDeleteDays", st.one_of(st.integers(1, 6), st.integers(max_value=-1),
                                                                 st.integers(min_value=91))),
    "storage location": _one("storage.location", st.from_regex(r"\A[a-z]{2,5}[ _./][a-z]{1,5}\Z")),
    "slice group name": _slice_field("name", BAD_LABEL),
    "slice count": _slice_field("count", st.one_of(st.integers(max_value=0), st.integers(min_value=65))),
    "tpu type": _slice_field("tpuType", st.from_regex(r"\Av[0-9]{2}[a-z]?\Z")),
    "topology": _slice_field("topology", st.from_regex(r"\A[0-9]{1,2}x[0-9]{1,2}x?[0-9]?\Z").filter(
        lambda t: t not in ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16", "2x2x1", "2x2x2", "2x2x4",
                            "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8"))),
    "capacity": _slice_field("capacity", st.from_regex(r"\A[a-z]{3,9}\Z")),
    "slice type": _slice_field("count", WRONG_TYPE),
    "system pool nodes": _one("cluster.systemPool.nodes", st.one_of(st.integers(max_value=0),
                                                                   st.integers(min_value=21), WRONG_TYPE)),
    "machine type": _one("cluster.systemPool.machineType", st.one_of(
        st.from_regex(r"\A[A-Z][a-z0-9]{1,3}-standard-[0-9]\Z"), st.from_regex(r"\A[a-z0-9]{2,3}_standard\Z"),
        st.just(""))),
    "release channel": _one("cluster.releaseChannel", st.sampled_from(["rapid", "FAST", "", "EXTENDED"])),
    "endpoint": _one("cluster.controlPlaneEndpoint", st.sampled_from(["public", "DNS", "private", ""])),
    "max restarts": _one("trainer.maxRestarts", st.one_of(st.integers(max_value=-1), st.integers(min_value=101))),
    "grace seconds": _one("trainer.terminationGraceSeconds",
                          st.one_of(st.integers(max_value=29), st.integers(min_value=3601))),
    "dranet mtu": _one("network.dranet.mtu", st.one_of(st.integers(max_value=1459), st.integers(min_value=8897))),
    "authorized range": _one("cluster.masterAuthorizedCidrs", NOT_A_CIDR.map(lambda c: [c])),
    "version prefix": _one("cluster.versionPrefix", st.from_regex(r"\A[0-9]\.[0-9]{2}\.[0-9]-gke\Z")),
    "service config": _service_one("service.config", st.sampled_from(
        ["qwen3-0.6b-grpo-v6e-2x2.yaml", "missing.yaml", "../x.yaml"])),
    "service name": _service_one("service.name", st.one_of(BAD_LABEL, st.just("t" * 32))),
    "service slice group": _service_one("service.sliceGroup", st.sampled_from(["v5p-prod", "nope"])),
    "service priority": _service_one("service.priority", st.sampled_from(["urgent", "max"])),
    "database tier": _service_one("service.database.tier", st.sampled_from(
        ["db-f1-micro", "db-custom-3-7680", "db-custom-1-512", "db-custom-2-7681", "db-n1-standard-1"])),
    "database range": _service_one("service.database.privateServiceCidr", st.one_of(
        BAD_SUBNET, st.sampled_from(["10.0.0.0/22", "10.16.0.0/16", "10.24.0.0/25"]))),
    "service access": _service_one("service.access", st.sampled_from(
        [{"internalLoadBalancer": True}, {"allowedCidrs": ["10.128.0.0/9"]}])),
}


# ---------------------------------------------------------------- running


class _Recording(mockrun.RecordingMonitor):
    made: list[mockrun.RecordingMonitor] = []

    def __init__(self, mocks: Any) -> None:
        super().__init__(mocks)
        _Recording.made.append(self)


def _run(case: Case, workdir: Path) -> tuple[int, str]:
    name = case.stack_name or case.env
    text = yaml.safe_dump({"config": case.doc}, sort_keys=False)
    if case.duplicate:
        text += case.duplicate + "\n"
        case.expect = f"{workdir / 'Pulumi.yaml'}:{len(text.splitlines())}: duplicate key"
    path = workdir / "Pulumi.yaml"
    path.write_text(text)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["plan", name, "--config-file", str(path)])
    return rc, err.getvalue()


def test_bad_stack_configs_are_refused_by_name_before_any_resource(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mockrun, "RecordingMonitor", _Recording)
    kinds: Counter[str] = Counter()
    workdir = Path(tempfile.mkdtemp(prefix="bad-stack-"))

    def check(case: Case) -> None:
        _Recording.made.clear()
        rc, err = _run(case, workdir)
        kinds[case.kind] += 1
        assert rc == 2, f"{case.kind}: accepted (exit {rc}); {err}"
        assert "Traceback" not in err, err
        assert case.expect in err, f"{case.kind}: the error does not name {case.expect!r}:\n{err}"
        registered = [r.type for m in _Recording.made for r in m.registrations]
        assert registered == [], f"{case.kind}: registered {registered} before refusing"

    # Every kind of mistake gets its share of the cases.
    per_kind = -(-STACK_CASES // len(_MUTATIONS))
    for kind in sorted(_MUTATIONS):
        settings(max_examples=per_kind, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])(
            given(case=stack_cases(kind))(check))()
    assert sum(kinds.values()) >= STACK_CASES
    assert set(kinds) == set(_MUTATIONS)


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_the_environment_files_themselves_pass(env: str, tmp_path: Path) -> None:
    """The campaign's baseline: each environment file as it is plans cleanly through the same path."""
    rc, err = _run(Case("none", env, stack_config(env), ""), tmp_path)
    assert rc == 0, err
