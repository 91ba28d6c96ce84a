"""docs/stack-config.md and docs/trainer-config.md are generated from the typed specs (infra/offline/reference.py): the
committed files match what the code renders, every key the environments and bundled trainer configs use is in them,
and a few known facts render right."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from envspec.config import NAMESPACE, SECRET_KEYS
from infra.cli import main
from infra.offline import reference

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("doc", sorted(reference.DOCS))
def test_the_committed_reference_is_up_to_date(doc: str) -> None:
    path, render = reference.DOCS[doc]
    committed = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
    assert committed == render(), f"{path} is out of date: run `{reference.REGENERATE}` and commit the result"


def _rows(doc: str) -> dict[str, list[str]]:
    """The reference's table rows by key (backticks and namespace stripped): [type, default, allowed, description]."""
    path, _ = reference.DOCS[doc]
    rows = {}
    for line in (ROOT / path).read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 5 and cells[0].startswith("`"):
            rows[cells[0].strip("`").removeprefix(f"{NAMESPACE}:")] = cells[1:]
    return rows


def _used(value: Any, path: str, documented: dict[str, list[str]]) -> list[str]:
    """The keys a file sets, as the reference names them (`slices[i].name`); a mapping-typed key (labels) stops."""
    out = [path]
    if documented.get(path, [reference.SECTION])[0] not in (reference.SECTION, reference.LIST_OF_MAPPINGS):
        return out
    items = [(path, value)] if isinstance(value, dict) else [(f"{path}[i]", item) for item in value or []]
    for where, mapping in items:
        for k, v in mapping.items():
            child = f"{where}.{k}"
            if child not in documented and f"{where}.<option>" in documented:  # a section that takes any key
                child = f"{where}.<option>"
            out += _used(v, child, documented)
    return out


STACK_FILES = sorted((ROOT / "environments").glob("Pulumi.*.yaml"))
TRAINER_FILES = sorted((ROOT / "trainer" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("stack_file", STACK_FILES, ids=lambda p: p.name)
def test_every_key_a_stack_file_uses_is_documented(stack_file: Path) -> None:
    documented = _rows("stack")
    config = yaml.safe_load(stack_file.read_text())["config"]
    used = []
    for key, value in config.items():
        assert key.startswith(f"{NAMESPACE}:"), key
        used += _used(value, key.removeprefix(f"{NAMESPACE}:"), documented)
    missing = sorted({k for k in used if k not in documented})
    assert len(used) > 10 and missing == [], f"docs/stack-config.md lacks keys {stack_file.name} uses: {missing}"


@pytest.mark.parametrize("config_file", TRAINER_FILES, ids=lambda p: p.name)
def test_every_key_a_bundled_trainer_config_uses_is_documented(config_file: Path) -> None:
    documented = _rows("trainer")
    used = [k for key, value in (yaml.safe_load(config_file.read_text()) or {}).items()
            for k in _used(value, key, documented)]
    missing = sorted({k for k in used if k not in documented})
    assert missing == [], f"docs/trainer-config.md lacks keys {config_file.name} uses: {missing}"


def test_known_stack_facts_render_right() -> None:
    rows = _rows("stack")
    kind, default, allowed, _ = rows["trainer.launcher"]
    assert (kind, default, allowed) == ("string", "`jobset`", "`jobset`, `ray`")
    assert rows["storage.softDeleteDays"][:3] == ["integer", "`7`", "0 to 90"]
    assert rows["cluster.releaseChannel"][1:3] == ["`RAPID`", "`RAPID`, `REGULAR`, `STABLE`"]
    assert rows["cluster.systemPool.nodes"][1:3] == ["`2`", "1 to 20"]
    assert rows["queues.priorityClasses"][:2] == ["mapping of string to integer",
                                                  "`{low: 100, default: 500, high: 1000}`"]
    assert rows["slices"][1:3] == ["required", "at least 1 item"]
    for key in ("project", "region", "zone", "slices[i].name", "slices[i].tpuType", "slices[i].topology"):
        assert rows[key][1] == "required", key
    assert "`v6e`" in rows["slices[i].tpuType"][2] and "`0.19.2`" in rows["controllers.kueueVersion"][2]
    assert "`qwen3-0.6b-grpo-v6e-2x2.yaml`" in rows["trainer.config"][2]
    assert rows["network.dranet"][0] == reference.SECTION
    assert rows["network.dranet.networks"][1:3] == ["unset", "1 to 8"]
    assert "env" not in rows  # the stack's name, not a key
    for key in SECRET_KEYS:
        assert "Pulumi secret" in rows[key][0] and rows[key][3], key


def test_known_trainer_facts_render_right() -> None:
    rows = _rows("trainer")
    assert "init.from" in rows and "init.from_" not in rows  # the alias a user writes
    assert rows["init.from"][1:3] == ["`random`", "`random`, `hf`"]
    assert rows["compute.remat"][1:3] == ["`none`", "`none`, `full`, `dots`"]
    assert rows["optim.b2"][1:3] == ["`0.999`", ">= 0, < 1"]
    assert rows["sampling.top_p"][2] == "> 0, <= 1" and rows["rl.group_size"][2] == ">= 2"
    assert rows["model"][:2] == [reference.SECTION, "unset"] and rows["model.vocab_size"][1] == "required"
    assert "`gsm8k`" in rows["task.name"][2] and "task.<option>" in rows
    assert rows["seed"][2] == ">= -2^63, < 2^63"


@pytest.mark.parametrize("keys", [reference.stack_keys, reference.trainer_keys], ids=["stack", "trainer"])
def test_every_key_says_what_it_changes(keys: Any) -> None:
    undescribed = [k.name for k in keys() if not k.description]
    assert undescribed == [], f"add description= to these Fields: {undescribed}"


def test_the_cli_prints_and_writes_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reference", "trainer"]) == 0
    assert capsys.readouterr().out == reference.trainer_markdown()
    (tmp_path / "Pulumi.yaml").write_text("name: x\n")
    monkeypatch.chdir(tmp_path)
    assert main(["reference", "--write"]) == 0
    assert (tmp_path / reference.STACK_DOC).read_text() == reference.stack_markdown()
    assert (tmp_path / reference.TRAINER_DOC).read_text() == reference.trainer_markdown()
