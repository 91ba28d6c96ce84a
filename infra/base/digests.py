"""sha256 of a file tree (relative names and contents, in a fixed order): what the plan compares to tell whether the
trainer image would be rebuilt (the build context, infra/offline/diff.py; trainer.code, infra/base/user_code.py)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path


def tree_digest(root: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]) -> str:
    """Hex digest of the files below `root` that `keep_file` keeps, in folders that `keep_dir` keeps (both called
    with the path relative to `root`, '/'-separated; a folder left out is not walked)."""
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        rel_folder = Path(folder).relative_to(root).as_posix()
        rel_folder = "" if rel_folder == "." else rel_folder + "/"
        dirs[:] = sorted(d for d in dirs if keep_dir(rel_folder + d))
        for name in sorted(files):
            rel = rel_folder + name
            if keep_file(rel):
                digest.update(rel.encode() + b"\0" + (Path(folder) / name).read_bytes() + b"\0")
    return digest.hexdigest()
