"""The trainer on one GPU: its ceilings, cuDNN attention against the einsum, the update's MFU and decode against the
HBM roofline (issue 20). Run on a GPU machine: `python -m bench.gpu --json FILE` (`--small` runs the same code at toy
sizes, on any backend, in about a minute: how it is checked off GPU).

Measured, in this order (the most wanted first, each part printed and written to the JSON as it finishes, so a run
cut short keeps what it measured):
1. ceilings: a bf16 8192^3 matmul (FLOP/s) and a device-to-device elementwise pass (bytes read + written / s);
2. attention: `compute.attention: cudnn` (rows packed valid-first, `jax.nn.dot_product_attention` on cuDNN) against
   the einsum path, both from the same bf16 inputs, each against a float32 einsum reference, values and gradients,
   with left, interior and trailing pads; and forward + backward time of each;
3. the update: the trainer's own update program (`trainer.rl.step.build_programs`) on a ~1B Llama-3.2-1B-shaped model
   (random weights), with einsum and cuDNN attention; step time, tokens/s and MFU = model FLOPs
   (bench.common.update_flops) / time / the measured bf16 peak;
4. decode: the trainer's own sample program (prefill + decode loop, continuous batching off: every row decodes
   `new` tokens, no EOS) against its HBM roofline: per decode step the bf16 weights plus each row's live KV cache
   read once at the measured bandwidth, the prefill at its FLOPs over the measured peak. With the defaults and with
   256-slot blocks (unrolled, or in a loop); `--hlo-dir` writes each variant's optimised HLO (how the kernels of a
   step were counted); decode_step and decode_profile time one step alone, the latter under jax.profiler.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import layer_params, update_flops
from trainer.base.config import ModelConfig, config_from_dict
from trainer.fit.flops import param_count
from trainer.model import attention as A
from trainer.model import decoder as M
from trainer.model.sharding import make_mesh
from trainer.rl.batch import replicate
from trainer.rl.step import build_programs

f32 = jnp.float32


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall seconds of `fn()` (blocked until ready) after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(n: int, copy_bytes: int) -> dict[str, float]:
    ka, kb = jax.random.split(jax.random.key(0))
    a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in (ka, kb))
    dot = jax.jit(jnp.dot)
    t_dot = median_time(lambda: dot(a, b), 10)
    x = jax.random.normal(ka, (copy_bytes // 2,), jnp.bfloat16)
    bump = jax.jit(lambda x: x + jnp.bfloat16(1))  # reads and writes every byte once
    t_copy = median_time(lambda: bump(x), 10)
    return {"matmul_n": n, "bf16_flops": 2 * n**3 / t_dot, "copy_bytes": copy_bytes,
            "hbm_bytes_per_s": 2 * copy_bytes / t_copy}


def _rel(a: jax.Array, b: jax.Array) -> float:
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def attention_check(B: int, T: int, H: int, K: int, E: int, repeats: int) -> dict[str, Any]:
    """Packed cuDNN attention and the bf16 einsum, each against a float32 einsum of the same bf16 inputs."""
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(kk, (B, T, n, E), f32).astype(jnp.bfloat16)
               for kk, n in zip(keys, (H, K, K), strict=True))
    valid_np = np.ones((B, T), bool)
    valid_np[0, : T // 3] = False  # a left-padded prompt
    valid_np[1 % B, T // 5: T // 3] = False  # a right-padded prompt before its completion
    valid_np[2 % B, -T // 7:] = False  # a completion cut short
    valid = jnp.asarray(valid_np)
    slot = jnp.arange(T)
    mask = valid[:, None, :] & (slot[None, None, :] <= slot[None, :, None])
    w = jnp.cos(jnp.arange(E, dtype=f32))

    def einsum(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return A.attention(q, k, v, mask)

    def packed(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        order, back, lengths = A.packed_order(valid)
        take = lambda x, o: jnp.take_along_axis(x, o[:, :, None, None], axis=1)  # noqa: E731
        out = A.packed_attention(take(q, order), take(k, order), take(v, order), lengths)
        return take(out, back)

    def loss(attend: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out = attend(q, k, v).astype(f32) * valid[:, :, None, None]  # pad queries' outputs are never used
        return jnp.sum(out * w)

    def program(attend: Callable[..., jax.Array]) -> Any:
        return jax.jit(jax.value_and_grad(lambda *a: loss(attend, *a), argnums=(0, 1, 2)))

    ref_out = jax.jit(lambda *a: einsum(*a))(*(x.astype(f32) for x in (q, k, v))) * valid[:, :, None, None]
    _, ref_g = program(einsum)(*(x.astype(f32) for x in (q, k, v)))
    out: dict[str, Any] = {"shape": {"B": B, "T": T, "H": H, "K": K, "E": E}}
    for name, attend in (("einsum_bf16", einsum), ("packed", packed)):
        fwd = jax.jit(lambda *a, attend=attend: attend(*a) * valid[:, :, None, None])
        got = fwd(q, k, v)
        prog = program(attend)
        _, g = prog(q, k, v)
        hlo = prog.lower(q, k, v).compile().as_text()
        out[name] = {
            "out_rel_err": _rel(got, ref_out),
            "grad_rel_err": {n: _rel(a, b) for n, a, b in zip("qkv", g, ref_g, strict=True)},
            "finite": bool(all(np.isfinite(np.asarray(x, np.float32)).all() for x in (got, *g))),
            "cudnn_in_program": "cudnn" in hlo.lower() and "fmha" in hlo.lower(),
            "fwd_bwd_s": median_time(functools.partial(prog, q, k, v), repeats),
        }
    return out


def model_1b() -> ModelConfig:
    """Llama-3.2-1B's shape (1.24B parameters, tied embeddings, GQA 32 / 8 heads of 64), random weights."""
    return ModelConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                       d_ff=8192, max_seq_len=4096, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
                       rope_type="llama3", rope_factor=32.0, rope_original_max_len=8192)


