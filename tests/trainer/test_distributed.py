from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from envspec import pod
from trainer.base.config import ConfigError, config_from_dict
from trainer.rl.metrics import read_metrics
from trainer.rl.train import train
from trainer.run import distributed as D
from trainer.run.launch import child_env, run_local

POD = {
    "COORDINATOR_ADDRESS": "rl-slice-0-0.rl:8476",
    "NUM_SLICES": "2",
    "SLICE_INDEX": "1",
    "HOSTS_PER_SLICE": "4",
    "HOST_INDEX": "3",
}


def test_env_contract_names() -> None:
    assert D.POD_ENV_VARS == ("COORDINATOR_ADDRESS", "NUM_SLICES", "SLICE_INDEX", "HOSTS_PER_SLICE", "HOST_INDEX")
    assert (pod.ENV_CHECKPOINT_DIR, pod.ENV_HF_TOKEN, D.ENV_CPU_DEVICES) == ("CHECKPOINT_DIR", "HF_TOKEN",
                                                                           "TRAINER_CPU_DEVICES")


def test_process_info_from_pod_env() -> None:
    info = D.process_info_from_env(POD)
    assert info.multi_process and info.coordinator == "rl-slice-0-0.rl:8476"
    assert (info.num_processes, info.process_id) == (8, 1 * 4 + 3)
    single = D.process_info_from_env({})
    assert not single.multi_process and (single.num_processes, single.process_id) == (1, 0)


def test_partial_or_bad_env_is_an_error() -> None:
    with pytest.raises(ConfigError, match="HOST_INDEX"):
        D.process_info_from_env({k: v for k, v in POD.items() if k != "HOST_INDEX"})
    with pytest.raises(ConfigError, match="SLICE_INDEX=2"):
        D.process_info_from_env({**POD, "SLICE_INDEX": "2"})
    with pytest.raises(ConfigError, match="NUM_SLICES='two'"):
        D.process_info_from_env({**POD, "NUM_SLICES": "two"})


def test_launcher_gives_each_child_a_pod_env() -> None:
    envs = [child_env({"PATH": "/bin"}, i, 2, 4, 1234) for i in range(2)]
    for i, env in enumerate(envs):
        info = D.process_info_from_env(env)
        assert info.coordinator == "127.0.0.1:1234" and info.num_processes == 2 and info.process_id == i
        assert info.cpu_devices == 4 and env["PATH"] == "/bin"
        assert set(D.POD_ENV_VARS) <= set(env)


@pytest.mark.slow
def test_two_process_run_matches_single_process(tmp_path: Path, tiny_train_dict: dict) -> None:
    """2 OS processes x 4 CPU devices (gloo over localhost) vs 1 process x 8 devices, same 2x2x2 mesh."""
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({**tiny_train_dict, "steps": 2}))
    rc = run_local(2, 4, ["--config", str(config), "--run-dir", str(tmp_path / "multi")])
    assert rc == 0
    multi = read_metrics(tmp_path / "multi")
    assert [r["step"] for r in multi] == [0, 1]
    assert (tmp_path / "multi" / "checkpoints" / "2").is_dir()

    single = train(config_from_dict({**tiny_train_dict, "steps": 2, "run_dir": str(tmp_path / "single")}))
    one = single.records
    assert multi[0]["reward_mean"] == one[0]["reward_mean"]  # identical samples
    assert multi[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-5, abs=1e-7)
    assert multi[1]["loss"] == pytest.approx(one[1]["loss"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_launcher_propagates_failure(tmp_path: Path, tiny_train_dict: dict) -> None:
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({**tiny_train_dict, "task": {"name": "no-such-task"}}))
    assert run_local(2, 4, ["--config", str(config), "--run-dir", str(tmp_path / "run")]) == 2
