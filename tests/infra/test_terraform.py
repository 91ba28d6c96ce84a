"""`gke-tpu-rl synth`: the Pulumi program's resources as Terraform, through the pinned cdktf bindings.

The synth tests run infra/terraform/cdktf_app.py in the cdktf venv `make install` builds ($(VENV)/cdktf): the bindings'
own constructors check every argument's name and type. The real Terraform CLI then loads every stack: `terraform init
-backend=false` checks the whole configuration before it looks for providers, and `terraform console` evaluates the
preconditions and validations. `validate` and `plan` cannot run here (they need the providers, which are not
downloadable); tests/infra/test_terraform_parity.py compares what is written with the Pulumi plan, and the checkov
test scans it.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from envspec.sections.cluster import gke_version_tuple
from infra.offline.mockrun import IMAGE_TYPE
from infra.offline.plan import is_kubernetes_object
from infra.terraform import synth
from infra.terraform.document import (
    GCP_TYPES,
    HELM_TYPE,
    HF_TOKEN_VAR,
    IMAGE_DIGEST_VAR,
    STAGES,
    Synthesis,
    synthesize,
    tf_name,
)
from tests.infra.conftest import ENVIRONMENTS, ROOT, stack_config

GOLDEN = ROOT / "tests" / "golden" / "terraform"
# A user's own environment: a shipped one copied under another stack name and project, with its store unprotected
# (no prevent_destroy), synthesized with the shipped ones in the same cdktf run.
USER_COPY = ("qa", "tinker", {"gke-tpu-rl:project": "acme-rl-qa", "gke-tpu-rl:storage": {"protect": False}})
GOOGLE_CONSTRAINT = ">= 7.22, < 8.0"  # review 2026-11-28 #13: data_api_access arrived in 7.22.0
# What `terraform init` says when it has loaded the configuration and cannot get a provider: the only error allowed.
PROVIDER_DOWNLOAD = "Failed to query available provider packages"


def strip_metadata(value: Any) -> Any:
    """cdk.tf.json without cdktf's "//" notes (construct paths), which say nothing Terraform reads."""
    if isinstance(value, dict):
        return {k: strip_metadata(v) for k, v in value.items() if k != "//"}
    if isinstance(value, list):
        return [strip_metadata(v) for v in value]
    return value


def golden_path(env: str, stack: str) -> Path:
    return GOLDEN / env / f"{stack}.cdk.tf.json"


@pytest.fixture(scope="module")
def syntheses() -> dict[str, Synthesis]:
    return {env: synthesize(env, stack_config(env)) for env in ENVIRONMENTS}


@pytest.fixture(scope="module")
def user_copy() -> Synthesis:
    name, source, changes = USER_COPY
    return synthesize(name, {**stack_config(source), **changes})


# A Namespace annotation holding Terraform's template sequences (test_strings_reach_terraform_as_written_...).
TEMPLATE_TEXT = 'echo "${HOME}" %{if x}y%{endif} $$PATH'


@pytest.fixture(scope="module")
def escapes() -> tuple[dict[str, Any], str]:
    """staging's document as env "escapes": an HF token set, and TEMPLATE_TEXT on its Namespace; with the
    Namespace's resource name. `synthesized` synthesizes it in the one cdktf run it makes for every document (each
    run starts a jsii/Node process: ~15 CPU-s, nearly all of it loading the provider bindings)."""
    config = {**stack_config("staging"), "gke-tpu-rl:hfToken": {"secure": "AAABAGVuY3J5cHRlZA=="}}
    doc = synthesize("staging", config).document
    doc["env"] = "escapes"
    [ns] = [e for e in doc["stacks"]["workloads"]["resources"]
            if e["type"] == "kubernetes_manifest" and e["args"]["manifest"]["kind"] == "Namespace"]
    ns["args"]["manifest"]["metadata"]["annotations"] = {"note": TEMPLATE_TEXT}
    return doc, ns["name"]


