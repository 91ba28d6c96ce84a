"""Pushing weights between disjoint device groups of a multi-process JAX job (issue 43): what jax 0.10.2 does.

    .venv/bin/python -m bench.async_rl_push      # 2 local processes x 4 CPU devices, gloo; ~20 s

Each case moves an [8, 8] fp32 array from a trainer group (2 x 2 mesh) to a sampler group (4 x 1 mesh, another
layout) and checks the values that land:
  device_put        jax.device_put onto the sampler's sharding (refused across processes between device sets)
  union permute     one program over both groups: the trainer's shards and empty buffers on the sampler's devices
                    as one [2, ...] array on a (group, x, y) mesh; a jitted x[::-1] (a collective permute) lands each
                    shard on its partner; then a device_put within the sampler's devices gives its layout
for two splits: by process (trainer = process 0's devices, sampler = process 1's) and across both processes.
"""

from __future__ import annotations

import subprocess
import sys
import time

PORT = 29731


def _case(pid: int, name: str, tdevs: list, sdevs: list) -> None:  # noqa: C901 (one readable case)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    want = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    spec = P("x", "y")
    tmesh = Mesh(np.array(tdevs).reshape(2, 2), ("x", "y"))
    sgrid = Mesh(np.array(sdevs).reshape(2, 2), ("x", "y"))  # the sampler's devices in the trainer's shape
    target = NamedSharding(Mesh(np.array(sdevs).reshape(4, 1), ("x", "y")), P("x", None))
    x = jax.make_array_from_callback((8, 8), NamedSharding(tmesh, spec), lambda i: want[i], dtype=np.float32)

    def check(out: jax.Array, t: float) -> str:
        jax.block_until_ready(out)
        ok = all(np.array_equal(np.asarray(s.data), want[s.index]) for s in out.addressable_shards)
        return f"{'ok' if ok else 'WRONG VALUES'} {time.perf_counter() - t:.4f} s"

    for how in ("device_put", "union permute"):
        t = time.perf_counter()
        try:
            if how == "device_put":
                res = check(jax.device_put(x, target), t)
            else:
                union = Mesh(np.stack([np.array(tdevs).reshape(2, 2), np.array(sdevs).reshape(2, 2)]),
                             ("g", "x", "y"))
                ush = NamedSharding(union, P("g", *spec))
                mine = {s.device: s.data for s in x.addressable_shards}
                bufs = []
                for d, idx in ush.addressable_devices_indices_map((2, 8, 8)).items():
                    if d in mine:
                        bufs.append(jnp.expand_dims(mine[d], 0))
                    else:
                        assert idx is not None
                        shape = tuple(len(range(*s.indices(n))) for s, n in zip(idx, (2, 8, 8), strict=True))
                        bufs.append(jax.device_put(np.zeros(shape, np.float32), d))
                u = jax.make_array_from_single_device_arrays((2, 8, 8), ush, bufs, dtype=np.float32)
                moved = jax.jit(lambda a: a[::-1], out_shardings=ush, donate_argnums=0)(u)
                landed = [jnp.squeeze(s.data, 0) for s in moved.addressable_shards if s.device in set(sdevs)]
                on_s = jax.make_array_from_single_device_arrays((8, 8), NamedSharding(sgrid, spec), landed,
                                                                dtype=np.float32)
                res = check(jax.device_put(on_s, target), t)
        except Exception as err:  # noqa: BLE001 (the point is which mechanism jax refuses, and how)
            res = f"refused: {type(err).__name__}: {str(err).splitlines()[0][:150]}"
        print(f"process {pid}  {name:<24} {how:<14} {res}", flush=True)


def child(pid: int) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{PORT}", num_processes=2, process_id=pid)
    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    p0 = [d for d in devs if d.process_index == 0]
    p1 = [d for d in devs if d.process_index == 1]
    _case(pid, "by process", p0, p1)
    _case(pid, "across both processes", p0[:2] + p1[:2], p0[2:] + p1[2:])
    print(f"process {pid}  jax {jax.__version__}", flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        child(int(sys.argv[1]))
        return
    procs = [subprocess.Popen([sys.executable, "-m", "bench.async_rl_push", str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        print("\n".join(line for line in out.splitlines() if line.startswith("process ")))


if __name__ == "__main__":
    main()
