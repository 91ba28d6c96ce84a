"""`gke-tpu-rl synth`: environments as Terraform, written by infra/terraform/cdktf_app.py in the isolated cdktf venv."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from infra.terraform.refs import STAGES

ROOT = Path(__file__).resolve().parents[2]
# Run as a module from ROOT: it imports infra/terraform/refs.py, as infra/terraform/document.py does.
APP = "infra.terraform.cdktf_app"
# Made by `make install` from tools/cdktf-requirements.txt, inside the project's venv (as checkov's is).
CDKTF_VENV = Path(sys.prefix) / "cdktf"
PYTHON_OVERRIDE = "GKE_TPU_RL_CDKTF_PYTHON"


class SynthError(Exception):
    """cdktf is missing or refused a document; the message says which and why."""


def cdktf_python() -> Path:
    path = Path(os.environ.get(PYTHON_OVERRIDE) or CDKTF_VENV / "bin" / "python")
    if not path.is_file():
        raise SynthError(f"no cdktf environment at {path}: `make install` builds it from "
                         f"tools/cdktf-requirements.txt (or set {PYTHON_OVERRIDE})")
    return path


def run_app(documents: list[dict[str, Any]], out: Path) -> None:
    """Writes OUT/<env>/stacks/<stack>/cdk.tf.json for each document, in one cdktf process; a SynthError names each
    document cdktf refused (the others are written all the same)."""
    python = cdktf_python()
    env = {**os.environ,
           # The jsii runtime unpacks each provider's assembly (hundreds of MB) here once, not under ~/.
           "JSII_RUNTIME_PACKAGE_CACHE_ROOT": str(python.parent.parent / "jsii-cache"),
           # jsii's banner for an old Node.js (a list of major versions): the synth is offline JSON generation.
           "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "18,19,20,21",
           "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "18,19,20,21"}
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for doc in documents:
            path = Path(tmp) / f"{doc['env']}.json"
            path.write_text(json.dumps(doc, ensure_ascii=False))
            paths.append(str(path))
        proc = subprocess.run([str(python), "-m", APP, str(out.resolve()), *paths], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise SynthError(f"cdktf synth failed (exit {proc.returncode}):\n{tail}")


def build_script(image: dict[str, Any]) -> str:
    """The trainer image's build and push, as the Pulumi program does it (infra/components/image.py), printing the
    digest the workloads stack takes."""
    return f"""#!/usr/bin/env bash
# Builds and pushes the trainer image, then prints the digest the workloads stack takes:
#   terraform -chdir=stacks/workloads apply -var trainer_image_digest=$(./build-image.sh)
# Docker must be logged in to the registry: gcloud auth configure-docker {image['repository'].split('/')[0]}
set -euo pipefail
meta="$(mktemp)"
# The program's build context paths start from infra/ of a checkout of this repository.
cd "${{GKE_TPU_RL_ROOT:-{ROOT}}}/{image['workdir']}"
{shlex.join(image['command'][:-1])} --metadata-file "$meta" {shlex.quote(image['command'][-1])} >&2
python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["containerimage.digest"])' "$meta"
"""


def write(documents: list[dict[str, Any]], out: Path) -> list[Path]:
    """Synthesises every document under OUT/<env>/ and adds its build-image.sh; returns the stacks' files."""
    run_app(documents, out)
    written = []
    for doc in documents:
        env_dir = out / doc["env"]
        if doc.get("image"):
            script = env_dir / "build-image.sh"
            script.write_text(build_script(doc["image"]))
            script.chmod(0o755)
        written += [env_dir / "stacks" / stack / "cdk.tf.json" for stack in STAGES]
    return written


def next_steps(doc: dict[str, Any], out: Path) -> str:
    env_dir = out / doc["env"]
    stacks = [f"terraform -chdir={env_dir / 'stacks' / s} init && terraform -chdir={env_dir / 'stacks' / s} apply"
              for s in STAGES]
    image = f"  {env_dir / 'build-image.sh'}   # prints the digest for trainer_image_digest\n" if doc.get("image") \
        else ""
    return (f"{doc['env']}: state in gs://{doc['backend']['bucket']}/{doc['backend']['prefix']}/<stack>; apply in "
            f"order:\n  {stacks[0]}\n{image}  {stacks[1]}\n  {stacks[2]}"
            + (" -var trainer_image_digest=sha256:..." if doc.get("image") else ""))
