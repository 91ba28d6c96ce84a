"""`gke-tpu-rl fit` of a service config (a `service:` section): the engine's own programs (trainer/service/programs.py)
compiled with libtpu at the passes it runs, per chip the base + 4 float32 adapter stacks + temporaries, and a refusal
naming lora.slots, lora.rank and service.max_batch_tokens when it does not fit.

The normal suite compiles a small model (seconds) and, through the CLI, the tiny random Qwen3 fixture published as
Qwen/Qwen3-8B in a private Hugging Face cache, where the engine reads it. The real Qwen3-8B on v6e 4x4 takes 5 to 9
minutes of compiles on 2 cores: it runs with GKE_TPU_RL_FIT_QWEN3_8B=1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import pytest

from tests.tiny_model import publish
from trainer.base.config import ConfigError, LoraConfig, config_from_dict, load_config, resolve_mesh
from trainer.fit import estimate as E
from trainer.fit import preflight as F
from trainer.model.lora import lora_axes, lora_shapes
from trainer.model.sharding import logical_to_spec
from trainer.service import programs as SP
from trainer.service import shapes

GiB, MiB = 1 << 30, 1 << 20
V5E_2X2 = F.Target("v5e", "2x2", 1, 4, 16 * GiB, 197e12, 819e9)
V6E_4X4 = F.Target("v6e", "4x4", 1, 16, 32 * GiB, 918e12, 1638e9)
TINY = {"vocab_size": 1088, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_ff": 128,
        "max_seq_len": 2048, "qk_norm": True, "tie_embeddings": False, "param_dtype": "float32"}
SERVICE = {"base_model": "Qwen/Qwen3-8B", "max_batch_tokens": 2048, "min_bucket": 32}
LORA = {"rank": 8, "alpha": 8, "slots": 4}


def _cfg(model: dict[str, Any] | None = None, **service: Any) -> Any:
    return config_from_dict({"model": {**TINY, **(model or {})}, "mesh": {"slices": 1, "fsdp": -1, "tensor": 2},
                             "lora": LORA, "service": {**SERVICE, **service}})


def _stack_bytes(m: Any, lcfg: LoraConfig, mesh_shape: dict[str, int]) -> float:
    """One float32 adapter stack per device, from trainer/model/lora.py's shapes and trainer/model/sharding.py's
    rules."""
    mesh = SimpleNamespace(shape=mesh_shape)
    leaves = zip(jax.tree.leaves(lora_shapes(m, lcfg), is_leaf=lambda x: isinstance(x, tuple) and all(
        isinstance(d, int) for d in x)), jax.tree.leaves(lora_axes(m, lcfg), is_leaf=lambda x: isinstance(x, tuple)),
        strict=True)
    total = 0.0
    for shape, names in leaves:
        spec = logical_to_spec(names, shape, mesh)  # type: ignore[arg-type]
        total += math.prod(d / math.prod(mesh_shape[a] for a in ((s,) if isinstance(s, str) else s or ()))
                           for d, s in zip(shape, spec, strict=True))
    return 4 * total


# ---------------------------------------------------------------------------------------------- the passes


def _engine_rows(n: int, data_parallel: int) -> int:
    return SP.EnginePrograms.rows(SimpleNamespace(data_parallel=data_parallel), n)  # type: ignore[arg-type]


def test_the_passes_are_the_engines_own_shapes() -> None:
    cfg = resolve_mesh(_cfg(), 4, exact=True)  # fsdp 2 x tensor 2: 2 data-parallel rows
    passes = E.service_passes(cfg, 2)
    assert [(p.rows, p.length) for p in passes] == [(64, 32), (32, 64), (16, 128), (8, 256), (4, 512), (2, 1024)]
    assert [p.kind for p in passes] == ["most rows", "", "", "", "", "longest"]
    assert E.service_longest_datum(cfg, 2) == 1024 and all(p.tokens <= 2048 for p in passes)
    for p in passes:  # as engine/batches.py `_fused` packs: max_batch_tokens // length datums, the programs' row bucket
        assert shapes.bucket(p.length, 32, TINY["max_seq_len"]) == p.length
        assert p.rows == _engine_rows(max(1, 2048 // p.length), 2)
    # 4 data-parallel rows of the longest datum; a max_batch_tokens no power-of-two multiple of a bucket rounds its
    # rows up, as the engine does (312 datums of 32 tokens run as 512 rows).
    odd = E.service_passes(_cfg(max_batch_tokens=10000), 4)
    assert (odd[0].rows, odd[0].length, odd[-1].rows, odd[-1].length) == (512, 32, 4, 2048)
    # The model's context caps the buckets (the last is max_seq_len itself).
    short = E.service_passes(_cfg({"max_seq_len": 100}), 4)
    assert [(p.rows, p.length) for p in short] == [(64, 32), (32, 64), (32, 100)]  # 20 datums of 100: 32 rows
    with pytest.raises(ConfigError, match=r"service.max_batch_tokens = 100 holds no forward_backward pass: the "
                       r"shortest is 4 rows .* x 32 tokens \(service.min_bucket\) = 128"):
        E.service_passes(_cfg(max_batch_tokens=100), 4)


def test_the_service_state_estimate_of_qwen3_8b_on_v6e_4x4() -> None:
    cfg = resolve_mesh(F.resolve_model(load_config("qwen3-8b-service-v6e-4x4.yaml"))[0], 16, exact=True)
    m, stack = cfg.model_cfg, shapes.stack_config(cfg)
    st = E.service_state(cfg)
    assert st.stack_params == 16 * 32 * 2_883_968 == 1_476_591_616  # every target, lm_head too, 16 slots of rank 32
    # The adapters shard over one mesh axis (their in or out dim), not two: a quarter of a stack per chip.
    assert st.stack == _stack_bytes(m, stack, {"slices": 1, "fsdp": 4, "tensor": 4}) == st.stack_params * 4 / 4
    assert st.base == F.param_count(m) * 2 / 16  # the frozen base in the checkpoint's bf16
    assert st.total / GiB == pytest.approx(6.45, abs=0.01)  # 0.95 + 4 x 1.375
    passes = E.service_passes(cfg, 4)
    assert (passes[-1].rows, passes[-1].length, passes[0].rows, passes[0].length) == (4, 4096, 512, 32)
    for p in passes:
        assert st.total + E.service_memory(cfg, "forward_backward", p).temp < 0.6 * 31.25 * GiB


# ---------------------------------------------------------------------------------------------- compiled


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny Qwen3 as Qwen/Qwen3-8B in a Hugging Face cache of its own (the engine's offline lookup)."""
    import huggingface_hub.constants

    home = tmp_path_factory.mktemp("hf_home")
    publish(home)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
        yield home


