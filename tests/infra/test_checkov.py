"""checkov (PyPI) over every environment's rendered Kubernetes objects: each finding is fixed or baselined, with why.

checkov runs from its own venv ($(VENV)/checkov, `make install` builds it from tools/checkov-requirements.txt: it pins
packaging<24, older than the project's) and fully offline: no API key reaches it, --skip-download (and
BC_SKIP_MAPPING) stop the guideline/policy-metadata download, CKV_SKIP_PACKAGE_UPDATE_CHECK stops the PyPI version
check its banner makes at import, --framework kubernetes keeps the runners that call the platform (SCA, secrets) off,
and a dead proxy catches any request that would still try to leave.

checkov scans the pod templates of the kinds it knows (Pod, Job, Deployment, ...) but not a JobSet's, nested under
spec.replicatedJobs[].template: each replicated job is also written as the batch/v1 Job the JobSet controller stamps
out from it (same Job spec, named JOBSET-REPLICATEDJOB), so every pod and container check applies to the trainer.
A RayJob's pod templates (its RayCluster's head and worker groups) are written likewise as the Pods KubeRay makes
from them, named RAYJOB-head and RAYJOB-GROUP.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.offline.mockrun import PlanResult
from infra.offline.plan import kubernetes_objects, manifest_filenames
from tests.infra.conftest import ENVIRONMENTS, ROOT

BASELINE = Path(__file__).with_name("checkov_baseline.yaml")
REQUIREMENTS = ROOT / "tools" / "checkov-requirements.txt"
CHECKOV_ENV = "GKE_TPU_RL_CHECKOV"  # a checkov binary to use instead of the venv's
CHECK_ID = re.compile(r"^CKV2?_K8S_\d+$")
# checkov reads these (API keys, platform URLs, its own switches): none of the caller's may reach it.
FOREIGN_ENV = re.compile(r"^(BC_|PRISMA_|CKV_|CHECKOV_|LOG_LEVEL$)")
OFFLINE_ENV = {
    "BC_SKIP_MAPPING": "TRUE",  # as --skip-download: no guidelines or policy metadata from the platform
    "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true",  # no PyPI lookup for a newer checkov (made at import, by the banner)
    # Anything that still tried to reach out through requests/urllib fails at once instead of leaving the machine.
    "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "",
    "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": "",
}
MIN_PASSED_PER_POD_TEMPLATE = 40  # checkov 3.3 passes ~75 pod/container checks on each trainer Job


@dataclass(frozen=True)
class Finding:
    check: str
    resource: str  # ENV/KIND.NAMESPACE.NAME
    title: str = ""
    file: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.check, self.resource


@dataclass(frozen=True)
class Report:
    summary: dict[str, Any]
    failed: list[Finding]
    passed: list[Finding]
    documents: int
    pod_templates: list[str]  # ENV/KIND.NAMESPACE.NAME of each stand-in Job (JobSet) or Pod (RayJob)


def checkov_binary() -> Path:
    override = os.environ.get(CHECKOV_ENV)
    return Path(override) if override else Path(sys.prefix) / "checkov" / "bin" / "checkov"


def pinned_version() -> str:
    [version] = re.findall(r"^checkov==(\S+)$", REQUIREMENTS.read_text(), re.M)
    return version


def replicated_jobs(jobset: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Each replicated job of a JobSet as the batch/v1 Job it stands for, so checkov's pod checks reach its pods."""
    meta = jobset["metadata"]
    for rj in jobset["spec"]["replicatedJobs"]:
        template = rj["template"]
        yield {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{meta['name']}-{rj['name']}", "namespace": meta.get("namespace", "default"),
                         **{k: v for k, v in template.get("metadata", {}).items() if k in ("labels", "annotations")}},
            "spec": template["spec"],
        }


