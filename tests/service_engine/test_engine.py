"""The engine behind the real API, driven by the real tinker SDK: losses, AdamW, batching across users, checkpoints,
sampling, limits and a restart. The model is a tiny random decoder (no tokenizer), so every test is about the engine;
tests/service_engine/test_seed_script.py runs the issue's script on a tiny Qwen3 against transformers' numbers."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tinker
from tinker import types

from tests.service_engine.service import LiveService, live_service
from trainer.model import decoder as M
from trainer.model import lora as L
from trainer.service import programs as P
from trainer.service.engine import MODEL_STATE_LOST, UserError
from trainer.service.shapes import ATTN_TARGETS, MLP_TARGETS

BASE = "tiny/random"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    with live_service(tmp_path_factory.mktemp("engine")) as service:
        yield service


def _data(seed: int, lengths: tuple[int, ...] = (10, 17, 5)) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        toks = rng.integers(1, 128, n + 1).tolist()
        weights = rng.integers(0, 2, n).astype(float).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:], "weights": weights}))
    return out


def _base_cross_entropy(live: LiveService, data: list[types.Datum]) -> tuple[float, list[np.ndarray]]:
    """-(sum of weighted target log-probs) under the base weights, from the model itself (no adapter, full softmax)."""
    params = jax.device_get(live.engine.params)
    total, per = 0.0, []
    for d in data:
        toks = np.array(d.model_input.to_ints())[None]
        x, _ = M.forward(params, live.engine.mcfg, jnp.asarray(toks), jnp.ones_like(toks, bool))
        logp = jax.nn.log_softmax(M.logits(params, live.engine.mcfg, x)[0], axis=-1)
        target = np.array(d.loss_fn_inputs["target_tokens"].tolist())
        lp = np.asarray(logp)[np.arange(len(target)), target]
        per.append(lp)
        total -= float(np.dot(lp, d.loss_fn_inputs["weights"].tolist()))
    return total, per


def test_a_fresh_adapter_is_the_base_model_and_training_lowers_the_loss(live: LiveService) -> None:
    tc = live.client().create_lora_training_client(base_model=BASE, rank=4).result()
    data = _data(0)
    expected, per = _base_cross_entropy(live, data)
    losses = []
    for step in range(5):
        out = tc.forward_backward(data, "cross_entropy").result()
        if step == 0:
            for got, want in zip(out.loss_fn_outputs, per, strict=True):
                np.testing.assert_allclose(got["logprobs"].to_numpy(), want, rtol=1e-5, atol=1e-5)
        losses.append(out.metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < 0.7 * losses[0], losses


def test_forward_changes_nothing_and_matches_forward_backward(live: LiveService) -> None:
    tc = live.client().create_lora_training_client(base_model=BASE, rank=8).result()
    data = _data(1)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    a = tc.forward(data, "cross_entropy").result()
    b = tc.forward(data, "cross_entropy").result()
    c = tc.forward_backward(data, "cross_entropy").result()
    assert a.metrics == b.metrics  # forward twice: the same program on unchanged weights, bit for bit
    # forward_backward computes the same values in another program (with its backward pass): float rounding apart
    assert c.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=1e-6)
    for x, y in zip(a.loss_fn_outputs, c.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(), rtol=1e-6, atol=1e-6)


def test_users_batched_together_train_exactly_as_alone(live: LiveService) -> None:
    """Two users' forward_backward requests fused into one pass give each the losses it gets alone: rows only touch
    their own slot's adapter and gradient."""
    def run(tc: tinker.TrainingClient, data: list[types.Datum], steps: int) -> list[float]:
        out = []
        for _ in range(steps):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=5e-3, weight_decay=0.1, grad_clip_norm=1.0))
            out.append(fb.result().metrics["loss:sum"])
        return out

    alone = run(live.client().create_lora_training_client(base_model=BASE, rank=4, seed=7).result(), _data(2), 3)
    a = live.client("a").create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    b = live.client("b").create_lora_training_client(base_model=BASE, rank=8, seed=8).result()
    before = len(live.engine.passes.fused_sizes)
    results: dict[str, list[float]] = {}
    threads = [threading.Thread(target=lambda: results.__setitem__("a", run(a, _data(2), 3))),
               threading.Thread(target=lambda: results.__setitem__("b", run(b, _data(3, (30, 9)), 3)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    np.testing.assert_allclose(results["a"], alone, rtol=2e-5)
    assert len(results["b"]) == 3
    sizes = list(live.engine.passes.fused_sizes)[before:]
    assert sizes, "no forward/backward batch ran"


def _slot(tree: dict, i: int) -> dict:
    """Slot i of an adapter-shaped tree (NumPy)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: np.take(np.asarray(x), i, axis=L._slot_axis(p)), tree)


def test_adamw_matches_optax_on_its_slot_only(live: LiveService) -> None:
    """optim_step is torch's AdamW (= optax.adamw, decoupled decay) after clipping the slot's global norm, applied to
    one slot; every other slot, its moments and its gradient stay as they were."""
    progs = live.engine.state.progs
    rng = np.random.default_rng(0)
    shapes = L.lora_shapes(progs.mcfg, progs.stack)
    rand = lambda: jax.tree.map(lambda s: rng.normal(size=s).astype(np.float32), shapes, is_leaf=L._is_shape)  # noqa: E731
    lora, m, v, g = rand(), rand(), jax.tree.map(np.abs, rand()), rand()
    put = lambda t: jax.device_put(t, progs.lora_sh)  # noqa: E731
    hyper = P.AdamHyper(learning_rate=1e-3, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.05, grad_clip_norm=0.5)
    slot, t = 2, 3
    new, nm, nv, ng, norm = progs.optim_step(put(lora), put(m), put(v), put(g), progs.put(np.int32(slot)),
                                             progs.put(np.int32(t)), progs.put(hyper.array()))
    opt = optax.chain(optax.clip_by_global_norm(hyper.grad_clip_norm),
                      optax.adamw(hyper.learning_rate, hyper.beta1, hyper.beta2, hyper.eps,
                                  weight_decay=hyper.weight_decay))
    state = opt.init(_slot(lora, slot))
    # optax's adam state at count t-1 with our moments: the next update is step t.
    adam = optax.ScaleByAdamState(count=jnp.int32(t - 1), mu=_slot(m, slot), nu=_slot(v, slot))
    state = (state[0], (adam, *state[1][1:]))
    upd, _ = opt.update(_slot(g, slot), state, _slot(lora, slot))
    want = optax.apply_updates(_slot(lora, slot), upd)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6), _slot(jax.device_get(new), slot),
                 want)
    gn = math.sqrt(sum(float(np.sum(x**2)) for x in jax.tree.leaves(_slot(g, slot))))
    assert float(norm) == pytest.approx(gn, rel=1e-5)
    for i in range(progs.stack.slots):
        if i == slot:
            continue
        for before, after in ((lora, new), (m, nm), (v, nv), (g, ng)):
            jax.tree.map(np.testing.assert_array_equal, _slot(before, i), _slot(jax.device_get(after), i))
    assert all(not np.any(x) for x in jax.tree.leaves(_slot(jax.device_get(ng), slot)))


def test_save_and_load_state_continue_exactly(live: LiveService) -> None:
    sc = live.client()
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, train_unembed=False).result()
    data = _data(4)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("two-steps").result().path
    restored = sc.create_training_client_from_state_with_optimizer(path).result()
    for client in (tc, restored):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    a = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    b = restored.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert a == pytest.approx(b, rel=1e-6)
    info = live.rest(sc).get_weights_info_by_tinker_path(path).result()
    assert info.lora_rank == 4
    storage = Path(live.store.get_checkpoint(live.store.get_model(_owner(live, tc), tc.model_id).owner_id,
                                             path).storage_path)
    weights, lcfg = L.import_peft(storage, live.engine.mcfg)  # a PEFT adapter, readable by PEFT's own layout
    assert lcfg.rank == 4 and "lm_head" not in lcfg.targets and set(lcfg.targets) == set(ATTN_TARGETS + MLP_TARGETS)


def _owner(live: LiveService, tc: tinker.TrainingClient) -> str:
    from sqlalchemy import select

    from trainer.service.store import Model

    with live.store._read() as s:
        return s.scalars(select(Model.owner_id).where(Model.id == tc.model_id)).one()


def test_sampling_is_seeded_stops_and_agrees_with_forward(live: LiveService) -> None:
    sc = live.client()
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    data = _data(5)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints([5, 9, 33, 17, 2])
    params = types.SamplingParams(max_tokens=6, seed=123, temperature=1.0)
    one = sampler.sample(prompt, 3, params).result()
    two = sampler.sample(prompt, 3, params).result()
    assert [s.tokens for s in one.sequences] == [s.tokens for s in two.sequences]
    assert len({tuple(s.tokens) for s in one.sequences}) > 1, "three samples of one prompt should differ"
    assert all(len(s.tokens) == 6 and s.stop_reason == "length" for s in one.sequences)

    # Sampler log-probs of a greedy continuation equal the training model's forward() log-probs of the same tokens.
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]
    full = prompt.to_ints() + greedy.tokens
    fwd = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                  loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})],
                     "cross_entropy").result()
    np.testing.assert_allclose(fwd.loss_fn_outputs[0]["logprobs"].to_numpy()[-6:], greedy.logprobs, atol=2e-5)
    lp = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert lp[0] is None
    np.testing.assert_allclose(lp[1:], fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=2e-5)

    # A stop token ends the sequence there (kept, as EOS is) with stop_reason "stop".
    stop_at = greedy.tokens[2]
    first = greedy.tokens.index(stop_at)
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[stop_at])).result()
    assert stopped.sequences[0].tokens == greedy.tokens[:first + 1]
    assert stopped.sequences[0].stop_reason == "stop"

    # The base model is another sampler: its log-probs are the base's.
    base = sc.create_sampling_client(base_model=BASE).result()
    base_lp = base.compute_logprobs(types.ModelInput.from_ints(full)).result()
    _, per = _base_cross_entropy(live, [types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                                    loss_fn_inputs={"target_tokens": full[1:],
                                                                    "weights": [1.0] * (len(full) - 1)})])
    np.testing.assert_allclose(base_lp[1:], per[0], atol=2e-5)


def test_another_users_sampling_settings_compile_nothing_and_bad_ones_are_refused_by_name(live: LiveService) -> None:
    """Issue 40: temperature, top_p, top_k, the stop ids and max_tokens were static arguments of the sample program,
    so each new value compiled (11.7-14.1 s on the tiny model) while every other user waited. Now they are data:
    once a shape has run, no setting within its buckets compiles anything. Settings out of range are refused at
    submit with a 400 naming the field (temperature NaN returned token ids outside the vocabulary)."""
    import jax.monitoring

    sc = live.client()
    base = sc.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints([5, 9, 33, 17])
    first = base.sample(prompt, 4, types.SamplingParams(max_tokens=5, seed=1)).result()
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, _secs, **_kw: compiles.append(name) if name.endswith("backend_compile_duration") else None)
    other = live.client("other").create_sampling_client(base_model=BASE).result()
    settings = [types.SamplingParams(max_tokens=3, temperature=0.3, top_p=0.9, seed=2),
                types.SamplingParams(max_tokens=7, temperature=1.7, top_k=5, stop=[3, 4, 5], seed=3),
                types.SamplingParams(max_tokens=1, temperature=0.0),
                types.SamplingParams(max_tokens=6, temperature=0.8, top_k=2, top_p=0.5, stop=[], seed=4)]
    # 3 and 4 samples share a row bucket (4), and max_tokens 1-7 the token bucket (service.min_bucket 16).
    results = [other.sample(prompt, n, params).result() for n, params in zip((3, 4, 4, 3), settings, strict=True)]
    assert compiles == [], compiles
    for params, res in zip(settings, results, strict=True):
        assert all(1 <= len(s.tokens) <= params.max_tokens for s in res.sequences)
        assert all(0 <= t < live.engine.mcfg.vocab_size for s in res.sequences for t in s.tokens)
        assert all(np.isfinite(s.logprobs).all() for s in res.sequences)  # type: ignore[arg-type]
    greedy = base.sample(prompt, 4, settings[2]).result().sequences
    assert [s.tokens for s in results[2].sequences] == [s.tokens for s in greedy] == [greedy[0].tokens] * 4
    # The same request asks the same program for the same tokens as before the others came.
    again = base.sample(prompt, 4, types.SamplingParams(max_tokens=5, seed=1)).result().sequences
    assert [(s.tokens, s.logprobs) for s in again] == [(s.tokens, s.logprobs) for s in first.sequences]

    # The SDK cannot send NaN or infinity (its JSON refuses them); a raw body can, as Python's JSON reads both.
    import httpx

    key = live._clients[-1][1]  # the "other" client's key
    for value in ("NaN", "Infinity"):
        body = json.dumps({"sampling_session_id": other._sampling_session_id, "seq_id": 99, "num_samples": 1,
                           "prompt": {"chunks": [{"tokens": [5, 9], "type": "encoded_text"}]},
                           "sampling_params": {"max_tokens": 2, "temperature": float(value)}})  # NaN, Infinity
        r = httpx.post(f"{live.url}/api/v1/asample", content=body, timeout=30,
                       headers={"X-API-Key": key, "content-type": "application/json"})
        assert r.status_code == 400 and "sampling_params.temperature must be a finite number" in r.text, r.text
    for params, field in ((dict(temperature=-1.0), "temperature"),
                          (dict(top_p=-1.0), "top_p"), (dict(top_p=5.0), "top_p"), (dict(top_k=-2), "top_k"),
                          (dict(max_tokens=0), "max_tokens")):
        bad = types.SamplingParams(**{"max_tokens": 4, **params})  # type: ignore[arg-type]
        with pytest.raises(tinker.BadRequestError, match=f"sampling_params.{field} must"):
            other.sample(prompt, 1, bad).result()
    with pytest.raises(tinker.RequestFailedError, match=r"top_k must be at most this model's vocabulary \(128\)"):
        other.sample(prompt, 1, types.SamplingParams(max_tokens=2, top_k=10**9)).result()
    limit = live.engine.service.max_num_samples
    with pytest.raises(tinker.RequestFailedError, match=rf"num_samples must be in \[1, {limit}\]"):
        other.sample(prompt, limit + 1, types.SamplingParams(max_tokens=2)).result()


def test_a_backlog_of_one_users_samples_does_not_hold_back_another_users_request(live: LiveService) -> None:
    """Issue 40's fair share: the engine took requests oldest first, 64 unordered ones per claim, so a user's request
    waited behind every sample another user had queued. Now the owner served longest ago goes next."""
    from sqlalchemy import select

    from trainer.service.store import QUEUED, Request

    prompt = types.ModelInput.from_ints([5, 9, 33, 17])
    params = types.SamplingParams(max_tokens=8, seed=5)
    flooder = live.client("flood").create_sampling_client(base_model=BASE).result()
    other = live.client("other").create_sampling_client(base_model=BASE).result()
    flooder.sample(prompt, 4, params).result()  # both programs compiled before the race
    live.stop_engine()  # the backlog queues up while no engine runs, then the other user's request arrives last
    backlog = [flooder.sample(prompt, 4, params) for _ in range(10)]
    mine = other.sample(prompt, 4, params)
    deadline = time.monotonic() + 60
    while True:
        with live.store._read() as s:
            if len(s.scalars(select(Request).where(Request.kind == "sample", Request.status == QUEUED)).all()) == 11:
                break
        assert time.monotonic() < deadline, "the requests did not arrive"
        time.sleep(0.1)
    live.start_engine()
    mine.result(timeout=120)
    for f in backlog:
        f.result(timeout=120)
    with live.store._read() as s:
        rows = s.scalars(select(Request).where(Request.kind == "sample").order_by(Request.started_at)).all()
    order = [r.owner_id for r in rows[-11:]]
    theirs = next(o for o in order if order.count(o) == 1)
    assert order.index(theirs) <= 1, order  # at most one of the backlog ran first


def test_limits_fail_one_request_and_serve_the_rest(live: LiveService) -> None:
    sc = live.client()
    with pytest.raises(tinker.RequestFailedError, match=r"rank at most 8 \(lora.rank\)"):
        sc.create_lora_training_client(base_model=BASE, rank=16).result()
    tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
    too_long = _data(6, (70,))
    with pytest.raises(tinker.RequestFailedError, match="context is 64"):
        tc.forward_backward(too_long, "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="stable_reinforce needs provenance on every datum"):
        tc.forward_backward(_data(6), "stable_reinforce").result()
    passes = live.engine.passes  # the part that validates forward_backward requests reads the limit
    service = passes.service
    passes.service = service.model_copy(update={"max_request_tokens": 20})  # _data(6): 32 tokens in 3 datums
    try:
        with pytest.raises(tinker.RequestFailedError, match=r"carries 32 tokens.*at most 20 per request \(service"
                                                            r".max_request_tokens\)"):
            tc.forward_backward(_data(6), "cross_entropy").result()
    finally:
        passes.service = service
    assert tc.forward_backward(_data(6), "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_malformed_tensor_fails_its_request_alone_and_its_batch_mates_train(live: LiveService) -> None:
    """Issue 40: a sparse weights tensor with a column index out of range (IndexError) or a [2^20, 2^20] shape (a 4
    TiB allocation) escaped the per-request validation, and every request claimed in the same batch, another user's
    included, stayed `running` forever. Now the bad requests fail as user errors naming the field; user A's request,
    claimed in the same batch, trains; user B's next request runs (its order moved on)."""
    import httpx
    from tinker.proto import tinker_public_pb2 as pb
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from trainer.service.protocol import PROTOBUF

    sc_a, sc_b = live.client("a"), live.client("b")
    tc_a = sc_a.create_lora_training_client(base_model=BASE, rank=2).result()
    tc_b = sc_b.create_lora_training_client(base_model=BASE, rank=2).result()
    key_b = next(k for c, k in live._clients if c is sc_b)

    seq_b = iter(range(1, 100))  # B's model's order, as the SDK numbers it (this test sends B's requests itself)

    def post(shape: list[int] | None = None, crow: list[int] | None = None, cols: list[int] | None = None) -> str:
        msg = forward_backward_request_to_proto(types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=_data(9, (4,)), loss_fn="cross_entropy"),
            model_id=tc_b.model_id, seq_id=next(seq_b)))
        if shape is not None and crow is not None and cols is not None:
            weights = pb.Tensor(dtype=pb.DTYPE_FLOAT32)
            weights.shape.extend(shape)
            weights.sparse_csr.values = np.ones(len(cols), np.float32).tobytes()
            weights.sparse_csr.crow_indices = np.asarray(crow, np.int64).tobytes()
            weights.sparse_csr.col_indices = np.asarray(cols, np.int64).tobytes()
            msg.data[0].loss_fn_inputs["weights"].CopyFrom(weights)
        r = httpx.post(f"{live.url}/api/v1/forward_backward", content=msg.SerializeToString(),
                       headers={"X-API-Key": key_b, "content-type": PROTOBUF}, timeout=30)
        assert r.status_code == 200, r.text
        return str(r.json()["request_id"])

    expected = tc_a.forward_backward(_data(8), "cross_entropy").result().metrics["loss:sum"]
    live.stop_engine()
    try:
        bad_ids = [post([1, 4], [0, 1], [7]), post([2**20, 2**20], [0] * (2**20 + 1), [])]
        fut_a = tc_a.forward_backward(_data(8), "cross_entropy")
        owner_b, owner_a = _owner(live, tc_b), _owner(live, tc_a)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and live.store.pending_count() < 3:
            time.sleep(0.1)
        assert live.store.pending_count() == 3  # all three wait for one claim
    finally:
        live.restart_engine()  # a stopped Engine does not start again (its writer is shut down): a new one
    # No optim_step between the two: the same loss.
    assert fut_a.result(timeout=120).metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    for rid, says in zip(bad_ids, (r"col_indices must be in \[0, 4\)", "has 1099511627776 elements"), strict=True):
        row = live.store.wait(owner_b, rid, 30)
        assert row.status == "failed" and row.error_category == "user", (row.status, row.error_message)
        assert row.error_message is not None
        assert re.search(rf"datum 0: loss_fn_inputs\['weights'\]: .*{says}", row.error_message), row.error_message
    assert owner_a != owner_b
    assert live.store.wait(owner_b, post(), 60).status == "done"  # B's order moved past the failed ones


def test_a_request_refused_at_submit_does_not_stop_its_training_client(live: LiveService) -> None:
    """Issue 40: the SDK numbers a request before sending it; a request the API refused (a checkpoint name with a
    space, AdamParams with a NaN) left its number out of the database, and every later request of that training
    client waited behind the gap for good. Now the refusal fails its own future and the client goes on."""
    tc = live.client().create_lora_training_client(base_model=BASE, rank=2).result()
    with pytest.raises(tinker.BadRequestError, match="checkpoint name 'my checkpoint'"):
        tc.save_state("my checkpoint").result(timeout=30)
    assert tc.forward_backward(_data(11), "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    with pytest.raises(tinker.APIStatusError):
        tc.optim_step(types.AdamParams(learning_rate=float("nan"))).result(timeout=30)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    assert tc.save_state("my-checkpoint").result(timeout=60).path.endswith("/my-checkpoint")


def _train_twice(tc: Any, first: list[types.Datum], second: list[types.Datum]) -> None:
    """A step, then a forward_backward whose gradient waits in the slot for the next optim_step."""
    tc.forward_backward(first, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tc.forward_backward(second, "cross_entropy").result()


def test_more_models_than_slots_evicts_the_least_recent_and_rebuilds_it_exactly(tmp_path: Path) -> None:
    """With every slot taken, a new model takes the least recently used one's slot; that model comes back on its
    next request from its last snapshot plus the forward_backward done since, and goes on as its twin that was never
    evicted does."""
    from tests.service_engine.service import tiny_config

    cfg = tiny_config(tmp_path / "ckpt", idle_unload_s=3600)
    cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"slots": 3})})  # type: ignore[union-attr]
    with live_service(tmp_path, cfg) as live:
        sc = live.client("first")
        a = sc.create_lora_training_client(base_model=BASE, rank=2, seed=7).result()
        twin = sc.create_lora_training_client(base_model=BASE, rank=2, seed=7).result()
        for tc in (a, twin):
            _train_twice(tc, _data(7), _data(8))
        want = twin.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"]
        want_loss = twin.forward(_data(9), "cross_entropy").result().metrics["loss:sum"]
        others = [live.client(f"other{i}").create_lora_training_client(base_model=BASE, rank=2).result()
                  for i in range(2)]
        assert a.model_id not in {s.model_id for s in live.engine.slots.values()}  # evicted: least recently used
        got = a.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"]
        # Rebuilt: the snapshot, then one replayed request.
        assert live.engine.models.restores[-1][:2] == (a.model_id, 1)
        assert got == pytest.approx(want, rel=1e-5)
        assert a.forward(_data(9), "cross_entropy").result().metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5)
        for tc in others:  # the models that took the slots still train
            assert tc.forward_backward(_data(7), "cross_entropy").result().metrics["loss:sum"] > 0