def _hf_service(**service: Any) -> Any:
    return config_from_dict({"init": {"from": "hf"}, "mesh": {"slices": 1, "fsdp": -1, "tensor": 2},
                             "compute": {"remat": "full", "logprob_chunk": 256}, "lora": LORA,
                             "service": {**SERVICE, **service}})


def test_the_model_comes_from_the_hf_cache_or_the_preset_named_like_base_model(hf_cache: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    cfg, source = F.resolve_model(_hf_service())  # as the engine: service.base_model in the Hugging Face cache
    assert source.startswith("Qwen/Qwen3-8B (the Hugging Face cache: ") and source.endswith("config.json)")
    assert cfg.model_cfg.n_layers == 2 and cfg.model_cfg.d_model == 64 and cfg.init.from_ == "hf"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_cache / "empty"))
    cfg, source = F.resolve_model(_hf_service())  # not cached here: the bundled preset of the same name
    assert source == "Qwen3-8B (bundled config.json; Qwen/Qwen3-8B is not in this machine's Hugging Face cache)"
    assert cfg.model_cfg.n_layers == 36 and cfg.model_cfg.param_dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"service.base_model 'acme/mystery-7b': not in this machine's Hugging Face "
                       r"cache, and its name matches no bundled model \(.*Qwen3-8B\); pass --model NAME"):
        F.resolve_model(_hf_service(base_model="acme/mystery-7b"))
    cfg, source = F.resolve_model(_hf_service(base_model="acme/mystery-7b"), "qwen3-0.6b")
    assert source.startswith("Qwen3-0.6B (bundled") and cfg.model_cfg.n_layers == 28


# Every dim a multiple of 128 (the rank too): TPU layouts pad a minor dim to 128, which for the tiny model's adapters
# would outweigh them in the compiled sizes (Qwen3-8B's are exact: see the GKE_TPU_RL_FIT_QWEN3_8B test).
ALIGNED = {"vocab_size": 512, "d_model": 256, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "head_dim": 128,
           "d_ff": 512, "max_seq_len": 2048, "qk_norm": True, "tie_embeddings": False, "param_dtype": "float32"}
ALIGNED_LORA = {"rank": 128, "alpha": 128, "slots": 2}


def _aligned() -> Any:
    return config_from_dict({"model": ALIGNED, "mesh": {"slices": 1, "fsdp": -1, "tensor": 2},
                             "compute": {"remat": "full", "logprob_chunk": 256, "scan_layers": True},
                             "lora": ALIGNED_LORA,
                             "service": {**SERVICE, "max_batch_tokens": 1024}})


