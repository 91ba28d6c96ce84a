"""fit's advice: the config settings that would reduce a program's memory (`suggestions` for the RL trainer's
programs, `service_suggestions` for the service engine's), each with values that pass the config's own checks, and
their estimated savings from the analytic model (trainer/fit/estimate.py) calibrated on what the compiler measured."""

from __future__ import annotations

from trainer.base.config import ConfigError, TrainConfig, apply_overrides, config_from_dict, resolve_mesh
from trainer.fit import estimate as E
from trainer.fit.report import ProgramFit, Suggestion
from trainer.service.shapes import rows as shape_rows


def service_suggestions(ps: E.Pass | None, cfg: TrainConfig) -> list[Suggestion]:
    """Settings that reduce a service program's memory (`ps`: the forward_backward pass; None: optim_step). The first
    three trade capacity (adapters, their rank, the tokens or the longest datum of a pass); the rest keep it."""
    assert cfg.lora is not None and cfg.service is not None
    lcfg, svc, c, mesh, m = cfg.lora, cfg.service, cfg.compute, cfg.mesh, cfg.model_cfg
    out: list[Suggestion] = []

    def add(setting: str, text: str) -> None:
        out.append(Suggestion(f"{setting}{text}", setting))

    if lcfg.slots > 1:
        add(f"lora.slots={lcfg.slots // 2}", f" (now {lcfg.slots}): half the adapters (fewer clients' models and "
            "sampler checkpoints loaded at once), each held 4 times")
    if lcfg.rank > 1:
        add(f"lora.rank={lcfg.rank // 2}", f" (now {lcfg.rank}): half the adapters' width (clients may ask for rank "
            f"<= {lcfg.rank // 2})")
    data = mesh.slices * mesh.fsdp
    if ps is not None:
        half = svc.max_batch_tokens // 2
        if half >= shape_rows(1, data) * svc.min_bucket:
            longest = E.service_longest_datum(cfg.model_copy(update={"service": svc.model_copy(
                update={"max_batch_tokens": half})}), data)
            add(f"service.max_batch_tokens={half}", f" (now {svc.max_batch_tokens}): fewer tokens per pass (the "
                f"longest datum a pass holds: {longest} tokens)")
        if c.remat != "full":
            add("compute.remat=full", f" (now {c.remat}): keep only each layer's input for the backward pass")
        if c.logprob_chunk > 32 and c.logprob_chunk < ps.length * 2:
            add(f"compute.logprob_chunk={c.logprob_chunk // 2}", f" (now {c.logprob_chunk}): fewer fp32 [rows, "
                "chunk, vocab] logits at once")
        if cfg.compute_dtype != "bfloat16":
            add("compute.dtype=bfloat16", ": bf16 activations")
    if m.param_dtype != "bfloat16":
        add("compute.param_dtype=bfloat16", ": halves the base weights (the adapters stay float32)")
    t = next((t for t in (2, 4, 8) if t > mesh.tensor and m.n_kv_heads % t == 0 and m.n_heads % t == 0), None)
    if t:
        add(f"mesh.tensor={t}", f" (now {mesh.tensor}): shard heads, MLP and vocab, not only the batch")
    out.append(Suggestion("more chips: a larger topology or more slices (--slices)"))
    return out


