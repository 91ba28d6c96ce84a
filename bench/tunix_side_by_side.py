"""Our GRPO update step against google-tunix 0.1.7's, side by side on the CPU: same tiny Qwen3, same batch, same loss.

Each side runs in its own process (`bench/tunix_worker.py`; Tunix from its own venv, `.venv-tunix`), on the same
mesh, for two cases: GRPO with the KL term (beta 0.04, k3 / "low_var_kl" estimator, reference log-probs as an input)
and without (beta 0). One step = forward + backward + global-norm clip + AdamW (optax) on 16 rows x (32 prompt + 96
completion) tokens, the clipped surrogate with a token-mean, from the same weights on both sides (their first-step
gradient norms are printed: equal when both compute the same model and loss). Meshes: 1 device, and 4 CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4) as 2 x 2: Tunix's ('fsdp', 'tp') = (2, 2) and our fsdp 2 x
tensor 2 (weights over fsdp and heads / d_ff over tensor, the batch over fsdp, on both sides).

Per mesh, both workers start and compile every case, then take turns: for each of --pairs rounds and each case, one
side times --steps steps, then the other (the order flips every time), while the idle one waits on its stdin. A busy
spell of the machine (it is shared) thus hits both sides of a pair. Reported per case: the median per-step wall time
of each side over all its timed steps, ours / Tunix, the spread of the per-pair ratios (ratio of pair medians), and
the median CPU seconds per step of each worker process (all threads; steadier than wall time on a loaded machine).

    .venv/bin/python -m bench.tunix_side_by_side --json runs/bench-tunix.json   # 3-7 min on 2 cores (make bench-tunix)

`--set KEY=VALUE` passes a config override to our side (e.g. compute.scan_layers=false) for experiments; the
default run uses our defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.tunix_worker import MODEL, NEW_TOKENS, PROMPT_LEN, PROTOCOL, ROWS

ROOT = Path(__file__).resolve().parent.parent
DEVICES = {"1": 1, "2x2": 4}
CASE_NAMES = {"kl": "with KL (beta 0.04)", "nokl": "no KL (beta 0)"}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def worker_env(mesh: str) -> dict[str, str]:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if DEVICES[mesh] > 1:
        flags.append(f"--xla_force_host_platform_device_count={DEVICES[mesh]}")
    env.update({"XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2",
                "PYTHONPATH": str(ROOT)})
    return env


class Worker:
    """A `bench.tunix_worker --serve` process: built and compiled once, then asked for timed steps."""

    def __init__(self, python: str, side: str, mesh: str, cases: list[str], extra: list[str], log_dir: Path):
        self.side, self.mesh = side, mesh
        self.cmd = [python, "-m", "bench.tunix_worker", "--side", side, "--mesh", mesh, "--cases", ",".join(cases),
                    "--serve", *extra]
        self.log = log_dir / f"{side}-{mesh}.stderr"
        self._err = open(self.log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=worker_env(mesh), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True, bufsize=1)

    def read(self, timeout: float) -> dict[str, Any]:
        """The next protocol line (other stdout lines are skipped)."""
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                self.fail(f"no answer within {timeout:.0f} s")
            line = self.proc.stdout.readline()
            if not line:
                self.fail(f"exited with {self.proc.wait()}")
            if line.startswith(PROTOCOL):
                msg = json.loads(line[len(PROTOCOL):])
                if "error" in msg:
                    self.fail(msg["error"])
                return msg

    def run(self, case: str, steps: int, timeout: float) -> dict[str, list[float]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {case} {steps}\n")
        self.proc.stdin.flush()
        msg = self.read(timeout)
        return {"step_s": msg["step_s"], "cpu_s": msg["cpu_s"]}

    def fail(self, why: str) -> None:
        self.close()
        sys.stderr.write(self.log.read_text()[-8000:])
        raise SystemExit(f"{self.side} worker (mesh {self.mesh}) {why}: {' '.join(self.cmd)}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._err.close()


def measure_mesh(mesh: str, cases: list[str], args: argparse.Namespace, pythons: dict[str, str],
                 extras: dict[str, list[str]], log_dir: Path) -> dict[str, Any]:
    """Both workers of one mesh: start and compile (one after the other, so compile times are each alone on the
    machine), then `pairs` rounds of alternating timed runs per case."""
    workers: dict[str, Worker] = {}
    ready: dict[str, Any] = {}
    try:
        for side in ("ours", "tunix"):
            workers[side] = Worker(pythons[side], side, mesh, cases, extras[side], log_dir)
            ready[side] = workers[side].read(args.timeout)
        times: dict[str, dict[str, list[dict[str, list[float]]]]] = {c: {"ours": [], "tunix": []} for c in cases}
        loads: list[float] = []
        for rnd in range(args.pairs):
            for i, case in enumerate(cases):
                order = ("ours", "tunix") if (rnd + i) % 2 == 0 else ("tunix", "ours")
                loads.append(os.getloadavg()[0])
                for side in order:
                    times[case][side].append(workers[side].run(case, args.steps, args.timeout))
                o, t = (statistics.median(times[case][s][-1]["step_s"]) for s in ("ours", "tunix"))
                print(f"  mesh {mesh} pair {rnd + 1}/{args.pairs} {case:4s}: ours {o:.3f} s, Tunix {t:.3f} s "
                      f"(ratio {o / t:.2f}, load {loads[-1]:.2f})", flush=True)
    finally:
        for w in workers.values():
            w.close()
    return {"ready": ready, "times": times, "loads": loads}


def summarize(measured: dict[str, Any], case: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in ("ours", "tunix"):
        runs = measured["times"][case][side]
        steps = [t for run in runs for t in run["step_s"]]
        cpu = [t for run in runs for t in run["cpu_s"]]
        ready = measured["ready"][side]["cases"][case]
        out[side] = {"median_s": statistics.median(steps), "min_s": min(steps), "median_cpu_s": statistics.median(cpu),
                     "pair_medians_s": [statistics.median(run["step_s"]) for run in runs],
                     "compile_s": ready["compile_s"],
                     "first_grad_norm": ready["first_grad_norm"], "first_loss": ready["first_loss"],
                     "layout": ready["layout"]}
    out["ratio"] = out["ours"]["median_s"] / out["tunix"]["median_s"]
    out["cpu_ratio"] = out["ours"]["median_cpu_s"] / out["tunix"]["median_cpu_s"]
    pairs = zip(out["ours"]["pair_medians_s"], out["tunix"]["pair_medians_s"], strict=True)
    out["pair_ratios"] = [o / t for o, t in pairs]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tunix-venv", default=str(ROOT / ".venv-tunix"), help="the venv holding google-tunix==0.1.7")
    ap.add_argument("--pairs", type=int, default=5, help="alternating (ours, Tunix) rounds per mesh and case")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per side in each round (after compiling)")
    ap.add_argument("--meshes", default="1,2x2", help="comma-separated: 1 (one device), 2x2 (4 CPU devices)")
    ap.add_argument("--cases", default="kl,nokl", help="comma-separated: kl, nokl")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for our side only (experiments; the default run uses our defaults)")
    ap.add_argument("--tunix-remat", default="none", choices=("none", "block", "decoder"),
                    help="Tunix's Qwen3 remat_config (its default: none, as is ours)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a worker may take to compile or answer")
    ap.add_argument("--json", help="also write every raw number here")
    args = ap.parse_args(argv)
    tunix_python = Path(args.tunix_venv) / "bin" / "python"
    if not tunix_python.exists():
        raise SystemExit(f"{tunix_python} not found: `make bench-tunix` creates that venv (google-tunix==0.1.7)")
    meshes = [m for m in args.meshes.split(",") if m]
    cases = [c for c in args.cases.split(",") if c]
    pythons = {"ours": sys.executable, "tunix": str(tunix_python)}
    extras = {"ours": [a for kv in args.set for a in ("--set", kv)], "tunix": ["--tunix-remat", args.tunix_remat]}

    started = time.time()
    load_start = os.getloadavg()
    machine = f"{platform.system()} {platform.machine()}, {cpu_name()}, {os.cpu_count()} cores"
    print(f"{machine}; 1-min load average at start {load_start[0]:.2f}", flush=True)
    measured: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tunix-sbs-") as tmp:
        for mesh in meshes:
            measured[mesh] = measure_mesh(mesh, cases, args, pythons, extras, Path(tmp))
    results = {(m, c): summarize(measured[m], c) for m in meshes for c in cases}
    load_end = os.getloadavg()
    loads = [x for m in meshes for x in measured[m]["loads"]]

    print()
    print(f"GRPO update step (fwd + bwd + clip + AdamW), {ROWS} rows x ({PROMPT_LEN} + {NEW_TOKENS}) tokens, tiny "
          f"Qwen3 (d {MODEL['d_model']}, {MODEL['n_layers']} layers, {MODEL['n_heads']}/{MODEL['n_kv_heads']} heads x "
          f"{MODEL['head_dim']}, d_ff {MODEL['d_ff']}, vocab {MODEL['vocab_size']}, fp32, the same weights); median "
          f"s/step over {args.pairs} alternating pairs x {args.steps} steps per side")
    if args.set:
        print(f"our side with overrides: {' '.join(args.set)}")
    print("| mesh | case | ours (s/step) | Tunix (s/step) | ours / Tunix | per-pair ratios | CPU s/step ours / Tunix "
          "(ratio) | first-step grad norm ours / Tunix |")
    print("|" + "---|" * 8)
    for (mesh, case), r in results.items():
        mesh_name = "1 device" if mesh == "1" else "2 x 2 (4 CPU devices)"
        ratios = r["pair_ratios"]
        print(f"| {mesh_name} | {CASE_NAMES[case]} | {r['ours']['median_s']:.3f} | {r['tunix']['median_s']:.3f} | "
              f"**{r['ratio']:.2f}** | {min(ratios):.2f}-{max(ratios):.2f} | {r['ours']['median_cpu_s']:.3f} / "
              f"{r['tunix']['median_cpu_s']:.3f} ({r['cpu_ratio']:.2f}) | "
              f"{r['ours']['first_grad_norm']:.5f} / {r['tunix']['first_grad_norm']:.5f} |")
    for mesh in meshes:
        r = results[(mesh, cases[0])]
        compile_s = {side: "/".join(f"{results[(mesh, c)][side]['compile_s']:.1f}" for c in cases)
                     for side in ("ours", "tunix")}
        print(f"mesh {mesh}: ours {r['ours']['layout']}; Tunix {r['tunix']['layout']}; first (compiling) call "
              f"{'/'.join(cases)}: ours {compile_s['ours']} s, Tunix {compile_s['tunix']} s")
    print(f"{machine}; 1-min load average: start {load_start[0]:.2f}, before each pair {min(loads):.2f}-"
          f"{max(loads):.2f} (mean {statistics.mean(loads):.2f}), end {load_end[0]:.2f}; total "
          f"{time.time() - started:.0f} s")
    worst = max(r["ratio"] for r in results.values())
    print(f"goal (ours <= 0.8 x Tunix in every case): {'met' if worst <= 0.8 else 'NOT met'}, worst ratio {worst:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "args": vars(args), "load_start": load_start, "load_end": load_end,
                       "summary": {f"{m}/{c}": r for (m, c), r in results.items()}, "measured": measured}, f, indent=1)


if __name__ == "__main__":
    main()
