"""The preflight: the trainer's own programs compiled with libtpu for a TPU topology on this CPU machine.

Small models on v6e 2x2 / v5e 2x2 keep each compile to a few seconds.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from trainer.base import presets
from trainer.base.config import ConfigError, config_from_dict, resolve_mesh
from trainer.fit import preflight as F

GiB = 1 << 30
V6E_2X2 = F.Target("v6e", "2x2", 1, 4, 32 * GiB, 918e12, 1638e9)
V5E_2X2 = F.Target("v5e", "2x2", 1, 4, 16 * GiB, 197e12, 819e9)
SMALL = {"vocab_size": 512, "d_model": 128, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "head_dim": 32,
         "d_ff": 384, "max_seq_len": 64, "qk_norm": True, "tie_embeddings": False, "param_dtype": "float32"}


def _cfg(model: dict | None = None, **sections: dict) -> Any:
    d: dict[str, Any] = {"model": {**SMALL, **(model or {})}, "mesh": {"slices": 1, "fsdp": -1, "tensor": 1},
                         "rl": {"group_size": 4, "prompts_per_step": 4, "mu_iterations": 1},
                         "sampling": {"max_new_tokens": 8, "max_prompt_len": 24}}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return config_from_dict(d)


@pytest.fixture(scope="module")
def once() -> F.FitReport:
    """Every loop runs once per body except the decode loop (1 layer, mu 1, one minibatch, one log-prob chunk). Its
    tests read memory and FLOPs only: the programs' timing compiles (phases) are left out."""
    return F.fit(_cfg(rl={"kl_beta": 0.05}), V6E_2X2, title="once", phases=False)


@pytest.fixture(scope="module")
def deep() -> F.FitReport:
    return F.fit(_cfg({"n_layers": 3}, rl={"mu_iterations": 2},
                      compute={"remat": "full", "train_micro_batch_size": 8, "logprob_chunk": 4,
                               "scan_layers": True}), V6E_2X2, title="deep")


def _by_name(report: F.FitReport) -> dict[str, F.ProgramFit]:
    return {p.name: p for p in report.programs}


def test_the_compiler_counts_a_loop_body_once() -> None:
    """Why the report's FLOPs are analytic: a 10-step scan costs what one step costs, in FLOPs and in time."""
    F.prepare_environment(V6E_2X2)
    devices = F.topology_devices(V6E_2X2)
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16,
                             sharding=jax.sharding.SingleDeviceSharding(devices[0]))

    def scanned(x: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda c, _: (c @ x, None), x, None, length=10)[0]

    def unrolled(x: jax.Array) -> jax.Array:
        c = x
        for _ in range(10):
            c = c @ x
        return c

    costs = [jax.jit(f).lower(x).compile().cost_analysis() for f in (scanned, unrolled)]
    one_step = 2 * 1024**3
    assert costs[0]["flops"] == pytest.approx(one_step, rel=0.01)
    assert costs[1]["flops"] == pytest.approx(10 * one_step, rel=0.01)
    assert costs[1]["optimal_seconds"] > 1.5 * costs[0]["optimal_seconds"]


def test_a_loop_is_priced_at_its_trip_count() -> None:
    """fit_loops.loop_factor weights each loop body's estimated cycles by the trips its condition reads: 12 trips
    of a matmul cost 3x 4 trips (counted once, they cost the same), and nested loops multiply (4 x 3 = 12). libtpu
    prices the body as it compiled it, a copy of the carry per trip included (4x the matmuls unrolled, here). A loop
    whose trips depend on data has no factor (fit then falls back to scaling by FLOPs)."""
    from trainer.fit.loops import loop_factor

    F.prepare_environment(V6E_2X2)
    a = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16,
                             sharding=jax.sharding.SingleDeviceSharding(F.topology_devices(V6E_2X2)[0]))

    def looped(trips: int, inner: int = 1) -> Any:
        def f(x: jax.Array) -> jax.Array:
            def step(c: jax.Array) -> jax.Array:
                return jax.lax.fori_loop(0, inner, lambda _, h: jnp.tanh(h @ x), c)

            return jax.lax.fori_loop(0, trips, lambda _, c: step(c), x)

        return f

    def priced(f: Any) -> float:
        compiled = jax.jit(f).lower(a).compile()
        factor = loop_factor(compiled.as_text())
        assert factor is not None
        return F._optimal_seconds(compiled) * factor

    twelve = priced(looped(12))
    assert twelve == pytest.approx(3 * priced(looped(4)), rel=0.05)
    assert priced(looped(4, 3)) == pytest.approx(twelve, rel=0.1)  # 4 x 3 trips
    compiled = jax.jit(lambda x: jax.lax.while_loop(lambda c: jnp.sum(c) < 1e9, lambda c: c @ x, x)).lower(a).compile()
    assert loop_factor(compiled.as_text()) is None


def test_the_compilers_time_is_a_roofline_per_instruction_summed() -> None:
    """What fit's estimates are made of: libtpu's optimal_seconds is each instruction's own roofline, max(its FLOPs
    / peak, its bytes / HBM bandwidth), summed over the program: no overlap between instructions. So a matmul next
    to an elementwise op of the same size costs both, where one roofline of the program's totals would hide the
    elementwise op under the matmul; every memory-bound op (a layout copy, a norm, a cast) costs its bytes."""
    F.prepare_environment(V6E_2X2)
    sh = jax.sharding.SingleDeviceSharding(F.topology_devices(V6E_2X2)[0])
    a, big = (jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh) for shape in ((8192, 8192), (8192, 32768)))

    def cost(f: Any, *args: Any) -> tuple[float, float, float]:
        c = jax.jit(f).lower(*args).compile().cost_analysis()
        t = V6E_2X2
        return c.get("flops", 0.0) / t.peak_flops_per_chip, c["bytes accessed"] / t.hbm_bytes_per_s_per_chip, \
            c["optimal_seconds"]

    mm_flops, mm_bytes, mm = cost(lambda x: x @ x, a)
    sin_flops, sin_bytes, sin = cost(jnp.sin, big)
    assert mm == pytest.approx(mm_flops, rel=0.01) and mm_bytes < mm / 4  # compute-bound: its FLOPs
    assert sin == pytest.approx(sin_bytes, rel=0.02) and sin_flops < sin / 100  # memory-bound: its bytes
    both_flops, both_bytes, both = cost(lambda x, y: (x @ x, jnp.sin(y)), a, big)
    assert both == pytest.approx(mm + sin, rel=0.02)
    assert both > 1.4 * max(both_flops, both_bytes)  # not the program's totals on one roofline


