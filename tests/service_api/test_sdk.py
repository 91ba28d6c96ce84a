"""The API driven by the real tinker 0.38 SDK (ServiceClient, TrainingClient, SamplingClient, RestClient), with the
fake engine of conftest.py (a test double for the JAX engine) answering the queued requests."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import tinker
from tinker import types
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

from tests.service_api.conftest import BASE_MODEL, OTHER_BASE_MODEL, TOKENIZER_ID, EngineFailure, FakeEngine, Service
from trainer.service import cli
from trainer.service.store import Request, Store

ServiceClientFactory = Callable[[str], tinker.ServiceClient]


@pytest.fixture
def service_client(service: Service) -> Iterator[ServiceClientFactory]:
    """ServiceClient(base_url=..., api_key=...) for a key; every one is closed after the test."""
    made: list[tinker.ServiceClient] = []

    def make(key: str) -> tinker.ServiceClient:
        made.append(tinker.ServiceClient(base_url=service.url, api_key=key))
        return made[-1]

    yield make
    for client in made:
        client.close("success").result(timeout=30)


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _heartbeat(client: tinker.ServiceClient) -> None:
    """One heartbeat through the SDK's own call (its loop sends one every 10 s: too slow to wait for)."""
    holder = client.holder

    async def beat() -> None:
        with holder.aclient(ClientConnectionPoolType.SESSION) as c:
            await c.service.session_heartbeat(session_id=holder.get_session_id(), max_retries=0)

    holder.run_coroutine_threadsafe(beat()).result(timeout=30)


def test_session_heartbeat_and_close(service: Service, service_client: ServiceClientFactory) -> None:
    owner, key = service.new_key()
    client = service_client(key)
    session_id = client.holder.get_session_id()
    created = service.store.get_session(owner, session_id)
    assert created.sdk_version == tinker.__version__ and created.finished_at is None
    _heartbeat(client)
    assert service.store.get_session(owner, session_id).heartbeat_at > created.heartbeat_at

    client.close("success", detail="done").result(timeout=30)  # must not raise (skyrl answers 404 here)
    finished = service.store.get_session(owner, session_id)
    assert finished.finished_at is not None and (finished.finish_reason, finished.finish_detail) == ("success", "done")
    # A finished session: heartbeats get 410 (the SDK stops its loop on it), new models are refused.
    headers = {"X-API-Key": key}
    beat = httpx.post(f"{service.url}/api/v1/session_heartbeat", json={"session_id": session_id}, headers=headers)
    assert beat.status_code == 410, beat.text
    create = httpx.post(
        f"{service.url}/api/v1/create_model", headers=headers,
        json=types.CreateModelRequest(
            session_id=session_id, model_seq_id=0, base_model=BASE_MODEL, lora_config=types.LoraConfig(rank=4)
        ).model_dump(mode="json"),
    )
    assert create.status_code == 410 and "finished" in create.json()["detail"]


def test_server_capabilities_and_empty_listings(service: Service) -> None:
    _, key = service.new_key()
    rest = tinker.RestClient(base_url=service.url, api_key=key)
    models = rest.get_server_capabilities().result(timeout=30).supported_models
    assert [m.model_name for m in models] == [BASE_MODEL, OTHER_BASE_MODEL]
    assert models[0].max_context_length == 4096 and models[0].trainable and models[0].sampleable
    runs = rest.list_training_runs().result(timeout=30)
    assert runs.training_runs == [] and runs.cursor.total_count == 0
    assert rest.list_user_checkpoints().result(timeout=30).checkpoints == []
    assert rest.list_sessions().result(timeout=30).sessions == []


