"""`gke-tpu-rl fit --search`: find the fastest settings that fit, compiling as few programs as it can.

Only settings that leave the maths unchanged up to float rounding are searched: compute.remat,
compute.train_micro_batch_size, compute.logprob_chunk, sampling.max_num_sequences and sampling.gather_weights; then,
only where no combination of those fits, the precision settings compute.grad_accum_dtype, compute.dtype and
compute.param_dtype (bfloat16), in that order. The rl batch sizes, the optimizer and the model are never changed.

The search runs `fit()` itself, with one `CompileCache`: the config as given first (its compiles count); then, for
each program that does not fit, the candidate values of that program's settings, fastest first by the estimated
time (trainer/fit/estimate.py: a roofline per micro-batch, so micro-batches cost only where a step turns
bandwidth-bound and remat costs its recomputed FLOPs; ties: fewer micro-batches, less recompute, larger chunks),
skipping any whose estimated peak is over the limit (over 90% of it while any is estimated under). Each estimate
is calibrated on the compiled candidate nearest to it, so every compile that fails sharpens the next estimates. A
setting another program does not depend on leaves that program's lowered text unchanged, so it is not compiled
again: a candidate usually costs one compile. The first candidate that fits with room (at most 90% of the limit)
is kept; one that fits tightly is kept only if none with room turns up. The search stops when every program fits
(exit 0, with the settings to pass as --set) or the budget of compiles is spent (exit 3, with what was tried).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainer.base.config import ConfigError, TrainConfig, resolve_mesh
from trainer.fit import estimate as E
from trainer.fit.advice import with_settings
from trainer.fit.preflight import PROGRAMS, CompileCache, FitReport, fit, resolve_model, topology_devices
from trainer.fit.report import BUDGET_SPENT, WARN_FRACTION, Target, size

# The programs whose lowered text each searched setting changes (tests/trainer/test_fit_search.py checks it): a
# candidate costs that many compiles.
AFFECTS: dict[str, tuple[str, ...]] = {
    "compute.remat": ("update",),  # the other programs run forward only: the same program
    "compute.train_micro_batch_size": ("update",),
    "compute.grad_accum_dtype": ("update",),
    "compute.logprob_chunk": ("ref_logprobs", "update"),
    "sampling.max_num_sequences": ("sample",),
    "sampling.gather_weights": ("sample",),
    "compute.dtype": PROGRAMS,
    "compute.param_dtype": PROGRAMS,
}
PRECISION = ("compute.grad_accum_dtype", "compute.dtype", "compute.param_dtype")
# Give up on a program when even its smallest candidate is estimated this far over the limit.
HOPELESS = 1.5
_REMAT_RANK = {"none": 0, "dots": 1, "full": 2}


@dataclass
class Attempt:
    """One configuration the search compiled (or reused)."""

    program: str  # the program it was for ("" for the config as given)
    settings: list[str]  # --set KEY=VALUE, against the config as given
    estimate: int | None  # estimated peak of `program` before compiling (bytes per device)
    peak: int | None  # compiled peak of `program` (the worst program's for the config as given)
    status: str  # fits / tight / does not fit / not compiled
    compiles: int  # compiles it took


@dataclass
class SearchResult:
    base: FitReport  # the config as given
    report: FitReport | None  # the config with `settings`, when it fits
    settings: list[str]
    budget: int
    compiles: int = 0
    seconds: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)
    pruned: int = 0  # candidates skipped: estimated not to fit
    reason: str = ""  # why the search stopped without a fit

    @property
    def found(self) -> bool:
        return self.report is not None and self.report.fits

    @property
    def precision(self) -> list[str]:
        return [s for s in self.settings if s.split("=", 1)[0] in PRECISION]

    def flags(self) -> str:
        return " ".join(f"--set {s}" for s in self.settings)

    def lines(self) -> list[str]:
        rep = self.report or self.base
        per = rep.unit.split()[0]
        spent = f"{self.compiles} compile{'s' if self.compiles != 1 else ''} (budget {self.budget}), " \
                f"{self.seconds:.0f} s"
        if self.found and not self.settings:
            out = [f"search: the config fits as given ({spent}); nothing to change"]
        elif self.found:
            out = [f"search: found settings that fit in {spent}; add:", f"  {self.flags()}"]
            if self.precision:
                out.append(f"  (lower precision: {', '.join(self.precision)}: no full-precision combination "
                           "fitted)")
        else:
            out = [f"search: nothing found that fits in {spent}: {self.reason}"]
        out.append(f"tried (peaks per {per}, shares of {rep.hbm_basis}):")
        for i, a in enumerate(self.attempts, 1):
            what = f"{a.program}: {' '.join(a.settings) or '(as given)'}" if a.program else "the config as given"
            est = f"est. {size(a.estimate)}, " if a.estimate is not None else ""
            peak = f"{size(a.peak)} ({a.peak / rep.hbm_limit:.0%})" if a.peak is not None else "-"
            out.append(f"  {i}. {what}: {est}compiled {peak}: {a.status}"
                       + (f" ({a.compiles} compile{'s' if a.compiles != 1 else ''})" if a.compiles != 1 else ""))
        if self.pruned:
            out.append(f"  not compiled: {self.pruned} faster candidate settings, estimated not to fit")
        return out

    def markdown(self) -> str:
        head, *rest = self.lines()
        return "\n".join(["", f"**{head}**", "", "```text", *rest, "```", ""])

    def to_json(self) -> dict[str, Any]:
        return {
            "found": self.found, "settings": self.settings, "set_flags": self.flags(), "precision": self.precision,
            "compiles": self.compiles, "budget": self.budget, "seconds": self.seconds, "pruned": self.pruned,
            "reason": self.reason or None,
            "attempts": [vars(a) for a in self.attempts],
        }


@dataclass
class _Candidate:
    values: dict[str, Any]  # the program's searched settings, effective values
    cfg: TrainConfig  # resolved
    order: tuple[Any, ...]
    memory: E.Memory


def _setting(key: str, value: Any) -> str:
    return f"{key}={str(value).lower() if isinstance(value, bool) else value}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _space(program: str, cfg: TrainConfig, precision: bool) -> dict[str, list[Any]]:
    """Candidate effective values of each setting `program` depends on (the current one first)."""
    data = cfg.mesh.slices * cfg.mesh.fsdp
    c, N = cfg.compute, cfg.sampling.max_new_tokens
    chunk = min(c.logprob_chunk, N)
    # Powers of two around the current chunk, at least 16 tokens (smaller ones only slow the head down).
    chunks = sorted({chunk, N, *(chunk << k for k in range(1, 4) if chunk << k < N),
                     *(chunk >> k for k in range(1, 4) if chunk >> k >= 16)}, reverse=True)
    space: dict[str, list[Any]] = {}
    if program == "update":
        space["compute.remat"] = ["none", "dots", "full"]
        mb = cfg.minibatch_rows
        space["compute.train_micro_batch_size"] = [mb // n for n in _divisors(mb // data) if mb % n == 0]
        space["compute.logprob_chunk"] = chunks
        space["compute.grad_accum_dtype"] = [c.grad_accum_dtype] + (
            ["bfloat16"] if precision and c.grad_accum_dtype != "bfloat16" else [])
    elif program == "ref_logprobs":
        space["compute.logprob_chunk"] = chunks
    else:
        B = cfg.batch_size
        space["sampling.max_num_sequences"] = [B // n for n in _divisors(B // data) if B % n == 0]
        space["sampling.gather_weights"] = [False, True]
    return space


def _effective(cfg: TrainConfig, key: str) -> Any:
    return {"compute.remat": cfg.compute.remat, "compute.train_micro_batch_size": cfg.micro_batch_rows,
            "compute.logprob_chunk": min(cfg.compute.logprob_chunk, cfg.sampling.max_new_tokens),
            "compute.grad_accum_dtype": cfg.compute.grad_accum_dtype,
            "sampling.max_num_sequences": cfg.sample_chunk_rows,
            "sampling.gather_weights": cfg.sampling.gather_weights,
            "compute.dtype": cfg.compute_dtype, "compute.param_dtype": cfg.model_cfg.param_dtype}[key]


def _config_value(given: TrainConfig, key: str, value: Any) -> Any | None:
    """The value to --set for an effective value, against the config as given; None: nothing to set."""
    if _effective(given, key) == value:
        return None
    if key == "compute.train_micro_batch_size" and value == given.minibatch_rows:
        return "null"  # the whole minibatch
    if key == "sampling.max_num_sequences" and value == given.batch_size:
        return "null"
    return value


class _Search:
    def __init__(self, cfg: TrainConfig, target: Target, title: str, model: str | None, budget: int,
                 progress: Callable[[str], None]) -> None:
        self.cfg, self.target, self.title, self.model, self.say = cfg, target, title, model, progress
        self.cache = CompileCache(budget)
        self.attempts: list[Attempt] = []
        self.tried: set[tuple[str, ...]] = set()  # full settings compiled (or passed over for the budget)
        self.skipped: set[tuple[str, ...]] = set()  # estimated not to fit while a slower candidate was compiled
        resolved, _ = resolve_model(cfg, model)
        self.given = resolve_mesh(resolved, len(topology_devices(target)), exact=True)
        # Compiled configurations per program: (resolved config, peak of that program, measured temporaries).
        self.compiled: dict[str, list[tuple[TrainConfig, int, float]]] = {p: [] for p in PROGRAMS}
        self.peak = target.peak_flops_per_chip
        self.bw = target.hbm_bytes_per_s_per_chip

    # ------------------------------------------------------------------ compiling

    def settings(self, values: dict[str, Any]) -> list[str]:
        """--set KEY=VALUE for effective values, against the config as given (sorted: one spelling each)."""
        return sorted(_setting(k, v) for k, v in ((k, _config_value(self.given, k, x)) for k, x in values.items())
                      if v is not None)

    def run_fit(self, values: dict[str, Any]) -> FitReport:
        settings = self.settings(values)
        self.tried.add(tuple(settings))
        report = fit(with_settings(self.cfg, settings), self.target, title=self.title, model=self.model,
                     progress=self.say, cache=self.cache, phases=False)
        resolved = with_settings(self.given, settings)
        for p in report.programs:
            if p.skipped is None:
                self.compiled[p.name].append((resolved, p.peak, E.measured_temp(p)))
        return report

    # ------------------------------------------------------------------ estimating

    def estimate(self, program: str, cand: _Candidate, keys: list[str]) -> float:
        """Peak of `program` for `cand`, from the compiled configuration with the fewest differing settings."""
        def distance(ref: TrainConfig) -> int:  # dtypes count too: a tier's compiles calibrate its candidates
            return sum(_effective(ref, k) != _effective(cand.cfg, k) for k in (*keys, *PRECISION[1:]))

        ref_cfg, ref_peak, ref_temp = min(reversed(self.compiled[program]), key=lambda r: distance(r[0]))
        ref_mem = E.memory(ref_cfg, program)
        k = E.calibration(ref_mem, ref_temp)
        return ref_peak - E.saving(ref_mem, cand.memory, k)

    def candidates(self, program: str, current: dict[str, Any], precision: bool) -> list[_Candidate]:
        import itertools

        base = with_settings(self.given, self.settings(current))
        space = _space(program, base, precision)
        out = []
        for combo in itertools.product(*space.values()):
            values = dict(zip(space, combo, strict=True))
            try:
                cfg = with_settings(self.given, self.settings({**current, **values}))
            except ConfigError:  # a combination the config's own checks refuse is no candidate
                continue
            secs = E.seconds(cfg, program, self.peak, self.bw)
            n_micro = cfg.minibatch_rows // cfg.micro_batch_rows
            lowered = sum(1 for k in PRECISION if k in values and _effective(cfg, k) != _effective(base, k)
                          and values[k] == "bfloat16")
            order = (lowered, float(f"{secs:.3g}"), n_micro, _REMAT_RANK[cfg.compute.remat],
                     -min(cfg.compute.logprob_chunk, cfg.sampling.max_new_tokens),
                     cfg.batch_size // cfg.sample_chunk_rows, not cfg.sampling.gather_weights)
            out.append(_Candidate(values, cfg, order, E.memory(cfg, program)))
        return out

    # ------------------------------------------------------------------ solving one program

    def solve(self, program: str, current: dict[str, Any], limit: int, precision: bool) -> dict[str, Any] | str:
        """Values of `program`'s settings under which it fits (to merge into `current`), or why there are none."""
        base = with_settings(self.given, self.settings(current))
        cands = self.candidates(program, current, precision)
        keys = list(_space(program, self.given, precision))
        tight: dict[str, Any] | None = None  # one that fits above WARN_FRACTION: kept unless one with room turns up
        while True:
            left = [c for c in cands if tuple(self.settings({**current, **c.values})) not in self.tried]
            if not left:
                return tight or f"{program}: every candidate setting was tried"
            est = {id(c): self.estimate(program, c, keys) for c in left}
            # Fastest first among those estimated to fit with room, then among those estimated to fit at all.
            roomy = sorted((c for c in left if est[id(c)] <= WARN_FRACTION * limit), key=lambda c: c.order)
            feasible = roomy or sorted((c for c in left if est[id(c)] <= limit), key=lambda c: c.order)
            if feasible:
                pick = feasible[0]
            else:  # nothing is estimated to fit: the smallest, unless it is far off (estimates err by ~30%)
                pick = min(left, key=lambda c: est[id(c)])
                if est[id(pick)] > HOPELESS * limit:
                    return tight or (
                        f"{program}: its smallest candidate ({' '.join(self.settings(pick.values)) or 'as given'}) "
                        f"is estimated at {size(est[id(pick)])}, over {HOPELESS:g}x the limit: a larger slice, more "
                        "slices or a smaller batch is needed")
            changed = {k for k, v in pick.values.items() if _effective(base, k) != v}
            cost = len({program, *(p for k in changed for p in AFFECTS[k])})
            left_budget = self.cache.left or 0
            settings = self.settings({**current, **pick.values})
            self.tried.add(tuple(settings))
            if cost > left_budget:  # it could not be compiled whole: a cheaper one may still be
                if left_budget == 0:
                    return tight or f"the budget of {self.cache.budget} compiles is spent"
                continue
            self.skipped.update(tuple(self.settings({**current, **c.values})) for c in left
                                if est[id(c)] > limit and c.order < pick.order)
            self.say(f"search: {program} with {' '.join(settings) or 'the settings as given'} (est. "
                     f"{size(est[id(pick)])}; {left_budget} compile{'s' if left_budget != 1 else ''} left)")
            before = self.cache.compiles
            report = self.run_fit({**current, **pick.values})
            p = report.program(program)
            status = report.status(p)
            self.attempts.append(Attempt(program, settings, int(est[id(pick)]), None if p.skipped else p.peak,
                                         status, self.cache.compiles - before))
            if p.skipped == BUDGET_SPENT:
                return tight or f"the budget of {self.cache.budget} compiles is spent"
            if status == "fits":
                return pick.values
            if status == "tight" and tight is None:
                tight = pick.values

    # ------------------------------------------------------------------ the whole search

    def run(self) -> SearchResult:
        t0 = time.perf_counter()
        base = self.run_fit({})
        worst = max((p for p in base.programs if p.skipped is None), key=base.share, default=None)
        self.attempts.append(Attempt("", [], None, worst.peak if worst else None,
                                     "fits" if base.fits else "does not fit", self.cache.compiles))
        result = SearchResult(base, base if base.fits else None, [], self.cache.budget or 0)
        if not base.fits:
            self.search(result)
        result.attempts, result.pruned = self.attempts, len(self.skipped - self.tried)
        result.compiles, result.seconds = self.cache.compiles, time.perf_counter() - t0
        return result

    def tiers(self) -> list[tuple[dict[str, Any], bool]]:
        """(settings every program gets, whether the gradient accumulator may be bf16): full precision first;
        then a bf16 accumulator; then bf16 activations; then bf16 weights and optimizer state too."""
        out: list[tuple[dict[str, Any], bool]] = [({}, False)]
        if self.given.compute.grad_accum_dtype != "bfloat16":
            out.append(({}, True))
        if self.given.compute_dtype != "bfloat16":
            out.append(({"compute.dtype": "bfloat16"}, True))
        if self.given.model_cfg.param_dtype != "bfloat16":
            out.append(({**out[-1][0], "compute.param_dtype": "bfloat16"}, True))
        return out

    def search(self, result: SearchResult) -> None:
        reasons = []
        for tier, accum in self.tiers():
            if self.cache.left == 0:
                break
            current = dict(tier)
            report = self.run_fit(current) if tier else result.base
            if tier:
                worst = max((p for p in report.programs if p.skipped is None), key=report.share, default=None)
                self.attempts.append(Attempt("", self.settings(current), None, worst.peak if worst else None,
                                             "fits" if report.fits else "does not fit", 0))
            solved: set[str] = set()
            while not report.fits:
                if any(p.skipped == BUDGET_SPENT for p in report.programs):
                    reasons.append(f"the budget of {self.cache.budget} compiles is spent")
                    break
                failing = [p.name for p in report.failures if p.name not in solved]
                if not failing:  # each fits with its own settings, not with the others' (never seen so far)
                    reasons.append(f"{', '.join(p.name for p in report.failures)} fit alone, not together")
                    break
                found = self.solve(failing[0], current, report.hbm_limit, accum)
                if isinstance(found, str):
                    reasons.append(found)
                    break
                solved.add(failing[0])
                current.update(found)
                report = self.run_fit(current)
            if report.fits:
                result.report, result.settings = report, self.settings(current)
                if result.settings:
                    report.title = f"{self.title}, with {' '.join(result.settings)}"
                return
        result.reason = "; ".join(dict.fromkeys(reasons)) or f"the budget of {self.cache.budget} compiles is spent"


def search(cfg: TrainConfig, target: Target, *, title: str, budget: int, model: str | None = None,
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """The fastest settings (by estimate) under which every program of `cfg` fits `target`, compiling at most
    `budget` programs (the config as given included); see the module docstring. A service config (`service:`) is
    refused: its capacity settings are the service's to choose."""
    if cfg.service is not None:
        raise ConfigError(
            "fit --search searches the RL trainer's settings; a service config's programs are sized by lora.slots, "
            "lora.rank and service.max_batch_tokens (the service's capacity), compute.remat and "
            "compute.logprob_chunk: run fit without --search for its suggestions and their estimated savings")
    if cfg.placement.mode == "split":
        raise ConfigError(
            "fit --search searches a colocated trainer's settings; placement.mode=split: run fit without --search: it "
            "compiles each group's programs, prices the push and the colocated layout, and its advice names each "
            "group's settings (placement.sampler.* for sampling)")
    return _Search(cfg, target, title, model, budget, progress or (lambda _msg: None)).run()
