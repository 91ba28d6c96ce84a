"""The store on sqlite and PostgreSQL: idempotent submission, per-model ordering (also under concurrent claimers),
long-poll waits, recovery of orphaned claims, checkpoints and sessions."""

from __future__ import annotations

import datetime as dt
import random
import threading
import time

import pytest
from sqlalchemy import text

from trainer.service.store import (
    CRASHED_ENGINE,
    DONE,
    FAILED,
    MAX_RUNS,
    QUEUED,
    RUNNING,
    SCHEMA_VERSION,
    SERVER_RESTARTED,
    Conflict,
    Model,
    NotFound,
    SessionFinished,
    StaleClaim,
    StateUpdate,
    Store,
    StoreError,
    parse_tinker_path,
    rest_tinker_path,
    sampling_session_id_for,
    tinker_path,
)


def _model(store: Store, owner: str, *, first_seq_id: int = 0) -> Model:
    session = store.create_session(owner, tags=["t"], user_metadata={"k": "v"}, sdk_version="0.38.0")
    return store.create_model(owner, session.id, 0, "tiny/base", {"rank": 8}, first_seq_id=first_seq_id)


def test_resubmission_is_idempotent_and_a_different_body_conflicts(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    model = _model(store, alice)
    first = store.submit(alice, "forward_backward", b"body-1", model_id=model.id, seq_id=1)
    again = store.submit(alice, "forward_backward", b"body-1", model_id=model.id, seq_id=1)
    assert again.request_id == first.request_id
    with pytest.raises(Conflict, match=f"seq_id 1 of model '{model.id}'.*different body"):
        store.submit(alice, "forward_backward", b"body-2", model_id=model.id, seq_id=1)
    with pytest.raises(Conflict):  # the same bytes as another operation are another request
        store.submit(alice, "optim_step", b"body-1", model_id=model.id, seq_id=1)
    # Requests without a model: idempotent through their dedup key; without one every submission is new.
    s1 = store.submit(alice, "sample", b"p", dedup_key="sample:s:1")
    assert store.submit(alice, "sample", b"p", dedup_key="sample:s:1").request_id == s1.request_id
    with pytest.raises(Conflict):
        store.submit(alice, "sample", b"q", dedup_key="sample:s:1")
    assert store.submit(alice, "sample", b"p").request_id != store.submit(alice, "sample", b"p").request_id
    # A resubmission after the request finished still gets the same id (the SDK resubmits on HTTP 410).
    worker = store.register_worker()
    store.submit(alice, "create_model", b"{}", model_id=model.id, seq_id=0)
    for _ in range(2):
        [claimed] = store.claim(worker, kinds={"create_model", "forward_backward"})
        store.complete(claimed.request_id, b"ok", worker_id=worker)
    assert store.submit(alice, "forward_backward", b"body-1", model_id=model.id, seq_id=1).request_id == (
        first.request_id
    )
    assert store.get_request(alice, first.request_id).status == DONE


def test_concurrent_identical_submissions_make_one_request(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    model = _model(store, alice)
    stores = [Store(str(store.url.render_as_string(hide_password=False))) for _ in range(4)]
    ids: list[str] = []
    barrier = threading.Barrier(len(stores))

    def submit(st: Store) -> None:
        barrier.wait()
        for seq in range(1, 11):
            row = st.submit(alice, "forward_backward", f"b{seq}".encode(), model_id=model.id, seq_id=seq)
            ids.append(row.request_id)

    threads = [threading.Thread(target=submit, args=(st,)) for st in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for st in stores:
        st.close()
    assert len(ids) == 40 and len(set(ids)) == 10


def test_a_models_requests_run_in_seq_id_order(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    model = _model(store, alice)
    worker = store.register_worker()
    # Submitted out of order (parallel chunks arrive in any order): nothing runs before seq 0 exists.
    r3 = store.submit(alice, "optim_step", b"3", model_id=model.id, seq_id=3)
    r2 = store.submit(alice, "forward_backward", b"2", model_id=model.id, seq_id=2)
    unordered = store.submit(alice, "sample", b"s")
    assert [r.request_id for r in store.claim(worker)] == [unordered.request_id]  # not blocked by the model
    assert store.claim(worker) == []
    r0 = store.submit(alice, "create_model", b"0", model_id=model.id, seq_id=0)
    assert [r.request_id for r in store.claim(worker)] == [r0.request_id]
    assert store.claim(worker) == []  # 1 waits for 0 to finish, and 2 for 1, which is not even submitted yet
    store.fail(r0.request_id, "bad lora config", category="user", worker_id=worker)  # failed counts as finished
    assert store.claim(worker) == []
    r1 = store.submit(alice, "forward_backward", b"1", model_id=model.id, seq_id=1)
    # A batch takes the consecutive requests of the same kind and stops at the optim_step.
    batch = store.claim(worker, max_batch=8)
    assert [r.request_id for r in batch] == [r1.request_id, r2.request_id]
    assert all(r.status == RUNNING and r.worker_id == worker for r in batch)
    assert store.claim(worker) == []
    store.complete(r2.request_id, b"2", worker_id=worker)  # out of order inside the batch: 3 still waits for 1
    assert store.claim(worker) == []
    store.complete(r1.request_id, b"1", worker_id=worker)
    assert [r.request_id for r in store.claim(worker)] == [r3.request_id]
    assert store.get_model(alice, model.id).next_seq_id == 3
    with pytest.raises(StaleClaim):
        store.complete(r1.request_id, b"again", worker_id=worker)
    with pytest.raises(StaleClaim):
        store.complete(r3.request_id, b"not yours", worker_id="someone-else")
    failed = store.get_request(alice, r0.request_id)
    assert (failed.status, failed.error_message, failed.error_category) == (FAILED, "bad lora config", "user")


def test_first_seq_id_and_kind_filter(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    model = _model(store, alice, first_seq_id=1)  # created inline: the client's seq 1 runs first
    worker = store.register_worker()
    fb = store.submit(alice, "forward_backward", b"1", model_id=model.id, seq_id=1)
    sample = store.submit(alice, "sample", b"s")
    assert [r.request_id for r in store.claim(worker, kinds={"sample"})] == [sample.request_id]
    assert [r.request_id for r in store.claim(worker, kinds={"forward_backward"})] == [fb.request_id]


@pytest.mark.parametrize("claimers", [2])
def test_concurrent_claimers_never_share_a_request_and_keep_each_models_order(
    store: Store, owners: tuple[str, str], claimers: int
) -> None:
    alice, bob = owners
    models = [_model(store, alice), _model(store, bob)]
    per_model = 25
    owner_of: dict[str, str] = {}
    rng = random.Random(0)
    order = [(m, seq) for m in models for seq in range(per_model)]
    rng.shuffle(order)  # arrival order has nothing to do with seq order
    for m, seq in order:
        kind = "optim_step" if seq % 3 == 2 else "forward_backward"
        owner_of[store.submit(m.owner_id, kind, f"{m.id}/{seq}".encode(), model_id=m.id, seq_id=seq).request_id] = (
            m.owner_id
        )
    for i in range(20):
        owner_of[store.submit(alice, "sample", f"s{i}".encode()).request_id] = alice

    log: list[tuple[str, str, str | None, int | None]] = []  # (event, request_id, model_id, seq_id)
    batch_of: dict[str, int] = {}
    claims_by: dict[str, int] = {}
    log_lock = threading.Lock()
    stop = threading.Event()
    url = store.url.render_as_string(hide_password=False)
    start = threading.Barrier(claimers)

    def work(n: int) -> None:
        st = Store(url, create=False)  # its own engine and connections, like another process
        worker = st.register_worker(f"w{n}")
        start.wait()
        idle_since = time.monotonic()
        while not stop.is_set() and time.monotonic() - idle_since < 5:
            batch = st.claim(worker, max_batch=rng.choice([1, 3]))
            if not batch:
                time.sleep(0.002)
                continue
            idle_since = time.monotonic()
            with log_lock:
                log.extend(("claim", r.request_id, r.model_id, r.seq_id) for r in batch)
                batch_of.update((r.request_id, len(log)) for r in batch)
                claims_by[worker] = claims_by.get(worker, 0) + len(batch)
            time.sleep(0.002)  # "running" it: the other claimer gets its turns meanwhile
            for r in batch:
                with log_lock:  # logged before the commit, so a later claim of seq+1 is logged after it
                    log.append(("done", r.request_id, r.model_id, r.seq_id))
                st.complete(r.request_id, b"ok", worker_id=worker)
            if st.pending_count() == 0:
                stop.set()
        st.close()

    threads = [threading.Thread(target=work, args=(n,)) for n in range(claimers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    claimed = [rid for ev, rid, _, _ in log if ev == "claim"]
    assert sorted(claimed) == sorted(owner_of)  # every request once, none twice
    assert len(claims_by) == claimers and min(claims_by.values()) > 0, claims_by  # they really competed
    for m in models:
        events = [(ev, seq) for ev, _, mid, seq in log if mid == m.id]
        batch = {seq: batch_of[rid] for ev, rid, mid, seq in log if mid == m.id and ev == "claim"}
        for seq in range(1, per_model):
            # seq runs after seq - 1 finished, or together with it in one batch (one worker, consecutive kinds).
            after = events.index(("claim", seq)) > events.index(("done", seq - 1))
            assert after or batch[seq] == batch[seq - 1], (m.id, seq)
    for rid, owner in owner_of.items():
        row = store.get_request(owner, rid)
        assert row.status == DONE and row.attempts == 1
    assert store.pending_count() == 0


def test_wait_long_polls(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    req = store.submit(alice, "sample", b"s")
    t0 = time.monotonic()
    assert store.wait(alice, req.request_id, 0.3).status == QUEUED
    assert time.monotonic() - t0 >= 0.3
    worker = store.register_worker()
    store.claim(worker)
    # Finished by another Store (another process's view): the waiter sees it by polling.
    other = Store(store.url.render_as_string(hide_password=False), create=False)
    threading.Timer(0.2, lambda: other.complete(req.request_id, b"result", worker_id=worker)).start()
    t0 = time.monotonic()
    row = store.wait(alice, req.request_id, 10)
    assert row.status == DONE and row.result == b"result" and time.monotonic() - t0 < 5
    other.close()
    with pytest.raises(NotFound):
        store.wait(alice, "no-such-request", 0.1)


def test_recover_requeues_pure_reads_and_fails_the_rest(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    model = _model(store, alice, first_seq_id=1)
    dead = store.register_worker("dead")
    fb = store.submit(alice, "forward_backward", b"1", model_id=model.id, seq_id=1)
    fwd = store.submit(alice, "forward", b"2", model_id=model.id, seq_id=2)
    opt = store.submit(alice, "optim_step", b"3", model_id=model.id, seq_id=3)
    sample = store.submit(alice, "sample", b"s")
    [c1] = store.claim(dead)
    [c2] = store.claim(dead)
    assert {c1.request_id, c2.request_id} == {fb.request_id, sample.request_id}

    report = Store(store.url.render_as_string(hide_password=False)).recover()  # a fresh process at start-up
    assert report.failed == [fb.request_id] and report.requeued == [sample.request_id]
    failed = store.get_request(alice, fb.request_id)
    assert failed.status == FAILED and failed.error_message == SERVER_RESTARTED and failed.error_category == "server"
    with pytest.raises(StaleClaim):  # the dead worker's late report (if it were alive) is refused
        store.complete(fb.request_id, b"late", worker_id=dead)
    worker = store.register_worker()
    got = []
    while batch := store.claim(worker):
        got += [r.request_id for r in batch]
        for r in batch:
            store.complete(r.request_id, b"ok", worker_id=worker)
    assert got == [fwd.request_id, opt.request_id, sample.request_id]  # ordering resumes after the failure
    assert store.get_request(alice, sample.request_id).attempts == 2


def test_a_pure_read_that_stopped_the_engine_three_times_fails_instead_of_running_again(
        store: Store, owners: tuple[str, str]) -> None:
    """Issue 40: a sample or forward that kills the engine (memory, a crash in device code) was queued again at every
    start, so the engine never served anyone again. After MAX_RUNS claims it fails; the model's order moves on."""
    alice, _ = owners
    model = _model(store, alice, first_seq_id=1)
    fwd = store.submit(alice, "forward", b"poison", model_id=model.id, seq_id=1)
    after = store.submit(alice, "forward", b"fine", model_id=model.id, seq_id=2)
    for run in range(1, MAX_RUNS + 1):
        [claimed] = store.claim(store.register_worker(f"engine-{run}"))  # the engine dies running it
        assert claimed.request_id == fwd.request_id and claimed.attempts == run
        report = Store(store.url.render_as_string(hide_password=False)).recover()
        assert report.requeued == ([fwd.request_id] if run < MAX_RUNS else []), run
    row = store.get_request(alice, fwd.request_id)
    assert row.status == FAILED and row.error_category == "server"
    assert row.error_message == CRASHED_ENGINE.format(n=MAX_RUNS)
    [next_one] = store.claim(store.register_worker("engine-4"))
    assert next_one.request_id == after.request_id


def test_a_refused_number_fails_in_its_place_and_the_order_goes_on(store: Store, owners: tuple[str, str]) -> None:
    """Issue 40: the API's 4xx at submit writes the refused number as a failed request (Store.refuse), so the
    client's next number runs; never over a number that holds a request, never on another owner's model."""
    alice, bob = owners
    model = _model(store, alice, first_seq_id=1)
    assert store.refuse(alice, "save_weights", model.id, 1, "checkpoint name 'a b': use letters, ...")
    after = store.submit(alice, "forward", b"next", model_id=model.id, seq_id=2)
    [claimed] = store.claim(store.register_worker())
    assert claimed.request_id == after.request_id
    assert not store.refuse(alice, "optim_step", model.id, 2, "taken")  # the request there answers for it
    assert not store.refuse(bob, "optim_step", model.id, 3, "not bob's")
    with pytest.raises(Conflict):  # a different body at a refused number
        store.submit(alice, "save_weights", b"{}", model_id=model.id, seq_id=1)


def test_recover_with_heartbeats_leaves_live_workers_alone(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    stale, live = store.register_worker("stale"), store.register_worker("live")
    a = store.submit(alice, "optim_step", b"a")
    b = store.submit(alice, "optim_step", b"b")
    store.claim(stale)
    store.claim(live)
    time.sleep(0.3)
    store.worker_heartbeat(live)
    report = store.recover(stale_after_s=0.2)
    assert report.failed == [a.request_id] and report.requeued == []
    assert store.get_request(alice, b.request_id).status == RUNNING


def test_fail_queued(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    model = _model(store, alice, first_seq_id=1)
    ids = [store.submit(alice, "forward_backward", b"x", model_id=model.id, seq_id=s).request_id for s in (1, 2)]
    assert store.fail_queued(model.id, "model lost") == ids
    assert store.get_model(alice, model.id).next_seq_id == 3
    assert store.claim(store.register_worker()) == []


def test_sessions(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    session = store.create_session(alice, tags=["a", "b"], user_metadata={"x": 1}, sdk_version="0.38.0")
    assert session.created_at.tzinfo is not None
    beat = store.heartbeat(alice, session.id)
    assert beat.heartbeat_at >= session.heartbeat_at
    done = store.finish_session(alice, session.id, "success", "bye")
    assert store.finish_session(alice, session.id, "errored").finish_reason == "success"
    assert done.finished_at is not None
    with pytest.raises(SessionFinished):
        store.heartbeat(alice, session.id)
    got = store.get_session(alice, session.id)
    assert (got.tags, got.user_metadata, got.sdk_version) == (["a", "b"], {"x": 1}, "0.38.0")
    page = store.list_sessions(alice, limit=1)
    assert page.total == 1 and [s.id for s in page.items] == [session.id]


def test_models_are_created_once_per_session_seq(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    session = store.create_session(alice)
    m = store.create_model(alice, session.id, 0, "tiny/base", {"rank": 8, "train_mlp": True})
    assert m.id == f"{session.id}:train:0"
    assert store.create_model(alice, session.id, 0, "ignored", {}).lora_config == {"rank": 8, "train_mlp": True}
    store.create_model(alice, session.id, 1, "tiny/base")
    page = store.list_models(alice, limit=10, offset=1)
    assert page.total == 2 and [x.model_seq_id for x in page.items] == [1]


def test_checkpoints(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    model = _model(store, alice)
    ck = store.add_checkpoint(alice, model.id, "step-10", "training", "/ckpt/a", size_bytes=123)
    assert ck.tinker_path == f"tinker://{model.id}/weights/step-10" == tinker_path(model.id, "training", "step-10")
    assert parse_tinker_path(ck.tinker_path) == (model.id, "training", "step-10")
    assert ck.checkpoint_id == "weights/step-10"
    with pytest.raises(Conflict):
        store.add_checkpoint(alice, model.id, "step-10", "training", "/ckpt/b")
    again = store.add_checkpoint(alice, model.id, "step-10", "training", "/ckpt/b", overwrite=True)
    assert again.storage_path == "/ckpt/b" and store.get_checkpoint(alice, ck.tinker_path).storage_path == "/ckpt/b"
    sampler = store.add_checkpoint(alice, model.id, "step-10", "sampler", "/ckpt/s")
    assert sampler.tinker_path == f"tinker://{model.id}/sampler_weights/step-10"
    short = store.add_checkpoint(alice, model.id, "tmp", "sampler", "/ckpt/t", ttl_seconds=0)
    with pytest.raises(NotFound):  # expired: gone for the client, listed for the clean-up
        store.get_checkpoint(alice, short.tinker_path)
    assert [c.tinker_path for c in store.expired_checkpoints()] == [short.tinker_path]
    assert store.expired_checkpoints(dt.datetime(2000, 1, 1, tzinfo=dt.UTC)) == []
    listed = store.list_checkpoints(alice, model.id)
    assert listed.total == 2 and {c.kind for c in listed.items} == {"training", "sampler"}
    assert [c.tinker_path for c in listed.items] == [sampler.tinker_path, again.tinker_path]  # newest first
    assert [c.tinker_path for c in store.list_checkpoints(alice, model.id, limit=1).items] == [sampler.tinker_path]
    assert store.delete_checkpoint(alice, sampler.tinker_path).storage_path == "/ckpt/s"
    with pytest.raises(NotFound):
        store.get_checkpoint(alice, sampler.tinker_path)
    for bad in ("../x", "a/b", "", "x" * 201):
        with pytest.raises(ValueError):
            store.add_checkpoint(alice, model.id, bad, "training", "/x")
    for bad_path in ("s3://x/weights/a", f"tinker://{model.id}/other/a", "tinker://m/weights/a/b"):
        with pytest.raises(ValueError):
            parse_tinker_path(bad_path)
        with pytest.raises(NotFound):
            store.get_checkpoint(alice, bad_path)


def test_external_checkpoints_ttl_changes_and_server_secrets(store: Store, owners: tuple[str, str]) -> None:
    alice, bob = owners
    model = _model(store, alice)
    ext = store.add_checkpoint(alice, model.id, "final", "external", "/ckpt/e")
    assert ext.tinker_path == f"tinker://{model.id}/external_weights/final"
    assert ext.checkpoint_id == "external_weights/final"
    assert parse_tinker_path(ext.tinker_path) == (model.id, "external", "final")
    assert rest_tinker_path(model.id, "external_weights/final") == ext.tinker_path
    with pytest.raises(ValueError):
        rest_tinker_path(model.id, "other/final")
    with pytest.raises(NotFound):  # another owner's
        store.set_checkpoint_ttl(bob, ext.tinker_path, 3600)
    assert store.set_checkpoint_ttl(alice, ext.tinker_path, 3600).expires_at is not None
    assert store.set_checkpoint_ttl(alice, ext.tinker_path, None).expires_at is None
    with pytest.raises(ValueError, match="10 years"):  # a datetime would overflow (a 500 the SDK retries)
        store.set_checkpoint_ttl(alice, ext.tinker_path, 10**13)
    with pytest.raises(ValueError, match="10 years"):
        store.add_checkpoint(alice, ext.model_id, "far", "sampler", "/ckpt/far", ttl_seconds=10**13)
    store.set_checkpoint_ttl(alice, ext.tinker_path, 0)
    with pytest.raises(NotFound):  # expired now
        store.get_checkpoint(alice, ext.tinker_path)
    key = store.secret("download-urls")
    assert len(key) == 32 and store.secret("download-urls") == key != store.secret("another")
    other = store.clone()
    try:
        assert other.secret("download-urls") == key  # every process on the database shares it
    finally:
        other.close()


def test_sampling_sessions(store: Store, owners: tuple[str, str]) -> None:
    alice, _ = owners
    model = _model(store, alice)
    ck = store.add_checkpoint(alice, model.id, "s1", "sampler", "/ckpt/s1")
    ss = store.create_sampling_session(alice, model.session_id, 0, base_model="tiny/base", model_path=ck.tinker_path)
    assert ss.model_id == model.id
    assert store.create_sampling_session(alice, model.session_id, 0, base_model="other").id == ss.id
    assert store.get_sampling_session(alice, ss.id).model_path == ck.tinker_path
    req = store.submit(alice, "sample", b"p", sampling_session_id=ss.id, seq_id=1, dedup_key=f"sample:{ss.id}:1")
    assert store.submit(
        alice, "sample", b"p", sampling_session_id=ss.id, seq_id=1, dedup_key=f"sample:{ss.id}:1"
    ).request_id == req.request_id
    with pytest.raises(ValueError, match="dedup_key"):
        store.submit(alice, "sample", b"p", seq_id=1)


def test_schema_creation_races_and_version_guard(db_url: str) -> None:
    errors: list[BaseException] = []

    def open_store() -> None:
        try:
            Store(db_url).close()
        except BaseException as e:  # reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=open_store) for _ in range(4)]  # API and engine starting together
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    st = Store(db_url)
    with st.engine.begin() as conn:
        assert conn.execute(text("SELECT value FROM store_meta")).scalars().all() == [str(SCHEMA_VERSION)]
        conn.execute(text("UPDATE store_meta SET value = :v"), {"v": str(SCHEMA_VERSION + 1)})
    st.close()
    with pytest.raises(StoreError, match="newer than this code"):
        Store(db_url)


def test_a_schema_1_database_is_migrated_in_place(db_url: str, owners: tuple[str, str]) -> None:
    """A database written by schema 1 (no workers.base_model, no model_states) opens, keeps its rows and gains both."""
    st = Store(db_url)
    alice, _ = owners
    model = _model(st, alice)
    with st.engine.begin() as conn:  # schema 1, as the previous release left it
        conn.execute(text("DROP TABLE model_states"))
        conn.execute(text("ALTER TABLE workers DROP COLUMN base_model"))
        conn.execute(text("UPDATE store_meta SET value = '1'"))
    st.close()
    st = Store(db_url)
    try:
        with st.engine.begin() as conn:
            assert conn.execute(text("SELECT value FROM store_meta")).scalars().all() == [str(SCHEMA_VERSION)]
        assert st.get_model(alice, model.id).id == model.id
        worker = st.register_worker(base_model="tiny/base")
        assert st.engine_up("tiny/base") and not st.engine_up("other/base")
        st.submit(alice, "create_model", b"{}", model_id=model.id, seq_id=0)
        [row] = st.claim(worker)
        st.complete(row.request_id, b"ok", worker_id=worker, state=StateUpdate(model.id, 0, 0, None))
        assert st.model_state(model.id).seq_id == 0  # type: ignore[union-attr]
    finally:
        st.close()


def test_state_and_checkpoints_commit_with_the_request_that_made_them(store: Store, owners: tuple[str, str]) -> None:
    """A model's state moves only with its request's completion, and a save's checkpoint row (and its sampler) only
    with the save's: a save that conflicts leaves the request running and nothing behind."""
    alice, _ = owners
    model = _model(store, alice)
    worker = store.register_worker(base_model="tiny/base")
    for seq, kind in enumerate(("create_model", "optim_step", "save_weights_for_sampler", "save_weights_for_sampler")):
        store.submit(alice, kind, f"{seq}".encode(), model_id=model.id, seq_id=seq)
    [create] = store.claim(worker)
    store.complete(create.request_id, b"ok", worker_id=worker, state=StateUpdate(model.id, 0, 0, None))
    [step] = store.claim(worker)
    store.complete(step.request_id, b"ok", worker_id=worker, state=StateUpdate(model.id, 1, 1, "/snap/1"))
    state = store.model_state(model.id)
    assert state is not None and (state.seq_id, state.step, state.storage_path) == (1, 1, "/snap/1")
    [save] = store.claim(worker)
    store.add_checkpoint(alice, model.id, "s1", "sampler", "/ckpt/a", sampler_seq_id=5,
                         completes=(save.request_id, worker, b"saved"))
    assert store.get_request(alice, save.request_id).status == DONE
    sampler = store.get_sampling_session(alice, sampling_session_id_for(model.session_id, 5))
    assert sampler.model_path == tinker_path(model.id, "sampler", "s1")
    [again] = store.claim(worker)
    with pytest.raises(Conflict):
        store.add_checkpoint(alice, model.id, "s1", "sampler", "/ckpt/b", sampler_seq_id=6,
                             completes=(again.request_id, worker, b"saved"))
    assert store.get_request(alice, again.request_id).status == RUNNING
    with pytest.raises(NotFound):
        store.get_sampling_session(alice, sampling_session_id_for(model.session_id, 6))
    assert store.get_checkpoint(alice, tinker_path(model.id, "sampler", "s1")).storage_path == "/ckpt/a"
    assert [r.seq_id for r in store.replay_log(model.id, 0, {"optim_step"})] == [1]


def test_engine_up_follows_heartbeats_and_retirement(store: Store) -> None:
    assert not store.engine_up(None)
    worker = store.register_worker(base_model="tiny/base")
    assert store.engine_up("tiny/base") and store.engine_up(None) and not store.engine_up("other/base")
    with store.engine.begin() as conn:  # its last beat 11 s ago: gone (ENGINE_GONE_AFTER_S)
        conn.execute(text("UPDATE workers SET heartbeat_at = :t"),
                     {"t": (dt.datetime.now(dt.UTC) - dt.timedelta(seconds=11)).replace(tzinfo=None)})
    assert not store.engine_up("tiny/base")
    store.worker_heartbeat(worker)
    assert store.engine_up("tiny/base")
    store.retire_worker(worker)
    assert not store.engine_up("tiny/base")


def test_an_engine_claims_only_its_base_model(store: Store, owners: tuple[str, str]) -> None:
    """One API may serve several base models, each with its engine: a claim for one never takes another's work."""
    alice, _ = owners
    session = store.create_session(alice, tags=[], user_metadata={}, sdk_version="0.38.0")
    small = store.create_model(alice, session.id, 0, "tiny/base", {"rank": 8}, first_seq_id=0)
    large = store.create_model(alice, session.id, 1, "big/base", {"rank": 8}, first_seq_id=0)
    small_sampler = store.create_sampling_session(alice, session.id, 0, base_model="tiny/base")
    large_sampler = store.create_sampling_session(alice, session.id, 1, base_model="big/base")
    rows = {
        "large create": store.submit(alice, "create_model", b"l", model_id=large.id, seq_id=0),
        "large sample": store.submit(alice, "sample", b"ls", sampling_session_id=large_sampler.id, seq_id=1,
                                     dedup_key="sample:l:1"),
        "small create": store.submit(alice, "create_model", b"s", model_id=small.id, seq_id=0),
        "small sample": store.submit(alice, "sample", b"ss", sampling_session_id=small_sampler.id, seq_id=1,
                                     dedup_key="sample:s:1"),
        "small sample 2": store.submit(alice, "sample", b"ss2", sampling_session_id=small_sampler.id, seq_id=2,
                                       dedup_key="sample:s:2"),
        "no model": store.submit(alice, "delete_checkpoint", b"{}"),
    }
    tiny = store.register_worker(base_model="tiny/base")
    taken = [r.request_id for r in store.claim(tiny, base_model="tiny/base")]
    taken += [r.request_id for r in store.claim(tiny, base_model="tiny/base", max_batch=8)]
    taken += [r.request_id for r in store.claim(tiny, base_model="tiny/base", max_batch=8)]
    assert store.claim(tiny, base_model="tiny/base", max_batch=8) == []
    names = {v.request_id: k for k, v in rows.items()}
    assert sorted(names[t] for t in taken) == ["no model", "small create", "small sample", "small sample 2"]
    big = store.register_worker(base_model="big/base")
    assert sorted(names[r.request_id] for _ in range(2) for r in store.claim(big, base_model="big/base")) == [
        "large create", "large sample"]


def test_the_fair_share_serves_the_owner_served_longest_ago_first(store: Store, owners: tuple[str, str]) -> None:
    """Issue 40: oldest-first let one user's backlog of samples hold everyone else's request behind all of it (and a
    claim took 64 of them at once). With owner_order, a newcomer's request goes next, then the owners in turn."""
    alice, bob = owners
    worker = store.register_worker("w")
    mine = [store.submit(alice, "sample", b"p", dedup_key=f"sample:a:{i}") for i in range(5)]
    theirs = store.submit(bob, "sample", b"p", dedup_key="sample:b:0")
    # Oldest first, as before, without an order; unordered requests batch unless told not to.
    assert [r.request_id for r in store.claim(worker, max_batch=3)] == [r.request_id for r in mine[:3]]
    first = store.claim(worker, max_batch=64, owner_order=[alice, bob], batch_unordered=False)
    assert [r.request_id for r in first] == [mine[3].request_id]  # bob was served more lately: alice first, alone
    assert [r.request_id for r in store.claim(worker, owner_order=[alice])] == [theirs.request_id]  # never served
    assert [r.request_id for r in store.claim(worker, owner_order=[bob, alice])] == [mine[4].request_id]
    assert store.claim(worker, owner_order=[bob, alice]) == []
