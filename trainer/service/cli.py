"""`python -m trainer.service` (also `gke-tpu-rl service`):
  keys create NAME | import NAME KEY | list | revoke ID
                                           the service's API keys
  serve --config FILE [...]                the Tinker-compatible HTTP API (api/) and the engine (engine/) in one
                                           process, the engine configured by a trainer config with a service section
  serve --base-model NAME [...]            the API alone; engines on the same database run the requests
  engine --config FILE                     an engine alone (the API runs elsewhere on the same database)

The database: --db (a SQLAlchemy URL, or a plain path to a sqlite file), else Cloud SQL through the connector when
$GKE_TPU_RL_CLOUDSQL_INSTANCE (with _USER and _DATABASE) is set (what the stack's pods get: every API replica and the
engine share that one database), else $GKE_TPU_RL_SERVICE_DB, else the sqlite file service.db in
$GKE_TPU_RL_SERVICE_HOME, else in $XDG_DATA_HOME/gke-tpu-rl/service (~/.local/share/gke-tpu-rl/service). `create`
prints the key once (only its hash is stored); `list` shows ids, names and states, never a secret. `serve` runs the
API only: it queues requests in the database, and an engine process on the same database runs them.

`engine` exit codes (the engine JobSet's podFailurePolicy, workloads/jobset.py RESTART_EXIT_CODES, restarts the
JobSet on 42 and 128-255 and fails it on any other; an always-on engine never exits 0, which would complete it):
  143  SIGTERM (a preemption, a `pulumi up` replacing the JobSet): stopped cleanly, on every process of the group.
  42   a failure a restart can outlast: the database unavailable at start-up for longer than
       service.db_retry_s seconds (default 300; recover, worker registration and schema creation are
       retried with backoff until then), the process group not formed in time (TRAINER_INIT_TIMEOUT_SECONDS), a
       transient JAX runtime error, a storage I/O error reading the base model (gcsfuse EIO), the engine thread ending
       without a SIGTERM; on a follower (process > 0), process 0 stopping after an error or vanishing.
  2    a configuration error (the config, the Cloud SQL variables, a checkpoint that is missing or wrong): a bug in
       what was deployed, so the JobSet fails at once. Any other error (a traceback, exit 1) fails it too.
Once running, the engine retries database errors itself (the loop backs off and goes on), so they never end it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from envspec.engine_args import add_db_option, add_engine_options, add_log_level
from envspec.pod import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_STOPPED, EXIT_TRANSIENT
from trainer.base.config import ConfigError
from trainer.run.cli import is_transient
from trainer.service import auth
from trainer.service.store import DatabaseUnavailable, NotFound, Store, StoreError, default_db_url, retry_database

if TYPE_CHECKING:  # api/ pulls in fastapi and tinker, the engine JAX: only `serve` and `engine` import them
    from trainer.base.config import TrainConfig
    from trainer.service.api import ServerConfig

log = logging.getLogger(__name__)


def open_store(args: argparse.Namespace) -> Store:
    """--db, else what Store() resolves: Cloud SQL from the environment, $GKE_TPU_RL_SERVICE_DB, the sqlite file."""
    return Store(args.db) if args.db else Store()


def _log_to_stderr(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _restart_code(err: BaseException) -> int | None:
    """EXIT_TRANSIENT, after one line on stderr, for a failure a restart can outlast; None for anything else."""
    from trainer.model.hf import is_transient_io

    if isinstance(err, DatabaseUnavailable):
        why = str(err)
    elif is_transient(err):
        why = f"transient runtime failure: {err}"
    elif is_transient_io(err):
        why = f"storage I/O error (a bucket mount?): {err}"
    else:
        return None
    # One line: the pod's status and `kubectl logs` show it whole.
    print(f"error: {' '.join(why.split())}; exiting {EXIT_TRANSIENT} to be restarted", file=sys.stderr, flush=True)
    return EXIT_TRANSIENT


def _exit_stopped(*_: Any) -> None:
    raise SystemExit(EXIT_STOPPED)


def _stop_followers(code: int) -> None:
    """Process 0's start-up failed before its engine ran, and it exits `code`: tell the followers (waiting for its
    first op) to stop and exit with the same kind of code (143, 42, or a bug's), so every process exits at once and
    the Job's failure says the same whichever pod the Job controller judges first (getFailJobMessage takes the first
    matching pod in lister order). Otherwise process 0 would sit in jax.distributed's shutdown barrier at exit until
    it timed out (minutes), the followers would then die by a signal, and the JobSet would see their signal instead of
    process 0's code (found by the as-deployed harness: tests/deployed/test_service.py)."""
    import jax

    if jax.process_count() <= 1:
        return
    from trainer.service import device

    reason = {EXIT_STOPPED: device.STOPPED, EXIT_TRANSIENT: device.FAILED}.get(code, device.BUG)
    try:
        device.Leader().stop(reason)  # no op was sent yet: n starts at 0
    except Exception:  # noqa: BLE001 - the followers are gone or stuck: the JobSet restarts them with this pod
        log.exception("engine: could not stop the followers")


