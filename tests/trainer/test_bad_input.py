"""A careless user's trainer configs: bad values generated from the demo config and a Hugging Face init config.

Each case must end `gke-tpu-rl train --local-processes 2 --devices-per-process 4` with exit 2, no traceback and the
dotted key (or the file and line, or the --set item) named, before any process is launched or device set up.
Values are bad by construction, not by asking the validator.
"""

from __future__ import annotations

import contextlib
import copy
import io
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.base.config import default_config_path
from trainer.run import cli, launch

TRAINER_CASES = 100
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "qwen3_tied_bf16"
DEVICES = ["--local-processes", "2", "--devices-per-process", "4"]


@dataclass
class Case:
    kind: str
    base: str
    doc: dict[str, Any]
    expect: str
    overrides: list[str] = field(default_factory=list)
    duplicate: str | None = None  # a top-level line appended again


def _bases(hf_dir: Path) -> dict[str, dict[str, Any]]:
    demo = yaml.safe_load(default_config_path().read_text())
    hf = copy.deepcopy(demo)
    del hf["model"]
    hf["init"] = {"from": "hf", "path": str(hf_dir)}
    return {"demo": demo, "hf": hf}


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf")])
WRONG_TYPE = st.one_of(st.just([1, 2]), st.just({"a": 1}), st.from_regex(r"\A[a-z]{3,8}\Z"))
POSITIVE_INTS = ("rl.prompts_per_step", "rl.mu_iterations", "sampling.max_new_tokens", "steps", "log_every",
                 "checkpoint.keep", "rl.minibatches", "compute.logprob_chunk")
POSITIVE_FLOATS = ("optim.lr", "optim.clip_norm", "rl.adv_eps")
NON_NEGATIVE_FLOATS = ("rl.clip_eps", "rl.clip_eps_high", "rl.kl_beta", "optim.weight_decay", "sampling.temperature")
ENUMS = ("rl.algo", "rl.loss_agg", "rl.kl_estimator", "compute.remat", "compute.dtype", "compute.param_dtype",
         "optim.name", "compute.grad_accum_dtype")


def _value(path: str, values: st.SearchStrategy[Any], expect: str | None = None, base: str | None = None) -> Any:
    def mutate(draw: st.DrawFn, bases: dict[str, dict[str, Any]], kind: str) -> Case:
        name = base or draw(st.sampled_from(sorted(bases)))
        doc = copy.deepcopy(bases[name])
        _set(doc, path, draw(values))
        return Case(kind, name, doc, expect or path)
    return mutate


def _from(keys: tuple[str, ...], values: st.SearchStrategy[Any], base: str | None = None,
          expect: str | None = None) -> Any:
    def mutate(draw: st.DrawFn, bases: dict[str, dict[str, Any]], kind: str) -> Case:
        name = base or draw(st.sampled_from(sorted(bases)))
        doc = copy.deepcopy(bases[name])
        key = draw(st.sampled_from(keys))
        _set(doc, key, draw(values))
        return Case(kind, name, doc, expect or key)
    return mutate


def _unknown_key(draw: st.DrawFn, bases: dict[str, dict[str, Any]], kind: str) -> Case:
    name = draw(st.sampled_from(sorted(bases)))
    doc = copy.deepcopy(bases[name])
    section = draw(st.sampled_from(["", "rl", "sampling", "optim", "checkpoint", "mesh", "compute", "init"]))
    key = draw(st.from_regex(r"\A[a-z]{2,6}_[a-z]{2,8}x\Z"))
    path = f"{section}.{key}" if section else key
    _set(doc, path, draw(st.integers()))
    return Case(kind, name, doc, f"unknown config key: {path}")


def _mesh(draw: st.DrawFn, bases: dict[str, dict[str, Any]], kind: str) -> Case:
    name = draw(st.sampled_from(sorted(bases)))
    doc = copy.deepcopy(bases[name])
    how = draw(st.sampled_from(["zero", "negative", "two inferred", "too many devices"]))
    axis = draw(st.sampled_from(["slices", "fsdp", "tensor"]))
    mesh = {"slices": 2, "fsdp": 2, "tensor": 2}
    if how == "zero":
        mesh[axis] = 0
    elif how == "negative":
        mesh[axis] = draw(st.integers(max_value=-2))
    elif how == "two inferred":
        mesh = {"slices": -1, "fsdp": -1, "tensor": 2}
    else:
        mesh[axis] = draw(st.sampled_from([3, 4, 8]))  # 12, 16 or 32 devices: not the 8 the processes have
    doc["mesh"] = mesh
    return Case(kind, name, doc, "mesh")