def test_training_sampling_and_rest_listings(
    service: Service, engine: FakeEngine, service_client: ServiceClientFactory
) -> None:
    owner, key = service.new_key()
    client = service_client(key)
    tc = client.create_lora_training_client(BASE_MODEL, rank=8, seed=3, train_unembed=False).result(timeout=30)
    model_id = tc.model_id
    assert model_id == f"{client.holder.get_session_id()}:train:0"
    info = tc.get_info()
    assert (info.model_data.model_name, info.model_data.tokenizer_id, info.lora_rank) == (BASE_MODEL, TOKENIZER_ID, 8)
    assert service.store.get_model(owner, model_id).lora_config == {
        "rank": 8, "seed": 3, "train_unembed": False, "train_mlp": True, "train_attn": True
    }

    fwd = tc.forward([_datum([1, 2, 3, 4])], "cross_entropy")
    fb = tc.forward_backward([_datum([1, 2, 3, 4, 5]), _datum([7, 8, 9])], "cross_entropy")
    opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
    out = fb.result(timeout=30)
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[4], [2]]
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == [-0.5] * 4 and out.metrics == {"loss:sum": 3.0}
    assert len(fwd.result(timeout=30).loss_fn_outputs) == 1
    assert opt.result(timeout=30).metrics == {"learning_rate:mean": pytest.approx(1e-3)}
    kinds = [k for k, _ in engine.handled[-4:]]
    assert kinds == ["create_model", "forward", "forward_backward", "optim_step"]  # the model's seq order

    saved = tc.save_state("step-1", user_metadata={"step": "1"}).result(timeout=30)
    assert saved.path == f"tinker://{model_id}/weights/step-1"
    sampler_path = tc.save_weights_for_sampler("step-1").result(timeout=30).path
    assert sampler_path == f"tinker://{model_id}/sampler_weights/step-1"

    # Sampling from a saved path, and through save_weights_and_get_sampling_client (its seq form).
    prompt = types.ModelInput.from_ints([5, 6, 7])
    sc = client.create_sampling_client(model_path=sampler_path).result(timeout=30)
    res = sc.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=3)).result(timeout=30)
    assert [s.tokens for s in res.sequences] == [[0, 1, 2], [10, 11, 12]]
    assert [s.stop_reason for s in res.sequences] == ["length", "length"]
    ids = [s.sequence_id for s in res.sequences]
    assert len(set(ids)) == 2 and all(ids)  # from the promise's sample_sequence_ids
    live = tc.save_weights_and_get_sampling_client().result(timeout=30)
    logprobs = live.compute_logprobs(prompt).result(timeout=30)
    assert logprobs[0] is None and logprobs[1:] == [-2.0, -2.0]

    rest = tinker.RestClient(base_url=service.url, api_key=key)
    [run] = rest.list_training_runs().result(timeout=30).training_runs
    assert (run.training_run_id, run.base_model, run.lora_rank, run.model_owner) == (model_id, BASE_MODEL, 8, owner)
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == saved.path
    assert run.last_sampler_checkpoint is not None
    assert rest.get_training_run_by_tinker_path(saved.path).result(timeout=30).training_run_id == model_id
    checkpoints = rest.list_checkpoints(model_id).result(timeout=30).checkpoints
    assert sorted(c.checkpoint_id for c in checkpoints) == [
        "sampler_weights/ss1_seq6", "sampler_weights/step-1", "weights/step-1"
    ]
    assert {c.checkpoint_id: c.user_metadata for c in checkpoints}["weights/step-1"] == {"step": "1"}
    weights = rest.get_weights_info_by_tinker_path(saved.path).result(timeout=30)
    assert (weights.base_model, weights.lora_rank, weights.train_unembed) == (BASE_MODEL, 8, False)
    sampler = rest.get_sampler(sc._sampling_session_id).result(timeout=30)
    assert (sampler.base_model, sampler.model_path) == (BASE_MODEL, sampler_path)
    session = rest.get_session(client.holder.get_session_id()).result(timeout=30)
    assert session.training_run_ids == [model_id] and len(session.sampler_ids) == 2
    assert rest.list_sessions().result(timeout=30).sessions == [client.holder.get_session_id()]

    rest.delete_checkpoint_from_tinker_path(sampler_path).result(timeout=30)
    remaining = rest.list_checkpoints(model_id).result(timeout=30).checkpoints
    assert sampler_path not in [c.tinker_path for c in remaining] and len(remaining) == 2
    # The engine is asked to delete the files (a queued request of its own, run asynchronously).
    deadline = time.monotonic() + 10
    while not any(kind == "delete_checkpoint" for kind, _ in engine.handled):
        assert time.monotonic() < deadline, "no delete_checkpoint request reached the engine"
        time.sleep(0.05)

    # A new training client from the saved state: load_weights creates the model (its seq 0).
    restored = client.create_training_client_from_state(saved.path).result(timeout=30)
    assert restored.model_id == f"{client.holder.get_session_id()}:train:1"
    assert restored.get_info().lora_rank == 8
    assert restored.forward_backward([_datum([1, 2])], "cross_entropy").result(timeout=30).metrics == {"loss:sum": 0.5}


def test_failed_request_raises_request_failed_error(
    service: Service, engine: FakeEngine, service_client: ServiceClientFactory
) -> None:
    _, key = service.new_key()
    tc = service_client(key).create_lora_training_client(BASE_MODEL, rank=4).result(timeout=30)

    def refuse(store: Store, row: Request) -> bytes:
        raise EngineFailure("loss_fn 'dro' is not supported by this engine", "user")

    engine.handlers["forward_backward"] = refuse
    with pytest.raises(tinker.RequestFailedError, match="loss_fn 'dro' is not supported") as failed:
        tc.forward_backward([_datum([1, 2, 3])], "dro").result(timeout=30)
    assert failed.value.category == types.RequestErrorCategory.User


