"""What `gke-tpu-rl fit` reports: the compile target, each program's memory and time, and their rendering (text,
markdown for a PR comment, JSON). How the figures are made: trainer/fit.py."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

GiB = 1 << 30
WARN_FRACTION = 0.9  # above this share of HBM a program fits, with a warning


@dataclass(frozen=True)
class Target:
    """The TPU to compile for. The caller fills it from its TPU catalog (the CLI: infra/tpu.py)."""

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
        name = {"v5e": "v5litepod"}.get(self.tpu_type, self.tpu_type)
        cores = self.chips_per_slice * (2 if self.tpu_type in ("v4", "v5p", "tpu7x") else 1)
        return f"{name}-{cores}"


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
    compile_seconds: float = 0.0

    @property
    def compiled(self) -> bool:
        return self.skipped is None and self.oom_message is None

    @property
    def program_peak(self) -> int:
        if self.oom_required is not None:
            return self.oom_required
        return self.argument + self.output - self.alias + self.temp + self.code

    @property
    def peak(self) -> int:
        return self.program_peak + self.resident


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
    suggestions: dict[str, list[str]] = field(default_factory=dict)

    @property
    def devices_per_chip(self) -> int:
        return max(1, self.devices // self.target.chips)

    @property
    def hbm_per_device(self) -> int:
        return self.target.hbm_bytes_per_chip // self.devices_per_chip

    @property
    def unit(self) -> str:
        return "chip" if self.devices_per_chip == 1 else f"device ({self.devices_per_chip} per chip)"

    def status(self, p: ProgramFit) -> str:
        if p.skipped is not None:
            return "skipped"
        if p.oom_message is not None or p.peak > self.hbm_per_device:
            return "does not fit"
        return "tight" if p.peak > WARN_FRACTION * self.hbm_per_device else "fits"

    @property
    def failures(self) -> list[ProgramFit]:
        return [p for p in self.programs if self.status(p) == "does not fit"]

    @property
    def fits(self) -> bool:
        return not self.failures

    @property
    def step_seconds(self) -> float:
        return sum(p.seconds for p in self.programs if p.skipped is None)

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
        return [
            f"{t.label}: {t.chips} chips, {_gib(t.hbm_bytes_per_chip)} HBM and {t.peak_flops_per_chip / 1e12:g} "
            f"TFLOP/s bf16 per chip",
            f"model: {self.model}, {_count(self.params)} params, weights {self.param_dtype}, "
            f"compute {self.compute_dtype}",
            f"step: {self.batch} sequences x ({self.prompt_len} prompt + {self.new_tokens} new) tokens; mesh "
            + " x ".join(f"{k}={v}" for k, v in self.mesh.items()),
        ]

    def rows(self) -> list[list[str]]:
        out = []
        for p in self.programs:
            if p.skipped is not None:
                out.append([p.name, *["-"] * (len(self.HEADERS) - 2), f"skipped: {p.skipped}"])
                continue
            status = self.status(p)
            if p.oom_message is not None:
                out.append([p.name, "-", "-", "-", "-", _gib(p.resident), _gib(p.peak),
                            f"{p.peak / self.hbm_per_device:.0%}", f"{p.flops:.3g}", f"{_secs(p.seconds)}",
                            f"{status} (compiler: {_gib(p.oom_required or 0)} needed, "
                            f"{_gib(p.oom_available or 0)} available)"])
                continue
            out.append([p.name, _gib(p.argument), _gib(p.temp), _gib(p.output), _gib(p.alias), _gib(p.resident),
                        _gib(p.peak), f"{p.peak / self.hbm_per_device:.0%}", f"{p.flops:.3g}",
                        _secs(p.seconds), status])
        return out

    HEADERS = ("program", "arguments", "temporaries", "outputs", "aliased", "resident", "peak", "of HBM",
               "FLOPs", "est. time", "status")

    def summary_line(self) -> str:
        t = self.target
        return (f"one RL step: {self.model_flops:.3g} model FLOPs in ~{_secs(self.step_seconds)} (estimated) = "
                f"MFU ~{self.mfu:.1%} of {t.chips} chips x {t.peak_flops_per_chip / 1e12:g} TFLOP/s")

    def notes(self) -> list[str]:
        hbm = _gib(self.target.hbm_bytes_per_chip)
        notes = [
            f"Memory is per {self.unit}: peak = arguments + outputs - aliased + temporaries + code + resident "
            "(state the loop keeps in HBM outside the program). "
            f"HBM is the catalog's {hbm} per chip; libtpu keeps part of it for itself (on v6e it offers 31.25 of "
            "the 32 GiB), so a program beyond that fails to compile and its figure is the compiler's.",
            "FLOPs are analytic, every loop iteration counted (XLA's cost analysis counts each loop body once: "
            "compiler figures " + ", ".join(
                f"{p.name} {p.compiler_flops:.3g} FLOPs / "
                + (_secs(p.compiler_seconds) if p.compiler_seconds > 0 else "no usable time")
                for p in self.programs if p.compiled) + "). "
            "est. time: ref_logprobs and update scale the compiler's optimal_seconds to every iteration (at peak "
            "FLOP/s where the compiler gave no usable time: optimistic); sample is prefill + max_new_tokens decode "
            "steps on a FLOPs / HBM-bandwidth roofline (decode is bandwidth-bound). Estimates, not measurements.",
        ]
        for p in self.programs:
            if p.resident:
                notes.append(f"{p.name} resident: {p.resident_what}.")
        return notes

    def warnings(self) -> list[str]:
        out = []
        for p in self.programs:
            if self.status(p) == "tight":
                out.append(f"{p.name} uses {p.peak / self.hbm_per_device:.0%} of HBM per {self.unit.split()[0]} "
                           f"({_gib(p.peak)} of {_gib(self.hbm_per_device)}): it fits, with little room for "
                           "fragmentation. To reduce it: " + "; ".join(self.suggestions.get(p.name, [])[:3]))
        return out

    def errors(self) -> list[str]:
        out = []
        for p in self.failures:
            avail = p.oom_available if p.oom_available is not None else self.hbm_per_device
            src = "the compiler ran out of HBM" if p.oom_message is not None else "peak exceeds HBM"
            unparsed = p.oom_message is not None and p.oom_required is None
            need = f"more than {_gib(avail)}" if unparsed else _gib(p.peak)
            out.append(f"{p.name} does not fit: needs {need} per {self.unit.split()[0]}, "
                       f"{_gib(avail)} available ({src}"
                       + (f", including {_gib(p.resident)} resident: {p.resident_what}" if p.resident else "")
                       + ")")
            for s in self.suggestions.get(p.name, []):
                out.append(f"  - {s}")
        return out

    def text(self) -> str:
        """Plain text (the CLI renders the same content with rich)."""
        lines = [f"fit: {self.title}", *self.headline(), ""]
        lines += _plain_table(self.HEADERS, self.rows())
        lines += ["", self.summary_line()]
        lines += [f"warning: {w}" for w in self.warnings()]
        lines += [f"error: {e}" if not e.startswith("  ") else e for e in self.errors()]
        lines += ["", *self.notes()]
        return "\n".join(lines) + "\n"

    def markdown(self, heading: str = "###") -> str:
        lines = [f"{heading} gke-tpu-rl fit: {self.title}", ""]
        lines += [f"- {h}" for h in self.headline()]
        lines += ["", "| " + " | ".join(self.HEADERS) + " |", "|" + "---|" * len(self.HEADERS)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self.rows()]
        lines += ["", f"**{self.summary_line()}**", ""]
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
        return {
            "title": self.title, "fits": self.fits, "target": asdict(self.target) | {"chips": self.target.chips},
            "model": self.model, "params": self.params, "param_dtype": self.param_dtype,
            "compute_dtype": self.compute_dtype, "mesh": self.mesh, "batch": self.batch,
            "prompt_len": self.prompt_len, "new_tokens": self.new_tokens, "devices": self.devices,
            "hbm_per_device": self.hbm_per_device,
            "programs": [asdict(p) | {"peak": p.peak, "status": self.status(p)} for p in self.programs],
            "step_seconds": self.step_seconds, "model_flops": self.model_flops, "mfu": self.mfu,
            "suggestions": self.suggestions, "warnings": self.warnings(), "errors": self.errors(),
        }

    def json(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


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