def test_after_a_restart_models_continue_where_they_were(live: LiveService) -> None:
    """An engine restart loses no model: the first request of each rebuilds it (snapshot + replayed gradients), and
    saved checkpoints still load."""
    sc = live.client()
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    twin = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    for t in (tc, twin):
        _train_twice(t, _data(8), _data(9))
    path = tc.save_state("before-restart").result().path
    want = twin.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"]
    live.restart_engine()
    deadline = time.monotonic() + 60
    while {tc.model_id, twin.model_id} - {s.model_id for s in list(live.engine.slots.values())}:
        assert time.monotonic() < deadline, "the new engine did not restore the open session's models at start"
        time.sleep(0.05)
    got = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"]
    assert got == pytest.approx(want, rel=1e-5)
    data = _data(8)
    assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        twin.forward(data, "cross_entropy").result().metrics["loss:sum"], rel=1e-5)
    restored = sc.create_training_client_from_state_with_optimizer(path).result()
    assert restored.forward(data, "cross_entropy").result().metrics["loss:sum"] > 0
    assert "create_training_client_from_state" in MODEL_STATE_LOST


def test_topk_prompt_logprobs_are_the_likeliest_tokens(live: LiveService) -> None:
    """sample(topk_prompt_logprobs=k): per prompt token the k likeliest tokens under the sampler's weights and their
    log-probs, the first position empty (the SDK's sentinel reads as None), as the full softmax of the model says."""
    base = live.client().create_sampling_client(base_model=BASE).result()
    tokens = [5, 9, 33, 17, 2, 77, 101]
    out = base.sample(types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=1),
                      include_prompt_logprobs=True, topk_prompt_logprobs=4).result()
    topk = out.topk_prompt_logprobs
    assert topk is not None and len(topk) == len(tokens) and topk[0] is None
    params = jax.device_get(live.engine.params)
    x, _ = M.forward(params, live.engine.mcfg, jnp.asarray([tokens]), jnp.ones((1, len(tokens)), bool))
    full = np.asarray(jax.nn.log_softmax(M.logits(params, live.engine.mcfg, x)[0], axis=-1))
    for i in range(1, len(tokens)):
        want = np.argsort(-full[i - 1])[:4]
        assert [t for t, _ in topk[i]] == want.tolist()
        np.testing.assert_allclose([lp for _, lp in topk[i]], full[i - 1][want], atol=2e-5)
        assert out.prompt_logprobs[i] == pytest.approx(float(full[i - 1][tokens[i]]), abs=2e-5)


