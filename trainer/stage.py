"""`python -m trainer.stage`: put a Hugging Face model, and optionally one GSM8K dataset file or the splits of a
dataset, where a trainer config reads them (init.path and tokenizer, task.path), usually on the checkpoint bucket's
GCS FUSE mount.

    python -m trainer.stage --model REPO_ID [--revision REV] --model-to DIR
                            [--dataset REPO_ID --dataset-file PATH_IN_REPO [--dataset-revision REV] --dataset-to FILE]
                            [--hub-dataset REPO_ID [--hub-config NAME] [--hub-revision REV] --splits-to DIR]

Model: config.json and the repo's other top-level *.json files (tokenizer.json, tokenizer_config.json,
special_tokens_map.json, generation_config.json, model.safetensors.index.json: what trainer/model/hf.py and
trainer/model/tokenizer.py read) plus tokenizer.model, then exactly the safetensors files the index names (or
model.safetensors), so duplicate weight sets (consolidated.safetensors, original/) are never fetched. config.json is
checked before any weight is fetched; the result must pass the trainer's own check_hf (and load as a tokenizer when it
has tokenizer.json), and only then is DIR/.gke-tpu-rl-staged.json written, last.

Files go through the local Hugging Face cache (HF_HUB_CACHE, default ~/.cache/huggingface/hub; HF_TOKEN for gated
repos) and are copied into DIR under a temporary name, then renamed onto their own name: file renames only (GCS FUSE
refuses directory renames on flat buckets), no huggingface_hub metadata in DIR. A weight file this run downloaded is
deleted from the cache once copied, so local disk holds at most --workers files at a time, not the whole model.
A journal (DIR/.gke-tpu-rl-staging.json) lets a retried Job keep the files an interrupted one already placed.

Idempotent: a marker for the same repo (and the same --revision, when one is given) whose files are all there skips
the model with one log line; another repo or revision re-stages, removing the files the old one had. A branch such
as main is not re-resolved once staged: pin a commit sha as --revision to move on.

Dataset: the one file, .parquet (converted with pyarrow) or .jsonl (copied as is), written as GSM8K JSONL
({"question", "answer"}) through a temporary file and os.replace, validated with the trainer's gsm8k task loader
before it replaces FILE; FILE.staged.json marks it.

Dataset splits (the dataset task's task.hub, hub_config, hub_revision and path): the parquet and JSONL files of the
config's folder (or the repo's), as they are, into DIR under their names, each through a temporary name; the
trainer's dataset task reads DIR as a folder of splits. DIR/.gke-tpu-rl-staged.json marks them, written last.

Exit codes (the trainer's, trainer/run/cli.py): 0 staged or already staged; 2 for what a retry cannot fix (a repo,
revision or file that is not there, a gated repo or a refused token, a checkpoint or dataset the trainer would
refuse), one line naming the flag; 42 for transient failures (connection errors, timeouts, HTTP 408/429/5xx) so the
Job's backoff retries. Anything else is a bug: a traceback and exit 1.

Over 600 lines as one module on purpose: it is the staging Job's one command, and its three sources (a model, a GSM8K
file, a dataset's splits) share the Hub error classification, the placement by rename and the journal; the tests
replace those shared pieces on this module. A fourth source should move each into a package of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envspec.pod import ENV_HF_TOKEN, EXIT_CONFIG, EXIT_TRANSIENT

MARKER = ".gke-tpu-rl-staged.json"
JOURNAL = ".gke-tpu-rl-staging.json"
DATASET_MARKER_SUFFIX = ".staged.json"
PARTIAL = ".stage-partial"
# The Hub's sharded file names of a split (train-00000-of-00002); a split folder of its parquet conversion holds
# 0000.parquet instead.
_SPLIT_SHARD = re.compile(r"^[A-Za-z][\w.]*-\d{5}-of-\d{5}$")
# Top-level files besides the weights: config.json, generation_config.json, model.safetensors.index.json and the
# tokenizer's JSON files (trainer/model/hf.py TOKENIZER_FILES, trainer/model/tokenizer.py), tokenizer.model for tools
# that want the SentencePiece model. "*/*" keeps subfolders (original/, onnx/, ...) out.
# chat_template.jinja: where transformers 5 writes a tokenizer's chat template (task.chat_template reads it first).
MODEL_PATTERNS = ["*.json", "tokenizer.model", "chat_template.jinja"]
TOP_LEVEL_ONLY = ["*/*"]
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_WORKERS = 2
# HTTP statuses worth a retry (huggingface_hub retries the same ones itself).
RETRY_STATUS = (408, 429, 500, 502, 503, 504)


class StageError(Exception):
    """A failure with its exit code and one line for the log."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def log(msg: str) -> None:
    print(f"stage: {msg}", flush=True)


