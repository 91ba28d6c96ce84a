"""Elastic Ray Train run of the real trainer on a local CPU "cluster": lose a slice, continue, scale back.

A `ray.cluster_utils.Cluster` on this machine: a head node (the trainer's Ray driver and the Train controller; no
"slice" resource) and two nodes with {"CPU": 1, "slice": 1}, one per "slice". The trainer runs as
`python -m trainer --ray --ray-slices 1:2 --ray-cpu-devices M --ray-worker-resources '{"slice": 1}'`, one Ray
worker (JAX process with M CPU devices) per slice node. While it trains, this script injects failures:

* `--kill-step K`: SIGKILL rank 1's process once K steps are done. Its node stays, so Ray restarts 2 workers.
* `--loss-step L`: remove the node that hosts rank 1 once L steps are done at 2 workers (a lost Spot slice; its
  worker dies with it). Ray restarts on the 1 node left, from the newest intact checkpoint.
* `--readd`: after the first step on 1 worker, add a slice node back; Ray scales back to 2 workers.

A reference run that is never stopped (`--local-processes 2`, the non-Ray launcher, same config) runs first; it
also fills the JAX compile cache the Ray workers then use. Writes a JSON of figures (`--out`): time from each
failure to the next step, steps per worker count, resume points, and the comparison with the reference.

    .venv/bin/python bench/ray_elastic.py --steps 60 --loss-step 8 --readd --out /tmp/ray_elastic.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from trainer.rl.metrics import CLOCK_KEYS  # wall-clock fields of a metrics record

ROOT = Path(__file__).resolve().parents[1]
SLICE = {"slice": 1}
CLOSE_KEYS = ("loss", "pg_loss", "entropy", "grad_norm", "ratio")
EXACT_KEYS = ("reward_mean", "reward_std", "completion_len")
# The demo config, small: 1-2 slices x 2 x 2 (tensor 2) on 4 CPU devices per worker.
DEMO_SETS = ("checkpoint.every=1", "checkpoint.keep=1000", "log_every=1", "progress=false")


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[ray_elastic {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return out


def trainer_args(args: argparse.Namespace, run: Path) -> list[str]:
    return [*(["--config", args.config] if args.config else []), *(f"--set={s}" for s in args.sets), "--run-dir",
            str(run)]


def run_reference(args: argparse.Namespace, run: Path, env: dict[str, str]) -> float:
    """The never-stopped run: 2 local processes, the same mesh as 2 Ray workers."""
    t0 = time.time()
    with (run.parent / "reference.log").open("wb") as out:
        done = subprocess.run([sys.executable, "-m", "trainer", "--local-processes", "2", "--devices-per-process",
                               str(args.devices), *trainer_args(args, run)], cwd=ROOT, env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=args.timeout)
    if done.returncode != 0:
        raise BenchError(f"reference run failed ({done.returncode}); see {run.parent / 'reference.log'}")
    return time.time() - t0


class Chaos:
    """Watches the run's ray_steps.jsonl and injects the failures, in the main thread (Cluster.add_node needs it)."""

    def __init__(self, cluster: Any, run: Path, driver: subprocess.Popen[bytes], deadline: float) -> None:
        self.cluster, self.run, self.driver, self.deadline = cluster, run, driver, deadline
        self.events: list[dict[str, Any]] = []

    def _wait(self, what: str, pred: Any) -> dict[str, Any]:
        while True:
            for rec in read_jsonl(self.run / "ray_steps.jsonl"):
                if pred(rec):
                    return rec
            if self.driver.poll() is not None:
                raise BenchError(f"the run ended ({self.driver.returncode}) while waiting for {what}")
            if time.time() > self.deadline:
                raise BenchError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def _rank1(self, since: float) -> dict[str, Any]:
        """Rank 1's worker record of the current 2-worker attempt (written at its start, after `since`)."""
        while True:
            path = self.run / "ray_worker_1.json"
            info = json.loads(path.read_text()) if path.exists() else None
            if info and info["time"] > since and info["world"] == 2:
                return info
            if time.time() > self.deadline:
                raise BenchError("no rank-1 worker record")
            time.sleep(0.1)

    def _event(self, kind: str, done_steps: int, **extra: Any) -> dict[str, Any]:
        ev = {"kind": kind, "time": time.time(), "done_steps_seen": done_steps, **extra}
        self.events.append(ev)
        log(f"{kind} after {done_steps} steps seen {extra}")
        return ev

    def _after(self, ev: dict[str, Any], world: int | None = None) -> None:
        # The first step of a worker-group attempt that started after the event (rank 0's pid tells attempts apart):
        # a step the old group was finishing when the event came can still be reported after it.
        old = {r["pid"] for r in read_jsonl(self.run / "ray_steps.jsonl") if r["time"] <= ev["time"]}
        rec = self._wait(f"a step after {ev['kind']}", lambda r: r["time"] > ev["time"] and r["pid"] not in old and
                         (world is None or r["world"] == world))
        ev.update(next_step=rec["step"], world_after=rec["world"], next_step_after_s=round(rec["time"] - ev["time"], 1))
        log(f"{ev['kind']}: step {rec['step']} on {rec['world']} worker(s) {ev['next_step_after_s']} s later")

    def kill(self, step: int, since: float) -> float:
        rec = self._wait(f"{step} steps", lambda r: r["step"] + 1 >= step and r["world"] == 2 and r["time"] > since)
        info = self._rank1(since)
        os.kill(info["pid"], signal.SIGKILL)
        ev = self._event("kill", rec["step"] + 1, pid=info["pid"])
        self._after(ev)
        return float(ev["time"])

    def lose_node(self, step: int, since: float) -> float:
        rec = self._wait(f"{step} steps at 2 workers",
                         lambda r: r["step"] + 1 >= step and r["world"] == 2 and r["time"] > since)
        info = self._rank1(since)
        victim = next(n for n in self.cluster.worker_nodes if n.node_id == info["node_id"])
        self.cluster.remove_node(victim, allow_graceful=False)
        ev = self._event("node_loss", rec["step"] + 1, node=info["node_id"][:8], pid=info["pid"])
        self._after(ev)
        return float(ev["time"])

    def readd(self) -> None:
        self.cluster.add_node(num_cpus=1, resources=SLICE)
        ev = self._event("readd", -1)
        self._after(ev, world=2)


