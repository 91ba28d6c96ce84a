"""`gke-tpu-rl plan` and `gke-tpu-rl train` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from infra import cli
from infra.base.stack_file import available_envs
from tests.infra.conftest import ENVIRONMENTS, ROOT, new_env_name, scratch_root, stack_config

GOLDEN = ROOT / "tests" / "golden"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # ENV resolves to environments/Pulumi.ENV.yaml under the repo root


def _write_config(path: Path, config: dict[str, object]) -> Path:
    path.write_text(yaml.safe_dump({"config": config}))
    return path


def test_plan_text_shows_summary_tree_and_outputs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "staging"]) == 0
    out = capsys.readouterr().out
    assert "plan: staging" in out
    assert "TPU: 2 slices, 8 hosts, 32 chips (v6e: 32)" in out
    assert "v6e-stg-1  gcp:container/nodePool:NodePool" in out
    assert "kubeconfig: [secret]" in out


def test_plan_markdown_matches_the_golden_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "dev", "--format", "markdown"]) == 0
    assert capsys.readouterr().out == (GOLDEN / "plan-dev.md").read_text()


def test_plan_out_writes_objects_and_resources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "staging", "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "resources.json" in names and "plan.md" in names
    assert "jobset-grpo-stg.yaml" in names and "resourceclaimtemplate-grpo-stg-netdev.yaml" in names
    jobset = yaml.safe_load((tmp_path / "jobset-grpo-stg.yaml").read_text())
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["spec"]["replicatedJobs"][0]["replicas"] == 2
    doc = json.loads((tmp_path / "resources.json").read_text())
    assert len([n for n in names if n.endswith(".yaml")]) == len(
        [r for r in doc["resources"] if r["type"].startswith("kubernetes:") and r["custom"]
         and not r["type"].startswith("kubernetes:helm.sh/")])
    assert "wrote" in capsys.readouterr().err


def test_plan_all_plans_every_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # A project whose environments/ holds the shipped environments and one a user added: --all plans every file there.
    # (The cwd stays this checkout: the image's build context is a path relative to it.)
    new = new_env_name()
    project = scratch_root(tmp_path / "project", {new: "dev"})
    monkeypatch.setattr("infra.base.stack_file.repo_root", lambda start=None: project)
    envs = sorted([*ENVIRONMENTS, new])
    out_dir = tmp_path / "out"
    assert cli.main(["plan", "--all", "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    for env in envs:
        assert f"plan: {env}" in out
        assert (out_dir / env / "resources.json").is_file()
    for env in ENVIRONMENTS:  # the shipped ones are the reviewed golden plans
        assert (out_dir / env / "plan.md").read_text() == (GOLDEN / f"plan-{env}.md").read_text()
    assert cli.main(["plan", "--format", "markdown"]) == 0  # ENV omitted: all of them too, in name order
    assert capsys.readouterr().out == "\n".join((out_dir / env / "plan.md").read_text() for env in envs)


def test_config_file_plans_any_stack_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = stack_config("dev")
    config["gke-tpu-rl:slices"] = [{"name": "v5e-x", "tpuType": "v5litepod", "topology": "2x4", "count": 3}]
    config["gke-tpu-rl:trainer"] = {"slices": 3}
    path = _write_config(tmp_path / "Pulumi.scratch.yaml", config)
    assert cli.main(["plan", "--config-file", str(path), "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("### gke-tpu-rl plan: `scratch`")  # the stack name comes from the file name
    assert "| v5e-x | v5e | 2x4 | ct5lp-hightpu-8t | 3 | 1 | 8 | 8 | 24 | on-demand |" in out
    assert cli.main(["plan", "other", "--config-file", str(path)]) == 0
    assert "plan: other" in capsys.readouterr().out


def test_bad_config_exits_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = stack_config("staging")
    config["gke-tpu-rl:slices"] = [{**config["gke-tpu-rl:slices"][0], "topology": "4x3"}]
    path = _write_config(tmp_path / "bad.yaml", config)
    assert cli.main(["plan", "staging", "--config-file", str(path), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert "gke-tpu-rl:slices[0].topology" in captured.err and "'4x3'" in captured.err
    assert "allowed: 1x1, 2x2, 2x4, 4x4" in captured.err
    assert "Traceback" not in captured.err + captured.out
    assert captured.out == ""
    assert not (tmp_path / "out").exists()


def test_unknown_environment_and_unreadable_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unknown = new_env_name()
    assert cli.main(["plan", unknown]) == 2
    err = capsys.readouterr().err
    assert f"no stack config for environment {unknown!r}" in err
    assert f"(environments: {', '.join(available_envs(ROOT))})" in err  # every file there, a user's own included
    assert all(env in available_envs(ROOT) for env in ENVIRONMENTS)
    (tmp_path / "broken.yaml").write_text("config: [unclosed\n")
    assert cli.main(["plan", "--config-file", str(tmp_path / "broken.yaml")]) == 2
    assert "is not valid YAML: " + str(tmp_path / "broken.yaml") + ":2:" in capsys.readouterr().err
    assert cli.main(["plan", "--config-file", str(tmp_path / "absent.yaml")]) == 2
    assert "cannot read stack config" in capsys.readouterr().err


def test_plain_secret_in_a_config_file_is_still_masked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token = "hf_CLI_PLAINTEXT_TOKEN_42"
    path = _write_config(tmp_path / "Pulumi.staging.yaml", {**stack_config("staging"), "gke-tpu-rl:hfToken": token})
    out_dir = tmp_path / "out"
    assert cli.main(["plan", "--config-file", str(path), "--out", str(out_dir)]) == 0
    assert token not in capsys.readouterr().out
    assert all(token not in p.read_text() for p in out_dir.iterdir())


def test_train_passes_the_rest_of_argv_to_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.run.cli

    seen: list[list[str]] = []

    def fake_main(argv: list[str] | None = None) -> int:
        seen.append(list(argv or []))
        return 7

    monkeypatch.setattr(trainer.run.cli, "main", fake_main)
    assert cli.main(["train", "--local-processes", "2", "--set", "steps=1"]) == 7
    assert seen == [["--local-processes", "2", "--set", "steps=1"]]


def test_export_passes_the_rest_of_argv_to_the_trainers_export(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.run.export

    seen: list[list[str]] = []

    def fake_main(argv: list[str] | None = None, prog: str = "") -> int:
        seen.append(list(argv or []))
        return 5

    monkeypatch.setattr(trainer.run.export, "main", fake_main)
    assert cli.main(["export", "runs/my", "--out", "m", "--lora", "adapter"]) == 5
    assert seen == [["runs/my", "--out", "m", "--lora", "adapter"]]


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    assert cli.main(["plan", "--all", "--config-file", "x.yaml"]) == 2
    assert "do not go together" in capsys.readouterr().err


def test_synth_all_names_every_refused_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Two broken stack files: `synth --all` says what is wrong with each before it stops, not the first alone."""
    root = scratch_root(tmp_path / "project")
    for env in ("dev", "prod"):
        path = root / "environments" / f"Pulumi.{env}.yaml"
        doc = yaml.safe_load(path.read_text())
        doc["config"]["gke-tpu-rl:region"] = "us-eest5"
        path.write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(root)
    assert cli.main(["synth", "--all", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "environment 'dev'" in err and "environment 'prod'" in err and err.count("'us-eest5' is not") == 2
    assert not (tmp_path / "out").exists()
