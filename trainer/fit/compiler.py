"""fit's compile machinery: libtpu's ahead-of-time TPU devices on a CPU machine (`prepare_environment`,
`topology_devices`), the usable HBM it allows, and one lowered program compiled into a ProgramFit (memory analysis, the
compiler's FLOPs and optimal_seconds, or the RESOURCE_EXHAUSTED it raised), with a cache and a budget across a search.
What to compile and how the figures are read is trainer/fit/preflight.py."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from trainer.base.config import ConfigError
from trainer.fit.report import BUDGET_SPENT, ProgramFit, Target

# Custom calls libtpu's cost model prices at -1 s each in optimal_seconds (libtpu 0.0.42.1: the negative part of
# every optimal_seconds seen, from 0.6B to 70B programs on 1 to 4 slices, is exactly the count of these).
_MINUS_ONE_SECOND_OPS = tuple(f'custom_call_target="{op}"' for op in ("ConcatBitcast", "SliceId", "ZeroCrop"))


# The update and reference passes are priced with XLA's windowed einsums (collective matmuls) off. At fsdp >= 16 the
# SPMD partitioner turns the layers' weight all-gathers and matmuls into while loops, which libtpu's cost analysis
# undercounts in `flops` and in optimal_seconds alike; fit's FLOPs scaling then read the FLOPs undercount as work
# left out and multiplied the time by it (2.14x on Qwen3-8B at fsdp 16). Without them the same
# maths is an all-gather, then the matmul, priced one after the other: no faster than the collective matmul that
# runs (tests/trainer/test_fit.py). The memory compile keeps the compiler's defaults: that is the program that runs.
PRICING_OPTIONS = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                   "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


class FitError(ConfigError):
    """The inputs cannot be compiled for the target (bad topology, mesh vs devices); the message says which."""


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


@functools.lru_cache(maxsize=16)
def usable_hbm(target: Target) -> int | None:
    """The HBM per device libtpu lets a program use on `target` (its compile-time limit, e.g. 31.25 GiB of a v6e
    chip's 32): the figure of the RESOURCE_EXHAUSTED it raises for a program that needs 1 TiB, a compile of well
    under a second. None where libtpu did not say."""
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((1,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(topology_devices(target)[0]))

    def huge(x: jax.Array) -> jax.Array:  # 1 TiB of temporaries, kept alive by the barrier: more than any chip has
        return jnp.sum(jax.lax.optimization_barrier(jnp.broadcast_to(x[0], (1 << 20, 1 << 18))))

    try:
        jax.jit(huge).lower(x).compile()
    except Exception as err:  # RESOURCE_EXHAUSTED, naming the limit
        parsed = parse_oom(str(err))
        return parsed[1] if parsed else None
    return None


@dataclass
class CompileCache:
    """Compiled programs by their lowered text and target (the same text compiles the same), and a budget.

    `fit --search` passes one through every fit it runs: a setting that leaves a program's lowered text unchanged
    (sampling.max_num_sequences for the update, compute.remat for the sampler) costs no compile, and `budget`
    caps the compiles of the whole search (a program past it is reported not compiled)."""

    budget: int | None = None
    compiles: int = 0
    compile_seconds: float = 0.0
    results: dict[str, ProgramFit] = field(default_factory=dict)
    # Whole fits by config and target (a split fit's colocated layout to compare: one fit for every split tried).
    reports: dict[str, Any] = field(default_factory=dict)

    @property
    def left(self) -> int | None:
        return None if self.budget is None else max(0, self.budget - self.compiles)


# What a compile measures; a reused program copies these.
_COMPILED_FIELDS = ("argument", "output", "alias", "temp", "code", "oom_message", "oom_required", "oom_available",
                    "compiler_flops", "compiler_seconds", "compile_seconds")


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


def _optimal_seconds(compiled: Any, hlo: str | None = None) -> float:
    """The compiler's optimal_seconds, with libtpu's -1 s per ConcatBitcast / SliceId / ZeroCrop added back (`hlo`:
    the compiled text, where the caller has it already)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    seconds = float(cost.get("optimal_seconds", 0.0))
    if seconds < 0:
        hlo = compiled.as_text() if hlo is None else hlo
        seconds += sum(hlo.count(op) for op in _MINUS_ONE_SECOND_OPS)
    return seconds


def _compile(p: ProgramFit, lowered: Any, mesh: Any, target: Target, n_devices: int, cache: CompileCache | None,
             say: Callable[[str], None], counter: str) -> None:
    """Compile one lowered program into `p` (memory analysis, cost analysis, or the compiler's RESOURCE_EXHAUSTED);
    with `cache`, a program compiled before is copied and one past the budget is marked not compiled."""
    import jax

    key = ""
    if cache is not None:
        text = f"{target.topology_name} {target.slices} {target.host_bounds}\n{lowered.as_text()}"
        key = hashlib.sha256(text.encode()).hexdigest()
        if key in cache.results:
            say(f"reusing {p.name}: compiled before in this run ({counter})")
            for f in _COMPILED_FIELDS:
                setattr(p, f, getattr(cache.results[key], f))
            p.reused = True
            return
        if cache.left == 0:
            p.skipped = BUDGET_SPENT
            say(f"skipping {p.name}: the compile budget is spent ({counter})")
            return
    say(f"compiling {p.name} for {target.label} ({counter})")
    t0 = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            compiled = lowered.compile()
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
        p.compiler_flops = float(cost.get("flops", 0.0)) * n_devices
        p.compiler_seconds = _optimal_seconds(compiled)
    p.compile_seconds = time.perf_counter() - t0
    if cache is not None:
        cache.compiles += 1
        cache.compile_seconds += p.compile_seconds
        cache.results[key] = ProgramFit(p.name, **{f.name: getattr(p, f.name) for f in fields(ProgramFit)
                                                   if f.name in _COMPILED_FIELDS})
