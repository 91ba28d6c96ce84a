"""Stopping a local run from the terminal: the whole process group gets SIGINT/SIGTERM, possibly several times, and
the launcher forwards its own SIGTERM. However many arrive, and whenever: one checkpoint, exit 143, a whole
run folder."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _wait_for_steps(run: Path, proc: subprocess.Popen[bytes], n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early with {proc.returncode}")
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError("no training steps within the timeout")


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.long)])  # another draw of the same timings
def test_repeated_signals_to_the_process_group_stop_once(tmp_path: Path, tiny_train_dict: dict, seed: int) -> None:
    rng = random.Random(seed)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({**tiny_train_dict, "steps": 10_000}))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "--local-processes", "2", "--devices-per-process", "4",
         "--config", str(config), "--run-dir", str(run)],
        cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_steps(run, proc, rng.randint(1, 3))
        time.sleep(rng.uniform(0, 1.0))  # anywhere inside a step
        for _ in range(rng.randint(2, 5)):  # Ctrl-C reaches every process; an impatient user presses it again
            os.killpg(proc.pid, rng.choice([signal.SIGINT, signal.SIGTERM]))
            time.sleep(rng.uniform(0, 0.6))
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.decode(errors="replace") + err.decode(errors="replace")
    assert proc.returncode == 143, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped"] is True
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [summary["step"]]  # exactly one checkpoint, at the step the run stopped after
    assert len((run / "metrics.jsonl").read_text().splitlines()) == summary["step"]
    assert (run / "metrics.png").is_file()
