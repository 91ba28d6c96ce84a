"""trainer.code: an environment's own tasks and rewards, built into the image, named in the trainer config, checked
at plan time, and a change to them rebuilding the image and replacing the job on `plan --diff`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from envspec.config import ConfigError
from envspec.pod import USER_CODE_DIR
from infra.base import user_code
from infra.components import image
from infra.offline.mockrun import IMAGE_TYPE, PlanResult, run_stack
from tests.infra.conftest import stack_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/my_tasks"
JOBSET = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"


def _config(**trainer: Any) -> dict[str, Any]:
    """staging's stack config with the trainer section changed (no staging: the example trains from random init)."""
    cfg = stack_config("staging")
    t = {k: v for k, v in cfg["gke-tpu-rl:trainer"].items() if k != "stage"}
    cfg["gke-tpu-rl:trainer"] = {**t, **trainer}
    return cfg


def _one(result: PlanResult, type_: str) -> dict[str, Any]:
    [r] = [r for r in result.resources if r.type == type_]
    return r.inputs


def _container(result: PlanResult) -> dict[str, Any]:
    jobset = _one(result, JOBSET)
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]


def test_the_folder_is_the_images_user_code_context_and_its_digest_a_build_arg() -> None:
    result = run_stack("staging", _config(code=EXAMPLE, config="configs/max-digit.yaml"))
    img = _one(result, IMAGE_TYPE)
    assert img["context"]["named"] == {image.USER_CODE_CONTEXT: {"location": f"../{EXAMPLE}"}}  # from infra/
    assert img["buildArgs"] == {image.USER_CODE_DIGEST_ARG: user_code.digest(ROOT / EXAMPLE)}
    # The pod reads the config where the image holds the folder.
    args = _container(result)["args"]
    assert args[:2] == ["--config", f"{USER_CODE_DIR}/configs/max-digit.yaml"]
    # Without trainer.code the context is the empty stand-in, and a bundled config goes by name.
    plain = run_stack("staging", stack_config("staging"))
    assert _one(plain, IMAGE_TYPE)["context"]["named"] == {
        image.USER_CODE_CONTEXT: {"location": "../trainer/no_user_code"}}
    assert _container(plain)["args"][:2] == ["--config", "llama3-70b-grpo-2xv6e-4x4.yaml"]


def test_the_digest_follows_the_code_and_not_its_caches(tmp_path: Path) -> None:
    shutil.copytree(ROOT / EXAMPLE, tmp_path / "pkg", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info",
                                                                                    "build"))
    before = user_code.digest(tmp_path / "pkg")
    (tmp_path / "pkg" / "my_tasks" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "my_tasks" / "__pycache__" / "rewards.cpython-311.pyc").write_bytes(b"\0")
    assert user_code.digest(tmp_path / "pkg") == before
    rewards = tmp_path / "pkg" / "my_tasks" / "rewards.py"
    rewards.write_text(rewards.read_text() + "\n")
    assert user_code.digest(tmp_path / "pkg") != before