def test_work_on_another_base_model_waits_for_its_own_engine(live: LiveService) -> None:
    """An API may list base models this engine does not hold (several engines on one database): this engine leaves
    their requests alone, and the API tells their clients that no engine of that base model runs."""
    import httpx
    from tinker import types as t

    from trainer.service import auth, protocol

    key_row, key = auth.create_key(live.store, "other")
    session = live.store.create_session(key_row.id)
    model = live.store.create_model(key_row.id, session.id, 0, "acme/other-model", {"rank": 4})
    request = t.CreateModelRequest(session_id=session.id, model_seq_id=0, base_model="acme/other-model",
                                   lora_config=t.LoraConfig(rank=4))
    row = live.store.submit(key_row.id, protocol.CREATE_MODEL, protocol.canonical_json(request), model_id=model.id,
                            seq_id=0)
    answer = httpx.post(f"{live.url}/api/v1/retrieve_future", json={"request_id": row.request_id},
                        headers={"X-API-Key": key}, timeout=30).json()
    assert answer["type"] == "try_again" and answer["queue_state"] == "paused_capacity"
    assert "no engine is running for base model acme/other-model" in answer["queue_state_reason"]
    assert live.store.get_request(key_row.id, row.request_id).status == "queued"  # not taken, not failed
    # Its own base model's work is served meanwhile, and the engine still refuses a foreign model it is handed.
    assert live.client().create_lora_training_client(base_model=BASE, rank=2).result()
    with pytest.raises(UserError, match="'acme/other-model' is not served by this engine"):
        live.engine.models.served("acme/other-model")