@pytest.fixture(scope="module")
def refused(syntheses: dict[str, Synthesis]) -> dict[str, dict[str, Any]]:
    """Two copies of staging's document the bindings must refuse, by env name: "unknown" sets an argument the
    bindings do not have (placementPolicy.tpuTopologee), "typed" one of the wrong type (nodeCount ["four"])."""
    unknown = copy.deepcopy(syntheses["staging"].document)
    unknown["env"] = "unknown"
    pool = next(e for e in unknown["stacks"]["gcp"]["resources"] if e["type"] == "google_container_node_pool"
                and "placementPolicy" in e["args"])
    pool["args"]["placementPolicy"]["tpuTopologee"] = "4x4"
    typed = copy.deepcopy(syntheses["staging"].document)
    typed["env"] = "typed"
    pool = next(e for e in typed["stacks"]["gcp"]["resources"] if e["type"] == "google_container_node_pool")
    pool["args"]["nodeCount"] = ["four"]
    return {"unknown": unknown, "typed": typed}


@pytest.fixture(scope="module")
def synthesized(syntheses: dict[str, Synthesis], user_copy: Synthesis, escapes: tuple[dict[str, Any], str],
                refused: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One cdktf run over every document of this module, the refused ones last (cdktf_app renders each document,
    a refused one too, and names each refused one): its output folder and its error."""
    out = tmp_path_factory.mktemp("synth")
    with pytest.raises(synth.SynthError) as err:
        synth.write([*(s.document for s in syntheses.values()), user_copy.document, escapes[0],
                     *refused.values()], out)
    return out, str(err.value)


@pytest.fixture(scope="module")
def written(synthesized: tuple[Path, str], refused: dict[str, dict[str, Any]]) -> Path:
    out, error = synthesized
    named = re.findall(r"^gke-tpu-rl synth (\S+): ", error, flags=re.M)
    assert named == list(refused), f"cdktf refused other documents than {list(refused)}:\n{error}"
    return out


def _stack(out: Path, env: str, stack: str) -> dict[str, Any]:
    return json.loads((out / env / "stacks" / stack / "cdk.tf.json").read_text())


# ---------------------------------------------------------------- the document


def test_every_registered_resource_has_one_terraform_counterpart_in_its_stack(
        syntheses: dict[str, Synthesis]) -> None:
    for env, s in syntheses.items():
        entries = [(stage, e) for stage in STAGES for e in s.document["stacks"][stage]["resources"]]
        by_urn = {e["urn"]: stage for stage, e in entries if "urn" in e}
        for r in s.plan.resources:
            if not r.custom or r.type.startswith("pulumi:providers:") or r.type == IMAGE_TYPE:
                assert r.urn not in by_urn
                continue
            want = "gcp" if r.type in GCP_TYPES else "controllers" if r.type == HELM_TYPE else "workloads"
            assert is_kubernetes_object(r) or want != "workloads", r.type
            assert by_urn.get(r.urn) == want, f"{env}: {r.name} ({r.type})"
        assert len(by_urn) == sum(1 for r in s.plan.resources if r.urn in by_urn)
        # The image is built outside Terraform (build-image.sh) and taken by digest.
        assert s.document["image"]["command"][:3] == ["docker", "buildx", "build"]
        assert IMAGE_DIGEST_VAR in s.document["stacks"]["workloads"]["variables"]


def test_the_hugging_face_token_is_a_sensitive_variable_not_a_value() -> None:
    config = {**stack_config("staging"), "gke-tpu-rl:hfToken": {"secure": "AAABAGVuY3J5cHRlZA=="}}
    s = synthesize("staging", config)
    workloads = s.document["stacks"]["workloads"]
    assert workloads["variables"][HF_TOKEN_VAR]["sensitive"] is True
    [secret] = [e for e in workloads["resources"] if e["type"] == "kubernetes_manifest"
                and e["args"]["manifest"]["kind"] == "Secret"]
    # As data, encoded by Terraform: stringData is write-only, and a kubernetes_manifest holding it never settles.
    assert "stringData" not in secret["args"]["manifest"]
    [value] = secret["args"]["manifest"]["data"].values()
    assert value == f"\u27e6tf:var.{HF_TOKEN_VAR}|#base64encode\u27e7"
    assert "AAABAGVuY3J5cHRlZA" not in json.dumps(s.document)


# ---------------------------------------------------------------- through cdktf


def test_the_synthesized_stacks_are_the_golden_ones(written: Path) -> None:
    update = os.environ.get("UPDATE_GOLDEN") == "1"
    for env in ENVIRONMENTS:
        for stack in STAGES:
            got = json.dumps(strip_metadata(_stack(written, env, stack)), indent=2, sort_keys=True) + "\n"
            path = golden_path(env, stack)
            if update:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(got)
            assert path.is_file(), f"no golden {path}: run `make golden`"
            assert got == path.read_text(), (
                f"{env}/{stack} differs from {path.relative_to(ROOT)}: review, then `make golden`")


def test_each_override_is_one_the_frozen_bindings_need_and_is_written(written: Path) -> None:
    # Every entry is used by some environment (tinker's store): written raw at its Terraform path.
    from infra.terraform.document import OVERRIDES
    for tf_type, path in OVERRIDES:
        tf_path = [re.sub(r"(?<=[a-z])(?=[A-Z])", "_", p).lower() for p in path.split(".")]
        found = []
        for env in ENVIRONMENTS:
            for body in _stack(written, env, "gcp")["resource"].get(tf_type, {}).values():
                node = body
                for key in tf_path:
                    node = node.get(key) if isinstance(node, dict) else None
                found += [node] if node is not None else []
        assert found, f"{tf_type} {path}: no environment sets it; drop the override"


def test_each_stack_has_its_own_state_and_reaches_the_cluster_without_a_stored_token(written: Path) -> None:
    for env in ENVIRONMENTS:
        for stack in STAGES:
            tf = _stack(written, env, stack)
            assert tf["terraform"]["backend"]["gcs"]["prefix"] == f"gke-tpu-rl/{env}/{stack}"
            assert tf["terraform"]["required_providers"]["google"]["version"] == GOOGLE_CONSTRAINT
            if stack == "gcp":
                assert "kubernetes" not in tf.get("provider", {})
                continue
            [k8s] = tf["provider"]["kubernetes"]
            assert k8s["exec"] == [{"api_version": "client.authentication.k8s.io/v1beta1",
                                    "command": "gke-gcloud-auth-plugin"}]
            assert "token" not in k8s and "google_client_config" not in tf.get("data", {})
            assert tf["provider"]["helm"][0]["kubernetes"]["host"] == k8s["host"]
            assert k8s["host"].startswith("https://${data.google_container_cluster.cluster.")


def test_strings_reach_terraform_as_written_and_references_as_references(
        written: Path, escapes: tuple[dict[str, Any], str]) -> None:
    tf = _stack(written, "escapes", "workloads")
    note = tf["resource"]["kubernetes_manifest"][escapes[1]]["manifest"]["metadata"]["annotations"]["note"]
    # Terraform reads "$${" as a literal "${" and "%%{" as "%{": the object applied is the one written.
    assert note == 'echo "$${HOME}" %%{if x}y%%{endif} $$PATH'
    assert note.replace("$${", "${").replace("%%{", "%{") == TEMPLATE_TEXT
    image = json.dumps(tf["resource"]["kubernetes_manifest"])
    assert f"trainer@${{var.{IMAGE_DIGEST_VAR}}}" in image
    [secret] = [m["manifest"] for m in tf["resource"]["kubernetes_manifest"].values()
                if m["manifest"]["kind"] == "Secret"]
    assert list(secret["data"].values()) == [f"${{base64encode(var.{HF_TOKEN_VAR})}}"]
    assert tf["variable"][HF_TOKEN_VAR]["sensitive"] is True


def test_an_argument_the_bindings_do_not_have_or_of_the_wrong_type_fails_the_synth(
        synthesized: tuple[Path, str], refused: dict[str, dict[str, Any]]) -> None:
    out, error = synthesized
    assert re.search(r"^gke-tpu-rl synth unknown: .*placementPolicy\.tpuTopologee: ContainerNodePoolPlacementPolicy "
                     r"has no such argument", error, flags=re.M), error
    pool = next(e for e in refused["typed"]["stacks"]["gcp"]["resources"] if e["type"] == "google_container_node_pool")
    assert re.search(rf"^gke-tpu-rl synth typed: google_container_node_pool\.{pool['name']}:.*node_count", error,
                     flags=re.M), error
    assert not [*(out / "unknown").rglob("*.tf.json"), *(out / "typed").rglob("*.tf.json")]  # nothing to apply


def test_build_image_builds_what_the_program_builds_and_prints_the_digest(
        syntheses: dict[str, Synthesis], tmp_path: Path) -> None:
    image = syntheses["dev"].document["image"]
    script = tmp_path / "build-image.sh"
    script.write_text(synth.build_script(image))
    script.chmod(0o755)
    fake = tmp_path / "bin"
    fake.mkdir()
    # A docker that records its arguments and writes the metadata file buildx would.
    (fake / "docker").write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" > \"$ARGS_OUT\"\n"
                                 "while [ $# -gt 0 ]; do if [ \"$1\" = --metadata-file ]; then "
                                 "echo '{\"containerimage.digest\": \"sha256:" + "ab" * 32 + "\"}' > \"$2\"; fi; "
                                 "shift; done\n")
    (fake / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "ARGS_OUT": str(tmp_path / "args"),
           "GKE_TPU_RL_ROOT": str(ROOT)}
    proc = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "sha256:" + "ab" * 32
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:3] == ["buildx", "build", "--push"]
    # Run from infra/, the program's paths resolve to the repository's Dockerfile and build context.
    assert (ROOT / "infra" / args[args.index("--file") + 1]).resolve() == ROOT / "trainer" / "Dockerfile"
    assert (ROOT / "infra" / args[-1]).resolve() == ROOT
    assert args[args.index("--tag") + 1].startswith(image["repository"] + ":")


# ---------------------------------------------------------------- what Terraform itself makes of it


def _triggers(tf: dict[str, Any]) -> dict[str, list[str]]:
    """address -> its lifecycle.replace_triggered_by, for every resource that has one."""
    return {f"{t}.{n}": body["lifecycle"]["replace_triggered_by"] for t, named in tf.get("resource", {}).items()
            for n, body in named.items() if "replace_triggered_by" in (body.get("lifecycle") or {})}


def test_replace_triggered_by_is_a_static_reference_review_2026_11_28_5(written: Path) -> None:
    """Terraform's JSON syntax reads replace_triggered_by as static references: "terraform_data.x", never the
    interpolation cdktf writes for a construct ("${terraform_data.x}", an "Invalid character" at init)."""
    for env in ENVIRONMENTS:
        tf = _stack(written, env, "workloads")
        triggers = _triggers(tf)
        assert triggers, f"{env}: nothing is replaced on change"
        for address, refs in triggers.items():
            for ref in refs:
                assert re.fullmatch(r"terraform_data\.[A-Za-z_][A-Za-z0-9_-]*", ref), f"{env} {address}: {ref!r}"
                assert ref.split(".")[1] in tf["resource"]["terraform_data"], f"{env} {address}: {ref} undeclared"


def test_staging_jobs_are_replaced_not_patched_on_both_backends_review_2026_11_28_7(
        syntheses: dict[str, Synthesis], written: Path) -> None:
    """A Job's pod template is immutable. pulumi-kubernetes replaces the Job (and is told so explicitly);
    kubernetes_manifest would PATCH it (it replaces only on apiVersion, kind, name, namespace), so Terraform needs
    a replace_triggered_by on a terraform_data holding the spec, which holds the image digest variable."""
    with_jobs = set()
    for env, s in syntheses.items():
        tf = _stack(written, env, "workloads")
        manifests, data = tf["resource"]["kubernetes_manifest"], tf["resource"].get("terraform_data", {})
        for job in s.plan.of_type("kubernetes:batch/v1:Job"):
            with_jobs.add(env)
            assert job.options.get("replaceOnChanges") == ["spec"], f"{env} {job.name}"
            assert job.options.get("deleteBeforeReplace") is True, f"{env} {job.name}"
            body = manifests[tf_name(job.name)]
            [trigger] = body["lifecycle"]["replace_triggered_by"]
            watched = data[trigger.removeprefix("terraform_data.")]["input"]
            assert watched == {"spec": body["manifest"]["spec"]}, f"{env} {job.name}"
            assert f"${{var.{IMAGE_DIGEST_VAR}}}" in json.dumps(watched), f"{env} {job.name}: a new image"
    assert with_jobs == set(ENVIRONMENTS)  # every shipped environment stages its model


def terraform_cli() -> str:
    """The real Terraform CLI; a plain failure without it (it is not installable from the registries here)."""
    path = shutil.which("terraform")
    if path is None:
        pytest.fail("the Terraform CLI (`terraform`, 1.11 or later) is not on PATH: these tests load every "
                    "synthesized stack with it and cannot check the stacks without it; install it and rerun",
                    pytrace=False)
    return path


@pytest.fixture(scope="module")
def terraform_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Terraform's environment: a CLI config whose only provider source is an empty folder, so `init` loads the
    configuration, then stops at the provider lookup at once and never reaches a registry, network or not."""
    home = tmp_path_factory.mktemp("terraform-cli")
    (home / "mirror").mkdir()
    (home / "cli.tfrc").write_text(
        f'provider_installation {{\n  filesystem_mirror {{\n    path = "{home / "mirror"}"\n  }}\n}}\n')
    return {**os.environ, "TF_CLI_CONFIG_FILE": str(home / "cli.tfrc"), "CHECKPOINT_DISABLE": "1",
            "TF_IN_AUTOMATION": "1"}


def terraform_init(folder: Path, env: dict[str, str]) -> tuple[list[str], str]:
    """`terraform init -backend=false` in a stack's folder: its errors other than the provider lookup's, and its
    output. The configuration is loaded and checked first; any other error is a configuration error."""
    proc = subprocess.run([terraform_cli(), "init", "-backend=false", "-input=false", "-no-color"], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    errors = re.split(r"^(?=Error: )", out, flags=re.M)[1:]
    wrong = [e.strip() for e in errors if not e.startswith(f"Error: {PROVIDER_DOWNLOAD}")]
    if proc.returncode != 0 and not errors:
        wrong.append(f"exit {proc.returncode} without an error:\n{out[-2000:]}")
    if proc.returncode != 0 and "Finding hashicorp/" not in out:
        wrong.append(f"stopped before the provider lookup:\n{out[-2000:]}")
    return wrong, out


def _init_all(folders: list[Path], env: dict[str, str]) -> dict[Path, tuple[list[str], str]]:
    terraform_cli()
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(folders, pool.map(lambda f: terraform_init(f, env), folders), strict=True))


def _assert_loads(results: dict[Path, tuple[list[str], str]]) -> None:
    failed = {str(f): errors for f, (errors, _) in results.items() if errors}
    assert not failed, "terraform init refused:\n" + "\n\n".join(
        f"{folder}:\n" + "\n".join(errors) for folder, errors in failed.items())
    for folder, (_, out) in results.items():
        # review 2026-11-28 #13: the constraint as Terraform reads it.
        assert 'Finding hashicorp/google versions matching ">= 7.22.0, < 8.0.0"' in out, folder


def test_terraform_init_loads_every_golden_stack_review_2026_11_28_5(
        tmp_path: Path, terraform_env: dict[str, str]) -> None:
    folders = []
    for env in ENVIRONMENTS:
        for stack in STAGES:
            folder = tmp_path / env / stack
            folder.mkdir(parents=True)
            shutil.copy(golden_path(env, stack), folder / "cdk.tf.json")
            folders.append(folder)
    _assert_loads(_init_all(folders, terraform_env))


def test_terraform_init_loads_every_synthesized_stack_and_a_users_copy_review_2026_11_28_5(
        written: Path, terraform_env: dict[str, str]) -> None:
    folders = [written / env / "stacks" / stack for env in (*ENVIRONMENTS, USER_COPY[0]) for stack in STAGES]
    _assert_loads(_init_all(folders, terraform_env))


def terraform_console(expression: str, env: dict[str, str], cwd: Path) -> Any:
    """An expression's value as `terraform console` computes it (offline: no configuration in `cwd`)."""
    proc = subprocess.run([terraform_cli(), "console", "-no-color"], input=f"jsonencode({expression})\n", cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"terraform console: {expression}\n{proc.stdout}{proc.stderr}"
    return json.loads(json.loads(proc.stdout.strip().splitlines()[-1]))


VERSION_LOOKUP = re.compile(r'data\.google_container_engine_versions\.\w+\.release_channel_\w+_version\["\w+"\]')
DIGESTS = {"sha256:" + "0" * 64: True, "sha256:" + "ab" * 32: True, "sha256:" + "0" * 63: False,
           "sha256:" + "0" * 65: False, "sha256:" + "A" * 64: False, "latest": False, "": False}


def test_terraform_console_evaluates_each_precondition_and_validation_on_both_sides_of_its_threshold(
        syntheses: dict[str, Synthesis], user_copy: Synthesis, written: Path, terraform_env: dict[str, str],
        tmp_path: Path) -> None:
    """The cluster's precondition (the channel's version is at least managed DRANET's floor, as the program's
    infra/components/cluster.py choose_version checks) and the digest variable's validation, evaluated by Terraform
    itself with the looked-up value replaced by each test value. A precondition or validation this test does not know
    fails it."""
    specs = {env: s.plan.spec for env, s in syntheses.items()} | {USER_COPY[0]: user_copy.plan.spec}
    with_floor = set()
    for env, spec in specs.items():
        for stack in STAGES:
            tf = _stack(written, env, stack)
            for type_, named in tf.get("resource", {}).items():
                for name, body in named.items():
                    for pre in (body.get("lifecycle") or {}).get("precondition", []):
                        assert type_ == "google_container_cluster", f"{env}: unknown precondition on {type_}.{name}"
                        floor = spec.gke_version_floor
                        assert floor is not None, f"{env}: a precondition without a floor"
                        with_floor.add(env)
                        condition = pre["condition"]
                        assert condition.startswith("${") and condition.endswith("}")
                        expr = VERSION_LOOKUP.sub("v", condition[2:-1])
                        assert "data." not in expr, expr
                        versions = ["1.33.5-gke.1000", "1.34.0-gke.1999999", "1.34.1-gke.1829000", floor,
                                    "1.34.1-gke.1829002", "1.34.2-gke.1", "1.35.0-gke.100", "2.0.0-gke.1",
                                    "1.34.1", "1.35.0"]
                        got = terraform_console(f"[for v in {json.dumps(versions)} : {expr}]", terraform_env,
                                                tmp_path)
                        want = [gke_version_tuple(v) >= gke_version_tuple(floor) for v in versions]
                        assert got == want, f"{env}: {dict(zip(versions, got, strict=True))}"
            for name, var in tf.get("variable", {}).items():
                for validation in var.get("validation", []):
                    assert name == IMAGE_DIGEST_VAR, f"{env}: unknown validation of var.{name}"
                    condition = validation["condition"]
                    expr = condition[2:-1].replace(f"var.{name}", "v")
                    got = terraform_console(f"[for v in {json.dumps(list(DIGESTS))} : {expr}]", terraform_env,
                                            tmp_path)
                    assert got == list(DIGESTS.values()), f"{env}: {dict(zip(DIGESTS, got, strict=True))}"
    # Environments with managed DRANET have the floor; the others (dev, tinker and its copy) none.
    assert with_floor == {env for env, spec in specs.items() if spec.gke_version_floor} == {"staging", "prod"}
