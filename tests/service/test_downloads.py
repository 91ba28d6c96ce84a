"""The signed download URLs of external weights (trainer/service/downloads.py); the route that honours them and the
real `tinker checkpoint download` are in tests/service_engine/test_real_clients.py."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from trainer.service import downloads
from trainer.service.store import Checkpoint

KEY = os.urandom(32)


def _ckpt(root: Path, owner: str = "aaaaaaaaaaaaaaaa") -> Checkpoint:
    return Checkpoint(owner_id=owner, model_id="s1:train:0", name="final", kind="external",
                      tinker_path="tinker://s1:train:0/external_weights/final", storage_path=str(root))


def test_a_url_grants_its_one_file_until_it_expires(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w.safetensors").write_bytes(b"x")
    ckpt = _ckpt(tmp_path)
    assert downloads.files(tmp_path) == ["adapter_config.json", "sub/w.safetensors"]
    assert downloads.files(tmp_path / "missing") == []
    url = downloads.url("http://host:8000/", KEY, ckpt, "sub/w.safetensors", 2000)
    parts = urlsplit(url)
    assert parts.path == f"{downloads.ROUTE}/aaaaaaaaaaaaaaaa/s1%3Atrain%3A0/final/sub/w.safetensors"
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    assert query["expires"] == "2000"
    sig = query["signature"]
    assert downloads.refusal(KEY, ckpt, "sub/w.safetensors", 2000, sig, now=1999) is None
    assert downloads.refusal(KEY, ckpt, "sub/w.safetensors", 2000, sig, now=2000) == downloads.EXPIRED
    # Any other file, expiry, owner, key, or a checkpoint saved again (a new storage path): not valid.
    refused = [
        downloads.refusal(KEY, ckpt, "adapter_config.json", 2000, sig, now=0),
        downloads.refusal(KEY, ckpt, "sub/w.safetensors", 3000, sig, now=0),
        downloads.refusal(KEY, _ckpt(tmp_path, "bbbbbbbbbbbbbbbb"), "sub/w.safetensors", 2000, sig, now=0),
        downloads.refusal(os.urandom(32), ckpt, "sub/w.safetensors", 2000, sig, now=0),
        downloads.refusal(KEY, _ckpt(tmp_path / "sub"), "sub/w.safetensors", 2000, sig, now=0),
    ]
    assert refused == [downloads.INVALID] * len(refused)


def test_file_path_stays_inside_the_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "a.json").write_text("{}")
    (tmp_path / "secret").write_text("no")
    ckpt = _ckpt(root)
    assert downloads.file_path(ckpt, "a.json") == (root / "a.json").resolve()
    assert downloads.file_path(ckpt, "../secret") is None
    assert downloads.file_path(ckpt, "missing.json") is None
