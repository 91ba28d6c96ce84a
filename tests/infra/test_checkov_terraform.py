"""checkov's Terraform checks over the golden cdk.tf.json of every environment: each finding fixed or baselined, with
why. The same offline checkov as tests/infra/test_checkov.py, with --framework terraform_json (checkov reads
Terraform JSON as cdktf writes it). The findings are the GCP resources' own: the Pulumi program declares the same
settings (tests/infra/test_terraform_parity.py), so each reason holds for both renderers.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.terraform.document import STAGES
from tests.infra import test_checkov as checkov
from tests.infra.conftest import ENVIRONMENTS, ROOT
from tests.infra.test_checkov import pinned_version, run_checkov
from tests.infra.test_terraform import golden_path

BASELINE = Path(__file__).with_name("checkov_terraform_baseline.yaml")
CHECK_ID = re.compile(r"^CKV2?_(GCP|TF)_\d+$")


@dataclass(frozen=True)
class Finding:
    check: str
    resource: str  # ENV/STACK/<checkov's resource name>
    title: str


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    scan = tmp_path_factory.mktemp("checkov-terraform")
    for env in ENVIRONMENTS:
        for stack in STAGES:
            # checkov takes *.tf.json files; ENV/STACK.tf.json names where a finding is.
            (scan / env).mkdir(exist_ok=True)
            shutil.copy(golden_path(env, stack), scan / env / f"{stack}.tf.json")
    return run_checkov(scan, tmp_path_factory.mktemp("checkov-home"), framework="terraform_json")


def _findings(report: dict[str, object], outcome: str) -> list[Finding]:
    results = report["results"][outcome]  # type: ignore[index]
    out = []
    for r in results:
        env, stack = r["file_path"].strip("/").split("/")[:2]
        out.append(Finding(r["check_id"], f"{env}/{stack.split('.')[0]}/{r['resource']}", r["check_name"]))
    return out


def _terraform_resource(resource: str) -> bool:
    env, stack, name = (resource.split("/", 2) + ["", ""])[:3]
    return env in ENVIRONMENTS and stack in STAGES and bool(name)


def load_baseline() -> dict[tuple[str, str], str]:
    return checkov.load_baseline(BASELINE, CHECK_ID, _terraform_resource, "ENV/STACK/RESOURCE")


def test_checkov_scanned_every_stack_of_every_environment(report: dict[str, object]) -> None:
    summary = report["summary"]
    assert summary["checkov_version"] == pinned_version()  # type: ignore[index]
    assert summary["parsing_errors"] == 0  # type: ignore[index]
    passed = _findings(report, "passed_checks")
    # Every environment's GCP resources took checks, the cluster and the TPU node pools among them.
    for env in ENVIRONMENTS:
        scanned = {f.resource for f in passed if f.resource.startswith(f"{env}/gcp/")}
        assert len(scanned) >= 10, f"{env}: checkov checked only {sorted(scanned)}"
    assert len(passed) >= 200


def test_every_terraform_finding_is_fixed_or_baselined(report: dict[str, object]) -> None:
    baseline = load_baseline()
    failed = _findings(report, "failed_checks")
    new = sorted({f for f in failed if (f.check, f.resource) not in baseline}, key=lambda f: (f.check, f.resource))
    assert not new, ("checkov findings neither fixed nor in the baseline:\n"
                     + "\n".join(f"  {f.check} ({f.title}) on {f.resource}" for f in new)
                     + f"\nFix the resource in infra/ (both renderers follow), or add it to "
                     f"{BASELINE.relative_to(ROOT)} with the reason.")
    stale = sorted(set(baseline) - {(f.check, f.resource) for f in failed})
    assert not stale, f"{BASELINE.relative_to(ROOT)} accepts findings checkov no longer reports: {stale}"
