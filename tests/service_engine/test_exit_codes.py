"""review 2026-11-28 #3: the always-on engine never ends its JobSet on a transient error. `python -m trainer.service
engine` runs as a real process here, as its pods run it: the database unreachable at start is retried for
service.db_retry_s and then exits 42 (the podFailurePolicy restarts the JobSet on it), or goes on when
the database comes back; the engine thread ending without a SIGTERM exits 42, never 0 (which completed the JobSet);
a SIGTERM exits 143, followers included; a process group that never forms exits 42."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine as SqlEngine
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from tests.service.cloudsql_fake import FakeCloudSql
from tests.service.test_cloudsql import ENGINE_USER, iam_db, start_cloudsql  # noqa: F401 - fixtures
from tests.service_engine.service import TINY_MODEL, tiny_config
from trainer.run.cli import EXIT_CONFIG, EXIT_STOPPED, EXIT_TRANSIENT
from trainer.run.launch import child_env, free_port
from trainer.service import auth
from trainer.service.engine import Engine
from trainer.service.store import CLOUDSQL_INSTANCE_ENV, CLOUDSQL_USER_ENV, DONE, FINISHED, Store
from workloads.jobset import RESTART_EXIT_CODES

ROOT = Path(__file__).resolve().parents[2]
BASE = "tiny/random"
# The engine with its loop broken by something no retry catches (what reached the old `return 0`).
BROKEN_ENGINE = """
import sys
from trainer.service import cli
from trainer.service.engine import Engine
class Escaped(BaseException):
    pass
def step(self):
    raise Escaped("the engine loop broke")
