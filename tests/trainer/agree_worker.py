"""One process of tests/trainer/test_agree.py (`python -m tests.trainer.agree_worker`, started by run_local with 2 CPU
devices per process): the processes agree on host values, and each step's stop-flag agreement is followed at once by
a program over each process's second device, as the sampling follows it with placement split within each host."""

from __future__ import annotations

STEPS = 30


def main() -> None:
    from trainer.run.distributed import initialize_from_env

    initialize_from_env()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from trainer.rl import agree
    from trainer.rl.checkpoint import StopFlag

    me, n = jax.process_index(), jax.process_count()
    assert agree.allgather(np.int32(me)).tolist() == list(range(n))
    assert agree.broadcast({"from": me}, source=n - 1) == {"from": n - 1}
    agree.barrier("agree-worker")

    # The sampler's mesh with placement split within each host: the second device of every process, in process order,
    # as jax.experimental.multihost_utils groups them too.
    second = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)[1] for p in range(n)]
    mesh = Mesh(np.array(second), ("x",))
    rows, cols = 64 * n, 256
    sharded = NamedSharding(mesh, P("x"))
    x = jax.make_array_from_callback((rows, cols), sharded, lambda i: np.full((rows, cols), 1e-3, np.float32)[i])

    @jax.jit
    def sample(x: jax.Array) -> jax.Array:  # an all-gather over the mesh each iteration, as the sampler's weights
        def body(i: jax.Array, a: jax.Array) -> jax.Array:
            full = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P()))
            return jax.lax.with_sharding_constraint(jnp.tanh(full @ full.T[:, :cols]) * 1e-3 + a, sharded)
        return jax.lax.fori_loop(0, 50, body, x)

    stop = StopFlag()
    jax.block_until_ready(sample(x))
    for _ in range(STEPS):
        assert not stop.agreed()
        jax.block_until_ready(sample(x))
    print(f"process {me}: {STEPS} agreements, each followed by a sampling-like program", flush=True)


if __name__ == "__main__":
    main()
