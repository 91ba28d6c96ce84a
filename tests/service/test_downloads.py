"""The signed download URLs of external weights (trainer/service/downloads.py); the route that honours them and the
real `tinker checkpoint download` are in tests/service_engine/test_real_clients.py."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

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


def test_a_non_ascii_signature_is_refused_not_a_server_error(tmp_path: Path) -> None:
    # hmac.compare_digest raises TypeError on str with non-ASCII characters: that was a 500 on `?signature=%C3%A9`.
    assert downloads.refusal(KEY, _ckpt(tmp_path), "a.json", 2000, "é" * 64, now=0) == downloads.INVALID


def test_unreadable_storage_reads_as_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GCS FUSE mount whose daemon died raises ENOTCONN from stat (Path.is_dir swallows only ENOENT, ENOTDIR,
    EBADF, ELOOP): the API then answers its 400, not a 500 the SDK retries for minutes."""
    def dead(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    monkeypatch.setattr(Path, "stat", dead)
    assert downloads.files(tmp_path) == []
    assert downloads.file_path(_ckpt(tmp_path), "a.json") is None


def test_signed_urls_never_reach_the_access_log(tmp_path: Path) -> None:
    """uvicorn, configured as the service starts it (its dictConfig runs after the app is made), logs each request's
    path with its query: a download's signature is dropped from it, other paths keep theirs."""
    import uvicorn

    from trainer.service.api import BaseModelSpec, ServerConfig, create_app
    from trainer.service.store import Store

    app = create_app(Store(f"sqlite:///{tmp_path / 'db'}"), ServerConfig([BaseModelSpec("tiny/random")]))
    uvicorn.Config(app, log_level="info")  # configures uvicorn's loggers, as serve does
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    access = logging.getLogger("uvicorn.access")
    access.addHandler(keep := Keep())
    try:
        fmt = '%s - "%s %s HTTP/%s" %d'  # uvicorn/protocols/http/h11_impl.py's access record
        access.info(fmt, "10.0.0.1:5", "GET", f"{downloads.ROUTE}/o/m/n/f?expires=1&signature=abc", "1.1", 200)
        access.info(fmt, "10.0.0.1:5", "GET", "/api/v1/training_runs?limit=5", "1.1", 200)
    finally:
        access.removeHandler(keep)
    assert seen == [f'10.0.0.1:5 - "GET {downloads.ROUTE}/o/m/n/f HTTP/1.1" 200',
                    '10.0.0.1:5 - "GET /api/v1/training_runs?limit=5 HTTP/1.1" 200']
