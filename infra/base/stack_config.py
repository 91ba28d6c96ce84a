"""The Pulumi side of the stack config: the running stack's `gke-tpu-rl:*` keys into the typed spec (envspec/config.py),
and config errors as `pulumi up` must see them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pulumi.errors import RunError

from envspec.config import NAMESPACE, ConfigError, EnvironmentSpec, parse_spec


class StackConfigError(ConfigError, RunError):
    """A ConfigError raised while the Pulumi program runs. A RunError, so `pulumi up` prints the message alone, not
    the program's traceback (pulumi-language-python's exec wrapper logs str(e) for RunError and the full stack for
    anything else); still a ConfigError for whoever catches that (the CLI, the tests)."""


@contextmanager
def config_errors_for_pulumi() -> Iterator[None]:
    """Re-raises a ConfigError from the block as a StackConfigError with the same message."""
    try:
        yield
    except StackConfigError:
        raise
    except ConfigError as err:
        raise StackConfigError(str(err)) from None  # the message is the whole story: no chained traceback


def _decode(value: Any) -> Any:
    # Pulumi hands structured config to the program as JSON text.
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def read_pulumi_config() -> dict[str, Any]:
    """All `gke-tpu-rl:*` keys of the running stack, namespace stripped, structured values decoded."""
    from pulumi.runtime import config as rc

    merged = {**rc.get_config_env(), **rc.CONFIG.get()}
    prefix = NAMESPACE + ":"
    return {k[len(prefix):]: _decode(v) for k, v in merged.items() if k.startswith(prefix)}


def load_spec() -> EnvironmentSpec:
    """The running stack's spec (what `pulumi up` and `plan` both call), checked against the configs the trainer
    image bundles."""
    import pulumi

    from trainer.base.config import bundled_configs

    return parse_spec(read_pulumi_config(), pulumi.get_stack(), bundled_configs())
