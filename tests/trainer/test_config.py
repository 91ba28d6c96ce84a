from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.base.config import ConfigError, config_from_dict, load_config, resolve_mesh
from trainer.run.cli import main


def _write(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_embedded_demo_config_loads() -> None:
    cfg = load_config(None, [])
    assert (cfg.mesh.slices, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, 2, 2)
    assert cfg.batch_size % (cfg.mesh.slices * cfg.mesh.fsdp) == 0
    resolve_mesh(cfg, 8, exact=True)


def test_overrides_parse_yaml_scalars(tmp_path: Path, tiny_train_dict: dict) -> None:
    path = _write(tmp_path, tiny_train_dict)
    cfg = load_config(path, ["rl.clip_eps=0.1", "steps=7", "model.qk_norm=false", "task.name=copy",
                             "rl.algo=gspo", "sampling.top_p=1"])
    assert cfg.rl.clip_eps == 0.1 and cfg.steps == 7 and cfg.model_cfg.qk_norm is False
    assert cfg.task.name == "copy" and cfg.rl.algo == "gspo" and cfg.sampling.top_p == 1.0


def test_task_section_keeps_task_options(tiny_train_dict: dict) -> None:
    tiny_train_dict["task"] = {"name": "gsm8k", "path": "x.jsonl"}
    cfg = config_from_dict(tiny_train_dict)
    # The extra keys go to the task; the kit's own (chat_template, ...) keep their defaults.
    assert cfg.task.name == "gsm8k" and cfg.task.model_extra == {"path": "x.jsonl"} and not cfg.task.chat_template


@pytest.mark.parametrize(
    ("override", "key"),
    [("rl.gruop_size=4", "rl.gruop_size"), ("model.n_layer=2", "model.n_layer"), ("stepz=3", "stepz"),
     ("checkpoint.evry=1", "checkpoint.evry")],
)
def test_unknown_key_named_in_error(tmp_path: Path, tiny_train_dict: dict, override: str, key: str) -> None:
    path = _write(tmp_path, tiny_train_dict)
    with pytest.raises(ConfigError, match=rf"unknown config key: {key}\b"):
        load_config(path, [override])


def test_unknown_key_in_file_named(tmp_path: Path, tiny_train_dict: dict) -> None:
    tiny_train_dict["sampling"]["temprature"] = 0.5
    with pytest.raises(ConfigError, match=r"sampling\.temprature"):
        load_config(_write(tmp_path, tiny_train_dict), [])


def test_bad_value_names_key(tiny_train_dict: dict) -> None:
    tiny_train_dict["rl"]["algo"] = "ppo"
    with pytest.raises(ConfigError, match=r"rl\.algo"):
        config_from_dict(tiny_train_dict)


def test_lengths_must_fit_model(tiny_train_dict: dict) -> None:
    tiny_train_dict["sampling"]["max_new_tokens"] = 12  # 8 + 12 > max_seq_len 16
    with pytest.raises(ConfigError, match=r"max_new_tokens.*max_seq_len \(16\)"):
        config_from_dict(tiny_train_dict)


def test_mesh_must_divide_devices(tiny_train_dict: dict) -> None:
    tiny_train_dict["mesh"] = {"slices": 3, "fsdp": 1, "tensor": 1}
    cfg = config_from_dict(tiny_train_dict)
    with pytest.raises(ConfigError, match=r"slices=3 x fsdp=1 x tensor=1 = 3 devices must divide the 8"):
        resolve_mesh(cfg, 8)
    tiny_train_dict["mesh"] = {"slices": 1, "fsdp": 2, "tensor": 2}
    with pytest.raises(ConfigError, match=r"must equal the 8 available"):
        resolve_mesh(config_from_dict(tiny_train_dict), 8, exact=True)


def test_mesh_infers_minus_one(tiny_train_dict: dict) -> None:
    tiny_train_dict["mesh"] = {"slices": 1, "fsdp": -1, "tensor": 2}
    cfg = resolve_mesh(config_from_dict(tiny_train_dict), 8)
    assert (cfg.mesh.slices, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, 4, 2)
    tiny_train_dict["mesh"] = {"slices": 1, "fsdp": -1, "tensor": 3}
    with pytest.raises(ConfigError, match=r"mesh\.fsdp=-1 cannot be inferred"):
        resolve_mesh(config_from_dict(tiny_train_dict), 8)


def test_batch_must_divide_data_axes(tiny_train_dict: dict) -> None:
    tiny_train_dict["rl"].update(prompts_per_step=3, group_size=3)
    with pytest.raises(ConfigError, match=r"rl\.prompts_per_step \* rl\.group_size = 3 \* 3 = 9 .* mesh\.slices \* "
                                          r"mesh\.fsdp = 4"):
        resolve_mesh(config_from_dict(tiny_train_dict), 8)


def test_sampling_tensor_is_checked_against_the_mesh(tiny_train_dict: dict) -> None:
    tiny_train_dict["mesh"] = {"slices": 1, "fsdp": 4, "tensor": 2}
    tiny_train_dict["sampling"].update(tensor=4)
    with pytest.raises(ConfigError, match=r"sampling\.tensor needs sampling\.gather_weights: true"):
        config_from_dict(tiny_train_dict)
    tiny_train_dict["sampling"].update(gather_weights=True)
    cfg = resolve_mesh(config_from_dict(tiny_train_dict), 8)
    assert cfg.sampler_mesh == {"slices": 1, "fsdp": 2, "tensor": 4}
    for bad in (3, 6, 16):
        tiny_train_dict["sampling"].update(tensor=bad)
        with pytest.raises(ConfigError, match=rf"sampling\.tensor={bad} must be a multiple of mesh\.tensor=2 "
                                              r"dividing mesh\.fsdp \* mesh\.tensor = 8: one of \[2, 4, 8\]"):
            resolve_mesh(config_from_dict(tiny_train_dict), 8)


def test_cli_reports_config_errors_without_traceback(tmp_path: Path, tiny_train_dict: dict,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, tiny_train_dict)
    assert main(["--config", path, "--set", "rl.bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key: rl.bogus" in err and "Traceback" not in err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read config" in capsys.readouterr().err
    assert main(["--config", path, "--local-processes", "3", "--devices-per-process", "1"]) == 2
    assert "must equal the 3 available devices" in capsys.readouterr().err


def test_split_placement_resolves_and_names_the_keys(tiny_train_dict: dict) -> None:
    tiny_train_dict["mesh"] = {"slices": 1, "fsdp": 2, "tensor": 2}
    tiny_train_dict["placement"] = {"mode": "split", "sampler": {"slices": 1, "fsdp": -1, "tensor": 2}}
    cfg = resolve_mesh(config_from_dict(tiny_train_dict), 8)
    assert cfg.sampler_mesh == {"slices": 1, "fsdp": 2, "tensor": 2}  # the devices mesh leaves: 8 - 4
    tiny_train_dict["mesh"]["fsdp"] = -1  # both inferred: half each
    assert resolve_mesh(config_from_dict(tiny_train_dict), 8).mesh.fsdp == 2
    tiny_train_dict["mesh"] = {"slices": 1, "fsdp": 4, "tensor": 2}
    tiny_train_dict["placement"]["sampler"] = {"fsdp": 2, "tensor": 2}
    with pytest.raises(ConfigError, match=r"placement\.mode=split needs mesh \(1 x 4 x 2 = 8\) \+ placement\.sampler "
                                          r"\(1 x 2 x 2 = 4\) = 12 devices, which must fit in the 8"):
        resolve_mesh(config_from_dict(tiny_train_dict), 8)
    tiny_train_dict["mesh"] = {"slices": 1, "fsdp": 2, "tensor": 2}
    with pytest.raises(ConfigError, match=r"must equal the 16 available"):
        resolve_mesh(config_from_dict(tiny_train_dict), 16, exact=True)
    tiny_train_dict["placement"]["sampler"] = {"fsdp": 3}
    with pytest.raises(ConfigError, match=r"placement\.sampler\.slices \* placement\.sampler\.fsdp = 3"):
        resolve_mesh(config_from_dict(tiny_train_dict), 8)
    tiny_train_dict["placement"]["sampler"] = {"fsdp": 0}
    with pytest.raises(ConfigError, match=r"placement\.sampler\.fsdp=0"):
        config_from_dict(tiny_train_dict)
    tiny_train_dict["placement"]["sampler"] = {}
    tiny_train_dict["sampling"].update(tensor=2, gather_weights=True)
    with pytest.raises(ConfigError, match=r"sampling\.tensor: with placement\.mode=split"):
        config_from_dict(tiny_train_dict)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("lag", -1, r"rl\.lag: Input should be greater than or equal to 0"),
    ("lag_correction", "is", r"rl\.lag_correction: Input should be 'clip' or 'decoupled'"),
    # A cap below 1 would weigh down tokens where both policies agree (w = 1); AReaL's cap must be > 1 too.
    ("behavior_weight_cap", 1, r"rl\.behavior_weight_cap: Input should be greater than 1"),
    ("behavior_weight_cap", 0.5, r"rl\.behavior_weight_cap: Input should be greater than 1"),
])
def test_lag_keys_are_checked(tiny_train_dict: dict, key: str, value: object, match: str) -> None:
    tiny_train_dict["rl"][key] = value
    with pytest.raises(ConfigError, match=match):
        config_from_dict(tiny_train_dict)
