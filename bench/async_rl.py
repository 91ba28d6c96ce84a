"""Asynchronous RL on CPU (issue 43): the demo task learned with rl.lag 0 and 1, and steps per second of colocated
against split placement at equal devices, all in one process on 8 virtual CPU devices.

    .venv/bin/python -m bench.async_rl --json bench/results/async_rl.json --png bench/results/async_rl.png

(a) curves: the demo config (trainer/configs/demo.yaml) as it is (k = 0, colocated on 2 x 2 x 2), on split placement
    (the update on 1 x 2 x 2, sampling on another 1 x 2 x 2) with k = 0, and with rl.lag 1 under each correction (clip,
    decoupled), same seed: reward per step side by side, and the first step whose mean reward reaches 0.9.
(b) speed: the demo model with longer completions (sampling and the update take comparable time), timed between the
    ends of steps after the compiles: colocated k = 0 on all 8 devices, split k = 0 and split k = 1 on 4 + 4.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

from trainer.base.config import load_config  # noqa: E402  (after the device count is set)
from trainer.rl.train import train  # noqa: E402

HALF = {"slices": 1, "fsdp": 2, "tensor": 2}
SPLIT = ["placement.mode=split", f"mesh={json.dumps(HALF)}", f"placement.sampler={json.dumps(HALF)}"]
# (b): a wider model (d_model 256) and 24 new tokens per completion: sampling about as long as the update (mu 2)
SPEED = ["sampling.max_new_tokens=24", "sampling.max_prompt_len=8", "model.max_seq_len=32", "checkpoint.every=0",
         "model.d_model=256", "model.d_ff=768", "model.n_heads=8", "model.n_kv_heads=4", "model.head_dim=32"]


def _run(name: str, overrides: list[str], run_root: Path, steps: int) -> dict[str, Any]:
    ends: list[float] = []
    shutil.rmtree(run_root / name, ignore_errors=True)  # a fresh run, never a resume of the last bench's
    cfg = load_config(None, [*overrides, f"steps={steps}", f"run_dir={run_root / name}", "progress=false",
                             f"log_every={steps}"])
    t0 = time.perf_counter()
    result = train(cfg, on_step=lambda _: ends.append(time.perf_counter()))
    wall = time.perf_counter() - t0
    recs = result.records
    return {"name": name, "overrides": overrides, "wall_s": wall, "ends": [e - t0 for e in ends],
            "reward": [r["reward_mean"] for r in recs], "policy_version": [r["policy_version"] for r in recs],
            "push_bytes": recs[-1]["push_bytes"],
            "phases": {k: [r.get(k, 0.0) for r in recs] for k in
                       ("time/sample_s", "time/score_s", "time/update_s", "time/push_s", "step_time_s")}}


def steps_per_s(run: dict[str, Any], skip: int) -> float:
    """Steps per second between the ends of step `skip - 1` and of the step before the last (the compiles come before,
    the last step waits for the run's final checkpoint)."""
    ends = run["ends"]
    return (len(ends) - 1 - skip) / (ends[-2] - ends[skip - 1])


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def plot(curves: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for i, run in enumerate(curves):
        ax.plot(range(len(run["reward"])), run["reward"], label=run["name"], color=f"C{i}", alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (char_match)")
    ax.set_title("demo task: rl.lag 0 and 1, colocated and split placement")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--curve-steps", type=int, default=60)
    ap.add_argument("--speed-steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="speed runs per layout, interleaved; the best is kept")
    ap.add_argument("--skip", type=int, default=4, help="steps left out of the speed (compiles)")
    ap.add_argument("--run-root", default="runs/bench-async-rl")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args()
    root = Path(args.run_root)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    curves = [_run("k=0 colocated 2x2x2", [], root, args.curve_steps),
              _run("k=0 split 1x2x2 + 1x2x2", SPLIT, root, args.curve_steps),
              _run("k=1 split, clip", [*SPLIT, "rl.lag=1"], root, args.curve_steps),
              _run("k=1 split, decoupled", [*SPLIT, "rl.lag=1", "rl.lag_correction=decoupled"], root,
                   args.curve_steps)]
    full = 'mesh={"slices": 1, "fsdp": 4, "tensor": 2}'
    layouts = [("colocated k=0 (1x4x2)", [*SPEED, full]), ("colocated k=1 (1x4x2)", [*SPEED, full, "rl.lag=1"]),
               ("colocated k=0 (1x2x2, half)", [*SPEED, f"mesh={json.dumps(HALF)}"]),
               ("split k=0 (1x2x2 + 1x2x2)", [*SPEED, *SPLIT]),
               ("split k=1 (1x2x2 + 1x2x2)", [*SPEED, *SPLIT, "rl.lag=1"])]
    # Interleaved rounds: a neighbour's load on the shared cores lands on every layout alike; each reports its best.
    rounds = [[_run(name, o, root, args.speed_steps) for name, o in layouts] for _ in range(args.rounds)]
    speed = []
    for i in range(len(layouts)):
        runs = [r[i] for r in rounds]
        for run in runs:
            run["steps_per_s"] = steps_per_s(run, args.skip)
        best = max(runs, key=lambda run: run["steps_per_s"])
        speed.append({**best, "rounds_steps_per_s": [run["steps_per_s"] for run in runs]})
    k = max(1, min(5, args.curve_steps // 10))
    print(f"\n(a) demo task, mean reward over the first / last {k} steps, wall seconds")
    for run in curves:
        r = run["reward"]
        reached = next((i for i, x in enumerate(r) if x >= 0.9), None)
        print(f"  {run['name']:<28} {sum(r[:k]) / k:.3f} -> {sum(r[-k:]) / k:.3f}   reward >= 0.9 first at step "
              f"{reached}   {run['wall_s']:.1f} s")
    print(f"\n(b) steps/s after {args.skip} steps, best of {args.rounds} rounds (its median phase seconds)   "
          f"cpu cores: {os.cpu_count()}, load average before: {load}")
    print(f"  {'':<28} {'steps/s':>8} {'sample':>7} {'score':>7} {'update':>7} {'push':>7} {'push MB':>8}")
    for run in speed:
        med = {k: _median(v[args.skip:-1]) for k, v in run["phases"].items()}
        print(f"  {run['name']:<28} {run['steps_per_s']:8.3f} {med['time/sample_s']:7.3f} {med['time/score_s']:7.3f} "
              f"{med['time/update_s']:7.3f} {med['time/push_s']:7.4f} {run['push_bytes'] / 1e6:8.2f}   rounds: "
              + ", ".join(f"{x:.3f}" for x in run["rounds_steps_per_s"]))
    base = speed[0]["steps_per_s"]
    print("  ratio to colocated: " + ", ".join(f"{r['name']}: {r['steps_per_s'] / base:.2f}x" for r in speed[1:]))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu_count": os.cpu_count(), "jax": jax.__version__, "load": load,
                                               "curves": curves, "speed": speed}, indent=1) + "\n")
    if args.png:
        plot(curves, Path(args.png))


if __name__ == "__main__":
    main()
