"""Run by test_crash.py as its own process (`python -m tests.service.crash_child URL`): it builds state, leaves
requests queued and in flight, then submits requests in a loop, printing each request id once it is accepted,
until the test SIGKILLs it."""

from __future__ import annotations

import json
import sys
import time

from trainer.service import auth
from trainer.service.store import Store


def main(url: str) -> None:
    store = Store(url)
    key_row, key = auth.create_key(store, "crash")
    owner = key_row.id
    session = store.create_session(owner, tags=["crash"], user_metadata={"run": "1"})
    model = store.create_model(owner, session.id, 0, "tiny/base", {"rank": 8})
    worker = store.register_worker("doomed")
    done = [
        store.submit(owner, "create_model", b"{}", model_id=model.id, seq_id=0),
        store.submit(owner, "forward_backward", b"fb1", model_id=model.id, seq_id=1),
    ]
    for req in done:
        [claimed] = store.claim(worker)
        store.complete(claimed.request_id, b"ok:" + req.body, worker_id=worker)
    training = store.add_checkpoint(owner, model.id, "before-kill", "training", "/ckpt/state", size_bytes=10)
    sampler_ck = store.add_checkpoint(owner, model.id, "before-kill", "sampler", "/ckpt/adapter", size_bytes=5)
    sampler = store.create_sampling_session(
        owner, session.id, 0, base_model="tiny/base", model_path=sampler_ck.tinker_path
    )
    optim = store.submit(owner, "optim_step", b"opt2", model_id=model.id, seq_id=2)
    fb3 = store.submit(owner, "forward_backward", b"fb3", model_id=model.id, seq_id=3)
    fwd4 = store.submit(owner, "forward", b"fwd4", model_id=model.id, seq_id=4)
    sample = store.submit(owner, "sample", b"prompt", sampling_session_id=sampler.id)
    in_flight = store.claim(worker) + store.claim(worker, kinds={"sample"})  # optim_step and sample now running
    assert [r.request_id for r in in_flight] == [optim.request_id, sample.request_id]
    state = {
        "key": key,
        "owner": owner,
        "session": session.id,
        "model": model.id,
        "sampler": sampler.id,
        "checkpoints": [training.tinker_path, sampler_ck.tinker_path],
        "done": [r.request_id for r in done],
        "running": {"optim": optim.request_id, "sample": sample.request_id},
        "queued": [fb3.request_id, fwd4.request_id],
    }
    print(json.dumps(state), flush=True)
    n = 0
    while True:  # until SIGKILL: every printed id was committed before it was printed
        n += 1
        req = store.submit(owner, "sample", f"prompt {n}".encode(), sampling_session_id=sampler.id)
        print(req.request_id, flush=True)
        time.sleep(0.002)


if __name__ == "__main__":
    main(sys.argv[1])
