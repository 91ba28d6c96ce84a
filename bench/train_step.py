"""Train-step throughput and model FLOP utilisation against this machine's measured fp32 matmul peak.

Times (1) the jitted RL update the trainer runs (trainer.rl.train's update program: forward + backward +
AdamW over prompt + completion tokens) on a fixed batch, and (2) whole RL steps (sample, score, update)
through `trainer.rl.train.train`. Run: `.venv/bin/python -m bench.train_step`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import bench_config, machine, matmul_peak_flops, update_flops
from trainer.base.config import TrainConfig, config_from_dict
from trainer.model import decoder as M
from trainer.model.sharding import make_mesh
from trainer.rl.batch import replicate
from trainer.rl.step import build_programs
from trainer.rl.train import train


def train_config(prompts: int, group: int, prompt_len: int, new_tokens: int, steps: int, run_dir: str) -> TrainConfig:
    return config_from_dict(
        {
            "model": bench_config().model_dump(),
            "mesh": {"slices": 1, "fsdp": 1, "tensor": 1},
            "task": {"name": "digits"},
            "rl": {"group_size": group, "prompts_per_step": prompts, "mu_iterations": 1},
            "sampling": {"max_new_tokens": new_tokens, "max_prompt_len": prompt_len, "temperature": 1.0},
            "optim": {"lr": 1e-4},
            "steps": steps,
            "run_dir": run_dir,
            "checkpoint": {"every": 0, "keep": 1, "dir": f"{run_dir}/ckpt", "async_save": False},
            "progress": False,
        }
    )


def time_update(cfg: TrainConfig, repeats: int) -> float:
    """Best wall seconds of the trainer's jitted update on a full-length random batch (every token counts)."""
    mesh = make_mesh(1, 1, 1, jax.devices()[:1])
    programs = build_programs(cfg, mesh, 0, 2)
    B, P, N, V = cfg.batch_size, cfg.prompt_len, cfg.sampling.max_new_tokens, cfg.model_cfg.vocab_size
    keys = jax.random.split(jax.random.key(0), 4)
    with jax.set_mesh(mesh):
        params = programs.init_params(replicate(mesh, np.asarray(jax.random.key_data(keys[0]))))
        opt_state = programs.init_opt(params)
        batch = {
            "prompt": jax.random.randint(keys[1], (B, P), 4, V, jnp.int32),
            "prompt_valid": jnp.ones((B, P), jnp.int32),
            "completion": jax.random.randint(keys[2], (B, N), 4, V, jnp.int32),
            "mask": jnp.ones((B, N), jnp.int32),
            "rewards": jax.random.uniform(keys[3], (B, 1)),
            "old_logp": jnp.zeros((B, N)),
        }
        batch["old_logp"] = programs.ref_logprobs(params, batch)  # on-policy: ratio 1, as in a real step
        best = float("inf")
        for i in range(repeats + 1):  # the first call compiles
            t0 = time.perf_counter()
            params, opt_state, metrics = programs.update(params, opt_state, batch, None)
            jax.block_until_ready((params, metrics))
            if i:
                best = min(best, time.perf_counter() - t0)
    return best


def time_rl_steps(cfg: TrainConfig) -> dict[str, float]:
    """Median step time / completion tokens per second of whole RL steps, skipping the compiling first one."""
    with contextlib.redirect_stdout(io.StringIO()):
        records = train(cfg).records[1:]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in records),
        "completion_tok_s": statistics.median(r["tokens_per_s"] for r in records),
        "completion_len": float(np.mean([r["completion_len"] for r in records])),
        "steps_timed": len(records),
    }


def run(prompts: int, group: int, prompt_len: int, new_tokens: int, repeats: int, rl_steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = train_config(prompts, group, prompt_len, new_tokens, rl_steps, tmp)
        peak = matmul_peak_flops()
        update_s = time_update(cfg, repeats)
        rl = time_rl_steps(cfg)
    B, T = cfg.batch_size, prompt_len + new_tokens
    flops = update_flops(cfg.model_cfg, B, prompt_len, new_tokens)
    return {
        "machine": machine(),
        "model": cfg.model_cfg.model_dump(),
        "params": sum(
            int(np.prod(s))
            for s in jax.tree.leaves(M.param_shapes(cfg.model_cfg), is_leaf=lambda x: isinstance(x, tuple))
        ),
        "batch_rows": B,
        "seq_len": T,
        "matmul": peak,
        "update_s": update_s,
        "update_tok_s": B * T / update_s,
        "update_flops": flops,
        "model_flops_per_s": flops / update_s,
        "mfu_vs_measured_peak": flops / update_s / peak["peak_flops"],
        "rl_step": rl,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3, help="timed update calls (best is reported)")
    ap.add_argument("--rl-steps", type=int, default=4, help="whole RL steps to run (the first is not timed)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    r = run(args.prompts, args.group, args.prompt_len, args.new_tokens, args.repeats, args.rl_steps)
    m = r["matmul"]
    print(r["machine"])
    print(f"model: {r['params']:,} params; batch {r['batch_rows']} rows x {r['seq_len']} tokens")
    print(
        f"fp32 matmul peak (measured): {m['peak_flops'] / 1e9:.0f} GFLOP/s at n={m['best_n']} "
        f"(slowest measurement {m['min_flops'] / 1e9:.0f})"
    )
    print(
        f"update step (fwd+bwd+AdamW): {r['update_s']:.3f} s, {r['update_tok_s']:.0f} tokens/s, "
        f"{r['model_flops_per_s'] / 1e9:.1f} GFLOP/s model = {100 * r['mfu_vs_measured_peak']:.1f}% of measured peak"
    )
    rl = r["rl_step"]
    print(
        f"whole RL step (sample+score+update, median of {rl['steps_timed']}): {rl['step_s']:.3f} s, "
        f"{rl['completion_tok_s']:.0f} completion tokens/s (mean completion {rl['completion_len']:.1f} tokens)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