def test_a_failed_snapshot_runs_the_step_again_on_the_rebuilt_model(live: LiveService) -> None:
    """The bucket refuses one snapshot write: the optim_step is not lost and not applied twice (the slot, ahead of
    the committed state, is dropped and the step runs again on the model rebuilt from it)."""
    sc = live.client()
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=5).result()
    twin = sc.create_lora_training_client(base_model=BASE, rank=2, seed=5).result()
    for t in (tc, twin):
        _train_twice(t, _data(3), _data(4))
    want = twin.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"]
    engine = live.engine
    real = engine.snapshots.write_adapter
    failures: list[str] = []

    def flaky(row: Any, kind: str, *args: Any, **kwargs: Any) -> Any:
        if kind == "state" and not failures:
            failures.append(row.request_id)
            raise OSError("the bucket said no")
        return real(row, kind, *args, **kwargs)

    engine.snapshots.write_adapter = flaky  # type: ignore[method-assign]
    got = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"]
    assert failures and got == pytest.approx(want, rel=1e-5)
    # Rebuilt: the step-1 snapshot plus the pending forward_backward.
    assert engine.models.restores[-1][:2] == (tc.model_id, 1)
    data = _data(6)
    assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        twin.forward(data, "cross_entropy").result().metrics["loss:sum"], rel=1e-5)


