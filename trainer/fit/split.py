"""fit for `placement.mode: split`: each device group's programs compiled for its own devices, the weights' push
compiled as the trainer runs it across processes, the overlap, and the colocated layout on the same chips to compare.

The devices are split by the trainer's own rule (trainer/rl/rollouts.py `placement_meshes`): libtpu's topology
devices carry the slice and host (process) indices a real job's devices have, so the groups are the ones the job
would get. On the sampler's mesh: `sample` (and its phases, priced as fit prices them); on the trainer's: `update`,
`ref_logprobs` (rl.kl_beta > 0) and `proximal` (rl.lag_correction: decoupled, the proximal policy's forward pass).
Memory is per device against the same chip's HBM (both groups are the same generation).

The push: after every update the trainer's weights go to the sampler in the trainer's layout, then take the sampler's.
In a job of several processes (every multi-host TPU slice) that is trainer/model/transfer.py's Bridge: one program
over the union of both groups, a collective permute of each trainer shard onto its partner device (transfer.py
`swap`: the two halves of an array with its first dimension doubled, over a (group, slices, fsdp, tensor) mesh),
then a reshard within the sampler's devices. Both are compiled here for the topology and the compiler's
optimal_seconds taken. Partners are the Bridge's (a device of the same host) where every host holds devices of both
groups; by slice, each trainer device's partner is the sampler device at the same place of its slice, over DCN.
libtpu's cost model prices a collective by bytes alone, whatever link it crosses, so across slices the push is at
least its bytes per chip over the generation's DCN bandwidth per chip (the TPU catalog's, envspec/tpu.py; where it
has none, the compiler's figure alone).

The step: the union program runs on both groups, so it waits for the sampling in flight and the sampler's next
sampling waits for it. With rl.lag >= 1 (both groups at once): max(sample, update + ref_logprobs + proximal) + push;
with lag 0, everything one after the other. That assumes the loop takes each step's rollouts (across processes a
Bridge program on the sampler's devices too) before it dispatches the next sampling, as trainer/rl/train.py does:
launched after it, their way back would wait for that sampling, and the update with it. The way back is not priced
(token ids, masks, log-probs: small next to the weights). The colocated layout on the same chips is the same config
with placement colocated, a mesh over every device (slices of the target, fsdp -1, the trainer's tensor), sampling at
the sampler's tensor degree (sampling.tensor, with sampling.gather_weights) and rl.lag 0 (colocated, a lag adds a
copy of the weights and no overlap), fitted in the same run (CompileCache: a config fitted before in the run is not
compiled again).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from trainer.base.config import ConfigError, TrainConfig, config_from_dict, with_model
from trainer.fit import phases as FP
from trainer.fit.compiler import CompileCache, _compile, _tree_bytes_per_device
from trainer.fit.report import FitReport, PhaseFit, ProgramFit, SplitFit, Target


def colocated_config(cfg: TrainConfig, n_slices: int) -> TrainConfig:
    """`cfg` (split, resolved) with both phases on every device: see the module docstring."""
    d = cfg.model_dump(mode="json")
    d["placement"] = {"mode": "colocated"}
    d["mesh"] = {**d["mesh"], "slices": n_slices, "fsdp": -1, "tensor": cfg.mesh.tensor}
    tensor = cfg.placement.sampler.tensor
    regroup = tensor != cfg.mesh.tensor and cfg.sampling.gather_weights  # sampling.tensor needs the gathered copy
    d["sampling"] = {**d["sampling"], "tensor": tensor if regroup else None}
    d["rl"] = {**d["rl"], "lag": 0}
    if cfg.init.from_ == "hf":
        d.pop("model")  # attached by fit (resolve_model): a config of init.from hf may not name one
    try:
        return with_model(config_from_dict(d), cfg.model_cfg)
    except ConfigError as err:
        raise ConfigError(f"the colocated layout to compare with: {err}") from None


def refused_across_processes(cfg: TrainConfig, trainer: list[Any], sampler: list[Any]) -> str:
    """Why the trainer refuses this split in a job of one process per host ("" where it runs it): the trainer's own
    rule (trainer/base/placement.py check_multiprocess_split) applied to the topology's hosts."""
    from trainer.base.placement import check_multiprocess_split

    n_procs = len({d.process_index for d in trainer} | {d.process_index for d in sampler})
    if n_procs <= 1:
        return ""
    try:
        check_multiprocess_split(trainer, sampler, n_procs)
    except ConfigError as err:
        return f"the trainer refuses this split (one process per host): {err}"
    return ""