@pytest.mark.parametrize(("trainer", "message"), [
    ({"code": "../elsewhere"}, "trainer.code: '../elsewhere' must be a path inside this repository"),
    ({"code": "/abs/path"}, "must be a path inside this repository"),
    ({"code": "examples/no-such-folder"}, "'examples/no-such-folder' is not a folder of this repository"),
    ({"code": EXAMPLE, "image": "us-docker.pkg.dev/p/r/trainer:1"}, "install your code in that image"),
    ({"code": EXAMPLE, "config": "configs/nope.yaml"}, "or a file inside trainer.code (examples/my_tasks)"),
    ({"config": "configs/max-digit.yaml"},
     "gke-tpu-rl:trainer.config: 'configs/max-digit.yaml' is not a trainer config under trainer/configs/; allowed:"),
])
def test_bad_code_settings_are_refused_naming_the_key(trainer: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        run_stack("staging", _config(**trainer))
    assert message in str(err.value)


@pytest.mark.parametrize(("trainer", "problem"), [
    # A reward the module does not define.
    ({"code": EXAMPLE, "config": "configs/max-digit.yaml",
      "args": ["--set", "rewards=[my_tasks.rewards:first_char, my_tasks.rewards:nope]"]},
     "rewards[1]: 'my_tasks.rewards:nope': examples/my_tasks/my_tasks/rewards.py defines no 'nope' at top level"),
    # A module the folder does not hold.
    ({"code": EXAMPLE, "config": "configs/max-digit.yaml", "args": ["--set", "task.name=my_tasks.nosuch:Task"]},
     "task.name: 'my_tasks.nosuch:Task': no module 'my_tasks.nosuch' in examples/my_tasks"),
    # The user's code named without trainer.code: the image would not have it.
    ({"args": ["--set", "rewards=[my_tasks.rewards:first_char]"]},
     "rewards[0]: 'my_tasks.rewards:first_char' names your own code, but trainer.code is not set"),
    ({"args": ["--set", "rewards=[trainer.rl.rewards:nope]"]}, "trainer/rl/rewards.py defines no 'nope'"),
    ({"args": ["--set", "rewards=[my tasks:x]"]}, "is not MODULE:NAME"),
])
def test_references_the_image_would_not_resolve_fail_the_plan(trainer: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        run_stack("staging", _config(**trainer))
    assert problem in str(err.value)


def test_the_kits_own_modules_and_the_users_resolve() -> None:
    run_stack("staging", _config(code=EXAMPLE, config="configs/max-digit.yaml",
                                 args=["--set", "rewards=[my_tasks.rewards:first_char, trainer.rl.rewards:length]"]))


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
                          check=True, capture_output=True, text=True).stdout


def test_a_change_to_the_users_code_rebuilds_the_image_and_replaces_the_job(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("Pulumi.yaml", "environments", "envspec", "infra", "workloads", "trainer", "examples", ".dockerignore",
                 "pyproject.toml", "README.md"):
        src = ROOT / name
        (shutil.copytree(src, repo / name, ignore=ignore) if src.is_dir() else shutil.copy(src, repo / name))
    stack = repo / "environments" / "Pulumi.staging.yaml"
    doc = yaml.safe_load(stack.read_text())
    doc["config"] = _config(code=EXAMPLE, config="configs/max-digit.yaml")
    stack.write_text(yaml.safe_dump(doc, sort_keys=False))
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    rewards = repo / EXAMPLE / "my_tasks" / "rewards.py"
    rewards.write_text(rewards.read_text().replace("0.5 if comp == tgt", "0.25 if comp == tgt"))
    _git(repo, "commit", "-q", "-am", "reward tweak")

    def diff(ref: str) -> str:
        # As a user runs it: the checkout's own program, in the checkout.
        out = subprocess.run([sys.executable, "-m", "infra.cli", "plan", "staging", "--diff", ref], cwd=repo,
                             env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.split("──")[0]  # the diff, before the plan itself

    changed = diff("HEAD~1")
    assert "Resources: 0 added, 0 removed, 2 changed, 1 of the changes replacements" in changed
    assert "changed cloud resources:\n  staging-image-trainer  docker-build:index:Image\n" in changed
    assert "Replaced: jobset-rl-grpo-stg (JobSet): training restarts from its last checkpoint." in changed
    assert "Resources: no change." in diff("HEAD")


def test_a_task_importing_the_kit_by_a_name_it_no_longer_has_fails_the_plan(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's task module is checked for the kit modules it imports: one the image lacks would fail the trainer's
    pre-flight (exit 2, final under the rendered policy); the names of before the floors still import."""
    from infra.base.pod_config import env_job
    from infra.checks import code_refs
    from trainer.base.config import TaskConfig

    (tmp_path / "mytask.py").write_text(
        "from trainer.tasks import Example  # before the floors: still imports\n"
        "import trainer.rl.rewards\n"
        "from trainer import tasks\n"
        "from trainer.nosuch import Thing\n"
        "class T:\n    pass\n")
    spec = run_stack("staging", _config(code=EXAMPLE, config="configs/max-digit.yaml")).spec
    monkeypatch.setattr(code_refs, "folder", lambda spec: tmp_path)  # the user's folder, with that module in it
    cfg = env_job(spec).cfg.model_copy(update={"task": TaskConfig(name="mytask:T"),
                                               "rewards": ["trainer.rewards:length"]})
    assert code_refs.check_references(spec, cfg) == [
        f"task.name: 'mytask:T': {tmp_path / 'mytask.py'} line 4 imports 'trainer.nosuch', which the kit does not "
        "have (its modules: docs/architecture.md, the trainer's floors)"]
