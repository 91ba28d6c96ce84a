"""`python -m trainer.stage` (the staging Job's command) against the real huggingface_hub, offline: a Hugging Face
cache is built in tmp_path in the hub's own layout (refs/<branch> -> commit, snapshots/<commit>/<file> symlinked to
blobs/<hash>), HF_HUB_CACHE points at it and HF_HUB_OFFLINE=1, so snapshot_download and hf_hub_download resolve from
it. The one test that needs a failing Hub points HF_ENDPOINT at a loopback port nothing listens on."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer import stage
from trainer.model.hf import check_hf
from trainer.model.tokenizer import load_tokenizer
from trainer.rl.tasks import get_task

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
REPO = "test-org/tiny-qwen"
SHA_MAIN = hashlib.sha1(b"main").hexdigest()
SHA_V2 = hashlib.sha1(b"v2").hexdigest()
SHA_DATA = hashlib.sha1(b"data").hexdigest()
PARQUET = "main/train-00000-of-00001.parquet"
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to her "
                 "friends in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A box holds 12 eggs. How many eggs are in 4 boxes?", "answer": "4 * 12 = <<4*12=48>>48\n#### 48"},
    {"question": "Sam had 20 stickers and gave 7 away. How many are left?", "answer": "20 - 7 = 13\n#### 13"},
]


def _tokenizer_json() -> bytes:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1, "clips": 2, "eggs": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    return tok.to_str().encode()


def _fixture_files(name: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (FIXTURES / name).iterdir()
            if p.name.endswith((".json", ".safetensors")) and p.name != "reference.json"}


def add_snapshot(cache: Path, repo: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = (),
                 repo_type: str = "model") -> None:
    """One commit of `repo` in the hub cache's layout, as huggingface_hub writes it."""
    folder = cache / f"{repo_type}s--{repo.replace('/', '--')}"
    for name, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)