def segments(history: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """The steps of each worker-group attempt (rank 0's pid tells them apart); times in s from `t0`."""
    out: list[dict[str, Any]] = []
    for rec in history:
        last = out[-1] if out else None
        if last and rec["pid"] == last["pid"]:
            last.update(last_step=rec["step"], steps=last["steps"] + 1, t_last=rec["time"])
        else:
            out.append({"world": rec["world"], "pid": rec["pid"], "first_step": rec["step"], "last_step": rec["step"],
                        "steps": 1, "t_first": rec["time"], "t_last": rec["time"]})
    for seg in out:
        t_first, t_last = seg.pop("t_first"), seg.pop("t_last")
        seg.update(first_step_at_s=round(t_first - t0, 1), seconds=round(t_last - t_first, 1))
    return out


def checksums(run: Path) -> dict[int, list[int]]:
    out = {}
    ckpt = run / "checkpoints"
    for d in ckpt.iterdir() if ckpt.is_dir() else []:
        meta = d / "meta" / "metadata"
        if d.name.isdigit() and meta.is_file():
            out[int(d.name)] = json.loads(meta.read_text())["checksums"]
    return out


def compare(ray_run: Path, reference: Path, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The final per-step metrics against the never-stopped run, per worker-group attempt (the last run of a step
    counts). Bitwise: every metric but the clock's. Same samples: rewards and completion lengths equal."""
    final = read_jsonl(ray_run / "metrics.jsonl")
    ref = {r["step"]: r for r in read_jsonl(reference / "metrics.jsonl")}
    attempt = {r["step"]: r["pid"] for r in history}  # later runs of a step overwrite earlier ones
    per: dict[int, dict[str, Any]] = {}
    first_differing = first_other_samples = None
    for rec in final:
        other = ref[rec["step"]]
        bitwise = ({k: v for k, v in rec.items() if k not in CLOCK_KEYS}
                   == {k: v for k, v in other.items() if k not in CLOCK_KEYS})
        samples = all(rec[k] == other[k] for k in EXACT_KEYS)
        if not bitwise and first_differing is None:
            first_differing = rec["step"]
        if not samples and first_other_samples is None:
            first_other_samples = rec["step"]
        seg = per.setdefault(attempt[rec["step"]], {"world": None, "steps": [rec["step"], rec["step"]],
                                                    "bitwise_equal": 0, "same_samples": 0, "max_abs_diff_loss": 0.0})
        seg["steps"][1] = rec["step"]
        seg["bitwise_equal"] += bitwise
        seg["same_samples"] += samples
        seg["max_abs_diff_loss"] = max(seg["max_abs_diff_loss"], *(abs(rec[k] - other[k]) for k in CLOSE_KEYS))
    for pid, seg in per.items():
        seg["world"] = next(r["world"] for r in history if r["pid"] == pid)
    mine, theirs = checksums(ray_run), checksums(reference)
    return {
        "final_steps": [r["step"] for r in final],
        "per_attempt": list(per.values()),
        "first_step_not_bitwise_equal": first_differing,
        "first_step_with_other_samples": first_other_samples,
        "checkpoint_checksums_equal": {str(s): mine[s] == theirs[s] for s in sorted(mine) if s in theirs},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="trainer config (default: the embedded demo config with --set's)")
    ap.add_argument("--set", dest="sets", action="append", default=None, metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--devices", type=int, default=4, help="JAX CPU devices per worker (per slice)")
    ap.add_argument("--kill-step", type=int, default=0, help="SIGKILL rank 1 after this many steps (0: no)")
    ap.add_argument("--loss-step", type=int, default=0, help="remove rank 1's node after this many steps (0: no)")
    ap.add_argument("--readd", action="store_true", help="add a slice node back after the first 1-worker step")
    ap.add_argument("--start-timeout", type=float, default=25.0, help="RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S")
    ap.add_argument("--resize-interval", type=float, default=5.0, help="--ray-resize-interval")
    ap.add_argument("--no-reference", action="store_true", help="skip the never-stopped reference run")
    ap.add_argument("--work", default="/tmp/ray_elastic", help="work folder (emptied first)")
    ap.add_argument("--out", help="write the figures here as JSON (default: WORK/figures.json)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole Ray run")
    args = ap.parse_args(argv)
    args.sets = [*(args.sets if args.sets is not None else ([] if args.config else DEMO_SETS)), f"steps={args.steps}"]

    work = Path(args.work).absolute()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out_path = Path(args.out) if args.out else work / "figures.json"
    # A persistent compile cache (unless one is set): a restart loads the programs its attempt already compiled.
    cache = {"JAX_COMPILATION_CACHE_DIR": str(work / "jax-cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    os.environ.update({"JAX_PLATFORMS": "cpu", **({} if "JAX_COMPILATION_CACHE_DIR" in os.environ else cache)})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # os.environ is inherited by the Cluster's raylets and workers
    figures: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "ok": False}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the cluster

    if not args.no_reference:
        log("reference run (never stopped, 2 local processes)")
        figures["reference_s"] = round(run_reference(args, work / "reference", env), 1)
        log(f"reference: {figures['reference_s']} s")

    from ray.cluster_utils import Cluster

    cluster = driver = None
    t_start = time.time()
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        for _ in range(2):
            cluster.add_node(num_cpus=1, resources=SLICE)
        cluster.wait_for_nodes()
        figures["cluster_start_s"] = round(time.time() - t_start, 1)
        run = work / "ray"
        cmd = [sys.executable, "-m", "trainer", "--ray", "--ray-slices", "1:2", "--ray-cpu-devices",
               str(args.devices), "--ray-worker-resources", json.dumps(SLICE), "--ray-address", cluster.address,
               "--ray-resize-interval", str(args.resize_interval), *trainer_args(args, run)]
        denv = {**env, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(args.start_timeout),
                "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}  # worker prints once, not also through the train logger
        log("ray run: " + " ".join(cmd[1:]))
        t_driver = time.time()
        with (work / "ray.log").open("wb") as out:
            driver = subprocess.Popen(cmd, cwd=ROOT, env=denv, stdout=out, stderr=subprocess.STDOUT)
        chaos = Chaos(cluster, run, driver, t_driver + args.timeout)
        since = t_driver
        if args.kill_step:
            since = chaos.kill(args.kill_step, since)
        if args.loss_step:
            chaos.lose_node(args.loss_step, since)
            if args.readd:
                chaos.readd()
        rc = driver.wait(timeout=max(1.0, t_driver + args.timeout - time.time()))
        figures["driver_rc"] = rc
        figures["ray_run_s"] = round(time.time() - t_driver, 1)
        history = read_jsonl(run / "ray_steps.jsonl")
        figures["first_step_s"] = round(history[0]["time"] - t_driver, 1) if history else None
        figures["events"] = [{k: v for k, v in ev.items() if k != "time"} for ev in chaos.events]
        figures["segments"] = segments(history, t_driver)
        figures["steps_per_world"] = {str(w): n for w, n in sorted(Counter(r["world"] for r in history).items())}
        figures["redone_steps"] = sorted(s for s, n in Counter(r["step"] for r in history).items() if n > 1)
        text = (work / "ray.log").read_text(errors="replace")
        figures["resumed_from"] = [int(s) for s in re.findall(r"resuming from checkpoint step (\d+)", text)]
        if not args.no_reference:
            figures["compare"] = compare(run, work / "reference", history)
        figures["ok"] = rc == 0
        log(f"ray run: rc {rc}, {figures['ray_run_s']} s; steps per worker count {figures['steps_per_world']}")
    except BenchError as err:
        figures["error"] = str(err)
        log(f"error: {err}")
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
            driver.wait()
        if cluster is not None:
            cluster.shutdown()
        figures["total_s"] = round(time.time() - t_start + figures.get("reference_s", 0.0), 1)
        out_path.write_text(json.dumps(figures, indent=1) + "\n")
        log(f"figures: {out_path}")
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
