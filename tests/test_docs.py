"""The docs only name commands and config keys that exist: every `gke-tpu-rl ...` line parses with the real CLI,
and every `gke-tpu-rl:key.path` is a field of the typed environment spec."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from pydantic import BaseModel

from infra.cli import build_parser
from infra.config import SECRET_KEYS, EnvironmentSpec

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:^|[\s`$])gke-tpu-rl ((?:plan|fit|train)\b[^`#\n]*)")
_PATH = r"[A-Za-z][A-Za-z0-9]*(?:(?:\.[A-Za-z][A-Za-z0-9]*)|\[\d+\])*"
KEY = re.compile(rf"gke-tpu-rl:({_PATH})")
# Keys written without the namespace, in backticks: `cluster.versionPrefix`, `storage.protect: true`.
SHORT_KEY = re.compile(rf"`((?:cluster|network|slices|storage|controllers|queues|trainer)(?:\.|\[\d+\]\.){_PATH})")


def _commands(path: Path) -> list[str]:
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [m.group(1).strip().rstrip(".,;:)") for m in COMMAND.finditer(text)]


def _keys(path: Path) -> list[str]:
    text = path.read_text()
    return sorted(set(KEY.findall(text)) | set(SHORT_KEY.findall(text)))


def key_exists(path: str) -> bool:
    """Whether `cluster.versionPrefix` / `slices[0].tpuType` names a field of EnvironmentSpec (by its alias)."""
    parts = [p for p in re.split(r"\.|\[\d+\]", path) if p]
    if parts == [] or (len(parts) == 1 and parts[0] in SECRET_KEYS):
        return bool(parts)
    model: type[BaseModel] | None = EnvironmentSpec
    for part in parts:
        if model is None:
            return False
        fields = {f.alias or name: f for name, f in model.model_fields.items()}
        if part not in fields or part == "env":
            return False
        annotation = fields[part].annotation
        inner = getattr(annotation, "__args__", (annotation,))
        model = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return True


def test_the_key_checker_tells_real_keys_from_typos() -> None:
    assert key_exists("cluster.versionPrefix") and key_exists("slices[0].tpuType") and key_exists("hfToken")
    assert key_exists("network.dranet.enabled") and key_exists("trainer.args")
    assert not key_exists("cluster.minVersion") and not key_exists("slices[0].tpu_type")
    assert not key_exists("trainer.config.steps") and not key_exists("nope")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_parses(doc: Path) -> None:
    commands = _commands(doc)
    parser = build_parser()
    for command in commands:
        argv = shlex.split(command)
        if argv[0] == "train":
            from trainer.cli import build_parser as trainer_parser

            trainer_parser().parse_args(argv[1:])
        else:
            parser.parse_args(argv)  # an unknown command or flag exits, failing the test with argparse's message


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_exists(doc: Path) -> None:
    missing = [k for k in _keys(doc) if not key_exists(k)]
    assert missing == [], f"{doc.name} names config keys the spec does not have: {missing}"


def test_the_walkthrough_covers_the_whole_path() -> None:
    text = (ROOT / "docs" / "walkthrough.md").read_text()
    for needle in ("TPU quota", "pulumi login gs://", "pulumi stack init", "pulumi config set", "pulumi up -s qa",
                   "kubectl get jobsets,workloads", "kubectl logs", "metrics.jsonl", "SIGTERM", "--diff",
                   "pulumi destroy -s qa", "retained on destroy"):
        assert needle in text, needle
    assert len(_commands(ROOT / "docs" / "walkthrough.md")) >= 3 and len(_keys(ROOT / "docs" / "walkthrough.md")) >= 10
