"""One key's sessions, models, requests, checkpoints and samplers are invisible to another key: every lookup by
another owner's id fails exactly like a lookup of a missing id, and every listing leaves them out."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from trainer.service.store import NotFound, Store


def _not_found_message(call: Callable[[], Any]) -> str:
    with pytest.raises(NotFound) as err:
        call()
    return str(err.value)


def test_another_keys_rows_read_as_missing(store: Store, owners: tuple[str, str]) -> None:
    alice, bob = owners
    session = store.create_session(alice)
    model = store.create_model(alice, session.id, 0, "tiny/base", {"rank": 4})
    ck = store.add_checkpoint(alice, model.id, "final", "training", "/ckpt/final")
    sck = store.add_checkpoint(alice, model.id, "final", "sampler", "/ckpt/final-sampler")
    sampler = store.create_sampling_session(alice, session.id, 0, base_model="tiny/base", model_path=sck.tinker_path)
    req = store.submit(alice, "create_model", b"{}", model_id=model.id, seq_id=0)
    bob_session = store.create_session(bob)

    # Bob using Alice's real ids gets the very error a made-up id of the same shape gets.
    lookups: list[tuple[Callable[[str], Any], str, str]] = [
        (lambda i: store.get_session(bob, i), session.id, session.id[:-4] + "0000"),
        (lambda i: store.heartbeat(bob, i), session.id, session.id[:-4] + "0000"),
        (lambda i: store.finish_session(bob, i, "success"), session.id, session.id[:-4] + "0000"),
        (lambda i: store.get_model(bob, i), model.id, model.id + "9"),
        (lambda i: store.list_checkpoints(bob, i), model.id, model.id + "9"),
        (lambda i: store.get_checkpoint(bob, i), ck.tinker_path, ck.tinker_path + "x"),
        (lambda i: store.get_checkpoint(bob, i), sck.tinker_path, sck.tinker_path + "x"),
        (lambda i: store.delete_checkpoint(bob, i), ck.tinker_path, ck.tinker_path + "x"),
        (lambda i: store.get_request(bob, i), req.request_id, "0" * 32),
        (lambda i: store.wait(bob, i, 0.01), req.request_id, "0" * 32),
        (lambda i: store.get_sampling_session(bob, i), sampler.id, sampler.id + "9"),
        (lambda i: store.submit(bob, "forward_backward", b"x", model_id=i, seq_id=1), model.id, model.id + "9"),
        (lambda i: store.submit(bob, "sample", b"x", sampling_session_id=i), sampler.id, sampler.id + "9"),
        (lambda i: store.add_checkpoint(bob, i, "mine", "training", "/x"), model.id, model.id + "9"),
        (lambda i: store.create_model(bob, i, 5, "tiny/base"), session.id, session.id[:-4] + "0000"),
        (lambda i: store.create_sampling_session(bob, i, 5, base_model="b"), session.id, session.id[:-4] + "0000"),
        (
            lambda i: store.create_sampling_session(bob, bob_session.id, 1, base_model="b", model_path=i),
            sck.tinker_path,
            sck.tinker_path + "x",
        ),
    ]
    for call, real, missing in lookups:
        real_msg = _not_found_message(functools.partial(call, real))
        missing_msg = _not_found_message(functools.partial(call, missing))
        assert real_msg == missing_msg.replace(repr(missing), repr(real)), (real_msg, missing_msg)

    # Listings: Bob sees only his own session and nothing of Alice's.
    assert [s.id for s in store.list_sessions(bob).items] == [bob_session.id]
    assert store.list_models(bob).total == 0
    assert store.list_checkpoints(bob).total == 0
    assert store.list_sampling_sessions(bob).total == 0
    assert store.list_models(bob, session_id=session.id).total == 0
    assert store.list_sampling_sessions(bob, session_id=session.id).total == 0
    assert [m.id for m in store.list_models(alice, session_id=session.id).items] == [model.id]
    assert [x.id for x in store.list_sampling_sessions(alice, session_id=session.id).items] == [sampler.id]
    # Nothing of Alice's was touched by Bob's attempts.
    assert store.get_session(alice, session.id).finished_at is None
    assert store.get_checkpoint(alice, ck.tinker_path).storage_path == "/ckpt/final"
    assert store.list_checkpoints(alice).total == 2 and store.list_models(alice).total == 1
    assert store.list_sessions(alice).total == 1


def test_dedup_keys_are_per_owner(store: Store, owners: tuple[str, str]) -> None:
    alice, bob = owners
    a = store.submit(alice, "sample", b"alice's", dedup_key="sample:x:1")
    b = store.submit(bob, "sample", b"bob's", dedup_key="sample:x:1")  # no conflict, no shared result
    assert a.request_id != b.request_id
    with pytest.raises(NotFound):
        store.get_request(bob, a.request_id)
