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
def test_lag1_is_deterministic_and_resumes_bitwise(tmp_path: Path, tiny_train_dict: dict,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """rl.lag 1 colocated (the sampler keeps its own copy of the version it samples with: the update donates the
    trainer's) equals split, and a split run interrupted after step 0 and resumed equals both. Each step takes its
    rollouts before it dispatches the next sampling: across processes their way back is a program on the sampler's
    devices, which would otherwise wait for that sampling to end."""
    from trainer.rl.rollouts import Pipeline

    calls: list[tuple[str, int]] = []
    for name in ("pop", "dispatch"):
        def logged(self: Pipeline, step: int, _name: str = name, _f: object = getattr(Pipeline, name)) -> object:
            calls.append((_name, step))
            return _f(self, step)  # type: ignore[operator]
        monkeypatch.setattr(Pipeline, name, logged)
    straight = _run(tiny_train_dict, tmp_path / "a", split=False, lag=1, steps=3, lag_correction="decoupled")
    assert calls == [("dispatch", 0), ("pop", 0), ("dispatch", 1), ("pop", 1), ("dispatch", 2), ("pop", 2)]
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
    calls.clear()
    resumed = _run(tiny_train_dict, tmp_path / "b", split=True, lag=1, steps=3, lag_correction="decoupled")
    assert [r["step"] for r in resumed.records] == [1, 2]
    assert calls == [("pop", 1), ("dispatch", 2), ("pop", 2)]  # step 1's rollouts came with the checkpoint
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


PAIR = {"slices": 1, "fsdp": 2, "tensor": 1}  # 2 devices: with 4 one-device processes, 2 train and 2 sample


@pytest.mark.long
def test_split_by_process_equals_one_process(tmp_path: Path, tiny_train_dict: dict) -> None:
    """4 OS processes x 1 CPU device split by process (a host or slice stand-in): processes 0-1 train, 2-3 sample,
    so each holds devices of one group only. The weights cross to other processes and the rollouts come back through
    the Bridge, the trainer's metrics and checksums reach the sampler's processes, only the trainer's processes write
    the checkpoint; the run equals the one-process split run and the colocated one, to the bit, and a roll-back to a
    checkpoint holding a queued rollout resumes bitwise."""
    import yaml

    from trainer.rl.metrics import read_metrics
    from trainer.run.launch import run_local

    d = {**tiny_train_dict, "mesh": PAIR, "rl": {**tiny_train_dict["rl"], "lag": 1},
         "placement": {"mode": "split", "sampler": PAIR}, "checkpoint": {"every": 1, "keep": 3},
         "eval": {"prompts": 4, "samples": 0}}  # greedy, after the last step: its scores reach every process
    strip = lambda rs: [{k: v for k, v in r.items() if k not in CLOCK_KEYS} for r in rs]  # noqa: E731
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({**d, "steps": 3}))
    args = ["--config", str(tmp_path / "cfg.yaml"), "--run-dir", str(tmp_path / "multi")]
    assert run_local(4, 1, args) == 0
    multi = read_metrics(tmp_path / "multi")
    one = train(config_from_dict({**d, "steps": 3, "run_dir": str(tmp_path / "one")})).records
    colocated = train(config_from_dict({**d, "steps": 3, "run_dir": str(tmp_path / "c"),
                                        "placement": {"mode": "colocated"}})).records
    assert strip(multi) == strip(one)
    assert [r["policy_version"] for r in multi] == [0, 0, 1] and "eval/greedy_len" in multi[-1]
    unpushed = {"push_bytes"}
    assert [{k: v for k, v in r.items() if k not in unpushed} for r in strip(multi)] == [
        {k: v for k, v in r.items() if k not in unpushed} for r in strip(colocated)]
    # Back to step 2 (its checkpoint holds step 2's rollouts, sampled on processes 2-3): the same last step.
    assert run_local(4, 1, [*args, "--set", "checkpoint.resume_step=2"]) == 0
    assert strip(read_metrics(tmp_path / "multi")) == strip(one)