def _parquet(rows: list[dict[str, str]]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


@pytest.fixture
def hub(tmp_path: Path) -> Path:
    cache = tmp_path / "hub"
    qwen = _fixture_files("qwen3_tied_bf16")
    extras = {  # what a real repo also holds and the stage must leave behind
        "README.md": b"# tiny\n",
        "original/params.json": b"{}",
        "consolidated.safetensors": qwen["model.safetensors"],
    }
    # transformers 5 keeps a chat template in chat_template.jinja, not in tokenizer_config.json (task.chat_template).
    tokenizer = {"tokenizer.json": _tokenizer_json(),
                 "tokenizer_config.json": json.dumps({"eos_token": "<|endoftext|>"}).encode(),
                 "chat_template.jinja": b"{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    add_snapshot(cache, REPO, SHA_MAIN, qwen | tokenizer | extras, refs=("main",))
    add_snapshot(cache, REPO, SHA_V2, _fixture_files("llama3_untied_sharded"), refs=("v2",))
    # A qwen3 config over qwen2 weights: config.json is fine, the checkpoint is not.
    bad = {"config.json": qwen["config.json"], "model.safetensors": _fixture_files("qwen2_bias")["model.safetensors"]}
    add_snapshot(cache, "test-org/bad-weights", SHA_MAIN, bad, refs=("main",))
    gpt2 = {"config.json": json.dumps({"model_type": "gpt2"}).encode(), "model.safetensors": qwen["model.safetensors"]}
    add_snapshot(cache, "test-org/gpt2", SHA_MAIN, gpt2, refs=("main",))
    jsonl = "".join(json.dumps(r) + "\n" for r in GSM8K_ROWS).encode()
    add_snapshot(cache, "openai/gsm8k", SHA_DATA, {
        PARQUET: _parquet(GSM8K_ROWS),
        "main/train.jsonl": jsonl,
        "other/no-answers.parquet": _parquet([{"question": "q", "solution": "#### 1"}]),
        "main/bad.jsonl": b'{"question": "q", "answer": "no number"}\n',
    }, refs=("main",), repo_type="dataset")
    return cache


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update({"HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf-home"), "HF_HUB_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1"} | extra)
    return env


def run_stage(cache: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainer.stage", *args], cwd=ROOT, env=_env(cache, **env),
                          capture_output=True, text=True, timeout=60)


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_stages_model_and_dataset_then_a_second_run_skips(hub: Path, tmp_path: Path) -> None:
    out, data = tmp_path / "ckpt" / "models" / "TinyQwen", tmp_path / "ckpt" / "data" / "gsm8k" / "train.jsonl"
    args = ("--model", REPO, "--model-to", str(out),
            "--dataset", "openai/gsm8k", "--dataset-file", PARQUET, "--dataset-to", str(data))
    r = run_stage(hub, *args)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr

    staged = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "chat_template.jinja"}
    assert {p.name for p in out.iterdir()} == staged | {stage.MARKER}  # no README, original/, consolidated, .cache/
    cfg = check_hf(out)
    assert (cfg.family, cfg.param_dtype) == ("qwen3", "bfloat16")
    assert load_tokenizer(out).eos_id == 1  # the config's `tokenizer:` is the same folder
    marker = json.loads((out / stage.MARKER).read_text())
    assert (marker["repo"], marker["revision"], marker["commit"]) == (REPO, None, SHA_MAIN)
    assert {f["path"]: f["size"] for f in marker["files"]} == {n: (out / n).stat().st_size for n in staged}
    times = _mtimes(out)
    assert times[stage.MARKER] >= max(t for n, t in times.items() if n != stage.MARKER)  # written last

    # One line per file with its size, and a summary.
    fetched = [line for line in r.stdout.splitlines() if line.startswith("stage: fetched ")]
    assert len(fetched) == len(staged) + 1  # + the dataset file
    assert any("model.safetensors (142.50 kB)" in line for line in fetched)
    assert f"model: staged {len(staged)} files, " in r.stdout and " s into " in r.stdout

    task = get_task("gsm8k", path=str(data))
    assert len(task) == len(GSM8K_ROWS)  # type: ignore[arg-type]
    assert {task.example(i).fields["answer"] for i in range(3)} == {"72", "48", "13"}
    assert [json.loads(line) for line in data.read_text().splitlines()] == GSM8K_ROWS
    dmarker = json.loads(Path(f"{data}{stage.DATASET_MARKER_SUFFIX}").read_text())
    assert (dmarker["repo"], dmarker["file"], dmarker["commit"], dmarker["rows"]) == ("openai/gsm8k", PARQUET,
                                                                                      SHA_DATA, 3)
    # The cache is left as found (every file was in it before).
    assert (hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / SHA_MAIN / "model.safetensors").is_file()

    data_mtime = data.stat().st_mtime_ns
    again = run_stage(hub, *args)
    assert again.returncode == 0, again.stderr
    assert "already staged" in again.stdout and "skipping" in again.stdout
    assert "fetched" not in again.stdout
    assert _mtimes(out) == times and data.stat().st_mtime_ns == data_mtime


