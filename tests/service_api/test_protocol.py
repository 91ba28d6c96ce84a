"""The futures protocol over plain HTTP (what the SDK does between its calls: promises, resubmission, long-poll,
try_again, the failure shape) and the protocol module's encoders against the SDK's own decoders."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from tests.service_api.conftest import BASE_MODEL, LONG_POLL_S, FakeEngine, Service
from trainer.service import protocol
from trainer.service.api import BaseModelSpec, ServerConfig


class Api:
    """Plain HTTP with one key, as the SDK sends it."""

    def __init__(self, service: Service, key: str) -> None:
        self.url, self.headers = service.url, {"X-API-Key": key}

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        if body is not None and hasattr(body, "model_dump"):
            body = body.model_dump(mode="json", exclude_none=True)
        return httpx.post(self.url + path, json=body, headers={**self.headers, **kw.pop("headers", {})}, **kw)

    def retrieve(self, request_id: str, timeout: float = 45) -> httpx.Response:
        return self.post("/api/v1/retrieve_future", {"request_id": request_id}, timeout=timeout)

    def result(self, request_id: str) -> httpx.Response:
        for _ in range(20):
            r = self.retrieve(request_id)
            assert r.status_code == 200, r.text
            if not r.headers["content-type"].startswith("application/json") or r.json().get("type") != "try_again":
                return r
        raise AssertionError(f"{request_id} never finished")

    def model(self) -> str:
        session_id = self.post(
            "/api/v1/create_session", types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="test")
        ).json()["session_id"]
        promise = self.post("/api/v1/create_model", types.CreateModelRequest(
            session_id=session_id, model_seq_id=0, base_model=BASE_MODEL, lora_config=types.LoraConfig(rank=4)
        )).json()
        assert self.result(promise["request_id"]).json() == {"model_id": promise["model_id"], "type": "create_model"}
        return promise["model_id"]


def _fwdbwd(model_id: str, seq_id: int, *, forward_only: bool = False) -> pb.ForwardBackwardRequest:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 0.0], "advantages": [0.5, -1.0, 2.0]},
    )
    msg = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.8, "mode": "x"}
        ),
        model_id=model_id, seq_id=seq_id,
    ))
    msg.forward_only = forward_only
    return msg


def test_resubmitted_seq_id_returns_the_same_request(service: Service) -> None:
    api = Api(service, service.new_key()[1])
    model_id = api.model()
    step = types.OptimStepRequest(optim_params=types.AdamParams(learning_rate=1e-4), model_id=model_id, seq_id=1)
    first = api.post("/api/v1/optim_step", step)
    again = api.post("/api/v1/optim_step", step)
    assert first.status_code == again.status_code == 200
    assert first.json() == again.json() and first.json()["model_id"] == model_id
    other = api.post("/api/v1/optim_step", step.model_copy(update={"optim_params": types.AdamParams(learning_rate=1)}))
    assert other.status_code == 409 and "different body" in other.json()["detail"]
    assert other.headers["x-should-retry"] == "false"

    # forward_backward: zstd or not, the same request is the same (the stored body is the decompressed canonical form).
    msg = _fwdbwd(model_id, 2).SerializeToString()
    proto = {"Content-Type": "application/x-protobuf"}
    plain = httpx.post(f"{api.url}/api/v1/forward_backward", content=msg, headers={**api.headers, **proto})
    zipped = httpx.post(
        f"{api.url}/api/v1/forward_backward", content=zstandard.ZstdCompressor().compress(msg),
        headers={**api.headers, **proto, "Content-Encoding": "zstd"},
    )
    assert plain.status_code == zipped.status_code == 200, (plain.text, zipped.text)
    assert plain.json()["request_id"] == zipped.json()["request_id"]
    result = api.result(plain.json()["request_id"])
    assert result.headers["content-type"] == "application/x-protobuf"
    assert deserialize_forward_backward_output(result.content).metrics == {"loss:sum": 1.0}

    as_json = api.post("/api/v1/forward_backward", {"model_id": model_id, "seq_id": 3})
    assert as_json.status_code == 415
    assert api.post("/api/v1/optim_step", step.model_copy(update={"seq_id": None})).status_code == 400
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (65 * 1024 * 1024))
    too_big = httpx.post(f"{api.url}/api/v1/forward_backward", content=bomb,
                         headers={**api.headers, **proto, "Content-Encoding": "zstd"})
    assert too_big.status_code == 413


def test_long_poll_returns_when_the_result_is_stored(service: Service, engine: FakeEngine) -> None:
    api = Api(service, service.new_key()[1])
    model_id = api.model()
    step = types.OptimStepRequest(optim_params=types.AdamParams(learning_rate=0.5), model_id=model_id, seq_id=1)
    with engine.paused():
        request_id = api.post("/api/v1/optim_step", step).json()["request_id"]
        # Nothing runs it: the poll holds for the long-poll time, then answers try_again (not an HTTP error).
        t0 = time.monotonic()
        waited = api.retrieve(request_id)
        assert LONG_POLL_S - 0.1 <= time.monotonic() - t0 < LONG_POLL_S + 1.5
        assert waited.status_code == 200
        assert waited.json() == {"type": "try_again", "request_id": request_id, "queue_state": "active"}

        answers: list[tuple[float, httpx.Response]] = []
        poll = threading.Thread(target=lambda: answers.append((time.monotonic(), api.retrieve(request_id))))
        poll.start()
        time.sleep(0.5)
        # The test plays the engine for this one request: complete it while the poll is waiting.
        [row] = engine.store.claim(engine.worker_id)
        assert row.request_id == request_id
        engine.store.complete(request_id, protocol.json_result(types.OptimStepResponse(metrics={"x:sum": 1.0})),
                              worker_id=engine.worker_id)
        stored = time.monotonic()
        poll.join(10)
    [(answered, response)] = answers
    assert answered - stored < 0.5, "the long-poll did not return as soon as the result was stored"
    assert response.json() == {"metrics": {"x:sum": 1.0}}
    assert api.retrieve("no-such-request").status_code == 404


def test_failed_request_shape(service: Service, engine: FakeEngine) -> None:
    api = Api(service, service.new_key()[1])
    model_id = api.model()
    with engine.paused():
        step = types.OptimStepRequest(optim_params=types.AdamParams(), model_id=model_id, seq_id=1)
        request_id = api.post("/api/v1/optim_step", step).json()["request_id"]
        engine.store.fail(request_id, "out of memory", category="server")  # queued -> failed, as an engine may
    r = api.retrieve(request_id)
    assert r.status_code == 200 and r.json() == {"error": "out of memory", "category": "server"}


def test_sample_promise_carries_sequence_ids(service: Service) -> None:
    api = Api(service, service.new_key()[1])
    session_id = api.post("/api/v1/create_session", types.CreateSessionRequest(
        tags=[], user_metadata={}, sdk_version="test")).json()["session_id"]
    sampler = api.post("/api/v1/create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=session_id, sampling_session_seq_id=0, base_model=BASE_MODEL)).json()["sampling_session_id"]
    req = types.SampleRequest(
        sampling_session_id=sampler, seq_id=0, num_samples=3, prompt=types.ModelInput.from_ints([1, 2]),
        sampling_params=types.SamplingParams(max_tokens=2),
    )
    promise = api.post("/api/v1/asample", req).json()
    assert promise["sample_sequence_ids"] == protocol.sequence_ids(promise["request_id"], 3)
    assert api.post("/api/v1/asample", req).json() == promise  # same (session, seq_id): same request
    result = api.result(promise["request_id"])
    assert result.headers["content-type"] == "application/x-protobuf"
    assert len(deserialize_sample_response(result.content).sequences) == 3
    no_session = req.model_copy(update={"sampling_session_id": None, "base_model": BASE_MODEL})
    assert api.post("/api/v1/asample", no_session).status_code == 400


# -- the protocol module against the SDK's own codecs ---------------------------------------------------------------


def test_forward_backward_body_round_trip() -> None:
    msg = _fwdbwd("m:train:0", 7, forward_only=True)
    # A sparse 2-D input as the SDK sends for target_tokens/weights of shape [N, K].
    sparse = msg.data[0].loss_fn_inputs["topk"]
    sparse.dtype, sparse.shape[:] = pb.DTYPE_INT64, [3, 2]
    sparse.sparse_csr.values = np.array([5, 6], np.int64).tobytes()
    sparse.sparse_csr.crow_indices = np.array([0, 1, 1, 2], np.int64).tobytes()
    sparse.sparse_csr.col_indices = np.array([1, 0], np.int64).tobytes()
    body = protocol.decode_forward_backward(protocol.canonical_forward_backward(msg))
    assert (body.model_id, body.seq_id, body.forward_only, body.loss_fn) == ("m:train:0", 7, True, "ppo")
    assert body.loss_fn_config == {"clip_low_threshold": pytest.approx(0.8), "mode": "x"}
    [datum] = body.data
    assert datum.tokens.tolist() == [1, 2, 3]
    assert datum.loss_fn_inputs["target_tokens"].dtype == np.int64
    assert datum.loss_fn_inputs["weights"].tolist() == [1.0, 1.0, 0.0]
    assert datum.loss_fn_inputs["topk"].tolist() == [[0, 5], [0, 0], [6, 0]]


def test_forward_backward_output_round_trip() -> None:
    outputs = [
        {"logprobs": np.array([-1.0, -2.0], np.float32), "ids": np.array([[1, 2], [3, 4]], np.int64)},
        {"logprobs": np.array([-3.0], np.float32), "ids": np.array([[5, 6]], np.int64)},
        # Another trailing shape: a second ArrayRecord.
        {"logprobs": np.array([-4.0, -5.0, -6.0], np.float32), "ids": np.arange(9, dtype=np.int64).reshape(3, 3)},
    ]
    out = deserialize_forward_backward_output(protocol.encode_forward_backward_output(outputs, {"loss:sum": 2.5}))
    assert out.metrics == {"loss:sum": 2.5} and out.loss_fn_output_type == "ArrayRecord"
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-3.0], [-4.0, -5.0, -6.0]]
    assert out.loss_fn_outputs[0]["ids"].to_numpy().tolist() == [[1, 2], [3, 4]]
    assert out.loss_fn_outputs[1]["ids"].shape == [1, 2] and out.loss_fn_outputs[2]["ids"].shape == [3, 3]
    assert pb.ForwardBackwardOutput.FromString(protocol.encode_forward_backward_output(outputs, {})).loss_fn_outputs[
        1].num_datums == 1
    with pytest.raises(ValueError, match="reduction suffix"):
        protocol.encode_forward_backward_output(outputs, {"loss": 1.0})
    with pytest.raises(ValueError, match="same field names"):
        protocol.encode_forward_backward_output([outputs[0], {"logprobs": outputs[1]["logprobs"]}], {})


def test_sample_response_round_trip() -> None:
    data = protocol.encode_sample_response(
        [protocol.SampledOutput(np.array([3, 4]), "stop", np.array([-0.1, -0.2])),
         protocol.SampledOutput(np.array([5]), "length")],
        prompt_logprobs=np.array([np.nan, -1.5, -2.5]),
    )
    res = deserialize_sample_response(data)
    assert [(s.tokens, s.stop_reason) for s in res.sequences] == [([3, 4], "stop"), ([5], "length")]
    assert res.sequences[0].logprobs == pytest.approx([-0.1, -0.2]) and res.sequences[1].logprobs is None
    assert res.prompt_logprobs == [None, -1.5, -2.5]


def test_every_kind_has_a_spec_and_json_bodies_round_trip() -> None:
    assert set(protocol.KINDS) == {
        "create_model", "load_weights", "forward", "forward_backward", "optim_step", "save_weights",
        "save_weights_for_sampler", "save_weights_external", "sample", "delete_checkpoint",
    }
    step = types.OptimStepRequest(optim_params=types.AdamParams(learning_rate=3e-4), model_id="m", seq_id=2)
    assert protocol.decode_json("optim_step", protocol.canonical_json(step)) == step
    assert protocol.KINDS["sample"].result_content_type == "application/x-protobuf"
    assert protocol.KINDS["save_weights"].result_content_type == "application/json"


def test_server_config_keeps_long_polls_inside_the_sdk_timeout() -> None:
    assert ServerConfig(base_models=[BaseModelSpec("m")]).long_poll_s == 40.0
    with pytest.raises(ValueError, match="45"):
        ServerConfig(base_models=[BaseModelSpec("m")], long_poll_s=45)
    with pytest.raises(ValueError, match="at least one"):
        ServerConfig(base_models=[])


def test_a_json_body_over_the_limit_is_refused_before_it_is_read(service: Service) -> None:
    """Issue 40: JSON routes took any body (30 MiB of user_metadata was stored). Over max_json_bytes (4 MiB) a body
    is answered 413 by its Content-Length, and a chunked one (no length) as it streams past the limit."""
    from trainer.service.api import DEFAULT_MAX_JSON_BYTES

    api = Api(service, service.new_key()[1])
    session = {"tags": [], "sdk_version": "test"}
    big = json.dumps({**session, "user_metadata": {"x": "y" * DEFAULT_MAX_JSON_BYTES}}).encode()
    headers = {**api.headers, "content-type": "application/json"}
    r = httpx.post(f"{api.url}/api/v1/create_session", content=big, headers=headers)
    assert r.status_code == 413 and "over 4194304 bytes" in r.json()["detail"], r.text
    chunks = (big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20))
    r = httpx.post(f"{api.url}/api/v1/create_session", content=chunks, headers=headers)
    assert "content-length" not in r.request.headers and r.status_code == 413, r.text
    assert r.headers["x-should-retry"] == "false"
    small = {**session, "user_metadata": {"x": "y" * 1000}}
    assert httpx.post(f"{api.url}/api/v1/create_session", json=small, headers=api.headers).status_code == 200


def test_a_key_with_too_much_unfinished_work_gets_a_429_for_its_next_sample(tmp_path: Path) -> None:
    """Issue 40's limit per key: with max_unfinished_samples samples queued or running, a key's next sample is
    answered 429 with Retry-After (the SDK backs off and sends it again); another key is not held back."""
    from tests.service_api.conftest import api_in_thread
    from trainer.service import auth
    from trainer.service.store import Store

    store = Store(f"sqlite:///{tmp_path / 'service.db'}")
    with api_in_thread(store, ServerConfig([BaseModelSpec(BASE_MODEL)], max_unfinished_samples=2)) as url:
        def sampler(key: str) -> tuple[Api, str]:
            api = Api.__new__(Api)
            api.url, api.headers = url, {"X-API-Key": key}
            session = api.post("/api/v1/create_session", types.CreateSessionRequest(
                tags=[], user_metadata={}, sdk_version="test")).json()["session_id"]
            made = api.post("/api/v1/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                                 "base_model": BASE_MODEL})
            return api, made.json()["sampling_session_id"]

        def sample(api: Api, sampler_id: str, seq: int) -> httpx.Response:
            return api.post("/api/v1/asample", types.SampleRequest(
                sampling_session_id=sampler_id, seq_id=seq, num_samples=1,
                prompt=types.ModelInput.from_ints([1, 2]), sampling_params=types.SamplingParams(max_tokens=2)))

        busy, busy_sampler = sampler(auth.create_key(store, "busy")[1])
        assert [sample(busy, busy_sampler, i).status_code for i in range(2)] == [200, 200]  # no engine: both queued
        refused = sample(busy, busy_sampler, 2)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        assert "2 or more samples queued or running" in refused.json()["detail"]
        other, other_sampler = sampler(auth.create_key(store, "other")[1])
        assert sample(other, other_sampler, 0).status_code == 200
