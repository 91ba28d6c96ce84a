"""A reference config's decode step as fit compiles it (trainer/fit/phases.py), with the XLA block loop or the Pallas
kernel, at one depth, reading 1 block and every block: libtpu's price, temporaries, kernels and cache-sized copies.

    .venv/bin/python -m bench.decode_price qwen3-8b-grpo-v6e-4x4.yaml v6e:4x4 Qwen3-8B pallas 2

Run it at two depths (2 and 4, as fit does) for the per-layer price; bench/README.md "session 5" quotes it.
"""

from __future__ import annotations

import math
import re
import sys
import time

import jax

from infra.offline.fit import file_job
from trainer.fit import phases as FP
from trainer.fit import preflight as F
from trainer.fit.advice import with_settings
from trainer.model.attention import static_decode_blocks
from trainer.model.sharding import make_mesh

BIG = 1_000_000  # elements: a copy this large is a cache block or more, not bookkeeping


def main(argv: list[str]) -> None:
    config, tpu, model, kernel, depth = argv[0], argv[1], argv[2], argv[3], int(argv[4])
    job = file_job(f"trainer/configs/{config}", tpu, 1)
    cfg, _ = F.resolve_model(job.cfg, model)
    F.prepare_environment(job.target)
    devices = F.topology_devices(job.target)
    cfg = with_settings(F._resolve_mesh(cfg, devices, job.target), [f"compute.decode_attention={kernel}"])
    mesh = make_mesh(cfg.mesh.slices, cfg.mesh.fsdp, cfg.mesh.tensor, devices)
    for every in (False, True):
        phase = next(p for p in FP.phases(FP.with_depth(cfg, depth), mesh) if p.name == "decode")
        assert phase.blocks is not None, "this config's decode step reads its cache in one einsum"
        n = phase.blocks[1] if every else 1
        t0 = time.perf_counter()
        with jax.set_mesh(phase.mesh), static_decode_blocks(n):
            compiled = phase.program.lower(*phase.args).compile()
        hlo = compiled.as_text()
        copies = {shape for shape in re.findall(r"= \w+\[([0-9,]+)\]\{[^}]*\} (?:copy|transpose)\(", hlo)
                  if math.prod(int(d) for d in shape.split(",")) > BIG}
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        print(f"{kernel} depth {depth} blocks {n}: {F._optimal_seconds(compiled) * 1e3:.3f} ms, temporaries "
              f"{temp:.1f} MiB, kernels {hlo.count('tpu_custom_call')}, cache-sized copies {sorted(copies)} "
              f"(compiled in {time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
