"""Nothing accepted is lost: a process that accepted requests and was running some is SIGKILLed; a new Store on the
same database recovers, and every accepted request then ends done or failed with a clear error, while the
key, session, model, checkpoints and sampler saved before the kill are all there."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from trainer.service import auth
from trainer.service.store import DONE, FAILED, QUEUED, RUNNING, SERVER_RESTARTED, Store

ROOT = Path(__file__).resolve().parents[2]


def test_sigkill_mid_flight_loses_nothing(db_url: str) -> None:
    Store(db_url).close()  # the schema exists before the child and the checks race for it
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.service.crash_child", db_url],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert child.stdout is not None
    try:
        first = child.stdout.readline()
        assert first, child.stderr.read() if child.stderr else ""
        state = json.loads(first)
        accepted = [child.stdout.readline().strip() for _ in range(30)]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    rest = child.stdout.read()  # ids printed before the kill landed: accepted too (a cut last line is not)
    accepted += [line for line in rest.split("\n")[:-1] if line]
    assert child.returncode == -signal.SIGKILL and len(accepted) >= 30

    store = Store(db_url)
    try:
        owner = state["owner"]
        running = store.get_request(owner, state["running"]["optim"])
        assert running.status == RUNNING  # as the dead process left it
        report = store.recover()
        assert report.failed == [state["running"]["optim"]] and report.requeued == [state["running"]["sample"]]

        # Everything saved before the kill is there.
        assert auth.authenticate(store, state["key"]) == owner
        assert store.get_session(owner, state["session"]).user_metadata == {"run": "1"}
        assert store.get_model(owner, state["model"]).lora_config == {"rank": 8}
        listed = store.list_checkpoints(owner, state["model"]).items  # newest first
        assert [c.tinker_path for c in listed] == state["checkpoints"][::-1]
        assert store.get_sampling_session(owner, state["sampler"]).model_path == state["checkpoints"][1]
        for rid in state["done"]:
            assert store.get_request(owner, rid).status == DONE
        for rid in [*state["queued"], *accepted]:
            assert store.get_request(owner, rid).status == QUEUED

        # A new engine drains the queue: every accepted request ends done, or failed with a clear error.
        worker = store.register_worker("reborn")
        ran: list[str] = []
        while batch := store.claim(worker, max_batch=8):
            for req in batch:
                ran.append(req.request_id)
                store.complete(req.request_id, b"ok:" + req.body, worker_id=worker)
        assert state["running"]["optim"] not in ran  # an optim_step is never applied twice
        assert ran[:2] == state["queued"]  # the model's order resumes after the failed seq_id
        expected = [state["running"]["sample"], *state["queued"], *accepted]
        assert len(ran) == len(set(ran)) and set(expected) <= set(ran)  # every accepted request ran, once
        # The child commits, then prints: the kill can land between the two for the last one, which ran too.
        unacknowledged = sorted(set(ran) - set(expected))
        assert len(unacknowledged) <= 1, unacknowledged
        every = [*state["done"], *state["running"].values(), *expected, *unacknowledged]
        for rid in every:
            row = store.wait(owner, rid, 0)
            assert row.status in (DONE, FAILED), row.status
            if row.status == FAILED:
                assert row.error_message == SERVER_RESTARTED and row.error_category == "server"
        optim = store.get_request(owner, state["running"]["optim"])
        assert optim.status == FAILED and optim.attempts == 1
        assert "server restarted" in SERVER_RESTARTED and "resubmit" in SERVER_RESTARTED
        assert store.pending_count() == 0
    finally:
        store.close()
