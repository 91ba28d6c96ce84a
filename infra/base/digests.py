"""sha256 of a file tree (relative names and contents, in a fixed order): what the plan compares to tell whether the
trainer image would be rebuilt (the build context, infra/offline/diff.py; trainer.code, infra/base/user_code.py)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path


def _files(root: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]) -> Iterator[tuple[str, Path]]:
    """(relative name, path) of the files below `root` that `keep_file` keeps, in folders that `keep_dir` keeps (both
    called with the path relative to `root`, '/'-separated; a folder left out is not walked), in a fixed order."""
    for folder, dirs, files in os.walk(root):
        rel_folder = Path(folder).relative_to(root).as_posix()
        rel_folder = "" if rel_folder == "." else rel_folder + "/"
        dirs[:] = sorted(d for d in dirs if keep_dir(rel_folder + d))
        for name in sorted(files):
            rel = rel_folder + name
            if keep_file(rel):
                yield rel, Path(folder) / name


def tree_digest(root: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]) -> str:
    """Hex digest of the files `_files` yields: their relative names and contents."""
    digest = hashlib.sha256()
    for rel, path in _files(root, keep_dir, keep_file):
        digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def tree_files(root: Path, keep_dir: Callable[[str], bool], keep_file: Callable[[str], bool]) -> dict[str, str]:
    """{relative name: sha256 of its content} of the files `_files` yields: what a diff compares to name the files
    that changed, not only that the tree's digest did."""
    return {rel: hashlib.sha256(path.read_bytes()).hexdigest() for rel, path in _files(root, keep_dir, keep_file)}
