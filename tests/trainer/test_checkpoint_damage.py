"""A damaged newest checkpoint: resume from the newest intact one, say so, and end bitwise where a run that never
stopped ends. The damaged step is moved aside, never deleted; with no intact step left the run refuses to start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from trainer.base.config import ConfigError, config_from_dict, resolve_mesh
from trainer.model import decoder as M
from trainer.model.sharding import make_mesh
from trainer.rl.checkpoint import COMMIT_MARKER, Checkpointer, NoUsableCheckpoint, abstract_like
from trainer.rl.metrics import CLOCK_KEYS, read_metrics
from trainer.rl.step import build_programs
from trainer.rl.train import train
from trainer.run import cli

from .conftest import tiny_train_config

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5


def _cfg_dict(run_dir: Path, **top: object) -> dict:
    return tiny_train_config(run_dir, **{"steps": STEPS, "checkpoint": {"every": 1, "keep": 3}, **top})


def _train(run_dir: Path, **kw: object) -> object:
    return train(config_from_dict(_cfg_dict(run_dir)), **kw)


def _same(a: object, b: object) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _target(d: dict, slices: int) -> Any:
    """The restore target train() builds for a mesh of `slices` x 2 x 2 (on the first devices of this process)."""
    devices = jax.devices()[: slices * 4]
    cfg = resolve_mesh(config_from_dict({**d, "mesh": {"slices": slices, "fsdp": 2, "tensor": 2}}), len(devices))
    programs = build_programs(cfg, make_mesh(slices, 2, 2, devices), 0, 1)
    params = M.abstract_params(cfg.model_cfg)
    state = {"params": params, "opt_state": jax.eval_shape(programs.optimizer.init, params)}
    return abstract_like(state, {"params": programs.param_sh, "opt_state": programs.opt_sh})


def _restore(ckpt: Path, target: Any, step: int) -> Any:
    return Checkpointer(ckpt, every=0, keep=2).restore(target, step)[0]


def _steps(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run that never stopped, and one stopped after step 4 with checkpoints at 2, 3 and 4."""
    base = tmp_path_factory.mktemp("damage")
    straight = _train(base / "straight")
    source = _train(base / "source", stop_after=4)
    assert source.stopped_early and _steps(base / "source" / "checkpoints") == ["2", "3", "4"]
    return {"base": base, "straight": straight, "source": base / "source"}


def _copy(runs: dict, name: str) -> Path:
    run = runs["base"] / name
    shutil.copytree(runs["source"], run)
    return run


def _data_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d")


def _truncate(step_dir: Path, runs: dict) -> None:
    for f in _data_files(step_dir):
        os.truncate(f, f.stat().st_size // 2)


def _bit_flip(step_dir: Path, runs: dict) -> None:
    """Well-formed files whose array holds one flipped bit: what corrupted raw array bytes read back as (orbax
    stores large arrays raw and unchecked; only the checksums in the meta can tell)."""
    target = _target(_cfg_dict(step_dir), 2)
    state = Checkpointer(step_dir.parent, every=0, keep=3).restore(target, int(step_dir.name))[0]
    embed = np.asarray(state["params"]["embed"]).copy()
    embed.view(np.uint32).flat[7] ^= 1
    state["params"]["embed"] = jax.device_put(embed, state["params"]["embed"].sharding)
    shutil.rmtree(step_dir / "state")
    saver = ocp.StandardCheckpointer()
    saver.save(step_dir / "state", state)
    saver.wait_until_finished()
    saver.close()


def _half_written(step_dir: Path, runs: dict) -> None:
    """An interrupted copy or non-atomic rename (gcsfuse): the folder has only part of its files."""
    (step_dir / COMMIT_MARKER).unlink()
    shutil.rmtree(step_dir / "meta")
    for f in _data_files(step_dir)[::2]:
        f.unlink()


def _no_meta(step_dir: Path, runs: dict) -> None:
    (step_dir / "meta" / "metadata").unlink()


def _no_array_metadata(step_dir: Path, runs: dict) -> None:
    (step_dir / "state" / "_METADATA").unlink()


def _bad_meta(step_dir: Path, runs: dict) -> None:
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "data_position": str(meta["data_position"])}))


