"""What `gke-tpu-rl fit` reports: the compile target, each program's memory and time, and their rendering (text,
markdown for a PR comment, JSON). How the figures are made: trainer/fit/preflight.py. A report is of the RL trainer's
programs (sample, ref_logprobs, update), or with `service` of the service engine's (forward_backward passes,
optim_step).

Over 600 lines as one module on purpose: the report's types and FitReport's three renderings read every field, so a
field added here is rendered in the same file, where a reviewer sees all three."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from envspec import tpu

GiB = 1 << 30
WARN_FRACTION = 0.9  # above this share of the usable HBM a program fits, with a warning
BUDGET_SPENT = "not compiled: the compile budget is spent"


@dataclass(frozen=True)
class Target:
    """The TPU to compile for: a generation of the TPU catalog (envspec/tpu.py), which `of` reads every figure from.
    The figures are fields so a test can shrink a chip (dataclasses.replace)."""

    tpu_type: str  # catalog name: v4, v5e, v5p, v6e, tpu7x
    topology: str  # e.g. 4x4
    slices: int
    chips_per_slice: int
    hbm_bytes_per_chip: int
    peak_flops_per_chip: float  # bf16
    hbm_bytes_per_s_per_chip: float
    # Chips per host as (x, y, z) for a single-host slice: libtpu assumes a 2x2x1 host otherwise, which a 1x1
    # slice does not divide. None for multi-host slices (libtpu's default host shape).
    host_bounds: tuple[int, int, int] | None = None
    dcn_bits_per_s_per_chip: float | None = None  # between slices; None: the catalog has no figure

    def __post_init__(self) -> None:
        if self.tpu_type not in tpu.GENERATIONS:  # the catalog's per-chip facts are looked up by this name
            raise ValueError(f"Target: {self.tpu_type!r} is not a TPU catalog name; allowed: "
                             f"{', '.join(sorted(tpu.GENERATIONS))}")

    @classmethod
    def of(cls, shape: tpu.SliceShape, slices: int) -> Target:
        """`slices` slices of a catalog shape, every figure from the catalog."""
        gen = shape.generation
        dims = tuple(int(d) for d in shape.topology.split("x"))
        return cls(
            tpu_type=gen.name, topology=shape.topology, slices=slices, chips_per_slice=shape.chips,
            hbm_bytes_per_chip=gen.hbm_gib_per_chip << 30, peak_flops_per_chip=gen.peak_bf16_tflops_per_chip * 1e12,
            hbm_bytes_per_s_per_chip=gen.hbm_gbps_per_chip * 1e9,
            # 1 to 3 dims, padded to 3: a tuple of 3 ints that mypy sees as tuple[int, ...].
            host_bounds=None if shape.multi_host else (*dims, *(1,) * (3 - len(dims))),  # type: ignore[arg-type]
            dcn_bits_per_s_per_chip=None if gen.dcn_gbps_per_chip is None else gen.dcn_gbps_per_chip * 1e9,
        )

    @property
    def generation(self) -> tpu.TpuGeneration:
        return tpu.GENERATIONS[self.tpu_type]

    @property
    def chips(self) -> int:
        return self.slices * self.chips_per_slice

    @property
    def topology_name(self) -> str:
        """libtpu's name for the slice shape, e.g. v6e:4x4."""
        return f"{self.tpu_type}:{self.topology}"

    @property
    def label(self) -> str:
        return f"{self.slices} x {self.tpu_type} {self.topology}"

    @property
    def accelerator_type(self) -> str:
        """A TPU_ACCELERATOR_TYPE value for this slice (libtpu wants one set; it does not change compilation)."""
        return self.generation.accelerator_type(self.chips_per_slice)