def test_windowed_einsums_are_priced_off() -> None:
    """Why fit prices the update with PRICING_OPTIONS: at fsdp 16 the SPMD partitioner runs an all-gathered weight's
    matmul as a windowed einsum (a while loop over weight chunks), which libtpu's cost analysis undercounts in FLOPs
    (a quarter) and in time (below the matmul's own FLOPs at peak); with the options the same maths is one all-gather
    and one matmul, counted whole and priced above that floor."""
    import numpy as np

    target = F.Target("v6e", "4x4", 1, 16, 32 * GiB, 918e12, 1638e9)
    F.prepare_environment(target)
    mesh = jax.sharding.Mesh(np.array(F.topology_devices(target)).reshape(16), ("fsdp",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", None))
    x = jax.ShapeDtypeStruct((16 * 8192, 4096), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((4096, 12288), jnp.bfloat16, sharding=rows)
    lowered = jax.jit(lambda x, w: x @ w, out_shardings=rows).lower(x, w)
    flops = 2 * 16 * 8192 * 4096 * 12288 / 16  # per chip
    windowed, priced = lowered.compile(), lowered.compile(compiler_options=F.PRICING_OPTIONS)
    assert "windowed_dot_general" in windowed.as_text() and "windowed_dot_general" not in priced.as_text()
    assert windowed.cost_analysis()["flops"] < flops / 2
    assert F._optimal_seconds(windowed) < flops / target.peak_flops_per_chip
    assert priced.cost_analysis()["flops"] == pytest.approx(flops, rel=0.01)
    assert F._optimal_seconds(priced) > flops / target.peak_flops_per_chip


def test_a_scanned_layer_is_priced_above_an_unrolled_one() -> None:
    """Why fit prices the update and reference log-probs from unrolled layers: the gradient of 8 scanned matmul
    layers is priced at its body once, and that body at over 2x one layer of the same gradient unrolled (4.6x with
    libtpu 0.0.42.1, at 512-wide layers as at 1024-wide ones, whose compile took 8x as long; 9.4x at 36 layers: the
    scan's stacked residuals and gradients are read and written whole)."""
    F.prepare_environment(V6E_2X2)
    sh = jax.sharding.SingleDeviceSharding(F.topology_devices(V6E_2X2)[0])
    w = jax.ShapeDtypeStruct((8, 512, 512), jnp.bfloat16, sharding=sh)
    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=sh)

    def scanned(w: jax.Array, x: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0].astype(jnp.float32).sum()

    def unrolled(w: jax.Array, x: jax.Array) -> jax.Array:
        h = x
        for i in range(8):
            h = jnp.tanh(h @ w[i])
        return h.astype(jnp.float32).sum()

    body, layers = (jax.jit(jax.grad(f)).lower(w, x).compile().cost_analysis()["optimal_seconds"]
                    for f in (scanned, unrolled))
    assert body > 2 * layers / 8


def test_the_update_is_priced_per_micro_batch_from_unrolled_layers(deep: F.FitReport) -> None:
    """2 mu iterations x 2 micro-batches: 4 runs of one micro-batch, compiled at 2 and 4 unrolled layers."""
    u = _by_name(deep)["update"]
    assert u.runs == 4 and 0 < u.depth_seconds[0] < u.depth_seconds[1]
    assert "update 4 x" in deep.text()


def test_a_loop_free_update_is_priced_as_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """One micro-batch, one mu iteration, one log-prob chunk, 3 unrolled layers: nothing in the whole program is
    counted once, so the depth-priced estimate is that program's own compiled time. (The sampler's phases are left
    uncompiled: this reads the update alone, and `deep` covers their pricing.)"""
    monkeypatch.setattr(F, "_price_sampler", lambda *_args: [])
    r = F.fit(_cfg({"n_layers": 3}, compute={"scan_layers": False, "logprob_chunk": 8}), V6E_2X2, title="flat")
    u = _by_name(r)["update"]
    assert u.runs == 1 and u.seconds == pytest.approx(u.compiler_seconds, rel=0.1)


def test_analytic_flops_match_the_compiler_where_loops_run_once(once: F.FitReport) -> None:
    p = _by_name(once)
    for name in ("ref_logprobs", "update"):
        assert p[name].compiler_flops == pytest.approx(p[name].flops, rel=0.08), name
    # The sampler's decode loop is a while_loop: the compiler counts prefill plus ONE of its 8 decode steps.
    cfg = F.resolve_model(_cfg(rl={"kl_beta": 0.05}))[0]
    flops = F.step_flops(cfg)
    assert p["sample"].compiler_flops == pytest.approx(cfg.batch_size * (flops.prefill_row + flops.decode_row),
                                                       rel=0.08)
    assert p["sample"].flops == pytest.approx(cfg.batch_size * (flops.prefill_row + 8 * flops.decode_row))


def test_memory_figures_are_consistent(once: F.FitReport) -> None:
    cfg = resolve_mesh(_cfg(rl={"kl_beta": 0.05}), 4)
    n_params = F.param_count(cfg.model_cfg)
    params_per_chip = n_params * 4 / 4  # float32, fully sharded over fsdp=4 (every dim here divides)
    p = _by_name(once)
    assert once.mesh == {"slices": 1, "fsdp": 4, "tensor": 1} and once.devices == 4
    assert p["sample"].argument >= params_per_chip
    assert p["update"].argument >= 3 * params_per_chip  # params + Adam's two moments
    assert p["update"].alias >= 3 * params_per_chip  # params and optimizer state are donated
    # Resident while sampling: the optimizer state and (kl_beta > 0) the reference weights.
    assert p["sample"].resident == pytest.approx(3 * params_per_chip, rel=0.05)
    assert p["ref_logprobs"].resident == pytest.approx(3 * params_per_chip, rel=0.05)
    assert p["update"].resident == pytest.approx(params_per_chip, rel=0.05)
    for prog in once.programs:
        assert 0 < prog.peak <= once.hbm_limit
        assert prog.peak == prog.argument + prog.output - prog.alias + prog.temp + prog.code + prog.resident
        assert once.status(prog) == "fits"
    assert once.fits and not once.errors() and not once.warnings()
    assert once.hbm_per_device == 32 * GiB
    # Shares are of what libtpu lets a program use (probed from its own RESOURCE_EXHAUSTED), not the nominal 32.
    assert once.hbm_usable == once.hbm_limit == int(31.25 * GiB)


def test_update_flops_scale_like_6_params_tokens_mu(deep: F.FitReport) -> None:
    cfg = resolve_mesh(_cfg({"n_layers": 3}, rl={"mu_iterations": 2}), 4)
    tokens = cfg.batch_size * (cfg.prompt_len + cfg.sampling.max_new_tokens)
    six_n_d = 6 * F.param_count(cfg.model_cfg) * tokens * cfg.rl.mu_iterations
    p = _by_name(deep)
    # Attention over 32 tokens, remat (one more forward) and re-running the head: more than 6ND, not wildly.
    assert six_n_d < p["update"].flops < 3 * six_n_d
    assert p["update"].model_flops < p["update"].flops  # remat is executed, not model, work
    # The compiler saw each loop body once (3 layers, 2 iterations, 2 micro-batches, 2 log-prob chunks).
    assert p["update"].compiler_flops < p["update"].flops / 4
    assert p["update"].seconds > p["update"].compiler_seconds
    assert p["ref_logprobs"].skipped == "rl.kl_beta = 0" and p["ref_logprobs"].seconds == 0
    assert 0 < deep.mfu < 1
    assert deep.step_seconds == pytest.approx(p["sample"].seconds + p["update"].seconds)


def test_renderings_carry_the_same_figures(deep: F.FitReport) -> None:
    text, md, doc = deep.text(), deep.markdown(), json.loads(deep.json())
    assert "fit: deep" in text and "sample" in text and "skipped: rl.kl_beta = 0" in text
    assert "| update |" in md and "MFU" in md
    assert doc["fits"] is True and doc["mesh"] == {"slices": 1, "fsdp": 4, "tensor": 1}
    assert [p["name"] for p in doc["programs"]] == ["sample", "ref_logprobs", "update"]
    assert doc["programs"][2]["peak"] == _by_name(deep)["update"].peak
    # One basis for every share, named wherever a share is shown.
    assert "of 31.25 GiB usable (libtpu)" in text and "| of 31.25 GiB usable (libtpu) |" in md
    assert "(31.25 GiB usable (libtpu) per chip)" in text.splitlines()[1]
    assert doc["share_of"] == "31.25 GiB usable (libtpu) per chip" and doc["hbm_limit"] == int(31.25 * GiB)
    assert doc["programs"][2]["share"] == pytest.approx(doc["programs"][2]["peak"] / doc["hbm_limit"])


def test_every_suggestion_carries_an_estimated_saving(deep: F.FitReport) -> None:
    update = deep.suggestions["update"]
    by_setting = {s.setting: s for s in update}
    # Recomputing every layer keeps less than keeping every activation; half the micro-batch rows, less again.
    assert by_setting["compute.train_micro_batch_size=4"].saves > 0
    assert by_setting["compute.param_dtype=bfloat16"].saves > 0  # float32 weights and Adam state halve
    assert update[-1].setting is None and update[-1].saves > 0 and "twice the chips" in update[-1].estimate_note
    assert all(isinstance(s.saves, int) for s in update)
    line = by_setting["compute.param_dtype=bfloat16"].line("chip")
    assert line.startswith("compute.param_dtype=bfloat16: halves") and line.endswith(" per chip, estimated]")
    doc = json.loads(deep.json())
    first = doc["suggestions"]["update"][0]
    assert first["setting"] == update[0].setting and first["saves"] == update[0].saves
    assert first["saves_is"] == "estimate"


def test_above_90_percent_warns_and_above_hbm_refuses(deep: F.FitReport) -> None:
    import copy

    report = copy.deepcopy(deep)
    update = _by_name(report)["update"]
    hbm = report.hbm_limit  # libtpu's 31.25 GiB: a program between it and the nominal 32 GiB does not fit
    update.temp += int(0.93 * hbm) - update.peak
    assert report.status(update) == "tight" and report.fits
    assert report.warnings()[0].startswith("update uses 93% of the 31.25 GiB usable (libtpu) per chip")
    assert "compute.train_micro_batch_size=4 (now 8)" in report.warnings()[0]
    update.temp += int(0.1 * hbm)
    assert report.status(update) == "does not fit" and not report.fits
    errors = report.errors()
    assert errors[0].startswith("update does not fit: needs 32.19 GiB per chip, 31.25 GiB usable (libtpu) (peak "
                                "exceeds it")
    assert any(e.startswith("  - compute.train_micro_batch_size=4 (now 8)") for e in errors)
    assert errors[-1].startswith("  - more chips")
    # No step time or MFU for a config that cannot run: "—" and the reason, in every rendering.
    assert "est. time — and MFU — (not applicable: update does not fit" in report.summary_line()
    assert report.rows()[2][-2] == "—" and "MFU ~" not in report.text() and "MFU ~" not in report.markdown()
    doc = json.loads(report.json())
    assert doc["mfu"] is None and doc["step_seconds"] is None and doc["not_applicable"] == "update does not fit"
    assert doc["programs"][2]["seconds"] is None and doc["programs"][0]["seconds"] > 0
    # A program the compiler refused: its message's figures stand in for the memory analysis.
    update.oom_message = "RESOURCE_EXHAUSTED: ... (40.00G) exceeds available HBM (31.25G)"
    update.oom_required, update.oom_available = 40 * GiB, int(31.25 * GiB)
    assert update.peak == 40 * GiB + update.resident
    assert "31.25 GiB usable (libtpu) (the compiler ran out of HBM" in report.errors()[0]


def test_oom_messages_are_parsed() -> None:
    assert F.parse_oom("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                       "temporaries (33.56G) exceeds available HBM (31.25G).") == (int(33.56 * GiB), int(31.25 * GiB))
    assert F.parse_oom("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
                       "hbm. Used 40.12G of 15.75G hbm. Exceeded hbm capacity by 24.37G.") == (
        int(40.12 * GiB), int(15.75 * GiB))
    assert F.parse_oom("RESOURCE_EXHAUSTED: something else") is None


@pytest.mark.parametrize("program", ["sample", "ref_logprobs", "update"])
def test_suggested_settings_pass_the_configs_own_checks(program: str) -> None:
    from trainer.base.config import apply_overrides

    cfg = resolve_mesh(_cfg(rl={"prompts_per_step": 16, "group_size": 8},
                            sampling={"max_new_tokens": 512, "max_prompt_len": 256},
                            model={"max_seq_len": 1024}), 8, exact=True)
    found = F.suggestions(program, cfg)
    assert found[-1].text.startswith("more chips") and found[-1].setting is None
    for s in found[:-1]:
        setting = s.setting
        assert s.text.startswith(setting)
        # The JobSet passes mesh.fsdp=-1, so a mesh.tensor suggestion re-derives fsdp.
        data = apply_overrides(cfg.model_dump(by_alias=True), [str(setting), "mesh.fsdp=-1"])
        resolve_mesh(config_from_dict(data), 8, exact=True)  # raises if the suggestion is not a valid config


# ---------------------------------------------------------------------------------------------- models


# Parameter counts as published for each model (embeddings and untied heads included).
PUBLISHED = {"Qwen3-0.6B": 596_049_920, "Qwen3-8B": 8_190_735_360, "Qwen3-32B": 32_762_123_264,
             "Llama-3.1-8B": 8_030_261_248, "Llama-3.1-70B": 70_553_706_496}


def test_every_preset_is_bundled() -> None:
    assert presets.names() == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_convert_to_the_published_size(name: str) -> None:
    # The Llama-3.1 ones need trainer.model.hf to accept rope_type llama3 (its rope scaling).
    cfg, source = F.resolve_model(_cfg(), name.lower())
    assert source.startswith(name)
    assert F.param_count(cfg.model_cfg) == PUBLISHED[name]
    assert cfg.model_cfg.param_dtype == "bfloat16"  # the checkpoints' dtype, as import_hf would keep it


def _hf_cfg(path: str) -> Any:
    return config_from_dict({"init": {"from": "hf", "path": path}, "rl": {"group_size": 4, "prompts_per_step": 4},
                             "sampling": {"max_new_tokens": 8, "max_prompt_len": 24}})


def test_the_model_comes_from_init_path_or_a_preset_named_like_it(tmp_path: Path) -> None:
    cfg, source = F.resolve_model(_hf_cfg("/gcs/models/qwen3-0.6b/"))
    assert source.startswith("Qwen3-0.6B (bundled") and cfg.model_cfg.n_layers == 28
    assert cfg.init.from_ == "hf"  # the run still imports its checkpoint; only the shape was attached
    local = tmp_path / "Qwen3-8B"  # a local config.json wins over the preset of the same name
    local.mkdir()
    (local / "config.json").write_text(json.dumps({**presets.hf_config("Qwen3-0.6B"), "num_hidden_layers": 3}))
    cfg, source = F.resolve_model(_hf_cfg(str(local)))
    assert cfg.model_cfg.n_layers == 3 and str(local / "config.json") in source
    with pytest.raises(ConfigError, match=r"init.path '/nowhere/my-model': no config.json there.*Qwen3-8B.*--model"):
        F.resolve_model(_hf_cfg("/nowhere/my-model"))
    with pytest.raises(ConfigError, match=r"--model 'gpt-5': not a bundled model; choose one of: Llama-3.1-70B"):
        F.resolve_model(_hf_cfg("/nowhere/my-model"), "gpt-5")


def test_bundled_configs_load_by_bare_name_and_size_their_model(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    from trainer.base.config import default_config_path, load_config

    monkeypatch.chdir(tmp_path)  # as in the image: no repository around, only the installed package
    names = sorted(p.name for p in default_config_path().parent.glob("*.yaml"))
    assert {"qwen3-0.6b-grpo-v6e-2x2.yaml", "qwen3-8b-grpo-v6e-4x4.yaml", "llama3.1-70b-grpo-v5p-4x4x4.yaml",
            "llama3.1-70b-gspo-v5p-4x4x4.yaml", "llama3-70b-grpo-2xv6e-4x4.yaml"} <= set(names)
    for name in names:
        cfg, _ = F.resolve_model(load_config(name))  # init.path names a bundled model
        assert cfg.batch_size >= 64 and cfg.prompt_len + cfg.sampling.max_new_tokens >= 1024 or name == "demo.yaml"
    with pytest.raises(ConfigError, match=r"cannot read config nope.yaml: .*\(nor a bundled config: demo.yaml, "):
        load_config("nope.yaml")


def test_the_sampler_is_priced_phase_by_phase(deep: F.FitReport) -> None:
    """No chunking (one prefill, N decode steps), no weight gathering: the sample estimate is its compiled phases
    times their runs, and every estimate sits above its physical floor."""
    p = _by_name(deep)
    runs = {ph.name: ph.runs for ph in deep.phases}
    assert runs == {"prefill": 1, "decode": 8}
    assert all(ph.seconds > 0 and ph.depth_seconds[1] > ph.depth_seconds[0] for ph in deep.phases)
    assert p["sample"].seconds == pytest.approx(sum(ph.total for ph in deep.phases))
    for name in ("sample", "update"):
        assert p[name].seconds > p[name].lower_bound > 0, name
    assert deep.step_lower_bound == pytest.approx(p["sample"].lower_bound + p["update"].lower_bound)
    assert deep.bound_ratio == pytest.approx(deep.step_seconds / deep.step_lower_bound)
    doc = json.loads(deep.json())
    assert doc["bound_ratio"] == pytest.approx(deep.bound_ratio) and [x["name"] for x in doc["phases"]] == [
        "prefill", "decode"]
    assert "lower bound (est. / bound)" in deep.text() and "estimate / bound" in deep.summary_line()


def test_phase_runs_follow_chunks_and_continuous_batching() -> None:
    """16 rows in slots of 4 on 4 data-parallel devices: static chunks prefill 4 times; continuous batching prefills
    the first 4 and refills the other 12 a row per data-parallel device at a time (3 refills); each decodes 4 x N."""
    from trainer.fit import phases as FP

    static = resolve_mesh(_cfg(sampling={"max_num_sequences": 4, "continuous_batching": False}), 4)
    cont = resolve_mesh(_cfg(sampling={"max_num_sequences": 4, "gather_weights": True}), 4)
    assert FP.counts(static, 4) == {"gather": 0, "prefill": 4, "refill": 0, "decode": 32}
    assert FP.counts(cont, 4) == {"gather": 1, "prefill": 1, "refill": 3, "decode": 32}
    assert FP.counts(cont, 2) == {"gather": 1, "prefill": 1, "refill": 6, "decode": 32}


def test_a_phase_extrapolates_linearly_in_depth() -> None:
    """What the sampler's phases rest on: compiled with 6 unrolled layers, a decode step costs what the 2- and
    4-layer compiles extrapolate to."""
    from trainer.fit import phases as FP
    from trainer.model.sharding import make_mesh

    F.prepare_environment(V6E_2X2)
    devices = F.topology_devices(V6E_2X2)
    cfg = F.resolve_model(resolve_mesh(_cfg(), 4))[0]
    mesh = make_mesh(1, 4, 1, devices)
    seconds = []
    for depth in (*FP.DEPTHS, 6):
        decode = next(ph for ph in FP.phases(FP.with_depth(cfg, depth), mesh) if ph.name == "decode")
        with jax.set_mesh(mesh):
            seconds.append(F._optimal_seconds(decode.program.lower(*decode.args).compile()))
    assert seconds[2] == pytest.approx(FP.extrapolate((seconds[0], seconds[1]), 6), rel=0.1)


def test_a_deep_model_is_priced_from_depths_further_apart() -> None:
    """Two compiles' difference is the per-layer cost, and their noise is multiplied on the way out to the model's
    depth: a model of 32 layers or more is compiled at 2 and 8 (libtpu's decode step of Llama-3.1-70B rises 0.49,
    0.55 and 0.05 ms over successive pairs of layers from 2 to 8), a shallower one at 2 and 4."""
    from trainer.fit import phases as FP

    assert FP.depths(28) == FP.DEPTHS == (2, 4) and FP.depths(80) == FP.depths(32) == (2, 8)
    assert FP.extrapolate((1.0, 4.0), 80, (2, 8)) == pytest.approx(1.0 + 78 * 0.5)
    assert FP.extrapolate((1.0, 4.0), 28) == pytest.approx(1.0 + 26 * 1.5)
    assert FP.at_mean_blocks((1.0, 2.0), 3.0, (2.0, 3), (2, 8)) == pytest.approx((1.0 + 2 / 16, 2.0 + 8 / 16))


def test_a_block_loop_decode_step_is_priced_at_its_mean_blocks() -> None:
    """compute.decode_block: the compiler counts the block loop's body once (a 4-layer step with the loop costs less
    than two blocks unrolled), so fit compiles it unrolled, reading 1 block at 2 and 4 layers and all at 4, and takes
    a block's cost per layer: that predicts a 6-layer step reading 3 of the 8 blocks, and a step reading all costs
    more than one reading the first. Its FLOPs count the blocks read on average."""
    from trainer.fit import phases as FP
    from trainer.fit.flops import decode_blocks
    from trainer.model import attention as A
    from trainer.model.sharding import make_mesh

    F.prepare_environment(V6E_2X2)
    devices = F.topology_devices(V6E_2X2)
    # The XLA loop (on TPU, auto picks the Pallas kernel, whose grid has no loop for the compiler to count once).
    cfg = F.resolve_model(resolve_mesh(_cfg({"head_dim": 128, "max_seq_len": 1024, "n_layers": 8},
                                            compute={"decode_block": 128, "decode_attention": "xla"},
                                            sampling={"max_new_tokens": 1000}), 4))[0]
    mean, most = decode_blocks(cfg)
    assert most == 8 and mean == pytest.approx(sum(min(8, (24 + i) // 128 + 1) for i in range(1000)) / 1000)
    whole = cfg.model_copy(update={"compute": cfg.compute.model_copy(update={"decode_block": 0})})
    read = F.step_flops(whole).decode_row - F.step_flops(cfg).decode_row  # attention's 4 x heads x E per slot
    assert read == pytest.approx(4 * 4 * 128 * 8 * (1024 - mean * 128))
    mesh = make_mesh(1, 4, 1, devices)

    def seconds(depth: int, blocks: int | None) -> float:
        decode = next(ph for ph in FP.phases(FP.with_depth(cfg, depth), mesh) if ph.name == "decode")
        assert decode.blocks == (mean, most)
        with jax.set_mesh(mesh), A.static_decode_blocks(blocks) if blocks else contextlib.nullcontext():
            return F._optimal_seconds(decode.program.lower(*decode.args).compile())

    one, one_deep, all_deep = seconds(2, 1), seconds(4, 1), seconds(4, most)
    assert all_deep > 1.5 * one_deep
    assert one_deep <= seconds(4, None) < one_deep + (all_deep - one_deep) / (most - 1)  # less than 2 blocks
    at3 = FP.at_mean_blocks((one, one_deep), all_deep, (3.0, most))
    assert seconds(6, 3) == pytest.approx(FP.extrapolate(at3, 6), rel=0.1)
    # fit's own pricing does the same (each block count a freshly traced program: jit's cache ignores the count)
    decode = next(ph for ph in F._price_sampler(cfg, V6E_2X2, mesh, lambda _: None) if ph.name == "decode")
    want = FP.extrapolate(FP.at_mean_blocks((one, one_deep), all_deep, (mean, most)), cfg.model_cfg.n_layers)
    assert decode.seconds == pytest.approx(want, rel=1e-6) and decode.seconds > FP.extrapolate((one, one_deep), 8)
    # The kernel's price grows with the blocks it reads, as fit's pricing at the mean block count needs.
    cfg = cfg.model_copy(update={"compute": cfg.compute.model_copy(update={"decode_attention": "pallas"})})
    assert seconds(4, most) > seconds(4, 1)


def test_decode_bound_is_the_bytes_each_chip_reads() -> None:
    """The decode floor by hand: 2 steps of 4 rows on fsdp 2 x tensor 2 read each chip's half of the bf16 weights
    and its 2 rows' KV cache (split over 2 KV heads' tensor halves) at P + 1 and P + 2 positions."""
    from trainer.fit import phases as FP

    cfg = resolve_mesh(_cfg({"n_layers": 2}, mesh={"tensor": 2}, rl={"group_size": 2, "prompts_per_step": 2},
                            sampling={"max_new_tokens": 2}, compute={"dtype": "bfloat16"}), 4)
    m, P = cfg.model_cfg, cfg.prompt_len
    weights = F.param_count(m) * 2 / 2
    kv_token = m.n_layers * 2 * m.n_kv_heads * m.head_dim * 2 / 2
    bw = 1e12
    want = sum((weights + 2 * kv_token * (P + i)) / bw for i in (1, 2))
    got = FP.bounds(cfg, 4, 1e30, bw, {"update": 8e30})
    assert got.decode == pytest.approx(want) and got.update == pytest.approx(2.0)


def test_a_regrouped_sampler_reads_its_share_of_the_weights() -> None:
    """sampling.tensor 4 on fsdp 2 x tensor 2 (v6e 2x2): the floor is a quarter of the bf16 weights per chip and
    every row's cache over all 4 chips (4 KV heads); the sampler's phases compile for the chips on the regrouped
    mesh, each chip holding a quarter of the gathered weights, and the decode step costs less than on the mesh as
    it is, where each chip reads half of them."""
    from trainer.fit import phases as FP
    from trainer.model.sharding import make_mesh

    model = {"n_layers": 2, "n_kv_heads": 4, "d_model": 512, "d_ff": 2048, "head_dim": 128}
    kw = dict(mesh={"tensor": 2}, rl={"group_size": 2, "prompts_per_step": 2}, compute={"dtype": "bfloat16"})
    plain = resolve_mesh(_cfg(model, sampling={"max_new_tokens": 2, "gather_weights": True}, **kw), 4)
    cfg = resolve_mesh(_cfg(model, sampling={"max_new_tokens": 2, "gather_weights": True, "tensor": 4}, **kw), 4)
    m, P = cfg.model_cfg, cfg.prompt_len
    kv_token = m.n_layers * 2 * m.n_kv_heads * m.head_dim * 2 / 4
    want = sum((F.param_count(m) * 2 / 4 + 4 * kv_token * (P + i)) / 1e12 for i in (1, 2))
    assert FP.bounds(cfg, 4, 1e30, 1e12, {}).decode == pytest.approx(want)

    F.prepare_environment(V6E_2X2)
    mesh = make_mesh(1, 2, 2, F.topology_devices(V6E_2X2))
    priced = {}
    for c in (plain, cfg):
        c = F.resolve_model(c)[0]
        by_name = {ph.name: ph for ph in FP.phases(c, mesh)}
        assert set(by_name) == {"gather", "prefill", "decode"}
        decode = by_name["decode"]
        assert decode.mesh.shape == ({"slices": 1, "fsdp": 1, "tensor": 4} if c.sampling.tensor else mesh.shape)
        wq = decode.args[0]["layers"]["wq"]
        assert wq.sharding.shard_shape(wq.shape)[-2] == m.n_heads // (c.sampling.tensor or 2)
        # The step takes the logits as the loop carries them (vocab-sharded, as the head writes them) and returns
        # the log-prob the sampler stores, so that pass is priced rather than dropped as dead code.
        logits = decode.args[2]
        assert logits.sharding.shard_shape(logits.shape)[-1] == m.vocab_size // (c.sampling.tensor or 2)
        with jax.set_mesh(decode.mesh):
            assert decode.program.eval_shape(*decode.args)[2].shape == (logits.shape[0],)
        with jax.set_mesh(decode.mesh):
            priced[c.sampling.tensor] = F._optimal_seconds(decode.program.lower(*decode.args).compile())
    assert priced[4] < priced[None]
    # The regrouped gather goes layer by layer; fit's phases unroll that loop, so a deeper model costs more (a loop
    # would be counted once: the same price at any depth).
    gather = {}
    for depth in FP.DEPTHS:
        ph = next(p for p in FP.phases(FP.with_depth(F.resolve_model(cfg)[0], depth), mesh) if p.name == "gather")
        with jax.set_mesh(ph.mesh):
            gather[depth] = F._optimal_seconds(ph.program.lower(*ph.args).compile())
    assert gather[4] > 1.5 * gather[2]
    report = F.fit(cfg, V6E_2X2, title="regrouped", phases=False)
    assert report.fits and report.to_json()["sampler_mesh"] == {"slices": 1, "fsdp": 1, "tensor": 4}
    assert "mesh slices=1 x fsdp=2 x tensor=2 (sampling on slices=1 x fsdp=1 x tensor=4)" in report.headline()[2]


def test_one_kv_head_per_chip_decodes_with_no_copy_of_the_cache() -> None:
    """4 KV heads regrouped over a tensor axis of 4 (sampling.tensor), the cache's layout the compiler's to choose as
    in the sampler's loop: the kernel reads each shard's one head through the cache's [L, B, S, E] view and keeps no
    cache-sized temporary. Its [block, 1, E] blocks made libtpu copy the cache at every step."""
    from trainer.fit import phases as FP
    from trainer.model import attention as A
    from trainer.model.sharding import make_mesh

    model = {"n_layers": 4, "n_kv_heads": 4, "head_dim": 128, "max_seq_len": 1280}
    cfg = resolve_mesh(_cfg(model, mesh={"tensor": 2}, rl={"group_size": 8, "prompts_per_step": 8},
                            compute={"dtype": "bfloat16", "decode_block": 256},
                            sampling={"max_new_tokens": 1024, "max_prompt_len": 256, "gather_weights": True,
                                      "tensor": 4}), 4)
    F.prepare_environment(V6E_2X2)
    mesh = make_mesh(1, 2, 2, F.topology_devices(V6E_2X2))
    decode = next(ph for ph in FP.phases(F.resolve_model(cfg)[0], mesh) if ph.name == "decode")
    cache = decode.args[1].k_LBSKE
    assert cache.sharding.shard_shape(cache.shape)[3] == 1
    cache_bytes = 2 * cache.size * cache.dtype.itemsize / 4
    with jax.set_mesh(decode.mesh), A.static_decode_blocks(5):
        compiled = decode.program.lower(*decode.args).compile()
    assert "tpu_custom_call" in compiled.as_text()
    assert compiled.memory_analysis().temp_size_in_bytes < 0.05 * cache_bytes


def test_a_decode_step_writes_the_cache_in_place() -> None:
    """Compiled for a v6e chip with the cache donated, a decode step keeps no cache-sized temporary, its layers
    scanned or unrolled, one write position for every row or one per row (continuous batching), its attention a loop
    over 256-slot blocks of the 2048-slot float32 cache. The cache as a scan input restacked into a fresh output, or a
    per-row dynamic-update-slice, kept 0.4-1x the cache; the loop's blocks read at default precision, 0.5x."""
    from trainer.base.config import ComputeConfig, ModelConfig
    from trainer.model import decoder as M

    F.prepare_environment(V6E_2X2)
    sh = jax.sharding.SingleDeviceSharding(F.topology_devices(V6E_2X2)[0])

    def at(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)

    tokens = jax.ShapeDtypeStruct((8, 1), jnp.int32, sharding=sh)
    # One KV head: the kernel reads the cache's [L, B, S, E] view (a [block, 1, E] block made libtpu copy it).
    for kv_heads, scan, kernel in ((2, True, "xla"), (2, False, "xla"), (2, True, "pallas"), (1, True, "pallas")):
        cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=kv_heads, head_dim=128,
                          d_ff=512, max_seq_len=2048)
        params = jax.tree.map(at, M.abstract_params(cfg))
        cache = jax.tree.map(at, jax.eval_shape(lambda cfg=cfg: M.init_cache(cfg, 8, 2048)))
        cache_bytes = 2 * cache.k_LBSKE.size * cache.k_LBSKE.dtype.itemsize
        for index in (jax.ShapeDtypeStruct((), jnp.int32, sharding=sh), jax.ShapeDtypeStruct((8,), jnp.int32,
                                                                                             sharding=sh)):
            def step(params: Any, cache: Any, tokens: Any, index: Any, scan: bool = scan, kernel: str = kernel,
                     cfg: ModelConfig = cfg) -> Any:
                return M.forward(params, cfg, tokens, jnp.ones_like(tokens), cache=cache, index=index,
                                 cc=ComputeConfig(scan_layers=scan, decode_attention=kernel))[1]

            compiled = jax.jit(step, donate_argnums=1).lower(params, cache, tokens, index).compile()
            mem = compiled.memory_analysis()
            assert mem.temp_size_in_bytes < 0.05 * cache_bytes, (kv_heads, scan, kernel, index.shape)
            # The Pallas kernel (trainer/model/decode_kernel.py) reads the stacked cache as it lies: no copy of it
            # either.
            assert ("tpu_custom_call" in compiled.as_text()) == (kernel == "pallas")


def test_the_update_reads_grouped_kv_heads_inside_the_attention_kernel() -> None:
    """The update compiled for v6e 2x2 (fsdp 2 x tensor 2, 4 query heads on 2 KV heads, 256-token rows) runs Pallas'
    splash kernels, forward and both backward passes, with no KV head broadcast to its query heads around them (the
    flash kernel took a shard's one KV head broadcast to [8 rows, 2 heads, 256, 128], and its gradient summed)."""
    from trainer.model.sharding import make_mesh
    from trainer.rl.step import abstract_args, build_programs

    F.prepare_environment(V6E_2X2)
    mesh = make_mesh(1, 2, 2, F.topology_devices(V6E_2X2))
    cfg = resolve_mesh(_cfg({"n_layers": 2, "head_dim": 128, "max_seq_len": 256}, mesh={"tensor": 2},
                            rl={"group_size": 8, "prompts_per_step": 2},
                            compute={"dtype": "bfloat16", "remat": "full", "logprob_chunk": 128},
                            sampling={"max_new_tokens": 128, "max_prompt_len": 128}), 4)
    built = build_programs(cfg, mesh, 0, 1)
    with jax.set_mesh(mesh):
        compiled = built.update.lower(*abstract_args(cfg, built, 1)["update"]).compile()
    hlo = compiled.as_text()
    for kernel in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"):
        assert kernel in hlo
    # (RoPE's cos and sin broadcast over the heads inside their multiply's fusion are no copy of a KV head)
    assert not [line for line in hlo.splitlines()
                if re.search(r"= bf16\[8,2,256,128\]\S* broadcast\(", line) and '/mul"' not in line]
    # The kernel declares no cost: the compiler's FLOPs leave its attention out, which fit adds back (every loop
    # runs once here, so with it the compiler's count is the analytic one).
    kernel = 2 * F._kernel_attention_flops(cfg, mesh, "update") / 4
    counted = compiled.cost_analysis()["flops"]
    assert F.step_flops(cfg).executed["update"] / 4 == pytest.approx(counted + kernel, rel=0.05)
    assert kernel > 0.1 * counted
    assert F._kernel_attention_flops(cfg.model_copy(update={"compute": cfg.compute.model_copy(
        update={"attention": "xla"})}), mesh, "update") == 0
    # The sampler's prefill runs the forward kernel over the 128-token prompts alone; fit prices those FLOPs too.
    from trainer.fit import phases as FP
    from trainer.fit.flops import attention_flops

    prefill = next(ph for ph in FP.phases(cfg, mesh) if ph.name == "prefill")
    rows = prefill.args[1].shape[0]
    with jax.set_mesh(prefill.mesh):
        assert "splash_mha_fwd" in prefill.program.lower(*prefill.args).compile().as_text()
    assert F._kernel_attention_flops(cfg, mesh, "prefill", rows) == rows * attention_flops(cfg.model_cfg, 128 * 128)


def test_unrolled_layers_are_rematerialised_on_tpu() -> None:
    """remat keeps each layer's input alone and runs its forward again in the backward. Unrolled (fit prices
    updates with their layers unrolled, and a model of up to 16 layers runs so), a checkpoint without prevent_cse let
    libtpu merge the recomputed forward with the first: 16.1 MB of temporaries here against 14.3 MB without remat, so
    neither the memory saving nor the recomputation's time was in the program (0.88x the FLOPs). With it: 5.5 MB and
    1.14x. (Small widths and sequences: the same finding at a fifth of the compile time.)"""
    from trainer.base.config import ComputeConfig, ModelConfig
    from trainer.model import decoder as M

    F.prepare_environment(V6E_2X2)
    sh = jax.sharding.SingleDeviceSharding(F.topology_devices(V6E_2X2)[0])
    cfg = ModelConfig(**{**SMALL, "n_layers": 4, "d_model": 256, "d_ff": 1024, "n_heads": 8, "n_kv_heads": 4,
                         "head_dim": 64, "vocab_size": 1024, "max_seq_len": 256})
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          jax.eval_shape(lambda: M.init_params(cfg, jax.random.PRNGKey(0))))
    prompt, completion = (jax.ShapeDtypeStruct((4, n), jnp.int32, sharding=sh) for n in (64, 192))

    def compiled(remat: str) -> Any:
        cc = ComputeConfig(remat=remat, scan_layers=False, attention="xla", dtype="bfloat16")

        def loss(p: Any, pr: jax.Array, co: jax.Array) -> jax.Array:
            return -jnp.sum(M.completion_logprobs(p, cfg, pr, jnp.ones_like(pr), co, jnp.ones_like(co), cc=cc)[0])

        return jax.jit(jax.grad(loss)).lower(params, prompt, completion).compile()

    none, full = compiled("none"), compiled("full")
    assert full.memory_analysis().temp_size_in_bytes < 0.5 * none.memory_analysis().temp_size_in_bytes
    # The forward runs again: more FLOPs (the head, a large share at this width, is not part of the layers' remat).
    assert full.cost_analysis()["flops"] > 1.1 * none.cost_analysis()["flops"]


def test_rope_is_priced_as_one_pass_on_tpu() -> None:
    """RoPE as transformers writes it (split the head dim in halves, negate one, concatenate) is, on TPU, a relayout
    pass of its own over q and k in every layer: libtpu fused the split into a multi-output slice beside the
    elementwise pass, and the Qwen3-0.6B update spent 3 of its 16 ms a layer there. rotate_half as a product with
    a signed permutation fuses the norm, the rotation and the kernel's transpose into one pass."""
    from trainer.base.config import ModelConfig
    from trainer.model import decoder as M

    F.prepare_environment(V6E_2X2)
    sh = jax.sharding.SingleDeviceSharding(F.topology_devices(V6E_2X2)[0])
    cfg = ModelConfig(**{**SMALL, "n_heads": 16, "n_kv_heads": 8, "head_dim": 128, "max_seq_len": 1024})
    x = jax.ShapeDtypeStruct((8, 1024, 16, 128), jnp.bfloat16, sharding=sh)
    w = jax.ShapeDtypeStruct((128,), jnp.bfloat16, sharding=sh)
    pos = jax.ShapeDtypeStruct((8, 1024), jnp.int32, sharding=sh)

    def split_rope(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
        x1, x2 = jnp.split(x, 2, axis=-1)
        return x * tables[0] + jnp.concatenate([-x2, x1], axis=-1) * tables[1]

    def seconds(rope: Any) -> float:
        def f(x: jax.Array, w: jax.Array, pos: jax.Array) -> jax.Array:  # q's path into the attention kernel
            return rope(M.rms_norm(x, w, 1e-6), M.rope_tables(pos, cfg, x.dtype)).swapaxes(1, 2)

        return F._optimal_seconds(jax.jit(f).lower(x, w, pos).compile())

    assert seconds(M.rope) < 0.65 * seconds(split_rope)


def test_the_memory_estimate_counts_no_scores_where_the_flash_kernel_runs() -> None:
    """fit's analytic memory (its suggestions' savings, the search's pruning) counted every layer's [T, T] attention
    scores, though on TPU the update runs the flash kernel, which never writes them. Compiled for v6e with 1024-token
    rows, the einsum's update holds 39 MB more than the kernel's; the estimate now differs by 168 MB (before: by
    nothing). That is the einsum's side counted as fp32 scores, a masked copy and the probabilities, where libtpu
    fuses them into about the probabilities alone: an upper bound, as the model means it."""
    from trainer.fit import estimate as E
    from trainer.model.sharding import make_mesh
    from trainer.rl.step import abstract_args, build_programs

    F.prepare_environment(V6E_2X2)
    mesh = make_mesh(1, 4, 1, F.topology_devices(V6E_2X2))
    temp, estimate = {}, {}
    for attention in ("xla", "flash"):
        cfg = resolve_mesh(_cfg({"head_dim": 128, "max_seq_len": 1024}, rl={"group_size": 8, "prompts_per_step": 2},
                                compute={"dtype": "bfloat16", "remat": "full", "logprob_chunk": 128,
                                         "attention": attention},
                                sampling={"max_new_tokens": 896, "max_prompt_len": 128}), 4)
        built = build_programs(cfg, mesh, 0, 1)
        with jax.set_mesh(mesh):
            compiled = built.update.lower(*abstract_args(cfg, built, 1)["update"]).compile()
        temp[attention] = compiled.memory_analysis().temp_size_in_bytes
        estimate[attention] = E.memory(cfg, "update").temp
    compiled_saving, estimated_saving = temp["xla"] - temp["flash"], estimate["xla"] - estimate["flash"]
    assert compiled_saving > 0.5 * temp["xla"]  # the scores are most of the einsum's update here
    assert compiled_saving < estimated_saving < 5 * compiled_saving
