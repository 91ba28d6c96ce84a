"""trainer.code: the environment's own tasks and rewards, a folder of this repository built into the trainer image.

The image build gets the folder as a named build context (infra/components/image.py). pulumi-docker-build decides
whether to rebuild from a hash of the build context, and it hashes a named context through the *main* context's
.dockerignore (provider/internal/context.go hashBuildContext, v0.0.22), whose allow-list would drop the user's files: so
the stack passes this module's digest of the folder as a build argument, which the provider compares on every update
(image.go Diff: buildArgs). The trainer config's MODULE:NAME references into the folder are checked before anything
is built (infra/checks/code_refs.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from envspec.repo import REPO_ROOT
from infra.base.digests import tree_digest, tree_files

if TYPE_CHECKING:
    from envspec.config import EnvironmentSpec

# Never part of the digest (nor worth sending): bytecode and tool caches the user's runs leave behind.
SKIPPED_DIRS = frozenset({"__pycache__", ".git", ".venv", ".pytest_cache", ".ruff_cache", ".mypy_cache"})
SKIPPED_SUFFIXES = (".pyc", ".pyo")


def folder(spec: EnvironmentSpec) -> Path | None:
    return None if spec.trainer.code is None else REPO_ROOT / spec.trainer.code


def local_config(spec: EnvironmentSpec, pod_config: str | None) -> str | None:
    """The pod's --config as a path here: a file of trainer.code is in the image at USER_CODE_DIR."""
    from envspec.pod import USER_CODE_DIR

    root = folder(spec)
    if root is None or pod_config is None or not pod_config.startswith(USER_CODE_DIR + "/"):
        return pod_config
    return str(root / pod_config.removeprefix(USER_CODE_DIR + "/"))


def _keep_dir(rel: str) -> bool:
    return rel.rsplit("/", 1)[-1] not in SKIPPED_DIRS


def _keep_file(rel: str) -> bool:
    return not rel.endswith(SKIPPED_SUFFIXES)


def digest(path: Path) -> str:
    """sha256 over the folder's files (relative names and contents), caches left out."""
    return tree_digest(path, _keep_dir, _keep_file)


def files(path: Path) -> dict[str, str]:
    """{name relative to the folder: sha256} of the files `digest` covers: what `plan --diff` names when it changed."""
    return tree_files(path, _keep_dir, _keep_file)
