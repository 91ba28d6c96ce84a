"""`python -m trainer --ray ...`: the trainer under Ray Train's JaxTrainer, elastic over whole slices.

The driver checks the flags and the config (cli.preflight, and on CPU the mesh for every slice count) before
ray.init, then runs JaxTrainer with ScalingConfig(num_workers=(MIN*H, MAX*H)), H = Ray workers per slice. Every
worker-group attempt runs in new processes: each worker reads its rank and the world size, sets up JAX, puts the
mesh on the slices it got (mesh.slices = world // H, mesh.fsdp = -1) and calls train(), which resumes from the
newest intact checkpoint. The global batch is the same for every slice count; each step reads the same examples
with the same per-row random streams, so after a resize only the placement and the order of sums change.

Any worker's death, and a scale-up when capacity returns, restarts the whole group: the steps since the last
checkpoint are redone, so checkpoint.every bounds the work a resize costs.

Files in the run folder (Ray path only):
- `ray_steps.jsonl`: one line per step from rank 0 (step, world size, rank 0's pid, time, loss), never truncated:
  metrics.jsonl is cut back to the resumed step, this keeps every attempt and the steps it redid;
- `ray_worker_<rank>.json`: rewritten by each worker at each start (pid, node id), to find a worker.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from trainer.base.config import ConfigError, TrainConfig, config_from_dict, resolve_mesh
from trainer.base.placement import RAY_SPLIT_REFUSED

EXIT_RAY_FAILED = 1  # Ray Train gave up (more worker-group failures than --ray-max-failures)
DEFAULT_MAX_FAILURES = 3
DEFAULT_RESIZE_INTERVAL_S = 60.0  # Ray's own default for ScalingConfig(elastic_resize_monitor_interval_s)
# ray.train.report() waits until the controller took the previous report, and the controller polls the workers only
# every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray's default 2 s): reporting every step would cap steps shorter than that
# at one per poll (measured on CPU: 1.96 s per step at 2 s, 0.77 s at 0.5 s). Used unless the variable is set.
HEALTH_CHECK_ENV, HEALTH_CHECK_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"
STEPS_FILE = "ray_steps.jsonl"
TOPOLOGY_RE = re.compile(r"^[1-9][0-9]*(x[1-9][0-9]*){1,2}$")
# The flags that mean something only with --ray (dest names), for the "needs --ray" check.
_RAY_ONLY = ("ray_slices", "ray_tpu", "ray_max_failures", "ray_address", "ray_cpu_devices", "ray_worker_resources",
             "ray_resize_interval")


@dataclass(frozen=True)
class RayOptions:
    min_slices: int
    max_slices: int
    accelerator: str | None = None  # e.g. TPU-V6E; None: the CPU stand-in
    topology: str | None = None  # e.g. 4x4
    cpu_devices: int | None = None  # JAX CPU devices per worker (CPU stand-in)
    worker_resources: dict[str, float] = field(default_factory=dict)  # extra Ray resources per worker (CPU)
    max_failures: int = DEFAULT_MAX_FAILURES
    address: str | None = None
    resize_interval_s: float = DEFAULT_RESIZE_INTERVAL_S

    @property
    def tpu(self) -> bool:
        return self.accelerator is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "Ray Train (elastic over slices)",
        "Run under Ray Train's JaxTrainer on an existing Ray cluster (RAY_ADDRESS, as `ray job submit` sets it, or "
        "--ray-address; else a local one). A lost slice restarts the run on the slices left, from the last "
        "checkpoint; it scales back when capacity returns.")
    g.add_argument("--ray", action="store_true", help="train under Ray Train (the flags below need it)")
    g.add_argument("--ray-slices", metavar="MIN:MAX", help="slice count range, 1 <= MIN <= MAX (required)")
    g.add_argument("--ray-tpu", metavar="ACCEL:TOPOLOGY",
                   help="TPU slices, e.g. TPU-V6E:4x4 (Ray's accelerator type names); Ray sets up jax.distributed")
    g.add_argument("--ray-max-failures", type=int, metavar="N",
                   help=f"worker-group failures to recover from, -1 = no limit (default {DEFAULT_MAX_FAILURES})")
    g.add_argument("--ray-address", metavar="ADDR", help="Ray cluster address (default: RAY_ADDRESS, else local)")
    g.add_argument("--ray-cpu-devices", type=int, metavar="M",
                   help="CPU stand-in: JAX CPU devices per worker, one worker per slice (required without --ray-tpu)")
    g.add_argument("--ray-worker-resources", metavar="JSON",
                   help="CPU stand-in: extra Ray resources per worker, e.g. '{\"slice\": 1}'")
    g.add_argument("--ray-resize-interval", type=float, metavar="S",
                   help="seconds between checks for returned capacity while training "
                        f"(default {DEFAULT_RESIZE_INTERVAL_S:g}, Ray's)")


def tpu_accelerators() -> list[str]:
    """Ray's TPU accelerator type names (ray.util.accelerators.GOOGLE_TPU_*)."""
    from ray.util import accelerators

    return sorted(v for k, v in vars(accelerators).items() if k.startswith("GOOGLE_TPU_") and isinstance(v, str))


