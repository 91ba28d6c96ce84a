"""`gke-tpu-rl synth`: the Pulumi program's resources as Terraform, through the pinned cdktf bindings.

The synth tests run infra/cdktf_app.py in the cdktf venv `make install` builds ($(VENV)/cdktf): the bindings' own
constructors check every argument's name and type. `terraform validate` cannot run here (it downloads the providers);
tests/infra/test_terraform_parity.py compares what is written with the Pulumi plan, and the checkov test scans it.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from envspec.config import gke_version_tuple
from infra import synth
from infra.mockrun import IMAGE_TYPE
from infra.plan import is_kubernetes_object
from infra.terraform import GCP_TYPES, HELM_TYPE, HF_TOKEN_VAR, IMAGE_DIGEST_VAR, STAGES, Synthesis, synthesize
from tests.infra.conftest import ENVIRONMENTS, ROOT, stack_config

GOLDEN = ROOT / "tests" / "golden" / "terraform"


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
def written(syntheses: dict[str, Synthesis], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    synth.write([s.document for s in syntheses.values()], out)
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


def _hcl_eval(expression: str, version: str) -> bool:
    """The precondition's expression for one looked-up version, with Terraform's split, tonumber and try (the only
    functions it uses) done by Python. A stand-in for `terraform console`, which needs the providers downloaded."""
    expr = re.sub(r'data\.google_container_engine_versions\.\w+\.\w+\["\w+"\]', "V", expression)
    expr = re.sub(r'try\((.*?), "0"\)', r'_try(lambda: \1, lambda: "0")', expr)

    def _try(*options: Any) -> Any:
        for option in options:
            try:
                return option()
            except (IndexError, ValueError):
                continue
        raise ValueError("no option of try() evaluated")

    env = {"V": version, "split": lambda sep, s: s.split(sep), "tonumber": lambda s: int(s), "_try": _try}
    return bool(eval(expr, env))  # noqa: S307 (our own expression, tested)


def test_the_cluster_refuses_a_channel_version_below_the_dranet_floor_as_the_program_does(
        syntheses: dict[str, Synthesis]) -> None:
    spec = syntheses["staging"].plan.spec
    floor = spec.gke_version_floor
    assert floor is not None
    [cluster] = [e for e in syntheses["staging"].document["stacks"]["gcp"]["resources"]
                 if e["type"] == "google_container_cluster"]
    [pre] = cluster["lifecycle"]["precondition"]
    versions = ["1.33.5-gke.1000", "1.34.0-gke.1999999", "1.34.1-gke.1829000", floor, "1.34.1-gke.1829002",
                "1.34.2-gke.1", "1.35.0-gke.100", "2.0.0-gke.1"]
    for v in versions:
        assert _hcl_eval(pre["condition"], v) == (gke_version_tuple(v) >= gke_version_tuple(floor)), v
    # Environments without DRANET have no floor, and no precondition.
    for env in ("dev", "tinker"):
        [c] = [e for e in syntheses[env].document["stacks"]["gcp"]["resources"]
               if e["type"] == "google_container_cluster"]
        assert "precondition" not in c.get("lifecycle", {})


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
    from infra.terraform import OVERRIDES
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
            assert tf["terraform"]["required_providers"]["google"]["version"] == "~> 7.21"
            if stack == "gcp":
                assert "kubernetes" not in tf.get("provider", {})
                continue
            [k8s] = tf["provider"]["kubernetes"]
            assert k8s["exec"] == [{"api_version": "client.authentication.k8s.io/v1beta1",
                                    "command": "gke-gcloud-auth-plugin"}]
            assert "token" not in k8s and "google_client_config" not in tf.get("data", {})
            assert tf["provider"]["helm"][0]["kubernetes"]["host"] == k8s["host"]
            assert k8s["host"].startswith("https://${data.google_container_cluster.cluster.")


def _run(documents: list[dict[str, Any]], out: Path) -> None:
    synth.write(documents, out)


def test_strings_reach_terraform_as_written_and_references_as_references(tmp_path: Path) -> None:
    config = {**stack_config("staging"), "gke-tpu-rl:hfToken": {"secure": "AAABAGVuY3J5cHRlZA=="}}
    doc = synthesize("staging", config).document
    doc["env"] = "escapes"
    [ns] = [e for e in doc["stacks"]["workloads"]["resources"]
            if e["type"] == "kubernetes_manifest" and e["args"]["manifest"]["kind"] == "Namespace"]
    text = 'echo "${HOME}" %{if x}y%{endif} $$PATH'
    ns["args"]["manifest"]["metadata"]["annotations"] = {"note": text}
    _run([doc], tmp_path)
    tf = _stack(tmp_path, "escapes", "workloads")
    written = tf["resource"]["kubernetes_manifest"][ns["name"]]["manifest"]["metadata"]["annotations"]["note"]
    # Terraform reads "$${" as a literal "${" and "%%{" as "%{": the object applied is the one written.
    assert written == 'echo "$${HOME}" %%{if x}y%%{endif} $$PATH'
    assert written.replace("$${", "${").replace("%%{", "%{") == text
    image = json.dumps(tf["resource"]["kubernetes_manifest"])
    assert f"trainer@${{var.{IMAGE_DIGEST_VAR}}}" in image
    [secret] = [m["manifest"] for m in tf["resource"]["kubernetes_manifest"].values()
                if m["manifest"]["kind"] == "Secret"]
    assert list(secret["data"].values()) == [f"${{base64encode(var.{HF_TOKEN_VAR})}}"]
    assert tf["variable"][HF_TOKEN_VAR]["sensitive"] is True


def test_an_argument_the_bindings_do_not_have_or_of_the_wrong_type_fails_the_synth(
        syntheses: dict[str, Synthesis], tmp_path: Path) -> None:
    doc = copy.deepcopy(syntheses["staging"].document)
    pool = next(e for e in doc["stacks"]["gcp"]["resources"] if e["type"] == "google_container_node_pool"
                and "placementPolicy" in e["args"])
    pool["args"]["placementPolicy"]["tpuTopologee"] = "4x4"
    with pytest.raises(synth.SynthError, match=r"placementPolicy\.tpuTopologee: ContainerNodePoolPlacementPolicy "
                       r"has no such argument"):
        _run([doc], tmp_path / "unknown")
    doc = copy.deepcopy(syntheses["staging"].document)
    pool = next(e for e in doc["stacks"]["gcp"]["resources"] if e["type"] == "google_container_node_pool")
    pool["args"]["nodeCount"] = ["four"]
    with pytest.raises(synth.SynthError, match=rf"google_container_node_pool\.{pool['name']}:.*node_count"):
        _run([doc], tmp_path / "typed")


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
