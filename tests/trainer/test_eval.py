"""The held-out eval: pass@k against the paper's own estimator, a run with eval on is bitwise the run without it,
an interrupted run with eval resumes exactly, `eval` on a checkpoint repeats the scores the run logged there, and
bad eval settings are refused before any device is touched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from tests.trainer.conftest import tiny_train_config
from trainer.base.config import ConfigError, config_from_dict
from trainer.rl.metrics import CLOCK_KEYS, read_metrics
from trainer.rl.train import TrainResult, train

EVAL = {"every": 2, "prompts": 6, "samples": 4, "pass_at": [1, 2, 4], "pass_threshold": 0.25}
STEPS = 4


def _cfg(run_dir: Path, **top: Any) -> Any:
    # checkpoint.every 2: checkpoints 2 and 4 to evaluate later; the eval's 6 prompts x 4 samples fill 3 batches of 8.
    return config_from_dict({**tiny_train_config(run_dir, steps=STEPS, checkpoint={"every": 2, "keep": 4}), **top})


def _training(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A record without its wall-clock fields and the eval's scores."""
    return [{k: v for k, v in r.items() if k not in CLOCK_KEYS and not k.startswith("eval/")} for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, TrainResult]]:
    """The same 4 steps with eval on (every 2 steps) and off; the programs compile once for both."""
    out = {}
    for name, extra in (("on", {"eval": EVAL}), ("off", {})):
        run_dir = tmp_path_factory.mktemp(name)
        out[name] = (run_dir, train(_cfg(run_dir, **extra)))
    return out


