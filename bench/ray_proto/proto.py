"""Ray Train v2 + JAX (CPU, multi-process) elastic prototype.

Run with the scratch venv (NOT the repo venv):

    # lose a "slice" node, go on with 1 worker, scale back up when it returns:
    .venv/bin/python bench/ray_proto/proto.py --scenario node
    .venv/bin/python bench/ray_proto/proto.py --scenario kill   # SIGKILL one worker process (resources stay)

Each Ray Train worker is one JAX process with --devices virtual CPU devices. The loop sets up
jax.distributed itself (Ray's JaxBackend does nothing when use_tpu=use_gpu=False), trains a tiny
data-parallel linear model on a mesh of all devices of all workers, and saves an orbax checkpoint
every step to a shared directory (our own, not Ray's checkpoint). After a failure the new worker
group restores the latest orbax step onto the new mesh and continues.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import ray
import ray.train
from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from ray.train.v2.jax import JaxTrainer

T0 = time.time()


# --------------------------------------------------------------------------- optional: Ray-side jax.distributed
# JaxConfig/_JaxBackend.on_start returns immediately unless use_tpu or use_gpu is set, so on CPU Ray never
# calls jax.distributed.initialize. This backend does it for CPU, the way _JaxBackend does for TPU/GPU
# (rank 0 picks addr:free port, every worker initializes with num_processes=len(group), process_id=rank).
# JAX options must come from env vars here (JAX_PLATFORMS, JAX_NUM_CPU_DEVICES,
# JAX_CPU_COLLECTIVES_IMPLEMENTATION) because initialize runs before the train loop.
from ray.train._internal.utils import get_address_and_port  # noqa: E402
from ray.train.v2.jax.config import JaxConfig, _JaxBackend, _shutdown_jax_distributed  # noqa: E402


def _cpu_jax_init(coord: str, n: int, i: int) -> None:
    import jax

    jax.distributed.initialize(coordinator_address=coord, num_processes=n, process_id=i)


class _CpuJaxBackend(_JaxBackend):
    def on_start(self, worker_group, backend_config):
        addr, port = worker_group.execute_single(0, get_address_and_port)
        n = len(worker_group)
        ray.get([worker_group.execute_single_async(i, _cpu_jax_init, f"{addr}:{port}", n, i) for i in range(n)])

    def on_shutdown(self, worker_group, backend_config):
        # Best effort, like the stock backend: after a failure some actors are already dead
        # (ActorDiedError) and a survivor's shutdown barrier may never complete.
        try:
            ray.get(worker_group.execute_async(_shutdown_jax_distributed), timeout=10)
        except Exception as e:  # noqa: BLE001
            print(f"jax.distributed shutdown skipped: {type(e).__name__}", flush=True)


class CpuJaxConfig(JaxConfig):
    @property
    def backend_cls(self):
        return _CpuJaxBackend


def log(msg: str) -> None:
    print(f"[driver +{time.time() - T0:6.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- worker side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def train_loop_per_worker(cfg: dict) -> None:
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    shared = cfg["shared_dir"]
    t_start = time.time()

    # 1. coordinator address chosen by rank 0 each attempt (fresh port => no collision with a
    #    previous attempt's coordinator that may still be in TIME_WAIT / a dying process).
    coord = None
    if rank == 0:
        coord = f"{ray.util.get_node_ip_address()}:{_free_port()}"
    coord = broadcast_from_rank_zero(coord)

    # 2. jax.distributed, same as trainer/run/distributed.py initialize_from_env would do with
    #    COORDINATOR_ADDRESS=coord NUM_SLICES=world SLICE_INDEX=rank HOSTS_PER_SLICE=1 HOST_INDEX=0.
    import logging

    import absl.logging
    import jax

    absl.logging.set_verbosity(absl.logging.WARNING)  # orbax is very chatty at INFO
    logging.getLogger("absl").setLevel(logging.WARNING)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", cfg["devices"])
    if world > 1 and not cfg["ray_inits_jax"]:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coord, num_processes=world, process_id=rank)
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    t_init = time.time()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    repl = NamedSharding(mesh, P())
    data_sh = NamedSharding(mesh, P("data"))
    attempt_info = dict(
        rank=rank,
        world=world,
        pid=os.getpid(),
        node=ray.get_runtime_context().get_node_id()[:8],
        coord=coord,
        n_devices=len(jax.devices()),
        local_devices=len(jax.local_devices()),
        jax_init_s=round(t_init - t_start, 2),
    )
    with open(os.path.join(shared, f"worker_{rank}.json"), "w") as f:
        json.dump(attempt_info, f)
    print("WORKER", json.dumps(attempt_info), flush=True)

    D, B, lr = 8, 64, 0.05
    w_true = np.arange(1, D + 1, dtype=np.float32) / D
    tx = optax.adam(lr)

    def init_state():
        params = {"w": jnp.zeros((D,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    state_shapes = jax.eval_shape(init_state)
    state_sh = jax.tree.map(lambda _: repl, state_shapes)

    def batch(step: int):
        rng = np.random.default_rng(step)  # same global batch whatever the world size
        x = rng.normal(size=(B, D)).astype(np.float32)
        y = (x @ w_true + 0.3 + 0.01 * rng.normal(size=(B,))).astype(np.float32)
        xs = jax.make_array_from_callback((B, D), data_sh, lambda idx: x[idx])
        ys = jax.make_array_from_callback((B,), data_sh, lambda idx: y[idx])
        return xs, ys

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(p):
            return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(state["params"])
        upd, opt = tx.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], upd), "opt": opt, "step": state["step"] + 1}, loss

    ckpt_dir = os.path.join(shared, "orbax")
    mgr = ocp.CheckpointManager(
        ckpt_dir,
        options=ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=False),
    )
    latest = mgr.latest_step()
    if latest is None:
        state = jax.jit(init_state, out_shardings=state_sh)()
        start = 0
    else:
        target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state_shapes, state_sh)
        state = mgr.restore(latest, args=ocp.args.StandardRestore(target))
        start = int(state["step"])
    t_ready = time.time()
    if rank == 0:
        print(
            f"ATTEMPT world={world} devices={len(jax.devices())} resume_from={latest} "
            f"jax_init={t_init - t_start:.2f}s restore+ready={t_ready - t_init:.2f}s wall={time.time():.2f}",
            flush=True,
        )

    for step in range(start, cfg["steps"]):
        x, y = batch(step)
        state, loss = train_step(state, x, y)
        mgr.save(step + 1, args=ocp.args.StandardSave(state))
        loss = float(loss)
        if rank == 0:
            print(f"STEP {step + 1:3d} world={world} loss={loss:.6f} wall={time.time():.2f}", flush=True)
            with open(os.path.join(shared, "progress"), "a") as f:
                f.write(f"{step + 1} {world} {loss:.6f} {time.time():.3f}\n")
        # Metrics only; checkpointing is ours (orbax dir), so checkpoint=None.
        ray.train.report({"step": step + 1, "loss": loss, "world": world}, checkpoint=None)
        # failure injection for --scenario kill: rank 1 kills its own process once
        if cfg["scenario"] == "kill" and rank == 1 and step + 1 == cfg["kill_step"]:
            marker = os.path.join(shared, "killed")
            if not os.path.exists(marker):
                open(marker, "w").close()
                print(f"WORKER rank 1 pid {os.getpid()} SIGKILL self at step {step + 1}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(cfg["step_sleep"])
    mgr.wait_until_finished()
    mgr.close()
    if world > 1 and not cfg["ray_inits_jax"]:
        jax.distributed.shutdown()


# --------------------------------------------------------------------------- driver side
def read_progress(shared: str) -> list[tuple[int, int, float, float]]:
    p = os.path.join(shared, "progress")
    if not os.path.exists(p):
        return []
    rows = []
    with open(p) as f:
        for line in f:
            s, w, loss, t = line.split()
            rows.append((int(s), int(w), float(loss), float(t)))
    return rows


def node_chaos(cluster, worker_nodes, shared: str, kill_step: int, readd_after_s: float) -> None:
    """Remove the node hosting rank 1 once step >= kill_step (a lost Spot slice); re-add one later."""
    while True:
        rows = read_progress(shared)
        if rows and rows[-1][0] >= kill_step and rows[-1][1] == 2:
            break
        time.sleep(0.2)
    with open(os.path.join(shared, "worker_1.json")) as f:
        info = json.load(f)
    victim = next(n for n in worker_nodes if n.node_id.startswith(info["node"]))
    log(f"removing node {info['node']} (rank 1, pid {info['pid']}) at step {rows[-1][0]}")
    t_kill = time.time()
    cluster.remove_node(victim, allow_graceful=False)
    with open(os.path.join(shared, "t_kill"), "w") as f:
        f.write(str(t_kill))
    if readd_after_s >= 0:
        time.sleep(readd_after_s)
        # Cluster.add_node() installs signal handlers, so it only works on the main thread; from this
        # thread start a plain `ray start --block` node (stopped at the end by terminating it).
        log("adding a replacement node (slice back) via `ray start`")
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        proc = subprocess.Popen(
            [ray_cli, "start", "--block", f"--address={cluster.address}", "--num-cpus=1", '--resources={"slice": 1}'],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        EXTRA_PROCS.append(proc)
        with open(os.path.join(shared, "t_readd"), "w") as f:
            f.write(str(time.time()))


EXTRA_PROCS: list = []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=["kill", "node"], default="node")
    ap.add_argument(
        "--trainer",
        choices=["jax", "dp", "jaxcpu"],
        default="jax",
        help="jax: JaxTrainer (use_tpu=use_gpu=False; loop inits jax.distributed); dp: v2 DataParallelTrainer "
        "(same); jaxcpu: JaxTrainer + CpuJaxConfig (Ray's backend hook inits jax.distributed)",
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-step", type=int, default=10)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--step-sleep", type=float, default=0.3)
    ap.add_argument(
        "--readd-after", type=float, default=45.0, help="node scenario: seconds before the slice comes back (<0: never)"
    )
    ap.add_argument("--resize-interval", type=float, default=5.0)
    ap.add_argument("--shared", default="/tmp/ray_proto_shared")
    args = ap.parse_args()

    shared = os.path.abspath(args.shared)
    shutil.rmtree(shared, ignore_errors=True)
    os.makedirs(shared)
    # RAY_TRAIN_V2_ENABLED defaults to 1 in this Ray; set anyway. Print patch off: avoids every worker
    # print appearing twice (stdout + train log) on the driver.
    env = {
        "JAX_PLATFORMS": "cpu",
        "RAY_TRAIN_V2_ENABLED": "1",
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
        "JAX_NUM_CPU_DEVICES": str(args.devices),
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
    }
    os.environ.update(env)

    cluster = None
    worker_nodes = []
    if args.scenario == "node":
        from ray.cluster_utils import Cluster

        # head: driver + Train controller (num_cpus=0 actor); two "slice" nodes with 1 CPU each.
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        worker_nodes = [cluster.add_node(num_cpus=1, resources={"slice": 1}) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env={"env_vars": env})
        resources = {"CPU": 1, "slice": 1}
    else:
        ray.init(num_cpus=4, runtime_env={"env_vars": env})
        resources = {"CPU": 1}
    log(f"ray {ray.__version__} cluster resources {ray.cluster_resources()}")

    cls = DataParallelTrainer if args.trainer == "dp" else JaxTrainer
    extra: dict[str, Any] = {"jax_config": CpuJaxConfig()} if args.trainer == "jaxcpu" else {}
    scaling = ScalingConfig(
        num_workers=(1, 2),
        use_gpu=False,
        use_tpu=False,
        resources_per_worker=resources,
        elastic_resize_monitor_interval_s=args.resize_interval,
    )
    trainer = cls(
        train_loop_per_worker=train_loop_per_worker,
        train_loop_config=dict(
            shared_dir=shared,
            steps=args.steps,
            kill_step=args.kill_step,
            devices=args.devices,
            scenario=args.scenario,
            step_sleep=args.step_sleep,
            ray_inits_jax=args.trainer == "jaxcpu",
        ),
        scaling_config=scaling,
        # ray types run_config as ray.air's RunConfig (ray.train's name before Train v2); v2 takes its own.
        run_config=RunConfig(  # type: ignore[arg-type]
            name="ray_proto",
            storage_path=os.path.join(shared, "ray_storage"),
            failure_config=FailureConfig(max_failures=3),
        ),
        **extra,
    )
    if cluster is not None:
        threading.Thread(
            target=node_chaos, args=(cluster, worker_nodes, shared, args.kill_step, args.readd_after), daemon=True
        ).start()

    t_fit = time.time()
    try:
        result = trainer.fit()
        log(f"fit() returned in {time.time() - t_fit:.1f}s; error={result.error!r}; metrics={result.metrics}")
    except Exception as e:  # noqa: BLE001
        log(f"fit() raised after {time.time() - t_fit:.1f}s: {type(e).__name__}: {e}")

    rows = read_progress(shared)
    log("progress (step world loss):")
    prev_t, prev_w = 0.0, None  # prev_t is read only once prev_w is set
    for s, w, loss, t in rows:
        note = ""
        if prev_w is not None and (w != prev_w or t - prev_t > 5.0):
            note = f"   <-- world {prev_w}->{w}, {t - prev_t:.1f}s since previous step (restart)"
        print(f"    step {s:3d}  world={w}  loss={loss:.6f}{note}")
        prev_t, prev_w = t, w
    steps = [r[0] for r in rows]
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    log(f"steps logged: {len(steps)}, unique: {len(set(steps))}, repeated: {repeated}")
    for name in ("t_kill", "t_readd"):
        p = os.path.join(shared, name)
        if os.path.exists(p):
            with open(p) as f:
                t = float(f.read())
            after = [r for r in rows if r[3] > t]
            if after:
                s0, w0, _, t0 = after[0]
                log(f"{name}: first step after it = step {s0} (world={w0}) {t0 - t:.1f}s later")
    ray.shutdown()
    for proc in EXTRA_PROCS:
        proc.terminate()
        proc.wait(timeout=60)
    if cluster is not None:
        cluster.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