def test_another_revision_restages_and_drops_the_old_files(hub: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    assert run_stage(hub, "--model", REPO, "--model-to", str(out)).returncode == 0

    r = run_stage(hub, "--model", REPO, "--revision", "v2", "--model-to", str(out))
    assert r.returncode == 0, r.stderr
    assert "staging" in r.stdout and "in its place" in r.stdout
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors.index.json", "model-00001-of-00003.safetensors", stage.MARKER} <= names
    assert not names & {"model.safetensors", "tokenizer.json", "tokenizer_config.json"}  # main's, gone
    assert check_hf(out).family == "llama"
    marker = json.loads((out / stage.MARKER).read_text())
    assert (marker["revision"], marker["commit"]) == ("v2", SHA_V2)

    # No --revision accepts what is staged; the same --revision too; another one stages again.
    for extra in ((), ("--revision", "v2")):
        r = run_stage(hub, "--model", REPO, *extra, "--model-to", str(out))
        assert r.returncode == 0 and f"{REPO}@{SHA_V2} already staged" in r.stdout
    r = run_stage(hub, "--model", REPO, "--revision", "main", "--model-to", str(out))
    assert r.returncode == 0 and check_hf(out).family == "qwen3"
    assert not (out / "model.safetensors.index.json").exists()


def test_a_retried_run_keeps_the_files_an_interrupted_one_placed(hub: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    shard3 = "model-00003-of-00003.safetensors"
    snap = hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / SHA_V2
    (snap / shard3).rename(tmp_path / shard3)  # not in the cache: offline, this attempt fails on it

    r = run_stage(hub, "--model", REPO, "--revision", "v2", "--model-to", str(out), "--workers", "1")
    assert r.returncode == 2 and f"file '{shard3}' not in the local Hugging Face cache" in r.stderr
    assert not (out / stage.MARKER).exists() and (out / stage.JOURNAL).exists()

    (tmp_path / shard3).rename(snap / shard3)
    r = run_stage(hub, "--model", REPO, "--revision", "v2", "--model-to", str(out), "--workers", "1")
    assert r.returncode == 0, r.stderr
    assert "kept model-00001-of-00003.safetensors" in r.stdout and f"fetched {shard3}" in r.stdout
    assert (out / stage.MARKER).exists() and not (out / stage.JOURNAL).exists()
    assert not list(out.glob(f"*{stage.PARTIAL}"))
    assert check_hf(out).family == "llama"


def test_weights_this_run_downloaded_leave_the_local_cache(monkeypatch: pytest.MonkeyPatch, hub: Path,
                                                          tmp_path: Path) -> None:
    """In production the cache is local disk and the weights are not in it: each one is deleted once copied, so the
    disk holds --workers files at a time. Here "not in it before" is what try_to_load_from_cache is made to say."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    real = huggingface_hub.try_to_load_from_cache
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache",
                        lambda repo, name, **kw: None if name.endswith(".safetensors") else real(repo, name, **kw))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    out = tmp_path / "model"
    stage.stage_model(REPO, "v2", out, workers=2)
    assert check_hf(out).family == "llama"
    snap = hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / SHA_V2
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "generation_config.json",
                                                      "model.safetensors.index.json"]
    blobs = {p.name for p in (snap.parents[1] / "blobs").iterdir()}
    assert not {hashlib.sha256((out / n).read_bytes()).hexdigest() for n in os.listdir(out)
                if n.endswith(".safetensors")} & blobs


def _fails_cleanly(r: subprocess.CompletedProcess[str], code: int, start: str) -> None:
    assert r.returncode == code, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {start}"), r.stderr
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.parametrize(("args", "start", "fetched"), [
    (("--model", "test-org/nope"), "--model test-org/nope: not in the local Hugging Face cache", False),
    (("--model", REPO, "--revision", "v9"), f"--model {REPO}: not in the local Hugging Face cache", False),
    (("--model", "test-org/gpt2"), "--model test-org/gpt2: the trainer cannot import this model: unsupported "
     "model_type 'gpt2'", False),
    (("--model", "test-org/bad-weights"), "--model test-org/bad-weights: the staged checkpoint fails the trainer's "
     "check: init.path:", True),
], ids=["unknown-repo", "unknown-revision", "unsupported-architecture", "fails-check_hf"])
def test_what_a_retry_cannot_fix_exits_2_in_one_line(hub: Path, tmp_path: Path, args: tuple[str, ...], start: str,
                                                     fetched: bool) -> None:
    out = tmp_path / "model"
    _fails_cleanly(run_stage(hub, *args, "--model-to", str(out)), 2, start)
    assert not (out / stage.MARKER).exists()
    assert (out / "model.safetensors").exists() == fetched  # an unsupported config stops before any weight


@pytest.mark.parametrize(("file", "start"), [
    ("main/missing.parquet", "--dataset openai/gsm8k: --dataset-file main/missing.parquet not in the local"),
    ("other/no-answers.parquet", "--dataset-file other/no-answers.parquet: no column(s) answer"),
    ("main/bad.jsonl", "--dataset-file main/bad.jsonl: the gsm8k task cannot read it: main/bad.jsonl:1: answer has "
     "no number"),
])
def test_a_bad_dataset_file_exits_2_and_leaves_no_file(hub: Path, tmp_path: Path, file: str, start: str) -> None:
    data = tmp_path / "data" / "train.jsonl"
    r = run_stage(hub, "--dataset", "openai/gsm8k", "--dataset-file", file, "--dataset-to", str(data))
    _fails_cleanly(r, 2, start)
    assert not data.exists()
    assert not data.parent.exists() or not list(data.parent.iterdir())  # no temporary file or marker left


def test_a_jsonl_dataset_file_is_copied_as_is(hub: Path, tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    r = run_stage(hub, "--dataset", "openai/gsm8k", "--dataset-file", "main/train.jsonl", "--dataset-to", str(data))
    assert r.returncode == 0, r.stderr
    src = hub / "datasets--openai--gsm8k" / "snapshots" / SHA_DATA / "main" / "train.jsonl"
    assert data.read_bytes() == src.read_bytes()


def test_an_unreachable_hub_exits_42(hub: Path, tmp_path: Path) -> None:
    with socket.socket() as sock:  # bound, not listening: connections to it are refused at once
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        r = run_stage(hub, "--model", "test-org/not-cached", "--model-to", str(tmp_path / "m"),
                      HF_HUB_OFFLINE="0", HF_ENDPOINT=endpoint)
    _fails_cleanly(r, 42, "--model test-org/not-cached: network failure talking to the Hugging Face Hub; exiting 42")


def test_flags_that_go_together() -> None:
    for argv in ([], ["--model", REPO], ["--dataset", "d", "--dataset-to", "f"], ["--revision", "v2"],
                 ["--hub-dataset", QA], ["--splits-to", "d"], ["--hub-config", "main"]):
        with pytest.raises(SystemExit) as exc:
            stage.main(argv)
        assert exc.value.code == 2


# ---------------------------------------------------------------------------------------------- dataset splits

QA = "test-org/qa"
SHA_QA, SHA_QA2 = hashlib.sha1(b"qa").hexdigest(), hashlib.sha1(b"qa2").hexdigest()
QA_ROWS = [{"prompt": f"{a} + {a}?", "answer": 2 * a, "level": a % 2} for a in range(1, 9)]


@pytest.fixture
def qa_hub(tmp_path: Path) -> Path:
    """A dataset repo with two configs in the layouts the Hub uses: main/ with a train split in two parquet shards
    and a test split, other/ with JSONL; v2 drops main's second shard."""
    cache = tmp_path / "hub"
    jsonl = "".join(json.dumps(r) + "\n" for r in QA_ROWS[:2]).encode()
    files = {"README.md": b"# qa\n", "main/train-00000-of-00002.parquet": _parquet(QA_ROWS[:3]),
             "main/train-00001-of-00002.parquet": _parquet(QA_ROWS[3:6]),
             "main/test-00000-of-00001.parquet": _parquet(QA_ROWS[6:]), "other/train.jsonl": jsonl}
    add_snapshot(cache, QA, SHA_QA, files, refs=("main",), repo_type="dataset")
    v2 = {k: v for k, v in files.items() if "00001-of-00002" not in k}
    add_snapshot(cache, QA, SHA_QA2, v2, refs=("v2",), repo_type="dataset")
    return cache


def test_stages_a_datasets_splits_for_the_dataset_task(qa_hub: Path, tmp_path: Path) -> None:
    """--hub-dataset (the dataset task's task.hub, as the stack's Job passes it): the config's split files into the
    folder task.path names, which the dataset task then reads offline, split by split."""
    out = tmp_path / "ckpt" / "data" / "qa"
    args = ("--hub-dataset", QA, "--hub-config", "main", "--splits-to", str(out))
    r = run_stage(qa_hub, *args)
    assert r.returncode == 0, r.stderr
    assert "splits test, train, 3 files" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "train-00000-of-00002.parquet", "train-00001-of-00002.parquet", "test-00000-of-00001.parquet", stage.MARKER])
    marker = json.loads((out / stage.MARKER).read_text())
    assert (marker["repo"], marker["config"], marker["commit"], marker["splits"]) == (QA, "main", SHA_QA,
                                                                                       ["test", "train"])
    train = get_task("dataset", path=str(out), shuffle=False)
    assert [train.example(i).prompt for i in range(6)] == [r["prompt"] for r in QA_ROWS[:6]]
    test = get_task("dataset", path=str(out), split="test", filter={"field": "level", "equals": 0}, shuffle=False)
    assert test.example(0).fields["answer"] == "16"
    assert len(test) == 1  # type: ignore[arg-type]  # the dataset task is sized (the Task protocol is not)

    again = run_stage(qa_hub, *args)
    assert again.returncode == 0 and "already staged" in again.stdout and "dataset: staging" not in again.stdout

    # Another revision replaces the folder's files: the shard v2 lacks is gone.
    r = run_stage(qa_hub, *args[:4], "--hub-revision", "v2", *args[4:])
    assert r.returncode == 0, r.stderr
    assert not (out / "train-00001-of-00002.parquet").exists()
    assert len(get_task("dataset", path=str(out))) == 3  # type: ignore[arg-type]  # sized, as above


