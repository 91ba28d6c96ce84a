"""The docs only name commands and config keys that exist: every `gke-tpu-rl ...` line parses with the real CLI,
and every `gke-tpu-rl:key.path` is a field of the typed environment spec."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from envspec.config import SECRET_KEYS, EnvironmentSpec
from infra.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:^|[\s`$])gke-tpu-rl ((?:plan|fit|train)\b[^`#\n]*)")
_PATH = r"[A-Za-z][A-Za-z0-9]*(?:(?:\.[A-Za-z][A-Za-z0-9]*)|\[\d+\])*"
# Not after a colon: a Pulumi URN's type token (`...::gke-tpu-rl:infra:Service$...`) is no config key.
KEY = re.compile(rf"(?<!:)gke-tpu-rl:({_PATH})")
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
            from trainer.run.cli import build_parser as trainer_parser

            trainer_parser().parse_args(argv[1:])
        else:
            parser.parse_args(argv)  # an unknown command or flag exits, failing the test with argparse's message


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_exists(doc: Path) -> None:
    missing = [k for k in _keys(doc) if not key_exists(k)]
    assert missing == [], f"{doc.name} names config keys the spec does not have: {missing}"


def _pulumi_value(text: str) -> object:
    # `pulumi config set --path`: "true" and "false" are booleans, integers numbers, anything else a string (a JSON
    # list too: `config set` has no --json). https://www.pulumi.com/docs/iac/cli/commands/pulumi_config_set/
    return {"true": True, "false": False}.get(text, int(text) if re.fullmatch(r"-?[0-9]+", text) else text)


def _pulumi_config_set(config: dict[str, object], argv: list[str]) -> None:
    """Applies one `pulumi config set [--path] [--secret] KEY [--] VALUE` to a stack file's `config:` map."""
    path = "--path" in argv
    flags_end = argv.index("--") if "--" in argv else len(argv)
    positional = [a for a in argv[:flags_end] if not a.startswith("--")] + argv[flags_end + 1:]
    assert len(positional) == 2, f"pulumi config set {shlex.join(argv)}: expected KEY VALUE"
    key, value = positional
    if "--secret" in argv:
        config[key] = {"secure": "v1:encrypted"}
        return
    if not path:
        config[key] = value  # a top-level value is always a string
        return
    namespace, _, rest = key.partition(":")
    parts: list[str | int] = [int(p[1:-1]) if p.startswith("[") else p for p in re.findall(r"\[\d+\]|[^.\[\]]+", rest)]
    node: object = config
    keys: list[str | int] = [f"{namespace}:{parts[0]}", *parts[1:]]
    for here, below in zip(keys, [*keys[1:], None], strict=True):
        if below is None:
            if isinstance(node, list) and here == len(node):
                node.append(_pulumi_value(value))
            else:
                node[here] = _pulumi_value(value)  # type: ignore[index]
        else:
            empty: object = [] if isinstance(below, int) else {}
            if isinstance(node, list):
                if here == len(node):
                    node.append(empty)
                node = node[here]  # type: ignore[index]
            else:
                node = node.setdefault(here, empty)  # type: ignore[union-attr]


def test_the_walkthroughs_pulumi_config_set_commands_make_a_valid_environment(tmp_path: Path) -> None:
    """Section 3's `pulumi config set` lines, stored as Pulumi stores them, make a stack file that `plan` (the program
    under mocks) and `fit` (the stack file read directly) accept; so do section 7's on top of them."""
    from infra.base.stack_file import env_spec
    from infra.offline.mockrun import run_stack

    text = (ROOT / "docs" / "walkthrough.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    config: dict[str, object] = {}
    for number in ("3.", "7."):
        [section] = [s for s in sections if s.startswith(number)]
        commands = [shlex.split(line, comments=True)[3:] for line in section.splitlines()
                    if line.startswith("pulumi config set ")]
        assert commands, f"section {number} sets no config"
        for argv in commands:
            _pulumi_config_set(config, argv)
        result = run_stack("qa", config, secret_keys=["hfToken"])
        path = tmp_path / "Pulumi.qa.yaml"
        path.write_text(yaml.safe_dump({"config": config}))
        assert env_spec("qa", path) == result.spec
    assert result.spec.trainer.args == ["--set", "steps=200"]
    assert (result.spec.slices[0].count, result.spec.trainer.slices) == (2, 2)


def test_the_walkthrough_covers_the_whole_path() -> None:
    text = (ROOT / "docs" / "walkthrough.md").read_text()
    for needle in ("TPU quota", "pulumi login gs://", "pulumi stack init", "pulumi config set", "pulumi up -s qa",
                   "kubectl get jobsets,workloads", "kubectl logs", "metrics.jsonl", "SIGTERM", "--diff",
                   "pulumi destroy -s qa", "retained on destroy"):
        assert needle in text, needle
    assert len(_commands(ROOT / "docs" / "walkthrough.md")) >= 3 and len(_keys(ROOT / "docs" / "walkthrough.md")) >= 10
