"""`python -m trainer.service keys create NAME | list | revoke ID [--db URL]`: the service's API keys;
`python -m trainer.service serve --base-model NAME [...] [--db URL]`: the Tinker-compatible HTTP API (api.py).

The database: --db (a SQLAlchemy URL, or a plain path to a sqlite file), else $GKE_TPU_RL_SERVICE_DB, else the
sqlite file service.db in $GKE_TPU_RL_SERVICE_HOME, else in $XDG_DATA_HOME/gke-tpu-rl/service
(~/.local/share/gke-tpu-rl/service). `create` prints the key once (only its hash is stored); `list` shows ids,
names and states, never a secret. `serve` runs the API only: it queues requests in the database, and an engine process
on the same database runs them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainer.service import auth
from trainer.service.store import NotFound, Store, default_db_url

if TYPE_CHECKING:  # api.py pulls in fastapi and tinker: only `serve` imports it
    from trainer.service.api import ServerConfig


def _db_option(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # Accepted before or after the subcommand; the leaf's SUPPRESS default keeps a top-level --db from being reset.
    parser.add_argument(
        "--db", metavar="URL", default=None if top else argparse.SUPPRESS,
        help=f"database URL or sqlite file path (default: $GKE_TPU_RL_SERVICE_DB or {default_db_url()})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.service",
        description="The post-training service: API keys (keys) and the Tinker-compatible HTTP API (serve).",
    )
    _db_option(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True)
    keys = commands.add_parser("keys", help="create, list and revoke API keys")
    _db_option(keys, top=False)
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a key and print it (once)")
    create.add_argument("name", help="a label for the key (who or what uses it)")
    listing = actions.add_parser("list", help="list keys (ids, names, states; no secrets)")
    listing.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    revoke = actions.add_parser("revoke", help="revoke a key: it is refused from then on")
    revoke.add_argument("key_id", metavar="ID", help="the key id, as `keys list` shows it")
    for leaf in (create, listing, revoke):
        _db_option(leaf, top=False)
    serve = commands.add_parser("serve", help="run the Tinker-compatible HTTP API (requests run in an engine process)")
    _db_option(serve, top=False)
    serve.add_argument(
        "--base-model", metavar="NAME", action="append", required=True,
        help="a base model clients may train and sample (repeatable); get_server_capabilities lists them",
    )
    serve.add_argument(
        "--tokenizer", metavar="BASE_MODEL=TOKENIZER_ID", action="append", default=[],
        help="the tokenizer get_info names for a base model (default: the model name itself; repeatable)",
    )
    serve.add_argument("--max-context-length", type=int, default=None, help="advertised in get_server_capabilities")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="listen port (default: %(default)s)")
    serve.add_argument(
        "--long-poll-s", type=float, default=None,
        help="how long retrieve_future waits for a result before answering try_again (default: 40; must stay under "
        "the SDK's 45 s timeout)",
    )
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def server_config(args: argparse.Namespace) -> ServerConfig:
    from trainer.service.api import DEFAULT_LONG_POLL_S, BaseModelSpec, ServerConfig

    tokenizers: dict[str, str] = {}
    for item in args.tokenizer:
        name, sep, tokenizer_id = item.partition("=")
        if not sep or not name or not tokenizer_id:
            raise ValueError(f"--tokenizer {item!r}: expected BASE_MODEL=TOKENIZER_ID")
        if name not in args.base_model:
            raise ValueError(f"--tokenizer {item!r}: {name!r} is not a --base-model")
        tokenizers[name] = tokenizer_id
    models = [BaseModelSpec(m, tokenizers.get(m), args.max_context_length) for m in args.base_model]
    long_poll_s = DEFAULT_LONG_POLL_S if args.long_poll_s is None else args.long_poll_s
    return ServerConfig(base_models=models, long_poll_s=long_poll_s)


def _serve(store: Store, args: argparse.Namespace) -> int:
    import uvicorn

    from trainer.service.api import create_app

    try:
        config = server_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # A shutdown waits for open long-polls at most this long; the SDK retries a cut poll on its own.
    uvicorn.run(
        create_app(store, config), host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=3,
    )
    return 0


def _keys(store: Store, args: argparse.Namespace) -> int:
    if args.action == "create":
        row, key = auth.create_key(store, args.name)
        print(f"created key {row.id} ({row.name}). Store it now; it cannot be shown again:", file=sys.stderr)
        print(key)
        return 0
    if args.action == "list":
        rows = store.list_api_keys()
        records = [
            {
                "id": r.id,
                "name": r.name,
                "created": r.created_at.isoformat(timespec="seconds"),
                "revoked": r.revoked_at.isoformat(timespec="seconds") if r.revoked_at else None,
            }
            for r in rows
        ]
        if args.json:
            print(json.dumps(records, indent=2))
            return 0
        print(f"{'ID':<16}  {'STATE':<7}  {'CREATED':<25}  NAME")
        for rec in records:
            state = "revoked" if rec["revoked"] else "active"
            print(f"{rec['id']:<16}  {state:<7}  {rec['created']:<25}  {rec['name']}")
        return 0
    try:
        row = auth.revoke_key(store, args.key_id)
    except NotFound:
        print(f"error: no API key {args.key_id!r}", file=sys.stderr)
        return 1
    print(f"revoked key {row.id} ({row.name})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    store = Store(args.db or default_db_url())
    try:
        if args.command == "keys":
            return _keys(store, args)
        if args.command == "serve":
            return _serve(store, args)
        raise AssertionError(args.command)
    finally:
        store.close()