def ray_pods(rayjob: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The head and each worker group of a RayJob's RayCluster as a v1 Pod, so checkov's pod checks reach them."""
    meta, cluster = rayjob["metadata"], rayjob["spec"]["rayClusterSpec"]
    groups = [("head", cluster["headGroupSpec"]["template"])]
    groups += [(g["groupName"], g["template"]) for g in cluster["workerGroupSpecs"]]
    for name, template in groups:
        yield {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{meta['name']}-{name}", "namespace": meta.get("namespace", "default"),
                         **{k: v for k, v in template.get("metadata", {}).items() if k in ("labels", "annotations")}},
            "spec": template["spec"],
        }


def write_manifests(plans: dict[str, PlanResult], root: Path) -> tuple[int, list[str]]:
    """ROOT/ENV/kind-name.yaml per object, plus job-JOBSET-RJ.yaml per replicated job; returns the document count
    and the resources the Jobs become."""
    documents, pod_templates = 0, []
    for env in ENVIRONMENTS:
        objects = kubernetes_objects(plans[env])
        jobs = [job for o in objects if o["kind"] == "JobSet" for job in replicated_jobs(o)]
        jobs += [pod for o in objects if o["kind"] == "RayJob" for pod in ray_pods(o)]
        # Real Jobs and Pods (the staging Job) are scanned as they are; none may share a stand-in's name.
        real = [o for o in objects if o["kind"] in ("Job", "Pod")]
        stand_ins = {(j["kind"], j["metadata"]["namespace"], j["metadata"]["name"]) for j in jobs}
        clash = [o for o in real if (o["kind"], o["metadata"].get("namespace", "default"), o["metadata"]["name"])
                 in stand_ins]
        assert not clash, "a real Job or Pod collides with a stand-in"
        out = root / env
        out.mkdir(parents=True)
        for name, obj in zip(manifest_filenames(objects + jobs), objects + jobs, strict=True):
            (out / name).write_text(yaml.safe_dump(obj, sort_keys=False))
        # checkov scans a Deployment twice: itself, and its pod template as a Pod of its own.
        documents += len(objects) + len(jobs) + sum(o["kind"] == "Deployment" for o in objects)
        pod_templates += [f"{env}/{j['kind']}.{j['metadata']['namespace']}.{j['metadata']['name']}"
                          for j in jobs + real]
    return documents, pod_templates


def _findings(results: list[dict[str, Any]]) -> list[Finding]:
    # file_path is /ENV/kind-name.yaml under the scanned directory.
    return [Finding(r["check_id"], f"{r['file_path'].strip('/').split('/')[0]}/{r['resource']}", r["check_name"],
                    r["file_path"]) for r in results]


def run_checkov(directory: Path, home: Path, framework: str = "kubernetes") -> dict[str, Any]:
    binary = checkov_binary()
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        pytest.fail(f"checkov not found at {binary}: run `make install` (it builds that venv from "
                    f"{REQUIREMENTS.relative_to(ROOT)}), or point {CHECKOV_ENV} at a checkov {pinned_version()}")
    env = {k: v for k, v in os.environ.items() if not FOREIGN_ENV.match(k)}
    # A HOME of its own: no ~/.checkov.yaml of the caller's is read, and nothing is left in the real one.
    env.update(OFFLINE_ENV, HOME=str(home))
    cmd = [str(binary), "--directory", str(directory), "--framework", framework, "--output", "json", "--compact",
           "--skip-download", "--soft-fail"]
    proc = subprocess.run(cmd, cwd=home, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"checkov failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checkov printed no JSON report:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    # One framework gives one report; with none found checkov prints a bare summary without results.
    [report] = [r for r in (report if isinstance(report, list) else [report]) if r.get("check_type") == framework]
    return report


@pytest.fixture(scope="module")
def report(plans: dict[str, PlanResult], tmp_path_factory: pytest.TempPathFactory) -> Report:
    manifests = tmp_path_factory.mktemp("checkov-manifests")
    documents, pod_templates = write_manifests(plans, manifests)
    raw = run_checkov(manifests, tmp_path_factory.mktemp("checkov-home"))
    return Report(raw["summary"], _findings(raw["results"]["failed_checks"]),
                  _findings(raw["results"]["passed_checks"]), documents, pod_templates)


def _kubernetes_resource(resource: str) -> bool:
    return resource.split("/")[0] in ENVIRONMENTS and resource.count("/") == 1


def load_baseline(path: Path = BASELINE, check_id: re.Pattern[str] = CHECK_ID,
                  resource_ok: Callable[[str], bool] = _kubernetes_resource,
                  resource_form: str = "ENV/KIND.NAMESPACE.NAME") -> dict[tuple[str, str], str]:
    """(check, resource) -> reason, from a baseline's entries (each a set of checks over a set of resources)."""
    data = yaml.safe_load(path.read_text())
    baseline: dict[tuple[str, str], str] = {}
    for i, entry in enumerate(data["accepted"]):
        where = f"{path.name} entry {i} ({entry.get('checks')})"
        assert set(entry) == {"checks", "resources", "reason"}, f"{where}: keys are checks, resources, reason"
        reason = " ".join(str(entry["reason"]).split())
        assert len(reason) >= 40, f"{where}: say why the finding is accepted"
        assert entry["checks"] and entry["resources"], f"{where}: name the checks and the resources"
        for check in entry["checks"]:
            assert check_id.match(check), f"{where}: {check!r} is not a checkov check id of this framework"
            for resource in entry["resources"]:
                assert resource_ok(resource), f"{where}: {resource!r} is not {resource_form}"
                assert (check, resource) not in baseline, f"{where}: {check} on {resource} is listed twice"
                baseline[check, resource] = reason
    return baseline


def test_checkov_ran_over_every_object_of_every_environment(report: Report) -> None:
    s = report.summary
    assert s["checkov_version"] == pinned_version(), (
        f"checkov {s['checkov_version']} ran, {REQUIREMENTS.relative_to(ROOT)} pins {pinned_version()}: "
        "run `make install`")
    assert s["parsing_errors"] == 0
    # Every document written was parsed as a resource: none was skipped as not Kubernetes.
    assert s["resource_count"] == report.documents > 0
    assert s["passed"] == len(report.passed) > 0 and s["failed"] == len(report.failed)
    # The trainer's pods were really checked: each environment's JobSet or RayJob pod templates, as their Jobs or
    # Pods, took the pod and container checks.
    assert {r.split("/")[0] for r in report.pod_templates} == set(ENVIRONMENTS)
    for resource in report.pod_templates:
        checked = [f for f in report.passed + report.failed if f.resource == resource]
        assert len(checked) >= MIN_PASSED_PER_POD_TEMPLATE, f"checkov ran only {len(checked)} checks on {resource}"


def test_every_finding_is_fixed_or_baselined(report: Report) -> None:
    baseline = load_baseline()
    new = sorted({f for f in report.failed if f.key not in baseline}, key=lambda f: f.key)
    assert not new, (
        "checkov findings neither fixed nor in the baseline:\n"
        + "\n".join(f"  {f.check} ({f.title}) on {f.resource} [{f.file}]" for f in new)
        + "\nFix the object (workloads/, infra/offline/render.py), or, where the check does not fit, add the check "
        f"and resource to {BASELINE.relative_to(ROOT)} with the reason. (JobSet pod templates are scanned as "
        "Job.NAMESPACE.JOBSET-REPLICATEDJOB, RayJob ones as Pod.NAMESPACE.RAYJOB-GROUP.)")


def test_baseline_holds_only_current_findings(report: Report) -> None:
    found = {f.key for f in report.failed}
    stale = sorted(set(load_baseline()) - found)
    assert not stale, (
        f"{BASELINE.relative_to(ROOT)} accepts findings checkov no longer reports (fixed, renamed or gone): "
        + ", ".join(f"{check} on {resource}" for check, resource in stale) + "; remove them")


def test_stand_in_jobs_carry_the_jobset_pod_template(plans: dict[str, PlanResult]) -> None:
    # What checkov sees as the Job is exactly what the JobSet would stamp out, pod template included.
    for env in ENVIRONMENTS:
        for jobset in (o for o in kubernetes_objects(plans[env]) if o["kind"] == "JobSet"):
            jobs = list(replicated_jobs(jobset))
            assert [j["spec"] for j in jobs] == [rj["template"]["spec"] for rj in jobset["spec"]["replicatedJobs"]]
            assert all(j["spec"]["template"]["spec"]["containers"] for j in jobs)


def test_stand_in_pods_carry_the_rayjob_pod_templates(plans: dict[str, PlanResult]) -> None:
    rayjobs = [o for env in ENVIRONMENTS for o in kubernetes_objects(plans[env]) if o["kind"] == "RayJob"]
    assert rayjobs, "no environment runs the trainer on Ray: the Ray path's pods would go unscanned"
    for rayjob in rayjobs:
        cluster = rayjob["spec"]["rayClusterSpec"]
        templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
        assert [p["spec"] for p in ray_pods(rayjob)] == [t["spec"] for t in templates]