def estimate_service_savings(p: ProgramFit, ps: E.Pass | None, cfg: TrainConfig,
                             found: list[Suggestion]) -> list[Suggestion]:
    """Each suggestion's estimated saving for service program `p` (forward_backward at pass `ps`, or optim_step):
    estimate.service_memory calibrated on what the compiler measured; a changed config's pass is the one of the
    same kind (or length)."""
    lay = E.Layout.of(cfg)
    program = "optim_step" if ps is None else "forward_backward"
    base = E.service_memory(cfg, program, ps, lay)
    k = E.calibration(base, E.measured_temp(p))

    def same(changed: TrainConfig, layout: E.Layout) -> E.Pass | None:
        if ps is None:
            return None
        passes = E.service_passes(changed, shape_rows(1, layout.data))
        if ps.kind.startswith("longest"):
            return passes[-1]
        if ps.kind == "most rows":
            return passes[0]
        return next((q for q in passes if q.length == ps.length), passes[-1])

    for s in found:
        try:
            if s.setting is None:
                other = E.service_memory(cfg, program, same(cfg, lay.doubled()), lay.doubled())
                s.estimate_note = "for twice the chips"
            else:
                changed = with_settings(cfg, [s.setting])
                if s.setting.startswith("mesh."):
                    changed = resolve_mesh(changed, lay.devices, exact=True)
                other_lay = E.Layout.of(changed)
                other = E.service_memory(changed, program, same(changed, other_lay), other_lay)
        except ConfigError as err:
            s.estimate_note = str(err)
            continue
        s.saves = int(E.saving(base, other, k))
    return found


