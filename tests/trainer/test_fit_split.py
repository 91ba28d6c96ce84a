"""fit for placement.mode=split (trainer/fit/split.py): each group's programs compiled for its own devices of a real
topology, the push priced, the overlap, and the ratio to the colocated layout compiled in the same run.

One fit (a tiny model on 2 x v6e 2x2, split by slice, programs without their timing compiles) serves every test."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from trainer.base.config import config_from_dict, resolve_mesh
from trainer.fit import preflight as F
from trainer.fit import split as FS
from trainer.fit.flops import param_count

GiB = 1 << 30
TWO_SLICES = F.Target("v6e", "2x2", 2, 4, 32 * GiB, 918e12, 1638e9, (2, 2, 1), 100e9)  # as Target.of gives it
SMALL = {"vocab_size": 512, "d_model": 128, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32,
         "d_ff": 384, "max_seq_len": 64, "qk_norm": True, "tie_embeddings": False, "param_dtype": "float32"}


def _cfg(lag: int = 1) -> Any:
    return config_from_dict({
        "model": SMALL, "mesh": {"slices": 1, "fsdp": -1, "tensor": 1},
        "placement": {"mode": "split", "sampler": {"slices": 1, "fsdp": -1, "tensor": 2}},
        "rl": {"group_size": 4, "prompts_per_step": 4, "mu_iterations": 1, "lag": lag,
               "lag_correction": "decoupled"},
        "sampling": {"max_new_tokens": 8, "max_prompt_len": 24, "gather_weights": True}})


@pytest.fixture(scope="module")
def fitted() -> tuple[F.FitReport, F.CompileCache]:
    cache = F.CompileCache()
    return FS.fit(_cfg(), TWO_SLICES, title="split", phases=False, cache=cache), cache


def test_each_group_compiles_its_programs_on_its_own_devices(fitted: tuple[F.FitReport, F.CompileCache]) -> None:
    report, _ = fitted
    sp = report.split
    assert sp is not None
    groups = {p.name: p.group for p in report.programs}
    assert groups == {"sample": "sampler", "ref_logprobs": "trainer", "proximal": "trainer", "update": "trainer",
                      "push": "both"}
    assert all(p.compiled and report.status(p) == "fits" for p in report.programs if p.name != "ref_logprobs")
    # The trainer's own rule (rollouts.placement_meshes): by slice, the first slice trains, the next samples.
    from trainer.rl.rollouts import placement_meshes

    devices = F.topology_devices(TWO_SLICES)
    mine, theirs = placement_meshes(resolve_mesh(_cfg(), len(devices), exact=True), devices)
    assert theirs is not None
    assert sp.trainer_ids == sorted(d.id for d in mine.devices.flat)
    assert sp.sampler_ids == sorted(d.id for d in theirs.devices.flat)
    assert not set(sp.trainer_ids) & set(sp.sampler_ids) and len(sp.trainer_ids) == len(sp.sampler_ids) == 4
    assert report.mesh == {"slices": 1, "fsdp": 4, "tensor": 1}
    assert report.sampler_mesh == {"slices": 1, "fsdp": 2, "tensor": 2}
    # Across slices the push crosses DCN; the trainer refuses a by-slice split whose training slice is one host of two.
    assert sp.push_links.startswith("DCN") and sp.push_dcn_seconds > 0
    assert "the trainer refuses this split" in sp.refused and "orbax refuses" in sp.refused


def test_the_push_is_the_trainers_push_bytes(fitted: tuple[F.FitReport, F.CompileCache]) -> None:
    """The trainer reports push_bytes = the sampler's fp32 copy, every parameter once (tests/trainer/
    test_async_rl.py); each trainer device sends its shards (fsdp 4, a few replicated norm scales)."""
    report, _ = fitted
    sp = report.split
    assert sp is not None
    assert sp.push_bytes == 4 * param_count(_cfg().model_cfg)
    assert sp.push_bytes / 4 <= sp.push_bytes_per_device < sp.push_bytes / 2
    push = report.program("push")
    assert push.seconds == max(sp.push_compiler_seconds, sp.push_dcn_seconds) > 0
    # At least each trainer chip's shards over the generation's DCN bandwidth per chip (the TPU catalog's).
    assert sp.push_dcn_seconds == pytest.approx(sp.push_bytes_per_device * 8 / 100e9)
    assert "over DCN at 100 Gbit/s per chip" in report.text()


def test_the_step_is_the_slower_group_at_lag_1_and_the_sum_at_lag_0(
        fitted: tuple[F.FitReport, F.CompileCache]) -> None:
    report, _ = fitted
    assert report.split is not None
    s, t, push = (report.group_seconds(g) for g in ("sampler", "trainer", "both"))
    assert s > 0 and t > 0 and push > 0 and s != t
    assert t == pytest.approx(report.program("proximal").seconds + report.program("update").seconds)
    assert report.step_seconds == pytest.approx(max(s, t) + push)
    lag0 = dataclasses.replace(report, split=dataclasses.replace(report.split, lag=0))
    assert lag0.step_seconds == pytest.approx(s + t + push)


def test_the_ratio_is_against_the_colocated_compile(fitted: tuple[F.FitReport, F.CompileCache]) -> None:
    report, cache = fitted
    sp = report.split
    assert sp is not None
    (colocated,) = cache.reports.values()  # fitted in the same run, with the same cache
    assert colocated.split is None and colocated.mesh == {"slices": 2, "fsdp": 4, "tensor": 1}
    assert colocated.sampler_mesh == {"slices": 2, "fsdp": 2, "tensor": 2}  # sampling at the sampler's tensor
    assert colocated.devices == 8 and colocated.fits
    assert sp.colocated_step_seconds == colocated.step_seconds
    assert report.throughput_ratio == pytest.approx(colocated.step_seconds / report.step_seconds)
    doc = json.loads(report.json())
    assert doc["split"]["throughput_ratio"] == pytest.approx(report.throughput_ratio)
    assert doc["step_seconds"] == pytest.approx(report.step_seconds)
    assert doc["split"]["push_bytes"] == sp.push_bytes
    for text in (report.text(), report.markdown()):
        assert "split throughput" in text and "push:" in text and "per group: sampling" in text


def test_a_split_meshes_devices_that_are_no_box_of_the_torus() -> None:
    """The trainer's meshes for a split of every host's chips (v5p 4x4x4: 2 of each host's 4) and a sampler tensor
    8 on a 4x4 slice: jax's physical-mesh ordering refuses both; make_mesh lays them out in process order instead."""
    from trainer.base.placement import split_devices
    from trainer.model.sharding import make_mesh

    v5p = F.Target("v5p", "4x4x4", 1, 64, 95 * GiB, 459e12, 2765e9)
    F.prepare_environment(v5p)
    devices = F.topology_devices(v5p)
    train, sample = split_devices(devices, 32, 32)
    assert {d.process_index for d in train} == {d.process_index for d in sample} == set(range(16))
    mesh = make_mesh(1, 4, 8, sample)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in sample)
    v6e = F.Target("v6e", "4x4", 1, 16, 32 * GiB, 918e12, 1638e9)
    slice_ = F.topology_devices(v6e)
    regrouped = make_mesh(1, 2, 8, slice_)
    assert regrouped.devices.reshape(-1).tolist() == make_mesh(1, 16, 1, slice_).devices.reshape(-1).tolist()


