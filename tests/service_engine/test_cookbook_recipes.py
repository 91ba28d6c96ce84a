"""tinker-cookbook 0.6.1's recipes, run unchanged as `python -m tinker_cookbook.recipes...` against the service as users
run it (tests/service_engine/served.py), each with its own defaults except the model (the tiny random Qwen3 published
offline as `Qwen/Qwen3-8B`), base_url, the key ($TINKER_API_KEY) and its step and batch knobs:

* sl_loop (supervised, cross_entropy, linear LR decay, a final `both` save): its train NLL falls;
* preference/dpo (client-side DPO loss through `forward_backward_custom`, reference log-probs through
  `compute_logprobs` on a `save_weights_and_get_sampling_client` snapshot, a test-NLL evaluator): its DPO loss starts
  at log 2 (the policy is the reference) and falls while the chosen-minus-rejected margin rises;
* math_rl, synchronous and asynchronous (`max_steps_off_policy=1`), and rl_loop, with their default loss,
  `stable_reinforce`: samplers made with record_stability_info=True, datums carrying provenance spans. math_rl's
  `optim/kl_sample_train_v1` (the mean of sampler minus trainer log-probs over the trained tokens) is ~0: the
  service trains on exactly what it sampled. On a random model no reward moves (every answer is wrong, so every
  advantage is 0 and rl_loop skips its updates): that stable_reinforce learns is tests/service_engine/test_engine.py's.

sl_loop, dpo and rl_loop load a Hub data set by a hard-coded name (sl_loop `HuggingFaceH4/no_robots`, dpo's default
`hhh` = `Anthropic/hh-rlhf`, rl_loop `openai/gsm8k`), which no config option replaces; with no network, a few rows of
the same shape are published as those data sets' offline cache entries (tests/hub_datasets.py), the way the model's
tokenizer is. math_rl's `arithmetic` environment makes its own problems.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hub_datasets import publish_dataset
from tests.service_engine.served import Server, serve

MODEL = "Qwen/Qwen3-8B"


def _sl_rows() -> list[dict[str, Any]]:
    """no_robots rows (the recipe reads `messages`): one short chat repeated, so that each batch is the same
    lesson and the NLL falls within a few steps at the recipe's learning rate (1e-4). 256 rows keep the linear decay
    (over len // batch_size batches) near the full rate for the steps run."""
    chat = [{"role": "user", "content": "Count to eight."},
            {"role": "assistant", "content": "one two three four five six seven eight"}]
    return [{"prompt": chat[0]["content"], "prompt_id": str(i), "messages": chat, "category": "Generation"}
            for i in range(256)]


def _hh_rows(n: int) -> list[dict[str, str]]:
    """hh-rlhf rows: `chosen` and `rejected` transcripts ("\\n\\nHuman: ... \\n\\nAssistant: ...") that differ in
    the last assistant turn."""
    def transcript(i: int, answer: str) -> str:
        return f"\n\nHuman: Please help me with task {i}.\n\nAssistant: {answer}"
    return [{"chosen": transcript(i, "Sure, here is a kind and helpful answer."), "rejected": transcript(i, "No.")}
            for i in range(n)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tmp_path_factory.mktemp("cookbook_recipes")) as served:
        publish_dataset(served.hf_home, "HuggingFaceH4/no_robots", {"train": _sl_rows(), "test": _sl_rows()[:4]})
        publish_dataset(served.hf_home, "Anthropic/hh-rlhf", {"train": _hh_rows(64), "test": _hh_rows(4)})
        gsm8k = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(16)]
        publish_dataset(served.hf_home, "openai/gsm8k", {"train": gsm8k, "test": gsm8k[:4]}, config_name="main")
        yield served


def run_recipe(server: Server, module: str, log_path: Path, *args: str) -> list[dict[str, Any]]:
    """Run `python -m module model_name=... base_url=... log_path=... *args`; assert it exits 0 and return its
    metrics.jsonl rows."""
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", module, f"model_name={MODEL}", f"base_url={server.url}", f"log_path={log_path}", *args],
        env={**server.env, "TINKER_API_KEY": server.key}, capture_output=True, text=True, timeout=600,
        cwd=log_path.parent)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    print(f"{module}: {time.monotonic() - start:.1f} s")
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _final_checkpoint(log_path: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]
    assert rows and rows[-1]["name"] == "final", rows
    return rows[-1]


