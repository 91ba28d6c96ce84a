"""A user's own tasks and rewards (MODULE:NAME in the trainer config): installed as the image installs them, resolved
and tried by the preflight, each mistake a ConfigError naming the key, and a real run on the example package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.trainer.conftest import tiny_train_config
from trainer.base.config import ConfigError, config_from_dict
from trainer.base.user_code import PTH_NAME, install, pins
from trainer.rl.task_data import load_task_data

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "my_tasks"


def _venv(tmp_path: Path) -> Path:
    """A fresh interpreter that sees this venv's packages (jax, pip, setuptools, the trainer) but installs into its
    own site-packages: the image's situation after its `pip install` layers."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(purelib, "base.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return venv / "bin" / "python"


def _install(python: Path, folder: Path) -> subprocess.CompletedProcess[str]:
    # Offline: no index, and the build backend (setuptools) from this venv instead of a downloaded one.
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0"}
    return subprocess.run([python, "-m", "trainer.base.user_code", "install", str(folder)], capture_output=True,
                          text=True, env=env, timeout=300)


def _imports(python: Path, module: str, cwd: Path) -> str:
    out = subprocess.run([python, "-c", f"import {module} as m; print(m.__file__)"], cwd=cwd, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_project_installs_with_its_dependencies_pinned_to_the_images(tmp_path: Path) -> None:
    python = _venv(tmp_path)
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE, project)
    result = _install(python, project)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "installed the project" in result.stdout
    # Installed (not a path entry): importable from anywhere, the source folder gone.
    shutil.rmtree(project)
    assert "site-packages" in _imports(python, "my_tasks.rewards", tmp_path)

    # A dependency that would move a version the image has is refused by pip, naming the constraint.
    import yaml as pyyaml_module  # noqa: F401  (installed here, so pinned)

    [pin] = [p for p in pins() if p.startswith("pyyaml==")]
    clash = tmp_path / "clash"
    shutil.copytree(EXAMPLE, clash)
    pyproject = clash / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('name = "my-tasks"', 'name = "clash"').replace(
        "dependencies = []", f'dependencies = ["pyyaml!={pin.split("==")[1]}"]'))
    result = _install(python, clash)
    assert result.returncode != 0
    assert "(constraint)" in result.stdout + result.stderr


def test_a_folder_of_modules_goes_on_the_path(tmp_path: Path) -> None:
    python = _venv(tmp_path)
    folder = tmp_path / "code"
    (folder / "scoring").mkdir(parents=True)
    (folder / "scoring" / "__init__.py").write_text("")
    (folder / "my_rewards.py").write_text("def one(prompts, completions, **_):\n    return [1.0] * len(prompts)\n")
    result = _install(python, folder)
    assert result.returncode == 0 and PTH_NAME in result.stdout, result.stderr
    assert _imports(python, "my_rewards", tmp_path) == str(folder / "my_rewards.py")
    assert _imports(python, "scoring", tmp_path) == str(folder / "scoring" / "__init__.py")


def test_the_empty_stand_in_installs_nothing(tmp_path: Path) -> None:
    # What the image gets without trainer.code (infra/components/image.py NO_USER_CODE).
    assert "nothing to install" in install(ROOT / "trainer" / "no_user_code")


# ---------------------------------------------------------------------------------------------- preflight


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of the user's modules on sys.path, as the image's .pth (or PYTHONPATH) puts it."""
    code = tmp_path / "code"
    code.mkdir()
    monkeypatch.syspath_prepend(str(code))
    for name in [m for m in sys.modules if m.startswith("u_")]:
        monkeypatch.delitem(sys.modules, name)
    return code


def _write(code: Path, module: str, text: str) -> None:
    (code / f"{module}.py").write_text(textwrap.dedent(text))


TASK = """
    import random
    from dataclasses import dataclass
    from trainer.rl.tasks import Example

    @dataclass(frozen=True)
    class Parity:
        seed: int = 0
        n: int = 4
        reward_names: tuple = ("u_rewards:exact",)

        def example(self, index):
            bits = format((self.seed * 7919 + index) % (1 << self.n), f"0{self.n}b")
            return Example(prompt="par " + bits, fields={"target": "odd" if bits.count("1") % 2 else "even"})

    def make(seed=0, n=4):
        return Parity(seed=seed, n=n)

    class Drifting:
        reward_names = ("u_rewards:exact",)
        def example(self, index):
            return Example(prompt=str(random.random()), fields={"target": "x"})

    class NoExample:
        reward_names = ("u_rewards:exact",)
"""

REWARDS = """
    def exact(prompts, completions, target, **_):
        return [1.0 if c == t else 0.0 for c, t in zip(completions, target)]

    def wants_answer(prompts, completions, answer, **_):
        return [0.0 for _ in completions]

    def short(prompts, completions, **_):
        return [1.0]

    def nan(prompts, completions, **_):
        return [float("nan") for _ in completions]

    RATE = 3