def test_the_colocated_layout_of_a_reference_split_config() -> None:
    """The async reference configs (init from a Hugging Face checkpoint, whose model fit attaches) compared with one
    mesh over all their chips, sampling at the sampler's tensor degree, rl.lag 0."""
    from infra.offline.fit import file_job

    job = file_job("trainer/configs/qwen3-8b-grpo-async-2xv6e-4x4.yaml", "v6e:4x4", 2)
    cfg = resolve_mesh(F.resolve_model(job.cfg)[0], job.target.chips, exact=True)
    assert cfg.mesh.axes() == {"slices": 1, "fsdp": 16, "tensor": 1} and cfg.rl.lag == 1
    col = resolve_mesh(FS.colocated_config(cfg, job.target.slices), job.target.chips, exact=True)
    assert (col.placement.mode, col.rl.lag, col.model_cfg) == ("colocated", 0, cfg.model_cfg)
    assert col.mesh.axes() == {"slices": 2, "fsdp": 16, "tensor": 1}
    assert col.sampler_mesh == {"slices": 2, "fsdp": 2, "tensor": 8}


def test_the_advice_names_each_groups_own_settings(fitted: tuple[F.FitReport, F.CompileCache]) -> None:
    """Sampling runs on placement.sampler's devices, which hold no optimizer state: its advice names neither mesh.*,
    the colocated sampler's sampling.tensor, nor the optimizer; the update's keeps them."""
    report, _ = fitted
    sample = [s.setting or s.text for s in report.suggestions["sample"]]
    update = [s.setting or s.text for s in report.suggestions["update"]]
    assert not [s for s in sample if s.startswith(("mesh.", "sampling.tensor", "optim."))], sample
    assert sample[-1].startswith("more chips for sampling: a larger placement.sampler"), sample
    assert update[-1].startswith("more chips for the update: a smaller placement.sampler"), update
    assert "mesh.tensor=2" in update


def test_the_samplers_tensor_advice_keeps_its_chips() -> None:
    """placement.sampler.tensor doubled halves its fsdp (the same chips), and its saving is estimated on the
    sampler's layout (estimate.Layout.running), not the update's."""
    from trainer.fit import estimate as E
    from trainer.fit.advice import suggestions, with_settings

    d = _cfg().model_dump(by_alias=True)
    d["placement"]["sampler"] = {"slices": 1, "fsdp": 4, "tensor": 1}
    cfg = resolve_mesh(config_from_dict(d), 8, exact=True)
    found = [s.setting for s in suggestions("sample", cfg)]
    assert "placement.sampler.tensor=2" in found, found
    changed = resolve_mesh(with_settings(cfg, ["placement.sampler.tensor=2"]), E.Layout.job_devices(cfg), exact=True)
    assert changed.placement.sampler.axes() == {"slices": 1, "fsdp": 2, "tensor": 2} and changed.mesh == cfg.mesh
    assert E.Layout.running(cfg, "sample") == E.Layout(4, 4, 1, 4) and E.Layout.job_devices(cfg) == 8
    assert E.Layout.running(cfg, "update") == E.Layout.of(cfg)
    # Half the KV cache's heads per device: the sampler's programs shrink by the change, the update's does not move.
    assert E.memory(changed, "sample", E.Layout.running(changed, "sample")).temp < E.memory(
        cfg, "sample", E.Layout.running(cfg, "sample")).temp


def test_fit_search_refuses_a_split_config_before_any_compile() -> None:
    from trainer.base.config import ConfigError
    from trainer.fit.search import search

    with pytest.raises(ConfigError, match=r"fit --search searches a colocated trainer's settings; placement\.mode="
                                          r"split: run fit without --search"):
        search(_cfg(), TWO_SLICES, title="split", budget=2)