def _require_ray() -> None:
    try:
        import ray.train  # noqa: F401
    except ImportError:
        raise ConfigError("--ray needs Ray Train installed: pip install 'ray[default,train]==2.60.0'") from None


def _parse_slices(raw: str | None) -> tuple[int, int]:
    if raw is None:
        raise ConfigError("--ray needs --ray-slices MIN:MAX (1 <= MIN <= MAX), e.g. --ray-slices 1:2")
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", raw)
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise ConfigError(f"--ray-slices {raw!r}: expected MIN:MAX with 1 <= MIN <= MAX, e.g. 1:2")
    return int(m[1]), int(m[2])


def _parse_tpu(raw: str) -> tuple[str, str]:
    allowed = tpu_accelerators()
    accel, _, topology = raw.partition(":")
    if accel not in allowed or not TOPOLOGY_RE.fullmatch(topology):
        raise ConfigError(f"--ray-tpu {raw!r}: expected ACCEL:TOPOLOGY with ACCEL one of {', '.join(allowed)} and "
                          "TOPOLOGY like 4x4 or 2x2x2, e.g. TPU-V6E:4x4")
    try:
        workers_per_slice(accel, topology)
    except ValueError as err:
        raise ConfigError(f"--ray-tpu {raw!r}: {err}") from None
    return accel, topology


def _parse_resources(raw: str) -> dict[str, float]:
    try:
        res = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--ray-worker-resources {raw!r}: not JSON ({err})") from None
    ok = isinstance(res, dict) and all(
        isinstance(k, str) and k and isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
        for k, v in res.items())
    if not ok or "TPU" in res:
        raise ConfigError(f"--ray-worker-resources {raw!r}: expected a JSON object of resource name -> number >= 0 "
                          "without TPU, e.g. '{\"slice\": 1}'")
    return {k: float(v) for k, v in res.items()}


def options_from_args(args: argparse.Namespace) -> RayOptions | None:
    """The Ray options, None without --ray; ConfigError (naming the flag and what it takes) on bad combinations."""
    if not args.ray:
        given = [f"--{d.replace('_', '-')}" for d in _RAY_ONLY if getattr(args, d) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} only go with --ray")
        return None
    if args.local_processes or args.devices_per_process:
        raise ConfigError("--ray does not go with --local-processes/--devices-per-process (Ray starts the workers)")
    _require_ray()
    lo, hi = _parse_slices(args.ray_slices)
    failures = DEFAULT_MAX_FAILURES if args.ray_max_failures is None else args.ray_max_failures
    if failures < -1:
        raise ConfigError(f"--ray-max-failures {failures}: expected N >= 0, or -1 for no limit")
    interval = DEFAULT_RESIZE_INTERVAL_S if args.ray_resize_interval is None else args.ray_resize_interval
    if not interval >= 0:
        raise ConfigError(f"--ray-resize-interval {interval}: expected seconds >= 0")
    common = {"min_slices": lo, "max_slices": hi, "max_failures": failures, "address": args.ray_address,
              "resize_interval_s": interval}
    if args.ray_tpu is not None:
        stray = [f for f, v in (("--ray-cpu-devices", args.ray_cpu_devices),
                                ("--ray-worker-resources", args.ray_worker_resources)) if v is not None]
        if stray:
            raise ConfigError(f"{', '.join(stray)}: only for the CPU stand-in, not with --ray-tpu (the TPU slice "
                              "sets the devices and resources)")
        accel, topology = _parse_tpu(args.ray_tpu)
        return RayOptions(accelerator=accel, topology=topology, **common)
    if args.ray_cpu_devices is None or args.ray_cpu_devices < 1:
        got = "" if args.ray_cpu_devices is None else f" (got {args.ray_cpu_devices})"
        raise ConfigError(f"--ray without --ray-tpu needs --ray-cpu-devices M >= 1, the JAX CPU devices per "
                          f"worker{got}")
    resources = _parse_resources(args.ray_worker_resources) if args.ray_worker_resources is not None else {}
    return RayOptions(cpu_devices=args.ray_cpu_devices, worker_resources=resources, **common)


