"""Our Tinker-compatible service against the reference server (skyrl 0.4.0), side by side, on the same tiny model.

Both servers serve the tiny random Qwen3 of tests/fixtures/tiny_qwen3, published into a private Hugging Face cache
as `Qwen/Qwen3-8B` (tests/tiny_model.py); both run on the CPU (JAX_PLATFORMS=cpu) and bind 127.0.0.1 only. The
clients are the official `tinker` SDK of our venv (0.38) in this process, against both servers. Each round starts
one server from nothing, measures it and stops it; the servers alternate (ours, skyrl, ours, skyrl, ...), so a
slow spell of the machine hits both. Per round:

1. start: process spawn -> GET /api/v1/healthz answers 200 ("HTTP ready"); -> a first ServiceClient +
   create_lora_training_client(...).result() completes ("model ready": skyrl's API answers before its engine
   subprocess has loaded the model); the first forward_backward + optim_step round trip (compiles).
2. steady state: the seed script's round trip (forward_backward(3 pig-latin datums, "cross_entropy").result(),
   then optim_step(AdamParams(learning_rate=1e-4)).result()), median of --steady after --warmup (the first,
   compiling round trip counts as a warm-up).
3. engine time per call in that window, from each server's own records: ours, the `requests` table
   (started_at -> finished_at; created_at -> finished_at); skyrl, its `futures` table (created_at -> completed_at;
   it records no start) and its engine's "(timing) ... took" log lines (the engine's own timer around each batch).
4. peak memory: RSS of the server process and all its children (psutil, every 0.2 s): from spawn to the end of
   the concurrency phase in the summary (ours samples after that, skyrl does not), to the stop in the JSON too.
5. N concurrent users (--users, default 1,2,4): each its own ServiceClient + LoRA training client doing the round
   trip in a thread; --user-warmup round trips each, a barrier, then --user-steps each; aggregate round trips per
   second over the measured window and each user's median latency.
6. two users, two temperatures (issue 40: one user's sampling settings must not stall another): user A keeps doing
   the round trip while user B, on a base-model sampler, samples once at temperature 0.7 (its first sample: the
   shape compiles) and then once at each of --new-settings temperatures it has not used before (8 new tokens, 4
   samples). Reported: B's latency per new setting, and A's round trips meanwhile (median, max, and how many took over
   2 s) against A's steady median. skyrl answers the sample, then the 0.38 SDK raises (its promise lacks
   sample_sequence_ids): the time to that answer is B's latency there.
Ours only (skyrl's sampling is broken for 0.38 clients, see /work/shared/TINKER-API.md): sample latency after
save_weights_and_get_sampling_client (16 new tokens, 1 sample; first call and median of the next ones).

The data are reference.json's "data" (exactly what the seed script builds with the tokenizer). skyrl runs from its
own venv (Python 3.12: `python -m venv .venv-skyrl && .venv-skyrl/bin/pip install "skyrl[tinker,jax]==0.4.0"
aiohttp uv`), started as the walkthrough does, through `uv run` (its API launches its engine with `uv run`).

    .venv/bin/python -m bench.tinker_service --json runs/bench-tinker.json     # 5-9 min on 2 cores (make bench-tinker)

Everything it starts is killed on exit, on error and on SIGTERM/SIGINT; a watchdog (--max-minutes) ends a hung run.
The servers as processes (start, memory, stop) are bench/tinker_servers.py; this file is the workload, the
measures and the report.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.tinker_servers import (
    BASE_MODEL,
    OURS_CONFIG,
    ROOT,
    SKYRL_BACKEND_CONFIG,
    Server,
    kill_all,
    start_ours,
    start_skyrl,
    wait_http,
)

FIXTURE_REFERENCE = ROOT / "tests" / "fixtures" / "tiny_qwen3" / "reference.json"
LORA_RANK = 32
LEARNING_RATE = 1e-4
CALL_TIMEOUT_S = 300.0  # one SDK call (the first round trip compiles: ~10-20 s here)

# ---- the workload -----------------------------------------------------------------------------------------------

def seed_data() -> tuple[list[Any], list[float]]:
    from tinker import types

    ref = json.loads(FIXTURE_REFERENCE.read_text())
    data = [types.Datum(model_input=types.ModelInput.from_ints(d["model_input"]),
                        loss_fn_inputs={"weights": d["weights"], "target_tokens": d["target_tokens"]})
            for d in ref["data"]]
    weights = [w for d in ref["data"] for w in d["weights"]]
    return data, weights


@dataclass
class User:
    service: Any
    training: Any
    data: list[Any]
    weights: list[float]
    latencies: list[float] = field(default_factory=list)

    def round_trip(self) -> tuple[float, float]:
        """The seed script's step: forward_backward(...).result(), then optim_step(...).result(); (seconds, the
        seed script's printed loss)."""
        from tinker import types

        t0 = time.perf_counter()
        fb = self.training.forward_backward(self.data, "cross_entropy").result(timeout=CALL_TIMEOUT_S)
        self.training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result(timeout=CALL_TIMEOUT_S)
        elapsed = time.perf_counter() - t0
        logprobs = [float(x) for o in fb.loss_fn_outputs for x in o["logprobs"].tolist()]
        loss = -sum(lp * w for lp, w in zip(logprobs, self.weights, strict=True)) / sum(self.weights)
        return elapsed, loss

    def close(self) -> None:
        try:
            self.service.close("success").result(timeout=30)
        except Exception as e:  # noqa: BLE001 - skyrl has no /sessions/{id}/finish (404): the client still closes
            print(f"    (ServiceClient.close: {type(e).__name__}: {str(e)[:100]})", flush=True)