@dataclass
class ProgramFit:
    """One program's compiled memory (bytes per device) and its FLOPs / time estimates (one RL step)."""

    name: str
    skipped: str | None = None
    argument: int = 0
    output: int = 0
    alias: int = 0
    temp: int = 0
    code: int = 0
    resident: int = 0
    resident_what: str = ""
    oom_message: str | None = None
    oom_required: int | None = None  # from the compiler's RESOURCE_EXHAUSTED message
    oom_available: int | None = None
    compiler_flops: float = 0.0  # all devices, as XLA reports it (loop bodies once)
    compiler_seconds: float = 0.0  # cost_analysis()["optimal_seconds"], -1 s sentinels removed; <= 0: unknown
    flops: float = 0.0  # analytic, executed, all devices, every loop iteration
    model_flops: float = 0.0
    seconds: float = 0.0  # the estimate described in the module docstring
    lower_bound: float = 0.0  # seconds: the physical floor of the same work (trainer/fit/phases.py); 0: none
    # ref_logprobs, update priced by depth (fit._price_passes): the compiler's optimal_seconds of one run (the
    # update: one micro-batch and the optimizer) at phases.depths unrolled layers, and the runs per step
    depth_seconds: tuple[float, ...] = ()
    runs: int = 1
    below_bound: float = 0.0  # the compiled estimate where it fell below lower_bound (then seconds = the bound)
    compile_seconds: float = 0.0
    reused: bool = False  # the same lowered program was compiled before (fit's CompileCache): figures copied
    # placement split (trainer/fit/split.py): the device group it runs on, "sampler", "trainer" or "both" (the push)
    group: str = ""

    @property
    def compiled(self) -> bool:
        return self.skipped is None and self.oom_message is None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.group})" if self.group else self.name

    @property
    def program_peak(self) -> int:
        if self.oom_required is not None:
            return self.oom_required
        return self.argument + self.output - self.alias + self.temp + self.code

    @property
    def peak(self) -> int:
        return self.program_peak + self.resident


@dataclass
class PhaseFit:
    """One sampler phase compiled on its own (trainer/fit/phases.py): seconds per run and runs per RL step."""

    name: str  # gather, prefill, refill, decode
    runs: int
    seconds: float  # per run, extrapolated to the model's depth; <= 0: the compiler gave no usable time
    depth_seconds: tuple[float, ...]  # the compiler's optimal_seconds at phases.depths layers
    compile_seconds: float = 0.0

    @property
    def total(self) -> float:
        return self.runs * self.seconds


@dataclass
class Suggestion:
    """A setting (or other change) that reduces a program's memory, with its estimated saving."""

    text: str  # "compute.remat=full (now none): keep only each layer's input for the backward pass"
    setting: str | None = None  # "compute.remat=full"; None for advice that is no single setting (more chips)
    saves: int | None = None  # estimated bytes per device saved (trainer/fit/estimate.py); None: no estimate
    estimate_note: str = ""  # what the estimate assumes, or why there is none

    def line(self, unit: str) -> str:
        if self.saves is None:
            return f"{self.text} [no estimate{': ' + self.estimate_note if self.estimate_note else ''}]"
        verb = "saves" if self.saves >= 0 else "costs"
        note = f", {self.estimate_note}" if self.estimate_note else ""
        return f"{self.text} [{verb} ~{size(abs(self.saves))} per {unit}, estimated{note}]"

    def __str__(self) -> str:
        return self.text


@dataclass
class StateFit:
    """The RL trainer's state per device by kind (bytes): the analytic estimate (trainer/fit/estimate.py `state`).
    With lora, `base` is frozen and optimizer, gradients and accumulator are the adapters' alone."""

    base: int
    adapters: int
    optimizer: int
    gradients: int
    accumulator: int
    reference: int
    lora: str | None = None  # "rank 32, 1 slot, q_proj, ..." (None: every weight is trained)
    lora_params: int = 0  # parameters of the adapter stack, every slot

    def line(self, unit: str) -> str:
        extra = (f", gradient accumulator {size(self.accumulator)}" if self.accumulator else "") + (
            f", reference weights {size(self.reference)}" if self.reference else "")
        if self.lora is None:
            return (f"training state per {unit} (estimated): weights {size(self.base)}, optimizer state "
                    f"{size(self.optimizer)}, gradient {size(self.gradients)}{extra}")
        return (f"training state per {unit} (estimated): base weights {size(self.base)} (frozen) + lora adapters "
                f"{size(self.adapters)} ({self.lora}: {_count(self.lora_params)} params); optimizer state "
                f"{size(self.optimizer)}, gradient {size(self.gradients)}{extra}: of the adapters alone")


