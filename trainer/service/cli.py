"""`python -m trainer.service keys create NAME | list | revoke ID [--db URL]`: the service's API keys.

The database: --db (a SQLAlchemy URL, or a plain path to a sqlite file), else $GKE_TPU_RL_SERVICE_DB, else the
sqlite file service.db in $GKE_TPU_RL_SERVICE_HOME, else in $XDG_DATA_HOME/gke-tpu-rl/service
(~/.local/share/gke-tpu-rl/service). `create` prints the key once (only its hash is stored); `list` shows ids,
names and states, never a secret.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from trainer.service import auth
from trainer.service.store import NotFound, Store, default_db_url


def _db_option(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # Accepted before or after the subcommand; the leaf's SUPPRESS default keeps a top-level --db from being reset.
    parser.add_argument(
        "--db", metavar="URL", default=None if top else argparse.SUPPRESS,
        help=f"database URL or sqlite file path (default: $GKE_TPU_RL_SERVICE_DB or {default_db_url()})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.service", description=__doc__.splitlines()[0])
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
    return parser


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
        raise AssertionError(args.command)
    finally:
        store.close()
