"""`gke-tpu-rl eval RUN_DIR` / `python -m trainer eval RUN_DIR`: the held-out eval of a run's checkpoint, with the
run's own config (RUN_DIR/config.yaml, which training writes) and its `eval:` section (the defaults when it has
none). Prints the scores and writes them as JSON. Exit codes are the trainer's (envspec/pod.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from envspec.pod import EXIT_CONFIG, EXIT_TRANSIENT
from trainer.base import yamlfile
from trainer.base.config import ConfigError, TrainConfig, apply_overrides, config_from_dict
from trainer.base.eval_config import EvalConfig
from trainer.run.cli import check_cpu_mesh, is_transient, preflight


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gke-tpu-rl eval",
        description="Score a checkpoint of a training run on the task's held-out split (greedy and sampled "
        "completions, mean reward, pass@k), with the run's config and its eval section.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (it holds config.yaml and, by default, "
                   "checkpoints/)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="the checkpoint of N completed steps (default: the newest)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where the scores go as JSON (default: RUN_DIR/eval/step-N.json)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a value of the run's config, e.g. --set eval.prompts=256 (repeatable)")
    p.add_argument("--local-processes", type=int, default=0, metavar="N",
                   help="run as N local processes joined by jax.distributed (CPU), as the run was")
    p.add_argument("--devices-per-process", type=int, default=0, metavar="M",
                   help="CPU devices per local process (with --local-processes)")
    return p


def run_config(run_dir: str, overrides: list[str]) -> TrainConfig:
    """The run's config as training wrote it, with `overrides`, the eval section's defaults where it has none."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml, so not a run folder (`gke-tpu-rl train` writes one there)")
    try:
        data = yamlfile.load(path) or {}
    except yamlfile.YamlFileError as err:
        raise ConfigError(f"config {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    if (data.get("init") or {}).get("from") == "hf":
        data.pop("model", None)  # written from the checkpoint's config.json, which the import reads again
    data["eval"] = data.get("eval") or {}
    data["run_dir"] = str(run_dir)
    return config_from_dict(apply_overrides(data, overrides))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.step is not None and args.step < 0:
            raise ConfigError(f"--step {args.step}: a checkpoint step is >= 0")
        if bool(args.local_processes) != bool(args.devices_per_process) or min(args.local_processes,
                                                                               args.devices_per_process) < 0:
            raise ConfigError("--local-processes and --devices-per-process go together, each >= 1")
        cfg = run_config(args.run_dir, args.overrides)
        checked = preflight(cfg)
        if args.local_processes:
            from trainer.base.config import resolve_mesh
            from trainer.run.launch import run_local

            resolve_mesh(checked, args.local_processes * args.devices_per_process, exact=True)
            child = ["eval", args.run_dir, *(f"--set={o}" for o in args.overrides),
                     *(["--step", str(args.step)] if args.step is not None else []),
                     *(["--out", args.out] if args.out else [])]
            return run_local(args.local_processes, args.devices_per_process, child)

        import jax

        from trainer.rl.eval_run import evaluate_checkpoint
        from trainer.run.distributed import initialize_from_env

        info = initialize_from_env(exit_on_timeout=EXIT_TRANSIENT)
        if not info.multi_process:
            check_cpu_mesh(checked)
        if info.multi_process and info.cpu_devices:
            from trainer.run.launch import quiet_native_stdout

            quiet_native_stdout()  # gloo's connection lines, as train hides them
        try:
            result = evaluate_checkpoint(cfg, args.step)
        except Exception as err:
            if not is_transient(err):
                raise
            print(f"error: transient runtime failure, exiting {EXIT_TRANSIENT}: {' '.join(str(err).split())}",
                  file=sys.stderr)
            return EXIT_TRANSIENT
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if jax.process_index() == 0:
        out = Path(args.out) if args.out else Path(args.run_dir) / "eval" / f"step-{result.step}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        ecfg = cfg.eval or EvalConfig()
        out.write_text(json.dumps({"run_dir": str(args.run_dir), "step": result.step,
                                   "checkpoint_dir": str(result.directory), "scores": result.scores,
                                   "eval": ecfg.model_dump()}, indent=2) + "\n")
        names = {k: k.removeprefix("eval/") for k in result.scores}
        width = max(map(len, names.values()))
        print(f"held-out eval of checkpoint step {result.step} ({ecfg.prompts} prompts):")
        for key, value in result.scores.items():
            print(f"  {names[key]:<{width}}  {value:.4f}")
        print(f"scores: {out}")
    return 0
