"""`fit --search`: real libtpu compiles of a small model against a small HBM limit (a Target's catalog figure below
libtpu's own limit is the one that counts), so every compile takes seconds."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import pytest

from trainer.base.config import config_from_dict, resolve_mesh
from trainer.fit import preflight as F
from trainer.fit.advice import with_settings
from trainer.fit.search import AFFECTS, PRECISION, SearchResult, search

MiB = 1 << 20
# An update of 256-token rows needs ~19 MiB per chip as given and ~9 MiB in micro-batches of 16 rows; sampling ~6.
SMALL_HBM = F.Target("v5e", "2x2", 1, 4, 11 * MiB, 197e12, 819e9)
MODEL = {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "d_ff": 128,
         "max_seq_len": 512, "param_dtype": "float32"}
SEARCHED = {"compute.remat", "compute.train_micro_batch_size", "compute.logprob_chunk", "sampling.max_num_sequences",
            "sampling.gather_weights", *PRECISION}


def _cfg() -> Any:
    # XLA attention: the figures above are the search's scenario, not the kernel's (whose 16-wide heads pad to 128).
    return config_from_dict({"model": MODEL, "rl": {"group_size": 8, "prompts_per_step": 8},
                             "sampling": {"max_new_tokens": 128, "max_prompt_len": 128},
                             "compute": {"attention": "xla"}})


def _search(budget: int) -> tuple[SearchResult, list[str]]:
    said: list[str] = []
    return search(_cfg(), SMALL_HBM, title="small", budget=budget, progress=said.append), said


@pytest.fixture(scope="module")
def found() -> tuple[SearchResult, list[str]]:
    return _search(12)


def test_the_printed_settings_fit_when_fed_back_to_fit(found: tuple[SearchResult, list[str]]) -> None:
    result, said = found
    assert not result.base.fits and result.base.status(result.base.program("update")) == "does not fit"
    assert result.found and result.settings and result.report is not None
    assert {s.split("=", 1)[0] for s in result.settings} <= SEARCHED  # never the batch, optimizer or model
    assert result.compiles == sum(m.startswith("compiling ") for m in said) <= 12
    assert result.attempts[0].program == "" and result.attempts[-1].status in ("fits", "tight")
    assert result.flags() == " ".join(f"--set {s}" for s in result.settings)
    # A fresh fit (no cache) of the config with the printed settings: it fits, with the figures the search saw. (Its
    # sampler timed as the search times it: the phases' compiles price time, not memory.)
    again = F.fit(with_settings(_cfg(), result.settings), SMALL_HBM, title="again", phases=False)
    assert again.fits and not any(p.reused for p in again.programs)
    assert again.program("update").peak == result.report.program("update").peak
    lines = result.lines()
    assert lines[0].startswith(f"search: found settings that fit in {result.compiles} compiles (budget 12)")
    assert lines[1] == f"  {result.flags()}"
    assert result.to_json()["settings"] == result.settings and result.to_json()["found"] is True


@pytest.mark.parametrize("budget", [1, 2])
def test_a_budget_of_n_compiles_is_respected(budget: int) -> None:
    result, said = _search(budget)
    assert result.compiles == sum(m.startswith("compiling ") for m in said) == budget
    assert not result.found and result.report is None and not result.settings
    assert "the budget of" in result.reason and result.lines()[0].startswith("search: nothing found that fits")
    assert result.lines()[-1].startswith("  1. the config as given: ")  # nothing else was compiled
    update = result.base.status(result.base.program("update"))
    # One compile: the sampler only; the update is reported not compiled, and the step gets no time or MFU.
    assert update == ("not compiled" if budget == 1 else "does not fit")
    assert result.base.not_applicable() == ("update not compiled" if budget == 1 else "update does not fit")
    # The progress says so as it happens, not only the report.
    assert any(m.startswith("skipping update: the compile budget is spent (") for m in said) == (budget == 1)


def _lowered(cfg: Any) -> dict[str, str]:
    F.prepare_environment(SMALL_HBM)
    from trainer.model.sharding import make_mesh
    from trainer.rl.step import abstract_args, build_programs

    cfg = resolve_mesh(cfg, 4, exact=True)
    mesh = make_mesh(1, 4, 1, F.topology_devices(SMALL_HBM))
    programs = build_programs(cfg, mesh, 0, 1)
    args = abstract_args(cfg, programs, 1)
    with jax.set_mesh(mesh):
        return {name: hashlib.sha256(getattr(programs, name).lower(*args[name]).as_text().encode()).hexdigest()
                for name in F.PROGRAMS}


def test_each_searched_setting_changes_only_the_programs_it_names() -> None:
    """What makes a candidate cost one compile: the other programs' lowered text, the cache's key, is unchanged."""
    small = {"model": {**MODEL, "max_seq_len": 64}, "rl": {"group_size": 4, "prompts_per_step": 4, "kl_beta": 0.1},
             "sampling": {"max_new_tokens": 16, "max_prompt_len": 16}, "compute": {"train_micro_batch_size": 8}}
    base = _lowered(config_from_dict(small))
    other = {"compute.remat": "full", "compute.train_micro_batch_size": 4, "compute.grad_accum_dtype": "bfloat16",
             "compute.logprob_chunk": 8, "sampling.max_num_sequences": 8, "sampling.gather_weights": True,
             "compute.dtype": "bfloat16", "compute.param_dtype": "bfloat16"}
    assert set(other) == set(AFFECTS)
    for key, value in other.items():
        section, name = key.split(".")
        changed = _lowered(config_from_dict({**small, section: {**small.get(section, {}), name: value}}))
        assert {p for p in F.PROGRAMS if changed[p] != base[p]} == set(AFFECTS[key]), key
