"""Split placement and a fixed lag (trainer/rl/rollouts.py): k = 0 on two device groups is the colocated run to the
bit; k = 1 is deterministic and resumes bitwise, its rollouts sampled ahead saved with the checkpoint."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from trainer.base.config import ConfigError, config_from_dict
from trainer.rl.metrics import CLOCK_KEYS
from trainer.rl.rollouts import tree_bytes
from trainer.rl.train import TrainResult, train

MESH = {"slices": 1, "fsdp": 2, "tensor": 2}  # devices 0-3; with split the sampler's the same shape on 4-7


def _run(d: dict, run_dir: Path, *, split: bool, lag: int, steps: int, stop_after: int | None = None,
         **rl: object) -> TrainResult:
    cfg = {**d, "run_dir": str(run_dir), "steps": steps, "mesh": MESH,
           "rl": {**d["rl"], "lag": lag, **rl},
           "placement": {"mode": "split" if split else "colocated", "sampler": MESH}}
    return train(config_from_dict(cfg), stop_after=stop_after)


def _same(a: TrainResult, b: TrainResult) -> None:
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    strip = lambda rs: [{k: v for k, v in r.items() if k not in CLOCK_KEYS | {"push_bytes"}} for r in rs]  # noqa: E731
    assert strip(a.records) == strip(b.records)


@pytest.mark.slow
def test_split_lag0_equals_colocated(tmp_path: Path, tiny_train_dict: dict) -> None:
    colocated = _run(tiny_train_dict, tmp_path / "c", split=False, lag=0, steps=2)
    split = _run(tiny_train_dict, tmp_path / "s", split=True, lag=0, steps=2)
    _same(colocated, split)
    assert [(r["policy_version"], r["lag"]) for r in split.records] == [(0, 0), (1, 0)]
    assert [r["push_bytes"] for r in colocated.records] == [0, 0]  # the sampler reads the trainer's weights
    # Every update's weights pushed to the sampler's devices: the whole fp32 model each time.
    assert [r["push_bytes"] for r in split.records] == [tree_bytes(split.params)] * 2
    assert all(r["time/push_s"] > 0 for r in split.records)
    assert {d.id for d in split.params["embed"].sharding.device_set} == {0, 1, 2, 3}


@pytest.mark.slow
def test_lag1_is_deterministic_and_resumes_bitwise(tmp_path: Path, tiny_train_dict: dict) -> None:
    """rl.lag 1 colocated (the sampler keeps its own copy of the version it samples with: the update donates the
    trainer's) equals split, and a split run interrupted after step 0 and resumed equals both."""
    straight = _run(tiny_train_dict, tmp_path / "a", split=False, lag=1, steps=3, lag_correction="decoupled")
    # Rollouts of step t from the weights after update max(0, t - 1); the copy is the whole model every step.
    assert [(r["policy_version"], r["lag"], r["push_bytes"]) for r in straight.records] == [
        (0, 0, tree_bytes(straight.params)), (0, 1, tree_bytes(straight.params)), (1, 1, tree_bytes(straight.params))]
    assert all(r["behavior_weight"] > 0 for r in straight.records)
    first = _run(tiny_train_dict, tmp_path / "b", split=True, lag=1, steps=3, stop_after=1,
                 lag_correction="decoupled")
    assert first.stopped_early
    # Its checkpoint holds step 1's rollouts (sampled with version 0), not a second copy of the weights: another
    # lag could not continue the run exactly, and says what to do.
    with pytest.raises(ConfigError, match=r"saved with rl\.lag=1, this run has rl\.lag=0.*Resume with rl\.lag=1"):
        _run(tiny_train_dict, tmp_path / "b", split=True, lag=0, steps=3, lag_correction="decoupled")
    # A reader of the whole saved step (the eval of a checkpoint) restores the queued rollouts with the weights.
    from trainer.rl.checkpoint import Checkpointer
    from trainer.rl.train import start_run

    run = start_run(config_from_dict({**tiny_train_dict, "mesh": MESH, "run_dir": str(tmp_path / "b"),
                                      "rl": {**tiny_train_dict["rl"], "lag": 1}}))
    ckpt = Checkpointer(tmp_path / "b" / "checkpoints", every=0, keep=2, async_save=False)
    state, meta = ckpt.restore(run.saved_target, 1)
    ckpt.close()
    assert meta.queued == [[1, 0]] and state["rollouts"]["0"]["tokens_BN"].shape == (8, 6)
    resumed = _run(tiny_train_dict, tmp_path / "b", split=True, lag=1, steps=3, lag_correction="decoupled")
    assert [r["step"] for r in resumed.records] == [1, 2]
    _same(straight, TrainResult(resumed.run_dir, 3, False, resumed.params, first.records + resumed.records))


@pytest.mark.long
def test_split_across_two_processes_equals_one(tmp_path: Path, tiny_train_dict: dict) -> None:
    """2 OS processes x 4 CPU devices, each giving 2 to the update and 2 to sampling: the weights and rollouts cross
    through trainer/model/transfer.py's Bridge, and the run equals the one-process split run."""
    import yaml

    from trainer.rl.metrics import read_metrics
    from trainer.run.launch import run_local

    cfg = {**tiny_train_dict, "steps": 3, "mesh": MESH, "rl": {**tiny_train_dict["rl"], "lag": 1},
           "placement": {"mode": "split", "sampler": MESH}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert run_local(2, 4, ["--config", str(tmp_path / "cfg.yaml"), "--run-dir", str(tmp_path / "multi")]) == 0
    multi = read_metrics(tmp_path / "multi")
    one = _run(tiny_train_dict, tmp_path / "one", split=True, lag=1, steps=3).records
    assert [(r["policy_version"], r["push_bytes"]) for r in multi] == [(r["policy_version"], r["push_bytes"])
                                                                        for r in one]
    assert [r["reward_mean"] for r in multi] == [r["reward_mean"] for r in one]  # the same rollouts
    assert [r["loss"] for r in multi] == pytest.approx([r["loss"] for r in one], rel=1e-4, abs=1e-6)
