"""A run checkpointed on 2 slices (2 processes x 4 CPU devices, mesh 2x2x2) resumes on 1 slice (1 process x 4
devices, mesh 1x2x2) with the same global batch: the restored state is bitwise what was saved, and training goes on
with the same examples and sampling streams, equal to the 2-slice run up to float rounding."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from trainer.rl.metrics import read_metrics

from .test_checkpoint_damage import _restore, _target, compile_cache_env

ROOT = Path(__file__).resolve().parents[2]


def _launch(processes: int, config: Path, run: Path, env: dict[str, str], *sets: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "--local-processes", str(processes), "--devices-per-process", "4",
         "--config", str(config), "--run-dir", str(run), *(f"--set={s}" for s in sets)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_two_slice_checkpoint_resumes_on_one_slice(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                  tiny_train_dict: dict) -> None:
    d = {**tiny_train_dict, "steps": 6, "checkpoint": {"every": 3, "keep": 2}}
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(d))
    env = compile_cache_env(tmp_path_factory)
    two = tmp_path / "two"
    _launch(2, config, two, env)

    # The same run, stopped after step 3 and resumed on one slice: only checkpoint 3 is left.
    one = tmp_path / "one"
    shutil.copytree(two, one)
    shutil.rmtree(one / "checkpoints" / "6")
    out = _launch(1, config, one, env, "mesh.slices=1")
    assert "resuming from checkpoint step 3\n" in out, out[-3000:]
    resolved = yaml.safe_load((one / "config.yaml").read_text())
    assert {k: resolved["mesh"][k] for k in ("slices", "fsdp", "tensor")} == {"slices": 1, "fsdp": 2, "tensor": 2}
    assert resolved["rl"]["prompts_per_step"] * resolved["rl"]["group_size"] == 8  # the same global batch
    meta = json.loads((one / "checkpoints" / "6" / "meta" / "metadata").read_text())
    assert meta["data_position"] == 6 * 2  # step * prompts_per_step: examples are indexed by global step

    # What the 1-slice run restored is bitwise what the 2-slice run saved (read back on its own 2x2x2 mesh).
    saved = _restore(two / "checkpoints", _target(d, 2), 3)
    restored = _restore(one / "checkpoints", _target(d, 1), 3)
    assert restored["params"]["embed"].sharding.mesh.devices.shape == (1, 2, 2)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Same examples, same per-row sampling keys: the same samples and rewards. The losses and the next params
    # differ only by float rounding (the data-parallel sums run over 2 shards instead of 4).
    a_recs, b_recs = read_metrics(two), read_metrics(one)
    assert [r["step"] for r in b_recs] == list(range(6)) and a_recs[:3] == b_recs[:3]
    for a, b in zip(a_recs[3:], b_recs[3:], strict=True):
        for key in ("reward_mean", "reward_std", "completion_len"):
            assert a[key] == b[key], (a["step"], key)
        for key in ("loss", "pg_loss", "entropy", "grad_norm", "ratio"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key, a[key], b[key])
    end_two = _restore(two / "checkpoints", _target(d, 2), 6)
    end_one = _restore(one / "checkpoints", _target(d, 2), 6)
    for a, b in zip(jax.tree.leaves(end_two["params"]), jax.tree.leaves(end_one["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
