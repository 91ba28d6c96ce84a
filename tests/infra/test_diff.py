"""`plan ENV --diff REF` on a throw-away git repository: what a pull request adds, removes and changes."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from infra.base.stack_file import PlanError
from infra.cli import main
from infra.offline import cost
from infra.offline import diff as diff_module
from infra.offline.diff import RESTARTS_TRAINING, Snapshot, changed_inputs, compare, diff_plan, headline, markdown
from infra.offline.plan import plan
from tests.infra.conftest import new_env_name

ROOT = Path(__file__).resolve().parents[2]
# The program and environments, and the image's build context (.dockerignore decides what of it the build sees).
COPIED = ("Pulumi.yaml", "environments", "envspec", "infra", "workloads", "trainer", "examples", ".dockerignore",
          "pyproject.toml", "README.md")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This project's program and environments, committed once as `base`."""
    repo = tmp_path_factory.mktemp("repo")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in COPIED:
        src = ROOT / name
        (shutil.copytree(src, repo / name, ignore=ignore) if src.is_dir() else shutil.copy(src, repo / name))
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-q", "-m", "base")
    _git(repo, "tag", "base")
    return repo


@pytest.fixture(scope="module", autouse=True)
def one_snapshot_per_commit() -> Iterator[None]:
    """Each environment at each commit is snapshotted once in this module: snapshot_at runs the revision's program in
    a fresh process (an extracted tree, its imports, the plan: 5-7 CPU-s a call), and four tests compare staging, and
    three dev, with the same `base`. Keyed by the commit the ref names, so a moved ref is planned anew; a ref that
    names none goes to the real snapshot_at, which says so."""
    real, done = diff_module.snapshot_at, {}

    def once(env: str, ref: str, root: Path) -> Snapshot:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                             capture_output=True, text=True)
        if rev.returncode != 0:
            return real(env, ref, root)
        key = (env, rev.stdout.strip(), root)
        if key not in done:
            done[key] = real(env, ref, root)
        return copy.deepcopy(done[key])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(diff_module, "snapshot_at", once)
        yield


def _edit_staging(repo: Path) -> None:
    path = repo / "environments" / "Pulumi.staging.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["config"]["gke-tpu-rl:slices"].append(
        {"name": "v6e-more", "tpuType": "v6e", "topology": "4x4", "count": 2, "capacity": "on-demand"})
    doc["config"]["gke-tpu-rl:trainer"]["maxRestarts"] = 5
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def test_a_new_slice_group_shows_chips_price_and_every_change(repo: Path) -> None:
    # A pull request's commit adds a slice group; its plan is compared with the base commit's.
    _edit_staging(repo)
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-q", "-am", "add slices")
    try:
        d = diff_plan(plan("staging", None, repo), "base", repo)
    finally:
        _git(repo, "reset", "-q", "--hard", "base")
    assert d.chips_delta == {"v6e": (32, 64)}
    added = {c.name for c in d.added}
    assert {"v6e-more-0", "v6e-more-1"} <= added and not d.removed
    changed = {c.name: c for c in d.changed}
    jobset = changed["jobset-rl-grpo-stg"]
    assert jobset.kubernetes and ("spec.failurePolicy.maxRestarts", 3, 5) in jobset.inputs
    assert jobset.replaced and jobset.consequence == RESTARTS_TRAINING  # failurePolicy is immutable (JobSet CEL)
    # Kueue's quota follows the chips: 32 -> 64 google.com/tpu.
    [quota] = [c for c in changed["clusterqueue-tpu-cluster-queue"].inputs if c[0].endswith("nominalQuota")
               and c[1] == 32]
    assert quota[2] == 64
    rate = cost.default_table().rate("v6e", "us-east5", "on-demand")
    before, after = d.cost_delta()
    if rate is None:
        assert any("No price for" in line for line in headline(d))
    else:
        assert after.usd_per_hour - before.usd_per_hour == pytest.approx(32 * rate)
        assert f"+${32 * rate:,.2f}/hour" in headline(d)[1]
    assert headline(d)[0] == "TPU chips: +32 v6e (32 → 64)."