def new_user(server: Server) -> User:
    import tinker

    service = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=LORA_RANK).result(
        timeout=CALL_TIMEOUT_S)
    data, weights = seed_data()
    return User(service, training, data, weights)


def _stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {"n": len(xs), "median": statistics.median(s), "mean": statistics.fmean(s), "min": s[0], "max": s[-1],
            "p90": s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]}


def _utc_epoch(text: str) -> float:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp()


def engine_times_ours(db: Path, t0: float, t1: float) -> dict[str, Any]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT kind, created_at, started_at, finished_at FROM requests WHERE kind IN "
                           "('forward_backward', 'optim_step') AND finished_at IS NOT NULL").fetchall()
    finally:
        con.close()
    out: dict[str, Any] = {}
    for kind in ("forward_backward", "optim_step"):
        sel = [(_utc_epoch(c), _utc_epoch(s), _utc_epoch(f)) for k, c, s, f in rows
               if k == kind and s is not None and t0 <= _utc_epoch(c) <= t1]
        out[kind] = {"engine_s": _stats([f - s for c, s, f in sel]),  # started_at -> finished_at
                     "queued_to_done_s": _stats([f - c for c, s, f in sel])}  # created_at -> finished_at
    return out


_TIMING = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - INFO - skyrl: \(timing\) "
                     r"process_(?:batch|single)_requests?\((\w+)(?:, n=(\d+))?\) took ([\d.]+)s")


def engine_times_skyrl(db: Path, log: Path, t0: float, t1: float) -> dict[str, Any]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT request_type, created_at, completed_at FROM futures WHERE request_type IN "
                           "('FORWARD_BACKWARD', 'OPTIM_STEP') AND completed_at IS NOT NULL").fetchall()
    finally:
        con.close()
    timings: dict[str, list[float]] = {"forward_backward": [], "optim_step": []}
    for line in log.read_text(errors="replace").splitlines():
        m = _TIMING.match(line)
        if m is None or m.group(2) not in timings:
            continue
        when = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()  # the engine's local time
        if t0 <= when <= t1 + 1.0:
            timings[m.group(2)].append(float(m.group(4)))
    out: dict[str, Any] = {}
    for kind in ("forward_backward", "optim_step"):
        sel = [(_utc_epoch(c), _utc_epoch(f)) for k, c, f in rows if k == kind.upper() and t0 <= _utc_epoch(c) <= t1]
        out[kind] = {"engine_s": _stats(timings[kind]),  # the engine's "(timing) ... took" around the batch
                     "queued_to_done_s": _stats([f - c for c, f in sel])}  # created_at -> completed_at
    return out