def workers_per_slice(accelerator: str | None, topology: str | None) -> int:
    """Ray workers (hosts) per slice: 1 for the CPU stand-in."""
    if accelerator is None or topology is None:
        return 1
    from ray.util.tpu import get_tpu_worker_resources

    return int(get_tpu_worker_resources(topology=topology, accelerator_type=accelerator)[0])


def slice_config(cfg: TrainConfig, slices: int) -> TrainConfig:
    """The config on `slices` slices: the per-slice fsdp axis takes whatever devices a slice has."""
    if cfg.mesh.tensor == -1:
        raise ConfigError("mesh.tensor=-1: with --ray set mesh.tensor to a number (mesh.fsdp=-1 takes the rest)")
    return cfg.model_copy(update={"mesh": cfg.mesh.model_copy(update={"slices": slices, "fsdp": -1})})


def check_mesh(cfg: TrainConfig, opts: RayOptions) -> None:
    """The placement (colocated only), and on the CPU stand-in the mesh and batch on every slice count the run may
    shrink or grow to."""
    if cfg.placement.mode != "colocated":
        raise ConfigError(RAY_SPLIT_REFUSED)
    if opts.cpu_devices is None:
        return  # TPU: devices per slice depend on the chip generation; train() checks at start
    for slices in range(opts.min_slices, opts.max_slices + 1):
        try:
            resolve_mesh(slice_config(cfg, slices), slices * opts.cpu_devices, exact=True)
        except ConfigError as err:
            raise ConfigError(f"--ray-slices {opts.min_slices}:{opts.max_slices} --ray-cpu-devices "
                              f"{opts.cpu_devices}: on {slices} slice(s): {err}") from None


# --------------------------------------------------------------------------------------------------- driver
def run(cfg: TrainConfig, checked: TrainConfig, opts: RayOptions) -> int:
    """Driver: `cfg` goes to the workers (run_dir resolved), `checked` is the preflight's (model attached)."""
    check_mesh(checked, opts)
    import ray
    from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.exceptions import TrainingFailedError
    from ray.train.v2.jax import JaxTrainer

    h = workers_per_slice(opts.accelerator, opts.topology)
    lo, hi = opts.min_slices * h, opts.max_slices * h
    hardware: dict[str, Any] = (
        {"use_tpu": True, "accelerator_type": opts.accelerator, "topology": opts.topology} if opts.tpu
        else {"resources_per_worker": {"CPU": 1.0, **opts.worker_resources}})
    scaling = ScalingConfig(num_workers=(lo, hi) if lo < hi else hi,
                            elastic_resize_monitor_interval_s=opts.resize_interval_s, **hardware)
    loop_config = {"cfg": cfg.model_dump(by_alias=True), "workers_per_slice": h, "cpu_devices": opts.cpu_devices}
    os.environ.setdefault(HEALTH_CHECK_ENV, HEALTH_CHECK_S)  # Ray Train passes it on to its controller
    try:
        ray.init(address=opts.address)
        trainer = JaxTrainer(
            train_loop_per_worker,
            train_loop_config=loop_config,
            scaling_config=scaling,
            run_config=RunConfig(name=Path(cfg.run_dir).name or "train",
                                 failure_config=FailureConfig(max_failures=opts.max_failures)),
        )
        trainer.fit()
    except TrainingFailedError as err:
        cause = config_error_of(err)
        if cause is not None:  # the same config error on every attempt (e.g. every checkpoint damaged)
            print(f"error: {cause}", file=sys.stderr)
            return 2
        print(f"error: Ray Train gave up (max_failures={opts.max_failures}): {describe_failure(err)}",
              file=sys.stderr)
        return EXIT_RAY_FAILED
    except ConnectionError as err:  # ray.init: no cluster at the address
        print(f"error: cannot reach the Ray cluster ({opts.address or os.environ.get('RAY_ADDRESS') or 'local'}): "
              f"{err}", file=sys.stderr)
        return EXIT_RAY_FAILED
    finally:
        ray.shutdown()
    print(f"ray: training finished; run folder {cfg.run_dir}", flush=True)
    return 0


