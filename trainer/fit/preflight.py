"""Preflight: compile the trainer's own jitted programs for a real TPU slice on this (CPU) machine, before
anyone pays for the slice.

`fit(cfg, target)` builds the very programs the RL loop runs (`trainer.rl.step.build_programs`) on the devices of
libtpu's ahead-of-time topology description (`jax.experimental.topologies.get_topology_desc`), lowers them on
`step.abstract_args` (ShapeDtypeStructs, no real array) and compiles them with libtpu, as MaxText's
train_compile does. Nothing runs; no TPU is needed.

What is measured, and what is estimated:

- Memory, per device (one per chip, except generations whose chips show up as two devices): XLA's memory
  analysis of each compiled program, i.e. arguments, outputs, temporaries, aliased bytes (donated inputs reused
  as outputs) and generated code; peak = arguments + outputs - aliased + temporaries + code, plus *resident*:
  state the loop keeps in HBM while the program runs without passing it in (the optimizer state while sampling;
  the policy and optimizer state while computing reference log-probs; the reference copy of the weights when
  rl.kl_beta > 0). A program the compiler cannot place raises RESOURCE_EXHAUSTED; its message's figures are
  reported instead.
- FLOPs and time: on TPU, XLA's cost analysis counts the body of every while loop once, and every `lax.scan`
  (decoder layers, mu iterations, minibatches, micro-batches, log-prob chunks) is a while loop, as is the
  sampler's decode loop. Checked with libtpu 0.0.42.1: a 10-step scan of a matmul reports the FLOPs and
  `optimal_seconds` of one step, the sampler's FLOPs do not change with max_new_tokens or n_layers
  (tests/trainer/test_fit.py). So the compiler's own figures are kept as reported and the estimates are:
  - FLOPs: analytic, for what the program executes (attention over every key slot it computes, remat and the
    log-prob chunks' recomputation included), with every loop iteration counted;
  - ref_logprobs, update: compiled again with their layers unrolled, at 2 and 4 layers (2 and 8 for a model of 32
    or more: phases.depths), and extrapolated to the model's depth (`_price_passes`; the update one micro-batch
    per run, the optimizer once per minibatch). A scanned layer's body is priced above an unrolled layer
    (tests/trainer/test_fit.py), and scaling the whole program by FLOPs would multiply its work outside the layers
    by the depth. With `phases=False` (fit --search): the
    compiler's `optimal_seconds` x (analytic FLOPs / compiler FLOPs). libtpu 0.0.42.1 prices
    each `ConcatBitcast`, `SliceId` (multislice) and `ZeroCrop` custom call at -1 s, which makes `optimal_seconds`
    negative for realistic programs: those are added back; should it stay <= 0, the estimate falls back to peak
    FLOP/s (optimistic) and says so;
  - sample: each of the sampler's phases (the weights gathered for sampling, a prefill, a continuous-batching
    refill, one decode step) compiled as a program of its own with its layers unrolled, at the same depths, and
    extrapolated to the model's depth (trainer/fit/phases.py): the compiler's optimal_seconds per run, which sees
    the decode step's real reads (the cache blocks up to the furthest live token, the weights), layouts and
    collectives, times the runs of a step whose every row generates max_new_tokens. With `phases=False`
    (fit --search), or where the compiler gives no usable time, a FLOPs / HBM-bandwidth roofline instead.
- What the compiler's time is (libtpu 0.0.42.1, tests/trainer/test_fit.py): `optimal_seconds` sums, over the
  program's instructions, each one's own roofline, max(its FLOPs / peak, its bytes accessed / HBM bandwidth). No
  instruction overlaps another, and each runs at its roofline: a layout copy, a cast or a norm costs its bytes. A
  Pallas kernel costs what it declares; splash attention (the update's) declares nothing and is priced at its
  operands' and results' bytes with no FLOPs, so `_price_passes` adds its FLOPs at peak. The estimates are of
  programs that run each op ideally, one at a time; the bytes of memory-bound ops are what keeps small models'
  updates far from peak.
- Lower bounds next to each estimate: prefill, reference log-probs and update at their model FLOPs over peak; each
  decode step at the bytes a chip must read (its share of the weights, its rows' live KV cache) over HBM bandwidth.
  The step's estimate / lower bound says how far the programs are from the hardware.
- MFU: model FLOPs of one RL step (generating B x max_new_tokens tokens, reference log-probs when
  rl.kl_beta > 0, mu_iterations forward + backward passes; causal attention, no remat) over
  chips x peak bf16 FLOP/s x the summed estimated time.

LoRA (`lora:`): the programs take {"base", "lora"} params and optimizer state for the adapters alone
(trainer/rl/step.py), so the measured arguments are base + adapters + the adapters' optimizer state; resident state is
that optimizer state alone (the reference policy is the base inside the params, never a copy). The report adds the
analytic state by kind (estimate.state) and the FLOPs count the adapters and drop the frozen weights' gradient.

A service config (`service:`) is the Tinker-compatible service's engine: `fit_service` compiles its own programs
(trainer/service/programs.py) instead, forward_backward at the passes the engine runs at their largest and
optim_step, and reports per device the base + four float32 adapter stacks + temporaries against the usable HBM.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.base import presets
from trainer.base.config import (
    ConfigError,
    ModelConfig,
    TrainConfig,
    resolve_mesh,
    with_model,
)
from trainer.fit import estimate as E
from trainer.fit import phases as FP
from trainer.fit.advice import estimate_savings, estimate_service_savings, service_suggestions, suggestions
from trainer.fit.compiler import (
    PRICING_OPTIONS,
    CompileCache,
    FitError,
    _compile,
    _optimal_seconds,
    _tree_bytes_per_device,
    parse_oom,
    prepare_environment,
    topology_devices,
    usable_hbm,
)
from trainer.fit.estimate import step_flops
from trainer.fit.flops import StepFlops, param_count
from trainer.fit.loops import loop_factor
from trainer.fit.report import (
    WARN_FRACTION,
    FitReport,
    GiB,
    PhaseFit,
    ProgramFit,
    ServiceFit,
    StateFit,
    Suggestion,
    Target,
)

# The report and FLOPs types (report.py, flops.py), the compile machinery (compiler.py) and the advice (advice.py)
# live beside this file; callers import fit's entry points from here.
__all__ = ["GiB", "WARN_FRACTION", "CompileCache", "FitError", "FitReport", "ProgramFit", "StepFlops", "Suggestion",
           "Target", "fit", "fit_service", "param_count", "parse_oom", "prepare_environment", "resolve_model",
           "step_flops", "suggestions", "topology_devices", "usable_hbm"]
PROGRAMS = ("sample", "ref_logprobs", "update")


# ---------------------------------------------------------------------------------------------- the model


def _hf_dtype(hf: dict[str, Any]) -> str:
    # The dtype a checkpoint with this config.json stores; import_hf keeps bf16 checkpoints in bf16.
    return "bfloat16" if str(hf.get("torch_dtype") or hf.get("dtype")) == "bfloat16" else "float32"


def _from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    from trainer.model.hf import model_config_from_hf

    try:
        return model_config_from_hf(hf, _hf_dtype(hf))
    except (ValueError, KeyError) as err:
        raise ConfigError(f"{where}: {err.args[0] if err.args else err}") from None


def resolve_model(cfg: TrainConfig, name: str | None = None) -> tuple[TrainConfig, str]:
    """The config with its model attached, and where the model came from.

    In order: `name` (a bundled preset, `--model`); the config's `model:`; for `init: {from: hf}`, the local
    init.path/config.json; a bundled preset named like init.path's last component. A service config with
    `init: {from: hf}` and no init.path (the engine reads service.base_model from the Hugging Face cache): the cached
    config.json when this machine's cache holds it, else a bundled preset named like service.base_model's last
    component ("Qwen/Qwen3-8B" -> Qwen3-8B).
    """
    if name is not None:
        found = presets.find(name)
        if found is None:
            raise ConfigError(f"--model {name!r}: not a bundled model; choose one of: {', '.join(presets.names())}")
        model = _from_hf(presets.hf_config(found), f"bundled {found}")
        return with_model(cfg, model), f"{found} (bundled config.json)"
    if cfg.model is not None:
        return cfg, "the config's model section"
    if cfg.service is not None and not cfg.init.path:
        return _service_model(cfg)
    path = cfg.init.path or ""
    local = Path(path) / "config.json"
    if local.is_file():
        try:
            hf = json.loads(local.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read {local}: {err}") from None
        return with_model(cfg, _from_hf(hf, str(local))), f"{Path(path).name} ({local})"
    found = presets.find(path)
    if found is not None:
        model = _from_hf(presets.hf_config(found), f"bundled {found}")
        return with_model(cfg, model), f"{found} (bundled config.json; {path} is not on this machine)"
    raise ConfigError(
        f"init.path {path!r}: no config.json there, and its name matches no bundled model "
        f"({', '.join(presets.names())}); pass --model NAME")


def _service_model(cfg: TrainConfig) -> tuple[TrainConfig, str]:
    assert cfg.service is not None
    repo = cfg.service.base_model
    cached = None
    with contextlib.suppress(Exception):  # no huggingface_hub, or a name it refuses: no cache to look in
        from huggingface_hub import try_to_load_from_cache

        found_path = try_to_load_from_cache(repo, "config.json")
        cached = Path(found_path) if isinstance(found_path, str) else None
    if cached is not None and cached.is_file():
        try:
            hf = json.loads(cached.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read {cached}: {err}") from None
        return with_model(cfg, _from_hf(hf, str(cached))), f"{repo} (the Hugging Face cache: {cached})"
    found = presets.find(repo)
    if found is None:
        raise ConfigError(
            f"service.base_model {repo!r}: not in this machine's Hugging Face cache, and its name matches no bundled "
            f"model ({', '.join(presets.names())}); pass --model NAME")
    model = _from_hf(presets.hf_config(found), f"bundled {found}")
    return with_model(cfg, model), f"{found} (bundled config.json; {repo} is not in this machine's Hugging Face cache)"


# ---------------------------------------------------------------------------------------------- compile


def fit(
    cfg: TrainConfig,
    target: Target,
    *,
    title: str,
    model: str | None = None,
    progress: Callable[[str], None] | None = None,
    cache: CompileCache | None = None,
    phases: bool = True,
) -> FitReport:
    """Compile `cfg`'s programs for `target` and report memory, FLOPs, time and MFU per RL step.

    `phases`: also compile the sampler's phases on their own to estimate its time (trainer/fit/phases.py);
    without, the sampler's time is a roofline (what `fit --search` orders candidates by).

    `cfg` is the trainer config as the pod would load it (mesh overrides applied); `model` names a bundled preset
    (see resolve_model). Raises ConfigError (FitError) for inputs that cannot be compiled; a program that does
    not fit is reported, not raised. With `cache`, a program compiled before is reused and its budget applies.
    A config with a `service:` section is the service engine's: its programs are sized instead (`fit_service`).
    """
    if cfg.service is not None:
        return fit_service(cfg, target, title=title, model=model, progress=progress, cache=cache)
    say = progress or (lambda _msg: None)
    cfg, source = resolve_model(cfg, model)
    prepare_environment(target)
    import jax

    from trainer.model.sharding import make_mesh
    from trainer.rl.step import abstract_args, build_programs

    devices = topology_devices(target)
    cfg = _resolve_mesh(cfg, devices, target)
    if cfg.placement.mode == "split":  # trainer/fit/split.py builds on this module: its `fit` takes both layouts
        raise FitError("placement.mode=split: fit it with trainer.fit.split.fit (each group's programs, the push)")
    mesh = make_mesh(cfg.mesh.slices, cfg.mesh.fsdp, cfg.mesh.tensor, devices)
    programs = build_programs(cfg, mesh, 0, 1)  # any valid pad / eos ids compile the same programs
    n_rewards = len(cfg.rewards) if cfg.rewards else 1
    args = abstract_args(cfg, programs, n_rewards)
    params_b = _tree_bytes_per_device(args["update"][0])
    opt_b = _tree_bytes_per_device(args["update"][1])
    kl = cfg.rl.kl_beta > 0
    if cfg.lora is None:
        resident = {
            "sample": (opt_b + (params_b if kl else 0),
                       "optimizer state" + (" + reference weights (rl.kl_beta > 0)" if kl else "")),
            "ref_logprobs": (params_b + opt_b, "policy weights + optimizer state"),
            "update": (params_b if kl else 0, "reference weights (rl.kl_beta > 0)" if kl else ""),
        }
    else:  # the params are base + adapters, and the reference policy is the base inside them: no copy
        resident = {
            "sample": (opt_b, "optimizer state (of the lora adapters)"),
            "ref_logprobs": (opt_b, "optimizer state (of the lora adapters)"),
            "update": (0, ""),
        }
    flops = step_flops(cfg)
    report_programs = []
    for i, name in enumerate(PROGRAMS):
        p = ProgramFit(name, model_flops=flops.model[name], flops=flops.executed[name])
        report_programs.append(p)
        if name == "ref_logprobs" and not kl:
            p.skipped, p.model_flops, p.flops = "rl.kl_beta = 0", 0.0, 0.0
            say(f"skipping {name}: rl.kl_beta = 0, no reference policy ({i + 1}/{len(PROGRAMS)})")
            continue
        p.resident, p.resident_what = resident[name]
        with jax.set_mesh(mesh):
            lowered = getattr(programs, name).lower(*args[name])
        _compile(p, lowered, mesh, target, len(devices), cache, say, f"{i + 1}/{len(PROGRAMS)}")
    _estimate_times(cfg, target, len(devices), flops, report_programs)
    if phases:
        _price_passes(cfg, target, mesh, report_programs, n_rewards, say)
    sample = report_programs[0]
    phase_fits = _price_sampler(cfg, target, mesh, say) if phases and sample.compiled else []
    if phase_fits and all(ph.seconds > 0 for ph in phase_fits):
        sample.seconds = sum(ph.total for ph in phase_fits)
    bounds = FP.bounds(cfg, target.chips, target.peak_flops_per_chip, target.hbm_bytes_per_s_per_chip, flops.model)
    for p in report_programs:
        p.lower_bound = {"sample": bounds.sample, "ref_logprobs": bounds.ref_logprobs,
                         "update": bounds.update}[p.name] if p.skipped is None else 0.0
        if 0 < p.seconds < p.lower_bound:  # no estimate below physics (libtpu under-counts some reads)
            p.below_bound, p.seconds = p.seconds, p.lower_bound
    report = _report(cfg, target, title=title, source=source, devices=devices, programs=report_programs,
                     phase_fits=phase_fits, bounds=bounds)
    report.sampler_mesh = cfg.sampler_mesh if cfg.sampling.tensor not in (None, cfg.mesh.tensor) else None
    return report


def _report(cfg: TrainConfig, target: Target, *, title: str, source: str, devices: list[Any],
            programs: list[ProgramFit], phase_fits: list[PhaseFit], bounds: FP.Bounds) -> FitReport:
    """The report of the trainer's programs compiled for `target`, with the memory advice of each."""
    m = cfg.model_cfg
    st = E.state(cfg)
    report = FitReport(
        title=title, target=target, model=source, params=param_count(m), param_dtype=m.param_dtype,
        compute_dtype=cfg.compute_dtype, mesh={k: getattr(cfg.mesh, k) for k in ("slices", "fsdp", "tensor")},
        batch=cfg.batch_size, prompt_len=cfg.prompt_len, new_tokens=cfg.sampling.max_new_tokens,
        devices=len(devices), programs=programs, hbm_usable=usable_hbm(target),
        state=StateFit(base=int(st.base), adapters=int(st.adapters), optimizer=int(st.optimizer),
                       gradients=int(st.gradients), accumulator=int(st.accumulator), reference=int(st.reference),
                       lora=None if cfg.lora is None else f"rank {cfg.lora.rank}, {cfg.lora.slots} slot"
                       f"{'s' if cfg.lora.slots != 1 else ''}, {', '.join(cfg.lora.targets)}",
                       lora_params=E.lora_param_count(m, cfg.lora) if cfg.lora is not None else 0),
        phases=phase_fits, sample_bounds={"prefill": bounds.prefill, "decode": bounds.decode},
        depths=FP.depths(m.n_layers))
    for p in programs:
        if p.skipped is None and p.name in PROGRAMS:
            report.suggestions[p.name] = estimate_savings(p, cfg, suggestions(p.name, cfg))
    return report


