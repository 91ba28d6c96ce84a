"""Sampler throughput: the KV-cache sampler (trainer.rl.sampler.sample) vs recomputing the full sequence
for every new token, greedy, same model and batch. Run: `.venv/bin/python -m bench.sampler`."""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

import jax
import jax.numpy as jnp

from bench.common import bench_config, machine, timed
from trainer.base.config import ModelConfig
from trainer.model.decoder import Params, forward, init_params, logits
from trainer.rl.sampler import sample, to_left_padding

NEVER = -1  # eos id no token can take, so every row generates exactly max_new_tokens in both samplers


def recompute_sample(
    params: Params, cfg: ModelConfig, prompt_BP: jax.Array, valid_BP: jax.Array, *, max_new_tokens: int, pad_id: int
) -> jax.Array:
    """Greedy decoding without a cache: every step runs the model over the whole (P + N)-slot buffer
    (fixed shape, so it compiles once; slots not generated yet are masked out) and reads the last logits."""
    B, P = prompt_BP.shape
    N = max_new_tokens
    prompt_BP, valid_BP = to_left_padding(prompt_BP, valid_BP.astype(bool))
    buf_BT = jnp.concatenate([prompt_BP, jnp.full((B, N), pad_id, prompt_BP.dtype)], axis=1)
    valid_BT = jnp.concatenate([valid_BP, jnp.zeros((B, N), bool)], axis=1)

    def body(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        buf, valid = carry
        x_BTD, _ = forward(params, cfg, buf, valid)
        last_B1D = jax.lax.dynamic_slice_in_dim(x_BTD, P - 1 + i, 1, axis=1)
        tok_B = jnp.argmax(logits(params, cfg, last_B1D)[:, 0], axis=-1).astype(buf.dtype)
        buf = jax.lax.dynamic_update_slice_in_dim(buf, tok_B[:, None], P + i, axis=1)
        valid = jax.lax.dynamic_update_slice_in_dim(valid, jnp.ones((B, 1), bool), P + i, axis=1)
        return buf, valid

    buf_BT, _ = jax.lax.fori_loop(0, N, body, (buf_BT, valid_BT))
    return buf_BT[:, P:]


def run(batch: int, prompt_len: int, new_tokens: list[int], repeats: int) -> dict[str, Any]:
    cfg = bench_config()
    params = init_params(cfg, jax.random.key(0))
    key = jax.random.key(1)
    prompts = jax.random.randint(key, (batch, prompt_len), 4, cfg.vocab_size, jnp.int32)
    # Ragged prompts: each row keeps a different number of real tokens (left pads) as in RL batches.
    lengths = prompt_len - jnp.arange(batch) % (prompt_len // 2)
    valid = jnp.arange(prompt_len)[None, :] >= (prompt_len - lengths)[:, None]
    rows = []
    for n in new_tokens:
        kv = jax.jit(
            lambda p, t, v, n=n: (
                sample(
                    p, cfg, t, v, jax.random.key(0), max_new_tokens=n, eos_id=NEVER, pad_id=0, temperature=0.0
                ).tokens_BN
            )
        )
        rc = jax.jit(lambda p, t, v, n=n: recompute_sample(p, cfg, t, v, max_new_tokens=n, pad_id=0))
        same = bool(jnp.all(kv(params, prompts, valid) == rc(params, prompts, valid)))
        t_kv = timed(functools.partial(kv, params, prompts, valid), repeats)
        t_rc = timed(functools.partial(rc, params, prompts, valid), repeats)
        tokens = batch * n
        rows.append(
            {
                "new_tokens": n,
                "kv_tok_s": tokens / t_kv,
                "recompute_tok_s": tokens / t_rc,
                "speedup": t_rc / t_kv,
                "kv_s": t_kv,
                "recompute_s": t_rc,
                "same_greedy_tokens": same,
            }
        )
    n_par = sum(x.size for x in jax.tree.leaves(params))
    return {
        "machine": machine(),
        "model": cfg.model_dump(),
        "params": n_par,
        "batch": batch,
        "prompt_len": prompt_len,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    res = run(args.batch, args.prompt_len, args.new_tokens, args.repeats)
    print(res["machine"])
    print(f"model: {res['params']:,} params, batch {res['batch']}, prompt {res['prompt_len']} tokens (ragged)")
    print(f"{'new':>5} {'KV tok/s':>10} {'recompute tok/s':>16} {'KV speedup':>11}  same greedy tokens")
    for r in res["rows"]:
        print(
            f"{r['new_tokens']:>5} {r['kv_tok_s']:>10.0f} {r['recompute_tok_s']:>16.0f} {r['speedup']:>10.1f}x"
            f"  {r['same_greedy_tokens']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