def _worker_failures(err: BaseException) -> list[tuple[int, BaseException]]:
    failures = getattr(err, "worker_failures", None)
    if not isinstance(failures, dict):
        return []
    # Ray wraps a worker's exception with its traceback text; the original is kept as `_base_exc`.
    return [(rank, cast(BaseException, getattr(e, "_base_exc", e))) for rank, e in sorted(failures.items())]


def config_error_of(err: BaseException) -> ConfigError | None:
    """The ConfigError every failed worker raised, if that is what ended the run."""
    failures = [e for _, e in _worker_failures(err)]
    if failures and all(isinstance(e, ConfigError) for e in failures):
        return failures[0]  # type: ignore[return-value]  # all() above found each a ConfigError
    return None


def describe_failure(err: BaseException) -> str:
    """One line: the lowest failed rank's error (its last line), else the error's own last line."""
    failures = _worker_failures(err)
    if failures:
        rank, first = failures[0]
        lines = [ln for ln in str(first).splitlines() if ln.strip()]
        return (f"{len(failures)} worker(s) failed; rank {rank}: {type(first).__name__}: "
                f"{lines[-1].strip() if lines else ''}")[:500]
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1].strip() if lines else ''}"[:500]


# --------------------------------------------------------------------------------------------------- workers
def _append_line(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def step_reporter(run_dir: Path, rank: int, world: int, slices: int,
                  report: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """train()'s on_step: rank 0 logs the step with its world size; every rank reports (a barrier in Ray)."""
    pid = os.getpid()  # a new process per worker-group attempt: tells the attempts apart in the log

    def on_step(record: dict[str, Any]) -> None:
        extra = {"world": world, "slices": slices}
        if rank == 0:
            _append_line(run_dir / STEPS_FILE, {"step": record["step"], **extra, "pid": pid, "time": time.time(),
                                                "loss": record["loss"], "reward_mean": record["reward_mean"]})
        report({**record, **extra})
    return on_step


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, int]:
    """One worker of one worker-group attempt (a fresh process each attempt, off the main thread)."""
    import logging

    import ray
    import ray.train

    from trainer.rl.checkpoint import StopFlag
    from trainer.rl.train import train
    from trainer.run.distributed import cpu_slice_env, initialize_from_env
    from trainer.run.launch import free_port

    logging.getLogger("absl").setLevel(logging.WARNING)  # Ray workers log at INFO: orbax would log every save
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    slices = world // int(loop_config["workers_per_slice"])
    devices = loop_config["cpu_devices"]
    if devices is not None:
        # On CPU JaxTrainer's backend leaves JAX alone: rank 0 picks the coordinator, the env contract does the rest.
        from ray.train.collective import broadcast_from_rank_zero

        # Every interface: the other workers connect over the node's address.
        coordinator = f"{ray.util.get_node_ip_address()}:{free_port('')}" if rank == 0 else None
        coordinator = broadcast_from_rank_zero(coordinator)
        initialize_from_env(cpu_slice_env(coordinator, world, rank, int(devices)))
    # On TPU the backend already ran jax.distributed.initialize and set the MEGASCALE_* variables.

    cfg = slice_config(config_from_dict(loop_config["cfg"]), slices)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"ray_worker_{rank}.json").write_text(json.dumps({
        "rank": rank, "world": world, "slices": slices, "pid": os.getpid(),
        "node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
        "time": time.time()}) + "\n")
    if rank == 0:
        print(f"ray: worker group of {world} on {slices} slice(s)", flush=True)
    # Signal handlers cannot be installed off the main thread; Ray stops workers by killing them, and each step's
    # checkpoint (checkpoint.every) is what a restart resumes from. The flag only serves train()'s stop protocol.
    result = train(cfg, stop=StopFlag(), on_step=step_reporter(run_dir, rank, world, slices, ray.train.report))
    return {"step": result.step}