def _price_sampler(cfg: TrainConfig, target: Target, mesh: Any, say: Callable[[str], None]) -> list[PhaseFit]:
    """Compile each sampler phase at phases.depths layers and extrapolate its time to the model's depth."""
    import jax

    from trainer.model.attention import static_decode_blocks

    seconds: dict[str, list[float]] = {}
    runs: dict[str, int] = {}
    spent: dict[str, float] = {}
    blocks: dict[str, tuple[float, int]] = {}
    all_blocks: dict[str, float] = {}  # a block loop's phase reading all its blocks, at the deeper depth
    n_devices = mesh.devices.size  # the sampler's regrouped mesh holds the same devices
    peak = target.peak_flops_per_chip / max(1, n_devices // target.chips)  # per device

    def compile_seconds(ph: FP.Phase, depth: int, n_blocks: int | None) -> float:
        read = "" if n_blocks is None else f" reading {n_blocks} cache block{'s' if n_blocks > 1 else ''}"
        say(f"compiling the sampler's {ph.name} step{read} with {depth} layer{'s' if depth > 1 else ''} for "
            f"{target.label}")
        t0 = time.perf_counter()
        fixed = contextlib.nullcontext() if n_blocks is None else static_decode_blocks(n_blocks)
        with jax.set_mesh(ph.mesh), fixed:
            compiled = ph.program.lower(*ph.args).compile()
        spent[ph.name] = spent.get(ph.name, 0.0) + time.perf_counter() - t0
        kernel = 0.0  # a prefill's splash kernel FLOPs at peak, as _price_passes adds the update's
        if ph.name in ("prefill", "refill"):
            kernel = depth * _kernel_attention_flops(cfg, ph.mesh, ph.name, ph.args[1].shape[0]) / n_devices / peak
        return _optimal_seconds(compiled) + kernel

    layers = cfg.model_cfg.n_layers
    at = FP.depths(layers)
    for depth in at:
        for ph in FP.phases(FP.with_depth(cfg, depth), mesh):
            seconds.setdefault(ph.name, []).append(compile_seconds(ph, depth, None if ph.blocks is None else 1))
            runs[ph.name] = ph.runs
            if ph.blocks is not None:
                blocks[ph.name] = ph.blocks
                if depth == at[-1]:  # a fresh program: jit would reuse its 1-block trace
                    again = next(p for p in FP.phases(FP.with_depth(cfg, depth), mesh) if p.name == ph.name)
                    all_blocks[ph.name] = compile_seconds(again, depth, ph.blocks[1])
    out = []
    for name, (shallow, deep) in seconds.items():
        if name in blocks and min(shallow, deep, all_blocks[name]) > 0:
            shallow, deep = FP.at_mean_blocks((shallow, deep), all_blocks[name], blocks[name], at)
        per_run = FP.extrapolate((shallow, deep), layers, at) if shallow > 0 and deep > 0 else 0.0
        out.append(PhaseFit(name, runs[name], per_run, (shallow, deep), spent[name]))
    return out


def _price_passes(cfg: TrainConfig, target: Target, mesh: Any, programs: list[ProgramFit], n_rewards: int,
                  say: Callable[[str], None]) -> None:
    """ref_logprobs and update timed like the sampler's phases: compiled with 2 and 4 unrolled layers and
    extrapolated to the model's depth. The full program's time counts its layer loop's body once, priced at over
    2x an unrolled layer (tests/trainer/test_fit.py); scaling it by analytic / compiler FLOPs would also multiply
    what lies outside the layers (the optimizer, the head) by the depth. The update is priced per micro-batch
    (phases.one_micro_batch: forward, backward and the optimizer once); the optimizer runs once per minibatch
    and gradient accumulation adds a read and write of its buffer per micro-batch, both at HBM bandwidth. The loops
    left (the log-prob chunks) count at their trip counts (loops.loop_factor); the splash attention kernel's
    FLOPs, which libtpu leaves out, are added at peak. Only where a loop's trips cannot be read is the pass scaled
    by analytic / compiler FLOPs instead."""
    import jax

    from trainer.model.sharding import data_size
    from trainer.rl.step import abstract_args, build_programs

    n_devices = mesh.devices.size
    per_chip = max(1, n_devices // target.chips)
    bw, peak = target.hbm_bytes_per_s_per_chip / per_chip, target.peak_flops_per_chip / per_chip
    micro = cfg.micro_batch_rows_on(mesh.devices.flat[0].platform, data_size(mesh))
    n_micro = cfg.minibatch_rows // micro
    minibatches = cfg.rl.mu_iterations * cfg.rl.minibatches
    st = E.state(cfg)
    trainable = st.base if cfg.lora is None else st.adapters
    optimizer = (2 * trainable + st.gradients + 2 * st.optimizer) / bw  # weights, moments read and written
    accumulate = 2 * st.accumulator / bw
    layers = cfg.model_cfg.n_layers
    at = FP.depths(layers)
    for p in programs:
        if p.name not in ("ref_logprobs", "proximal", "update") or not p.compiled or p.seconds <= 0:
            continue
        base, runs = (FP.one_micro_batch(cfg, micro), minibatches * n_micro) if p.name == "update" else (cfg, 1)
        kernel = _kernel_attention_flops(base, mesh, p.name) / n_devices  # per layer, per device
        seconds, flops, looped = [], [], True
        for depth in at:
            c = FP.with_depth(base, depth)
            say(f"compiling {p.name} with {depth} layer{'s' if depth > 1 else ''} for {target.label}")
            built = build_programs(c, mesh, 0, 1)
            t0 = time.perf_counter()
            with jax.set_mesh(mesh):
                # the proximal pass (rl.lag_correction: decoupled) takes ref_logprobs' arguments
                program, args = (built.logprobs, "ref_logprobs") if p.name == "proximal" else (
                    getattr(built, p.name), p.name)
                lowered = program.lower(*abstract_args(c, built, n_rewards)[args])
                compiled = lowered.compile(compiler_options=PRICING_OPTIONS)
            p.compile_seconds += time.perf_counter() - t0
            # The log-prob chunks' loops at their trip counts; the kernel's FLOPs (libtpu prices it at its bytes
            # alone) at peak, on top: no credit for overlap.
            hlo = compiled.as_text()
            factor = loop_factor(hlo)
            looped = looped and factor is not None
            seconds.append(_optimal_seconds(compiled, hlo) * (factor or 1.0) + depth * kernel / peak)
            flops.append(float(compiled.cost_analysis().get("flops", 0.0)) + depth * kernel)
        if min(seconds) <= 0 or min(flops) <= 0:
            continue
        per_run = FP.extrapolate((seconds[0], seconds[1]), layers, at)
        if not looped:  # a loop of unknown trips: the pass scaled by the FLOPs the compiler counted once
            per_run *= max(1.0, p.flops / n_devices / runs / FP.extrapolate((flops[0], flops[1]), layers, at))
        total = runs * per_run
        if p.name == "update":
            total += (minibatches - runs) * optimizer + (runs if n_micro > 1 else 0) * accumulate
        p.seconds, p.depth_seconds, p.runs = max(total, p.flops / (n_devices * peak)), tuple(seconds), runs


def _kernel_attention_flops(cfg: TrainConfig, mesh: Any, program: str, rows: int | None = None) -> float:
    """Per layer, all devices: the attention FLOPs of `program` (one run) that run inside the Pallas splash kernel,
    counted as trainer/fit/flops.py counts them (every [T, T] pair; forward, backward and a recomputed forward), 0 where
    the pass runs XLA's einsum. The kernel declares no cost, so the compiler's FLOPs and time leave them out. The
    sampler's prefill and refill (`rows` prompts) run it forward over the prompts alone."""
    from trainer.fit.flops import attention_flops
    from trainer.model.attention import no_cache_attention

    prefill = program in ("prefill", "refill")
    T = cfg.prompt_len + (0 if prefill else cfg.sampling.max_new_tokens)
    if no_cache_attention(cfg.compute.on_platform(mesh.devices.flat[0].platform), T) != "flash":
        return 0.0
    # As flops.step_flops counts a pass: each mu iteration a forward, a backward (2x) and, with remat, a recomputation
    forward_only = program in ("ref_logprobs", "proximal") or prefill
    passes = 1 if forward_only else cfg.rl.mu_iterations * (3 + (cfg.compute.remat != "none"))
    return (cfg.batch_size if rows is None else rows) * passes * attention_flops(cfg.model_cfg, T * T)


def _resolve_mesh(cfg: TrainConfig, devices: list[Any], target: Target) -> TrainConfig:
    try:
        return resolve_mesh(cfg, len(devices), exact=True)
    except ConfigError as err:
        raise FitError(f"{err} (the {len(devices)} devices of {target.label})") from None


# ---------------------------------------------------------------------------------------------- the service


def fit_service(
    cfg: TrainConfig,
    target: Target,
    *,
    title: str,
    model: str | None = None,
    progress: Callable[[str], None] | None = None,
    cache: CompileCache | None = None,
) -> FitReport:
    """Compile a service config's engine programs (trainer/service/programs.py) for `target` and report them.

    forward_backward is compiled at the passes estimate.service_passes describes: the longest datum a pass of
    service.max_batch_tokens holds, and the shortest bucket with the most rows (plus any other bucket the analytic
    model puts above both); optim_step once. Per device: the frozen base, the four float32 adapter stacks (weights,
    Adam m and v, the gradient accumulator: arguments or resident) and each program's temporaries, against the
    slice's usable HBM. The report `fits` or names the knobs (lora.slots, lora.rank, service.max_batch_tokens).
    """
    say = progress or (lambda _msg: None)
    cfg, source = resolve_model(cfg, model)
    if cfg.service is None or cfg.lora is None:
        raise FitError("fit_service needs a config with service and lora sections")
    prepare_environment(target)
    from trainer.model.sharding import make_mesh
    from trainer.service import programs as SP

    devices = topology_devices(target)
    cfg = _resolve_mesh(cfg, devices, target)
    mesh = make_mesh(cfg.mesh.slices, cfg.mesh.fsdp, cfg.mesh.tensor, devices)
    progs = SP.build(cfg, mesh)
    lay = E.Layout.of(cfg)
    passes = _service_compiled_passes(cfg, E.service_passes(cfg, progs.data_parallel), lay)
    fb_args = SP.abstract_args(progs, passes[0].rows, passes[0].length)
    base_b = _tree_bytes_per_device(fb_args["forward_backward"][0])
    stack_b = _tree_bytes_per_device(fb_args["forward_backward"][1])
    total = len(passes) + 1
    programs: list[ProgramFit] = []
    for i, ps in enumerate(passes):
        executed, model_flops = E.service_flops(cfg, ps)
        p = ProgramFit(ps.name, flops=executed, model_flops=model_flops, resident=2 * stack_b,
                       resident_what="Adam m and v of the adapter stack (2 x float32 stacks)")
        args = SP.abstract_args(progs, ps.rows, ps.length)["forward_backward"]
        with _mesh(mesh):
            lowered = progs.forward_backward.lower(*args)
        _compile(p, lowered, mesh, target, len(devices), cache, say, f"{i + 1}/{total}")
        programs.append(p)
    p = ProgramFit("optim_step", resident=base_b, resident_what="the frozen base weights")
    with _mesh(mesh):
        lowered = progs.optim_step.lower(*fb_args["optim_step"])
    _compile(p, lowered, mesh, target, len(devices), cache, say, f"{total}/{total}")
    p.flops = p.compiler_flops  # elementwise over the stacks: no loop for the compiler to count once
    programs.append(p)
    _estimate_service_times(target, len(devices), stack_b, programs)
    m = cfg.model_cfg
    est = E.service_state(cfg, lay)
    svc = cfg.service
    assert svc is not None and cfg.lora is not None  # checked above; _resolve_mesh keeps both
    report = FitReport(
        title=title, target=target, model=source, params=param_count(m), param_dtype=m.param_dtype,
        compute_dtype=cfg.compute_dtype, mesh={k: getattr(cfg.mesh, k) for k in ("slices", "fsdp", "tensor")},
        batch=max(ps.rows for ps in passes), prompt_len=passes[-1].length if passes else 0, new_tokens=0,
        devices=len(devices), programs=programs, hbm_usable=usable_hbm(target),
        service=ServiceFit(
            base_model=svc.base_model, slots=cfg.lora.slots, rank=cfg.lora.rank, max_batch_tokens=svc.max_batch_tokens,
            min_bucket=svc.min_bucket, data_parallel=progs.data_parallel, context=m.max_seq_len,
            longest_datum=E.service_longest_datum(cfg, progs.data_parallel), passes={ps.name: ps.kind for ps in passes},
            base=base_b, stack=stack_b, stack_params=est.stack_params, base_estimate=int(est.base),
            stack_estimate=int(est.stack)))
    for pass_, p in zip([*passes, None], programs, strict=True):
        if p.skipped is None:
            report.suggestions[p.name] = estimate_service_savings(p, pass_, cfg, service_suggestions(pass_, cfg))
    return report


@contextlib.contextmanager
def _mesh(mesh: Any) -> Any:
    import jax

    with jax.set_mesh(mesh):
        yield


def _service_compiled_passes(cfg: TrainConfig, passes: list[E.Pass], lay: E.Layout) -> list[E.Pass]:
    """The longest pass and the one with the most rows (first, last of `passes`), and any other whose analytic peak is
    above both (the bound service_passes argues holds for fixed tokens; the row bucket's rounding can break it)."""
    ends = [passes[-1]] if len(passes) == 1 else [passes[-1], passes[0]]
    peak = {id(p): E.service_memory(cfg, "forward_backward", p, lay).temp for p in passes}
    top = max(passes, key=lambda p: peak[id(p)])
    if all(peak[id(top)] > 1.05 * peak[id(e)] for e in ends):
        ends.append(E.Pass("estimated largest", top.rows, top.length))
    return ends


def _estimate_service_times(target: Target, n_devices: int, stack_b: int, programs: list[ProgramFit]) -> None:
    per_chip = max(1, n_devices // target.chips)
    peak = target.peak_flops_per_chip / per_chip
    bw = target.hbm_bytes_per_s_per_chip / per_chip
    for p in programs:
        if p.skipped is not None:
            continue
        if p.name == "optim_step":  # reads lora, m, v, grads and writes them back
            p.seconds = max(p.compiler_seconds, 8 * stack_b / bw)
            continue
        floor = p.flops / (n_devices * peak)
        if p.compiler_flops > 0 and p.compiler_seconds > 0:
            p.seconds = max(floor, p.compiler_seconds * p.flops / p.compiler_flops)
        else:
            p.seconds = floor


def _estimate_times(cfg: TrainConfig, target: Target, n_devices: int, flops: StepFlops,
                    programs: list[ProgramFit]) -> None:
    per_chip = max(1, n_devices // target.chips)
    peak = target.peak_flops_per_chip / per_chip  # per device
    bw = target.hbm_bytes_per_s_per_chip / per_chip
    for p in programs:
        if p.skipped is not None:
            continue
        floor = p.flops / (n_devices * peak)
        if p.name == "sample":
            p.seconds = E.sample_seconds(cfg, n_devices, flops, peak, bw)
        elif p.compiler_flops > 0 and p.compiler_seconds > 0:
            p.seconds = max(floor, p.compiler_seconds * p.flops / p.compiler_flops)
        else:  # did not compile: the compute roofline alone
            p.seconds = floor
