"""The store's ids and paths: what a model, a sampler, a checkpoint and a request are called.

Pure functions over strings (no database): the API, the engine and the downloads read them too. The model and
sampler ids are the ones tinker's SDK derives itself, so they must not change.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import Final, Literal

# training: LoRA + optimizer (save_state); sampler: a PEFT adapter to sample from; external: a PEFT adapter to download
# (save_weights_external, fetched through signed URLs: api/, downloads.py).
CheckpointKind = Literal["training", "sampler", "external"]

# Checkpoint names become file names on the engine's side: keep them to one safe path component.
CHECKPOINT_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_TINKER_SCHEME: Final = "tinker://"
_KIND_SEGMENT: Final[dict[str, CheckpointKind]] = {
    "weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
SEGMENT_FOR_KIND: Final[dict[CheckpointKind, str]] = {v: k for k, v in _KIND_SEGMENT.items()}


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """The id the SDK itself derives for create_training_client_from_state (service_client.py)."""
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id_for(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"


def tinker_path(model_id: str, kind: CheckpointKind, name: str) -> str:
    return f"{_TINKER_SCHEME}{model_id}/{SEGMENT_FOR_KIND[kind]}/{name}"


def parse_tinker_path(path: str) -> tuple[str, CheckpointKind, str]:
    """tinker://<model_id>/weights|sampler_weights|external_weights/<name> -> (model_id, kind, name); ValueError
    otherwise."""
    if not path.startswith(_TINKER_SCHEME):
        raise ValueError(f"not a tinker:// path: {path!r}")
    parts = path[len(_TINKER_SCHEME) :].split("/")
    if len(parts) != 3 or not parts[0] or parts[1] not in _KIND_SEGMENT or not CHECKPOINT_NAME.fullmatch(parts[2]):
        raise ValueError(f"not a checkpoint path (tinker://<model_id>/{'|'.join(_KIND_SEGMENT)}/<name>): {path!r}")
    return parts[0], _KIND_SEGMENT[parts[1]], parts[2]


def rest_tinker_path(model_id: str, checkpoint_id: str) -> str:
    """The tinker:// path of a REST route's checkpoint (/training_runs/<model_id>/checkpoints/<checkpoint_id>/...);
    ValueError if it is none."""
    path = f"{_TINKER_SCHEME}{model_id}/{checkpoint_id}"
    parse_tinker_path(path)
    return path


def body_hash(kind: str, body: bytes) -> str:
    # The kind is hashed too, so the same bytes under another operation count as a different request.
    return hashlib.sha256(kind.encode() + b"\0" + body).hexdigest()


def new_id() -> str:
    return uuid.uuid4().hex