def run_concurrent(users: list[User], warmup: int, steps: int) -> dict[str, Any]:
    n = len(users)
    marks: dict[str, float] = {}
    def mark_start() -> None:
        marks.setdefault("t0", time.perf_counter())

    barrier = threading.Barrier(n, action=mark_start)
    errors: list[BaseException] = []
    done: list[float] = []

    def work(u: User) -> None:
        try:
            u.latencies = []
            for _ in range(warmup):
                u.round_trip()
            barrier.wait(timeout=CALL_TIMEOUT_S)
            for _ in range(steps):
                u.latencies.append(u.round_trip()[0])
            done.append(time.perf_counter())
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(u,), name=f"user{i}", daemon=True) for i, u in enumerate(users)]
    wall0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_TIMEOUT_S * (warmup + steps))
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"{n} concurrent users did not finish")
    window = max(done) - marks["t0"]
    medians = [statistics.median(u.latencies) for u in users]
    return {"users": n, "round_trips": n * steps, "window_s": window, "round_trips_per_s": n * steps / window,
            "per_user_median_s": medians, "median_of_user_medians_s": statistics.median(medians),
            "all_latencies": _stats([x for u in users for x in u.latencies]), "started_at": wall0,
            # this slow in the measured window: a compile (a batch shape or adapter seen for the first time) or load
            "slow_round_trips_over_2s": sum(x > 2.0 for u in users for x in u.latencies),
            "latencies_s": [u.latencies for u in users]}


def _sample_answered(sampler: Any, prompt: Any, params: Any) -> float:
    """Seconds until the server answered a 4-sample request (skyrl: until the SDK's assertion on its answer)."""
    t = time.perf_counter()
    try:
        sampler.sample(prompt=prompt, num_samples=4, sampling_params=params).result(timeout=CALL_TIMEOUT_S)
    except AssertionError as e:  # skyrl 0.4.0: the answer came, without sample_sequence_ids
        if "sample_sequence_ids" not in str(e):
            raise
    return time.perf_counter() - t


