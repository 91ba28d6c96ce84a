"""Signed download URLs for external weights: what `tinker checkpoint download` and
RestClient.get_external_weights_urls fetch.

tinker 0.38 asks GET /api/v1/training_runs/<id>/checkpoints/external_weights/<name>/external_weights_urls for
{"urls": {file: url}, "expires"} and fetches each url with a bare urllib GET (tinker/cli/commands/checkpoint.py
`_download_external_weights`, `_download_file`): no API key goes with it, so the URL itself must carry the right to
read that one file. Ours point back at this API (`ROUTE`/<owner>/<model id>/<name>/<file>?expires=&signature=); the
signature is HMAC-SHA256, under a server secret kept in the database (`Store.secret`, shared by every API replica and
kept across restarts), over the owner, the checkpoint, its storage path, the file and the expiry. So a URL cannot be
made for another file, owner or time without the secret, and stops working at its expiry, when its checkpoint is
deleted or saved again under the same name (a new storage path), or when the owner's key is revoked (checked by the
route). Like any signed URL it is a bearer credential until then: whoever holds it may download that file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path
from typing import Final
from urllib.parse import quote

from trainer.service.store import Checkpoint, parse_tinker_path

ROUTE: Final = "/api/v1/external_weights"
SECRET_NAME: Final = "download-urls"
# The CLI signs again once fewer than 5 minutes are left (checkpoint.py `_download_external_weights`), so a URL must
# live well beyond that; an hour, as a GCS signed URL's usual lifetime, covers a large file on a slow link.
DEFAULT_URL_TTL_S: Final = 3600
MIN_URL_TTL_S: Final = 600


def files(root: Path) -> list[str]:
    """The checkpoint's files, as paths relative to its directory (the keys of `urls`), in a stable order; none when
    the storage cannot be read here (not mounted, or a FUSE mount whose daemon died: ENOTCONN, which is_dir raises)."""
    try:
        if not root.is_dir():
            return []
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    except OSError:
        return []


def signature(key: bytes, ckpt: Checkpoint, file: str, expires: int) -> str:
    # NUL-separated: no field can hold a NUL, so two different tuples never give the same message.
    message = "\0".join(("v1", ckpt.owner_id, ckpt.tinker_path, ckpt.storage_path, file, str(expires)))
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def url(base_url: str, key: bytes, ckpt: Checkpoint, file: str, expires: int) -> str:
    """The signed URL of one file of an external weights checkpoint, under the API's base URL."""
    model_id, _, name = parse_tinker_path(ckpt.tinker_path)
    where = "/".join(quote(part, safe="") for part in (ckpt.owner_id, model_id, name))
    return (f"{base_url.rstrip('/')}{ROUTE}/{where}/{quote(file, safe='/')}"
            f"?expires={expires}&signature={signature(key, ckpt, file, expires)}")


# The one answer to any URL not signed as it stands, whether or not its checkpoint exists: it tells nothing more.
INVALID: Final = ("this download URL is not valid (altered, made for another file, or its checkpoint was deleted or "
                  "saved again): ask for new ones (RestClient.get_external_weights_urls, or run `tinker checkpoint "
                  "download` again)")
EXPIRED: Final = "this download URL has expired: ask for new ones (RestClient.get_external_weights_urls)"


def refusal(key: bytes, ckpt: Checkpoint, file: str, expires: int, given: str, now: float) -> str | None:
    """Why this URL does not grant `file` now (None: it does)."""
    # As bytes: compare_digest refuses str with non-ASCII characters (a TypeError, i.e. a 500, for `?signature=%C3%A9`).
    if not hmac.compare_digest(signature(key, ckpt, file, expires).encode(), given.encode("utf-8", "surrogateescape")):
        return INVALID
    return EXPIRED if now >= expires else None


def file_path(ckpt: Checkpoint, file: str) -> Path | None:
    """The file on disk, if it is one inside the checkpoint's directory (the signature already pins `file`)."""
    try:
        root = Path(ckpt.storage_path).resolve()
        path = (root / file).resolve()
        return path if path.is_relative_to(root) and path.is_file() else None
    except OSError:  # storage not readable here (see files)
        return None


class RedactSignatures(logging.Filter):
    """uvicorn's access log writes each request's path with its query string (uvicorn/protocols/utils.py
    `get_path_with_query_string`, the third argument of its "%s - \"%s %s HTTP/%s\" %d" record): a download URL's
    signature, a bearer credential, would land in the pods' logs (Cloud Logging on GKE). This drops the query of
    those paths."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and args[2].startswith(ROUTE):
            record.args = (*args[:2], args[2].split("?", 1)[0], *args[3:])
        return True


def redact_access_log() -> None:
    """Install RedactSignatures on uvicorn's access logger (once; dictConfig keeps a logger's filters)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactSignatures) for f in access.filters):
        access.addFilter(RedactSignatures())