def model_small() -> ModelConfig:
    return ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=256,
                       max_seq_len=512, tie_embeddings=True)


def train_cfg(mcfg: ModelConfig, rows: int, P: int, N: int, compute: dict[str, Any],
              sampling: dict[str, Any] | None = None) -> Any:
    return config_from_dict({
        "model": mcfg.model_dump(),
        "mesh": {"slices": 1, "fsdp": 1, "tensor": 1},
        "task": {"name": "digits"},
        "compute": {"param_dtype": "float32", "dtype": "bfloat16", **compute},
        "rl": {"group_size": rows, "prompts_per_step": 1, "mu_iterations": 1},
        "sampling": {"max_new_tokens": N, "max_prompt_len": P, "temperature": 1.0, "continuous_batching": False,
                     **(sampling or {})},
        "optim": {"lr": 1e-5},
        "steps": 100,
        "progress": False,
    })


def _batch(rows: int, P: int, N: int, V: int) -> dict[str, jax.Array]:
    """Ragged prompts (left-padded to P, 3/4 of P on average) and completions every token of which counts."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(P // 2, P + 1, rows)
    prompt_valid = (np.arange(P)[None, :] >= (P - lengths)[:, None]).astype(np.int32)
    return {
        "prompt": jnp.asarray(rng.integers(3, V, (rows, P)) * prompt_valid, jnp.int32),
        "prompt_valid": jnp.asarray(prompt_valid),
        "completion": jnp.asarray(rng.integers(3, V, (rows, N)), jnp.int32),
        "mask": jnp.ones((rows, N), jnp.int32),
        "rewards": jnp.asarray(rng.uniform(size=(rows, 1)), f32),
        "old_logp": jnp.zeros((rows, N), f32),
    }


def update_run(mcfg: ModelConfig, rows: int, P: int, N: int, compute: dict[str, Any], repeats: int,
               peak: float) -> dict[str, Any]:
    cfg = train_cfg(mcfg, rows, P, N, compute)
    mesh = make_mesh(1, 1, 1, jax.devices()[:1])
    programs = build_programs(cfg, mesh, 0, -1)
    with jax.set_mesh(mesh):
        params = programs.init_params(replicate(mesh, np.asarray(jax.random.key_data(jax.random.key(0)))))
        opt_state = programs.init_opt(params)
        batch = _batch(rows, P, N, mcfg.vocab_size)
        batch["old_logp"] = programs.ref_logprobs(params, batch)  # on-policy: ratio 1, as in a real step
        t0 = time.perf_counter()
        compiled = programs.update.lower(params, opt_state, batch, None).compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        state = [params, opt_state]

        def step() -> Any:
            state[0], state[1], metrics = compiled(state[0], state[1], batch, None)
            return state[0], metrics

        t = median_time(step, repeats)
        loss = float(step()[1]["loss"])
    flops = update_flops(mcfg, rows, P, N)
    return {
        "compute": cfg.compute.model_dump(exclude_none=True),
        "attention_resolved": cfg.compute.on_platform(jax.devices()[0].platform).attention,
        "rows": rows, "tokens": rows * (P + N), "compile_s": compile_s,
        "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
        "update_s": t, "tokens_per_s": rows * (P + N) / t, "model_flops": flops, "mfu": flops / t / peak,
        "loss_finite": bool(np.isfinite(loss)), "_logp": np.asarray(batch["old_logp"]),
    }


def decode_step_run(mcfg: ModelConfig, rows: int, P: int, N: int, compute: dict[str, Any], repeats: int,
                    bw: float, trace_dir: str | None = None) -> dict[str, Any]:
    """One decode step alone (`trainer.rl.sampler.decode_step`, jitted, the cache donated) with every row's cache
    live up to slot P + N / 2: the step's own cost, without the sampler's loop around it. The weights as the sampler
    holds them (one array per layer where `step.UNSTACKED_SAMPLER_PLATFORMS` says). `trace_dir`: `repeats` more
    steps traced by jax.profiler (`trace_summary`; a whole sample call's trace, ~250,000 kernels, did not finish
    in 230 s on an H100)."""
    from trainer.rl.sampler import decode_step
    from trainer.rl.step import UNSTACKED_SAMPLER_PLATFORMS

    cfg = train_cfg(mcfg, rows, P, N, compute)
    platform = jax.devices()[0].platform
    cc = cfg.compute.on_platform(platform)
    dt = M.compute_dtype(mcfg, cc)
    params = M.cast_weights(M.init_params(mcfg, jax.random.key(0)), dt)
    if platform in UNSTACKED_SAMPLER_PLATFORMS:
        params = M.unstack_layers(params)
    cache = M.init_cache(mcfg, rows, P + N, cc)
    live = P + N // 2
    cache = M.KVCache(cache.k_LBSKE + jnp.asarray(0.01, dt), cache.v_LBSKE + jnp.asarray(0.01, dt),
                      cache.valid_BS.at[:, :live].set(True))
    # The weights are an argument: closed over, they would be compiled in as 2.5 GB of constants (minutes of compile)
    step = jax.jit(lambda p, c, tok: decode_step(p, mcfg, tok, jnp.ones((rows,), bool),
                                                 jnp.full((rows,), live, jnp.int32), live, c, cc, None),
                   donate_argnums=1)
    state = [cache]
    tok = jnp.ones((rows,), jnp.int32)

    def run() -> Any:
        logits, state[0] = step(params, state[0], tok)
        return logits

    t = median_time(run, repeats)
    kv = 2 * mcfg.n_layers * mcfg.n_kv_heads * mcfg.head_dim * 2 * rows * live
    floor = (2 * param_count(mcfg) + kv) / bw
    out = {"compute": compute, "rows": rows, "live_slots": live, "step_ms": 1e3 * t, "floor_ms": 1e3 * floor,
           "time_over_floor": t / floor}
    if trace_dir:
        out["profile"] = trace_summary(lambda: [run() for _ in range(repeats)][-1], trace_dir, steps=repeats)
    return out


def decode_run(mcfg: ModelConfig, rows: int, P: int, N: int, repeats: int, peak: float, bw: float,
               compute: dict[str, Any] | None = None, sampling: dict[str, Any] | None = None,
               hlo_file: str | None = None) -> dict[str, Any]:
    """The sample program's time against its roofline; `hlo_file`: its optimised HLO written there."""
    cfg = train_cfg(mcfg, rows, P, N, compute or {}, sampling)
    mesh = make_mesh(1, 1, 1, jax.devices()[:1])
    programs = build_programs(cfg, mesh, 0, -1)  # EOS -1 is never drawn: every row decodes N tokens
    batch = _batch(rows, P, N, mcfg.vocab_size)
    with jax.set_mesh(mesh):
        params = programs.init_params(replicate(mesh, np.asarray(jax.random.key_data(jax.random.key(0)))))
        key = replicate(mesh, np.asarray(jax.random.key_data(jax.random.key(1))))
        step = replicate(mesh, np.asarray(0, np.int32))
        args = (params, batch["prompt"], batch["prompt_valid"], key, step)
        t0 = time.perf_counter()
        compiled = programs.sample.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        if hlo_file:
            with open(hlo_file, "w") as f:
                f.write(compiled.as_text())
        run = lambda: compiled(*args)  # noqa: E731
        t0 = time.perf_counter()
        samples = jax.block_until_ready(run())
        first_s = time.perf_counter() - t0
        t = median_time(run, repeats)
    steps = int(samples.steps)
    generated = int(np.asarray(samples.mask_BN).sum())
    # The floor: the prefill's matmul FLOPs at peak; each decode step reads the bf16 weights once (the embedding
    # table only for its B rows, the tied head whole) and every row's live cache (prompt + tokens so far).
    n = param_count(mcfg)
    weights = 2 * n
    kv_per_slot = 2 * mcfg.n_layers * mcfg.n_kv_heads * mcfg.head_dim * 2
    prompt_tokens = int(np.asarray(batch["prompt_valid"]).sum())
    prefill_s = 2 * n * rows * P / peak
    decode_bytes = sum(weights + kv_per_slot * (prompt_tokens + rows * s) for s in range(1, steps + 1))
    floor_s = prefill_s + decode_bytes / bw
    return {
        "compute": compute or {}, "sampling": sampling or {},
        "decode_attention": cfg.compute.on_platform(jax.devices()[0].platform).decode_attention,
        "rows": rows, "prompt": P, "new_tokens": N, "steps": steps, "generated": generated,
        "compile_s": compile_s, "first_call_s": first_s, "sample_s": t, "tokens_per_s": generated / t,
        "roofline_s": floor_s, "roofline_tokens_per_s": generated / floor_s, "time_over_roofline": t / floor_s,
        "decode_step_ms": 1e3 * t / max(steps, 1), "weights_bytes": weights,
    }