def suggestions(program: str, cfg: TrainConfig) -> list[Suggestion]:
    """Config settings that would reduce `program`'s memory, with values that pass the config's own checks (no
    estimate yet: `estimate_savings` adds it)."""
    c, rl, mesh, m = cfg.compute, cfg.rl, cfg.mesh, cfg.model_cfg
    data = mesh.slices * mesh.fsdp
    # placement.mode=split: sampling runs on placement.sampler's own devices, which hold no optimizer state; its
    # layout is the sampler's keys, not mesh.* or sampling.tensor (the colocated sampler's regroup).
    split_sample = program == "sample" and cfg.placement.mode == "split"
    out: list[Suggestion] = []

    def add(setting: str, text: str) -> None:
        out.append(Suggestion(f"{setting}{text}", setting))

    def halves(n: int, divides: int) -> int | None:
        h = n // 2
        return h if n % 2 == 0 and h % data == 0 and divides % h == 0 else None

    if program == "update":
        if c.remat != "full":
            add("compute.remat=full", f" (now {c.remat}): keep only each layer's input for the backward pass")
        mb = halves(cfg.micro_batch_rows, cfg.minibatch_rows)
        if mb:
            add(f"compute.train_micro_batch_size={mb}", f" (now {cfg.micro_batch_rows}): fewer sequences' "
                "activations at once, gradients accumulated")
        if cfg.batch_size % (2 * rl.minibatches) == 0 and (cfg.batch_size // (2 * rl.minibatches)) % data == 0:
            add(f"rl.minibatches={2 * rl.minibatches}", f" (now {rl.minibatches}): smaller minibatches (more "
                "optimizer steps per RL step: changes the algorithm)")
    if program == "sample":
        sm = cfg.sampler_mesh
        if split_sample:
            data = sm["slices"] * sm["fsdp"]  # the sampler's rows split over its own data shards
        ns = halves(cfg.sample_chunk_rows, cfg.batch_size)
        if ns:
            add(f"sampling.max_num_sequences={ns}", f" (now {cfg.sample_chunk_rows}): a KV cache for fewer "
                "sequences at once")
        st, within = sm["tensor"], mesh.fsdp * mesh.tensor
        t2 = 2 * st
        if split_sample and sm["fsdp"] % 2 == 0 and m.n_heads % t2 == 0 and m.n_kv_heads % t2 == 0:
            add(f"placement.sampler.tensor={t2}", f" (now {st}, placement.sampler.fsdp {sm['fsdp']} -> "
                f"{sm['fsdp'] // 2}): the sampler's heads, KV cache, MLP and vocab over twice the chips, on the "
                "same chips")
        if not split_sample and cfg.sampling.gather_weights and within % (2 * st) == 0:
            add(f"sampling.tensor={2 * st}", f" (now {st}): the sampler's copy of the weights split over twice the "
                "chips (each slice's chips regrouped for sampling), not gathered per token")
        if cfg.sampling.gather_weights:
            add("sampling.gather_weights=false", " (now true): no whole compute-dtype copy of the weights while "
                "sampling (an all-gather per generated token instead)")
    if program in ("update", "ref_logprobs") and c.logprob_chunk > 128 and cfg.sampling.max_new_tokens > 128:
        add(f"compute.logprob_chunk={max(128, min(c.logprob_chunk, cfg.sampling.max_new_tokens) // 2)}",
            f" (now {c.logprob_chunk}): fewer fp32 [batch, chunk, vocab] logits at once")
    if program in ("sample", "update") and not split_sample and getattr(cfg.optim, "name", None) == "adamw":
        add("optim.name=adafactor", ": factored second moments and no first moment instead of Adam's two "
            "param-sized moments" + (" (resident while sampling)" if program == "sample" else "")
            + " (a different optimizer: changes the algorithm)")
    if cfg.compute_dtype != "bfloat16":
        add("compute.dtype=bfloat16", ": bf16 activations" + (" and KV cache" if program == "sample" else ""))
    if m.param_dtype != "bfloat16":
        add("compute.param_dtype=bfloat16", ": halves the master weights and Adam state")
    if mesh.slices > 1 and not split_sample and getattr(mesh, "fsdp_across_slices", None) is False:
        add("mesh.fsdp_across_slices=true", ": shard the weights and optimizer state over the slices too "
            "(an all-gather over DCN every pass)")
    t = next((t for t in (2, 4, 8) if t > mesh.tensor and m.n_kv_heads % t == 0 and m.n_heads % t == 0), None)
    if t and not split_sample:
        add(f"mesh.tensor={t}", f" (now {mesh.tensor}): shard heads, MLP and vocab, not only the batch")
    if cfg.placement.mode == "split":
        group = "sampling: a larger placement.sampler" if split_sample else "the update: a smaller placement.sampler"
        out.append(Suggestion(f"more chips for {group} (the other group's chips), a larger topology or more slices "
                              "(trainer.slices / --slices)"))
    else:
        out.append(Suggestion("more chips: a larger topology or more slices (trainer.slices / --slices)"))
    return out


def with_settings(cfg: TrainConfig, settings: list[str]) -> TrainConfig:
    """`cfg` with `--set KEY=VALUE` settings applied the way the CLI applies them (resolved mesh axes kept, except
    that a mesh.tensor setting re-derives fsdp, as the JobSet's mesh.fsdp=-1 would)."""
    extra = ["mesh.fsdp=-1"] if any(s.startswith("mesh.tensor=") for s in settings) else []
    for s in settings:  # the sampler's tensor on the same chips: its fsdp gives way
        if s.startswith("placement.sampler.tensor="):
            sm = cfg.placement.sampler
            extra.append(f"placement.sampler.fsdp={sm.fsdp * sm.tensor // int(s.split('=', 1)[1])}")
    data = apply_overrides(cfg.model_dump(by_alias=True), [*settings, *extra])
    if cfg.model is not None and cfg.init.from_ == "hf":  # a model attached by resolve_model: as with_model does
        data["init"] = {"from": "random", "path": None}
        return config_from_dict(data).model_copy(update={"init": cfg.init})
    return config_from_dict(data)


def estimate_savings(p: ProgramFit, cfg: TrainConfig, found: list[Suggestion]) -> list[Suggestion]:
    """Fill each suggestion's estimated saving for compiled program `p` of the resolved config `cfg`: the
    analytic memory model (trainer/fit/estimate.py) calibrated on what the compiler measured for `p`."""
    lay = E.Layout.running(cfg, p.name)
    base = E.memory(cfg, p.name, lay)
    k = E.calibration(base, E.measured_temp(p))
    for s in found:
        try:
            if s.setting is None:  # more chips: twice as many, as a topology twice the size
                other = E.memory(cfg, p.name, lay.doubled())
                s.estimate_note = "for twice the chips"
            else:
                changed = with_settings(cfg, [s.setting])
                if s.setting.startswith("mesh."):
                    changed = resolve_mesh(changed, E.Layout.job_devices(cfg), exact=True)
                other = E.memory(changed, p.name, E.Layout.running(changed, p.name))
        except ConfigError as err:
            s.estimate_note = str(err)
            continue
        s.saves = int(E.saving(base, other, k))
    return found
