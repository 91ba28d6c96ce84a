"""`--ray` flags: bad combinations are a ConfigError naming the flag and what it takes (exit 2, before ray.init); good
ones become the JaxTrainer's scaling; the driver's exit codes; the worker's env contract and step log."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainer.base.config import ConfigError, config_from_dict
from trainer.run import cli
from trainer.run import ray_train as R
from trainer.run.distributed import cpu_slice_env, process_info_from_env

pytest.importorskip("ray.train", reason="the Ray path needs ray[train]")


def _options(*argv: str) -> R.RayOptions | None:
    return R.options_from_args(cli.build_parser().parse_args(list(argv)))


def _error(*argv: str) -> str:
    with pytest.raises(ConfigError) as err:
        _options(*argv)
    return str(err.value)


def test_no_ray_means_no_options_and_ray_flags_need_ray() -> None:
    assert _options() is None
    msg = _error("--ray-slices", "1:2", "--ray-cpu-devices", "4")
    assert msg == "--ray-slices, --ray-cpu-devices only go with --ray"


@pytest.mark.parametrize("slices", [None, "2:1", "0:2", "1", "a:b", "1:2:3", "-1:2"])
def test_slices_must_be_min_max(slices: str | None) -> None:
    argv = ["--ray", "--ray-cpu-devices", "4", *([f"--ray-slices={slices}"] if slices is not None else [])]
    msg = _error(*argv)
    assert "--ray-slices" in msg and "MIN:MAX" in msg and "1 <= MIN <= MAX" in msg


@pytest.mark.parametrize("tpu", ["TPU-V9:4x4", "v6e:4x4", "TPU-V6E", "TPU-V6E:4by4", "TPU-V6E:0x4", ":4x4"])
def test_tpu_must_be_a_ray_accelerator_and_a_topology(tpu: str) -> None:
    msg = _error("--ray", "--ray-slices", "1:2", "--ray-tpu", tpu)
    assert msg.startswith(f"--ray-tpu {tpu!r}") and "TPU-V6E" in msg and "TPU-V5LITEPOD" in msg and "4x4" in msg


def test_tpu_names_are_rays() -> None:
    from ray.util import accelerators

    assert accelerators.GOOGLE_TPU_V6E in R.tpu_accelerators() and accelerators.GOOGLE_TPU_V4 in R.tpu_accelerators()


def test_cpu_stand_in_flags_do_not_go_with_tpu() -> None:
    msg = _error("--ray", "--ray-slices", "1:2", "--ray-tpu", "TPU-V6E:4x4", "--ray-cpu-devices", "4",
                 "--ray-worker-resources", "{}")
    assert msg.startswith("--ray-cpu-devices, --ray-worker-resources: only for the CPU stand-in")


@pytest.mark.parametrize("devices", [None, "0", "-2"])
def test_cpu_needs_devices(devices: str | None) -> None:
    msg = _error("--ray", "--ray-slices", "1:2", *(["--ray-cpu-devices", devices] if devices else []))
    assert "--ray-cpu-devices M >= 1" in msg


@pytest.mark.parametrize("resources", ["{slice: 1}", "[1]", '{"slice": -1}', '{"slice": true}', '{"TPU": 4}',
                                       '{"": 1}'])
def test_worker_resources_must_be_a_json_object_of_amounts(resources: str) -> None:
    msg = _error("--ray", "--ray-slices", "1:2", "--ray-cpu-devices", "4", "--ray-worker-resources", resources)
    assert msg.startswith(f"--ray-worker-resources {resources!r}")


def test_other_bad_combinations() -> None:
    base = ("--ray", "--ray-slices", "1:2", "--ray-cpu-devices", "4")
    assert "--ray-max-failures -2" in _error(*base, "--ray-max-failures", "-2")
    assert "--ray-resize-interval" in _error(*base, "--ray-resize-interval", "-1")
    assert "--local-processes" in _error(*base, "--local-processes", "2", "--devices-per-process", "4")


def test_good_flags() -> None:
    cpu = _options("--ray", "--ray-slices", "1:2", "--ray-cpu-devices", "4", "--ray-worker-resources",
                   '{"slice": 1}', "--ray-address", "10.0.0.1:6379")
    assert cpu == R.RayOptions(min_slices=1, max_slices=2, cpu_devices=4, worker_resources={"slice": 1.0},
                               address="10.0.0.1:6379")
    assert not cpu.tpu and cpu.max_failures == 3 and cpu.resize_interval_s == 60.0
    tpu = _options("--ray", "--ray-slices", "2:4", "--ray-tpu", "TPU-V6E:4x4", "--ray-max-failures", "-1")
    assert tpu is not None and tpu.tpu
    assert (tpu.accelerator, tpu.topology, tpu.max_failures, tpu.cpu_devices) == ("TPU-V6E", "4x4", -1, None)
    # A v6e 4x4 slice is 4 hosts of 4 chips: 4 Ray workers per slice; the CPU stand-in has 1.
    assert R.workers_per_slice("TPU-V6E", "4x4") == 4 and R.workers_per_slice(None, None) == 1


def test_mesh_must_fit_every_slice_count(tiny_train_dict: dict) -> None:
    cfg = config_from_dict(tiny_train_dict)  # tensor 2, 2 prompts x group 4 = 8 rows
    ok = R.RayOptions(min_slices=1, max_slices=2, cpu_devices=4)
    R.check_mesh(cfg, ok)
    assert R.slice_config(cfg, 1).mesh.axes() == {"slices": 1, "fsdp": -1, "tensor": 2}
    with pytest.raises(ConfigError, match=r"--ray-slices 1:2 --ray-cpu-devices 3: on 1 slice\(s\): mesh"):
        R.check_mesh(cfg, R.RayOptions(min_slices=1, max_slices=2, cpu_devices=3))
    # 3 slices x fsdp 2 = 6 data shards do not split 8 rows
    with pytest.raises(ConfigError, match=r"on 3 slice\(s\): .*divisible"):
        R.check_mesh(cfg, R.RayOptions(min_slices=1, max_slices=3, cpu_devices=4))
    with pytest.raises(ConfigError, match="mesh.tensor=-1"):
        R.slice_config(config_from_dict({**tiny_train_dict, "mesh": {"tensor": -1, "fsdp": 2}}), 1)
    # A split placement's groups would change with the slices each attempt gets: refused, on TPU as on CPU.
    split = config_from_dict({**tiny_train_dict, "placement": {"mode": "split", "sampler": {"fsdp": 2}},
                              "mesh": {"fsdp": 2, "tensor": 1},
                              "sampling": {**tiny_train_dict["sampling"], "tensor": None}})
    for opts in (ok, R.RayOptions(min_slices=1, max_slices=2)):
        with pytest.raises(ConfigError, match=r"placement\.mode=split: not with --ray .*placement\.mode=colocated"):
            R.check_mesh(split, opts)


def test_bad_flags_and_a_mesh_that_does_not_fit_exit_2_before_ray_init(
    tmp_path: Path, tiny_train_dict: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(tiny_train_dict))
    assert cli.main(["--ray", "--ray-slices", "3:1", "--ray-cpu-devices", "4", "--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith("error: --ray-slices '3:1'")
    assert cli.main(["--ray", "--ray-slices", "1:2", "--ray-cpu-devices", "3", "--config", str(config)]) == 2
    assert "error: --ray-slices 1:2 --ray-cpu-devices 3: on 1 slice(s)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


class _FakeTrainer:
    raised: BaseException | None = None
    seen: dict[str, Any] = {}

    def __init__(self, fn: Any, **kwargs: Any) -> None:
        type(self).seen = kwargs

    def fit(self) -> None:
        if self.raised is not None:
            raise self.raised


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> type[_FakeTrainer]:
    import ray
    import ray.train.v2.jax

    monkeypatch.setattr(ray, "init", lambda address=None: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray.train.v2.jax, "JaxTrainer", _FakeTrainer)
    monkeypatch.setenv(R.HEALTH_CHECK_ENV, "unset at teardown")  # run() sets it; monkeypatch undoes both
    monkeypatch.delenv(R.HEALTH_CHECK_ENV)
    _FakeTrainer.raised = None
    return _FakeTrainer


def _worker_failure(exc: BaseException) -> BaseException:
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2.api.exceptions import WorkerGroupError

    wrapped = UserExceptionWithTraceback(exc, f"Traceback (most recent call last):\n  ...\n{exc!r}")
    return WorkerGroupError("[Rank 0 Error Snippet]: ...", {0: wrapped, 1: wrapped})


def test_driver_scaling_and_exit_codes(tiny_train_dict: dict, fake_ray: type[_FakeTrainer],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config_from_dict(tiny_train_dict)
    cpu = R.RayOptions(min_slices=1, max_slices=2, cpu_devices=4, worker_resources={"slice": 1.0}, max_failures=5)
    assert R.run(cfg, cfg, cpu) == 0
    scaling = fake_ray.seen["scaling_config"]
    assert scaling.num_workers == (1, 2) and not scaling.use_tpu
    assert scaling.resources_per_worker == {"CPU": 1.0, "slice": 1.0}
    assert fake_ray.seen["run_config"].failure_config.max_failures == 5
    loop = fake_ray.seen["train_loop_config"]
    assert loop["workers_per_slice"] == 1 and loop["cpu_devices"] == 4
    assert config_from_dict(loop["cfg"]) == cfg  # the whole config reaches the workers
    assert os.environ[R.HEALTH_CHECK_ENV] == "0.5"  # reporting every step must not wait for Ray's 2 s polls
    os.environ[R.HEALTH_CHECK_ENV] = "3"
    assert R.run(cfg, cfg, cpu) == 0 and os.environ[R.HEALTH_CHECK_ENV] == "3"  # the user's value stays

    tpu = R.RayOptions(min_slices=1, max_slices=2, accelerator="TPU-V6E", topology="4x4")
    assert R.run(cfg, cfg, tpu) == 0
    scaling = fake_ray.seen["scaling_config"]
    assert scaling.num_workers == (4, 8) and scaling.use_tpu
    assert (scaling.accelerator_type, scaling.topology) == ("TPU-V6E", "4x4")
    assert scaling.resources_per_worker == {"CPU": 1, "TPU": 4}
    assert fake_ray.seen["train_loop_config"]["cpu_devices"] is None

    capsys.readouterr()
    fake_ray.raised = _worker_failure(RuntimeError("gloo connection reset\nmore detail"))
    assert R.run(cfg, cfg, cpu) == R.EXIT_RAY_FAILED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: Ray Train gave up (max_failures=5): ")
    assert err.endswith("2 worker(s) failed; rank 0: RuntimeError: more detail\n")

    fake_ray.raised = _worker_failure(ConfigError("no usable checkpoint in /ckpt"))  # the same on every attempt
    assert R.run(cfg, cfg, cpu) == 2
    assert capsys.readouterr().err == "error: no usable checkpoint in /ckpt\n"


def test_worker_env_contract_and_step_log(tmp_path: Path) -> None:
    info = process_info_from_env(cpu_slice_env("10.0.0.1:1234", 3, 2, 4))
    assert (info.num_processes, info.process_id, info.cpu_devices, info.coordinator) == (3, 2, 4, "10.0.0.1:1234")

    reports: list[dict[str, Any]] = []
    rank0 = R.step_reporter(tmp_path, 0, 2, 2, reports.append)
    rank1 = R.step_reporter(tmp_path, 1, 2, 2, reports.append)
    for step in range(2):
        record = {"step": step, "loss": 0.5, "reward_mean": 0.25}
        rank0(record)
        rank1(record)
    assert [(r["step"], r["world"], r["slices"]) for r in reports] == [(0, 2, 2)] * 2 + [(1, 2, 2)] * 2
    lines = [json.loads(line) for line in (tmp_path / R.STEPS_FILE).read_text().splitlines()]
    assert [(r["step"], r["world"], r["loss"]) for r in lines] == [(0, 2, 0.5), (1, 2, 0.5)]  # rank 0 only
