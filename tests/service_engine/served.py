"""The service as users run it: `python -m trainer.service serve --config` (API and engine in one process) on the tiny
random Qwen3 published offline as `Qwen/Qwen3-8B` (tests/tiny_model.py), with a fresh key. The real-client and
cookbook-recipe tests run the SDK, the seed script and the recipes against it as subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.service_api.conftest import free_port, wait_healthy
from tests.tiny_model import publish

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    key: str
    env: dict[str, str]  # the environment a client process needs: offline HF_HOME with the model (and data sets)
    db: Path
    storage: Path
    hf_home: Path


@contextmanager
def serve(tmp: Path, port: int | None = None, weak_keys: dict[str, str] | None = None) -> Iterator[Server]:
    """Serve on 127.0.0.1:`port` (a free one if None) from `tmp`; `weak_keys` ({name: key}) are imported with
    --allow-weak besides the fresh key. On exit the server gets SIGTERM, and its log must hold no traceback."""
    hf_home = tmp / "hf"
    publish(hf_home)
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu",
           "TOKENIZERS_PARALLELISM": "false"}
    config = tmp / "service.yaml"
    storage = tmp / "checkpoints"
    config.write_text(json.dumps({
        "init": {"from": "hf"}, "lora": {"rank": 32, "alpha": 32, "slots": 8},
        "service": {"base_model": "Qwen/Qwen3-8B", "min_bucket": 32, "storage_dir": str(storage), "warmup": False},
    }))
    db = tmp / "service.db"
    created = subprocess.run([sys.executable, "-m", "trainer.service", "keys", "create", "tests", "--db", str(db)],
                             cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    key = created.stdout.strip()
    for name, weak in (weak_keys or {}).items():
        subprocess.run([sys.executable, "-m", "trainer.service", "keys", "import", name, weak, "--allow-weak",
                        "--db", str(db)], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    port = port or free_port()
    log_path = tmp / "server.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.service", "serve", "--config", str(config), "--db", str(db),
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log_path.read_text, 120)
        yield Server(url, key, env, db, storage, hf_home)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    out = log_path.read_text()
    assert "Traceback" not in out, out
