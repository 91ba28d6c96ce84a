"""Slot efficiency and rollout time with and without continuous batching (trainer.rl.sampler, `sampling.
continuous_batching`). Run: `.venv/bin/python -m bench.continuous_batching`.

Two parts:
- **Schedule replay** (no model): for each reference workload's rollout (rows, slots = sampling.max_num_sequences,
  refills of one row per data-parallel group), the slot efficiency (generated tokens / (decode steps x slots)) of a
  long-tailed completion-length distribution, from `trainer.rl.sampler.schedule_steps`, which tests/trainer/
  test_sampler.py checks step for step against the sampler.
- **Measured** on this machine: the bench model samples 64 rows in 16 slots, static chunks against continuous
  batching, side by side in one process (alternating, best of `--repeats`): wall time, generated tokens/s, the
  sampler's own step count, and whether both drew the same tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import bench_config, machine
from trainer.model.decoder import init_params
from trainer.rl.sampler import sample, schedule_steps

# (name, rows per step, slots, data-parallel groups, max new tokens)
WORKLOADS = (
    ("Qwen3-8B, v6e 4x4, 32 slots", 128, 32, 4, 1024),
    ("Llama-3.1-70B, v5p 4x4x4 (config: 128 slots)", 256, 128, 16, 1024),
    ("Llama-3.1-70B, v5p 4x4x4, 64 slots", 256, 64, 16, 1024),
)


def long_tailed(rows: int, cap: int, seed: int = 0) -> list[int]:
    """Log-normal completion lengths (median cap / 8, sigma 1), capped: most completions short, a few at the cap, as
    RL rollouts of reasoning tasks are."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(np.round(rng.lognormal(np.log(cap / 8), 1.0, rows)), 1, cap)]


def replay() -> list[dict[str, Any]]:
    out = []
    for name, rows, slots, groups, cap in WORKLOADS:
        lengths = long_tailed(rows, cap)
        tokens = sum(lengths)
        static = schedule_steps(lengths, slots, continuous=False)
        cont = schedule_steps(lengths, slots, continuous=True, refill_rows=groups)
        out.append({"workload": name, "rows": rows, "slots": slots, "refill_rows": groups, "tokens": tokens,
                    "median_len": float(np.median(lengths)), "max_len": max(lengths),
                    "static_steps": static, "continuous_steps": cont,
                    "static_efficiency": tokens / (static * slots), "continuous_efficiency": tokens / (cont * slots)})
    return out


def measured(rows: int, slots: int, new_tokens: int, repeats: int) -> dict[str, Any]:
    cfg = bench_config()
    params = init_params(cfg, jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (rows, 32), 4, cfg.vocab_size, jnp.int32)
    valid = jnp.arange(32)[None, :] >= (jnp.arange(rows) % 16)[:, None]  # ragged left-padded prompts
    stops = (4, 5)  # 2 of 100 ids end a row: geometric lengths, mean ~50, capped at new_tokens
    fns = {name: jax.jit(functools.partial(sample, cfg=cfg, max_new_tokens=new_tokens, eos_id=stops, pad_id=0,
                                           temperature=1.0, max_num_sequences=slots, continuous=cont))
           for name, cont in (("static", False), ("continuous", True))}
    outs = {name: jax.block_until_ready(f(params, prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(2)))
            for name, f in fns.items()}  # compiles
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(params, prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(2)))
            best[name] = min(best[name], time.perf_counter() - t0)
    tokens = int(outs["static"].mask_BN.sum())
    res: dict[str, Any] = {"rows": rows, "slots": slots, "max_new_tokens": new_tokens, "tokens": tokens,
                           "same_tokens": bool(jnp.array_equal(outs["static"].tokens_BN, outs["continuous"].tokens_BN))}
    for name, out in outs.items():
        steps = int(out.steps)
        res[name] = {"seconds": best[name], "tokens_per_s": tokens / best[name], "steps": steps,
                     "slot_efficiency": tokens / (steps * slots)}
    res["speedup"] = best["static"] / best["continuous"]
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    res: dict[str, Any] = {"machine": machine(), "replay": replay(),
                           "measured": measured(args.rows, args.slots, args.new_tokens, args.repeats)}
    print(res["machine"])
    print("schedule replay, log-normal lengths (median max/8, sigma 1):")
    for r in res["replay"]:
        print(f"  {r['workload']}: {r['rows']} rows, median {r['median_len']:.0f}, max {r['max_len']} tokens; "
              f"slot efficiency static {r['static_efficiency']:.0%} ({r['static_steps']} steps) -> continuous "
              f"{r['continuous_efficiency']:.0%} ({r['continuous_steps']} steps, refills of {r['refill_rows']})")
    m = res["measured"]
    print(f"measured: {m['rows']} rows in {m['slots']} slots, up to {m['max_new_tokens']} new tokens, "
          f"{m['tokens']} generated; same tokens: {m['same_tokens']}")
    for name in ("static", "continuous"):
        x = m[name]
        print(f"  {name:>10}: {x['seconds']:.3f} s, {x['tokens_per_s']:,.0f} tok/s, {x['steps']} steps, "
              f"slot efficiency {x['slot_efficiency']:.0%}")
    print(f"  speedup {m['speedup']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
