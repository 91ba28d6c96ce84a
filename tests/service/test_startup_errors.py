"""review 2026-11-28 #3, the pieces: which start-up errors the engine outlasts (retry_database: the database
unavailable; exit 42: storage I/O errors, transient JAX runtime errors) and which stay errors (a bug, a bad
checkpoint path: exit 2)."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError, ProgrammingError

from trainer.base.config import ConfigError
from trainer.model import hf
from trainer.service import cli
from trainer.service import store as S
from trainer.service.store import connection


class _Pg8000ServerError(Exception):
    """What pg8000 raises for a server error: the server's fields as a dict."""


def _pg8000(code: str) -> ProgrammingError:
    return ProgrammingError("SELECT 1", {}, _Pg8000ServerError({"S": "FATAL", "C": code, "M": "..."}))


def test_what_counts_as_the_database_unavailable() -> None:
    unavailable = [
        OperationalError("connect", {}, Exception("connection refused")),
        _pg8000("57P03"),  # the database system is starting up (Cloud SQL's maintenance restart)
        _pg8000("28000"),  # IAM login refused: the user or its binding not propagated yet
        ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
        type("CloudSQLConnectionError", (Exception,), {})("instance not reachable"),
        type("RefreshError", (Exception,), {"__module__": "google.auth.exceptions"})("403 from IAM"),
        type("ClientResponseError", (Exception,), {"__module__": "aiohttp.client_exceptions"})("503"),
    ]
    for err in unavailable:
        assert S.is_database_unavailable(err), err
    for err in (_pg8000("42P01"), ValueError("region was mismatched"), S.StoreError("schema newer"), KeyError("x")):
        assert not S.is_database_unavailable(err), err


def test_retry_database_outlasts_an_outage_and_gives_up_after_its_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # The module that reads it (the package only re-exports the value).
    monkeypatch.setattr(connection, "DB_RETRY_FIRST_S", 0.01)
    failures = [OperationalError("connect", {}, Exception("refused"))] * 3
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if failures:
            raise failures.pop()
        return "ok"

    assert S.retry_database(flaky, "test", within_s=30) == "ok" and len(calls) == 4
    start = time.monotonic()
    with pytest.raises(S.DatabaseUnavailable, match="unavailable for 0.3 s .* to test: .*refused") as err:
        S.retry_database(lambda: (_ for _ in ()).throw(OperationalError("c", {}, Exception("refused"))), "test",
                         within_s=0.3)
    assert 0.3 <= time.monotonic() - start < 5 and isinstance(err.value.__cause__, OperationalError)
    calls.clear()
    with pytest.raises(KeyError):  # a bug is not retried
        S.retry_database(lambda: calls.append(1) or {}["x"], "test", within_s=30)
    assert calls == [1]


def test_a_storage_io_error_is_a_restart_and_a_bad_path_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """gcsfuse answers a failed GCS read with EIO: check_hf let it through as it is (it used to become a ConfigError,
    exit 2: FailJobSet), and the engine maps it to 42. A missing checkpoint stays a config error."""
    with pytest.raises(ConfigError, match="init.path"):
        hf.check_hf(tmp_path / "missing")

    def eio(*_: object, **__: object) -> None:
        raise OSError(errno.EIO, "Input/output error", str(tmp_path / "config.json"))

    monkeypatch.setattr(hf, "_validated", eio)
    with pytest.raises(OSError) as err:
        hf.check_hf(tmp_path)
    assert cli._restart_code(err.value) == 42
    assert capsys.readouterr().err.strip().endswith("Input/output error: '" + str(tmp_path / "config.json")
                                                    + "'; exiting 42 to be restarted")
    assert cli._restart_code(OSError(errno.ENOENT, "gone")) is None


def test_the_retry_window_is_a_key_of_the_engine_config() -> None:
    """service.db_retry_s (a user sets it through the stack's service.args): 300 s unless set, never negative."""
    from trainer.base.config import load_config

    base = "qwen3-8b-service-v6e-4x4.yaml"
    assert load_config(base, []).service.db_retry_s == 300
    assert load_config(base, ["service.db_retry_s=5"]).service.db_retry_s == 5
    for bad in ("soon", "-1"):
        with pytest.raises(ConfigError, match="db_retry_s"):
            load_config(base, [f"service.db_retry_s={bad}"])