def _compile_mesh(mesh: Any, devices: list[Any]) -> Any:
    """`mesh` for compiling: libtpu refuses a program on a multislice topology without devices of its first slice
    ("Slice is empty"), so a group of later slices compiles on the same places of the first ones (the slices are
    alike; the program is the same)."""
    from jax.sharding import Mesh

    first = min(getattr(d, "slice_index", 0) for d in mesh.devices.flat)
    if first == 0:
        return mesh
    places: dict[tuple[int, int], Any] = {}
    for s in {getattr(d, "slice_index", 0) for d in devices}:
        for i, d in enumerate(sorted((d for d in devices if getattr(d, "slice_index", 0) == s), key=lambda d: d.id)):
            places[s, i] = d
    index = {d: key for key, d in places.items()}
    moved = np.vectorize(lambda d: places[index[d][0] - first, index[d][1]], otypes=[object])(mesh.devices)
    return Mesh(moved, mesh.axis_names, axis_types=mesh.axis_types)


def _union(train_mesh: Any, sampler: list[Any]) -> tuple[Any, Any, str]:
    """The union mesh of the push, the sampler's devices shaped as the trainer's mesh (the partners), and the links."""
    from jax.sharding import AxisType, Mesh

    from trainer.model.transfer import GROUP_AXIS, Bridge

    try:  # the trainer's own pairing: a partner device of the same host
        twin = Bridge(train_mesh, sampler).twin
    except ValueError:  # by slice: the device at the same place of the other slice
        order = sorted(sampler, key=lambda d: (getattr(d, "slice_index", 0), d.process_index, d.id))
        twin = Mesh(np.array(order, dtype=object).reshape(train_mesh.devices.shape), train_mesh.axis_names,
                    axis_types=train_mesh.axis_types)
    union = Mesh(np.stack([train_mesh.devices, twin.devices]), (GROUP_AXIS, *train_mesh.axis_names),
                 axis_types=(AxisType.Auto, *train_mesh.axis_types))
    across = any(getattr(a, "slice_index", 0) != getattr(b, "slice_index", 0)
                 for a, b in zip(train_mesh.devices.flat, twin.devices.flat, strict=True))
    return union, twin, "DCN (across slices)" if across else "ICI (within a slice)"


def _push_programs(t_params: Any, s_sh: Any, union: Any, twin: Any) -> tuple[Any, Any]:
    """The Bridge's two programs, lowered: its own collective permute over the union (transfer.py `swap`) and the
    reshard from the trainer's layout to the sampler's, within the sampler's devices."""
    import jax
    from jax.sharding import Mesh, NamedSharding

    from trainer.model.transfer import swap, union_layout

    def on(mesh: Any, x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec))

    def doubled(x: Any) -> jax.ShapeDtypeStruct:
        shape, sharding = union_layout(x.shape, x.sharding.spec, union)
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)

    stacked = [doubled(x) for x in jax.tree.leaves(t_params)]
    # The landed shards in the trainer's layout on the sampler's devices, numbered in the sampler mesh's order (jit
    # takes one device order; the Bridge's device_put, any): a reshard of the same bytes between the same layouts.
    s_mesh = jax.tree.leaves(s_sh)[0].mesh
    ordered = Mesh(s_mesh.devices.reshape(twin.devices.shape), twin.axis_names, axis_types=twin.axis_types)
    landed = jax.tree.map(lambda x: on(ordered, x), t_params)
    reshard = jax.jit(lambda tree: tree, out_shardings=s_sh)
    with jax.set_mesh(union):
        flipped = swap.lower(stacked, tuple(x.sharding for x in stacked))
    with jax.set_mesh(s_mesh):
        resharded = reshard.lower(landed)
    return flipped, resharded


