"""Preflight: compile the trainer's own jitted programs for a real TPU slice on this (CPU) machine, before
anyone pays for the slice.

`fit(cfg, target)` builds the very programs the RL loop runs (`trainer.step.build_programs`) on the devices of
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
  - ref_logprobs, update: the compiler's `optimal_seconds` x (analytic FLOPs / compiler FLOPs), i.e. the
    compiler's own throughput for the program's loop bodies applied to all their iterations. libtpu 0.0.42.1 prices
    each `ConcatBitcast`, `SliceId` (multislice) and `ZeroCrop` custom call at -1 s, which makes `optimal_seconds`
    negative for realistic programs: those are added back; should it stay <= 0, the estimate falls back to peak
    FLOP/s (optimistic) and says so;
  - sample: per chunk of sampling.max_num_sequences, prefill + max_new_tokens decode steps, each a roofline
    max(FLOPs / peak, HBM bytes / bandwidth) with HBM bytes = the weights + the KV cache. A decode step reads
    every weight for one token per row: it is bandwidth-bound, which no scaling of a once-counted body shows.
    Every row is assumed to run to max_new_tokens; collectives and imperfect overlap are not modelled, so
    this is a lower bound on time.
- MFU: model FLOPs of one RL step (generating B x max_new_tokens tokens, reference log-probs when
  rl.kl_beta > 0, mu_iterations forward + backward passes; causal attention, no remat) over
  chips x peak bf16 FLOP/s x the summed estimated time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer import presets
from trainer.config import ConfigError, ModelConfig, TrainConfig, resolve_mesh, with_model

GiB = 1 << 30
WARN_FRACTION = 0.9  # above this share of HBM a program fits, with a warning
PROGRAMS = ("sample", "ref_logprobs", "update")
# Custom calls libtpu's cost model prices at -1 s each in optimal_seconds (libtpu 0.0.42.1: the negative part of
# every optimal_seconds seen, from 0.6B to 70B programs on 1 to 4 slices, is exactly the count of these).
_MINUS_ONE_SECOND_OPS = tuple(f'custom_call_target="{op}"' for op in ("ConcatBitcast", "SliceId", "ZeroCrop"))
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


class FitError(ConfigError):
    """The inputs cannot be compiled for the target (bad topology, mesh vs devices); the message says which."""


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


# ---------------------------------------------------------------------------------------------- the model


def _hf_dtype(hf: dict[str, Any]) -> str:
    # The dtype a checkpoint with this config.json stores; import_hf keeps bf16 checkpoints in bf16.
    return "bfloat16" if str(hf.get("torch_dtype") or hf.get("dtype")) == "bfloat16" else "float32"


def _from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    from trainer.hf import model_config_from_hf

    try:
        return model_config_from_hf(hf, _hf_dtype(hf))
    except (ValueError, KeyError) as err:
        raise ConfigError(f"{where}: {err.args[0] if err.args else err}") from None


def resolve_model(cfg: TrainConfig, name: str | None = None) -> tuple[TrainConfig, str]:
    """The config with its model attached, and where the model came from.

    In order: `name` (a bundled preset, `--model`); the config's `model:`; for `init: {from: hf}`, the local
    init.path/config.json; a bundled preset named like init.path's last component.
    """
    if name is not None:
        found = presets.find(name)
        if found is None:
            raise ConfigError(f"--model {name!r}: not a bundled model; choose one of: {', '.join(presets.names())}")
        model = _from_hf(presets.hf_config(found), f"bundled {found}")
        return with_model(cfg, model), f"{found} (bundled config.json)"
    if cfg.model is not None:
        return cfg, "the config's model section"
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


# ---------------------------------------------------------------------------------------------- FLOPs


def _fwd_flops(m: ModelConfig, tokens: float, pairs: float, logit_rows: float) -> float:
    """Matmul FLOPs of one forward pass of one row: `tokens` through every layer, `pairs` (query, key) pairs of
    attention per layer, `logit_rows` positions through the output head."""
    per_layer = m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim + m.n_heads * m.head_dim * m.d_model
    per_layer += 3 * m.d_model * m.d_ff
    attn = 4 * m.n_heads * m.head_dim  # QK^T and PV, 2 FLOPs per multiply-add
    return m.n_layers * (2 * per_layer * tokens + attn * pairs) + 2 * m.d_model * m.vocab_size * logit_rows


def param_count(m: ModelConfig) -> int:
    import jax

    from trainer.model import param_shapes

    return sum(math.prod(s) for s in jax.tree.leaves(param_shapes(m), is_leaf=lambda x: isinstance(x, tuple)))


@dataclass(frozen=True)
class StepFlops:
    """Per RL step, all devices: executed FLOPs per program, model FLOPs per program, sampler phases per row."""

    executed: dict[str, float]
    model: dict[str, float]
    prefill_row: float  # executed, one row
    decode_row: float  # executed, one row, one decode step


def step_flops(cfg: TrainConfig) -> StepFlops:
    m, B, P, N = cfg.model_cfg, cfg.batch_size, cfg.prompt_len, cfg.sampling.max_new_tokens
    T, S = P + N, P + N
    chunk = min(cfg.compute.logprob_chunk, N)
    n_head = -(-N // chunk) * chunk  # log-prob chunks are padded to whole chunks
    causal = T * (T + 1) / 2
    # The sampler: prefill writes the prompt into an S-slot cache and attends over all S slots (masked), each
    # decode step runs one token per row against the S slots.
    prefill = _fwd_flops(m, P, P * S, 1)
    decode = _fwd_flops(m, 1, S, 1)
    fwd = _fwd_flops(m, T, T * T, n_head)  # completion_logprobs: full [T, T] attention, padded head chunks
    head = 2 * m.d_model * m.vocab_size * n_head
    attn = 4 * m.n_heads * m.head_dim * m.n_layers * T * T
    remat = {"none": 0.0, "full": fwd - head, "dots": attn}[cfg.compute.remat]
    # Backward = 2x forward; the head chunks are recomputed in the backward (jax.checkpoint), layers per remat.
    train_pass = 3 * fwd + head + remat
    model_fwd = _fwd_flops(m, T, causal, N)
    executed = {"sample": B * (prefill + N * decode), "ref_logprobs": B * fwd,
                "update": B * cfg.rl.mu_iterations * train_pass}
    model = {"sample": B * model_fwd, "ref_logprobs": B * model_fwd,
             "update": B * cfg.rl.mu_iterations * 3 * model_fwd}
    return StepFlops(executed, model, prefill, decode)


# ---------------------------------------------------------------------------------------------- compile


_OOM_PATTERNS = (
    # "Used 35.2G of 31.25G hbm." / "... required for HLO temporaries (33.56G) exceeds available HBM (31.25G)"
    re.compile(r"Used\s+([\d.]+)\s*([KMGTP]?)i?B?\s+of\s+([\d.]+)\s*([KMGTP]?)i?B?\s+hbm", re.I),
    re.compile(r"\(([\d.]+)\s*([KMGTP]?)i?B?\)\s*exceeds available HBM\s*\(([\d.]+)\s*([KMGTP]?)i?B?\)", re.I),
)


def parse_oom(message: str) -> tuple[int, int] | None:
    """(bytes required, bytes available) from libtpu's RESOURCE_EXHAUSTED message, if it states them."""
    for pat in _OOM_PATTERNS:
        m = pat.search(message)
        if m:
            need = float(m.group(1)) * _UNITS[m.group(2).upper()]
            have = float(m.group(3)) * _UNITS[m.group(4).upper()]
            return int(need), int(have)
    return None