def _lengths(draw: st.DrawFn, bases: dict[str, dict[str, Any]], kind: str) -> Case:
    doc = copy.deepcopy(bases["demo"])  # max_seq_len 16
    doc["sampling"] = {**doc["sampling"], "max_prompt_len": draw(st.integers(9, 40)), "max_new_tokens": 8}
    return Case(kind, "demo", doc, "sampling.max_prompt_len")


def _indivisible(draw: st.DrawFn, bases: dict[str, dict[str, Any]], kind: str) -> Case:
    name = draw(st.sampled_from(sorted(bases)))
    doc = copy.deepcopy(bases[name])  # 16 prompts x 8 = 128 sequences a step
    key, value = draw(st.sampled_from([
        ("rl.minibatches", 3), ("rl.minibatches", 5), ("rl.minibatches", 7),
        ("compute.train_micro_batch_size", 3), ("compute.train_micro_batch_size", 48),
        ("sampling.max_num_sequences", 5), ("sampling.max_num_sequences", 100)]))
    _set(doc, key, value)
    return Case(kind, name, doc, key)


def _hf_damage(draw: st.DrawFn, bases: dict[str, dict[str, Any]], kind: str) -> Case:
    doc = copy.deepcopy(bases["hf"])
    src = Path(doc["init"]["path"])
    dst = Path(tempfile.mkdtemp(prefix="hf-damaged-", dir=src.parent))
    how = draw(st.sampled_from(["missing dir", "empty dir", "a file", "no config", "config not JSON",
                                "truncated weights", "weights header garbage", "no weights"]))
    if how == "missing dir":
        dst.rmdir()
    elif how == "a file":
        dst.rmdir()
        dst.write_text("not a checkpoint")
    elif how != "empty dir":
        shutil.copytree(src, dst, dirs_exist_ok=True)
        weights, config = dst / "model.safetensors", dst / "config.json"
        if how == "no config":
            config.unlink()
        elif how == "config not JSON":
            text = config.read_text()
            config.write_text(text[: draw(st.integers(1, len(text) - 2))])
        elif how == "truncated weights":
            data = weights.read_bytes()
            weights.write_bytes(data[: draw(st.integers(0, len(data) - 1))])
        elif how == "weights header garbage":
            data = weights.read_bytes()
            weights.write_bytes(draw(st.binary(min_size=8, max_size=64)) + data[64:])
        else:
            weights.unlink()
    doc["init"]["path"] = str(dst)
    return Case(f"{kind}: {how}", "hf", doc, "init.path")


def _duplicate(draw: st.DrawFn, bases: dict[str, dict[str, Any]], kind: str) -> Case:
    name = draw(st.sampled_from(sorted(bases)))
    doc = copy.deepcopy(bases[name])
    key = draw(st.sampled_from(["steps", "seed", "tokenizer", "log_every"]))
    doc.setdefault(key, {"steps": 3, "seed": 1, "tokenizer": "char", "log_every": 1}[key])
    return Case(kind, name, doc, "duplicate key", duplicate=f"{key}: {doc[key]}")


def _bad_set(draw: st.DrawFn, bases: dict[str, dict[str, Any]], kind: str) -> Case:
    name = draw(st.sampled_from(sorted(bases)))
    item = draw(st.sampled_from(["rl.group_size", "rl..group_size=4", "steps=[unclosed", "rl.group_size={a: ",
                                 "seed.value=1", ".steps=2"]))
    return Case(kind, name, copy.deepcopy(bases[name]), "--set", overrides=[item])