def measure_two_temperatures(server: Server, trainer: User, new_settings: int) -> dict[str, Any]:
    """B samples at new temperatures while A trains; see the module docstring, phase 6."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=server.url, api_key=server.api_key)
    try:
        sampler = service.create_sampling_client(base_model=BASE_MODEL)
        prompt = types.ModelInput.from_ints(trainer.data[0].model_input.to_ints()[:16])
        first = _sample_answered(sampler, prompt, types.SamplingParams(max_tokens=8, temperature=0.7, seed=0))
        temps = [round(0.3 + 0.15 * i, 2) for i in range(new_settings)]  # none of them 0.7
        stop = threading.Event()
        during: list[float] = []
        errors: list[BaseException] = []

        def train() -> None:
            try:
                while not stop.is_set():
                    during.append(trainer.round_trip()[0])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        worker = threading.Thread(target=train, name="trainer", daemon=True)
        worker.start()
        time.sleep(0.5)  # A is mid-stream when B's first new setting arrives
        per_setting = [_sample_answered(sampler, prompt, types.SamplingParams(max_tokens=8, temperature=t, seed=1))
                       for t in temps]
        stop.set()
        worker.join(CALL_TIMEOUT_S)
        if errors:
            raise errors[0]
    finally:
        with contextlib.suppress(Exception):
            service.close("success").result(timeout=30)
    return {"first_sample_s": first, "temperatures": temps, "new_setting_s": _stats(per_setting),
            "new_setting_each_s": per_setting, "trainer_round_trips_s": _stats(during),
            "trainer_round_trips_over_2s": sum(x > 2.0 for x in during)}


def measure_sampling(user: User, repeats: int) -> dict[str, Any]:
    from tinker import types

    t = time.perf_counter()
    sampler = user.training.save_weights_and_get_sampling_client().result(timeout=CALL_TIMEOUT_S)
    save_s = time.perf_counter() - t
    prompt = types.ModelInput.from_ints(user.data[0].model_input.to_ints()[:16])
    params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=0)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        out = sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result(timeout=CALL_TIMEOUT_S)
        times.append(time.perf_counter() - t)
    return {"save_weights_and_get_sampling_client_s": save_s, "first_sample_s": times[0],
            "sample_s": _stats(times[1:]), "new_tokens": len(out.sequences[0].tokens), "prompt_tokens": 16}


def one_round(name: str, index: int, args: argparse.Namespace, hf_home: Path, work: Path) -> dict[str, Any]:
    print(f"[round {index}] {name}: starting", flush=True)
    rdir = work / f"r{index}-{name}"
    shutil.rmtree(rdir, ignore_errors=True)  # a fresh database and storage every round
    server = start_ours(rdir, hf_home) if name == "ours" else start_skyrl(rdir, hf_home, args.skyrl_venv)
    result: dict[str, Any] = {"server": name, "round": index, "log": str(server.log), "db": str(server.db),
                              "load_avg_at_start": os.getloadavg()}
    users: list[User] = []
    try:
        result["http_ready_s"] = wait_http(server)
        users.append(new_user(server))
        result["model_ready_s"] = time.perf_counter() - server.spawned_perf
        first, loss = users[0].round_trip()
        result["first_round_trip_s"] = first
        result["first_round_trip_done_s"] = time.perf_counter() - server.spawned_perf
        result["first_loss"] = loss
        print(f"  http ready {result['http_ready_s']:.2f} s, model ready {result['model_ready_s']:.2f} s, first "
              f"round trip {first:.2f} s (loss {loss:.4f})", flush=True)
        for _ in range(max(0, args.warmup - 1)):
            users[0].round_trip()
        t0 = time.time()
        lat = []
        for _ in range(args.steady):
            lat.append(users[0].round_trip()[0])
        t1 = time.time()
        result["steady_round_trip_s"] = _stats(lat)
        result["steady_window"] = [t0, t1]
        print(f"  steady round trip: median {statistics.median(lat) * 1000:.0f} ms over {len(lat)}", flush=True)
        conc = {}
        for n in args.users:
            while len(users) < n:
                users.append(new_user(server))
            c = run_concurrent(users[:n], args.user_warmup, args.user_steps)
            conc[str(n)] = c
            print(f"  {n} users: {c['round_trips_per_s']:.2f} round trips/s, per-user median "
                  f"{c['median_of_user_medians_s'] * 1000:.0f} ms", flush=True)
        result["concurrent"] = conc
        server.memory.sample()
        result["peak_rss_training_bytes"] = server.memory.peak_total  # before ours samples: skyrl does not
        if args.new_settings > 0:
            tt = result["two_temperatures"] = measure_two_temperatures(server, users[0], args.new_settings)
            print(f"  two users: B's first sample {tt['first_sample_s']:.2f} s, a new temperature median "
                  f"{tt['new_setting_s']['median']:.2f} s (max {tt['new_setting_s']['max']:.2f}); A's round trip "
                  f"meanwhile median {tt['trainer_round_trips_s'].get('median', 0) * 1000:.0f} ms, max "
                  f"{tt['trainer_round_trips_s'].get('max', 0):.2f} s", flush=True)
        if name == "ours" and args.sample_repeats > 0:
            result["sampling"] = measure_sampling(users[0], args.sample_repeats)
            print(f"  sample (16 tokens): first {result['sampling']['first_sample_s']:.2f} s, then median "
                  f"{result['sampling']['sample_s']['median'] * 1000:.0f} ms", flush=True)
        for u in users:
            u.close()
        users = []
    finally:
        for u in users:  # after an error: close what is open, quietly
            with contextlib.suppress(Exception):
                u.service.close("errored")
        server.stop()
        result["exit_code"] = server.proc.returncode
    mem = server.memory
    result["peak_rss_bytes"] = mem.peak_total
    result["peak_rss_by_process"] = sorted(({"pid": pid, "cmd": cmd, "peak_rss_bytes": rss}
                                            for pid, (cmd, rss) in mem.peak_by_pid.items()),
                                           key=lambda x: -x["peak_rss_bytes"])
    result["rss_samples"] = mem.samples
    result["load_avg_at_end"] = os.getloadavg()
    t0, t1 = result["steady_window"]
    if name == "ours":
        result["engine"] = engine_times_ours(server.db, t0, t1)
    else:
        result["engine"] = engine_times_skyrl(server.db, server.log, t0, t1)
    e = result["engine"]
    fb_ms = e["forward_backward"]["engine_s"].get("median", 0) * 1000
    opt_ms = e["optim_step"]["engine_s"].get("median", 0) * 1000
    print(f"  engine per call (median): forward_backward {fb_ms:.0f} ms, optim_step {opt_ms:.0f} ms; peak RSS "
          f"{mem.peak_total / 2**20:.0f} MiB", flush=True)
    return result


# ---- summary ----------------------------------------------------------------------------------------------------

def _med(rounds: list[dict[str, Any]], get: Callable[[dict[str, Any]], float]) -> float | None:
    vals = []
    for r in rounds:
        try:
            vals.append(float(get(r)))
        except (KeyError, TypeError):
            continue
    return statistics.median(vals) if vals else None


def summarize(rounds: list[dict[str, Any]], users: list[int]) -> list[dict[str, Any]]:
    """One row per metric: the median over rounds for each server, and ours / skyrl."""
    by = {s: [r for r in rounds if r["server"] == s and "error" not in r] for s in ("ours", "skyrl")}
    metrics: list[tuple[str, str, bool, Callable[[dict[str, Any]], float]]] = [
        ("start: spawn -> /healthz 200", "s", True, lambda r: r["http_ready_s"]),
        ("start: spawn -> first create_model done", "s", True, lambda r: r["model_ready_s"]),
        ("first forward_backward + optim_step (compiles)", "s", True, lambda r: r["first_round_trip_s"]),
        ("start: spawn -> first round trip done", "s", True, lambda r: r["first_round_trip_done_s"]),
        ("steady round trip (median)", "ms", True, lambda r: r["steady_round_trip_s"]["median"] * 1000),
        ("engine: forward_backward (median)", "ms", True,
         lambda r: r["engine"]["forward_backward"]["engine_s"]["median"] * 1000),
        ("engine: optim_step (median)", "ms", True, lambda r: r["engine"]["optim_step"]["engine_s"]["median"] * 1000),
        ("db: forward_backward created -> done (median)", "ms", True,
         lambda r: r["engine"]["forward_backward"]["queued_to_done_s"]["median"] * 1000),
        ("db: optim_step created -> done (median)", "ms", True,
         lambda r: r["engine"]["optim_step"]["queued_to_done_s"]["median"] * 1000),
        ("peak RSS, server + children (start to end of the training phases)", "MiB", True,
         lambda r: r["peak_rss_training_bytes"] / 2**20),
    ]
    # Lambdas that bind n as a default argument: mypy cannot infer one against a one-argument Callable (misc).
    for n in users:
        metrics.append((f"{n} user(s): aggregate round trips/s", "1/s", False,
                        lambda r, n=n: r["concurrent"][str(n)]["round_trips_per_s"]))  # type: ignore[misc]
        metrics.append((f"{n} user(s): per-user median latency", "ms", True,
                        lambda r, n=n: r["concurrent"][str(n)]["median_of_user_medians_s"] * 1000))  # type: ignore[misc]
        metrics.append((f"{n} user(s): round trips over 2 s in the window", "count", True,
                        lambda r, n=n: r["concurrent"][str(n)]["slow_round_trips_over_2s"]))  # type: ignore[misc]
    metrics.append(("two users: B's sample at a new temperature (median)", "s", True,
                    lambda r: r["two_temperatures"]["new_setting_s"]["median"]))
    metrics.append(("two users: B's sample at a new temperature (max)", "s", True,
                    lambda r: r["two_temperatures"]["new_setting_s"]["max"]))
    metrics.append(("two users: A's round trip meanwhile (median)", "ms", True,
                    lambda r: r["two_temperatures"]["trainer_round_trips_s"]["median"] * 1000))
    metrics.append(("two users: A's round trip meanwhile (max)", "s", True,
                    lambda r: r["two_temperatures"]["trainer_round_trips_s"]["max"]))
    metrics.append(("two users: A's round trips over 2 s meanwhile", "count", True,
                    lambda r: r["two_temperatures"]["trainer_round_trips_over_2s"]))
    metrics.append(("ours only: save_weights_and_get_sampling_client", "s", True,
                    lambda r: r["sampling"]["save_weights_and_get_sampling_client_s"]))
    metrics.append(("ours only: first sample, 16 tokens (compiles)", "s", True,
                    lambda r: r["sampling"]["first_sample_s"]))
    metrics.append(("ours only: sample, 16 tokens (median)", "ms", True,
                    lambda r: r["sampling"]["sample_s"]["median"] * 1000))
    rows = []
    for label, unit, lower, get in metrics:
        ours, sky = _med(by["ours"], get), _med(by["skyrl"], get)
        ratio = ours / sky if ours is not None and sky else None
        rows.append({"metric": label, "unit": unit, "lower_is_better": lower, "ours": ours, "skyrl": sky,
                     "ours_over_skyrl": ratio,
                     "ours_rounds": [_med([r], get) for r in by["ours"]],
                     "skyrl_rounds": [_med([r], get) for r in by["skyrl"]]})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    def f(x: float | None, unit: str) -> str:
        if x is None:
            return "–"
        return f"{x:.2f}" if unit in ("s", "1/s") else f"{x:.0f}"

    out = ["| metric | ours | skyrl 0.4.0 | ours / skyrl | better |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = "–" if r["ours_over_skyrl"] is None else f"**{r['ours_over_skyrl']:.2f}**"
        spread = lambda xs, u: " / ".join(f(x, u) for x in xs)  # noqa: E731
        out.append(f"| {r['metric']} ({r['unit']}) | {f(r['ours'], r['unit'])} ({spread(r['ours_rounds'], r['unit'])})"
                   f" | {f(r['skyrl'], r['unit'])} ({spread(r['skyrl_rounds'], r['unit'])}) | {ratio} | "
                   f"{'lower' if r['lower_is_better'] else 'higher'} |")
    return "\n".join(out)


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "load_avg_before": os.getloadavg()}


def versions(skyrl_venv: Path) -> dict[str, Any]:
    from importlib.metadata import version

    out: dict[str, Any] = {"python_ours": platform.python_version(), "tinker_client": version("tinker")}
    for pkg in ("jax", "jaxlib"):
        out[f"{pkg}_ours"] = version(pkg)
    code = ("import importlib.metadata as m, platform, json; print(json.dumps({'python': platform.python_version(), "
            "**{p: m.version(p) for p in ('skyrl', 'jax', 'jaxlib', 'tinker')}}))")
    try:
        out["skyrl_venv"] = json.loads(subprocess.run([str(skyrl_venv / "bin" / "python"), "-c", code], check=True,
                                                      capture_output=True, text=True, timeout=60).stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        out["skyrl_venv"] = f"unknown: {e}"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "trainer"], cwd=ROOT, capture_output=True,
                               text=True).stdout.split("\n")
        out["git"] = {"head": head, "trainer_changes_not_committed": [d for d in dirty if d]}
    except OSError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds per server, alternating (default: %(default)s)")
    p.add_argument("--steady", type=int, default=20, help="measured steady-state round trips (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up round trips incl. the first (default: %(default)s)")
    p.add_argument("--users", default="1,2,4", help="concurrent user counts (default: %(default)s)")
    p.add_argument("--user-warmup", type=int, default=3, help="warm-up round trips per user (default: %(default)s)")
    p.add_argument("--user-steps", type=int, default=10, help="measured round trips per user (default: %(default)s)")
    p.add_argument("--sample-repeats", type=int, default=5, help="ours: timed samples after the first; 0: none")
    p.add_argument("--new-settings", type=int, default=4,
                   help="two users: B's samples at temperatures new to the server; 0: skip the phase")
    p.add_argument("--servers", default="ours,skyrl", help="which servers, in the order of each round")
    p.add_argument("--skyrl-venv", type=Path, default=ROOT / ".venv-skyrl", help="skyrl 0.4.0's venv")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-tinker", help="logs, databases, HF cache")
    p.add_argument("--json", type=Path, default=ROOT / "runs" / "bench-tinker.json", help="the raw figures")
    p.add_argument("--max-minutes", type=float, default=25.0, help="watchdog: kill everything and exit 3 after this")
    args = p.parse_args(argv)
    args.users = [int(x) for x in args.users.split(",") if x]
    # absolute (not resolved: the venv's python is a symlink that must stay inside the venv); skyrl runs in --work
    args.skyrl_venv, args.work, args.json = (Path(os.path.abspath(x)) for x in (args.skyrl_venv, args.work, args.json))
    servers = [s for s in args.servers.split(",") if s]
    if "skyrl" in servers and not (args.skyrl_venv / "bin" / "uv").exists():
        print(f"error: no skyrl venv at {args.skyrl_venv} (see bench/README.md: make bench-tinker builds it)",
              file=sys.stderr)
        return 2

    def on_signal(signum: int, _frame: Any) -> None:
        print(f"signal {signum}: stopping the servers", file=sys.stderr, flush=True)
        kill_all()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def watchdog() -> None:
        print(f"watchdog: over {args.max_minutes} min, stopping the servers", file=sys.stderr, flush=True)
        kill_all()
        os._exit(3)

    timer = threading.Timer(args.max_minutes * 60, watchdog)
    timer.daemon = True
    timer.start()

    sys.path.insert(0, str(ROOT))
    from tests.tiny_model import publish

    args.work.mkdir(parents=True, exist_ok=True)
    hf_home = args.work / "hf"
    publish(hf_home)
    # The client side: get_tokenizer() is not called (the data are pre-tokenized), but keep the SDK offline too.
    os.environ.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, "-m", "bench.tinker_service", *sys.argv[1:]]),
        "machine": machine(), "versions": versions(args.skyrl_venv),
        "settings": {"rounds": args.rounds, "steady": args.steady, "warmup": args.warmup, "users": args.users,
                     "user_warmup": args.user_warmup, "user_steps": args.user_steps, "base_model": BASE_MODEL,
                     "new_settings": args.new_settings,
                     "lora_rank": LORA_RANK, "learning_rate": LEARNING_RATE, "ours_config": OURS_CONFIG,
                     "skyrl_backend_config": SKYRL_BACKEND_CONFIG},
        "rounds": [],
    }
    started = time.perf_counter()

    def rounds() -> None:
        for i in range(args.rounds):
            for name in servers:
                try:
                    report["rounds"].append(one_round(name, i, args, hf_home, args.work))
                except Exception as e:  # noqa: BLE001 - recorded, the other rounds still run
                    traceback.print_exc()
                    report["rounds"].append({"server": name, "round": i, "error": f"{type(e).__name__}: {e}"})

    # The rounds run in a thread: the main thread only waits, waking every 0.5 s, so a SIGTERM/SIGINT that the kernel
    # hands to one of the SDK's threads still reaches the handler at once (a main thread blocked in a long
    # future.result() would run it only when the wait ends).
    worker = threading.Thread(target=rounds, name="rounds", daemon=True)
    try:
        worker.start()
        while worker.is_alive():
            worker.join(0.5)
    finally:
        kill_all()
        report["wall_s"] = time.perf_counter() - started
        report["summary"] = summarize(report["rounds"], args.users)
        report["markdown"] = markdown(report["summary"])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        timer.cancel()
    print(report["markdown"])
    print(f"\n{len(report['rounds'])} rounds in {report['wall_s']:.0f} s; raw figures in {args.json}")
    return 1 if any("error" in r for r in report["rounds"]) else 0


if __name__ == "__main__":
    sys.exit(main())