@dataclass
class ServiceFit:
    """What a service config's report is of (trainer/service/programs.py; the passes: estimate.service_passes)."""

    base_model: str
    slots: int
    rank: int
    max_batch_tokens: int
    min_bucket: int
    data_parallel: int  # rows of a pass are a multiple of this (mesh.slices x mesh.fsdp)
    context: int  # model.max_seq_len: the longest datum the engine accepts
    longest_datum: int  # the longest datum a pass of max_batch_tokens holds
    passes: dict[str, str]  # forward_backward program name -> which pass it is ("longest", "most rows", ...)
    base: int  # bytes per device of the frozen base weights (the programs' arguments)
    stack: int  # bytes per device of one float32 adapter stack
    stack_params: int  # parameters of one stack (every slot, every target)
    base_estimate: int = 0  # the analytic figures (trainer/fit/estimate.py service_state), to compare
    stack_estimate: int = 0

    @property
    def resident(self) -> int:
        return self.base + 4 * self.stack

    def knobs(self) -> str:
        return (f"lora.slots (now {self.slots}), lora.rank (now {self.rank}) or service.max_batch_tokens (now "
                f"{self.max_batch_tokens})")


@dataclass
class SplitFit:
    """placement.mode=split (trainer/fit/split.py): the two groups, the push, the overlap, the colocated layout."""

    lag: int
    lag_correction: str
    trainer_devices: int
    sampler_devices: int
    trainer_ids: list[int]
    sampler_ids: list[int]
    push_bytes: int  # the sampler's copy of the weights, each array once: the trainer's `push_bytes`
    push_bytes_per_device: int  # what each trainer device sends (its shards)
    push_links: str  # "ICI (within a slice)" or "DCN (across slices)"
    push_compiler_seconds: float  # the Bridge's two programs' optimal_seconds
    push_dcn_seconds: float  # across slices: the bytes per chip over DCN (Target.dcn_bits_per_s_per_chip); 0 within
    push_reshard_peak: int  # bytes per device of the reshard on the sampler's devices
    refused: str  # why the trainer refuses this split in a job of several processes; "" where it runs it
    colocated_mesh: dict[str, int]
    colocated_sampler_mesh: dict[str, int]
    colocated_step_seconds: float | None  # None: the colocated layout does not fit (colocated_why)
    colocated_why: str = ""

    def step(self, sampling: float, training: float, push: float) -> float:
        """One step: with lag >= 1 both groups at once, then the push (one program over both groups waits for the
        two); with lag 0 one after the other."""
        return max(sampling, training) + push if self.lag >= 1 else sampling + training + push