_MUTATIONS: dict[str, Any] = {
    "unknown key": _unknown_key,
    "positive int not positive": _from(POSITIVE_INTS, st.integers(max_value=0)),
    "group size under 2": _value("rl.group_size", st.integers(max_value=1)),
    "wrong type": _from(POSITIVE_INTS + ("rl.group_size",), WRONG_TYPE),
    "non-finite float": _from(POSITIVE_FLOATS + NON_NEGATIVE_FLOATS + ("optim.b1", "optim.b2"), NON_FINITE),
    "positive float not positive": _from(POSITIVE_FLOATS, st.floats(max_value=0, allow_nan=False,
                                                                    allow_infinity=False)),
    "negative float": _from(NON_NEGATIVE_FLOATS, st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False)),
    "adam beta outside [0, 1)": _from(("optim.b1", "optim.b2"), st.one_of(
        st.floats(min_value=1, allow_nan=False, allow_infinity=False),
        st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False))),
    "rope theta not positive": _value("model.rope_theta", st.floats(max_value=0, allow_nan=False,
                                                                    allow_infinity=False), base="demo"),
    "norm eps not positive": _value("model.norm_eps", st.floats(max_value=0, allow_nan=False, allow_infinity=False),
                                    base="demo"),
    "top_p outside (0, 1]": _value("sampling.top_p", st.one_of(
        st.floats(max_value=0, allow_nan=False, allow_infinity=False),
        st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False))),
    "min_lr_ratio outside [0, 1]": _value("optim.min_lr_ratio", st.one_of(
        st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
        st.floats(min_value=1.0001, allow_nan=False, allow_infinity=False))),
    "enum": _from(ENUMS, st.from_regex(r"\A[a-z]{1,4}[0-9][a-z]{0,4}\Z")),
    "init from": _value("init.from", st.sampled_from(["huggingface", "HF", "scratch", ""]), expect="init.from"),
    "unknown task": _value("task.name", st.from_regex(r"\A[a-z]{3,8}[0-9]\Z"), expect="task"),
    "task option": _from(("task.path", "task.split", "task.max_len"), st.integers(), expect="task: "),
    "unknown reward": _value("rewards", st.from_regex(r"\A[a-z]{3,8}[0-9]\Z").map(lambda r: [r]),
                             expect="rewards"),
    "tokenizer": _value("tokenizer", st.from_regex(r"\A/nonexistent/[a-z]{3,8}\Z"), expect="tokenizer"),
    "vocab below the tokenizer's": _value("model.vocab_size", st.integers(1, 99), base="demo"),
    "heads": _value("model.n_kv_heads", st.sampled_from([3, 5, 6]), expect="model", base="demo"),
    "model dims": _from(("model.d_model", "model.n_layers", "model.d_ff", "model.max_seq_len"),
                        st.integers(max_value=0), base="demo"),
    "model with hf init": _value("model", st.just({"vocab_size": 100, "d_model": 8, "n_layers": 1, "n_heads": 1,
                                                   "n_kv_heads": 1, "head_dim": 8, "d_ff": 8, "max_seq_len": 16}),
                                 expect="model", base="hf"),
    "mesh": _mesh,
    "lengths": _lengths,
    "indivisible batch": _indivisible,
    "seed out of int64": _value("seed", st.one_of(st.integers(min_value=2**63), st.integers(max_value=-(2**63) - 1))),
    "empty run dir": _value("run_dir", st.just("")),
    "hf checkpoint": _hf_damage,
    "duplicate key": _duplicate,
    "bad --set": _bad_set,
}


@st.composite
def trainer_cases(draw: st.DrawFn, kind: str, bases: dict[str, dict[str, Any]]) -> Case:
    return _MUTATIONS[kind](draw, bases, kind)


def _run(case: Case, workdir: Path) -> tuple[int, str]:
    text = yaml.safe_dump(case.doc, sort_keys=False)
    path = workdir / "run.yaml"
    if case.duplicate:
        text += case.duplicate + "\n"
        case.expect = f"{path}:{len(text.splitlines())}: duplicate key"
    path.write_text(text)
    args = ["--config", str(path), *(f"--set={o}" for o in case.overrides), "--run-dir", str(workdir / "run"),
            *DEVICES]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(args)
    return rc, err.getvalue()


def _never_launch(*args: Any, **kwargs: Any) -> int:
    raise AssertionError("a bad config reached the launcher")


def test_bad_trainer_configs_are_refused_by_key_before_any_device(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.setattr(launch, "run_local", _never_launch)
    hf_dir = tmp_path / "hf" / "model"
    shutil.copytree(FIXTURE, hf_dir)
    bases = _bases(hf_dir)
    kinds: Counter[str] = Counter()

    def check(case: Case) -> None:
        rc, err = _run(case, tmp_path)
        kinds[case.kind.split(":")[0]] += 1
        assert rc == 2, f"{case.kind}: accepted (exit {rc}); {err}"
        assert "Traceback" not in err, err
        assert case.expect in err, f"{case.kind}: the error does not name {case.expect!r}:\n{err}"
        assert not (tmp_path / "run").exists(), f"{case.kind}: a run folder was made"

    per_kind = -(-TRAINER_CASES // len(_MUTATIONS))
    for kind in sorted(_MUTATIONS):
        settings(max_examples=per_kind, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])(
            given(case=trainer_cases(kind, bases))(check))()
    assert sum(kinds.values()) >= TRAINER_CASES
    assert set(kinds) == set(_MUTATIONS)


def test_the_bases_themselves_reach_the_launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The campaign's baseline: both base configs pass every check and get as far as launching."""
    launched: list[list[str]] = []
    monkeypatch.setattr(launch, "run_local", lambda n, m, child: launched.append(child) or 0)
    hf_dir = tmp_path / "hf" / "model"
    shutil.copytree(FIXTURE, hf_dir)
    for name, doc in _bases(hf_dir).items():
        rc, err = _run(Case(name, name, doc, ""), tmp_path)
        assert rc == 0, f"{name}: {err}"
    assert len(launched) == 2
