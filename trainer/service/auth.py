"""API keys: `tml-<key id>_<secret>` (the SDK refuses keys without the `tml-` prefix).

`import_key` also registers a key made elsewhere (one a team already hands out, or a secret its deployment holds): any
`tml-` string; its id is derived from its hash (`x` + 15 hex digits, never a generated id's 16 hex digits), and one
shorter than IMPORT_MIN_CHARS is refused unless asked for (a development stand-in like the walkthroughs' `tml-dummy`).

The key id is public (it is the owner id of every session, model and checkpoint the key creates, and what
`keys list` shows and `keys revoke` takes); the secret is 256 random bits shown once at creation. The store keeps
only a hash. The API layer calls `authenticate(store, request.headers.get("X-API-Key"))` and maps `AuthError` to
HTTP 401.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Final

from trainer.service.store import ApiKey, Store

KEY_PREFIX: Final = "tml-"
_KEY = re.compile(r"tml-([0-9a-f]{16})_([A-Za-z0-9_-]{43})")
# Hashed when no row matches, so a wrong id costs the same work as a wrong secret.
_DUMMY_HASH: Final = "0" * 64


IMPORT_MIN_CHARS: Final = 32  # after the prefix: below that a key is guessable


class AuthError(Exception):
    """The request carries no usable key (HTTP 401)."""


class MissingKey(AuthError):
    pass


class InvalidKey(AuthError):
    pass


class RevokedKey(AuthError):
    pass


def hash_key(key: str) -> str:
    # SHA-256, not a slow password hash: the secret is 256 bits from `secrets`, so guessing it is infeasible at any
    # hash speed; slow hashes (bcrypt, scrypt) exist for low-entropy human passwords and would only add latency to
    # every request. The domain prefix keeps these digests distinct from any other SHA-256 use of the same bytes.
    return hashlib.sha256(b"gke-tpu-rl service api key v1\0" + key.encode()).hexdigest()


def generate_key() -> tuple[str, str]:
    """A new (key id, full key)."""
    key_id = secrets.token_hex(8)
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def create_key(store: Store, name: str) -> tuple[ApiKey, str]:
    """Store a new key's hash; return the row and the full key (the only time it exists in clear)."""
    if not name.strip():
        raise ValueError("a key needs a name")
    key_id, key = generate_key()
    return store.add_api_key(key_id, name.strip(), hash_key(key)), key


def imported_key_id(key: str) -> str:
    return "x" + hash_key(key)[:15]


def import_key(store: Store, name: str, key: str, *, allow_weak: bool = False) -> ApiKey:
    """Register an existing key (only its hash is stored). ValueError: no `tml-` prefix, whitespace, or fewer than
    IMPORT_MIN_CHARS characters after the prefix without allow_weak."""
    if not name.strip():
        raise ValueError("a key needs a name")
    if not key.startswith(KEY_PREFIX) or key != key.strip() or any(c.isspace() for c in key):
        raise ValueError(f"an API key must start with {KEY_PREFIX!r} (the SDK refuses others) and hold no whitespace")
    if len(key) - len(KEY_PREFIX) < IMPORT_MIN_CHARS and not allow_weak:
        raise ValueError(f"this key has {len(key) - len(KEY_PREFIX)} characters after {KEY_PREFIX!r}; fewer than "
                         f"{IMPORT_MIN_CHARS} can be guessed (use `keys create`, or allow a weak key for a development "
                         "server)")
    match = _KEY.fullmatch(key)
    key_id = match.group(1) if match else imported_key_id(key)
    if (existing := store.get_api_key(key_id)) is not None:
        raise ValueError(f"this key is already registered, as {existing.id} ({existing.name})")
    return store.add_api_key(key_id, name.strip(), hash_key(key))


def authenticate(store: Store, header: str | None) -> str:
    """The owner id (key id) for an X-API-Key header value; MissingKey / InvalidKey / RevokedKey otherwise."""
    if header is None or not header.strip():
        raise MissingKey("no API key: send it in the X-API-Key header")
    key = header.strip()
    if not key.startswith(KEY_PREFIX):
        raise InvalidKey("invalid API key")
    match = _KEY.fullmatch(key)
    row = store.get_api_key(match.group(1) if match else imported_key_id(key))
    # Constant-time compare, run even for an unknown id, so timing tells nothing about the stored hash.
    same = hmac.compare_digest(row.key_hash if row is not None else _DUMMY_HASH, hash_key(header.strip()))
    if row is None or not same:
        raise InvalidKey("invalid API key")
    if row.revoked_at is not None:
        raise RevokedKey("this API key was revoked")
    return row.id


def revoke_key(store: Store, key_id: str) -> ApiKey:
    return store.revoke_api_key(key_id)