def test_the_hubs_parquet_conversion_is_a_folder_per_split(qa_hub: Path, tmp_path: Path) -> None:
    """A dataset kept in another format is read from the Hub's own conversion (revision refs/convert/parquet), whose
    layout is <config>/<split>/NNNN.parquet: the folder keeps it, and the dataset task reads it."""
    sha = hashlib.sha1(b"converted").hexdigest()
    add_snapshot(qa_hub, QA, sha, {"main/train/0000.parquet": _parquet(QA_ROWS[:5]),
                                   "main/validation/0000.parquet": _parquet(QA_ROWS[5:])}, repo_type="dataset")
    ref = qa_hub / f"datasets--{QA.replace('/', '--')}" / "refs" / "refs" / "convert" / "parquet"
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(sha)  # huggingface_hub's cache keeps a ref named refs/convert/parquet under that path
    out = tmp_path / "qa"
    r = run_stage(qa_hub, "--hub-dataset", QA, "--hub-config", "main", "--hub-revision", "refs/convert/parquet",
                  "--splits-to", str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "validation" / "0000.parquet").is_file()
    val = get_task("dataset", path=str(out), split="validation", shuffle=False)
    assert [val.example(i).prompt for i in range(3)] == [r["prompt"] for r in QA_ROWS[5:]]


