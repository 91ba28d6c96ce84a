"""The service engine's tests run on 8 virtual CPU devices, like tests/trainer; this must happen before anything
touches a JAX backend."""

import contextlib
from collections.abc import Callable, Iterator

import jax
import pytest
import tinker

from tests.service.conftest import pg_server_url  # noqa: F401 - the real PostgreSQL server, shared

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture
def sdk_clients() -> Iterator[Callable[[str, str], tinker.ServiceClient]]:
    """make(url, key) -> a tinker.ServiceClient, closed after the test (while its module's server still runs), so
    no heartbeat thread outlives the server and complains at interpreter exit."""
    made: list[tinker.ServiceClient] = []

    def make(url: str, key: str) -> tinker.ServiceClient:
        made.append(tinker.ServiceClient(base_url=url, api_key=key))
        return made[-1]

    yield make
    for client in made:
        with contextlib.suppress(Exception):
            client.close("success").result(timeout=10)
