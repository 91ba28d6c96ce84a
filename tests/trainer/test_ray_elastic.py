"""The trainer under Ray Train (`python -m trainer --ray`) on a local CPU Ray cluster of two one-worker "slice" nodes
(bench/ray_elastic.py): a SIGKILLed worker restarts at 2 workers and goes on bitwise like a run that never stopped;
a lost slice node continues on the one left from the last checkpoint, with the same data order, so it matches the
never-stopped run up to float rounding."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import yaml

from trainer.base.config import config_from_dict
from trainer.rl.metrics import CLOCK_KEYS, read_metrics
from trainer.rl.train import train

from .test_checkpoint_damage import _restore, _target, compile_cache_env

pytest.importorskip("ray.train", reason="the Ray path needs ray[train]")

ROOT = Path(__file__).resolve().parents[2]
STEPS, KILL_STEP, LOSS_STEP = 8, 2, 5


def test_on_step_gets_each_step_record_in_order(tmp_path: Path, tiny_train_dict: dict) -> None:
    seen: list[dict[str, Any]] = []
    result = train(config_from_dict({**tiny_train_dict, "steps": 2}), on_step=seen.append)
    assert [r["step"] for r in seen] == [0, 1] and seen == result.records


def _attempts(history: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """ray_steps.jsonl split by worker-group attempt (each runs in new processes: rank 0's pid tells them apart)."""
    out: list[list[dict[str, Any]]] = []
    for rec in history:
        if out and out[-1][-1]["pid"] == rec["pid"]:
            out[-1].append(rec)
        else:
            out.append([rec])
    return out


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """The bench shuts its Ray cluster down on SIGTERM; whatever is left of its process group is then killed."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=90)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # raylets, Ray workers and the trainer's driver share the group
    proc.wait()


@pytest.mark.slow
def test_ray_run_survives_a_killed_worker_and_a_lost_slice(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, tiny_train_dict: dict
) -> None:
    d = {**tiny_train_dict, "steps": STEPS, "checkpoint": {"every": 1, "keep": 100}}
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(d))
    work, figures_path, log = tmp_path / "work", tmp_path / "figures.json", tmp_path / "bench.log"
    cmd = [sys.executable, str(ROOT / "bench" / "ray_elastic.py"), "--config", str(config), "--steps", str(STEPS),
           "--kill-step", str(KILL_STEP), "--loss-step", str(LOSS_STEP), "--work", str(work), "--out",
           str(figures_path), "--timeout", "720",
           # A worker group starts in 7-12 s here (2 cores, loaded). After the node loss Ray Train tries 2 workers
           # until its resource view drops the dead node (Ray Data's AutoscalingCoordinator re-reads the nodes every
           # 20 s), each try waiting out this timeout: 15 s instead of the bench's 25 turns two failed 25-s tries
           # into about two 15-s ones. A start that takes longer is retried (Train's controller retries these without
           # limit), which the assertions below see as nothing but time.
           "--start-timeout", "15"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **compile_cache_env(tmp_path_factory)}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: the whole Ray cluster
    try:
        proc.wait(timeout=1000)
    finally:
        _stop(proc)
    tail = log.read_text(errors="replace")[-3000:]
    assert figures_path.exists(), tail
    figures = json.loads(figures_path.read_text())
    print(json.dumps({k: figures.get(k) for k in ("reference_s", "cluster_start_s", "first_step_s", "ray_run_s",
                                                  "total_s", "events", "steps_per_world")}, indent=1))
    assert proc.returncode == 0 and figures["ok"] and figures["driver_rc"] == 0, (figures.get("error"), tail)
    run, reference = work / "ray", work / "reference"
    ray_log = (work / "ray.log").read_text(errors="replace")
    assert "ray: training finished" in ray_log

    # Three worker groups: 2 workers; 2 again after the SIGKILL (the node and its resources stay); 1 after the node
    # loss. Each restart resumes at the newest checkpoint: the step after the last one reported, or that step
    # itself if its checkpoint was still being written (no other step is redone), and runs on without gaps.
    kill, loss = figures["events"]
    assert (kill["kind"], kill["world_after"], loss["kind"], loss["world_after"]) == ("kill", 2, "node_loss", 1)
    attempts = _attempts([json.loads(line) for line in (run / "ray_steps.jsonl").read_text().splitlines()])
    assert [a[0]["world"] for a in attempts] == [2, 2, 1] and all(
        r["world"] == a[0]["world"] for a in attempts for r in a)
    assert attempts[0][0]["step"] == 0 and attempts[-1][-1]["step"] == STEPS - 1
    for a in attempts:
        assert [r["step"] for r in a] == list(range(a[0]["step"], a[-1]["step"] + 1))
    resumed = [a[0]["step"] for a in attempts[1:]]
    assert figures["resumed_from"] == resumed  # what train() printed: "resuming from checkpoint step N"
    for before, start in zip(attempts[:-1], resumed, strict=True):
        assert before[-1]["step"] <= start <= before[-1]["step"] + 1
    assert resumed[0] >= KILL_STEP - 1 and resumed[1] >= LOSS_STEP - 1 and resumed[1] > resumed[0]

    # The final metrics hold every step once. Steps run on 2 workers are bitwise those of the never-stopped run
    # (2 local processes, same mesh), including the ones after the SIGKILL restart; steps on 1 worker read the same
    # examples with the same sampling streams, so samples and rewards are equal and the losses differ by rounding.
    final, ref = read_metrics(run), read_metrics(reference)
    assert [r["step"] for r in final] == list(range(STEPS)) == [r["step"] for r in ref]
    strip = lambda r: {k: v for k, v in r.items() if k not in CLOCK_KEYS}  # noqa: E731
    for a, b in zip(final[: resumed[1]], ref[: resumed[1]], strict=True):
        assert strip(a) == strip(b), a["step"]
    for a, b in zip(final[resumed[1]:], ref[resumed[1]:], strict=True):
        for key in ("reward_mean", "reward_std", "completion_len"):
            assert a[key] == b[key], (a["step"], key)
        for key in ("loss", "pg_loss", "entropy", "grad_norm", "ratio"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key, a[key], b[key])

    # The state the 2-worker group left (after its own SIGKILL restart) is bitwise the never-stopped run's; the
    # final state after the 1-worker stretch equals it up to rounding.
    target = _target(d, 2)
    mine, theirs = _restore(run / "checkpoints", target, resumed[1]), _restore(reference / "checkpoints", target,
                                                                              resumed[1])
    for x, y in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    mine, theirs = _restore(run / "checkpoints", target, STEPS), _restore(reference / "checkpoints", target, STEPS)
    for x, y in zip(jax.tree.leaves(mine["params"]), jax.tree.leaves(theirs["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