def test_pass_at_k_is_the_papers_unbiased_estimator() -> None:
    from trainer.rl.evaluate import pass_at_k

    def paper(n: int, c: int, k: int) -> float:
        # Chen et al. 2021, figure 3: the numerically stable form, written as the paper's listing does.
        if n - c < k:
            return 1.0
        return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))

    for n in (1, 2, 5, 16, 200):
        for c in range(n + 1):
            for k in {1, min(2, n), n // 2 or 1, n}:
                assert pass_at_k(n, c, k) == pytest.approx(paper(n, c, k), rel=1e-12, abs=1e-12), (n, c, k)
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


@pytest.mark.slow
def test_a_run_with_eval_is_bitwise_the_run_without(runs: dict[str, tuple[Path, TrainResult]]) -> None:
    (on_dir, on), (off_dir, off) = runs["on"], runs["off"]
    for a, b in zip(jax.tree.leaves(on.params), jax.tree.leaves(off.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    on_records, off_records = read_metrics(on_dir), read_metrics(off_dir)
    assert _training(on_records) == _training(off_records)
    # The eval followed steps 2 and 4 (records 1 and 3, 0-based like every record), with its time of its own.
    evaluated = [r["step"] for r in on_records if "eval/greedy_reward" in r]
    assert evaluated == [1, 3] and all(r["time/eval_s"] > 0 for r in on_records if r["step"] in evaluated)
    assert not any(k.startswith("eval/") for r in off_records for k in r)
    scores = on_records[3]
    assert set(scores) >= {"eval/greedy_reward", "eval/greedy_pass", "eval/greedy_len", "eval/sampled_reward",
                           "eval/sampled_len", "eval/pass_at_1", "eval/pass_at_2", "eval/pass_at_4"}
    # Rates and char_match means lie in [0, 1]; pass@k grows with k; pass@1 is the mean pass rate of the samples.
    for key in ("eval/greedy_reward", "eval/greedy_pass", "eval/sampled_reward", "eval/pass_at_1"):
        assert 0.0 <= scores[key] <= 1.0, key
    assert scores["eval/pass_at_1"] <= scores["eval/pass_at_2"] <= scores["eval/pass_at_4"]
    assert 1 <= scores["eval/greedy_len"] <= 6 and scores["eval/greedy_reward"] > 0  # a random policy earns some
    # In TensorBoard and the summary too.
    from tests.trainer.test_train import _board

    assert _board(on_dir, "eval/pass_at_4") == [(1, pytest.approx(on_records[1]["eval/pass_at_4"])),
                                                (3, pytest.approx(scores["eval/pass_at_4"]))]
    summary = json.loads((on_dir / "summary.json").read_text())
    assert summary["eval"] == {"after_step": 3, **{k: v for k, v in scores.items() if k.startswith("eval/")}}


@pytest.mark.slow
def test_eval_of_a_checkpoint_repeats_the_logged_scores(runs: dict[str, tuple[Path, TrainResult]],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.run.eval_cli import main

    run_dir, _ = runs["on"]
    logged = read_metrics(run_dir)
    want = {2: {k: v for k, v in logged[1].items() if k.startswith("eval/")},
            4: {k: v for k, v in logged[3].items() if k.startswith("eval/")}}
    assert main([str(run_dir), "--step", "2"]) == 0
    assert json.loads((run_dir / "eval" / "step-2.json").read_text())["scores"] == want[2]
    assert "held-out eval of checkpoint step 2 (6 prompts)" in capsys.readouterr().out
    # The newest by default; a run trained without an eval section takes the defaults (and --set works).
    out = run_dir / "newest.json"
    assert main([str(run_dir), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["step"] == 4 and json.loads(out.read_text())["scores"] == want[4]
    off_dir, _ = runs["off"]
    assert main([str(off_dir), "--set", "eval.prompts=3", "--set", "eval.samples=0"]) == 0
    scores = json.loads((off_dir / "eval" / "step-4.json").read_text())["scores"]
    assert set(scores) == {"eval/greedy_reward", "eval/greedy_pass", "eval/greedy_len"}
    # No such step, no run folder: exit 2 with the reason.
    capsys.readouterr()
    assert main([str(run_dir), "--step", "3"]) == 2
    assert "--step 3: no checkpoint of that step" in capsys.readouterr().err
    assert main([str(run_dir / "nothing")]) == 2
    assert "no config.yaml, so not a run folder" in capsys.readouterr().err


@pytest.mark.slow
def test_an_interrupted_run_with_eval_resumes_exactly(runs: dict[str, tuple[Path, TrainResult]],
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stopped right after step 2 (the eval due there still runs, once the checkpoint is finished: the grace period
    # is sized for the save alone), then resumed.
    from trainer.rl.checkpoint import finished_steps
    from trainer.rl.evaluate import Evaluator

    finished_when_evaluated: list[list[int]] = []
    evaluate = Evaluator.__call__

    def spy(self: Evaluator, params: Any) -> dict[str, float]:
        finished_when_evaluated.append(finished_steps(tmp_path / "checkpoints")[0])
        return evaluate(self, params)

    monkeypatch.setattr(Evaluator, "__call__", spy)
    first = train(_cfg(tmp_path, eval=EVAL), stop_after=2)
    assert first.stopped_early and first.step == 2
    assert finished_when_evaluated == [[2]]
    monkeypatch.undo()
    resumed = train(_cfg(tmp_path, eval=EVAL))
    assert resumed.step == STEPS
    strip = lambda rs: [{k: v for k, v in r.items() if k not in CLOCK_KEYS} for r in rs]  # noqa: E731
    assert strip(read_metrics(tmp_path)) == strip(read_metrics(runs["on"][0]))


def test_eval_settings_are_checked_before_any_device(tmp_path: Path) -> None:
    from trainer.rl.task_data import load_task_data
    from trainer.rl.tasks import sample_gsm8k_path

    def load(**top: Any) -> Any:
        return load_task_data(config_from_dict({**tiny_train_config(tmp_path), **top}))

    with pytest.raises(ConfigError, match=r"eval\.pass_reward: 'exact_match' is not one of the run's rewards "
                                          r"\(char_match\)"):
        load(eval={"pass_reward": "exact_match"})
    with pytest.raises(ConfigError, match=r"eval: pass_at: \[5\] not in \[1, samples = 4\]"):
        load(eval={"pass_at": [1, 5]})
    gsm8k = {"name": "gsm8k", "path": str(sample_gsm8k_path())}
    # A finite dataset without a held-out split would score what it trains on.
    with pytest.raises(ConfigError, match="gsm8k task has no held-out split: set task.eval_path"):
        load(task=gsm8k, tokenizer="char", eval={})
    n = len(load(task=gsm8k).task)
    with pytest.raises(ConfigError, match=r"eval\.prompts: 32 held-out prompts asked .* the split has 2"):
        load(task={**gsm8k, "holdout": 2}, eval={})
    # holdout: those rows leave the training stream; eval_path: a file of its own, training keeps every row.
    data = load(task={**gsm8k, "holdout": 2}, eval={"prompts": 2})
    held = {data.task.eval_example(i).prompt for i in range(2)}
    trained = {data.task.example(i).prompt for i in range(3 * n)}
    assert len(held) == 2 and len(trained) == n - 2 and not held & trained
    data = load(task={**gsm8k, "eval_path": str(sample_gsm8k_path())}, eval={"prompts": n})
    assert len(data.task) == n and data.task.eval_example(n - 1).prompt in trained | held
    with pytest.raises(ConfigError, match="not both"):
        load(task={**gsm8k, "eval_path": str(sample_gsm8k_path()), "holdout": 1})


def test_a_generated_tasks_held_out_split_lies_past_every_training_index() -> None:
    from trainer.base.eval_config import EVAL_INDEX_OFFSET
    from trainer.rl.tasks import Example, eval_example, get_task

    task = get_task("copy")
    assert eval_example(task, 3) == task.example(EVAL_INDEX_OFFSET + 3)

    class Own:  # a user's task with a split of its own
        name, reward_names = "own", ("char_match",)

        def example(self, index: int) -> Example:
            return Example(f"t{index}", {"target": "x"})

        def eval_example(self, index: int) -> Example:
            return Example(f"e{index}", {"target": "y"})

    assert eval_example(Own(), 2) == Example("e2", {"target": "y"})

    class Finite(Own):  # sized, no split: refused
        eval_example = None  # type: ignore[assignment]

        def __len__(self) -> int:
            return 3

    with pytest.raises(TypeError, match="finite dataset without an eval_example"):
        eval_example(Finite(), 0)


def test_the_eval_reuses_the_rollouts_program_and_compiles_greedy_once(tmp_path: Path) -> None:
    from trainer.base.config import resolve_mesh
    from trainer.model.sharding import make_mesh
    from trainer.rl.step import build_programs

    # Built, not compiled: jit compiles on the first call.
    cfg = resolve_mesh(_cfg(tmp_path, mesh={"slices": 1, "fsdp": 1, "tensor": 1}), 1)
    programs = build_programs(cfg, make_mesh(1, 1, 1, jax.devices()[:1]), 0, 1)
    sc = cfg.sampling
    assert programs.sampler(sc.temperature, sc.top_k, sc.top_p) is programs.sample  # the eval at the rollouts' own
    greedy = programs.sampler(0.0, 0, 1.0)
    assert greedy is not programs.sample and programs.sampler(0, 5, 0.5) is greedy  # greedy ignores top_k, top_p
    assert programs.sampler(0.7, 0, 1.0) not in (greedy, programs.sample)