def test_sl_loop_trains_and_its_nll_falls(server: Server, tmp_path: Path) -> None:
    log_path = tmp_path / "sl_loop"
    metrics = run_recipe(server, "tinker_cookbook.recipes.sl_loop", log_path, "batch_size=4", "max_steps=12")
    nll = [m["train_mean_nll"] for m in metrics]
    print("sl_loop train_mean_nll:", nll)
    assert [m["step"] for m in metrics] == list(range(12))
    assert all(b < a for a, b in zip(nll, nll[1:], strict=False)), nll  # the same batch every step
    assert nll[-1] < nll[0] - 0.1, nll
    final = _final_checkpoint(log_path)
    assert "/weights/final" in final["state_path"] and "/sampler_weights/final" in final["sampler_path"]


def test_dpo_trains_and_prefers_the_chosen_answers(server: Server, tmp_path: Path) -> None:
    log_path = tmp_path / "dpo"
    metrics = run_recipe(server, "tinker_cookbook.recipes.preference.dpo.train", log_path, "batch_size=4",
                         "max_steps=8", "behavior_if_log_dir_exists=delete")
    loss, margin = [m["dpo_loss"] for m in metrics], [m["margin"] for m in metrics]
    print("dpo loss:", loss, "margin:", margin)
    assert [m["step"] for m in metrics] == list(range(8))
    # Step 0: the policy is its own reference (the snapshot taken before any update), so every log-ratio is 0.
    assert loss[0] == pytest.approx(math.log(2), abs=1e-4) and margin[0] == pytest.approx(0, abs=1e-4)
    assert loss[-1] < loss[0] - 0.005 and margin[-1] > 0.01, (loss, margin)
    assert metrics[-1]["accuracy"] == 1.0
    assert "test/nll" in metrics[0] and "test/nll" in metrics[-1]  # its evaluator ran, at step 0 and the last step
    _final_checkpoint(log_path)


def _done(server: Server, kind: str) -> list[bytes]:
    """The bodies of this server's completed requests of `kind`, read from its database."""
    from trainer.service.store import DONE, Request, Store

    store = Store(f"sqlite:///{server.db}")
    try:
        with store._read() as s:
            return [r.body for r in s.query(Request).filter(Request.kind == kind, Request.status == DONE)]
    finally:
        store.close()


def _trained_with(server: Server, loss_fn: str) -> int:
    from trainer.service import protocol

    bodies = _done(server, protocol.FORWARD_BACKWARD)
    return sum(protocol.decode_forward_backward(b).loss_fn == loss_fn for b in bodies)


def _samples(server: Server, *, record_stability_info: bool) -> int:
    from trainer.service import protocol

    return sum(bool(protocol.decode_json(protocol.SAMPLE, b).record_stability_info) == record_stability_info
               for b in _done(server, protocol.SAMPLE))


@pytest.mark.parametrize("off_policy", [0, 1], ids=["sync", "async"])
def test_math_rl_with_its_default_loss(server: Server, tmp_path: Path, off_policy: int) -> None:
    log_path = tmp_path / "math_rl"
    before = _trained_with(server, "stable_reinforce")
    args = ["env=arithmetic", "group_size=4", "groups_per_batch=2", "max_tokens=8", "max_steps=2", "eval_every=0",
            "save_every=0", "behavior_if_log_dir_exists=delete"]
    if off_policy:
        args.append(f"max_steps_off_policy={off_policy}")
    metrics = run_recipe(server, "tinker_cookbook.recipes.math_rl.train", log_path, *args)
    trained = [m for m in metrics if "optim/kl_sample_train_v1" in m]
    assert [m["step"] for m in trained] == [0, 1], metrics  # (a last row, step 2, holds the final evaluation)
    assert _trained_with(server, "stable_reinforce") >= before + 2  # one forward_backward per step at least
    for m in trained:
        assert abs(m["optim/kl_sample_train_v1"]) < 1e-3, m  # sampler and trainer log-probs agree
    _final_checkpoint(log_path)


def test_rl_loop_with_its_default_loss(server: Server, tmp_path: Path) -> None:
    log_path = tmp_path / "rl_loop"
    recorded, unrecorded = (_samples(server, record_stability_info=r) for r in (True, False))
    metrics = run_recipe(server, "tinker_cookbook.recipes.rl_loop", log_path, "batch_size=2", "group_size=4",
                         "max_tokens=16", "max_steps=2")
    assert [m["step"] for m in metrics] == [0, 1], metrics
    # No answer of a random model holds a right \boxed{} (reward 0, so rl_loop skips the update), but it sampled as
    # stable_reinforce needs: every sample recorded.
    assert [m["reward/total"] for m in metrics] == [0.0, 0.0]
    assert _samples(server, record_stability_info=True) >= recorded + 2
    assert _samples(server, record_stability_info=False) == unrecorded  # (dpo's compute_logprobs record nothing)
