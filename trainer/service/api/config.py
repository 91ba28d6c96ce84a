"""The API server's configuration: the base models it serves and its limits, with the SDK timings they respect."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from fastapi import HTTPException

from trainer.service import downloads

# The SDK polls retrieve_future with a 45 s HTTP timeout (tinker/lib/api_future_impl.py:467): a long-poll must
# answer try_again before that.
SDK_RETRIEVE_TIMEOUT_S: Final = 45.0
DEFAULT_LONG_POLL_S: Final = 40.0
# Decompressed forward_backward body cap. The SDK splits data into chunks of at most fwdbwd_max_chunk_bytes_count
# (5 MB by default, which /client/config keeps) before protobuf encoding, so this leaves ample headroom.
DEFAULT_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# Every other route takes JSON: a sample's prompt of 128k tokens is under 1 MiB; user_metadata and names are small.
DEFAULT_MAX_JSON_BYTES: Final = 4 * 1024 * 1024
# A key with this many samples queued or running gets a 429 for its next one (tinker 0.38's SamplingClient retries a
# 429 with its own back-off, without limit, so it waits rather than fails); training requests are never refused for it
# (the SDK has numbered them: a refusal would leave a gap).
DEFAULT_MAX_UNFINISHED: Final = 1024
LIST_LIMIT_MAX: Final = 1000
# How long a retrieve_future waits before it answers paused_capacity while no engine runs.
PAUSED_POLL_S: Final = 5.0


def paused_reason(base_model: str | None) -> str:
    what = f"base model {base_model}" if base_model else "this request"
    return (f"no engine is running for {what} (its TPU slice is starting, preempted or suspended); the request is "
            "queued and runs in order when the engine is back")


@dataclass(frozen=True)
class BaseModelSpec:
    """A base model this server serves: the name clients pass as base_model, and the tokenizer get_info names
    (the SDK's get_tokenizer() loads it with transformers; default: the model name itself)."""

    name: str
    tokenizer_id: str | None = None
    max_context_length: int | None = None


@dataclass(frozen=True)
class ServerConfig:
    base_models: Sequence[BaseModelSpec]
    long_poll_s: float = DEFAULT_LONG_POLL_S
    poll_interval_s: float = 0.05
    # Asks the SDK to zstd the forward_backward body (client/config proto_compress_fwdbwd): >10x smaller on the wire.
    proto_compress_fwdbwd: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    max_unfinished_samples: int = DEFAULT_MAX_UNFINISHED
    # How long the external weights download URLs live (downloads.py).
    download_url_ttl_s: int = downloads.DEFAULT_URL_TTL_S
    _by_name: dict[str, BaseModelSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_models", tuple(self.base_models))
        if not self.base_models:
            raise ValueError("the server needs at least one base model")
        if not 0 < self.long_poll_s < SDK_RETRIEVE_TIMEOUT_S:
            raise ValueError(f"long_poll_s must be in (0, {SDK_RETRIEVE_TIMEOUT_S}) (the SDK's retrieve timeout)")
        object.__setattr__(self, "_by_name", {m.name: m for m in self.base_models})
        if len(self._by_name) != len(self.base_models):
            raise ValueError("base model names must be unique")
        if self.download_url_ttl_s < downloads.MIN_URL_TTL_S:
            raise ValueError(f"download_url_ttl_s must be >= {downloads.MIN_URL_TTL_S} (the CLI signs again 5 minutes "
                             "before the expiry)")

    def base_model(self, name: str) -> BaseModelSpec:
        if (spec := self._by_name.get(name)) is None:
            served = ", ".join(sorted(self._by_name))
            raise HTTPException(400, f"base model {name!r} is not served here; this server serves: {served}")
        return spec

    def tokenizer_id(self, name: str) -> str:
        spec = self._by_name.get(name)
        return (spec.tokenizer_id if spec is not None else None) or name

