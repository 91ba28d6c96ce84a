"""Fixtures of the as-deployed harness: one harness at a time on this machine (its bridge and addresses are fixed),
folders the pods' users can reach, the Hub mirror, the database as the stack declares it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from tests.deployed import sandbox as S
from tests.deployed.cluster import Boundary, Cluster
from tests.deployed.render import Rendered, render, user_copy
from tests.service.conftest import pg_server_url  # noqa: F401  (the embedded PostgreSQL, a fixture)
from tests.trainer.test_stage import GSM8K_ROWS, PARQUET, _parquet, _tokenizer_json, add_snapshot
from trainer.service.store import normalize_url

ROOT = Path(__file__).resolve().parents[2]
TINY_QWEN = ROOT / "tests" / "fixtures" / "tiny_qwen3"
TINY_REPO = "test-org/tiny-qwen"
LOCK = Path("/var/tmp/gke-tpu-rl-harness.lock")


@pytest.fixture(scope="module")
def harness_lock() -> Iterator[None]:
    """Held for one scenario's module (its bridge and addresses are fixed), not a worker's whole session: another
    pytest on this machine then waits for one scenario, not for every later test of that worker."""
    if (why := S.can_run()) is not None:
        # Our CI runs as root (the harness runs there); a hosted runner without root says so in the skip reason.
        pytest.skip(f"NOT RUN: {why}")
    with LOCK.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture
def work() -> Iterator[Path]:
    """Outside /tmp (pods mount their own /tmp) and open to the pods' user."""
    path = Path(tempfile.mkdtemp(prefix="gke-tpu-rl-harness-", dir="/var/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def hub_mirror(folder: Path) -> Path:
    """The Hub as the staging Jobs read it, in the hub cache's own layout: a tiny Qwen3 and GSM8K."""
    cache = folder / "hub"
    files = {p.name: p.read_bytes() for p in TINY_QWEN.iterdir() if p.suffix in (".json", ".safetensors")
             and p.name != "reference.json"}
    files.setdefault("tokenizer.json", _tokenizer_json())
    add_snapshot(cache, TINY_REPO, hashlib.sha1(b"tiny").hexdigest(), files, refs=("main",))
    jsonl = "".join(json.dumps(r) + "\n" for r in GSM8K_ROWS).encode()
    add_snapshot(cache, "openai/gsm8k", hashlib.sha1(b"gsm8k").hexdigest(),
                 {PARQUET: _parquet(GSM8K_ROWS), "main/train.jsonl": jsonl}, refs=("main",), repo_type="dataset")
    for p in [cache, *cache.rglob("*")]:
        os.chown(p, S.IMAGE_UID, S.IMAGE_UID, follow_symlinks=False)
    return cache


# The Hub stand-in: every container sees the mirror at this path, in offline mode (huggingface_hub's own switches).
HUB_MOUNT = "/hub-mirror"
HUB_ENV = {"HF_HUB_CACHE": HUB_MOUNT, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def trainer_on_cpu(env: str, work: Path, folder: Path, args: list[str], *, cpu_devices: int = 1,
                   trainer: dict[str, Any] | None = None) -> tuple[Rendered, Cluster]:
    """A user's copy of `env` whose only changes are what a team could set itself (trainer.stage: a tiny model on
    the Hub; trainer.args: `args`; any other `trainer` keys), rendered, and the harness cluster to run it on
    `cpu_devices` CPU devices per pod, with the Hub mirror."""
    path = user_copy(env, folder, f"{env}-local", {"trainer": {
        "stage": {"model": TINY_REPO, "dataset": "openai/gsm8k", "datasetFile": "main/train-00000-of-00001.parquet"},
        "args": args, **(trainer or {})}})
    rendered = render(f"{env}-local", path)
    cluster = Cluster(rendered.objects, work / "cluster", boundary=Boundary(env=dict(HUB_ENV)), cpu_devices=cpu_devices,
                      depends_on=rendered.depends_on, mounts={HUB_MOUNT: str(hub_mirror(work))})
    return rendered, cluster


@contextmanager
def provision_database(pg_server: str, rendered: Rendered) -> Iterator[None]:
    """What the stack declares on Cloud SQL (infra/components/database.py, read from the plan): the database and each
    IAM database user with its database_roles (the owner role, here a plain role)."""
    users = rendered.result.of_type("gcp:sql/user:User")
    [database] = rendered.result.of_type("gcp:sql/database:Database")
    roles = sorted({r for u in users for r in u.inputs.get("databaseRoles", [])})
    admin = create_engine(normalize_url(pg_server), isolation_level="AUTOCOMMIT")
    names = [u.inputs["name"] for u in users]
    with admin.connect() as conn:
        for role in roles:
            conn.execute(text(f'CREATE ROLE "{role}" NOLOGIN'))
        for u in users:
            member = ", ".join(f'"{r}"' for r in u.inputs.get("databaseRoles", []))
            conn.execute(text(f'CREATE ROLE "{u.inputs["name"]}" LOGIN' + (f" IN ROLE {member}" if member else "")))
        owner = roles[0] if roles else "postgres"
        conn.execute(text(f'CREATE DATABASE "{database.inputs["name"]}" OWNER "{owner}"'))
    try:
        yield
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{database.inputs["name"]}" WITH (FORCE)'))
            for role in (*names, *roles):
                conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
        admin.dispose()


def workload_identity(rendered: Rendered) -> list[tuple[str, str]]:
    """(GSA e-mail, member) of every roles/iam.workloadIdentityUser grant the plan makes."""
    accounts = rendered.result.of_type("gcp:serviceaccount/account:Account")
    out = []
    for m in rendered.result.of_type("gcp:serviceaccount/iAMMember:IAMMember"):
        if m.inputs.get("role") != "roles/iam.workloadIdentityUser":
            continue
        ref = str(m.inputs["serviceAccountId"])
        [acct] = [a for a in accounts if ref in (a.name, a.id, a.inputs["accountId"]) or ref.endswith(
            f"/{a.inputs['accountId']}@{a.inputs['project']}.iam.gserviceaccount.com")]
        out.append((f"{acct.inputs['accountId']}@{acct.inputs['project']}.iam.gserviceaccount.com",
                    m.inputs["member"]))
    return out


def instance_name(rendered: Rendered) -> str:
    [inst] = rendered.result.of_type("gcp:sql/databaseInstance:DatabaseInstance")
    i = inst.inputs
    return f"{i['project']}:{i['region']}:{i['name']}"


def only(items: list[Any]) -> Any:
    assert len(items) == 1, items
    return items[0]