@dataclass
class FitReport:
    title: str  # what was fitted: an environment, or a config file
    target: Target
    model: str  # the model and where its shape came from
    params: int
    param_dtype: str
    compute_dtype: str
    mesh: dict[str, int]
    batch: int
    prompt_len: int
    new_tokens: int
    devices: int
    programs: list[ProgramFit]
    suggestions: dict[str, list[Suggestion]] = field(default_factory=dict)
    # libtpu's per-device HBM limit (its compile-time check; fit probes it): below the catalog's HBM, as libtpu
    # keeps part of it (31.25 of the 32 GiB on v6e). None: not known.
    hbm_usable: int | None = None
    state: StateFit | None = None  # the RL trainer's state by kind (estimate)
    service: ServiceFit | None = None  # set: a service engine's report
    phases: list[PhaseFit] = field(default_factory=list)  # the sampler's phases, when compiled on their own
    sample_bounds: dict[str, float] = field(default_factory=dict)  # prefill and decode lower bounds, seconds
    sampler_mesh: dict[str, int] | None = None  # set: the sampler runs on the chips regrouped (sampling.tensor)
    # The layers the programs priced by depth were compiled at (phases.depths; set by preflight.fit, which prices so).
    depths: tuple[int, ...] = ()
    split: SplitFit | None = None  # set: placement split, each program's group in ProgramFit.group

    @property
    def devices_per_chip(self) -> int:
        return max(1, self.devices // self.target.chips)

    @property
    def hbm_per_device(self) -> int:
        return self.target.hbm_bytes_per_chip // self.devices_per_chip

    @property
    def unit(self) -> str:
        return "chip" if self.devices_per_chip == 1 else f"device ({self.devices_per_chip} per chip)"

    @property
    def hbm_limit(self) -> int:
        """What a program must fit in, per device: every share in the report is of this figure."""
        if self.hbm_usable is not None and self.hbm_usable <= self.hbm_per_device:
            return self.hbm_usable
        return self.hbm_per_device

    @property
    def hbm_basis(self) -> str:
        """The limit with where it comes from, e.g. "31.25 GiB usable (libtpu)": the label of every share."""
        if self.hbm_limit == self.hbm_usable:
            return f"{_gib(self.hbm_limit)} usable (libtpu)"
        return f"{_gib(self.hbm_limit)} HBM (catalog)"

    def share(self, p: ProgramFit) -> float:
        return p.peak / self.hbm_limit

    def status(self, p: ProgramFit) -> str:
        if p.skipped is not None:
            return "not compiled" if p.skipped == BUDGET_SPENT else "skipped"
        if p.oom_message is not None or p.peak > self.hbm_limit:
            return "does not fit"
        return "tight" if p.peak > WARN_FRACTION * self.hbm_limit else "fits"

    @property
    def failures(self) -> list[ProgramFit]:
        return [p for p in self.programs if self.status(p) == "does not fit"]

    @property
    def fits(self) -> bool:
        """Every program compiled (or skipped by the config) and fits."""
        return not self.failures and all(self.status(p) != "not compiled" for p in self.programs)

    def program(self, name: str) -> ProgramFit:
        return next(p for p in self.programs if p.name == name)

    def not_applicable(self) -> str | None:
        """Why the step has no time or MFU (None: it has): an estimate for a config that cannot run would read
        as achievable."""
        if self.failures:
            return f"{', '.join(p.name for p in self.failures)} does not fit"
        missing = [p.name for p in self.programs if self.status(p) == "not compiled"]
        return f"{', '.join(missing)} not compiled" if missing else None

    def group_seconds(self, group: str, bound: bool = False) -> float:
        return sum(p.lower_bound if bound else p.seconds for p in self.programs if p.skipped is None
                   and p.group == group)

    def _step(self, bound: bool) -> float:
        if self.split is None:
            return self.group_seconds("", bound)
        return self.split.step(*(self.group_seconds(g, bound) for g in ("sampler", "trainer", "both")))

    @property
    def step_seconds(self) -> float:
        return self._step(False)

    @property
    def step_lower_bound(self) -> float:
        return self._step(True)

    @property
    def throughput_ratio(self) -> float | None:
        """Split: the colocated layout's step time on the same chips / this one's (None: either cannot run)."""
        sp = self.split
        if sp is None or sp.colocated_step_seconds is None or self.not_applicable() or self.step_seconds <= 0:
            return None
        return sp.colocated_step_seconds / self.step_seconds

    def split_lines(self) -> list[str]:
        """placement split: the groups, the push, the overlap and the ratio to colocated ([] when colocated)."""
        sp = self.split
        if sp is None:
            return []
        axes = " x ".join(f"{k}={v}" for k, v in (self.sampler_mesh or {}).items())
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        s, t, push = (self.group_seconds(g) for g in ("sampler", "trainer", "both"))
        trainer = " + ".join(f"{p.name} {_secs(p.seconds)}" for p in self.programs
                             if p.group == "trainer" and p.skipped is None)
        bps = self.target.dcn_bits_per_s_per_chip
        dcn = (f", its bytes per chip over DCN at {bps / 1e9:g} Gbit/s per chip {_secs(sp.push_dcn_seconds)}"
               if sp.push_dcn_seconds and bps else ", no DCN figure for this generation in the TPU catalog: the "
               "compiler's alone" if sp.push_links.startswith("DCN") else "")
        how = ("max(sampling, trainer) + push: both groups at once (rl.lag >= 1); the push, one program over both "
               "groups, waits for the two" if sp.lag >= 1 else "sampling + trainer + push: one after the other "
               "(rl.lag 0)")
        lines = [
            f"split placement: the update on {sp.trainer_devices} devices ({mesh}), sampling on "
            f"{sp.sampler_devices} ({axes}), disjoint; rl.lag {sp.lag}, rl.lag_correction {sp.lag_correction}",
            f"per group: sampling {_secs(s)}; trainer {_secs(t)} ({trainer})",
            f"push: {size(sp.push_bytes)} per step (push_bytes), {size(sp.push_bytes_per_device)} per trainer device "
            f"over {sp.push_links}: the compiled Bridge {_secs(sp.push_compiler_seconds)}{dcn} -> {_secs(push)}",
        ]
        why = self.not_applicable()
        if why is not None:
            lines.append(f"step: — (not applicable: {why})")
        else:
            lines.append(f"step: {_secs(self.step_seconds)} = {how}")
        col = (" x ".join(f"{k}={v}" for k, v in sp.colocated_mesh.items())
               + (", sampling on " + " x ".join(f"{k}={v}" for k, v in sp.colocated_sampler_mesh.items())
                  if sp.colocated_sampler_mesh != sp.colocated_mesh else ""))
        ratio = self.throughput_ratio
        if sp.colocated_step_seconds is None:
            lines.append(f"colocated on the same {self.target.chips} chips ({col}, rl.lag 0): does not run "
                         f"({sp.colocated_why})")
        else:
            lines.append(f"colocated on the same {self.target.chips} chips ({col}, rl.lag 0): step "
                         f"{_secs(sp.colocated_step_seconds)}" + (f"; split throughput {ratio:.2f}x colocated"
                                                                   if ratio is not None else ""))
        if sp.refused:
            lines.append(f"note: {sp.refused}")
        return lines

    @property
    def bound_ratio(self) -> float | None:
        """Estimated step time / its lower bound: how far the programs are from the hardware (1 = at the floor)."""
        return self.step_seconds / self.step_lower_bound if self.step_lower_bound > 0 else None

    @property
    def model_flops(self) -> float:
        return sum(p.model_flops for p in self.programs if p.skipped is None)

    @property
    def mfu(self) -> float:
        peak = self.target.chips * self.target.peak_flops_per_chip * self.step_seconds
        return self.model_flops / peak if peak > 0 else 0.0

    # ------------------------------------------------------------------ rendering

    def headline(self) -> list[str]:
        t = self.target
        usable = f" ({self.hbm_basis} per {self.unit.split()[0]})" if self.hbm_limit == self.hbm_usable else ""
        per = self.unit.split()[0]
        mesh = "mesh " + " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        if self.sampler_mesh:
            mesh += " (sampling on " + " x ".join(f"{k}={v}" for k, v in self.sampler_mesh.items()) + ")"
        lines = [
            f"{t.label}: {t.chips} chips, {_gib(t.hbm_bytes_per_chip)} HBM{usable} and "
            f"{t.peak_flops_per_chip / 1e12:g} TFLOP/s bf16 per chip",
            f"model: {self.model}, {_count(self.params)} params, weights {self.param_dtype}, "
            f"compute {self.compute_dtype}",
        ]
        sv = self.service
        if sv is None:
            lines.append(f"step: {self.batch} sequences x ({self.prompt_len} prompt + {self.new_tokens} new) tokens; "
                         + mesh)
            if self.state is not None:
                lines.append(self.state.line(per))
            return lines
        passes = ", ".join(f"{name.split()[-1]} ({kind})" for name, kind in sv.passes.items())
        lines += [
            f"service {sv.base_model}: {sv.slots} adapter slots of rank <= {sv.rank} on every target (lm_head too), "
            f"float32; forward_backward passes of <= {sv.max_batch_tokens} tokens (rows x length): {passes}; "
            f"the longest datum a pass holds: {sv.longest_datum} tokens; {mesh}",
            f"resident per {per}: base weights {size(sv.base)} + adapter stack {size(sv.stack)} x 4 (weights, Adam m, "
            f"Adam v, gradient accumulator; {_count(sv.stack_params)} params each) = {size(sv.resident)}",
        ]
        return lines

    def rows(self) -> list[list[str]]:
        out = []
        width = len(self.headers())
        for p in self.programs:
            if p.skipped is not None:
                note = p.skipped if p.skipped == BUDGET_SPENT else f"skipped: {p.skipped}"
                out.append([p.label, *["-"] * (width - 2), note])
                continue
            status = self.status(p)
            # No time for a program that cannot run: it would read as achievable.
            secs = ["—" if status == "does not fit" else _secs(p.seconds)]
            if self.service is None:
                secs.append(_bound(p, status))
            if p.oom_message is not None:
                out.append([p.label, "-", "-", "-", "-", _gib(p.resident), _gib(p.peak),
                            f"{self.share(p):.0%}", f"{p.flops:.3g}", *secs,
                            f"{status} (compiler: {_gib(p.oom_required or 0)} needed, "
                            f"{_gib(p.oom_available or 0)} available)"])
                continue
            out.append([p.label, _gib(p.argument), _gib(p.temp), _gib(p.output), _gib(p.alias), _gib(p.resident),
                        _gib(p.peak), f"{self.share(p):.0%}", f"{p.flops:.3g}", *secs, status])
        return out

    def headers(self) -> tuple[str, ...]:
        bound = ("lower bound (est. / bound)",) if self.service is None else ()
        return ("program", "arguments", "temporaries", "outputs", "aliased", "resident", "peak",
                f"of {self.hbm_basis}", "FLOPs", "est. time", *bound, "status")

    def summary_line(self) -> str:
        t = self.target
        why = self.not_applicable()
        if self.service is not None:
            verdict = (f"the service fits {t.label}" if self.fits else f"the service does not fit {t.label}")
            if why is not None:
                return f"{verdict}; est. time — (not applicable: {why})"
            parts = []
            for p in self.programs:
                if p.name.startswith("forward_backward"):
                    tokens = int(p.name.split()[-1].split("x")[0]) * int(p.name.split()[-1].split("x")[1])
                    mfu = p.model_flops / (t.chips * t.peak_flops_per_chip * p.seconds) if p.seconds > 0 else 0.0
                    parts.append(f"{p.name}: {tokens} tokens in ~{_secs(p.seconds)} (MFU ~{mfu:.1%})")
                else:
                    parts.append(f"{p.name}: ~{_secs(p.seconds)}")
            worst = max((self.share(p) for p in self.programs if p.skipped is None), default=0.0)
            return f"{verdict} (peak {worst:.0%} of the limit); estimated: " + "; ".join(parts)
        if why is not None:
            return (f"one RL step: {self.model_flops:.3g} model FLOPs; est. time — and MFU — (not applicable: {why}; "
                    "no estimate for a configuration that cannot run)")
        ratio = self.bound_ratio
        bound = (f"; lower bound {_secs(self.step_lower_bound)}, estimate / bound = {ratio:.2f}x"
                 if ratio is not None else "")
        return (f"one RL step: {self.model_flops:.3g} model FLOPs in ~{_secs(self.step_seconds)} (estimated) = "
                f"MFU ~{self.mfu:.1%} of {t.chips} chips x {t.peak_flops_per_chip / 1e12:g} TFLOP/s{bound}")

    def notes(self) -> list[str]:
        hbm = _gib(self.target.hbm_bytes_per_chip)
        if self.hbm_limit == self.hbm_usable:
            basis = (f"Every share is of the {self.hbm_basis} per {self.unit.split()[0]}: the limit libtpu's "
                     f"compiler enforces for this target (probed), below the chip's nominal {hbm} as libtpu keeps "
                     "part of it; a program beyond it fails to compile and its figure is the compiler's.")
        else:
            basis = (f"Every share is of the {self.hbm_basis} per {self.unit.split()[0]}: the TPU catalog's figure "
                     "(libtpu's own usable limit was not known or is larger).")
        if self.service is not None:
            return [*self._service_notes(basis), *self._resident_notes()]
        notes = [
            f"Memory is per {self.unit}: peak = arguments + outputs - aliased + temporaries + code + resident "
            "(state the loop keeps in HBM outside the program). " + basis,
            "FLOPs are analytic, every loop iteration counted (XLA's cost analysis counts each loop body once: "
            "compiler figures " + ", ".join(
                f"{p.name} {p.compiler_flops:.3g} FLOPs / "
                + (_secs(p.compiler_seconds) if p.compiler_seconds > 0 else "no usable time")
                for p in self.programs if p.compiled) + "). "
            "est. time: " + self._passes_note() + self._sample_note()
            + " Estimates, not measurements.",
            "Lower bounds (trainer/fit/phases.py): prefill, ref_logprobs and update at their model FLOPs over peak; "
            "each decode step at the bytes a chip must read (its share of the compute-dtype weights and its rows' "
            "live KV cache) over HBM bandwidth" + (
                f" (sample: prefill {_secs(self.sample_bounds['prefill'])}, decode "
                f"{_secs(self.sample_bounds['decode'])})" if self.sample_bounds else "") + ".",
            "Savings next to a suggestion are estimates (trainer/fit/estimate.py): the tensors the setting scales, "
            "calibrated on this compile; `fit --search` compiles to check.",
        ]
        for p in self.programs:
            if p.below_bound:
                notes.append(f"{p.name}: the compiled estimate, {_secs(p.below_bound)}, is below the physical floor, "
                             f"so the floor ({_secs(p.lower_bound)}) is used: the compiler's cost model counts "
                             "fewer bytes than the weights each chip must read.")
        return [*notes, *self._resident_notes()]

    @property
    def _depths(self) -> str:
        return " and ".join(map(str, self.depths)) or "two depths of"

    def _passes_note(self) -> str:
        by_depth = [f"{p.name} {p.runs} x {_secs(p.seconds / p.runs)}" for p in self.programs
                    if p.compiled and p.depth_seconds]
        scaled = [p.name for p in self.programs
                  if p.compiled and p.name not in ("sample", "push") and not p.depth_seconds]
        out = ""
        if by_depth:
            out += (f"compiled again with their layers unrolled at {self._depths} layers and "
                    "extrapolated to the model's "
                    "depth (the update one micro-batch per run, the optimizer once per minibatch; the log-prob chunk "
                    "loops at their trip counts): "
                    + ", ".join(by_depth) + "; ")
        if scaled:
            out += (" and ".join(scaled) + " scale the compiler's optimal_seconds to every iteration (at peak FLOP/s "
                    "where the compiler gave no usable time: optimistic); ")
        return out

    def _sample_note(self) -> str:
        if not self.phases:
            return ("sample is prefill + max_new_tokens decode steps on a FLOPs / HBM-bandwidth roofline (its phases "
                    "were not compiled on their own).")
        parts = [f"{ph.name} {ph.runs} x {_secs(ph.seconds)}" for ph in self.phases if ph.runs]
        return (f"sample is each of its phases compiled on its own (layers unrolled, at {self._depths} layers, "
                "extrapolated to the model's depth) times the runs of a step whose every "
                "row generates max_new_tokens: "
                + " + ".join(parts) + ".")

    def _resident_notes(self) -> list[str]:
        notes = []
        reused = [p.name for p in self.programs if p.reused]
        if reused:
            notes.append(f"{', '.join(reused)}: the same program was compiled earlier in this run; its figures are "
                         "reused.")
        for p in self.programs:
            if p.resident:
                notes.append(f"{p.name} resident: {p.resident_what}.")
        return notes

    def _service_notes(self, basis: str) -> list[str]:
        sv = self.service
        assert sv is not None
        return [
            f"Memory is per {self.unit}: peak = arguments + outputs - aliased + temporaries + code + resident (the "
            "engine's state outside the program: Adam's moments during a pass, the base weights during optim_step). "
            + basis,
            f"forward_backward is compiled at the engine's largest pass of the longest datum a pass of "
            f"service.max_batch_tokens holds ({sv.data_parallel} rows, one per data-parallel device, padding rows "
            f"included) and of the shortest bucket (service.min_bucket = {sv.min_bucket}, as many rows as "
            "max_batch_tokens takes): attention peaks at the one, the log-prob logits at the other (see "
            "trainer/fit/estimate.py service_passes). Sampling (service.sample_max_sequences, max_tokens per request) "
            "is not sized: its shapes are each request's.",
            "est. time: forward_backward scales the compiler's optimal_seconds to every layer and log-prob chunk (at "
            "peak FLOP/s where the compiler gave no usable time); optim_step is the larger of the compiler's time and "
            "reading and writing the four adapter stacks at HBM bandwidth. FLOPs: analytic (the adapters for every "
            "slot, no gradient of the frozen base); MFU counts the row's own slot, causal attention, no remat. "
            f"Estimates, not measurements (analytic state: base {size(sv.base_estimate)}, stack "
            f"{size(sv.stack_estimate)} per {self.unit.split()[0]}).",
        ]

    def warnings(self) -> list[str]:
        out = []
        per = self.unit.split()[0]
        for p in self.programs:
            if self.status(p) == "tight":
                out.append(f"{p.name} uses {self.share(p):.0%} of the {self.hbm_basis} per {per} ({_gib(p.peak)}): "
                           "it fits, with little room for fragmentation. To reduce it: "
                           + "; ".join(s.line(per) for s in self.suggestions.get(p.name, [])[:3]))
        sv = self.service
        if sv is not None and sv.context > sv.longest_datum:
            out.append(f"the model's context is {sv.context} tokens, but a forward_backward pass of "
                       f"service.max_batch_tokens = {sv.max_batch_tokens} holds a datum of at most {sv.longest_datum} "
                       f"({sv.data_parallel} data-parallel rows of it): longer datums are not sized here, so the "
                       "engine must refuse them; raise service.max_batch_tokens to size longer ones")
        return out

    def errors(self) -> list[str]:
        out = []
        per = self.unit.split()[0]
        if self.service is not None and self.failures:
            out.append(f"the service does not fit {self.target.label}: reduce {self.service.knobs()}, or use more "
                       "chips")
        for p in self.failures:
            libtpu = p.oom_available is not None and p.oom_available != self.hbm_limit
            # libtpu: oom_available is not None.
            avail = f"{_gib(p.oom_available)} available (libtpu)" if libtpu else self.hbm_basis  # type: ignore[arg-type]
            src = "the compiler ran out of HBM" if p.oom_message is not None else "peak exceeds it"
            unparsed = p.oom_message is not None and p.oom_required is None
            need = f"more than {_gib(p.oom_available or self.hbm_limit)}" if unparsed else _gib(p.peak)
            out.append(f"{p.name} does not fit: needs {need} per {per}, {avail} ({src}"
                       + (f", including {_gib(p.resident)} resident: {p.resident_what}" if p.resident else "")
                       + ")")
            for s in self.suggestions.get(p.name, []):
                out.append(f"  - {s.line(per)}")
        return out

    def text(self) -> str:
        """Plain text (the CLI renders the same content with rich)."""
        lines = [f"fit: {self.title}", *self.headline(), ""]
        lines += _plain_table(self.headers(), self.rows())
        lines += ["", self.summary_line(), *self.split_lines()]
        lines += [f"warning: {w}" for w in self.warnings()]
        lines += [f"error: {e}" if not e.startswith("  ") else e for e in self.errors()]
        lines += ["", *self.notes()]
        return "\n".join(lines) + "\n"

    def markdown(self, heading: str = "###") -> str:
        lines = [f"{heading} gke-tpu-rl fit: {self.title}", ""]
        lines += [f"- {h}" for h in self.headline()]
        headers = self.headers()
        lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self.rows()]
        lines += ["", f"**{self.summary_line()}**", ""]
        if self.split is not None:
            lines += [f"- {line}" for line in self.split_lines()] + [""]
        lines += [f"> **Warning:** {w}" for w in self.warnings()]
        errs = self.errors()
        if errs:
            lines += ["**Does not fit:**", ""] + [f"- {e}" if not e.startswith("  ") else f"  {e}" for e in errs]
            lines.append("")
        lines += ["<details><summary>How these figures are made</summary>", ""]
        lines += [f"- {n}" for n in self.notes()]
        lines += ["", "</details>", ""]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        why = self.not_applicable()
        programs = []
        for p in self.programs:
            doc = asdict(p) | {"peak": p.peak, "status": self.status(p), "share": self.share(p)}
            if self.status(p) == "does not fit":
                doc["seconds"] = None  # no time for a program that cannot run
            programs.append(doc)
        return {
            "title": self.title, "fits": self.fits, "target": asdict(self.target) | {"chips": self.target.chips},
            "model": self.model, "params": self.params, "param_dtype": self.param_dtype,
            "compute_dtype": self.compute_dtype, "mesh": self.mesh, "batch": self.batch,
            "prompt_len": self.prompt_len, "new_tokens": self.new_tokens, "devices": self.devices,
            "hbm_per_device": self.hbm_per_device, "hbm_usable": self.hbm_usable, "hbm_limit": self.hbm_limit,
            "share_of": f"{self.hbm_basis} per {self.unit.split()[0]}",
            "programs": programs,
            # A service has no step: each program's own time and FLOPs are in `programs`.
            "step_seconds": None if why or self.service else self.step_seconds, "model_flops": self.model_flops,
            "step_lower_bound": None if why or self.service else self.step_lower_bound,
            "bound_ratio": None if why or self.service else self.bound_ratio,
            "phases": [asdict(ph) | {"total": ph.total} for ph in self.phases], "sample_bounds": self.sample_bounds,
            "sampler_mesh": self.sampler_mesh, "depths": list(self.depths),
            "mfu": None if why or self.service else self.mfu, "not_applicable": why,
            "suggestions": {k: [asdict(s) | {"saves_is": "estimate" if s.saves is not None else None} for s in v]
                            for k, v in self.suggestions.items()},
            "warnings": self.warnings(), "errors": self.errors(),
            "state": asdict(self.state) if self.state is not None else None,
            "service": (asdict(self.service) | {"resident": self.service.resident})
            if self.service is not None else None,
            "split": None if self.split is None else asdict(self.split) | {
                "sampling_seconds": self.group_seconds("sampler"), "trainer_seconds": self.group_seconds("trainer"),
                "push_seconds": self.group_seconds("both"), "throughput_ratio": self.throughput_ratio},
        }

    def json(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"


def _bound(p: ProgramFit, status: str) -> str:
    if p.lower_bound <= 0 or status == "does not fit":
        return "—"
    return f"{_secs(p.lower_bound)} ({p.seconds / p.lower_bound:.1f}x)"


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def size(n: float) -> str:
    """GiB as the report writes them, MiB below a tenth of one (an estimated saving of a small model)."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _secs(s: float) -> str:
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.1f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def _plain_table(headers: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*headers).rstrip(), *(fmt.format(*r).rstrip() for r in rows)]