def test_bridge_partners_by_process() -> None:
    """The Bridge's pairing (fake devices): within each process where both groups are there, else the k-th trainer
    device (in process order) with the k-th sampler device, on another process."""
    from collections import namedtuple
    from types import SimpleNamespace

    from trainer.model.transfer import _partners

    dev = namedtuple("dev", "process_index id")  # hashable, as jax's devices

    def pairs(mine: list, theirs: list) -> list:
        flat = np.empty(len(mine), dtype=object)
        flat[:] = mine
        grid = SimpleNamespace(devices=flat.reshape(1, len(mine) // 2, 2))
        return [(a.process_index, a.id, b.process_index, b.id)
                for a, b in zip(grid.devices.flat, _partners(grid, theirs).flat, strict=True)]  # type: ignore[arg-type]

    assert pairs([dev(0, 0), dev(0, 1), dev(1, 4), dev(1, 5)], [dev(1, 7), dev(1, 6), dev(0, 3), dev(0, 2)]) == [
        (0, 0, 0, 2), (0, 1, 0, 3), (1, 4, 1, 6), (1, 5, 1, 7)]
    assert pairs([dev(1, 1), dev(0, 0)], [dev(3, 3), dev(2, 2)]) == [(1, 1, 3, 3), (0, 0, 2, 2)]


def test_split_by_process_refusals() -> None:
    """What still cannot run in a job of several processes is refused with the reason (fake devices: no jax job)."""
    from types import SimpleNamespace

    from trainer.base.placement import check_multiprocess_split

    def devs(*procs: int) -> list:
        return [SimpleNamespace(process_index=p, id=i) for i, p in enumerate(procs)]

    check_multiprocess_split(devs(0, 1), devs(2, 3), 4)  # by process
    check_multiprocess_split(devs(0, 1, 2, 3), devs(0, 1, 2, 3), 4)  # within each process
    for trainer, sampler, why in [
        (devs(0, 1), devs(2, 3, 3, 3), "of equal size"),
        (devs(0, 0), devs(2, 2), "hold none"),
        (devs(0, 1, 2), devs(1, 2, 3), "one group only"),
        (devs(2, 3), devs(0, 1), "process 0 to train"),
    ]:
        with pytest.raises(ConfigError, match=why):
            check_multiprocess_split(trainer, sampler, 4)
    with pytest.raises(ConfigError, match="orbax refuses"):
        check_multiprocess_split(devs(0, 0), devs(1, 1), 2)


def test_the_bridge_lands_shards_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Bridge in one process (devices 0-3 and 4-7): there and back to the bit, one collective permute, and each
    landed shard is the permute's own output buffer (no copy after it), as each source shard is its input buffer."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from trainer.model import transfer
    from trainer.model.sharding import make_mesh

    mesh, other = make_mesh(1, 2, 2, jax.devices()[:4]), make_mesh(1, 2, 2, jax.devices()[4:])
    bridge = transfer.Bridge(mesh, list(other.devices.flat))
    on = lambda m, spec: NamedSharding(m, spec)  # noqa: E731
    specs = {"w": P("fsdp", "tensor"), "v": P(("slices", "fsdp")), "b": P(), "s": P()}
    tree = {"w": jnp.arange(32.0).reshape(8, 4), "v": jnp.arange(4, dtype=jnp.int32) - 2,
            "b": jnp.array([1.5, -0.0, 3.0, -2.0]), "s": jnp.float32(7.0)}
    tree = {k: jax.device_put(x, on(mesh, specs[k])) for k, x in tree.items()}
    seen: list[tuple[list[jax.Array], list[jax.Array]]] = []
    real = transfer.swap

    def spy(xs: list[jax.Array], shardings: tuple) -> list[jax.Array]:
        out = real(xs, shardings)
        seen.append((xs, out))
        return out

    monkeypatch.setattr(transfer, "swap", spy)
    target = {"w": on(other, P(None, "fsdp")), "v": on(other, P()), "b": on(other, P("tensor")), "s": on(other, P())}
    there = bridge.there(tree, target)
    landed = bridge._cross(tree, bridge.mesh, bridge.twin)
    back = bridge.back(there, {k: on(mesh, specs[k]) for k in tree})
    for k, x in tree.items():
        assert there[k].sharding == target[k] and back[k].sharding == x.sharding
        np.testing.assert_array_equal(np.asarray(there[k]), np.asarray(x))
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(x))
    (xs, out) = seen[1]  # the _cross call above
    for x, u, m, got in zip(jax.tree.leaves(tree), xs, out, jax.tree.leaves(landed), strict=True):
        ptr = lambda a: {s.device: s.data.unsafe_buffer_pointer() for s in a.addressable_shards}  # noqa: E731
        if x.ndim:  # a 0-d array is reshaped to [1] and back: a few bytes
            assert {d: p for d, p in ptr(u).items() if d in set(mesh.devices.flat)} == ptr(x)
            assert {d: p for d, p in ptr(m).items() if d in set(other.devices.flat)} == ptr(got)
    hlo = real.lower(xs, tuple(u.sharding for u in xs)).compile().as_text()
    assert "collective-permute" in hlo and "all-gather" not in hlo and "all-to-all" not in hlo