def _db_option(parser: argparse.ArgumentParser, *, top: bool) -> None:
    add_db_option(parser, top=top, help="database URL or sqlite file path (default: Cloud SQL from "
                  "$GKE_TPU_RL_CLOUDSQL_INSTANCE, _USER and _DATABASE, else $GKE_TPU_RL_SERVICE_DB, else "
                  f"{default_db_url()})")


def build_parser(prog: str = "python -m trainer.service") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="The post-training service: API keys (keys), the Tinker-compatible HTTP API (serve) and the "
        "engine that runs its requests on a base model with LoRA adapter slots (engine, or serve --config).",
    )
    _db_option(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True)
    keys = commands.add_parser("keys", help="create, list and revoke API keys")
    _db_option(keys, top=False)
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a key and print it (once)")
    create.add_argument("name", help="a label for the key (who or what uses it)")
    imported = actions.add_parser("import", help="register a key made elsewhere (only its hash is stored)")
    imported.add_argument("name", help="a label for the key")
    imported.add_argument("key", metavar="KEY", help="the key (tml-...), or - to read it from standard input (keeps it "
                          "out of the shell's history)")
    imported.add_argument("--allow-weak", action="store_true",
                          help="accept a key of fewer than 32 characters after tml- (a development server only)")
    listing = actions.add_parser("list", help="list keys (ids, names, states; no secrets)")
    listing.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    revoke = actions.add_parser("revoke", help="revoke a key: it is refused from then on")
    revoke.add_argument("key_id", metavar="ID", help="the key id, as `keys list` shows it")
    for leaf in (create, imported, listing, revoke):
        _db_option(leaf, top=False)
    serve = commands.add_parser(
        "serve", help="run the Tinker-compatible HTTP API (with --config, and its engine in the same process)")
    _db_option(serve, top=False)
    add_engine_options(serve)
    serve.add_argument(
        "--base-model", metavar="NAME", action="append", default=None,
        help="a base model clients may train and sample (repeatable; default: the --config's service.base_model); "
        "get_server_capabilities lists them",
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
    add_log_level(serve)
    engine = commands.add_parser("engine", help="run an engine alone: it claims the database's requests and runs them")
    _db_option(engine, top=False)
    add_engine_options(engine, required=True)
    add_log_level(engine)
    return parser


def server_config(args: argparse.Namespace, engine_cfg: TrainConfig | None = None) -> ServerConfig:
    """The API's config; with an engine config, its base model is served (and is the default --base-model) and its
    context length is advertised unless --max-context-length says otherwise."""
    from trainer.service.api import DEFAULT_LONG_POLL_S, BaseModelSpec, ServerConfig

    base_models = list(args.base_model or [])
    context = args.max_context_length
    if engine_cfg is not None and engine_cfg.service is not None:
        name = engine_cfg.service.base_model
        if base_models and name not in base_models:
            raise ValueError(f"--base-model {base_models}: the --config engine serves {name!r} (service.base_model)")
        base_models = base_models or [name]
        if context is None and engine_cfg.model is not None:
            context = engine_cfg.model.max_seq_len
    if not base_models:
        raise ValueError("--base-model: required without --config (which base models the API serves)")
    tokenizers: dict[str, str] = {}
    for item in args.tokenizer:
        name, sep, tokenizer_id = item.partition("=")
        if not sep or not name or not tokenizer_id:
            raise ValueError(f"--tokenizer {item!r}: expected BASE_MODEL=TOKENIZER_ID")
        if name not in base_models:
            raise ValueError(f"--tokenizer {item!r}: {name!r} is not a --base-model")
        tokenizers[name] = tokenizer_id
    models = [BaseModelSpec(m, tokenizers.get(m), context) for m in base_models]
    long_poll_s = DEFAULT_LONG_POLL_S if args.long_poll_s is None else args.long_poll_s
    return ServerConfig(base_models=models, long_poll_s=long_poll_s)


def _engine_config(args: argparse.Namespace) -> TrainConfig | None:
    if args.config is None:
        return None
    from trainer.base.config import load_config
    from trainer.service.engine import resolve_base_model

    cfg = load_config(args.config, args.overrides)
    if cfg.service is None:
        raise ConfigError(f"{args.config}: no service section (the engine's base model, batching and storage)")
    cfg = resolve_base_model(cfg)
    if cfg.init.from_ == "hf":
        from trainer.base.config import with_model
        from trainer.model.hf import check_hf

        cfg = with_model(cfg, check_hf(cfg.init.path or "", cfg.compute.param_dtype))
    return cfg


_LOCAL_FLAGS = ("--local-processes", "--devices-per-process")


def _child_argv(argv: Sequence[str]) -> list[str]:
    """This command's arguments without the local-process flags (each child is one process of the group)."""
    out: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
        elif item in _LOCAL_FLAGS:
            skip = True
        elif not item.startswith(tuple(f"{f}=" for f in _LOCAL_FLAGS)):
            out.append(item)
    return out


def _group(args: argparse.Namespace, cfg: TrainConfig) -> int | None:
    """Multi-process set-up before any JAX use: spawn the local group (returns its exit code), or join the group this
    process belongs to (the trainer's env contract) and, on a follower, follow process 0 until it stops (returns 143
    when process 0 was asked to stop, 42 when it stopped after an error or vanished: never 0, which would complete
    the engine's JobSet). None: this is process 0 (or the only process); go on."""
    if args.local_processes or args.devices_per_process:
        if args.local_processes < 1 or args.devices_per_process < 1:
            raise ConfigError("--local-processes and --devices-per-process go together, both >= 1")
        from trainer.run.launch import run_local

        return run_local(args.local_processes, args.devices_per_process, _child_argv(args.argv),
                         module="trainer.service")
    from trainer.run.distributed import initialize_from_env

    # A group that has not formed by the start-up timeout exits 42 from a watchdog (jax would abort natively).
    initialize_from_env(exit_on_timeout=EXIT_TRANSIENT)
    import jax

    assert cfg.service is not None
    if cfg.service.compile_cache:  # every process: each compiles, and reads back, the same programs
        from trainer.run import compile_cache
        from trainer.service.engine import state_root

        compile_cache.enable(state_root(cfg.service, args.storage) / compile_cache.DIR_NAME)

    if jax.process_index() == 0:
        return None
    from trainer.service import device
    from trainer.service.engine import run_follower

    _log_to_stderr(args)
    reason = run_follower(cfg)
    if reason == device.STOPPED:
        return EXIT_STOPPED
    if reason == device.BUG:
        print(f"error: engine process {jax.process_index()}: process 0 failed with a configuration error or a bug (its "
              f"log says which); exiting {EXIT_CONFIG}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    print(f"error: engine process {jax.process_index()}: process 0 stopped after an error or is gone (its log says "
          f"why); exiting {EXIT_TRANSIENT} to be restarted", file=sys.stderr, flush=True)
    return EXIT_TRANSIENT


def _start_engine(store: Store, cfg: TrainConfig, args: argparse.Namespace, *, db_retry_s: float = 0.0
                  ) -> tuple[Any, threading.Event, Any]:
    """Settle what a previous engine left running (this is the only engine on the database), then run a new one in a
    thread on its own Store (a clone: on Cloud SQL it keeps the connector). Database calls are retried for up to
    db_retry_s while it is unavailable. Returns the thread, its stop event and the engine."""
    from trainer.service.engine import Engine, recover

    recover(store, db_retry_s=db_retry_s)
    engine = Engine(store.clone(), cfg, storage_dir=args.storage, db_retry_s=db_retry_s)
    stop = threading.Event()
    thread = threading.Thread(target=engine.run, args=(stop,), name="engine", daemon=True)
    thread.start()
    return thread, stop, engine


def _serve(store: Store, args: argparse.Namespace) -> int:
    import uvicorn

    from trainer.service.api import create_app

    try:
        engine_cfg = _engine_config(args)
        config = server_config(args, engine_cfg)
        if engine_cfg is not None and (rc := _group(args, engine_cfg)) is not None:
            return rc
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _log_to_stderr(args)
    engine = _start_engine(store, engine_cfg, args)[:2] if engine_cfg is not None else None

    def stop_engine() -> None:
        if engine is not None:
            engine[1].set()
            engine[0].join(60)

    # A shutdown waits for open long-polls at most this long; the SDK retries a cut poll on its own.
    try:
        _run_uvicorn(uvicorn.Config(create_app(store, config), host=args.host, port=args.port,
                                    log_level=args.log_level, timeout_graceful_shutdown=3), stop_engine)
    finally:
        stop_engine()
    return 0


def _run_uvicorn(config: Any, on_exit: Any) -> None:
    """uvicorn.Server(config).run(), calling on_exit() after the server has shut down but before uvicorn re-raises the
    SIGTERM it caught (uvicorn/server.py capture_signals), which would end the process before the engine stops its
    followers."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    on_exit()

    Server(config).run()


def _engine(args: argparse.Namespace) -> int:
    """The engine alone, as the stack's engine JobSet runs it: exit codes in the module docstring."""
    try:
        cfg = _engine_config(args)
        assert cfg is not None and cfg.service is not None
        retry_s = cfg.service.db_retry_s
        if (rc := _group(args, cfg)) is not None:
            return rc
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as err:
        if (rc := _restart_code(err)) is None:
            raise
        return rc
    _log_to_stderr(args)
    # Until the engine thread runs, SIGTERM ends the start-up at once with 143 (a Python handler: with
    # jax.distributed up, its preemption notifier would otherwise take the signal and nothing would act on it).
    signal.signal(signal.SIGTERM, _exit_stopped)
    store: Store | None = None
    try:
        # Only process 0 talks to the database; the followers wait in run_follower meanwhile.
        store = retry_database(lambda: open_store(args), "open the store (and create its schema)", within_s=retry_s)
        thread, stop, engine = _start_engine(store, cfg, args, db_retry_s=retry_s)
    except BaseException as err:  # SystemExit(143) from a SIGTERM too: close the store on the way out
        if store is not None:
            store.close()
        if not isinstance(err, Exception):
            _stop_followers(EXIT_STOPPED if isinstance(err, SystemExit) and err.code == EXIT_STOPPED else EXIT_CONFIG)
            raise
        if (rc := _restart_code(err)) is not None:
            _stop_followers(rc)
            return rc
        _stop_followers(EXIT_CONFIG)  # a bug, on every process: the JobSet fails whichever pod it judges first
        if isinstance(err, (ValueError, ConfigError, StoreError)):  # e.g. half-set Cloud SQL variables
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
            return EXIT_CONFIG
        raise
    terminated = threading.Event()

    def on_sigterm(*_: Any) -> None:
        terminated.set()
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        stop.set()
        thread.join(30)
        return EXIT_INTERRUPTED
    finally:
        engine.store.close()
        store.close()
    # 143 (128 + SIGTERM), the trainer's code for a preemption: the JobSet restarts the engine on it. The loop
    # retries every error itself, so ending without a SIGTERM is a failure: 42, a restart. 0 would complete the
    # JobSet and leave the service without an engine.
    if terminated.is_set():
        return EXIT_STOPPED
    print(f"error: the engine stopped without a SIGTERM (its log says why); exiting {EXIT_TRANSIENT} to be "
          "restarted", file=sys.stderr, flush=True)
    return EXIT_TRANSIENT


def _keys(store: Store, args: argparse.Namespace) -> int:
    if args.action == "create":
        row, key = auth.create_key(store, args.name)
        print(f"created key {row.id} ({row.name}). Store it now; it cannot be shown again:", file=sys.stderr)
        print(key)
        return 0
    if args.action == "import":
        key = sys.stdin.readline().strip() if args.key == "-" else args.key
        try:
            row = auth.import_key(store, args.name, key, allow_weak=args.allow_weak)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"imported key {row.id} ({row.name})")
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


def main(argv: Sequence[str] | None = None, prog: str = "python -m trainer.service") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    args.argv = argv
    if args.command == "engine":
        return _engine(args)  # opens its store once it is process 0, retrying while the database is unavailable
    store = open_store(args)
    try:
        if args.command == "keys":
            return _keys(store, args)
        if args.command == "serve":
            return _serve(store, args)
        raise AssertionError(args.command)
    finally:
        store.close()