"""


def _cfg(tmp_path: Path, task: dict[str, Any], rewards: list[str] | None = None) -> Any:
    return config_from_dict(tiny_train_config(tmp_path, task=task, **({"rewards": rewards} if rewards else {})))


def test_a_users_task_and_rewards_resolve_and_score(tmp_path: Path, user_modules: Path) -> None:
    _write(user_modules, "u_tasks", TASK)
    _write(user_modules, "u_rewards", REWARDS)
    data = load_task_data(_cfg(tmp_path, {"name": "u_tasks:Parity", "n": 5, "seed": 3}))
    assert data.reward_names == ("u_rewards:exact",)  # the task's own
    assert data.task.example(2).prompt == "par " + format((3 * 7919 + 2) % 32, "05b")
    # A factory function works like a class; the config's rewards replace the task's, built-ins beside the user's.
    data = load_task_data(_cfg(tmp_path, {"name": "u_tasks:make"}, ["u_rewards:exact", "length"]))
    assert data.reward_names == ("u_rewards:exact", "length")


@pytest.mark.parametrize(("task", "rewards", "message"), [
    ({"name": "u_nowhere:Task"}, None,
     "task: 'u_nowhere:Task': no module 'u_nowhere' on the path; on the cluster set gke-tpu-rl:trainer.code"),
    ({"name": "u_tasks:Parity_"}, None, "task: 'u_tasks:Parity_': module 'u_tasks' has no 'Parity_'; its "
     "callables: Drifting, NoExample, Parity, make"),
    ({"name": "u_tasks:Parity", "size": 3}, None, "task: task 'u_tasks:Parity' does not take the options ['size']"),
    ({"name": "u_tasks:NoExample"}, None, "without an example(index) method"),
    ({"name": "u_tasks:Drifting"}, None, "example(0) differs between two calls"),
    ({"name": "u_tasks:Parity"}, ["u_rewards:RATE"], "rewards: 'u_rewards:RATE' is a int, not a function or class"),
    ({"name": "u_tasks:Parity"}, ["u_rewards:wants_answer"],
     "rewards: 'u_rewards:wants_answer' failed on example 0 of task 'u_tasks:Parity' with an empty completion: "
     "TypeError"),
    ({"name": "u_tasks:Parity"}, ["u_rewards:short", "exact_match"], "returned 1 scores for 2 completions"),
    ({"name": "u_tasks:Parity"}, ["u_rewards:nan"], "expected finite numbers"),
    ({"name": "u_tasks:Parity"}, ["nosuch"], "unknown reward 'nosuch'"),
])
def test_each_mistake_is_a_config_error_naming_the_key(tmp_path: Path, user_modules: Path, task: dict[str, Any],
                                                       rewards: list[str] | None, message: str) -> None:
    _write(user_modules, "u_tasks", TASK)
    _write(user_modules, "u_rewards", REWARDS)
    with pytest.raises(ConfigError) as err:
        load_task_data(_cfg(tmp_path, task, rewards))
    assert message in str(err.value)


def test_a_module_that_fails_to_import_says_why(tmp_path: Path, user_modules: Path) -> None:
    _write(user_modules, "u_broken", "import json\nraise RuntimeError('needs OPENAI_KEY')\n")
    _write(user_modules, "u_missing_dep", "import sympy_not_installed_here\n")
    with pytest.raises(ConfigError, match=r"rewards: 'u_broken:f': importing 'u_broken' failed: RuntimeError: "
                       r"needs OPENAI_KEY"):
        load_task_data(_cfg(tmp_path, {"name": "digits"}, ["u_broken:f"]))
    # A dependency the image lacks is not mistaken for the module itself being absent.
    with pytest.raises(ConfigError, match=r"importing 'u_missing_dep' failed: No module named "
                       r"'sympy_not_installed_here'"):
        load_task_data(_cfg(tmp_path, {"name": "digits"}, ["u_missing_dep:f"]))


@pytest.mark.slow
def test_the_example_package_trains_under_the_real_cli(tmp_path: Path) -> None:
    # What docs/own-tasks.md says to run locally, cut to two steps on one process.
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(EXAMPLE / "configs" / "max-digit.yaml"),
         "--run-dir", str(tmp_path / "run"), "--set", "steps=2", "--set", "mesh.slices=1", "--set", "mesh.fsdp=1",
         "--set", "mesh.tensor=1", "--set", "rl.prompts_per_step=4", "--set", "progress=false"],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(0 <= r["reward/my_tasks.rewards:first_char"] <= 1.5 for r in records)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    # The task's own options beside the kit's chat-template keys (at their defaults).
    assert saved["task"] == {"name": "my_tasks.tasks:MaxDigit", "digits": 3, "chat_template": False,
                             "system_prompt": None, "chat_template_kwargs": {}}


def test_the_flat_module_names_of_before_the_floors_still_import(tmp_path: Path) -> None:
    """docs/own-tasks.md once said `from trainer.tasks import Example`: a user's task written so keeps running after
    the kit put trainer/ in floors, told where the module is now (trainer/base/moved.py)."""
    (tmp_path / "old_task.py").write_text(
        "from trainer.tasks import Example\n"
        "from trainer.rewards import extract_answer\n"
        "class Old:\n"
        "    name, reward_names = 'old', ('char_match',)\n"
        "    def example(self, index):\n"
        "        return Example(prompt=f'rep {index % 10}', fields={'answer': str(index % 10) * 4})\n")
    code = ("import trainer.rl.tasks, trainer.tasks\n"
            "from trainer.base.user_code import resolve\n"
            "task = resolve('old_task:Old')()\n"
            "assert trainer.tasks is trainer.rl.tasks and isinstance(task.example(3), trainer.rl.tasks.Example)\n"
            "print(resolve('trainer.rewards:length').__module__)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["trainer.rl.rewards"]
    assert "FutureWarning: trainer.tasks moved to trainer.rl.tasks: import it from there" in run.stderr
    assert "trainer.rewards moved to trainer.rl.rewards" in run.stderr