def human(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


@contextmanager
def _replacing(dest: Path) -> Iterator[Path]:
    """A temporary file beside `dest` to write; renamed onto `dest` when the block succeeds (a file rename: fine on
    GCS FUSE), removed either way."""
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}{PARTIAL}")
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json(path: Path, obj: Any) -> None:
    with _replacing(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2) + "\n")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _place(src: str | Path, dest: Path) -> int:
    """Copy src onto dest through a temporary name beside it and a rename; the bytes written."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _replacing(dest) as tmp:
        shutil.copyfile(src, tmp)
    return dest.stat().st_size


def _token() -> str | None:
    return os.environ.get(ENV_HF_TOKEN) or None


def _offline() -> bool:
    from huggingface_hub import constants

    check = getattr(constants, "is_offline_mode", None)
    return bool(check() if callable(check) else constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


# ---------------------------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class Source:
    """What a hub call fetches, named by the flags that chose it (for error lines)."""

    flag: str  # --model / --dataset
    repo: str
    revision: str | None
    revision_flag: str  # --revision / --dataset-revision
    file_flag: str | None = None  # --dataset-file, or None for a model file the stage picked


def _status(err: BaseException) -> int | None:
    status = getattr(getattr(err, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _is_transport_error(err: BaseException) -> bool:
    """Connection failures and timeouts, of whichever HTTP library huggingface_hub uses (requests, httpx, httpx2)."""
    names = {c.__name__ for c in type(err).__mro__}
    return isinstance(err, (ConnectionError, TimeoutError)) or bool(
        names & {"TransportError", "TimeoutException", "ConnectionError", "Timeout", "ChunkedEncodingError"}
    )


def classify(err: BaseException, src: Source, filename: str | None = None) -> StageError | None:
    """The StageError a hub failure maps to (2: a retry cannot fix it, 42: transient), or None for a bug."""
    from huggingface_hub import errors as hf_errors

    repo = f"{src.flag} {src.repo}"
    what = f"{src.file_flag} {filename}" if src.file_flag and filename else f"file {filename!r}" if filename else ""
    rev = f" at {src.revision_flag} {src.revision}" if src.revision else ""
    token = "HF_TOKEN is set" if _token() else "HF_TOKEN is not set"

    def fatal(msg: str) -> StageError:
        return StageError(EXIT_CONFIG, msg)

    def transient(msg: str) -> StageError:
        return StageError(EXIT_TRANSIENT, f"{msg}; exiting {EXIT_TRANSIENT} to be retried: {_one_line(err)}")

    if isinstance(err, hf_errors.GatedRepoError):
        return fatal(f"{repo}: gated repository: accept its terms on huggingface.co with the account whose token is "
                     f"HF_TOKEN ({token}; a token without access to it is refused too)")
    if isinstance(err, hf_errors.RepositoryNotFoundError):
        return fatal(f"{repo}: repository not found on the Hugging Face Hub (a typo, or a private repository "
                     f"HF_TOKEN cannot see; {token})")
    if isinstance(err, hf_errors.RevisionNotFoundError):
        return fatal(f"{src.revision_flag} {src.revision}: no such revision in {src.repo}")
    disabled = getattr(hf_errors, "DisabledRepoError", None)
    if disabled is not None and isinstance(err, disabled):
        return fatal(f"{repo}: the repository is disabled on the Hugging Face Hub")
    if isinstance(err, hf_errors.LocalEntryNotFoundError):
        if _offline():
            return fatal(f"{repo}: {what + ' ' if what else ''}not in the local Hugging Face cache "
                         f"({_cache_dir()}){rev} and HF_HUB_OFFLINE is set, so nothing can be downloaded")
        # Online, huggingface_hub raises this with the HTTP or connection error that stopped it as the cause.
        cause = err.__cause__
        if cause is not None and cause is not err:
            mapped = classify(cause, src, filename)
            if mapped is not None:
                return mapped
        return transient(f"{repo}: the Hugging Face Hub could not be reached")
    if isinstance(err, hf_errors.EntryNotFoundError):
        return fatal(f"{repo}: no {what or 'such file'} in the repository{rev}")
    if isinstance(err, hf_errors.OfflineModeIsEnabled):
        return fatal(f"{repo}: HF_HUB_OFFLINE is set and this needs the Hugging Face Hub")
    if isinstance(err, hf_errors.HFValidationError):
        return fatal(f"{repo}: not a valid repository id or revision ({_one_line(err)})")
    if isinstance(err, hf_errors.HfHubHTTPError):
        status = _status(err)
        if status in (401, 403):
            return fatal(f"{repo}: the Hugging Face Hub refused access (HTTP {status}; {token}: check the token and "
                         "that its account may read the repository)")
        if status is None or status in RETRY_STATUS or status >= 500:
            return transient(f"{repo}: the Hugging Face Hub failed (HTTP {status})")
        return fatal(f"{repo}: the Hugging Face Hub answered HTTP {status}: {_one_line(err)}")
    xet = getattr(hf_errors, "XetDownloadError", None)
    if _is_transport_error(err) or (xet is not None and isinstance(err, xet)):
        return transient(f"{repo}: network failure talking to the Hugging Face Hub")
    return None


@contextmanager
def hub_errors(src: Source, filename: str | None = None) -> Iterator[None]:
    try:
        yield
    except StageError:
        raise
    except Exception as err:
        mapped = classify(err, src, filename)
        if mapped is None:
            raise
        raise mapped from None


# ---------------------------------------------------------------------------------------------- model


def _marker_files_intact(root: Path, marker: dict[str, Any]) -> str | None:
    """None when every file the marker lists is there with its size, else what is wrong."""
    files = marker.get("files")
    if not isinstance(files, list) or not files:
        return "the marker lists no files"
    for entry in files:
        path = root / str(entry.get("path"))
        try:
            size = path.stat().st_size
        except OSError:
            return f"{entry.get('path')} is missing"
        if size != entry.get("size"):
            return f"{entry.get('path')} has {size} bytes, the marker says {entry.get('size')}"
    return None


def _weight_files(snapshot: Path, repo: str) -> list[str]:
    index = snapshot / INDEX
    if not index.is_file():
        return [SINGLE]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise StageError(EXIT_CONFIG, f"--model {repo}: {INDEX} has no readable weight_map ({err!r})") from None
    if not shards or not all(isinstance(s, str) and s.endswith(".safetensors") for s in shards):
        raise StageError(EXIT_CONFIG, f"--model {repo}: {INDEX} names no safetensors shards")
    return shards


def _check_config(snapshot: Path, repo: str, commit: str) -> None:
    """Refuse an architecture the trainer cannot import before any weight is fetched."""
    from trainer.model.hf import model_config_from_hf

    cfg_file = snapshot / "config.json"
    if not cfg_file.is_file():
        raise StageError(EXIT_CONFIG, f"--model {repo}: no config.json at commit {commit} (not a transformers model?)")
    try:
        hf_cfg = json.loads(cfg_file.read_text())
        if not isinstance(hf_cfg, dict):
            raise ValueError("config.json is not a JSON object")
        model_config_from_hf(hf_cfg)
    except (ValueError, KeyError, TypeError) as err:
        msg = f"missing field {err}" if isinstance(err, KeyError) else _one_line(err)
        raise StageError(EXIT_CONFIG, f"--model {repo}: the trainer cannot import this model: {msg}") from None


def _validate_model(root: Path, repo: str) -> str:
    from trainer.base.config import ConfigError
    from trainer.model.hf import check_hf

    try:
        cfg = check_hf(root)
    except ConfigError as err:
        msg = f"--model {repo}: the staged checkpoint fails the trainer's check: {err}"
        raise StageError(EXIT_CONFIG, msg) from None
    if (root / "tokenizer.json").is_file():
        from trainer.model.tokenizer import load_tokenizer

        try:
            load_tokenizer(root)
        except Exception as err:  # tokenizers raises its own exception types
            raise StageError(EXIT_CONFIG, f"--model {repo}: tokenizer.json does not load: {_one_line(err)}") from None
    else:
        log(f"note: {repo} has no tokenizer.json: point the config's tokenizer at another directory")
    return f"{cfg.family}, {cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}, {cfg.param_dtype}"


def _remove_stale(root: Path, keep: set[str], old_files: list[str]) -> None:
    """Files an earlier staging left that this one does not have, and any weights nobody lists: a stale index or
    shard would change what check_hf and the trainer read."""
    stale = set(old_files)
    stale |= {p.name for p in root.glob("*.safetensors")} | ({INDEX} if (root / INDEX).exists() else set())
    for name in sorted(stale - keep):
        path = root / name
        if path.is_file():
            path.unlink()
            log(f"removed {name} (not in this revision)")


def _clean_partials(root: Path) -> None:
    for p in root.glob(f".*{PARTIAL}"):
        p.unlink(missing_ok=True)


class _Journal:
    """Which files of which commit are already in DIR, for a retried Job (rewritten after each file)."""

    def __init__(self, root: Path, repo: str, commit: str) -> None:
        self.path = root / JOURNAL
        self.repo, self.commit = repo, commit
        self._lock = threading.Lock()
        old = _read_json(self.path) or {}
        same = old.get("repo") == repo and old.get("commit") == commit and isinstance(old.get("files"), dict)
        self.files: dict[str, int] = dict(old["files"]) if same else {}

    def has(self, root: Path, name: str) -> bool:
        try:
            return self.files.get(name) == (root / name).stat().st_size
        except OSError:
            return False

    def add(self, name: str, size: int) -> None:
        with self._lock:
            self.files[name] = size
            _write_json(self.path, {"repo": self.repo, "commit": self.commit, "files": self.files})


def stage_model(repo: str, revision: str | None, dest: str | Path, workers: int = DEFAULT_WORKERS) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download, try_to_load_from_cache
    from huggingface_hub.utils import filter_repo_objects

    root = Path(dest)
    src = Source("--model", repo, revision, "--revision")
    marker_path = root / MARKER
    marker = _read_json(marker_path)
    if marker is not None and marker.get("repo") == repo and revision in (None, marker.get("revision")):
        problem = _marker_files_intact(root, marker)
        if problem is None:
            log(f"model: {repo}@{marker.get('commit')} already staged in {root} ({marker_path.name}); skipping")
            return root
        log(f"model: {root} has a marker for {repo} but {problem}: staging again")
    elif marker is not None:
        log(f"model: {root} holds {marker.get('repo')} (revision {marker.get('revision') or 'default'}); "
            f"staging {repo} (revision {revision or 'default'}) in its place")
    old_files = [str(f.get("path")) for f in (marker or {}).get("files", []) if isinstance(f, dict)]

    start = time.monotonic()
    cache = _cache_dir()
    token = _token()
    with hub_errors(src):
        snapshot = Path(snapshot_download(repo, revision=revision, cache_dir=cache, token=token,
                                          allow_patterns=MODEL_PATTERNS, ignore_patterns=TOP_LEVEL_ONLY))
    commit = snapshot.name
    _check_config(snapshot, repo, commit)
    small = sorted(filter_repo_objects(
        [p.relative_to(snapshot).as_posix() for p in snapshot.iterdir() if p.is_file()],
        allow_patterns=MODEL_PATTERNS, ignore_patterns=TOP_LEVEL_ONLY))
    weights = _weight_files(snapshot, repo)
    names = small + [w for w in weights if w not in small]
    log(f"model: staging {repo} (revision {revision or 'default'} -> commit {commit}) into {root}: "
        f"{len(names)} files, {len(weights)} of them weights")

    # The old marker goes first: from here until the new one is written, DIR claims nothing.
    root.mkdir(parents=True, exist_ok=True)
    marker_path.unlink(missing_ok=True)
    _clean_partials(root)
    journal = _Journal(root, repo, commit)
    sizes: dict[str, int] = {}
    done = [0]
    count_lock = threading.Lock()

    def fetch(name: str) -> None:
        if journal.has(root, name):
            sizes[name] = journal.files[name]
            with count_lock:
                done[0] += 1
                n = done[0]
            log(f"kept {name} ({human(sizes[name])}, placed by an earlier attempt) [{n}/{len(names)}]")
            return
        t0 = time.monotonic()
        with hub_errors(src, name):
            cached = isinstance(try_to_load_from_cache(repo, name, cache_dir=cache, revision=commit), str)
            path = hf_hub_download(repo, name, revision=commit, cache_dir=cache, token=token)
        size = _place(path, root / name)
        if not cached:  # fetched for DIR alone: free the local disk
            blob = os.path.realpath(path)
            Path(path).unlink(missing_ok=True)
            Path(blob).unlink(missing_ok=True)
        journal.add(name, size)
        sizes[name] = size
        with count_lock:
            done[0] += 1
            n = done[0]
        log(f"fetched {name} ({human(size)}) in {time.monotonic() - t0:.1f} s [{n}/{len(names)}]")

    for name in small:  # already in the cache: placed in order, before the weights
        fetch(name)
    _run_all(fetch, [w for w in weights if w not in small], workers)

    _remove_stale(root, set(names), old_files)
    summary = _validate_model(root, repo)
    total = sum(sizes.values())
    _write_json(marker_path, {
        "repo": repo,
        "revision": revision,
        "commit": commit,
        "files": [{"path": n, "size": sizes[n]} for n in names],
        "bytes": total,
        "staged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tool": "python -m trainer.stage",
    })
    (root / JOURNAL).unlink(missing_ok=True)
    secs = time.monotonic() - start
    log(f"model: staged {len(names)} files, {human(total)} in {secs:.1f} s into {root} ({summary})")
    return root


def _run_all(fn: Any, items: list[str], workers: int) -> None:
    """fn over items on `workers` threads; the first failure cancels what has not started and is raised."""
    if not items:
        return
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="stage") as pool:
        futures = [pool.submit(fn, item) for item in items]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in finished and f.exception() is not None]
        if failed:
            for f in futures:
                f.cancel()
            raise failed[0].exception()  # type: ignore[misc]  # not None: failed holds only those


# ---------------------------------------------------------------------------------------------- dataset


def _write_gsm8k_jsonl(source: Path, out: Path, filename: str) -> int:
    """source (.parquet or .jsonl) as GSM8K JSONL in `out`; the number of rows."""
    suffix = filename.rsplit(".", 1)[-1].lower() if "." in filename else ""
    if suffix == "jsonl":
        shutil.copyfile(source, out)
        return sum(1 for line in out.read_text().splitlines() if line.strip())
    if suffix != "parquet":
        raise StageError(EXIT_CONFIG, f"--dataset-file {filename}: expected a .parquet or .jsonl file")
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(source)
        columns = set(pf.schema_arrow.names)
        missing = {"question", "answer"} - columns
        if missing:
            raise StageError(EXIT_CONFIG, f"--dataset-file {filename}: no column(s) {', '.join(sorted(missing))} "
                             f"(it has {', '.join(sorted(columns))}); the gsm8k task reads question and answer")
        rows = 0
        with out.open("w") as f:
            for batch in pf.iter_batches(columns=["question", "answer"]):
                for row in batch.to_pylist():
                    f.write(json.dumps({"question": row["question"], "answer": row["answer"]}, ensure_ascii=False))
                    f.write("\n")
                    rows += 1
        return rows
    except StageError:
        raise
    except Exception as err:  # pyarrow's ArrowInvalid and friends
        raise StageError(EXIT_CONFIG, f"--dataset-file {filename}: not a readable parquet file: "
                         f"{_one_line(err)}") from None


def _validate_gsm8k(path: Path, filename: str) -> int:
    from trainer.rl.tasks import get_task

    try:
        task = get_task("gsm8k", path=str(path))
        n = len(task)  # type: ignore[arg-type]  # the gsm8k task is sized (the Task protocol is not)
        for i in range(min(3, n)):
            task.example(i)
    except (ValueError, KeyError, TypeError, OSError) as err:
        msg = str(err.args[0] if err.args else err).replace(str(path), filename)  # name the file, not the temp
        raise StageError(EXIT_CONFIG, f"--dataset-file {filename}: the gsm8k task cannot read it: {msg}") from None
    return n


def stage_dataset(repo: str, filename: str, dest: str | Path, revision: str | None = None) -> Path:
    from huggingface_hub import hf_hub_download

    out = Path(dest)
    marker_path = out.with_name(out.name + DATASET_MARKER_SUFFIX)
    src = Source("--dataset", repo, revision, "--dataset-revision", "--dataset-file")
    marker = _read_json(marker_path)
    if (marker is not None and marker.get("repo") == repo and marker.get("file") == filename
            and revision == marker.get("revision")):  # a pin removed is a change too: back to the default branch
        try:
            intact = out.stat().st_size == marker.get("size")
        except OSError:
            intact = False
        if intact:
            log(f"dataset: {repo}/{filename}@{marker.get('commit')} already staged as {out} "
                f"({marker_path.name}); skipping")
            return out
        log(f"dataset: {out} differs from its marker: staging again")

    start = time.monotonic()
    with hub_errors(src, filename):
        path = Path(hf_hub_download(repo, filename, repo_type="dataset", revision=revision,
                                    cache_dir=_cache_dir(), token=_token()))
    # The cache's layout: .../snapshots/<commit>/<filename>.
    commit = path.parents[len(Path(filename).parts) - 1].name
    log(f"fetched {repo}/{filename} ({human(path.stat().st_size)}) at commit {commit}")
    out.parent.mkdir(parents=True, exist_ok=True)
    marker_path.unlink(missing_ok=True)
    with _replacing(out) as tmp:
        _write_gsm8k_jsonl(path, tmp, filename)
        rows = _validate_gsm8k(tmp, filename)
    size = out.stat().st_size
    _write_json(marker_path, {
        "repo": repo,
        "revision": revision,
        "commit": commit,
        "file": filename,
        "rows": rows,
        "size": size,
        "staged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tool": "python -m trainer.stage",
    })
    log(f"dataset: staged {rows} examples, {human(size)} in {time.monotonic() - start:.1f} s as {out}")
    return out


# ---------------------------------------------------------------------------------------------- dataset splits


def _split_patterns(config: str | None) -> list[str]:
    """The repo files a folder of splits can come from: the config's folder, or (no config) every data file (a
    repo's root, data/, or <split>/ folders; huggingface_hub's fnmatch `*` crosses `/`)."""
    base = f"{config}/" if config else ""
    return [f"{base}*.parquet", f"{base}*.jsonl"]


def stage_splits(repo: str, config: str | None, revision: str | None, dest: str | Path) -> Path:
    """Every split of a Hugging Face dataset (its `config` folder, or the repo's data files), copied into the folder
    `dest` under their names in the repo (relative to the config's folder), for the dataset task's task.path. The
    repo's own data files: parquet or JSONL in the layouts the Hub uses (trainer/rl/dataset_files.py
    files_by_split); a dataset kept in another format is read from the Hub's parquet conversion with
    --hub-revision refs/convert/parquet. A marker (dest/.gke-tpu-rl-staged.json) makes a second run a no-op."""
    from huggingface_hub import snapshot_download

    from trainer.rl.dataset_files import files_by_split

    root = Path(dest)
    src = Source("--hub-dataset", repo, revision, "--hub-revision")
    marker_path = root / MARKER
    marker = _read_json(marker_path)
    if (marker is not None and marker.get("repo") == repo and marker.get("config") == config
            and revision == marker.get("revision")):  # a pin removed is a change too: back to the default branch
        problem = _marker_files_intact(root, marker)
        if problem is None:
            log(f"dataset: {repo} ({config or 'no config'})@{marker.get('commit')} already staged in {root}; skipping")
            return root
        log(f"dataset: {root} has a marker for {repo} but {problem}: staging again")
    old_files = [str(f.get("path")) for f in (marker or {}).get("files", []) if isinstance(f, dict)]

    start = time.monotonic()
    with hub_errors(src):
        snapshot = Path(snapshot_download(repo, repo_type="dataset", revision=revision, cache_dir=_cache_dir(),
                                          token=_token(), allow_patterns=_split_patterns(config)))
    base = snapshot / config if config else snapshot
    splits = files_by_split(base) if base.is_dir() else {}
    if not splits:
        folders = sorted({p.parent.relative_to(snapshot).parts[0] for p in snapshot.rglob("*")
                          if p.is_file() and p.suffix in (".parquet", ".jsonl") and p.parent != snapshot})
        hint = f"; its folders with data files: {', '.join(folders)} (set task.hub_config to one)" if folders else ""
        raise StageError(EXIT_CONFIG, f"--hub-dataset {repo}: no split files (<split>.parquet, <split>.jsonl, "
                         f"<split>-00000-of-00001.parquet or <split>/*.parquet) in "
                         f"{f'the folder {config}/' if config else 'the repository'} at commit {snapshot.name}{hint}; "
                         "a dataset kept in another format: --hub-revision refs/convert/parquet (the Hub's parquet "
                         "conversion)")
    if config is None:
        # gsm8k's layout: main/train-00000-of-00001.parquet, socratic/...: each folder is a config holding splits,
        # which files_by_split would read as splits named main and socratic.
        configs = sorted(name for name, files in splits.items()
                         if files[0].parent.name == name and all(_SPLIT_SHARD.match(f.stem) for f in files))
        if configs:
            raise StageError(EXIT_CONFIG, f"--hub-dataset {repo}: its folders {', '.join(configs)} each hold splits "
                             "of their own (files named <split>-00000-of-NNNNN): they are the dataset's configs; set "
                             "task.hub_config to one")
    names = sorted(p.relative_to(base).as_posix() for files in splits.values() for p in files)
    log(f"dataset: staging {repo} ({config or 'no config'}, revision {revision or 'default'} -> commit "
        f"{snapshot.name}) into {root}: splits {', '.join(sorted(splits))}, {len(names)} files")
    root.mkdir(parents=True, exist_ok=True)
    marker_path.unlink(missing_ok=True)
    _clean_partials(root)
    sizes = {name: _place(base / name, root / name) for name in names}
    # Every data file the folder holds that this revision does not: the marker's list alone misses what an earlier,
    # cut-off restage left (its marker was already gone), and the trainer would read those too.
    there = {p.relative_to(root).as_posix() for files in files_by_split(root).values() for p in files}
    for name in sorted((set(old_files) | there) - set(names)):
        (root / name).unlink(missing_ok=True)
        log(f"removed {name} (not in this revision)")
    _check_parquet(root, names)
    _write_json(marker_path, {
        "repo": repo,
        "config": config,
        "revision": revision,
        "commit": snapshot.name,
        "splits": sorted(splits),
        "files": [{"path": n, "size": sizes[n]} for n in names],
        "staged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "tool": "python -m trainer.stage",
    })
    log(f"dataset: staged {len(names)} files, {human(sum(sizes.values()))} in {time.monotonic() - start:.1f} s "
        f"into {root}")
    return root


def _check_parquet(root: Path, names: list[str]) -> None:
    """Each parquet file opens (the trainer reads them with pyarrow); rows and fields are the trainer's check."""
    import pyarrow.parquet as pq

    for name in names:
        if name.endswith(".parquet"):
            try:
                pq.ParquetFile(root / name)
            except Exception as err:  # pyarrow's ArrowInvalid and friends
                raise StageError(EXIT_CONFIG, f"--hub-dataset: {name} is not a readable parquet file: "
                                 f"{_one_line(err)}") from None


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.stage",
        description="Fetch a Hugging Face model (and one GSM8K dataset file) to where a trainer config reads them; "
        "skips what is already staged. HF_TOKEN is used for gated repositories.",
    )
    p.add_argument("--model", metavar="REPO_ID", help="model repository, e.g. Qwen/Qwen3-8B")
    p.add_argument("--revision", help="branch, tag or commit of --model (default: the repository's default branch)")
    p.add_argument("--model-to", metavar="DIR", help="directory to put the model in (the config's init.path)")
    p.add_argument("--dataset", metavar="REPO_ID", help="dataset repository, e.g. openai/gsm8k")
    p.add_argument("--dataset-file", metavar="PATH_IN_REPO",
                   help="the .parquet or .jsonl file in --dataset, e.g. main/train-00000-of-00001.parquet")
    p.add_argument("--dataset-revision", metavar="REV", help="branch, tag or commit of --dataset")
    p.add_argument("--dataset-to", metavar="FILE", help="the GSM8K JSONL file to write (the config's task.path)")
    p.add_argument("--hub-dataset", metavar="REPO_ID",
                   help="a dataset repository whose splits go to --splits-to (the dataset task's task.hub)")
    p.add_argument("--hub-config", metavar="NAME", help="the folder of --hub-dataset holding the config's splits "
                   "(task.hub_config), e.g. main")
    p.add_argument("--hub-revision", metavar="REV", help="branch, tag or commit of --hub-dataset (task.hub_revision)")
    p.add_argument("--splits-to", metavar="DIR", help="the folder to put the splits in (the dataset task's task.path)")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, metavar="N",
                   help=f"weight files fetched at once; each holds local disk until copied (default {DEFAULT_WORKERS})")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.model and not args.dataset and not args.hub_dataset:
        parser.error("nothing to stage: give --model and --model-to, and/or --dataset, --dataset-file and "
                     "--dataset-to, and/or --hub-dataset and --splits-to")
    if bool(args.model) != bool(args.model_to) or (args.revision and not args.model):
        parser.error("--model and --model-to go together (--revision needs them)")
    dataset_flags = (args.dataset, args.dataset_file, args.dataset_to)
    if any(dataset_flags) and not all(dataset_flags) or (args.dataset_revision and not args.dataset):
        parser.error("--dataset, --dataset-file and --dataset-to go together (--dataset-revision needs them)")
    if bool(args.hub_dataset) != bool(args.splits_to) or ((args.hub_config or args.hub_revision)
                                                          and not args.hub_dataset):
        parser.error("--hub-dataset and --splits-to go together (--hub-config and --hub-revision need them)")
    if args.workers < 1:
        parser.error("--workers must be >= 1")

    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # `kubectl logs` gets the per-file lines below instead of carriage-return bars
    try:
        if args.model:
            stage_model(args.model, args.revision, args.model_to, args.workers)
        if args.dataset:
            stage_dataset(args.dataset, args.dataset_file, args.dataset_to, args.dataset_revision)
        if args.hub_dataset:
            stage_splits(args.hub_dataset, args.hub_config, args.hub_revision, args.splits_to)
    except StageError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return err.code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