DAMAGES: dict[str, Callable[[Path, dict], None]] = {
    "truncated-array-file": _truncate,
    "flipped-bit": _bit_flip,
    "half-written": _half_written,
    "missing-meta": _no_meta,
    "missing-array-metadata": _no_array_metadata,
    "malformed-meta": _bad_meta,
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_newest_checkpoint_resumes_from_the_previous_one(
    runs: dict, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(runs, damage)
    ckpt = run / "checkpoints"
    DAMAGES[damage](ckpt / "4", runs)
    capsys.readouterr()
    resumed = _train(run)
    err = capsys.readouterr().err
    assert f"warning: checkpoint step 4 in {ckpt} is damaged" in err, err
    assert f"moved to {ckpt / '4.damaged'}" in err and "resuming from checkpoint step 3 (damaged step 4 skipped)" in err
    assert [r["step"] for r in resumed.records] == [3, 4]
    _same(runs["straight"].params, resumed.params)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in CLOCK_KEYS} for r in rs]  # noqa: E731
    assert strip(read_metrics(run)) == strip(runs["straight"].records)
    # Kept for inspection, and out of the way: step 4 was saved again, so the next resume starts there.
    assert _steps(ckpt) == ["3", "4", "4.damaged", "5"]
    assert (ckpt / "4" / COMMIT_MARKER).is_file()
    assert json.loads((ckpt / "4" / "meta" / "metadata").read_text())["step"] == 4


