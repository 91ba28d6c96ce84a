"""The two servers of bench/tinker_service.py as processes: each started from nothing (ours: `python -m
trainer.service serve` on SQLite; skyrl 0.4.0 from its own venv through `uv run`), its memory sampled (RSS of the
whole process tree), its HTTP door awaited, and stopped with everything it started, on exit, on error and on
SIGTERM/SIGINT (kill_all)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
BASE_MODEL = "Qwen/Qwen3-8B"
OURS_CONFIG = """\
# bench/tinker_service.py: the engine for the tiny Qwen3 published as Qwen/Qwen3-8B in $HF_HOME
init: {from: hf}
lora: {rank: 32, alpha: 32, slots: 8}
service: {base_model: Qwen/Qwen3-8B, min_bucket: 32, max_batch_tokens: 8192}
"""
# skyrl's JAX backend, as close to ours as it goes: 8 trainable adapter slots (its slot 0 is the base model), rank up
# to 32, the whole batch in one pass (no micro-batches, like ours under max_batch_tokens), no remat.
SKYRL_BACKEND_CONFIG = {"max_lora_adapters": 9, "max_lora_rank": 32, "train_micro_batch_size": 0,
                        "sample_max_num_sequences": 0, "gradient_checkpointing": False}

# ---- processes --------------------------------------------------------------------------------------------------

_LIVE: list[Server] = []  # servers to kill on exit
_LIVE_LOCK = threading.Lock()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MemorySampler(threading.Thread):
    """RSS of a process tree every `interval` s: the peak of the sum, and each process's peak."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        super().__init__(name=f"rss-{pid}", daemon=True)
        self.root = psutil.Process(pid)
        self.interval = interval
        self.stop_event = threading.Event()
        self.peak_total = 0
        self.peak_by_pid: dict[int, tuple[str, int]] = {}
        self.seen: dict[int, psutil.Process] = {pid: self.root}
        self.samples = 0

    def _tree(self) -> list[psutil.Process]:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = [p for p in self.seen.values() if p.is_running()]
        for p in procs:
            self.seen.setdefault(p.pid, p)
        return procs

    def sample(self) -> None:
        total = 0
        for p in self._tree():
            try:
                rss = p.memory_info().rss
                name = " ".join(p.cmdline()[:4])[:120]
            except psutil.Error:
                continue
            total += rss
            if rss > self.peak_by_pid.get(p.pid, ("", 0))[1]:
                self.peak_by_pid[p.pid] = (name, rss)
        self.peak_total = max(self.peak_total, total)
        self.samples += 1

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval)


@dataclass
class Server:
    name: str  # "ours" | "skyrl"
    url: str
    api_key: str
    db: Path
    log: Path
    proc: subprocess.Popen[bytes]
    spawned: float  # time.time() just before the spawn
    spawned_perf: float
    memory: MemorySampler
    _log_file: Any = None
    stopped: bool = False
    _stop_lock: threading.Lock = field(default_factory=threading.Lock)

    def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL it and every process of the tree seen since the spawn."""
        with self._stop_lock:
            self._stop()

    def _stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.memory.sample()
        self.memory.stop_event.set()
        try:
            tree = [self.memory.root, *self.memory.root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for p in tree:
            self.memory.seen.setdefault(p.pid, p)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=15)
        deadline = time.monotonic() + 10
        for p in self.memory.seen.values():  # skyrl's engine is a grandchild: give it a moment to follow the API
            while time.monotonic() < deadline and _alive(p):
                time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for p in self.memory.seen.values():
            try:
                if p.is_running():
                    p.kill()
            except psutil.Error:
                pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
        with _LIVE_LOCK:
            if self in _LIVE:
                _LIVE.remove(self)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_all() -> None:
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for s in servers:
        try:
            s.stop()
        except Exception:  # noqa: BLE001 - best effort on the way out
            traceback.print_exc()


def _base_env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "JAX_COMPILATION_CACHE_DIR", "TINKER_BASE_URL", "TINKER_API_KEY",
                        "PYTHONPATH", "XLA_FLAGS")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", JAX_PLATFORMS="cpu",
               TOKENIZERS_PARALLELISM="false", COLUMNS="240", PYTHONUNBUFFERED="1")
    return env


def _spawn(name: str, cmd: list[str], env: dict[str, str], cwd: Path, log: Path, db: Path, port: int,
           api_key: str) -> Server:
    log_file = log.open("wb")
    log_file.write(("$ " + " ".join(cmd) + "\n").encode())
    log_file.flush()
    spawned, spawned_perf = time.time(), time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log_file, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    memory = MemorySampler(proc.pid)
    server = Server(name, f"http://127.0.0.1:{port}", api_key, db, log, proc, spawned, spawned_perf, memory,
                    log_file)
    with _LIVE_LOCK:
        _LIVE.append(server)
    memory.start()
    return server


def start_ours(work: Path, hf_home: Path) -> Server:
    work.mkdir(parents=True, exist_ok=True)
    config = work / "engine.yaml"
    config.write_text(OURS_CONFIG)
    db = work / "service.db"
    env = _base_env(hf_home)
    url = f"sqlite:///{db}"
    key = subprocess.run([sys.executable, "-m", "trainer.service", "keys", "create", "bench", "--db", url],
                         env=env, cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    port = _free_port()
    cmd = [sys.executable, "-m", "trainer.service", "serve", "--config", str(config), "--db", url,
           "--host", "127.0.0.1", "--port", str(port), "--storage", str(work / "checkpoints"),
           "--log-level", "warning"]
    return _spawn("ours", cmd, env, ROOT, work / "server.log", db, port, key)


def start_skyrl(work: Path, hf_home: Path, venv: Path) -> Server:
    work.mkdir(parents=True, exist_ok=True)
    db = work / "tinker.db"
    env = _base_env(hf_home)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # its API runs `uv run ... skyrl.tinker.engine`
    env["UV_NO_SYNC"] = "1"
    port = _free_port()
    # `uv run --no-project`: the repository's pyproject.toml is not skyrl's project; the API re-uses these flags for
    # its engine subprocess (api.py _get_parent_uv_run_args).
    cmd = [str(venv / "bin" / "uv"), "run", "--no-project", "--python", str(venv / "bin" / "python"),
           "-m", "skyrl.tinker.api", "--base-model", BASE_MODEL, "--backend", "jax",
           "--backend-config", json.dumps(SKYRL_BACKEND_CONFIG), "--database-url", f"sqlite:///{db}",
           "--checkpoints-base", str(work / "checkpoints"), "--external-inference-lora-base", str(work / "lora"),
           "--host", "127.0.0.1", "--port", str(port)]
    return _spawn("skyrl", cmd, env, work, work / "server.log", db, port, "tml-dummy")


def wait_http(server: Server, timeout: float = 180.0) -> float:
    """Seconds from spawn until GET /api/v1/healthz answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} before answering; see {server.log}")
        try:
            with urllib.request.urlopen(server.url + "/api/v1/healthz", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - server.spawned_perf
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{server.name}: /api/v1/healthz did not answer in {timeout:.0f} s; see {server.log}")
