"""The engine's command line, defined once: the options of `python -m trainer.service engine` (and of `serve`, which
can run an engine in its own process), with the one parser every reader of that line uses.

The service CLI (trainer/service/cli.py) parses the pod's arguments with it; the stack reads the arguments it gives the
engine pod (workloads/service.py; infra/base/engine_config.py loads the config they name) and `gke-tpu-rl fit` sizes
the engine from them (infra/base/pod_config.py, through the service CLI's build_parser), so what they load is what the
pod loads. Part of the pod contract, so on the
lowest floor beside envspec/pod.py, which both the image and the stack hold: standard library only, the stack imports
it without JAX.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn


def add_engine_options(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """The options that say which engine runs: its config and overrides, a local process group, its storage."""
    parser.add_argument(
        "--config", metavar="FILE", required=required,
        help="a trainer config with service and lora sections (e.g. trainer/configs/qwen3-8b-service-v6e-4x4.yaml): "
        "the engine's base model, adapter slots, mesh and batching")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                        help="override a config key, e.g. --set service.max_batch_tokens=4096 (repeatable)")
    parser.add_argument("--local-processes", type=int, default=0, metavar="N",
                        help="run the engine as N local processes joined by jax.distributed (a multi-host slice on "
                        "one machine; process 0 serves, the others follow); with --devices-per-process")
    parser.add_argument("--devices-per-process", type=int, default=0, metavar="M", help="CPU devices per local process")
    parser.add_argument("--storage", metavar="DIR", default=None,
                        help="where checkpoints are written (default: service.storage_dir, else checkpoints/ in the "
                        "service home)")


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """--log-level, which `engine` and `serve` both take."""
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


class _Parser(argparse.ArgumentParser):
    """Raises instead of printing usage and exiting: a caller inside a program (the stack) reports the error."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def add_db_option(parser: argparse.ArgumentParser, *, top: bool, help: str | None = None) -> None:
    """--db, accepted before or after the subcommand; the leaf's SUPPRESS default keeps a top-level --db from being
    reset. The service CLI gives the help (it names the store's defaults)."""
    parser.add_argument("--db", metavar="URL", default=None if top else argparse.SUPPRESS, help=help)


def parse_engine_args(argv: Sequence[str]) -> argparse.Namespace:
    """An engine command line (the arguments after `engine`), read as the engine's own parser reads it: the same
    options, so an abbreviation is as ambiguous here as there (--d: --db or --devices-per-process), and nothing else.
    Raises ValueError where the engine would refuse it at start (an unknown option or argument, a missing value, a
    value of the wrong type; -h, which would print the help and exit 0)."""
    parser = _Parser(add_help=False)
    add_db_option(parser, top=False)
    add_engine_options(parser)
    add_log_level(parser)
    return parser.parse_args(list(argv))
