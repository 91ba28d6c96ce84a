"""The service as users run it, against the official clients: `python -m trainer.service serve --config` (API and engine
in one process) on a tiny random Qwen3 published offline as `Qwen/Qwen3-8B` (tests/tiny_model.py), then

* the issue's seed script byte for byte (its `tml-dummy` imported with `keys import --allow-weak`, the server on
  localhost:8000; only if port 8000 is taken on this machine is the script's URL pointed at the server's port): its
  first loss is transformers' cross entropy of the base model on those tokens
  (tests/fixtures/tiny_qwen3/reference.json), and the loss falls;
* tinker-cookbook's math_rl recipe (arithmetic, importance_sampling, two steps), which samples, trains and saves;
* the SDK's REST calls on what they left behind (training runs, checkpoints, weights info, delete).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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


def test_tinker_cookbook_math_rl_runs_against_the_service(server: Server, tmp_path: Path) -> None:
    log_path = tmp_path / "math_rl"
    run = subprocess.run(
        [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", "model_name=Qwen/Qwen3-8B", "env=arithmetic",
         "group_size=4", "groups_per_batch=2", "max_tokens=8", "lora_rank=8", "loss_fn=importance_sampling",
         "max_steps=2", "eval_every=0", "save_every=0", f"base_url={server.url}", f"log_path={log_path}",
         "behavior_if_log_dir_exists=delete"],
        env={**server.env, "TINKER_API_KEY": server.key}, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["step"] for m in metrics if "step" in m][-1] >= 1, metrics
    # It trained, sampled and saved through this server: its checkpoints are the SDK's to list.
    rest = tinker.RestClient(base_url=server.url, api_key=server.key)
    runs = rest.list_training_runs().result().training_runs
    assert any(r.lora_rank == 8 for r in runs)


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