def fit_split(cfg: TrainConfig, target: Target, devices: list[Any], *, title: str, source: str,
              say: Callable[[str], None], cache: CompileCache | None, phases: bool) -> FitReport:
    """The split fit (module docstring); `cfg` resolved on `devices`, the topology's."""
    import jax

    from trainer.fit import preflight as PF
    from trainer.fit.estimate import step_flops
    from trainer.rl.rollouts import placement_meshes, tree_bytes
    from trainer.rl.step import abstract_args, build_programs

    col_cfg = colocated_config(cfg, target.slices)  # its errors before any compile
    train_mesh, smesh = placement_meshes(cfg, devices)
    assert smesh is not None  # placement split
    t_dev, s_dev = list(train_mesh.devices.flat), list(smesh.devices.flat)
    train_mesh, smesh = _compile_mesh(train_mesh, devices), _compile_mesh(smesh, devices)
    say(f"split: the update on {len(t_dev)} devices, sampling on {len(s_dev)}")
    tprog, sprog = build_programs(cfg, train_mesh, 0, 1), build_programs(cfg, smesh, 0, 1)
    n_rewards = len(cfg.rewards) if cfg.rewards else 1
    targs, sargs = abstract_args(cfg, tprog, n_rewards), abstract_args(cfg, sprog, n_rewards)
    params_b = _tree_bytes_per_device(targs["update"][0])
    opt_b = _tree_bytes_per_device(targs["update"][1])
    s_params_b = _tree_bytes_per_device(sargs["sample"][0])
    kl, decoupled = cfg.rl.kl_beta > 0, cfg.rl.lag_correction == "decoupled"
    flops = step_flops(cfg)
    ref_w = (params_b, " + reference weights (rl.kl_beta > 0)") if kl else (0, "")
    specs = [  # name, group, program, args, resident, what
        ("sample", "sampler", sprog.sample, sargs["sample"], params_b,
         "the next weights landing (the push, in the trainer's layout)"),
        ("ref_logprobs", "trainer", tprog.ref_logprobs, targs["ref_logprobs"], params_b + opt_b,
         "policy weights + optimizer state"),
        ("proximal", "trainer", tprog.logprobs, targs["ref_logprobs"], opt_b + ref_w[0],
         "optimizer state" + ref_w[1]),
        ("update", "trainer", tprog.update, targs["update"], ref_w[0], ref_w[1].removeprefix(" + ")),
    ]
    programs: list[ProgramFit] = []
    total = len(specs) + 1
    for i, (name, group, program, args, resident, what) in enumerate(specs):
        kind = "ref_logprobs" if name == "proximal" else name
        p = ProgramFit(name, model_flops=flops.model[kind], flops=flops.executed[kind], group=group)
        programs.append(p)
        skip = ("rl.kl_beta = 0" if name == "ref_logprobs" and not kl else
                "rl.lag_correction = clip" if name == "proximal" and not decoupled else None)
        if skip is not None:
            p.skipped, p.model_flops, p.flops = skip, 0.0, 0.0
            say(f"skipping {name}: {skip} ({i + 1}/{total})")
            continue
        p.resident, p.resident_what = resident, what
        mesh = smesh if group == "sampler" else train_mesh
        with jax.set_mesh(mesh):
            lowered = program.lower(*args)
        _compile(p, lowered, mesh, target, len(devices), cache, say, f"{i + 1}/{total} ({group} group)")
    by_group = {"sampler": [p for p in programs if p.group == "sampler"],
                "trainer": [p for p in programs if p.group == "trainer"]}
    PF._estimate_times(cfg, target, len(s_dev), flops, by_group["sampler"])
    PF._estimate_times(cfg, target, len(t_dev), flops, by_group["trainer"])
    if phases:
        PF._price_passes(cfg, target, train_mesh, by_group["trainer"], n_rewards, say)
    sample = programs[0]
    phase_fits: list[PhaseFit] = PF._price_sampler(cfg, target, smesh, say) if phases and sample.compiled else []
    if phase_fits and all(ph.seconds > 0 for ph in phase_fits):
        sample.seconds = sum(ph.total for ph in phase_fits)
    per_chip = max(1, len(devices) // target.chips)
    chips = {"sampler": max(1, len(s_dev) // per_chip), "trainer": max(1, len(t_dev) // per_chip)}
    b = {g: FP.bounds(cfg, n, target.peak_flops_per_chip, target.hbm_bytes_per_s_per_chip, flops.model)
         for g, n in chips.items()}
    for p in programs:
        p.lower_bound = 0.0 if p.skipped is not None else (
            b["sampler"].sample if p.name == "sample" else b["trainer"].update if p.name == "update"
            else b["trainer"].ref_logprobs)
        if 0 < p.seconds < p.lower_bound:
            p.below_bound, p.seconds = p.seconds, p.lower_bound

    # The push: the bytes the trainer reports (push_bytes: the sampler's copy, each array once) and the Bridge.
    push_bytes = tree_bytes(sargs["sample"][0])
    union, twin, links = _union(train_mesh, s_dev)  # both groups: libtpu sees the first slice
    push = ProgramFit("push", group="both", resident=max(opt_b + ref_w[0], s_params_b),
                      resident_what="the larger of the trainer's optimizer state and the sampler's weights in use")
    flipped, resharded = _push_programs(targs["update"][0], sprog.param_sh, union, twin)
    _compile(push, flipped, union, target, len(devices), cache, say, f"{total}/{total} (the push over both groups)")
    again = ProgramFit("push reshard", group="sampler")
    _compile(again, resharded, smesh, target, len(devices), cache, say, "the push's reshard on the sampler's devices")
    push.compiler_seconds = max(push.compiler_seconds, 0.0) + max(again.compiler_seconds, 0.0)
    push.compile_seconds += again.compile_seconds
    dcn_bps = target.dcn_bits_per_s_per_chip  # the catalog's (envspec/tpu.py); None: no figure, no bound
    dcn = params_b * 8 / dcn_bps if links.startswith("DCN") and dcn_bps else 0.0
    push.lower_bound = dcn
    push.seconds = max(push.compiler_seconds, dcn)
    programs.append(push)

    colocated = _colocated(col_cfg, target, say=say, cache=cache, phases=phases)
    split = SplitFit(
        lag=cfg.rl.lag, lag_correction=cfg.rl.lag_correction, trainer_devices=len(t_dev),
        sampler_devices=len(s_dev), trainer_ids=sorted(d.id for d in t_dev), sampler_ids=sorted(d.id for d in s_dev),
        push_bytes=push_bytes, push_bytes_per_device=params_b, push_links=links,
        push_compiler_seconds=push.compiler_seconds, push_dcn_seconds=dcn, push_reshard_peak=again.program_peak,
        refused=refused_across_processes(cfg, t_dev, s_dev),
        colocated_mesh=colocated.mesh, colocated_sampler_mesh=colocated.sampler_mesh or colocated.mesh,
        colocated_step_seconds=colocated.step_seconds if colocated.not_applicable() is None else None,
        colocated_why=colocated.not_applicable() or "")
    m = cfg.model_cfg
    report = PF._report(cfg, target, title=title, source=source, devices=devices, programs=programs,
                        phase_fits=phase_fits, bounds=b["sampler"])
    report.sampler_mesh = dict(cfg.placement.sampler.axes())
    report.split = split
    report.depths = FP.depths(m.n_layers)
    return report


def _colocated(col: TrainConfig, target: Target, *, say: Callable[[str], None], cache: CompileCache | None,
               phases: bool) -> FitReport:
    """The colocated fit on the same chips (`colocated_config`), reused from `cache` when fitted before in the run."""
    from trainer.fit.preflight import fit

    key = hashlib.sha256(f"{target}\n{phases}\n{col.model_dump_json()}".encode()).hexdigest()
    if cache is not None and key in cache.reports:
        say("the colocated layout: fitted before in this run")
        return cache.reports[key]
    say("fitting the colocated layout on the same chips, to compare")
    report = fit(col, target, title="colocated", progress=say, cache=cache, phases=phases)
    if cache is not None:
        cache.reports[key] = report
    return report


def fit(cfg: TrainConfig, target: Target, *, title: str, model: str | None = None,
        progress: Callable[[str], None] | None = None, cache: CompileCache | None = None,
        phases: bool = True) -> FitReport:
    """preflight.fit for any placement: a split config's groups, push and colocated comparison (fit_split), else
    preflight.fit itself. The door the CLI uses; it sits above preflight, which split builds on."""
    from trainer.fit import preflight as PF

    if cfg.service is not None or cfg.placement.mode != "split":
        return PF.fit(cfg, target, title=title, model=model, progress=progress, cache=cache, phases=phases)
    say = progress or (lambda _msg: None)
    cfg, source = PF.resolve_model(cfg, model)
    PF.prepare_environment(target)
    devices = PF.topology_devices(target)
    cfg = PF._resolve_mesh(cfg, devices, target)
    return fit_split(cfg, target, devices, title=title, source=source, say=say, cache=cache, phases=phases)
