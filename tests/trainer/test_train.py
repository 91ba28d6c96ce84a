from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from trainer.base.config import ModelConfig, config_from_dict
from trainer.model import decoder as M
from trainer.model.hf import export_hf
from trainer.rl.metrics import CLOCK_KEYS, read_metrics
from trainer.rl.train import train


def _board(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a scalar in the run folder's TensorBoard event files (TFRecords of Event protos), as
    TensorBoard reads them: files in name (= creation) order, a SessionLog START (what a writer's purge_step writes
    first) dropping the values logged before it at or after its step."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[int, float] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + length])
            i += 12 + length + 4  # length, its crc, the record, its crc
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                out = {s: v for s, v in out.items() if s < event.step}
            for value in event.summary.value:
                if value.tag == tag:
                    out[event.step] = value.simple_value
    return sorted(out.items())


def _cfg(d: dict, run_dir: Path, **top: object) -> object:
    return config_from_dict({**d, "run_dir": str(run_dir), **top})


@pytest.mark.slow
def test_resume_is_bitwise_exact(tmp_path: Path, tiny_train_dict: dict) -> None:
    straight = train(_cfg(tiny_train_dict, tmp_path / "a", steps=6))
    assert straight.step == 6 and not straight.stopped_early

    first = train(_cfg(tiny_train_dict, tmp_path / "b", steps=6), stop_after=3)
    assert first.step == 3 and first.stopped_early
    resumed = train(_cfg(tiny_train_dict, tmp_path / "b", steps=6))
    assert resumed.step == 6 and [r["step"] for r in resumed.records] == [3, 4, 5]

    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The logged history is identical too (minus wall-clock fields).
    strip = lambda rs: [{k: v for k, v in r.items() if k not in CLOCK_KEYS} for r in rs]  # noqa: E731
    assert strip(read_metrics(tmp_path / "a")) == strip(read_metrics(tmp_path / "b"))
    # TensorBoard sees the one history across the two writers (the resumed one purges from its start step on).
    history = read_metrics(tmp_path / "b")
    assert _board(tmp_path / "b", "loss") == [(r["step"], pytest.approx(r["loss"])) for r in history]
    # And training did something: params moved away from the step-0 init.
    assert any(r["grad_norm"] > 0 for r in read_metrics(tmp_path / "a"))


@pytest.mark.slow
def test_hf_init_gspo_kl_run_writes_metrics_plot_and_summary(tmp_path: Path, tiny_train_dict: dict,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    model_cfg = ModelConfig(**tiny_train_dict.pop("model"))
    start = M.init_params(model_cfg, jax.random.PRNGKey(123))
    export_hf(start, model_cfg, tmp_path / "hf")
    tiny_train_dict["init"] = {"from": "hf", "path": str(tmp_path / "hf")}
    tiny_train_dict["rl"].update(algo="gspo", kl_beta=0.05, kl_estimator="k3", loss_agg="seq_mean_token_mean",
                                 clip_eps=3e-4, clip_eps_high=4e-4)
    # A random model earns no char_match credit: the length reward varies within groups, so the first update has a
    # real gradient (without one, only rounding between the policy and reference passes moved the weights).
    tiny_train_dict["rewards"] = ["char_match", "length"]
    tiny_train_dict["mesh"] = {"slices": 1, "fsdp": 2, "tensor": 2}  # a subset of the 8 devices
    run_dir = tmp_path / "run"
    result = train(_cfg(tiny_train_dict, run_dir, steps=2))
    # Started from the imported weights: 2 small Adam steps away from them (a fresh init is O(0.1) away).
    for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(result.params), strict=True):
        assert float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) < 0.03
    # The import records the family the export wrote (qwen3: the tiny model has QK-norm).
    want_model = model_cfg.model_copy(update={"family": "qwen3"}).model_dump()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"] == want_model
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1]
    for key in ("reward_mean", "reward_std", "reward/char_match", "loss", "kl", "clip_frac", "entropy",
                "completion_len", "tokens_per_s", "step_time_s"):
        assert all(math.isfinite(r[key]) for r in records), key
    # Where the time went: each phase (the reference pass with the KL term on), within the step's time.
    for r in records:
        phases = [r[f"time/{p}_s"] for p in ("sample", "score", "reference", "update")]
        assert all(t > 0 for t in phases) and sum(phases) <= r["step_time_s"] and r["time/checkpoint_s"] >= 0
    assert records[1]["time/checkpoint_s"] > 0  # the last step saves
    assert all(0 < r["slot_efficiency"] <= 1 for r in records)
    # The run folder opens in TensorBoard: every number of the JSONL, per step.
    assert _board(run_dir, "loss") == [(0, pytest.approx(records[0]["loss"])), (1, pytest.approx(records[1]["loss"]))]
    assert [step for step, _ in _board(run_dir, "time/update_s")] == [0, 1]
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert records[1]["kl"] > 0
    assert (run_dir / "metrics.png").stat().st_size > 1000
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 2 and "reward_start" in summary
    # What a pod's log shows: one line per step however long (no wrap at 80 columns outside a terminal), and the
    # summary in words that fit a 2-step run.
    out = capsys.readouterr().out
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 2 and all("tok/s" in line and line.endswith("s)") for line in step_lines), out
    assert max(map(len, step_lines)) > 80 and "(first step) -> end" in out and "(last step)" in out
    assert result.params["embed"].sharding.mesh.devices.size == 4
