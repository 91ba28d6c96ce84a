"""The reference workloads, compiled for their real TPU slices on this CPU machine (libtpu ahead-of-time).

    .venv/bin/python -m bench.fit_reference [--only NAME ...] [--json FILE]

Each row is `gke-tpu-rl fit --config trainer/configs/CONFIG --tpu TPU --slices N` on the bundled config.json of
the model (no weights needed). Long: every program of a 70B model compiles in 1-4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "trainer" / "configs"


@dataclass(frozen=True)
class Workload:
    name: str
    config: str
    tpu: str
    slices: int
    model: str


WORKLOADS = (
    Workload("Qwen3-0.6B GRPO, dev (v6e 2x2)", "qwen3-0.6b-grpo-v6e-2x2.yaml", "v6e:2x2", 1, "Qwen3-0.6B"),
    Workload("Qwen3-8B GRPO, v6e 4x4", "qwen3-8b-grpo-v6e-4x4.yaml", "v6e:4x4", 1, "Qwen3-8B"),
    Workload("Llama-3.1-70B GRPO, v5p 4x4x4", "llama3.1-70b-grpo-v5p-4x4x4.yaml", "v5p:4x4x4", 1, "Llama-3.1-70B"),
    Workload("Llama-3.1-70B GSPO, v5p 4x4x4", "llama3.1-70b-gspo-v5p-4x4x4.yaml", "v5p:4x4x4", 1, "Llama-3.1-70B"),
    Workload("Llama-3-70B-size GRPO, 2 x v6e 4x4", "llama3-70b-grpo-2xv6e-4x4.yaml", "v6e:4x4", 2, "Llama-3.1-70B"),
)


def run(w: Workload) -> dict:
    from infra.offline.fit import file_job
    from trainer.fit.preflight import fit

    job = file_job(str(CONFIGS / w.config), w.tpu, w.slices)
    t0 = time.perf_counter()
    report = fit(job.cfg, job.target, title=w.name, model=w.model)
    out = report.to_json()
    out["compile_seconds_total"] = time.perf_counter() - t0
    out["workload"] = w.name
    out["config"] = w.config
    return out


def row(r: dict) -> str:
    progs = [p for p in r["programs"] if p["status"] != "skipped"]
    worst = max(progs, key=lambda p: p["peak"] if p["peak"] else p.get("oom_required") or 0)
    hbm = r["hbm_limit"]  # the basis every share of the report is of (libtpu's usable HBM where it was read)
    peak = worst["peak"] or worst.get("oom_required") or 0
    verdict = "yes" if r["fits"] else "**no**"
    batch = f"{r['batch']} x ({r['prompt_len']} + {r['new_tokens']})"
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    # No time or MFU for a config that does not fit (the report gives null and says why).
    step = "—" if r["step_seconds"] is None else f"{r['step_seconds']:.1f} s"
    mfu = "—" if r["mfu"] is None else f"{r['mfu']:.0%}"
    bound = "—" if r["step_lower_bound"] is None else f"{r['step_lower_bound']:.1f} s"
    ratio = "—" if r["bound_ratio"] is None else f"{r['bound_ratio']:.2f}x"
    return (f"| {r['workload']} | {mesh} | {batch} | {verdict} | {peak / 2**30:.1f} GiB ({peak / hbm:.0%} of "
            f"{r['share_of']}, {worst['name']}) | {step} | {bound} | {ratio} | {mfu} | "
            f"{r['compile_seconds_total']:.0f} s |")


def phase_row(r: dict) -> str:
    """Per program and sampler phase: estimated seconds per step / lower bound."""
    p = {x["name"]: x for x in r["programs"]}
    runs = ", ".join(f"{ph['name']} {ph['runs']} x {ph['seconds'] * 1e3:.2f} ms" for ph in r["phases"] if ph["runs"])
    b = r["sample_bounds"]
    cells = [f"{p[n]['seconds']:.2f} s / {p[n]['lower_bound']:.2f} s" if p[n]["status"] != "skipped" else "—"
             for n in ("sample", "ref_logprobs", "update")]
    return (f"| {r['workload']} | {runs} | {b['prefill']:.2f} s + {b['decode']:.2f} s | " + " | ".join(cells) + " |")


HEADER = ("| workload | mesh | batch (sequences x tokens) | fits | peak HBM per chip (share, program) | "
          "est. step | lower bound | est. / bound | est. MFU | compile here |\n" + "|---" * 10 + "|")
PHASE_HEADER = ("| workload | sampler phases (runs x compiled time) | sample bound (prefill + decode) | sample est. / "
                "bound | ref_logprobs | update |\n|---|---|---|---|---|---|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="substrings of workload names to run")
    ap.add_argument("--json", type=Path, help="write every report here")
    args = ap.parse_args()
    chosen = [w for w in WORKLOADS if not args.only or any(s.lower() in w.name.lower() for s in args.only)]
    results = []
    for w in chosen:
        print(f"compiling {w.name} ...", flush=True)
        results.append(run(w))
        print(row(results[-1]), flush=True)
    print()
    print(HEADER)
    for r in results:
        print(row(r))
    print()
    print(PHASE_HEADER)
    for r in results:
        print(phase_row(r))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
