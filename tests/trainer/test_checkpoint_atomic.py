"""Saves that work on a Cloud Storage FUSE mount of a flat bucket: no directory is renamed (gcsfuse refuses that
without rename-dir-limit, and never does it atomically). A step is published by its commit marker, written last;
a save cut off before it is set aside and the previous step is used. A set-aside (a directory rename) cut off midway
leaves a step that is still damaged: it is set aside again, and nothing is lost."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from trainer.rl.checkpoint import COMMIT_MARKER, Checkpointer, Meta

ROOT = Path(__file__).resolve().parents[2]
_renames: list[tuple[str, str]] | None = None  # directory renames seen while recording


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # CPython raises "os.rename" for os.rename and os.replace, so for every Python caller: pathlib, shutil.move and
    # etils.epath (orbax's async_path.rename -> epath -> os.rename). The event comes before the call: src still exists.
    if event == "os.rename" and _renames is not None and os.path.isdir(args[0]):
        _renames.append((os.fsdecode(args[0]), os.fsdecode(args[1])))


@pytest.fixture
def dir_renames() -> Iterator[list[tuple[str, str]]]:
    """Every rename of a directory done from Python while the test runs. (Tensorstore renames in C++, files only:
    `<file>.__lock` -> `<file>`, seen with strace.)"""
    global _renames
    if not getattr(sys, "_checkpoint_rename_audit", False):  # an audit hook can't be removed: install it once
        sys.addaudithook(_audit)
        sys._checkpoint_rename_audit = True  # type: ignore[attr-defined]
    _renames = []
    try:
        yield _renames
    finally:
        _renames = None


def _state(step: int) -> dict[str, jax.Array]:
    return {"w": jax.numpy.arange(64.0) * step, "b": jax.numpy.full((4, 4), step, jax.numpy.int32)}


def _target() -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state(0))


def _save(ckpt: Checkpointer, step: int) -> None:
    assert ckpt.save(_state(step), Meta(step, 10 * step, [0, step]))


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _entries(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_orbax_default_mode_renames_directories_and_the_recorder_sees_it(
    tmp_path: Path, dir_renames: list[tuple[str, str]]
) -> None:
    """Proves the recorder: orbax's default for a local path (AtomicRenameTemporaryPath) renames the step folder."""
    mngr = ocp.CheckpointManager(tmp_path, item_names=("state",))
    mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(1))))
    mngr.wait_until_finished()
    mngr.close()
    assert (str(tmp_path / "1.orbax-checkpoint-tmp"), str(tmp_path / "1")) in dir_renames, dir_renames


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_save_renames_no_directory(tmp_path: Path, dir_renames: list[tuple[str, str]], async_save: bool) -> None:
    ckpt = Checkpointer(tmp_path, every=1, keep=2, async_save=async_save)
    for step in (1, 2, 3):  # the third save also deletes step 1 (keep=2)
        _save(ckpt, step)
    ckpt.close()
    assert dir_renames == []
    assert _entries(tmp_path) == ["2", "3"] and (tmp_path / "3" / COMMIT_MARKER).is_file()
    state, meta = Checkpointer(tmp_path, every=1, keep=2).restore(_target())
    assert meta == Meta(3, 30, [0, 3])
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(3)["w"]))


# Saves steps 1, 2, ... and is SIGKILLed in the save of step argv[2] just before orbax publishes it (the marker of
# the step folder, CommitFileTemporaryPath.finalize): what a preemption there leaves.
_KILLED_IN_SAVE = """
import os, signal, sys
import orbax.checkpoint as ocp
from tests.trainer.test_checkpoint_atomic import _save
from trainer.rl.checkpoint import Checkpointer

directory, last = sys.argv[1], int(sys.argv[2])
finalize = ocp.path.atomicity.CommitFileTemporaryPath.finalize

async def killed_before_the_marker(self):
    if str(self.get_final()) == os.path.join(directory, str(last)):
        os.kill(os.getpid(), signal.SIGKILL)
    await finalize(self)

ocp.path.atomicity.CommitFileTemporaryPath.finalize = killed_before_the_marker
ckpt = Checkpointer(directory, every=1, keep=3)
for step in range(1, last + 1):
    _save(ckpt, step)
ckpt.wait()
"""


