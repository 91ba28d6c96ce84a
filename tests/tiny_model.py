"""The tiny random Qwen3 fixture (tests/fixtures/tiny_qwen3, made by its make_fixture.py) as `Qwen/Qwen3-8B`.

`publish(hf_home)` lays the checkpoint and tokenizer out as a Hugging Face Hub cache entry, so with
HF_HOME=hf_home and HF_HUB_OFFLINE=1 the official `tinker` SDK (`get_tokenizer()`), `tinker-cookbook`
(`get_tokenizer`, renderer `qwen3`), `transformers.AutoTokenizer.from_pretrained("Qwen/Qwen3-8B")` and
`huggingface_hub.snapshot_download("Qwen/Qwen3-8B")` all find it without a network.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tiny_qwen3"
# What a Hub repo of the model holds (reference.json and the generator script are ours, not the model's).
HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def commit_hash() -> str:
    """A stable 40-hex "commit" for the fixture: SHA-1 over its files' names and bytes (changes when they do)."""
    h = hashlib.sha1()
    for name in HF_FILES:
        h.update(name.encode() + b"\0" + (FIXTURE / name).read_bytes())
    return h.hexdigest()


def publish(hf_home: Path, repo_id: str = "Qwen/Qwen3-8B") -> Path:
    """Write the fixture into hf_home/hub as the cache entry of model `repo_id` and return its snapshot dir.

    The layout is huggingface_hub's: models--{org}--{name}/blobs/<sha256> (the files' bytes),
    refs/main (the commit), snapshots/<commit>/<file> (relative symlinks into blobs, as the Hub client
    makes them). Idempotent.
    """
    repo = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = commit_hash()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in HF_FILES:
        data = (FIXTURE / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            tmp = blob.with_suffix(".incomplete")
            tmp.write_bytes(data)
            os.replace(tmp, blob)
        link = snapshot / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def reference() -> dict[str, Any]:
    """reference.json: the seed script's three data with transformers' fp32 log-probs and first_loss."""
    return json.loads((FIXTURE / "reference.json").read_text())
