"""SIGKILL, the preemption nothing can catch: a 2-process local run killed (the whole process group) at seeded random
moments, resumed each time, ends bitwise where a run that was never killed ends."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from trainer.rl.checkpoint import COMMIT_MARKER
from trainer.rl.metrics import CLOCK_KEYS, read_metrics

from .test_checkpoint_damage import _restore, _target, compile_cache_env

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
KILLS = 3


def _command(config: Path, run: Path) -> list[str]:
    return [sys.executable, "-m", "trainer", "--local-processes", "2", "--devices-per-process", "4",
            "--config", str(config), "--run-dir", str(run)]


def _checkpoints(run: Path) -> list[int]:
    """The finished steps (a step's folder appears when its save starts; its marker is written last)."""
    ckpt = run / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit() and (p / COMMIT_MARKER).is_file()) \
        if ckpt.is_dir() else []


def _saves_started(run: Path, since: float) -> list[int]:
    """Steps whose save began at or after `since` (the folder appears when it begins; a leftover unfinished one from
    an earlier cycle is older, and moved aside by the resume)."""
    ckpt = run / "checkpoints"
    return sorted(int(p.name) for p in ckpt.iterdir()
                  if p.name.isdigit() and p.stat().st_mtime >= since) if ckpt.is_dir() else []


def _kill_after(proc: subprocess.Popen[bytes], run: Path, step: int, delay: float, log: Path) -> None:
    """SIGKILL the launcher and its processes `delay` s after the save of step `step` (or a later one) begins."""
    deadline, since = time.monotonic() + 240, time.time()
    while not any(s >= step for s in _saves_started(run, since)):
        assert proc.poll() is None, f"run ended with {proc.returncode} before step {step}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint within the timeout"
        time.sleep(0.05)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _kill_and_resume(config: Path, tmp_path: Path, env: dict[str, str], rng: random.Random) -> None:
    """KILLS seeded-random SIGKILLs of the whole process group, each after some progress; then a run to the end."""
    run = tmp_path / "killed"
    resumed_from = []
    for cycle in range(KILLS):
        log = tmp_path / f"cycle{cycle}.log"
        start = max(_checkpoints(run), default=0)
        with log.open("wb") as out:
            proc = subprocess.Popen(_command(config, run), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # its own process group, so killpg reaches every child
            try:
                # 1 or 2 steps on, then anywhere in the next steps: mid-step, mid-save, or between them.
                _kill_after(proc, run, min(start + rng.randint(1, 2), STEPS - 2), rng.uniform(0, 1.2), log)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        assert proc.returncode == -signal.SIGKILL
        if cycle:
            assert f"resuming from checkpoint step {start}" in log.read_text()
        resumed_from.append(start)
    assert resumed_from == sorted(set(resumed_from)) and _checkpoints(run)[-1] < STEPS  # progress, not finished

    done = subprocess.run(_command(config, run), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # A kill mid-save leaves a step without its commit marker: reported, set aside, resumed from the step before;
    # never any other kind of damage.
    logs = [p.read_text() for p in sorted(tmp_path.glob("cycle*.log"))] + [done.stdout + done.stderr]
    damaged = [line for log in logs for line in log.splitlines() if " is damaged (" in line]
    assert all("(no commit_success.txt: the save did not finish)" in line for line in damaged), damaged
    assert _checkpoints(run)[-1] == STEPS


@pytest.mark.slow
def test_sigkilled_and_resumed_run_ends_bitwise_like_an_uninterrupted_one(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, tiny_train_dict: dict
) -> None:
    rng = random.Random(7)
    d = {**tiny_train_dict, "steps": STEPS, "checkpoint": {"every": 1, "keep": 2}}
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(d))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **compile_cache_env(tmp_path_factory)}

    # The run that is never killed goes on alongside the killed one (the test's wall time is mostly startups).
    straight = tmp_path / "straight"
    with (tmp_path / "straight.log").open("wb") as out:
        reference = subprocess.Popen(_command(config, straight), cwd=ROOT, env=env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _kill_and_resume(config, tmp_path, env, rng)
        assert reference.wait(timeout=300) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    finally:
        if reference.poll() is None:
            os.killpg(reference.pid, signal.SIGKILL)
            reference.wait()

    run = tmp_path / "killed"
    target = _target(d, 2)
    a, b = _restore(straight / "checkpoints", target, STEPS), _restore(run / "checkpoints", target, STEPS)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    strip = lambda rs: [{k: v for k, v in r.items() if k not in CLOCK_KEYS} for r in rs]  # noqa: E731
    assert strip(read_metrics(run)) == strip(read_metrics(straight))