def _rl_datum(prompt: list[int], seq: Any, advantage: float, *, spans: bool = True) -> types.Datum:
    """A datum as tinker-cookbook builds one from a sampled sequence (rl/data_processing.py trajectory_to_data):
    prompt then completion, shifted by one; advantages on the sampled tokens; provenance naming the sequence."""
    full = prompt + seq.tokens
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:], "logprobs": [0.0] * (len(prompt) - 1) + seq.logprobs,
                                        "advantages": [0.0] * (len(prompt) - 1) + [advantage] * len(seq.tokens)})
    if not spans:
        return datum
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[tinker.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                     tinker.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens) - 1)],
        loss_fn_inputs=[tinker.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                        tinker.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens))])


def test_stable_reinforce_trains_on_recorded_samples_and_checks_their_provenance(live: LiveService) -> None:
    """tinker-cookbook's default RL loss: a sampler made with record_stability_info=True, datums naming its
    sequences. Right after sampling (no ratio above C = 2) its loss is importance_sampling's on the sampler's
    log-probs; what the spans claim is checked against what was sampled, in this session only."""
    sc = live.client()
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    tc.forward_backward(_data(11), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True)
    prompt = [5, 9, 33, 17, 2]
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                          types.SamplingParams(max_tokens=6, seed=5, temperature=1.0)).result().sequences
    data = [_rl_datum(prompt, s, adv) for s, adv in zip(seqs, (1.0, -1.0), strict=True)]
    stable = tc.forward(data, "stable_reinforce").result()
    plain = tc.forward([_rl_datum(prompt, s, adv, spans=False) for s, adv in zip(seqs, (1.0, -1.0), strict=True)],
                       "importance_sampling").result()
    assert stable.metrics["loss:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-5, abs=1e-5)
    assert stable.metrics["loss:sum"] == pytest.approx(-(len(seqs[0].tokens) - len(seqs[1].tokens)), abs=0.05)
    before = tc.forward_backward(data, "stable_reinforce").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    after = tc.forward(data, "stable_reinforce").result().metrics["loss:sum"]
    assert after < before, (before, after)

    def refused(datums: list[types.Datum], match: str, client: Any = tc) -> None:
        with pytest.raises(Exception, match=match):
            client.forward_backward(datums, "stable_reinforce").result()

    refused([_rl_datum(prompt, seqs[0], 1.0, spans=False)], "record_stability_info=True")
    wrong = _rl_datum(prompt, seqs[0], 1.0)
    targets = wrong.loss_fn_inputs["target_tokens"].tolist()
    targets[-1] = (targets[-1] + 1) % 128
    refused([types.Datum(model_input=wrong.model_input, loss_fn_inputs={**wrong.loss_fn_inputs,
                                                                         "target_tokens": targets},
                         model_input_spans=wrong.model_input_spans, loss_fn_input_spans=wrong.loss_fn_input_spans)],
            "are not the tokens")
    unrecorded = tc.save_weights_and_get_sampling_client()
    plain_seq = unrecorded.sample(types.ModelInput.from_ints(prompt), 1,
                                  types.SamplingParams(max_tokens=4, seed=1)).result().sequences[0]
    refused([_rl_datum(prompt, plain_seq, 1.0)], "sampled without record_stability_info")
    # The same key's second session, and another tenant, cannot name these sequences.
    key = next(k for c, k in live._clients if c is sc)
    other_session = tinker.ServiceClient(base_url=live.url, api_key=key)
    try:
        tc2 = other_session.create_lora_training_client(base_model=BASE, rank=4).result()
        refused(data, "another session", tc2)
    finally:
        other_session.close("success").result(timeout=10)
    tc3 = live.client("other").create_lora_training_client(base_model=BASE, rank=4).result()
    refused(data, "no such sample request", tc3)
    # Training went on: a refused request fails alone.
    assert tc.forward(data, "stable_reinforce").result().metrics["loss:sum"] == pytest.approx(after, rel=1e-6)