def _commit(repo: Path, message: str) -> None:
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-q", "-am", message)


def test_a_pull_request_that_adds_a_slice_changes_a_flag_and_a_reward(repo: Path, capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The PR comment (`--format markdown`, as preview.yml posts it) for issue 42's change: the delta first, each
    part read as what it is, and one digest naming each revision's image in the diff and in the plan under it."""
    stack = repo / "environments" / "Pulumi.staging.yaml"
    doc = yaml.safe_load(stack.read_text())
    trainer = {k: v for k, v in doc["config"]["gke-tpu-rl:trainer"].items() if k != "stage"}
    doc["config"]["gke-tpu-rl:trainer"] = {**trainer, "code": "examples/my_tasks", "config": "configs/max-digit.yaml",
                                           "args": ["--set", "rl.group_size=8", "--set", "steps=60"]}
    stack.write_text(yaml.safe_dump(doc, sort_keys=False))
    _commit(repo, "the environment trains on its own code")
    # The pull request: a slice group, a trainer flag changed and one added, the reward's bonus halved.
    doc["config"]["gke-tpu-rl:slices"].append(
        {"name": "v6e-more", "tpuType": "v6e", "topology": "4x4", "count": 2, "capacity": "on-demand"})
    doc["config"]["gke-tpu-rl:trainer"]["args"] = ["--set", "rl.kl_beta=0.01", "--set", "rl.group_size=16",
                                                   "--set", "steps=60"]
    stack.write_text(yaml.safe_dump(doc, sort_keys=False))
    reward = repo / "examples" / "my_tasks" / "my_tasks" / "rewards.py"
    reward.write_text(reward.read_text().replace("0.5 if comp == tgt", "0.25 if comp == tgt"))
    monkeypatch.chdir(repo)
    try:
        assert main(["plan", "staging", "--diff", "HEAD", "--format", "markdown"]) == 0
    finally:
        _git(repo, "reset", "-q", "--hard", "base")
    out = capsys.readouterr().out
    assert out.startswith("### gke-tpu-rl plan diff: `staging` against `HEAD`")
    delta, plan_md = out.split("### gke-tpu-rl plan: `staging`")  # the delta first: what the reviewer decides on
    assert "- **TPU chips**: +32 v6e (32 → 64)." in delta and "| added | `v6e-more-0` |" in delta
    assert "- **Image**: rebuilt: your code (trainer.code examples/my_tasks): my_tasks/rewards.py (changed)." in delta
    container = "spec.replicatedJobs[name=slice].template.spec.template.spec.containers[name=trainer]"
    assert (f"under `{container}`:<br>`args --set rl.kl_beta`: `∅` → `0.01`<br>`args --set rl.group_size`: `8` → "
            "`16`<br>`image`: ") in delta
    assert "steps" not in delta and "…" not in delta  # no unchanged flag, nothing cut
    old, new = re.search(r"Stand-in digest ([0-9a-f]{12}) → ([0-9a-f]{12})", delta).groups()  # type: ignore[union-attr]
    digests = set(re.findall(r"trainer@sha256:([0-9a-f]{64})", plan_md))
    assert len(digests) == 1 and digests.pop().startswith(new)  # the tree and the outputs: the diff's new digest
    assert {d[:12] for d in re.findall(r"trainer@sha256:([0-9a-f]{64})", delta)} == {old, new}


def test_no_change_and_a_new_environment(repo: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    d = diff_plan(plan("dev", None, repo), "base", repo)
    assert d.empty and not d.chips_delta and headline(d)[-1] == "Resources: no change."
    # A stack file not yet committed: --diff compares the revision with the working tree, so it is a new environment
    # against any revision. (Its name is one no environments/ holds: a user's own `qa` would be in `base`.)
    new = new_env_name()
    new_env = repo / "environments" / f"Pulumi.{new}.yaml"
    shutil.copy(repo / "environments" / "Pulumi.dev.yaml", new_env)
    monkeypatch.chdir(repo)
    try:
        d = diff_plan(plan(new, None, repo), "base", repo)
        assert main(["plan", new, "--diff", "HEAD"]) == 0  # as the walkthrough runs it
    finally:
        new_env.unlink()
    assert d.old.missing and d.chips_delta == {"v6e": (0, 8)} and not d.removed and not d.changed
    assert headline(d)[0] == f"New environment: no environments/Pulumi.{new}.yaml at this revision."
    out = capsys.readouterr().out
    assert f"New environment: no environments/Pulumi.{new}.yaml at this revision." in out
    assert out.index("New environment") < out.index(f"plan: {new}")  # the delta first


def test_an_unknown_ref_is_a_clear_error(repo: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    message = "--diff no-such-ref: not a commit, branch or tag in this repository"
    with pytest.raises(PlanError) as e:
        diff_plan(plan("dev", None, repo), "no-such-ref", repo)
    assert str(e.value) == message  # git rev-parse --quiet prints nothing: the message is ours
    monkeypatch.chdir(repo)
    assert main(["plan", "dev", "--diff", "no-such-ref"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {message}\n" and captured.out == ""


def test_changed_inputs_are_leaf_paths_and_secrets_stay_masked() -> None:
    old = {"a": {"b": 1, "c": [{"d": "x"}]}, "s": "[secret]", "gone": True}
    new = {"a": {"b": 2, "c": [{"d": "y"}, {"d": "z"}]}, "s": "[secret]"}
    assert changed_inputs(old, new) == [("a.b", 1, 2), ("a.c[0].d", "x", "y"), ("a.c[1].d", None, "z"),
                                        ("gone", True, None)]
    # A secret that changed shows as masked on both sides: nothing to diff, nothing leaked.
    a = Snapshot("us-east5", [], {"u": {"type": "kubernetes:core/v1:Secret", "name": "s", "custom": True,
                                        "inputs": {"stringData": {"token": "[secret]"}}, "options": {}}})
    assert compare("dev", "x", a, a).empty


def _jobset_update_refused(old: dict, new: dict) -> bool:
    """JobSet v0.12.0's ValidateUpdate (pkg/webhooks/jobset_webhook.go:312-406): spec.replicatedJobs of an existing
    JobSet is immutable except, while it is suspended, the pod template's labels, annotations, node selector,
    tolerations and scheduling gates. A running (unsuspended) trainer JobSet is refused any other change."""
    return old["spec"]["replicatedJobs"] != new["spec"]["replicatedJobs"]


@pytest.mark.parametrize(("env", "kind"), [("staging", "JobSet"), ("dev", "RayJob")])
def test_a_trainer_change_replaces_the_training_job(repo: Path, env: str, kind: str) -> None:
    """A change under trainer/ rebuilds the image; its new digest changes the job's spec, which JobSet's webhook
    refuses to update in place (and KubeRay would not rerun a finished RayJob): the plan shows the job replaced."""
    source = repo / "trainer" / "rl" / "losses.py"
    original = source.read_text()
    source.write_text(original + "\n# a change a pull request makes\n")
    try:
        d = diff_plan(plan(env, None, repo), "base", repo)
    finally:
        source.write_text(original)
    image = [c for c in d.changed if c.type == "docker-build:index:Image"]
    assert len(image) == 1 and image[0].inputs[0] == ("stand-in digest", d.old.context, d.new.context)
    # The files it is built from that changed, by name: here one of the kit's.
    assert [(p, a is None, b is None) for p, a, b in d.changed_sources] == [("trainer/rl/losses.py", False, False)]
    assert ("file trainer/rl/losses.py", f"sha256:{d.old.sources['trainer/rl/losses.py'][:12]}",
            f"sha256:{d.new.sources['trainer/rl/losses.py'][:12]}") in image[0].inputs
    assert "Image: rebuilt: the kit: trainer/rl/losses.py (changed)." in "\n".join(headline(d))
    [job] = [c for c in d.changed if c.type.endswith(f":{kind}")]
    assert job.replaced and job.consequence == RESTARTS_TRAINING
    assert any(path.endswith(".image") for path, _, _ in job.inputs)
    # Nothing else is replaced but the staging Job, whose pod template holds the same image and is immutable
    # (review 2026-11-28 #7: workloads/stage.py REPLACE_ON_CHANGES).
    others = [c for c in d.changed if c.replaced and c is not job]
    assert [c.type for c in others] == ["kubernetes:batch/v1:Job"] and others[0].name.endswith("-stage")
    assert f"Replaced: {job.name} ({kind}): {RESTARTS_TRAINING}." in headline(d)
    assert f"**replaced** ({RESTARTS_TRAINING})" in markdown(d)
    if kind == "JobSet":
        old_obj = {"spec": {"replicatedJobs": [{"template": {"image": job.inputs[0][1]}}]}}
        new_obj = {"spec": {"replicatedJobs": [{"template": {"image": job.inputs[0][2]}}]}}
        assert _jobset_update_refused(old_obj, new_obj)
    # The same tree again: nothing rebuilt, nothing replaced.
    assert diff_plan(plan(env, None, repo), "base", repo).empty


def test_a_placement_change_replaces_the_jobset_at_the_same_cost(repo: Path) -> None:
    """issue 43: a trainer that samples on half of each host's chips and trains on the other half, lag 1. The plan's
    trainer line says so (text and markdown), the diff says what changed and that the JobSet is replaced (its args),
    and the chips and the price stay as they were."""
    from infra.offline import render

    stack = repo / "environments" / "Pulumi.staging.yaml"
    doc = yaml.safe_load(stack.read_text())
    trainer = doc["config"]["gke-tpu-rl:trainer"]
    trainer.update(slices=1, terminationGraceSeconds=900)  # one 4-host slice: a split within each host
    stack.write_text(yaml.safe_dump(doc, sort_keys=False))
    _commit(repo, "one slice")
    trainer["args"] = ["--set", "placement.mode=split", "--set", "mesh.slices=1", "--set", "placement.sampler.fsdp=-1",
                       "--set", "sampling.tensor=null", "--set", "rl.lag=1", "--set", "rl.lag_correction=decoupled"]
    stack.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        d = diff_plan(plan("staging", None, repo), "HEAD", repo)
    finally:
        _git(repo, "reset", "-q", "--hard", "base")
    said = ("sampling on 2 of each host's 4 chips (mesh 1x8x1), training on the other 2 (mesh 1x2x4), weights "
            "pushed every step, lag 1, decoupled")
    assert d.old.placement is None and d.new.placement == said
    assert f"Trainer placement: {diff_module.DEFAULT_PLACEMENT} → {said}." in headline(d)
    [job] = [c for c in d.changed if c.type.endswith(":JobSet")]
    assert job.replaced and f"Replaced: {job.name} (JobSet): {RESTARTS_TRAINING}." in headline(d)
    assert any(p.endswith("args --set placement.mode") and b == "split" for p, _, b in job.inputs), job.inputs
    assert "- **Trainer placement**: " in markdown(d)
    # Same chips, same price.
    assert not d.chips_delta and "TPU chips: no change." in headline(d)
    old_cost, new_cost = d.cost_delta()
    assert old_cost == new_cost and new_cost.usd_per_hour > 0
    assert d.new.plan is not None
    assert f"{said}; any change replaces it" in render.text(d.new.plan)
    assert "- **Trainer**: JobSet rl/grpo-stg: 1 x v6e-stg (4x4) = 4 pods x 4 chips" in render.markdown(d.new.plan)
    assert said in render.markdown(d.new.plan)
