"""The engine's command line, defined once: the options of `python -m trainer.service engine` (and of `serve`, which
can run an engine in its own process), with the one parser every reader of that line uses.

The service CLI (trainer/service/cli.py) parses the pod's arguments with it; the stack reads the arguments it gives the
engine pod (workloads/service.py: the config they load) and `gke-tpu-rl fit` sizes the engine from them (infra/fit.py,
through the service CLI's build_parser), so what they load is what the pod loads. Part of the pod contract, so on the
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


def parse_engine_args(argv: Sequence[str]) -> argparse.Namespace:
    """The engine options in an engine command line (the arguments after `engine`), as the engine reads them; what
    is not an engine option is left alone (the engine's own parser refuses it at start). Raises ValueError where the
    engine would refuse an option (a missing value, a value of the wrong type)."""
    parser = _Parser(add_help=False)
    add_engine_options(parser)
    add_log_level(parser)  # so an abbreviation (--lo) is as ambiguous here as it is to the engine
    return parser.parse_known_args(list(argv))[0]