def trace_summary(run: Callable[[], Any], trace_dir: str, steps: int = 1, top: int = 30) -> dict[str, Any]:
    """One call of `run` (`steps` steps) under jax.profiler: the device's busy time (the union of its kernels'
    intervals) against the span from its first kernel to its last, so the share the device waits (on the host,
    between launches) shows, and the kernels taking most of it (ms per step, launches per step)."""
    import collections
    import glob
    import gzip

    t0 = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(run())
    wall_us = (time.perf_counter() - t0) * 1e6
    with gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in procs.items() if "/device:GPU" in name}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in device and "dur" in e]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, -1.0
    for a, b in spans:  # the union of the kernels' intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for e in kernels:
        total[e["name"][:120]] += e["dur"]
        count[e["name"][:120]] += 1
    return {"processes": sorted(set(procs.values()))[:20], "wall_ms": wall_us / 1e3,
            "device_busy_ms_per_step": busy / 1e3 / steps, "device_kernels_per_step": len(spans) / steps,
            "span_ms_per_step": (spans[-1][1] - spans[0][0]) / 1e3 / steps if spans else 0.0,
            "top": [[name, round(us / 1e3 / steps, 4), count[name] / steps] for name, us in total.most_common(top)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the figures here (rewritten after each part)")
    ap.add_argument("--small", action="store_true", help="toy sizes: checks the script on any backend")
    ap.add_argument("--parts", help="comma-separated parts to run (default: all), e.g. ceilings,decode,decode_unrolled")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip parts that would start after this")
    ap.add_argument("--hlo-dir", help="write each decode variant's optimised HLO here")
    ap.add_argument("--trace-dir", default="/tmp/bench-gpu-trace", help="decode_profile's jax.profiler trace")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    small = args.small
    dev = jax.devices()[0]
    report: dict[str, Any] = {"jax": jax.__version__, "device": f"{dev.platform} {dev.device_kind}",
                              "small": small}
    failed = False

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    def part(name: str, fn: Callable[[], Any]) -> None:
        nonlocal failed
        if args.parts and name not in args.parts.split(","):
            return
        if time.perf_counter() - start > args.budget_s:
            report[name] = "skipped: over the time budget"
            print(f"[{name}] skipped (budget)", flush=True)
            return
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # one part's failure must not cost the others' figures
            failed = True
            report[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            traceback.print_exc()
        print(f"[{name}] {time.perf_counter() - t0:.1f} s: {json.dumps(report[name], default=str)[:1500]}",
              flush=True)
        save()

    print(report, flush=True)
    part("ceilings", lambda: ceilings(1024 if small else 8192, (1 << 22) if small else (1 << 31)))
    peak = report["ceilings"]["bf16_flops"] if "bf16_flops" in report.get("ceilings", {}) else 1e12
    bw = report["ceilings"]["hbm_bytes_per_s"] if "hbm_bytes_per_s" in report.get("ceilings", {}) else 1e11
    mcfg = model_small() if small else model_1b()
    report["model"] = {"params": param_count(mcfg), "layer_matmul_params": layer_params(mcfg), **mcfg.model_dump()}
    part("attention", lambda: attention_check(*((4, 256, 4, 2, 32) if small else (8, 1024, 32, 8, 64)),
                                              repeats=3 if small else 10))
    rows, P, N = (8, 32, 96) if small else (32, 256, 768)
    logp: dict[str, np.ndarray] = {}

    def update(name: str, compute: dict[str, Any], rows: int = rows) -> dict[str, Any]:
        out = update_run(mcfg, rows, P, N, {"logprob_chunk": 128, **compute}, 2 if small else 5, peak)
        logp[name] = out.pop("_logp")
        return out

    def same_logp(a: str, b: str) -> None:
        """The log-probs of the same weights and batch under two attentions."""
        if a in logp and b in logp:
            d = np.abs(logp[a] - logp[b])
            report[f"logp_{a}_vs_{b}"] = {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
                                          "mean_logp": float(logp[b].mean())}

    part("update_cudnn", lambda: update("cudnn", {"attention": "cudnn", "remat": "full"}))
    part("update_xla", lambda: update("xla", {"attention": "xla", "remat": "full"}))
    same_logp("cudnn", "xla")
    dec = (8, 32, 32) if small else (64, 256, 512)
    reps = 2 if small else 3
    # name: compute and sampling settings over the defaults (on a GPU: the whole cache in one einsum, a bf16 copy of
    # the weights made once before the loop, one array per layer)
    decodes: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "decode": ({}, {}),
        "decode_unrolled": ({"decode_block": 256}, {}),  # 256-slot blocks, the step compiled per live-block count
        "decode_loop": ({"decode_block": 256, "decode_attention": "xla"}, {}),  # the block loop inside the step
        "decode_gather": ({}, {"gather_weights": True}),  # one device: nothing to gather, the same copy
    }
    for name, (cc, sc) in decodes.items():
        part(name, functools.partial(
            decode_run, mcfg, *dec, reps, peak, bw, cc, sc, f"{args.hlo_dir}/{name}.hlo" if args.hlo_dir else None))
    part("decode_step", lambda: decode_step_run(mcfg, *dec, {"decode_block": 256}, 3 if small else 20, bw))
    part("decode_profile", lambda: decode_step_run(mcfg, *dec, {}, 3 if small else 10, bw, args.trace_dir))
    part("update_cudnn_dots", lambda: update("cudnn_dots", {"attention": "cudnn", "remat": "dots"}))
    # Both attentions where the einsum's [T, T] scores fit: a quarter of the batch
    for attention in ("cudnn", "xla"):
        part(f"update_quarter_{attention}", functools.partial(
            update, f"quarter_{attention}", {"attention": attention, "remat": "full"}, rows // 4))
    same_logp("quarter_cudnn", "quarter_xla")
    save()
    report["total_s"] = time.perf_counter() - start
    save()
    print(json.dumps({k: v for k, v in report.items() if k != "model"}, default=str), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