def test_sdk_errors_on_bad_input(service: Service, service_client: ServiceClientFactory) -> None:
    _, key = service.new_key()
    client = service_client(key)
    with pytest.raises(tinker.BadRequestError, match="is not served here"):
        client.create_lora_training_client("no/such-model", rank=4).result(timeout=30)
    with pytest.raises(tinker.NotFoundError):
        client.create_sampling_client(model_path="tinker://nope:train:0/sampler_weights/x").result(timeout=30)


def test_unknown_revoked_and_missing_keys_are_refused(service: Service, capsys: pytest.CaptureFixture[str]) -> None:
    unknown = "tml-0123456789abcdef_" + "A" * 43
    with pytest.raises(tinker.AuthenticationError, match="invalid API key"):
        tinker.ServiceClient(base_url=service.url, api_key=unknown).create_lora_training_client(BASE_MODEL).result()

    # A key made with the CLI works until it is revoked with the CLI.
    assert cli.main(["keys", "create", "revoke-me", "--db", service.db_url]) == 0
    key = capsys.readouterr().out.strip()
    key_id = key.removeprefix("tml-").split("_")[0]
    rest = tinker.RestClient(base_url=service.url, api_key=key)
    assert rest.list_training_runs().result(timeout=30).training_runs == []
    assert cli.main(["keys", "revoke", key_id, "--db", service.db_url]) == 0
    with pytest.raises(tinker.AuthenticationError, match="revoked"):
        rest.list_training_runs().result(timeout=30)

    # No key at all (the SDK refuses to send without one, so plain HTTP): every route but healthz is 401.
    for method, path in [
        ("POST", "/api/v1/client/config"), ("POST", "/api/v1/create_session"), ("POST", "/api/v1/retrieve_future"),
        ("GET", "/api/v1/training_runs"), ("GET", "/api/v1/get_server_capabilities"), ("POST", "/api/v1/telemetry"),
        ("POST", "/api/v1/forward_backward"), ("DELETE", "/api/v1/training_runs/m/checkpoints/weights/x"),
    ]:
        r = httpx.request(method, service.url + path, json={})
        assert r.status_code == 401, (path, r.status_code, r.text)
        assert "X-API-Key" in r.json()["detail"]
    assert httpx.get(f"{service.url}/api/v1/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{service.url}/openapi.json").status_code == 404  # no unauthenticated schema/docs routes


def test_other_keys_ids_are_invisible(service: Service, service_client: ServiceClientFactory) -> None:
    _, alice = service.new_key("alice")
    _, bob = service.new_key("bob")
    client = service_client(alice)
    tc = client.create_lora_training_client(BASE_MODEL, rank=4).result(timeout=30)
    path = tc.save_state("mine").result(timeout=30).path
    session_id = client.holder.get_session_id()

    rest = tinker.RestClient(base_url=service.url, api_key=bob)
    assert rest.list_training_runs().result(timeout=30).training_runs == []
    assert rest.list_user_checkpoints().result(timeout=30).checkpoints == []
    missing = tc.model_id.replace(session_id, "00000000-0000-0000-0000-000000000000")
    for call in (
        lambda m: rest.get_training_run(m),
        lambda m: rest.list_checkpoints(m),
        lambda m: rest.get_weights_info_by_tinker_path(path.replace(tc.model_id, m)),
        lambda m: rest.delete_checkpoint_from_tinker_path(path.replace(tc.model_id, m)),
    ):
        with pytest.raises(tinker.NotFoundError) as theirs:
            call(tc.model_id).result(timeout=30)
        with pytest.raises(tinker.NotFoundError) as absent:
            call(missing).result(timeout=30)
        assert str(theirs.value).replace(tc.model_id, "ID") == str(absent.value).replace(missing, "ID")
    with pytest.raises(tinker.NotFoundError):
        rest.get_session(session_id).result(timeout=30)
    # Alice still sees hers.
    alice_rest = tinker.RestClient(base_url=service.url, api_key=alice)
    assert [r.training_run_id for r in alice_rest.list_training_runs().result(timeout=30).training_runs] == [
        tc.model_id
    ]


def test_prompt_logprobs_nan_is_none(service: Service, service_client: ServiceClientFactory) -> None:
    _, key = service.new_key()
    sc = service_client(key).create_sampling_client(base_model=OTHER_BASE_MODEL).result(timeout=30)
    res = sc.sample(
        types.ModelInput.from_ints([1, 2, 3, 4]), num_samples=1, sampling_params=types.SamplingParams(max_tokens=2),
        include_prompt_logprobs=True,
    ).result(timeout=30)
    assert res.prompt_logprobs is not None and res.prompt_logprobs[0] is None
    assert not any(math.isnan(x) for x in res.prompt_logprobs[1:])