@pytest.fixture(scope="module")
def tiny() -> F.FitReport:
    said: list[str] = []
    report = F.fit(_aligned(), V5E_2X2, title="small service", progress=said.append)
    assert said == ["compiling forward_backward 2x512 for 1 x v5e 2x2 (1/3)",
                    "compiling forward_backward 32x32 for 1 x v5e 2x2 (2/3)",
                    "compiling optim_step for 1 x v5e 2x2 (3/3)"]
    return report


def test_a_service_config_sizes_the_engines_programs(tiny: F.FitReport) -> None:
    sv = tiny.service
    assert sv is not None and tiny.model == "the config's model section"
    assert tiny.mesh == {"slices": 1, "fsdp": 2, "tensor": 2} and sv.data_parallel == 2
    assert sv.passes == {"forward_backward 2x512": "longest", "forward_backward 32x32": "most rows"}
    assert [p.name for p in tiny.programs] == [*sv.passes, "optim_step"]
    cfg = resolve_mesh(_aligned(), 4, exact=True)
    stack = shapes.stack_config(cfg)
    assert stack.targets == tuple(shapes.ALL_TARGETS) and stack.slots == 2 and stack.rank == 128
    assert sv.stack == _stack_bytes(cfg.model_cfg, stack, {"slices": 1, "fsdp": 2, "tensor": 2}) == sv.stack_estimate
    assert sv.base == pytest.approx(F.param_count(cfg.model_cfg) * 4 / 4, rel=0.01) and sv.base_estimate > 0
    assert sv.resident == sv.base + 4 * sv.stack
    for name in sv.passes:
        p = tiny.program(name)
        # Arguments: base, adapters, the donated gradient accumulator (its output aliases it) and the batch.
        assert sv.base + 2 * sv.stack <= p.argument <= sv.base + 2 * sv.stack + MiB
        assert p.alias == sv.stack and sv.stack <= p.output <= sv.stack + 64 * 1024
        assert p.resident == 2 * sv.stack and "Adam m and v" in p.resident_what  # beside it: the moments
        assert p.peak == p.argument + p.output - p.alias + p.temp + p.code + p.resident >= sv.resident
        assert 0 < p.compiler_flops < p.flops and 0 < p.model_flops < p.flops  # 2 layers, chunks: loops counted once
    opt = tiny.program("optim_step")
    assert 4 * sv.stack <= opt.argument <= 4 * sv.stack + 4096 and opt.alias == 4 * sv.stack  # + slot, step, hyper
    assert opt.resident == sv.base and opt.flops == opt.compiler_flops > 0
    assert tiny.fits and all(tiny.status(p) == "fits" for p in tiny.programs)
    assert all(p.compile_seconds > 0 for p in tiny.programs)


def test_the_service_report_renders_the_state_and_the_verdict(tiny: F.FitReport) -> None:
    text, md, doc = tiny.text(), tiny.markdown(), json.loads(tiny.json())
    lines = text.splitlines()
    assert lines[3].startswith("service Qwen/Qwen3-8B: 2 adapter slots of rank <= 128 on every target (lm_head too), "
                               "float32; forward_backward passes of <= 1024 tokens (rows x length): 2x512 (longest), "
                               "32x32 (most rows); the longest datum a pass holds: 512 tokens; mesh ")
    assert lines[4].startswith("resident per chip: base weights ")
    assert "x 4 (weights, Adam m, Adam v, gradient accumulator; " in lines[4]
    summary = tiny.summary_line()
    assert summary.startswith("the service fits 1 x v5e 2x2 (peak 0% of the limit); estimated: forward_backward "
                              "2x512: 1024 tokens in ~")
    assert summary in text and "optim_step: ~" in summary
    # The model's context (2048) is longer than a pass holds: said, with the knob.
    assert any(w.startswith("the model's context is 2048 tokens, but a forward_backward pass of "
                            "service.max_batch_tokens = 1024 holds a datum of at most 512") for w in tiny.warnings())
    assert "warning: the model's context is 2048 tokens" in text and "> **Warning:** the model's context" in md
    assert doc["fits"] is True and doc["service"]["resident"] == tiny.service.resident  # type: ignore[union-attr]
    assert doc["service"]["passes"] == tiny.service.passes and doc["mfu"] is None  # type: ignore[union-attr]
    assert [p["name"] for p in doc["programs"]] == ["forward_backward 2x512", "forward_backward 32x32", "optim_step"]