def test_a_repo_of_configs_needs_hub_config(qa_hub: Path, tmp_path: Path) -> None:
    """Without task.hub_config, main/ and other/ would be read as splits named main and other: refused, naming them."""
    out = tmp_path / "qa"
    r = run_stage(qa_hub, "--hub-dataset", QA, "--splits-to", str(out))
    _fails_cleanly(r, 2, f"--hub-dataset {QA}: its folders main each hold splits of their own")
    assert "set task.hub_config to one" in r.stderr and not (out / stage.MARKER).exists()


def test_a_restage_cut_off_then_retried_leaves_only_the_new_revisions_files(qa_hub: Path, tmp_path: Path) -> None:
    """v1 staged; a restage to v2 cut off after the marker went (a preemption); the retry must drop v1's extra shard
    even though no marker lists it any more, or the trainer reads both revisions' rows."""
    out = tmp_path / "qa"
    args = ("--hub-dataset", QA, "--hub-config", "main", "--splits-to", str(out))
    assert run_stage(qa_hub, *args).returncode == 0
    (out / stage.MARKER).unlink()  # what the cut-off restage left: v1's files, no marker
    r = run_stage(qa_hub, *args[:4], "--hub-revision", "v2", *args[4:])
    assert r.returncode == 0, r.stderr
    assert "removed train-00001-of-00002.parquet (not in this revision)" in r.stdout
    assert len(get_task("dataset", path=str(out))) == 3  # type: ignore[arg-type]  # sized: v2's rows only
    # The pin removed: back to the default branch (v1), not "already staged" at v2.
    again = run_stage(qa_hub, *args)
    assert again.returncode == 0 and "already staged" not in again.stdout
    assert len(get_task("dataset", path=str(out))) == 6  # type: ignore[arg-type]