def _killed_in_save(directory: Path, step: int = 3) -> None:
    done = subprocess.run([sys.executable, "-c", _KILLED_IN_SAVE, str(directory), str(step)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == -9, done.stderr[-3000:]


def test_a_save_killed_before_its_marker_is_set_aside_and_the_previous_step_used(tmp_path: Path) -> None:
    _killed_in_save(tmp_path)
    left = tmp_path / "3"
    assert left.is_dir() and not (left / COMMIT_MARKER).exists() and (left / "state").is_dir()
    files = _files(left)
    ckpt = Checkpointer(tmp_path, every=1, keep=3)
    assert ckpt.latest_step() == 2  # orbax lists only committed steps (step.py _StandardNameFormat._build_metadata)
    found = ckpt.resume(_target())
    assert found is not None
    state, meta, aside = found
    assert meta.step == 2 and [(a.step, a.path) for a in aside] == [(3, tmp_path / "3.damaged")]
    assert aside[0].reason == f"no {COMMIT_MARKER}: the save did not finish"
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(2)["w"]))
    assert _files(tmp_path / "3.damaged") == files  # kept as it was
    _save(ckpt, 3)  # the run goes on and saves step 3 afresh
    ckpt.close()
    assert _entries(tmp_path) == ["1", "2", "3", "3.damaged"]
    assert Checkpointer(tmp_path, every=1, keep=3).restore(_target())[1].step == 3


def test_a_first_save_killed_before_its_marker_is_set_aside_and_the_run_starts_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No save ever finished: that is no checkpoint yet (not a run to refuse to throw away)."""
    _killed_in_save(tmp_path, step=1)
    files = _files(tmp_path / "1")
    ckpt = Checkpointer(tmp_path, every=1, keep=3)
    assert ckpt.resume(_target()) is None
    assert f"checkpoint step 1 in {tmp_path} is damaged (no {COMMIT_MARKER}: the save did not finish); moved to " \
           f"{tmp_path / '1.damaged'}; no save finished before it: starting from scratch" in capsys.readouterr().err
    _save(ckpt, 1)
    ckpt.close()
    assert _entries(tmp_path) == ["1", "1.damaged"] and _files(tmp_path / "1.damaged") == files


def test_a_damaged_step_that_cannot_be_moved_is_not_overwritten(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Orbax deletes whatever is at a step's folder before saving there (force=True); an unfinished step is not
    one of its steps, so without a guard the next save of that step would delete it silently."""
    _killed_in_save(tmp_path)
    files = _files(tmp_path / "3")

    def refused(self: Path, target: Any) -> Path:
        raise OSError(24, "Too many open files")  # what gcsfuse answers above rename-dir-limit

    monkeypatch.setattr(Path, "rename", refused)
    ckpt = Checkpointer(tmp_path, every=1, keep=3)
    found = ckpt.resume(_target())
    assert found is not None and found[1].step == 2
    assert [(a.step, a.path, a.move_error) for a in found[2]] == [(3, None, "[Errno 24] Too many open files")]
    assert not ckpt.save(_state(3), Meta(3, 30, [0, 3]))  # skipped, as a step that exists would be
    _save(ckpt, 4)
    ckpt.close()
    assert _files(tmp_path / "3") == files and _entries(tmp_path) == ["1", "2", "3", "4"]


def _truncate_arrays(step_dir: Path) -> None:
    for f in (p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"):
        os.truncate(f, f.stat().st_size // 2)


@pytest.mark.parametrize("moved", ["first-file", "half", "all-but-last"])
def test_a_set_aside_cut_off_midway_is_finished_on_the_next_resume(tmp_path: Path, moved: str) -> None:
    """gcsfuse renames a folder of a flat bucket object by object, in name order (copy, then delete the source).
    A preemption leaves part of a damaged step under `<step>` and part under `<step>.damaged`, one object maybe in
    both. The part left under `<step>` is still damaged, so the next resume moves it to a free name."""
    ckpt = Checkpointer(tmp_path, every=1, keep=3)
    for step in (1, 2, 3):
        _save(ckpt, step)
    ckpt.close()
    _truncate_arrays(tmp_path / "3")
    before = _files(tmp_path / "3")
    names = list(before)
    cut = {"first-file": 1, "half": len(names) // 2, "all-but-last": len(names) - 1}[moved]
    for name in names[:cut]:  # the last one copied but not yet deleted
        dst = tmp_path / "3.damaged" / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(before[name])
        if name != names[cut - 1]:
            (tmp_path / "3" / name).unlink()

    found = Checkpointer(tmp_path, every=1, keep=3).resume(_target())
    assert found is not None
    state, meta, aside = found
    assert meta.step == 2 and [(a.step, a.path) for a in aside] == [(3, tmp_path / "3.damaged.1")]
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(2)["w"]))
    assert _entries(tmp_path) == ["1", "2", "3.damaged", "3.damaged.1"]
    kept = {**_files(tmp_path / "3.damaged"), **_files(tmp_path / "3.damaged.1")}
    assert kept == before  # nothing lost
