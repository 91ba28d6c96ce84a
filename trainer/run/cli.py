"""`gke-tpu-rl train` / `python -m trainer`: parse flags, then train in-process, spawn local processes, or run
under Ray Train (`--ray`, trainer/run/ray_train.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from envspec.pod import EXIT_CONFIG, EXIT_STOPPED, EXIT_TRANSIENT
from trainer.base.config import ConfigError, TrainConfig, load_config
from trainer.run.ray_train import add_arguments as add_ray_arguments  # imports Ray only once --ray is used
from trainer.run.ray_train import options_from_args as ray_options

# The exit codes are the pod contract's (envspec/pod.py): EXIT_CONFIG (2) for a bad config, EXIT_STOPPED (143) on
# SIGTERM so a preempted pod "fails" and the JobSet restarts it, EXIT_TRANSIENT (42) for a runtime failure worth
# retrying from the last checkpoint (a lost peer, a DCN or libtpu timeout); every other non-signal exit code is a
# bug and fails the JobSet at once (workloads/jobset.py).
# Status codes of jax's runtime errors that come from the cluster rather than the program.
TRANSIENT_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED")


def is_transient(err: BaseException) -> bool:
    """A JAX runtime error whose status says the cluster, not the program, failed."""
    import jax

    if not isinstance(err, jax.errors.JaxRuntimeError):
        return False
    return str(err).lstrip().startswith(TRANSIENT_STATUS)


def _restart_me(err: BaseException) -> int:
    # One line: the JobSet's pod status and `kubectl logs` show it whole; a runtime error's text is multi-line.
    print(f"error: transient runtime failure, exiting {EXIT_TRANSIENT} to be restarted: {' '.join(str(err).split())}",
          file=sys.stderr)
    return EXIT_TRANSIENT


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gke-tpu-rl train",
        description="RL post-training (GRPO/GSPO/Dr.GRPO) of a decoder LLM with JAX. Without --config the "
        "embedded demo config is used.",
    )
    p.add_argument("--config", help="YAML config file (default: the embedded trainer/configs/demo.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set rl.group_size=8 (repeatable)")
    p.add_argument("--run-dir", help="run folder for metrics, plot and (default) checkpoints")
    p.add_argument("--local-processes", type=int, default=0, metavar="N",
                   help="run as N local processes joined by jax.distributed (CPU)")
    p.add_argument("--devices-per-process", type=int, default=0, metavar="M",
                   help="CPU devices per local process (with --local-processes)")
    add_ray_arguments(p)
    return p


def _resolve_run_dir(cfg: TrainConfig, run_dir: str | None) -> TrainConfig:
    # `{timestamp}` is filled once here, so every local process gets the same folder.
    raw = run_dir or cfg.run_dir
    return cfg.model_copy(update={"run_dir": raw.replace("{timestamp}", time.strftime("%Y%m%d-%H%M%S"))})


def preflight(cfg: TrainConfig) -> TrainConfig:
    """What can be checked before any device is set up: the Hugging Face checkpoint's config and file headers, the
    task, rewards and tokenizer. Returns the config with the checkpoint's model attached (for the mesh check)."""
    from trainer.rl.task_data import load_task_data

    if cfg.service is not None:
        raise ConfigError("this config has a service section: it configures the post-training service's engine "
                          "(gke-tpu-rl service serve --config FILE), not an RL training run")
    if cfg.init.from_ == "hf":
        from trainer.base.config import with_model
        from trainer.model.hf import check_hf

        cfg = with_model(cfg, check_hf(cfg.init.path or "", cfg.compute.param_dtype))
    load_task_data(cfg)
    return cfg


def check_cpu_mesh(cfg: TrainConfig) -> None:
    """A single process on CPU: a mesh that does not fit its CPU devices is one ConfigError line with the fix, raised
    before the run starts (only the CPU backend is started here, which prints nothing)."""
    import jax

    if jax.config.jax_platforms != "cpu":  # type: ignore[attr-defined]  # an option jax sets at run time
        return  # TPU/GPU or undecided: train() checks the mesh against whatever backend JAX picks
    n = jax.device_count()
    axes = cfg.mesh.axes()
    need = 1
    for v in axes.values():
        need *= v if v != -1 else 1
    if n % need == 0:
        return  # fits (a -1 axis takes the rest); the batch checks follow in train()
    mesh = " x ".join(f"{k}={v}" for k, v in axes.items())
    sized = f"a multiple of {need}" if -1 in axes.values() else str(need)
    slices = max(axes["slices"], 1)
    have = f"{n} CPU device{'s' if n != 1 else ''}"
    raise ConfigError(
        f"the mesh {mesh} needs {sized} devices but this CPU run has {have}; run it as local processes: "
        f"--local-processes {slices} --devices-per-process {need // slices}, or shrink the mesh: "
        f"--set mesh.slices=1 --set mesh.fsdp={n} --set mesh.tensor=1"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        ray_opts = ray_options(args)  # None without --ray
        if args.local_processes < 0 or args.devices_per_process < 0:
            raise ConfigError("--local-processes and --devices-per-process must be >= 0")
        if bool(args.local_processes) != bool(args.devices_per_process):
            raise ConfigError("--local-processes and --devices-per-process go together")
        cfg = _resolve_run_dir(load_config(args.config, args.overrides), args.run_dir)
        checked = preflight(cfg)
        if ray_opts is not None:
            from trainer.run.ray_train import run

            return run(cfg, checked, ray_opts)
        if args.local_processes:
            from trainer.base.config import resolve_mesh
            from trainer.run.launch import run_local

            resolve_mesh(checked, args.local_processes * args.devices_per_process, exact=True)
            child = [*(["--config", args.config] if args.config else []),
                     *(f"--set={o}" for o in args.overrides), "--run-dir", cfg.run_dir]
            return run_local(args.local_processes, args.devices_per_process, child)

        from trainer.rl.checkpoint import StopFlag
        from trainer.rl.train import train
        from trainer.run.distributed import initialize_from_env

        # A process group that has not formed by the start-up timeout (a peer's node still being repaired) exits
        # EXIT_TRANSIENT from a watchdog: jax itself would abort from native code, which Python cannot catch.
        try:
            info = initialize_from_env(exit_on_timeout=EXIT_TRANSIENT)
        except Exception as err:
            if not is_transient(err):
                raise
            return _restart_me(err)
        if cfg.checkpoint.compile_cache:
            from trainer.rl.train import checkpoint_dir
            from trainer.run import compile_cache

            compile_cache.enable(checkpoint_dir(cfg, Path(cfg.run_dir)) / compile_cache.DIR_NAME)
        if not info.multi_process:
            check_cpu_mesh(checked)
        if info.multi_process and info.cpu_devices:
            from trainer.run.launch import quiet_native_stdout

            quiet_native_stdout()
        # Installed for the whole run, not just the loop: a signal after the last step still lands here, so the
        # checkpoint and the run summary are written once and the exit code stays 143. Once signalled it stays
        # installed until the process exits, absorbing the rest of a burst.
        stop = StopFlag().install()
        try:
            result = train(cfg, stop=stop)
        except Exception as err:
            if not is_transient(err):
                raise
            return _restart_me(err)
        finally:
            if not stop.is_set:
                stop.uninstall()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if result.stopped_early:
        print(f"stopped by signal at step {result.step}; resume with the same --run-dir", file=sys.stderr)
        return EXIT_STOPPED
    return 0
