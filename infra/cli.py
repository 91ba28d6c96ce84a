"""`gke-tpu-rl`: `plan` (the stack under Pulumi mocks, offline) and `train` (the trainer's own CLI)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_OK = 0
EXIT_CONFIG = 2  # bad stack config, unknown environment, unreadable file: the message says which


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gke-tpu-rl",
        description="A GKE + Cloud TPU RL training environment (Pulumi) and its trainer.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = sub.add_parser(
        "plan", help="show what an environment's stack declares, without credentials or the Pulumi CLI",
        description="Runs the real Pulumi program under mocks and prints every resource it would register, "
        "a summary, and the stack outputs (secrets masked).")
    plan.add_argument("env", nargs="?", metavar="ENV",
                      help="environment (stack) name: reads environments/Pulumi.ENV.yaml; omit for all")
    plan.add_argument("--all", action="store_true", help="plan every environments/Pulumi.*.yaml")
    plan.add_argument("--config-file", type=Path, metavar="FILE",
                      help="plan this stack config file instead; ENV then names the stack (default: from FILE)")
    plan.add_argument("--out", type=Path, metavar="DIR",
                      help="write each Kubernetes object as DIR/kind-name.yaml, plus DIR/resources.json and "
                      "DIR/plan.md (with several environments: DIR/ENV/...)")
    plan.add_argument("--format", choices=("text", "markdown"), default="text",
                      help="text (a tree for the terminal) or markdown (for a PR comment)")
    sub.add_parser("train", add_help=False, help="run the trainer (gke-tpu-rl train --help for its flags)")
    return p


def _env_from_file(path: Path) -> str:
    # Pulumi.<env>.yaml names its stack; any other file name is used as-is.
    name = path.name
    if name.startswith("Pulumi.") and name.endswith((".yaml", ".yml")):
        return name.split(".", 1)[1].rsplit(".", 1)[0]
    return path.stem


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from infra import render
    from infra.config import ConfigError
    from infra.plan import PlanError, available_envs, plan, repo_root, write_out

    root = repo_root()
    if args.config_file is not None:
        if args.all:
            print("error: --all and --config-file do not go together", file=sys.stderr)
            return EXIT_CONFIG
        envs = [args.env or _env_from_file(args.config_file)]
    elif args.env and not args.all:
        envs = [args.env]
    else:
        envs = available_envs(root)
        if not envs:
            print(f"error: no environments/Pulumi.*.yaml under {root}", file=sys.stderr)
            return EXIT_CONFIG
    # Piped output (make demo | tee, CI logs) gets a width that keeps the slice table readable.
    console = Console(width=None if sys.stdout.isatty() else 200)
    status = EXIT_OK
    for i, env in enumerate(envs):
        try:
            result = plan(env, args.config_file, root)
        except (ConfigError, PlanError) as e:
            print(f"error: {e}", file=sys.stderr)
            status = EXIT_CONFIG
            continue
        md = render.markdown(result)
        if args.format == "markdown":
            sys.stdout.write(("\n" if i else "") + md)  # verbatim: no wrapping, markup or emoji codes
        else:
            if i:
                console.print()
            render.print_text(result, console)
        if args.out is not None:
            out_dir = args.out / env if len(envs) > 1 else args.out
            written = write_out(result, out_dir, markdown=md)
            print(f"wrote {len(written)} files to {out_dir}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        # Everything after `train` belongs to the trainer; import it only when asked (it pulls in JAX).
        from trainer.cli import main as train_main

        return int(train_main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    return _plan(args)


if __name__ == "__main__":
    sys.exit(main())
