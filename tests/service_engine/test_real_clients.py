"""The service as users run it, against the official clients: `python -m trainer.service serve --config` (API and engine
in one process) on a tiny random Qwen3 published offline as `Qwen/Qwen3-8B` (tests/tiny_model.py), then

* the issue's seed script byte for byte (its `tml-dummy` imported with `keys import --allow-weak`, the server on
  localhost:8000; only if port 8000 is taken on this machine is the script's URL pointed at the server's port): its
  first loss is transformers' cross entropy of the base model on those tokens
  (tests/fixtures/tiny_qwen3/reference.json), and the loss falls;
* the SDK's REST calls on what they left behind (training runs, checkpoints, weights info, delete).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import tinker

from tests.service_engine.served import ROOT, Server, serve
from tests.tiny_model import reference

SdkClients = Callable[[str, str], tinker.ServiceClient]
SEED_PORT = 8000  # the seed script's base_url
SEED_SCRIPT = ROOT / "tests" / "fixtures" / "tinker" / "seed_script.py.txt"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = SEED_PORT if _free(SEED_PORT) else None
    with serve(tmp_path_factory.mktemp("real_clients"), port, weak_keys={"seed-script": "tml-dummy"}) as served:
        yield served


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_seed_script_trains_from_the_base_models_loss(server: Server, tmp_path: Path) -> None:
    text = SEED_SCRIPT.read_text()
    assert text.count('"http://localhost:8000"') == 1 and text.count('"tml-dummy"') == 1
    script = tmp_path / "seed.py"
    if not server.url.endswith(f":{SEED_PORT}"):  # port 8000 was taken here: the one line that must change
        text = text.replace('"http://localhost:8000"', repr(server.url))
    script.write_text(text)
    run = subprocess.run([sys.executable, str(script)], env=server.env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^Loss: (\S+)$", run.stdout, re.MULTILINE)]
    assert len(losses) == 6, run.stdout
    assert f"{losses[0]:.4f}" == reference()["first_loss_printed"]  # a fresh LoRA is the base model
    print("seed script losses:", losses)
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_rest_calls_see_and_delete_what_the_clients_saved(server: Server, sdk_clients: SdkClients) -> None:
    sc = sdk_clients(server.url, server.key)
    tc = sc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    state = tc.save_state("kept").result().path
    sampler = tc.save_weights_for_sampler("to-delete").result().path
    rest = tinker.RestClient(base_url=server.url, api_key=server.key)
    listed = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert {state, sampler} <= listed
    run = rest.get_training_run(tc.model_id).result()
    assert run.base_model == "Qwen/Qwen3-8B" and run.is_lora and run.lora_rank == 4
    info = rest.get_weights_info_by_tinker_path(sampler).result()
    assert info.lora_rank == 4 and info.base_model == "Qwen/Qwen3-8B"
    before = {p.name for p in server.storage.rglob("to-delete-*")}
    assert before, "the sampler save wrote no files"
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    deadline = time.monotonic() + 30
    while any(server.storage.rglob("to-delete-*")):
        assert time.monotonic() < deadline, "the engine did not delete the checkpoint's files"
        time.sleep(0.2)
    assert {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints} == listed - {sampler}


def test_a_sampler_checkpoint_loads_in_peft_with_the_services_logprobs(server: Server,
                                                                      sdk_clients: SdkClients) -> None:
    """What save_weights_for_sampler writes is a PEFT adapter: transformers + PEFT on it give the log-probs the
    service's forward() gives for the trained model."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from tests.tiny_model import FIXTURE
    from trainer.service.store import Store

    sc = sdk_clients(server.url, server.key)
    tc = sc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8, seed=3).result()
    data = [tinker.types.Datum(**d) for d in _reference_datums()]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_weights_for_sampler("peft-check").result().path
    ours = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    store = Store(f"sqlite:///{server.db}")
    try:
        owner = server.key.removeprefix("tml-").split("_")[0]
        adapter_dir = store.get_checkpoint(owner, path).storage_path
    finally:
        store.close()
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURE, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    for datum, out in zip(data, ours, strict=True):
        tokens = torch.tensor([datum.model_input.to_ints()])
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens).logits[0].double(), -1)
        targets = datum.loss_fn_inputs["target_tokens"].tolist()
        theirs = logp[torch.arange(len(targets)), torch.tensor(targets)].numpy()
        assert abs(theirs - out["logprobs"].to_numpy()).max() < 2e-4
    base = reference()["data"][0]["logprobs"]
    assert abs(ours[0]["logprobs"].to_numpy() - base).max() > 1e-2, "training should have moved the log-probs"


def _reference_datums() -> list[dict]:
    return [{"model_input": tinker.types.ModelInput.from_ints(d["model_input"]),
             "loss_fn_inputs": {"target_tokens": d["target_tokens"], "weights": d["weights"]}}
            for d in reference()["data"]]


