"""Paths inside this repository that the spec names (trainer.code, a trainer config inside it).

The stack builds the folder into the trainer image (infra/base/user_code.py, infra/components/image.py), so it must be
versioned with the environment: a relative path below the repository root, where Pulumi.yaml is.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]  # where Pulumi.yaml is and `pulumi` runs the program


def within_repo(value: str) -> bool:
    """A relative path that cannot leave the folder it is resolved in (no '..')."""
    path = Path(value)
    return not path.is_absolute() and ".." not in path.parts


def repo_folder(value: str) -> str:
    """A relative path inside the repository, without '..': what the image build and `plan --diff` of another
    revision both resolve against the repository they run in. Returns it as given; raises ValueError."""
    if not within_repo(value) or value.strip() in ("", "."):
        raise ValueError(f"{value!r} must be a path inside this repository, relative to Pulumi.yaml, without '..' "
                         "(so the code is versioned with the environment)")
    return value
