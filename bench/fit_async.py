"""fit's estimates for placement split (issue 43, docs/async-rl.md "What fit estimates for TPU"): a config's splits
compiled with libtpu on this CPU machine, one CompileCache for all (the colocated layout is fitted once per sampler
tensor degree), each split's step, push and ratio to colocated printed and its JSON report written.

    PYTHONPATH=. python bench/fit_async.py CONFIG TYPE:TOPOLOGY SLICES OUT_DIR [NAME=--set,--set ...]...

e.g. bench/fit_async.py trainer/configs/qwen3-8b-grpo-async-2xv6e-4x4.yaml v6e:4x4 2 /tmp/fits \\
    t8= t4=placement.sampler.tensor=4
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from infra.offline.fit import file_job
from trainer.fit.preflight import CompileCache
from trainer.fit.split import fit


def main(argv: list[str]) -> None:
    config, tpu, slices, out, *variants = argv
    cache = CompileCache()
    Path(out).mkdir(parents=True, exist_ok=True)
    for variant in variants or ["base="]:
        name, _, sets = variant.partition("=")
        job = file_job(config, tpu, int(slices), [s for s in sets.split(",") if s])
        t0 = time.perf_counter()
        report = fit(job.cfg, job.target, title=f"{job.title} [{name}]", cache=cache,
                     progress=lambda m: print(f"  {time.strftime('%H:%M:%S')} {m}", file=sys.stderr, flush=True))
        wall = time.perf_counter() - t0
        (Path(out) / f"{name}.json").write_text(report.json())
        (Path(out) / f"{name}.txt").write_text(report.text())
        print(f"== {name} ({sets or 'as the file'}): {wall:.0f} s wall", flush=True)
        print("\n".join([report.summary_line(), *report.split_lines()]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