Engine.step = step
sys.exit(cli.main(sys.argv[1:]))
"""


def _config(tmp: Path) -> Path:
    path = tmp / "engine.yaml"
    path.write_text(json.dumps({
        "model": TINY_MODEL, "lora": {"rank": 8, "alpha": 32, "slots": 4},
        "service": {"base_model": BASE, "min_bucket": 16, "storage_dir": str(tmp / "bucket"), "warmup": False},
    }))
    return path


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "JAX_PLATFORMS": "cpu", "HOME": str(home), **extra}


def _engine_cmd(config: Path, *more: str, script: str | None = None) -> list[str]:
    head = [sys.executable, "-c", script] if script else [sys.executable, "-m", "trainer.service"]
    return [*head, "engine", "--config", str(config), "--log-level", "info", *more]


def _wait_for(what: str, ok: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert proc.poll() is None, f"the engine exited {proc.returncode} before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def test_the_database_unreachable_at_start_exits_42_after_the_retry_window(tmp_path: Path) -> None:
    """No server behind the URL (Cloud SQL down for maintenance): the start-up retries with backoff, then exits 42
    with one line on stderr; the old code died with a traceback (exit 1: FailJobSet)."""
    nothing = tmp_path / "no-server"
    nothing.mkdir()
    db = f"postgresql+psycopg://engine@/service?host={nothing}"
    start = time.monotonic()
    proc = subprocess.run(_engine_cmd(_config(tmp_path), "--db", db, "--set", "service.db_retry_s=4"),
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == EXIT_TRANSIENT, proc.stderr[-4000:]
    assert EXIT_TRANSIENT in RESTART_EXIT_CODES
    [line] = _errors(proc.stderr)
    assert "the database stayed unavailable for 4 s" in line and "open the store" in line, line
    assert line.endswith(f"exiting {EXIT_TRANSIENT} to be restarted"), line
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count("the database is unavailable to open the store") >= 2  # retried, with backoff
    print(f"engine with no database: exit {proc.returncode} after {took:.1f} s")
    assert took < 60


def test_the_engine_waits_for_cloud_sql_then_serves_and_stops_143(
    start_cloudsql: Callable[..., FakeCloudSql], iam_db: SqlEngine, tmp_path: Path,  # noqa: F811
) -> None:
    """The engine command on Cloud SQL (the stand-in; the engine pod's variables, no --db) while the instance is down:
    it retries, goes on once the instance is back, runs a request the API queued, and exits 143 on SIGTERM. Also
    review 2026-11-28 #2: the engine's own Store reaches Cloud SQL through the connector, as its own IAM user."""
    fake = start_cloudsql()
    real_socket = fake.pg_unix_socket
    link = tmp_path / "instance" / Path(real_socket).name
    link.parent.mkdir()
    fake.pg_unix_socket = str(link)  # the instance is down: its port answers TLS but reaches no server
    log = tmp_path / "engine.log"
    env = _env(tmp_path, **{CLOUDSQL_USER_ENV: ENGINE_USER})
    proc = subprocess.Popen(_engine_cmd(_config(tmp_path), "--set", "service.db_retry_s=90"), cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    api = None
    try:
        _wait_for("a retry", lambda: "the database is unavailable to open the store" in log.read_text(), proc, log, 60)
        link.symlink_to(real_socket)  # the instance is back
        api = Store()  # the API's side: its own IAM user, the same database
        key, _ = auth.create_key(api, "t")
        session = api.create_session(key.id)
        model = api.create_model(key.id, session.id, 0, BASE, {"rank": 4})
        row = api.submit(key.id, "create_model", b"{}", model_id=model.id, seq_id=0)
        _wait_for("a completed request", lambda: api.wait(key.id, row.request_id, 1.0).status in FINISHED, proc, log,
                  60)
        assert api.get_request(key.id, row.request_id).status == DONE
        with iam_db.connect() as conn:
            assert conn.execute(text("SELECT pid FROM workers")).scalars().all() == [proc.pid]
        assert any(t.client_bytes and t.startup_params()["user"] == ENGINE_USER for t in fake.tunnels)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == EXIT_STOPPED, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if api is not None:
            api.close()
    out = log.read_text()
    assert "Traceback" not in out and _errors(out) == [], out[-4000:]
    assert not list((tmp_path / "home").rglob("*.db"))  # no private sqlite store


def test_the_engine_thread_ending_without_sigterm_exits_42(tmp_path: Path) -> None:
    """Something escapes the engine loop (the old code then returned 0, and the JobSet completed for good)."""
    proc = subprocess.run(_engine_cmd(_config(tmp_path), "--db", str(tmp_path / "service.db"), script=BROKEN_ENGINE),
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_TRANSIENT, proc.stderr[-4000:]
    [line] = _errors(proc.stderr)
    assert "the engine stopped without a SIGTERM" in line, line


@pytest.mark.parametrize("how", ["sigterm", "error", "no-database", "config-error"])
def test_followers_exit_as_process_0_does(tmp_path: Path, how: str) -> None:
    """A two-process engine (process 1 follows process 0's device ops): a SIGTERM stops both with 143; process 0's
    loop breaking stops both with 42. The old follower exited 0 either way. The database unreachable at start: both
    exit 42 at once (process 0 stops its follower, which waits for a first op; before, process 0 sat in
    jax.distributed's shutdown barrier for minutes and the follower then died by a signal: the as-deployed harness).
    A configuration error on process 0 (half-set Cloud SQL variables): both exit 2, so the JobSet fails whichever pod
    the Job controller judges first (the second fresh-eyes review: a follower's 42 would have made it a restart)."""
    config = _config(tmp_path)
    db = tmp_path / "service.db"
    nothing = tmp_path / "no-server"
    nothing.mkdir()
    db_args = {"no-database": ("--db", f"postgresql+psycopg://engine@/service?host={nothing}", "--set",
                               "service.db_retry_s=2"),
               "config-error": ()}.get(how, ("--db", str(db)))
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    for i in range(2):
        env = {**_env(tmp_path), **child_env(os.environ, i, 2, 1, port)}
        if how == "config-error":
            env[CLOUDSQL_INSTANCE_ENV] = "p:r:i"  # without its _USER and _DATABASE
        script = BROKEN_ENGINE if (how == "error" and i == 0) else None
        procs.append(subprocess.Popen(_engine_cmd(config, *db_args, script=script), cwd=ROOT, env=env,
                                      stdout=logs[i].open("w"), stderr=subprocess.STDOUT))
    try:
        if how == "sigterm":
            _wait_for("the engine up", lambda: db.exists() and _engine_up(db), procs[0], logs[0], 90)
            for proc in procs:  # as the JobSet's pods are all deleted
                proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        codes = [proc.wait(90) for proc in procs]
        took = time.monotonic() - start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    want, reason = {"sigterm": (EXIT_STOPPED, "stopped"), "config-error": (EXIT_CONFIG, "bug")}.get(
        how, (EXIT_TRANSIENT, "failed"))
    assert codes == [want, want], [log.read_text()[-3000:] for log in logs]
    follower = logs[1].read_text()
    assert f"engine follower: stop ({reason})" in follower, follower[-3000:]
    assert took < 60, took  # no process waits out a shutdown barrier


def _engine_up(db: Path) -> bool:
    store = Store(f"sqlite:///{db}", create=False)
    try:
        return store.engine_up(BASE)
    except OperationalError:  # the tables are not there yet
        return False
    finally:
        store.close()


def test_a_process_group_that_never_forms_exits_42(tmp_path: Path) -> None:
    """Process 1 of 2 whose coordinator never answers: the watchdog exits 42 after TRAINER_INIT_TIMEOUT_SECONDS (the
    old code let jax's own deadline abort the process natively)."""
    env = {**_env(tmp_path), **child_env(os.environ, 1, 2, 1, free_port()), "TRAINER_INIT_TIMEOUT_SECONDS": "2"}
    proc = subprocess.run(_engine_cmd(_config(tmp_path), "--db", str(tmp_path / "service.db")), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_TRANSIENT, proc.stderr[-4000:]
    assert "the process group did not form within 2 s" in proc.stderr, proc.stderr[-4000:]


def test_a_database_error_while_restoring_live_models_is_retried(tmp_path: Path) -> None:
    """restore_live ran outside the loop's retry: one failed query ended the engine thread (and the old CLI exited
    0). Now it is retried like a step, before anything is claimed."""
    db = f"sqlite:///{tmp_path / 'service.db'}"
    store = Store(db)
    engine = Engine(Store(db), tiny_config(tmp_path / "bucket"))
    real = engine.store.live_models
    calls: list[float] = []

    def flaky(**kwargs: float) -> list:  # type: ignore[type-arg]
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise OperationalError("SELECT ...", {}, Exception("server closed the connection unexpectedly"))
        return real(**kwargs)

    engine.store.live_models = flaky  # type: ignore[method-assign]
    stop = threading.Event()
    thread = threading.Thread(target=engine.run, args=(stop,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(calls) < 2:  # the loop backed off and restored again, then went on to claim work
            assert thread.is_alive() and time.monotonic() < deadline, "the engine thread ended"
            time.sleep(0.1)
        time.sleep(1.0)
        assert thread.is_alive() and store.engine_up(BASE) and len(calls) == 2
    finally:
        stop.set()
        thread.join(30)
        engine.store.close()
        store.close()