def test_a_service_that_does_not_fit_names_the_knobs(tiny: F.FitReport) -> None:
    small = dataclasses.replace(tiny, target=dataclasses.replace(tiny.target, hbm_bytes_per_chip=2 * MiB))
    assert small.hbm_limit == 2 * MiB and not small.fits and small.failures
    errors = small.errors()
    assert errors[0] == ("the service does not fit 1 x v5e 2x2: reduce lora.slots (now 2), lora.rank (now 128) or "
                         "service.max_batch_tokens (now 1024), or use more chips")
    assert small.summary_line().startswith("the service does not fit 1 x v5e 2x2; est. time — (not applicable: ")
    fb = {s.setting: s for s in tiny.suggestions["forward_backward 2x512"]}
    for knob in ("lora.slots=1", "lora.rank=64", "service.max_batch_tokens=512"):
        assert fb[knob].saves is not None and fb[knob].saves > 0, knob
    assert "the longest datum a pass holds: 256 tokens" in fb["service.max_batch_tokens=512"].text
    assert any(e.startswith("  - lora.slots=1 (now 2): half the adapters") for e in errors)
    opt = {s.setting: s for s in tiny.suggestions["optim_step"]}
    assert opt["lora.slots=1"].saves == pytest.approx(2 * tiny.service.stack, rel=0.01)  # type: ignore[union-attr]


def test_the_cli_refuses_a_service_that_does_not_fit(hf_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from infra.base import pod_config
    from infra.cli import main

    original = pod_config.target
    monkeypatch.setattr(pod_config, "target", lambda shape, slices: dataclasses.replace(
        original(shape, slices), hbm_bytes_per_chip=2 * MiB))  # a slice whose catalog HBM is 2 MiB per chip
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump({"init": {"from": "hf"}, "mesh": {"tensor": 2}, "lora": LORA,
                                    "service": {**SERVICE, "max_batch_tokens": 256}}))
    assert main(["fit", "--config", str(path), "--tpu", "v5e:2x2", "--format", "json"]) == 3
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["fits"] is False and doc["service"]["slots"] == 4
    assert "error: the service does not fit 1 x v5e 2x2: reduce lora.slots (now 4), lora.rank (now 8) or " \
           "service.max_batch_tokens (now 256), or use more chips" in err
    assert "--search" not in err  # search refuses service configs: no hint pointing there


def test_fit_search_refuses_a_service_config() -> None:
    from trainer.fit.search import search

    with pytest.raises(ConfigError, match=r"fit --search searches the RL trainer's settings; .*lora.slots, lora.rank "
                       r"and service.max_batch_tokens"):
        search(_cfg(), V5E_2X2, title="service", budget=3)


# ---------------------------------------------------------------------------------------------- Qwen3-8B


@pytest.mark.skipif(not os.environ.get("GKE_TPU_RL_FIT_QWEN3_8B"),
                    reason="5 to 9 minutes of libtpu compiles on 2 cores: set GKE_TPU_RL_FIT_QWEN3_8B=1")
def test_the_bundled_qwen3_8b_service_config_fits_v6e_4x4() -> None:
    t0 = time.perf_counter()
    report = F.fit(load_config("qwen3-8b-service-v6e-4x4.yaml"), V6E_4X4, title="qwen3-8b service")
    seconds = time.perf_counter() - t0
    sv = report.service
    assert sv is not None and report.model.startswith(("Qwen3-8B (bundled", "Qwen/Qwen3-8B (the Hugging Face cache"))
    assert sv.passes == {"forward_backward 4x4096": "longest", "forward_backward 512x32": "most rows"}
    assert sv.stack == 1_476_591_616 and sv.base == pytest.approx(0.95 * GiB, rel=0.01)
    assert report.hbm_limit == int(31.25 * GiB) and sv.resident / GiB == pytest.approx(6.45, abs=0.01)
    for name in sv.passes:  # big arrays get unpadded layouts: the compiled sizes are the state's own
        p = report.program(name)
        assert sv.base + 2 * sv.stack <= p.argument <= sv.base + 2 * sv.stack + 64 * MiB
        assert p.alias == pytest.approx(sv.stack, rel=1e-3)  # a few tiles of padding
    opt = report.program("optim_step")
    assert opt.argument == pytest.approx(4 * sv.stack, rel=1e-3) and opt.resident == sv.base
    for p in report.programs:
        assert report.status(p) == "fits" and p.peak < 0.6 * report.hbm_limit, (p.name, p.peak / GiB)
    assert report.fits
    print(report.text(), f"fit took {seconds:.0f} s:",
          ", ".join(f"{p.name} {p.compile_seconds:.0f} s" for p in report.programs))
