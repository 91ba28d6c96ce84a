"""`gke-tpu-rl fit` and `plan --fit` as a user runs them: real libtpu compiles of small models, bad input named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from envspec.config import ConfigError
from infra import cli
from tests.infra.conftest import ROOT

TINY_HF = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 384,
           "max_position_embeddings": 64, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
           "rms_norm_eps": 1e-6, "rope_theta": 1000000}
SMALL_STEP = ["--set", "sampling.max_prompt_len=16", "--set", "sampling.max_new_tokens=16", "--set",
              "rl.prompts_per_step=4", "--set", "compute.logprob_chunk=8"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint directory holding only config.json: all `fit` reads of a checkpoint."""
    path = tmp_path / "tiny-qwen3"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_HF))
    return path


def _compile_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's fit compiles on its first call only; later calls render that report (other formats, same job)."""
    reports: list[Any] = []
    real_run_fit = cli._run_fit
    monkeypatch.setattr(cli, "_run_fit", lambda job, model=None: reports[0] if reports else
                        reports.append(real_run_fit(job, model)) or reports[0])


def _run_yaml(path: Path, model: dict | None = None, **sections: dict) -> Path:
    doc = {"model": {"vocab_size": 512, "d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                     "head_dim": 32, "d_ff": 384, "max_seq_len": 64, **(model or {})},
           "rl": {"group_size": 4, "prompts_per_step": 4}, "sampling": {"max_new_tokens": 8, "max_prompt_len": 16}}
    for k, v in sections.items():
        doc[k] = {**doc.get(k, {}), **v}
    path.write_text(yaml.safe_dump(doc))
    return path


def test_fit_dev_compiles_the_environments_trainer(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _compile_once(monkeypatch)
    # dev's trainer config, slice group and JobSet mesh; the checkpoint path swapped for a small model.
    args = ["fit", "dev", "--set", f"init.path={tiny_checkpoint}", *SMALL_STEP]
    assert cli.main(args) == 0
    out, err = capsys.readouterr()
    # dev runs on Ray down to 1 slice with the global batch kept: the fit is checked at that smallest size.
    assert "fit: dev (trainer grpo-dev, config qwen3-0.6b-grpo-v6e-2x2.yaml, at Ray's minimum of 1 slice)" in out
    assert "1 x v6e 2x2: 4 chips, 32.00 GiB HBM" in out and "mesh slices=1 x fsdp=4 x tensor=1" in out
    assert "skipped: rl.kl_beta = 0" in out and "MFU" in out
    assert "compiling sample for 1 x v6e 2x2 (1/3)" in err and "Traceback" not in err
    # Every program is counted aloud, the one not compiled too (issue 42: "(2/3)" went missing).
    assert "skipping ref_logprobs: rl.kl_beta = 0, no reference policy (2/3)" in err
    assert "could not determine TPU" not in err  # libtpu's no-TPU warnings are silenced

    assert cli.main([*args, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["target"]["tpu_type"] == "v6e" and doc["target"]["chips"] == 4
    assert doc["mesh"] == {"slices": 1, "fsdp": 4, "tensor": 1}
    assert doc["model"].startswith("tiny-qwen3") and doc["param_dtype"] == "float32"  # compute.param_dtype wins
    assert [p["status"] for p in doc["programs"]] == ["fits", "skipped", "fits"]


def test_fit_a_config_alone_on_several_slices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run_yaml(tmp_path / "run.yaml")
    assert cli.main(["fit", "--config", str(run), "--tpu", "v5e:2x2", "--slices", "2", "--set", "rl.kl_beta=0.1",
                     "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert md.startswith(f"### gke-tpu-rl fit: {run} on 2 x v5e 2x2")
    assert "2 x v5e 2x2: 8 chips, 16.00 GiB HBM" in md and "mesh slices=2 x fsdp=4 x tensor=1" in md
    assert "| ref_logprobs |" in md and "skipped" not in md


def test_an_oversized_config_is_refused_naming_the_program_and_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # ~8.6 B float32 params, nearly all in a 1M-token embedding and head: with Adam's moments ~24 GiB of state per
    # v5e chip (16 GiB). One layer and short sequences keep the compile to seconds.
    run = _run_yaml(tmp_path / "big.yaml", {"vocab_size": 1 << 20, "d_model": 4096, "n_layers": 1, "n_heads": 32,
                                            "n_kv_heads": 8, "head_dim": 128, "d_ff": 4096, "tie_embeddings": False})
    _compile_once(monkeypatch)
    assert cli.main(["fit", "--config", str(run), "--tpu", "v5e:2x2", "--format", "json"]) == cli.EXIT_NO_FIT
    out, err = capsys.readouterr()
    assert json.loads(out)["fits"] is False
    assert "error: update does not fit: needs" in err and "per chip, 15.75 GiB usable (libtpu)" in err
    assert "compute.remat=full" in err and "compute.param_dtype=bfloat16" in err and "more chips" in err
    # Every suggestion carries its estimated saving; the step gets no MFU.
    advice = [line for line in err.splitlines() if line.startswith("  - ")]
    assert advice and all("estimated" in line for line in advice) and "saves ~" in err
    # The text report carries the same errors; stderr then only names the programs.
    assert cli.main(["fit", "--config", str(run), "--tpu", "v5e:2x2"]) == cli.EXIT_NO_FIT
    out, err = capsys.readouterr()
    assert "error: update does not fit: needs" in out and "- compute.remat=full" in out
    assert err.splitlines()[-2].startswith("error: does not fit on 1 x v5e 2x2: ") and "update" in err
    assert err.splitlines()[-1].startswith("hint: `gke-tpu-rl fit ... --search` compiles candidate settings")


def _small_chip_search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[str]]:
    """A 13 MiB chip: the 256-token update of this small model needs ~26 MiB per chip as given, so the search has
    something to solve at compiles of seconds. Everything else is the real CLI, catalog and libtpu."""
    import dataclasses

    from infra.base import pod_config

    real_target = pod_config.target
    monkeypatch.setattr(pod_config, "target", lambda shape, slices: dataclasses.replace(
        real_target(shape, slices), hbm_bytes_per_chip=13 << 20))
    run = _run_yaml(tmp_path / "run.yaml", {"d_model": 64, "head_dim": 16, "d_ff": 128, "max_seq_len": 512},
                    rl={"group_size": 8, "prompts_per_step": 8},
                    sampling={"max_new_tokens": 128, "max_prompt_len": 128})
    return run, ["fit", "--config", str(run), "--tpu", "v5e:2x2"]


@pytest.mark.long  # the search itself is proven in-process (tests/trainer/test_fit_search.py); this is its CLI
def test_fit_search_prints_settings_that_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run, args = _small_chip_search(tmp_path, monkeypatch)
    assert cli.main([*args, "--search", "--budget", "6"]) == 0
    out, err = capsys.readouterr()
    assert "search: found settings that fit in " in out and "(budget 6)" in out
    flags = next(line.split() for line in out.splitlines() if line.startswith("  --set "))
    assert flags[::2] == ["--set"] * (len(flags) // 2)
    assert f"fit: {run} on 1 x v5e 2x2, with {' '.join(flags[1::2])}" in out  # the report is the fitting config's
    assert "MFU ~" in out and "0.01 GiB HBM (catalog)" in out
    assert sum(line.startswith("compiling ") for line in err.splitlines()) <= 6
    # Fed back to fit, those flags fit.
    assert cli.main([*args, *flags, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["mfu"] > 0 and doc["share_of"] == "0.01 GiB HBM (catalog) per chip"


def test_fit_search_that_finds_nothing_exits_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _, args = _small_chip_search(tmp_path, monkeypatch)
    # Nothing fits in one compile: exit 3, saying what was tried, with the config as given reported.
    assert cli.main([*args, "--search", "--budget", "1", "--format", "json"]) == cli.EXIT_NO_FIT
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["fits"] is False and doc["mfu"] is None and doc["search"]["found"] is False
    assert doc["search"]["compiles"] == 1 and doc["search"]["reason"] == "the budget of 1 compiles is spent"
    assert "error: search: nothing found that fits in 1 compile (budget 1)" in err


# ---------------------------------------------------------------------------------------------- a service environment


def estimate_service(job: Any, model: str | None = None) -> Any:
    """A service engine's fit from the analytic model alone (trainer/fit/estimate.py: service_passes,
    service_memory, service_flops), in seconds and without libtpu: the same passes and report as
    trainer.fit.preflight.fit_service, each program's memory the estimate instead of the compiler's figures, against the
    catalog's HBM (libtpu's usable share, e.g. 31.25 of a v6e chip's 32 GiB, is only known by compiling), times from
    peak FLOP/s and HBM bandwidth. `fit` (the compile) is the proof; this stands in for it in these tests."""
    from trainer.base.config import ConfigError as TrainerConfigError
    from trainer.base.config import resolve_mesh
    from trainer.fit import estimate as E
    from trainer.fit.flops import param_count
    from trainer.fit.preflight import _estimate_service_times, resolve_model
    from trainer.fit.report import FitReport, ProgramFit, ServiceFit

    cfg, source = resolve_model(job.cfg, model)
    if cfg.service is None or cfg.lora is None:
        raise ConfigError(f"{job.title}: the estimate sizes a service config (service and lora sections)")
    t = job.target
    devices = t.chips * (2 if t.tpu_type == "tpu7x" else 1)  # Ironwood shows two devices per chip to JAX
    try:
        cfg = resolve_mesh(cfg, devices, exact=True)
    except TrainerConfigError as err:
        raise ConfigError(f"{err} (the {devices} devices of {t.label})") from None
    lay = E.Layout.of(cfg)
    passes = E.service_passes(cfg, lay.data)
    st = E.service_state(cfg, lay)
    adam = "Adam m and v of the adapter stack (2 x float32 stacks)"
    programs = []
    for ps in passes:
        executed, model_flops = E.service_flops(cfg, ps)
        mem = E.service_memory(cfg, "forward_backward", ps, lay)
        # Arguments: the base, the adapter weights and the gradient accumulator; Adam's moments stay resident.
        programs.append(ProgramFit(ps.name, argument=int(st.base + 2 * st.stack), temp=int(mem.temp),
                                   resident=int(2 * st.stack), resident_what=adam, flops=executed,
                                   model_flops=model_flops))
    programs.append(ProgramFit("optim_step", argument=int(st.adapters), resident=int(st.base),
                               resident_what="the frozen base weights"))
    _estimate_service_times(t, devices, int(st.stack), programs)
    m, svc = cfg.model_cfg, cfg.service
    return FitReport(
        title=f"{job.title}, estimated", target=t, model=source, params=param_count(m), param_dtype=m.param_dtype,
        compute_dtype=cfg.compute_dtype, mesh={k: getattr(cfg.mesh, k) for k in ("slices", "fsdp", "tensor")},
        batch=max(ps.rows for ps in passes), prompt_len=passes[-1].length, new_tokens=0, devices=devices,
        programs=programs, hbm_usable=None,
        service=ServiceFit(
            base_model=svc.base_model, slots=cfg.lora.slots, rank=cfg.lora.rank, max_batch_tokens=svc.max_batch_tokens,
            min_bucket=svc.min_bucket, data_parallel=lay.data, context=m.max_seq_len,
            longest_datum=E.service_longest_datum(cfg, lay.data), passes={ps.name: ps.kind for ps in passes},
            base=int(st.base), stack=int(st.stack), stack_params=st.stack_params, base_estimate=int(st.base),
            stack_estimate=int(st.stack)))



def _estimate_instead_of_compiling(monkeypatch: pytest.MonkeyPatch) -> list:
    """`fit ENV` compiles with libtpu (Qwen3-8B's engine: minutes here); the analytic estimate of the same passes
    (estimate_service below) stands in for the compile. Returns the jobs the CLI asked for."""

    seen: list = []
    monkeypatch.setattr(cli, "_run_fit", lambda job, model=None: seen.append(job) or
                        estimate_service(job, model))
    return seen


def test_fit_tinker_sizes_the_service_engine_on_the_service_slice_group(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # tinker has no trainer (trainer.enabled: false): fit checks service.config on service.sliceGroup.
    seen = _estimate_instead_of_compiling(monkeypatch)
    assert cli.main(["fit", "tinker"]) == 0
    out, err = capsys.readouterr()
    job = seen[0]
    assert job.title == "tinker (service tinker engine on v6e-svc, config qwen3-8b-service-v6e-4x4.yaml)"
    assert (job.target.tpu_type, job.target.topology, job.target.slices, job.target.chips) == ("v6e", "4x4", 1, 16)
    assert job.cfg.service is not None and job.cfg.service.base_model == "Qwen/Qwen3-8B"
    assert job.cfg.lora is not None and (job.cfg.lora.slots, job.cfg.lora.rank) == (16, 32)
    # Loaded from the engine pod's own arguments (workloads.service.engine_args): weights on the bucket's mount,
    # sized here from the bundled Qwen3-8B config.json of the same name.
    assert job.cfg.init.path == "/checkpoints/tinker/models/Qwen3-8B" and job.cfg.mesh.slices == 1
    assert "model: Qwen3-8B (bundled config.json" in out
    assert "fit: tinker (service tinker engine on v6e-svc" in out and "1 x v6e 4x4: 16 chips, 32.00 GiB HBM" in out
    assert "mesh slices=1 x fsdp=4 x tensor=4" in out and "the service fits 1 x v6e 4x4" in out
    assert "Traceback" not in err

    assert cli.main(["fit", "tinker", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["mesh"] == {"slices": 1, "fsdp": 4, "tensor": 4}
    assert doc["service"]["slots"] == 16 and doc["service"]["longest_datum"] == 4096
    names = [p["name"] for p in doc["programs"]]
    assert names[0] == "forward_backward 512x32" and names[-2:] == ["forward_backward 4x4096", "optim_step"]
    # The config's own header: 12.47 GiB peak per chip compiled (libtpu) of 31.25 usable; the estimate is close.
    peak = max(p["peak"] for p in doc["programs"])
    assert 10 << 30 < peak < 14 << 30 and all(p["status"] == "fits" for p in doc["programs"])


def test_fit_tinker_applies_service_args_then_set_and_reports_a_service_that_does_not_fit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    raw = yaml.safe_load((ROOT / "environments" / "Pulumi.tinker.yaml").read_text())
    raw["config"]["gke-tpu-rl:service"]["args"] = ["--set", "service.max_batch_tokens=8192"]
    stack = tmp_path / "Pulumi.tinker.yaml"
    stack.write_text(yaml.safe_dump(raw))
    seen = _estimate_instead_of_compiling(monkeypatch)
    assert cli.main(["fit", "--config-file", str(stack), "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert seen[-1].cfg.service.max_batch_tokens == 8192 and doc["service"]["max_batch_tokens"] == 8192
    assert doc["service"]["longest_datum"] == 2048  # 4 data-parallel rows of the longest bucket in 8192 tokens

    # 256 slots of rank 32: four float32 adapter stacks of ~22 GiB per chip cannot fit a v6e chip.
    assert cli.main(["fit", "--config-file", str(stack), "--set", "lora.slots=256"]) == cli.EXIT_NO_FIT
    out, err = capsys.readouterr()
    assert "the service does not fit 1 x v6e 4x4" in out and "does not fit on 1 x v6e 4x4" in err
    assert "--search" not in err  # search refuses service configs: no hint to run it


def test_fit_of_an_environment_without_trainer_or_service_says_so(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    raw = yaml.safe_load((ROOT / "environments" / "Pulumi.tinker.yaml").read_text())
    del raw["config"]["gke-tpu-rl:service"]
    stack = tmp_path / "Pulumi.idle.yaml"
    stack.write_text(yaml.safe_dump(raw))
    assert cli.main(["fit", "--config-file", str(stack)]) == cli.EXIT_CONFIG
    assert "trainer.enabled is false and there is no service; there is no trainer to fit" in capsys.readouterr().err


BAD = [
    (["--config", "run.yaml", "--tpu", "v9:2x2"],
     "--tpu 'v9:2x2': unknown TPU type 'v9'; allowed: tpu7x, v4, v5e, v5p, v6e"),
    (["--config", "run.yaml", "--tpu", "v6e:4x3"],
     "--tpu 'v6e:4x3': topology '4x3' is not valid for v6e; allowed: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8"),
    (["--config", "run.yaml", "--tpu", "v6e"], "--tpu 'v6e': expected TYPE:TOPOLOGY such as v6e:4x4"),
    (["--config", "run.yaml", "--tpu", "v6e:2x2", "--slices", "0"], "--slices 0: must be 1 or more"),
    (["--config", "run.yaml"], "fit needs ENV, or --config YAML with --tpu TYPE:TOPOLOGY"),
    ([], "fit needs ENV"),
    (["dev", "--tpu", "v6e:2x2"], "--tpu and --slices go with --config alone"),
    (["nope"], "no stack config for environment 'nope'"),
    (["dev", "--model", "gpt-5"], "--model 'gpt-5': not a bundled model; choose one of: Llama-3.1-70B, "),
    (["--config", "absent.yaml", "--tpu", "v6e:2x2"], "cannot read config absent.yaml"),
    (["--config", "run.yaml", "--tpu", "v6e:2x2", "--budget", "4"], "--budget goes with --search"),
    (["--config", "run.yaml", "--tpu", "v6e:2x2", "--search", "--budget", "0"], "--budget 0: must be 1 or more"),
    (["--config", "run.yaml", "--tpu", "v6e:2x2", "--set", "mesh.tensor=3"],
     "mesh.fsdp=-1 cannot be inferred: 4 devices are not divisible by the other axes' product 3"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(b[0]) or "nothing" for b in BAD])
def test_bad_input_exits_2_naming_the_flag(args: list[str], message: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _run_yaml(tmp_path / "run.yaml")
    monkeypatch.chdir(tmp_path)  # run.yaml resolves here; environments/ through --config-file below
    if args and args[0] in ("dev", "nope"):
        args = ["--config-file", str(ROOT / "environments" / f"Pulumi.{args[0]}.yaml"), *args[1:]] \
            if args[0] == "dev" else args
    assert cli.main(["fit", *args]) == cli.EXIT_CONFIG
    out, err = capsys.readouterr()
    assert message in err and "Traceback" not in err and out == ""


# ---------------------------------------------------------------------------------------------- plan --fit


@pytest.fixture(scope="module")
def small_report():  # noqa: ANN201 - trainer.fit.preflight.FitReport
    from trainer.base.config import load_config
    from trainer.fit.preflight import Target, fit

    path = Path(__file__).parent / "_fit_small.yaml"
    try:
        _run_yaml(path)
        cfg = load_config(str(path), ["mesh.fsdp=-1"])
    finally:
        path.unlink(missing_ok=True)
    # Its programs alone (no sampler phases): plan renders the report's summary; fit's pricing is tested in trainer/.
    return fit(cfg, Target("v6e", "2x2", 1, 4, 32 << 30, 918e12, 1638e9), title="dev (stand-in)", phases=False)


def test_plan_fit_adds_the_summary_to_text_and_markdown(small_report, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    seen = []
    monkeypatch.setattr(cli, "_run_fit", lambda job, model=None: seen.append(job) or small_report)
    assert cli.main(["plan", "dev", "--fit"]) == 0
    out = capsys.readouterr().out
    assert out.index("plan: dev") < out.index("fit: dev (stand-in)") and "MFU" in out
    job = seen[0]  # what `fit dev` would compile: the environment's trainer, as its JobSet runs it
    assert job.title == "dev (trainer grpo-dev, config qwen3-0.6b-grpo-v6e-2x2.yaml, at Ray's minimum of 1 slice)"
    assert (job.target.slices, job.cfg.mesh.slices) == (1, 1)
    assert (job.target.label, job.cfg.mesh.slices, job.cfg.mesh.fsdp, job.cfg.steps) == ("1 x v6e 2x2", 1, -1, 200)
    assert cli.main(["plan", "dev", "--fit", "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert "#### gke-tpu-rl fit: dev (stand-in)" in md and md.index("#### gke-tpu-rl fit") < md.index("Resource tree")


def test_plan_fit_exits_3_when_a_program_does_not_fit(small_report, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import copy

    failing = copy.deepcopy(small_report)
    failing.programs[-1].temp = 64 << 30
    monkeypatch.setattr(cli, "_run_fit", lambda job, model=None: failing)
    assert cli.main(["plan", "dev", "--fit"]) == cli.EXIT_NO_FIT
    assert "error: dev: does not fit on 1 x v6e 2x2: update" in capsys.readouterr().err
    assert cli.main(["plan", "dev", "--fit", "--format", "markdown"]) == cli.EXIT_NO_FIT
    out, err = capsys.readouterr()
    assert "**Does not fit:**" in out and "error: dev: update does not fit: needs" in err


def test_plan_without_fit_never_imports_jax() -> None:
    code = ("import sys, contextlib, io; from infra.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): rc = main(['plan', 'dev']) or main(['plan', 'staging'])\n"
            "assert rc == 0 and 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