@pytest.mark.slow
def test_a_step_saved_again_after_the_damaged_one_was_moved_aside_is_used(runs: dict,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(runs, "saved-again")
    ckpt = run / "checkpoints"
    _truncate(ckpt / "4", runs)
    _train(run)
    shutil.rmtree(ckpt / "5")
    capsys.readouterr()
    again = _train(run)
    err = capsys.readouterr().err
    assert "resuming from checkpoint step 4\n" in err and "damaged" not in err, err
    assert [r["step"] for r in again.records] == [4]
    _same(runs["straight"].params, again.params)


@pytest.mark.slow
def test_an_interrupted_saves_temporary_folder_is_not_a_checkpoint(runs: dict,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(runs, "tmp")
    ckpt = run / "checkpoints"
    # What orbax 0.12 leaves when killed mid-save in its default mode, which the trainer used before saving in place
    # (`<step>.orbax-checkpoint-tmp`; older versions add a timestamp).
    for name in ("5.orbax-checkpoint-tmp", "6.orbax-checkpoint-tmp-1712345678"):
        shutil.copytree(ckpt / "4", ckpt / name)
        (ckpt / name / COMMIT_MARKER).unlink()
    capsys.readouterr()
    resumed = _train(run)
    err = capsys.readouterr().err
    assert "resuming from checkpoint step 4\n" in err and "damaged" not in err, err
    assert [r["step"] for r in resumed.records] == [4]
    _same(runs["straight"].params, resumed.params)
    # Step 5 is saved in place; the leftovers stay untouched.
    assert _steps(ckpt) == ["3", "4", "5", "5.orbax-checkpoint-tmp", "6.orbax-checkpoint-tmp-1712345678"]


@pytest.mark.slow
def test_no_intact_checkpoint_refuses_to_start_over(runs: dict, tmp_path: Path) -> None:
    run = _copy(runs, "all-damaged")
    ckpt = run / "checkpoints"
    for step in ("2", "3", "4"):
        _truncate(ckpt / step, runs)
    with pytest.raises(NoUsableCheckpoint, match=r"no usable checkpoint in .*step 4: .*; step 3: .*; step 2: "):
        _train(run)
    assert _steps(ckpt) == ["2", "3", "4"]  # nothing moved or deleted
    # The CLI: a config-style error (exit 2, which fails the JobSet instead of restarting it) and no traceback,
    # not even at exit from the reads orbax abandoned.
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(_cfg_dict(run)))
    done = subprocess.run([sys.executable, "-m", "trainer", "--config", str(config)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TRAINER_CPU_DEVICES": "8"})
    assert done.returncode == cli.EXIT_CONFIG, done.stderr[-3000:]
    assert done.stderr.startswith("error: no usable checkpoint in ") and "Traceback" not in done.stderr, done.stderr
    assert read_metrics(run) == read_metrics(runs["source"])  # the history was not truncated either


def compile_cache_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One persistent compilation cache for the session's trainer subprocesses: a restart skips recompiling."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "jax-compile-cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def _launch(config: Path, run: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "--local-processes", "2", "--devices-per-process", "4",
         "--config", str(config), "--run-dir", str(run)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


@pytest.mark.slow
def test_processes_agree_when_only_one_of_them_cannot_read_the_newest_step(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """fsdp across the 2 processes: each reads only its own shards, so damage to process 1's files fails the read
    on process 1 alone. Both must skip the step together (a lone fallback would deadlock the collectives)."""
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(_cfg_dict(tmp_path, steps=3, mesh={"slices": 1, "fsdp": 4, "tensor": 2})))
    run, env = tmp_path / "run", compile_cache_env(tmp_path_factory)
    first = _launch(config, run, env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    ckpt = run / "checkpoints"
    assert _steps(ckpt) == ["1", "2", "3"]
    before = read_metrics(run)
    own = sorted((ckpt / "3" / "state" / "ocdbt.process_1" / "d").iterdir())
    assert own
    for f in own:
        os.truncate(f, f.stat().st_size // 2)

    second = _launch(config, run, env)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "checkpoint step 3" in out and "is damaged (unreadable on process(es) [1])" in out, out[-3000:]
    assert "resuming from checkpoint step 2 (damaged step 3 skipped)" in out
    assert _steps(ckpt) == ["1", "2", "3", "3.damaged"]
    strip = lambda rs: [{k: v for k, v in r.items() if k not in CLOCK_KEYS} for r in rs]  # noqa: E731
    assert strip(read_metrics(run)) == strip(before)  # step 2 again, with the same result


@pytest.mark.slow
def test_resume_step_rolls_back_once(runs: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """checkpoint.resume_step: the run goes on from that step as the straight run did from it (steps after it moved
    aside, not deleted); a restart with the same config (a preemption) resumes from its own newer saves."""
    run = _copy(runs, "rolled-back")
    ckpt = run / "checkpoints"
    cfg = config_from_dict(_cfg_dict(run, checkpoint={"every": 1, "keep": 3, "resume_step": 2}))
    capsys.readouterr()
    rolled = train(cfg)
    err = capsys.readouterr().err
    assert "rolling back to checkpoint step 2: steps 3, 4 moved aside (3.rolled-back, 4.rolled-back)" in err, err
    assert "resuming from checkpoint step 2\n" in err and "damaged" not in err
    assert [r["step"] for r in rolled.records] == [2, 3, 4]
    _same(runs["straight"].params, rolled.params)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in CLOCK_KEYS} for r in rs]  # noqa: E731
    assert strip(read_metrics(run)) == strip(runs["straight"].records)  # the rolled-back steps' lines replaced
    assert _steps(ckpt) == ["3", "3.rolled-back", "4", "4.rolled-back", "5", "rolled-back-to-2.json"]
    assert json.loads((ckpt / "rolled-back-to-2.json").read_text())["step"] == 2
    again = train(cfg)  # the same job restarted: no second roll-back
    err = capsys.readouterr().err
    assert again.records == [] and "resuming from checkpoint step 5\n" in err
    assert "checkpoint.resume_step=2: already rolled back to it" in err and "move that record away" in err
    with pytest.raises(ConfigError, match=r"checkpoint.resume_step=7: no step 7 in .*; it holds 3, 4, 5"):
        train(config_from_dict(_cfg_dict(run, checkpoint={"every": 1, "keep": 3, "resume_step": 7})))
