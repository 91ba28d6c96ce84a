"""review 2026-11-28 #2: the engine started as the CLI starts it (`_start_engine`, used by `engine` and `serve
--config`) on Cloud SQL, through the stand-in of tests/service/cloudsql_fake.py: its own Store keeps the connector
and logs in as the IAM user (it used to rebuild a Store from a URL that names no host, and dial localhost:5432)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine as SqlEngine
from sqlalchemy import text

from tests.service.cloudsql_fake import FakeCloudSql
from tests.service.test_cloudsql import USER, iam_db, start_cloudsql  # noqa: F401 - fixtures
from tests.service_engine.service import tiny_config
from trainer.service import cli
from trainer.service.store import Store


def test_start_engine_runs_on_cloud_sql(
    start_cloudsql: Callable[..., FakeCloudSql], iam_db: SqlEngine, tmp_path: Path,  # noqa: F811
) -> None:
    fake = start_cloudsql()
    store = Store()
    started = cli._start_engine(store, tiny_config(tmp_path / "bucket"), argparse.Namespace(storage=None))
    thread, stop = started[0], started[1]
    try:
        deadline = time.monotonic() + 30
        while not store.engine_up("tiny/random"):  # the engine's heartbeat, through its own connector
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.2)
        with iam_db.connect() as conn:
            assert conn.execute(text("SELECT base_model FROM workers")).scalars().all() == ["tiny/random"]
    finally:
        stop.set()
        thread.join(30)
        started[2].store.close()  # the engine's own Store (and connector)
        store.close()
    assert not thread.is_alive()
    assert sum(1 for t in fake.tunnels if t.client_bytes and t.startup_params()["user"] == USER) >= 2