def test_a_dataset_without_split_files_exits_2_naming_its_folders(qa_hub: Path, tmp_path: Path) -> None:
    out = tmp_path / "qa"
    r = run_stage(qa_hub, "--hub-dataset", QA, "--splits-to", str(out), "--hub-config", "nope")
    _fails_cleanly(r, 2, f"--hub-dataset {QA}: no split files")
    assert "in the folder nope/" in r.stderr and "its folders with data files: main, other" in r.stderr
    assert not (out / stage.MARKER).exists()
    _fails_cleanly(run_stage(qa_hub, "--hub-dataset", "test-org/none", "--splits-to", str(out)), 2,
                   "--hub-dataset test-org/none: not in the local Hugging Face cache")


# ---------------------------------------------------------------------------------------------- the exit-code map


def _http_error(cls: type, status: int) -> BaseException:
    response = SimpleNamespace(status_code=status, headers={}, request=None)
    return cls(f"HTTP {status}", response=response)


def _caused(err: BaseException, cause: BaseException) -> BaseException:
    err.__cause__ = cause
    return err


def _hub_errors() -> list[tuple[str, BaseException, int | None]]:
    from huggingface_hub import errors as e

    local = e.LocalEntryNotFoundError
    return [
        ("gated", _http_error(e.GatedRepoError, 403), 2),
        ("not-found", _http_error(e.RepositoryNotFoundError, 401), 2),
        ("revision", _http_error(e.RevisionNotFoundError, 404), 2),
        ("entry", _http_error(e.RemoteEntryNotFoundError, 404), 2),
        ("unauthorized", _http_error(e.HfHubHTTPError, 401), 2),
        ("forbidden", _http_error(e.HfHubHTTPError, 403), 2),
        ("bad-request", _http_error(e.HfHubHTTPError, 400), 2),
        ("invalid-id", e.HFValidationError("Repo id must be in the form 'repo_name'"), 2),
        ("rate-limited", _http_error(e.HfHubHTTPError, 429), 42),
        ("server-error", _http_error(e.HfHubHTTPError, 503), 42),
        ("local-from-403", _caused(local("cannot find"), _http_error(e.HfHubHTTPError, 403)), 2),
        ("local-from-502", _caused(local("cannot find"), _http_error(e.HfHubHTTPError, 502)), 42),
        ("local-from-connection", _caused(local("check your connection"), ConnectionResetError(104, "reset")), 42),
        ("timeout", TimeoutError("read timed out"), 42),
        ("connection", ConnectionRefusedError(111, "Connection refused"), 42),
        ("a-bug", KeyError("weight_map"), None),
    ]


@pytest.mark.parametrize("case", range(len(_hub_errors())), ids=[c[0] for c in _hub_errors()])
def test_hub_failures_map_to_2_or_42(monkeypatch: pytest.MonkeyPatch, case: int) -> None:
    monkeypatch.setattr(stage, "_offline", lambda: False)
    _, err, code = _hub_errors()[case]
    src = stage.Source("--model", REPO, "v2", "--revision")
    mapped = stage.classify(err, src, "model.safetensors")
    assert (mapped.code if mapped else None) == code
    if mapped is not None:
        assert mapped.args[0].startswith(("--model test-org/tiny-qwen", "--revision v2"))
        assert "\n" not in mapped.args[0]


def test_transport_errors_of_the_hubs_http_library_are_transient() -> None:
    import importlib.util

    httpx = pytest.importorskip("httpx2" if importlib.util.find_spec("httpx2") else "httpx")  # hub >= 2 / 1.x
    for err in (httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), httpx.RemoteProtocolError("eof")):
        mapped = stage.classify(err, stage.Source("--dataset", "openai/gsm8k", None, "--dataset-revision"))
        assert mapped is not None and mapped.code == 42