def test_external_weights_download_with_the_tinker_cli(server: Server, sdk_clients: SdkClients,
                                                       tmp_path: Path) -> None:
    """save_weights_external writes the PEFT adapter; the SDK's own `tinker checkpoint download` (a subprocess)
    fetches it through our signed URLs, and it loads in PEFT with the trained tensors. Those URLs are the owner's
    alone, and refused once altered, expired or their checkpoint deleted."""
    import urllib.error
    import urllib.request

    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    from tests.tiny_model import FIXTURE
    from trainer.service import downloads
    from trainer.service.store import Store

    sc = sdk_clients(server.url, server.key)
    tc = sc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4, seed=5).result()
    tc.forward_backward([tinker.types.Datum(**d) for d in _reference_datums()], "cross_entropy").result()
    tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_for_sampler("ext-reference").result().path
    with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
        tc.save_weights_external("sealed", age_encryption_recipients=["age1" + "q" * 58]).result()
    ext = tc.save_weights_external("final").result().path  # the refusal above held up nothing
    assert ext == f"tinker://{tc.model_id}/external_weights/final"
    rest = tinker.RestClient(base_url=server.url, api_key=server.key)
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[ext].checkpoint_type == "external" and listed[ext].size_bytes

    env = {**server.env, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": server.key}
    tinker_cli = [str(Path(sys.executable).parent / "tinker"), "checkpoint", "download"]
    run = subprocess.run([*tinker_cli, ext, "--output", str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, (run.stdout, run.stderr)
    got = tmp_path / f"{tc.model_id}_external_weights_final"  # the CLI's own naming
    assert sorted(p.name for p in got.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    store = Store(f"sqlite:///{server.db}")
    try:
        owner = server.key.removeprefix("tml-").split("_")[0]
        reference_dir = Path(store.get_checkpoint(owner, sampler).storage_path)
        key = store.secret(downloads.SECRET_NAME)
        ckpt = store.get_checkpoint(owner, ext)
    finally:
        store.close()
    ours, saved = load_file(got / "adapter_model.safetensors"), load_file(reference_dir / "adapter_model.safetensors")
    assert ours.keys() == saved.keys() and all((ours[k] == saved[k]).all() for k in ours)
    assert any(abs(t).max() > 0 for k, t in ours.items() if "lora_B" in k), "training should have moved lora_B"
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURE)
    peft.PeftModel.from_pretrained(model, got)  # loads as the PEFT adapter it is

    # The URLs: signed for this owner, this file and an hour (the CLI signs again 5 minutes before the expiry).
    answer = rest.get_external_weights_urls(ext).result()
    assert set(answer.urls) == {"adapter_config.json", "adapter_model.safetensors"}
    assert 3500 < (answer.expires - datetime.now(UTC)).total_seconds() <= 3600
    config_url = answer.urls["adapter_config.json"]
    with urllib.request.urlopen(config_url) as response:
        assert response.read() == (got / "adapter_config.json").read_bytes()

    def refused(url: str) -> str:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url)
        assert e.value.code == 403, url
        return e.value.read().decode()

    refused(config_url[:-1] + ("0" if config_url[-1] != "0" else "1"))  # an altered signature
    refused(config_url.replace("adapter_config.json", "adapter_model.safetensors"))  # another file, same signature
    refused(re.sub(r"expires=\d+", lambda m: f"expires={int(m.group(0)[8:]) + 86400}", config_url))  # a longer life
    past = int(time.time()) - 1
    assert "expired" in refused(downloads.url(server.url, key, ckpt, "adapter_config.json", past))

    # Another tenant: the checkpoint reads as missing, to the SDK and to the CLI.
    other = subprocess.run([sys.executable, "-m", "trainer.service", "keys", "create", "other", "--db", str(server.db)],
                           cwd=ROOT, env=server.env, capture_output=True, text=True, check=True).stdout.strip()
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=server.url, api_key=other).get_external_weights_urls(ext).result()
    theirs = subprocess.run([*tinker_cli, ext, "--output", str(tmp_path / "other")],
                            env={**env, "TINKER_API_KEY": other}, capture_output=True, text=True, timeout=120)
    assert theirs.returncode != 0 and not any((tmp_path / "other").iterdir())
    other_id = other.removeprefix("tml-").split("_")[0]
    refused(config_url.replace(f"/{owner}/", f"/{other_id}/"))  # our URL made out to them
    # A URL of a deleted checkpoint no longer works (before its expiry).
    rest.delete_checkpoint_from_tinker_path(ext).result()
    refused(config_url)


def test_tinker_checkpoint_download_exports_a_training_checkpoint(server: Server, sdk_clients: SdkClients,
                                                                 tmp_path: Path) -> None:
    """`tinker checkpoint download tinker://<run>/weights/<name>`: the CLI loads the state into a new training run,
    exports it with save_weights_external, keeps the export alive while it downloads (set_checkpoint_ttl), then
    deletes it. What it writes is the state's adapter."""
    from safetensors.numpy import load_file

    from trainer.service.store import Store

    sc = sdk_clients(server.url, server.key)
    tc = sc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4, seed=7).result()
    tc.forward_backward([tinker.types.Datum(**d) for d in _reference_datums()], "cross_entropy").result()
    tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("exported").result().path
    env = {**server.env, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": server.key}
    run = subprocess.run([str(Path(sys.executable).parent / "tinker"), "checkpoint", "download", state, "--output",
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout, run.stderr)
    got = tmp_path / f"{tc.model_id}_weights_exported"
    assert sorted(p.name for p in got.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    store = Store(f"sqlite:///{server.db}")
    try:
        owner = server.key.removeprefix("tml-").split("_")[0]
        saved = load_file(Path(store.get_checkpoint(owner, state).storage_path) / "adapter_model.safetensors")
    finally:
        store.close()
    ours = load_file(got / "adapter_model.safetensors")
    assert ours.keys() == saved.keys() and all((ours[k] == saved[k]).all() for k in ours)
    rest = tinker.RestClient(base_url=server.url, api_key=server.key)
    left = [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints]
    assert not [p for p in left if p.endswith("/external_weights/download")], left  # the CLI deleted its export
