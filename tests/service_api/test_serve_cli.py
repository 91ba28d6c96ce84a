"""`python -m trainer.service serve` as a process: it starts, the SDK can use it with a key from `keys create`, and it
stops on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import tinker

from tests.service_api.conftest import free_port, wait_healthy
from trainer.service import cli

ROOT = Path(__file__).resolve().parents[2]


def test_serve_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "service.db"
    assert cli.main(["keys", "create", "sdk", "--db", str(db)]) == 0
    key = capsys.readouterr().out.strip()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.service", "serve", "--db", str(db), "--base-model", "acme/a",
         "--base-model", "acme/b", "--tokenizer", "acme/b=acme/b-tokenizer", "--host", "127.0.0.1",
         "--port", str(port), "--long-poll-s", "5", "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, lambda: proc.communicate()[0], 30)
        models = tinker.RestClient(base_url=url, api_key=key).get_server_capabilities().result(timeout=30)
        assert [m.model_name for m in models.supported_models] == ["acme/a", "acme/b"]
        assert httpx.get(f"{url}/api/v1/training_runs").status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out = proc.communicate(timeout=20)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    # uvicorn shuts down gracefully, then re-raises the signal it caught (uvicorn/server.py capture_signals).
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Traceback" not in out, out


def test_serve_refuses_a_bad_tokenizer_mapping(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--db", str(tmp_path / "s.db"), "--base-model", "acme/a", "--tokenizer", "acme/zzz=tok"]
    assert cli.main(argv) == 2
    assert "not a --base-model" in capsys.readouterr().err
    assert cli.main(["serve", "--db", str(tmp_path / "s.db"), "--base-model", "a", "--long-poll-s", "60"]) == 2