def _tree_bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs carrying NamedShardings."""
    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return total


def prepare_environment(target: Target) -> None:
    """Compile for TPU from a CPU-only process: JAX on CPU, libtpu told what it would otherwise look up.

    Without TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES libtpu prints "could not determine TPU accelerator type"
    and worker-hostname errors on a machine without TPUs; they do not change the compilation (checked: the same
    memory and cost figures with any value), so set them for this process only where the caller has not. Real
    errors (a topology libtpu refuses, RESOURCE_EXHAUSTED) still surface. Call before anything initialises a JAX
    backend.
    """
    import jax

    os.environ.setdefault("TPU_ACCELERATOR_TYPE", target.accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu takes /tmp/libtpu_lockfile when it loads, so a second fit (or a fit beside a TPU job) would abort with
    # "Internal error when accessing libtpu multi-process lockfile". A compile-only process opens no TPU device.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with contextlib.suppress(RuntimeError):  # a backend is up already (tests, a TPU VM): keep it
        jax.config.update("jax_platforms", "cpu")


def topology_devices(target: Target) -> list[Any]:
    from jax.experimental.topologies import get_topology_desc

    kwargs: dict[str, Any] = {"num_slices": target.slices}
    if target.host_bounds is not None:
        kwargs["chips_per_host_bounds"] = list(target.host_bounds)
    try:
        topo = get_topology_desc(platform="tpu", topology_name=target.topology_name, **kwargs)
    except RuntimeError as err:  # JaxRuntimeError: libtpu refused the shape
        raise FitError(f"libtpu cannot describe {target.label}: {str(err).strip()}") from None
    return list(topo.devices)


def fit(
    cfg: TrainConfig,
    target: Target,
    *,
    title: str,
    model: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> FitReport:
    """Compile `cfg`'s programs for `target` and report memory, FLOPs, time and MFU per RL step.

    `cfg` is the trainer config as the pod would load it (mesh overrides applied); `model` names a bundled preset
    (see resolve_model). Raises ConfigError (FitError) for inputs that cannot be compiled; a program that does
    not fit is reported, not raised.
    """
    say = progress or (lambda _msg: None)
    cfg, source = resolve_model(cfg, model)
    prepare_environment(target)
    import jax

    from trainer.sharding import make_mesh
    from trainer.step import abstract_args, build_programs

    devices = topology_devices(target)
    try:
        cfg = resolve_mesh(cfg, len(devices), exact=True)
    except ConfigError as err:
        raise FitError(f"{err} (the {len(devices)} devices of {target.label})") from None
    mesh = make_mesh(cfg.mesh.slices, cfg.mesh.fsdp, cfg.mesh.tensor, devices)
    programs = build_programs(cfg, mesh, 0, 1)  # any valid pad / eos ids compile the same programs
    n_rewards = len(cfg.rewards) if cfg.rewards else 1
    args = abstract_args(cfg, programs, n_rewards)
    params_b = _tree_bytes_per_device(args["update"][0])
    opt_b = _tree_bytes_per_device(args["update"][1])
    kl = cfg.rl.kl_beta > 0
    resident = {
        "sample": (opt_b + (params_b if kl else 0),
                   "optimizer state" + (" + reference weights (rl.kl_beta > 0)" if kl else "")),
        "ref_logprobs": (params_b + opt_b, "policy weights + optimizer state"),
        "update": (params_b if kl else 0, "reference weights (rl.kl_beta > 0)" if kl else ""),
    }
    flops = step_flops(cfg)
    report_programs = []
    for i, name in enumerate(PROGRAMS):
        p = ProgramFit(name, model_flops=flops.model[name], flops=flops.executed[name])
        if name == "ref_logprobs" and not kl:
            p.skipped, p.model_flops, p.flops = "rl.kl_beta = 0", 0.0, 0.0
            report_programs.append(p)
            continue
        p.resident, p.resident_what = resident[name]
        say(f"compiling {name} for {target.label} ({i + 1}/{len(PROGRAMS)})")
        t0 = time.perf_counter()
        try:
            with jax.set_mesh(mesh):
                compiled = getattr(programs, name).lower(*args[name]).compile()
        except Exception as err:  # only RESOURCE_EXHAUSTED is a finding; anything else is re-raised
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            p.oom_message = str(err).strip()
            parsed = parse_oom(p.oom_message)
            p.oom_required, p.oom_available = parsed if parsed else (None, None)
        else:
            mem = compiled.memory_analysis()
            p.argument, p.output = mem.argument_size_in_bytes, mem.output_size_in_bytes
            p.alias, p.temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
            p.code = mem.generated_code_size_in_bytes
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            p.compiler_flops = float(cost.get("flops", 0.0)) * len(devices)
            p.compiler_seconds = float(cost.get("optimal_seconds", 0.0))
            if p.compiler_seconds < 0:
                hlo = compiled.as_text()
                p.compiler_seconds += sum(hlo.count(op) for op in _MINUS_ONE_SECOND_OPS)
        p.compile_seconds = time.perf_counter() - t0
        report_programs.append(p)
    _estimate_times(cfg, target, len(devices), flops, report_programs)
    m = cfg.model_cfg
    report = FitReport(
        title=title, target=target, model=source, params=param_count(m), param_dtype=m.param_dtype,
        compute_dtype=cfg.compute_dtype, mesh={k: getattr(cfg.mesh, k) for k in ("slices", "fsdp", "tensor")},
        batch=cfg.batch_size, prompt_len=cfg.prompt_len, new_tokens=cfg.sampling.max_new_tokens,
        devices=len(devices), programs=report_programs)
    report.suggestions = {p.name: suggestions(p.name, cfg) for p in report_programs if p.skipped is None}
    return report


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
            p.seconds = _sample_seconds(cfg, n_devices, flops, peak, bw)
        elif p.compiler_flops > 0 and p.compiler_seconds > 0:
            p.seconds = max(floor, p.compiler_seconds * p.flops / p.compiler_flops)
        else:  # did not compile: the compute roofline alone
            p.seconds = floor


def _sample_seconds(cfg: TrainConfig, n_devices: int, flops: StepFlops, peak: float, bw: float) -> float:
    import jax.numpy as jnp

    m, mesh = cfg.model_cfg, cfg.mesh
    rows = cfg.sample_chunk_rows
    chunks = cfg.batch_size // rows
    S = cfg.prompt_len + cfg.sampling.max_new_tokens
    data = mesh.slices * mesh.fsdp
    # Each device reads the weights of its tensor shard once per forward pass (FSDP gathers the rest; with
    # sampling.gather_weights a compute-dtype copy gathered once per step) and its rows' KV cache (sharded over kv
    # heads when mesh.tensor divides them).
    gathered = getattr(cfg.sampling, "gather_weights", False)
    weights = param_count(m) * jnp.dtype(cfg.compute_dtype if gathered else m.param_dtype).itemsize / mesh.tensor
    kv_shards = mesh.tensor if m.n_kv_heads % mesh.tensor == 0 else 1
    kv = rows / data * S * m.n_layers * 2 * m.n_kv_heads * m.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
    kv /= kv_shards
    hbm_s = (weights + kv) / bw
    prefill = max(rows * flops.prefill_row / (n_devices * peak), hbm_s)
    decode = max(rows * flops.decode_row / (n_devices * peak), hbm_s)
    return chunks * (prefill + cfg.sampling.max_new_tokens * decode)


# ---------------------------------------------------------------------------------------------- advice


def suggestions(program: str, cfg: TrainConfig) -> list[str]:
    """Config settings that would reduce `program`'s memory, with values that pass the config's own checks."""
    c, rl, mesh, m = cfg.compute, cfg.rl, cfg.mesh, cfg.model_cfg
    data = mesh.slices * mesh.fsdp
    out: list[str] = []

    def halves(n: int, divides: int) -> int | None:
        h = n // 2
        return h if n % 2 == 0 and h % data == 0 and divides % h == 0 else None

    if program == "update":
        if c.remat != "full":
            out.append(f"compute.remat=full (now {c.remat}): keep only each layer's input for the backward pass")
        mb = halves(cfg.micro_batch_rows, cfg.minibatch_rows)
        if mb:
            out.append(f"compute.train_micro_batch_size={mb} (now {cfg.micro_batch_rows}): fewer sequences' "
                       "activations at once, gradients accumulated")
        if cfg.batch_size % (2 * rl.minibatches) == 0 and (cfg.batch_size // (2 * rl.minibatches)) % data == 0:
            out.append(f"rl.minibatches={2 * rl.minibatches} (now {rl.minibatches}): smaller minibatches (more "
                       "optimizer steps per RL step: changes the algorithm)")
    if program == "sample":
        ns = halves(cfg.sample_chunk_rows, cfg.batch_size)
        if ns:
            out.append(f"sampling.max_num_sequences={ns} (now {cfg.sample_chunk_rows}): a KV cache for fewer "
                       "sequences at once")
    if program in ("update", "ref_logprobs") and c.logprob_chunk > 128 and cfg.sampling.max_new_tokens > 128:
        out.append(f"compute.logprob_chunk={max(128, min(c.logprob_chunk, cfg.sampling.max_new_tokens) // 2)} "
                   f"(now {c.logprob_chunk}): fewer fp32 [batch, chunk, vocab] logits at once")
    if program in ("sample", "update") and getattr(cfg.optim, "name", None) == "adamw":
        out.append("optim.name=adafactor: factored second moments and no first moment instead of Adam's two "
                   "param-sized moments" + (" (resident while sampling)" if program == "sample" else ""))
    if cfg.compute_dtype != "bfloat16":
        out.append("compute.dtype=bfloat16: bf16 activations" + (" and KV cache" if program == "sample" else ""))
    if m.param_dtype != "bfloat16":
        out.append("compute.param_dtype=bfloat16: halves the master weights and Adam state")
    if mesh.slices > 1 and getattr(mesh, "fsdp_across_slices", None) is False:
        out.append("mesh.fsdp_across_slices=true: shard the weights and optimizer state over the slices too "
                   "(an all-gather over DCN every pass)")
    t = next((t for t in (2, 4, 8) if t > mesh.tensor and m.n_kv_heads % t == 0 and m.n_heads % t == 0), None)
    if t:
        out.append(f"mesh.tensor={t} (now {mesh.tensor}): shard heads, MLP and vocab, not only the batch")
    out.append("more chips: a larger topology or more slices (trainer.slices / --slices)")
    return out
