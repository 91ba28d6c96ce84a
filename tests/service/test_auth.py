"""API keys: only the hash is stored, unknown / malformed / revoked keys are refused, and the keys CLI."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from trainer.service import auth, cli
from trainer.service.store import Store

ROOT = Path(__file__).resolve().parents[2]


def test_keys_authenticate_until_revoked(store: Store) -> None:
    row, key = auth.create_key(store, "alice")
    assert key.startswith("tml-") and len(key) == 4 + 16 + 1 + 43  # the SDK requires the prefix
    assert auth.authenticate(store, key) == row.id
    assert auth.authenticate(store, f"  {key}\n") == row.id  # header whitespace
    other, other_key = auth.create_key(store, "bob")
    assert auth.authenticate(store, other_key) == other.id != row.id

    # The database holds no secret: the key and its secret part appear in no column.
    with store.engine.connect() as conn:
        dump = repr(conn.execute(text("SELECT * FROM api_keys")).all())
    assert key not in dump and key.split("_", 1)[1] not in dump
    assert auth.hash_key(key) in dump

    for missing in (None, "", "   "):
        with pytest.raises(auth.MissingKey):
            auth.authenticate(store, missing)
    secret_tampered = key[:-1] + ("A" if key[-1] != "A" else "B")
    unknown_id = "tml-" + "0" * 16 + key[20:]
    for bad in (secret_tampered, unknown_id, key[4:], "tml-", "Bearer " + key, key + "x", "eyJhbGciOi.x.y"):
        with pytest.raises(auth.InvalidKey):
            auth.authenticate(store, bad)

    auth.revoke_key(store, row.id)
    with pytest.raises(auth.RevokedKey):
        auth.authenticate(store, key)
    assert auth.authenticate(store, other_key) == other.id  # other keys unaffected
    first = store.get_api_key(row.id)
    assert first is not None and first.revoked_at is not None
    assert auth.revoke_key(store, row.id).revoked_at == first.revoked_at  # idempotent
    assert all(isinstance(e, auth.AuthError) for e in (auth.MissingKey(), auth.InvalidKey(), auth.RevokedKey()))


def test_imported_keys(store: Store, db_url: str, capsys: pytest.CaptureFixture[str],
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A key made elsewhere authenticates once imported, is hashed like any other, and a guessable one needs the
    caller to say so."""
    strong = "tml-" + "k3y-from-the-team-secret-manager-0001"
    row = auth.import_key(store, "team", strong)
    assert row.id.startswith("x") and len(row.id) == 16 and auth.authenticate(store, strong) == row.id
    with store.engine.connect() as conn:
        assert strong not in repr(conn.execute(text("SELECT * FROM api_keys")).all())
    for bad in ("dummy", "tml-with space-" + "x" * 40, " tml-" + "x" * 40):
        with pytest.raises(ValueError, match="must start with 'tml-'"):
            auth.import_key(store, "bad", bad)
    with pytest.raises(ValueError, match="can be guessed"):
        auth.import_key(store, "dev", "tml-dummy")
    dev = auth.import_key(store, "dev", "tml-dummy", allow_weak=True)
    assert auth.authenticate(store, "tml-dummy") == dev.id != row.id
    for wrong in ("tml-dummy2", "tml-dumm", strong + "x"):
        with pytest.raises(auth.InvalidKey):
            auth.authenticate(store, wrong)
    generated_form, generated = auth.create_key(store, "made")
    store.revoke_api_key(generated_form.id)
    with pytest.raises(auth.RevokedKey):
        auth.authenticate(store, generated)
    auth.revoke_key(store, dev.id)
    with pytest.raises(auth.RevokedKey):
        auth.authenticate(store, "tml-dummy")

    # The CLI: from standard input (kept out of shell history), weak keys refused unless --allow-weak.
    monkeypatch.setattr("sys.stdin", io.StringIO(strong.replace("0001", "0002") + "\n"))
    assert cli.main(["keys", "import", "ci", "-", "--db", db_url]) == 0
    assert capsys.readouterr().out.startswith("imported key x")
    assert cli.main(["keys", "import", "weak", "tml-dev", "--db", db_url]) == 2
    assert "can be guessed" in capsys.readouterr().err
    assert cli.main(["keys", "import", "weak", "tml-dev", "--allow-weak", "--db", db_url]) == 0
    assert cli.main(["keys", "import", "again", "tml-dev", "--allow-weak", "--db", db_url]) == 2
    assert "already registered" in capsys.readouterr().err


def test_keys_cli(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["keys", "create", "ci runner", "--db", db_url]) == 0
    key = capsys.readouterr().out.strip()
    assert cli.main(["--db", db_url, "keys", "create", "laptop"]) == 0
    laptop_key = capsys.readouterr().out.strip()

    assert cli.main(["keys", "list", "--db", db_url]) == 0
    listing = capsys.readouterr().out
    key_id = key[4:20]
    assert key_id in listing and "ci runner" in listing and "laptop" in listing
    assert key.split("_", 1)[1] not in listing and laptop_key.split("_", 1)[1] not in listing

    assert cli.main(["keys", "revoke", key_id, "--db", db_url]) == 0
    capsys.readouterr()
    assert cli.main(["keys", "revoke", "nosuchkey", "--db", db_url]) == 1
    assert "no API key" in capsys.readouterr().err
    assert cli.main(["keys", "list", "--json", "--db", db_url]) == 0
    assert '"revoked": null' in capsys.readouterr().out  # the laptop key stays active

    store = Store(db_url)
    try:
        with pytest.raises(auth.RevokedKey):
            auth.authenticate(store, key)
        assert auth.authenticate(store, laptop_key) == laptop_key[4:20]
    finally:
        store.close()


def test_module_entry_point_uses_the_env_database(tmp_path: Path) -> None:
    env = {**os.environ, "GKE_TPU_RL_SERVICE_DB": str(tmp_path / "keys.db")}
    run = [sys.executable, "-m", "trainer.service", "keys"]
    created = subprocess.run([*run, "create", "x"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert created.returncode == 0, created.stderr
    assert created.stdout.startswith("tml-") and "cannot be shown again" in created.stderr
    listed = subprocess.run([*run, "list"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert listed.returncode == 0 and created.stdout[4:20] in listed.stdout
    assert (tmp_path / "keys.db").exists()


def test_default_database_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.service.store import default_db_url

    monkeypatch.delenv("GKE_TPU_RL_SERVICE_DB", raising=False)
    monkeypatch.setenv("GKE_TPU_RL_SERVICE_HOME", str(tmp_path / "home"))
    assert default_db_url() == f"sqlite:///{tmp_path / 'home' / 'service.db'}"
    monkeypatch.delenv("GKE_TPU_RL_SERVICE_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_db_url() == f"sqlite:///{tmp_path / 'xdg' / 'gke-tpu-rl' / 'service' / 'service.db'}"
