"""`gke-tpu-rl export` / `python -m trainer export`: a run's checkpoint as a Hugging Face checkpoint.

A full-weights run, or a LoRA run merged into its base (W + scale x A B, `lora.merge`), is written as
`model.safetensors` (sharded with an index above 4 GiB, as transformers writes them), `config.json` of the model's
family, `generation_config.json` and the run's tokenizer files; a LoRA run can also be written as its PEFT adapter
(`lora.export_peft`). The run folder and its checkpoints are read where they are, a local folder or `gs://`, through
orbax (trainer/rl/checkpoint.py `read_saved`); the output is a local folder.

What the run's config.yaml names (init.path, tokenizer) is found as written, else moved the way the run folder moved:
a pod's run folder /checkpoints/grpo/run read as gs://BUCKET/grpo/run finds /checkpoints/models/x at
gs://BUCKET/models/x.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from etils import epath

from envspec.pod import EXIT_CONFIG
from trainer.base.config import ConfigError, InitConfig, TrainConfig, config_from_dict
from trainer.rl.train import RUN_CONFIG

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
LORA_MODES = ("merged", "adapter")


def build_parser(prog: str = "gke-tpu-rl export") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Write a run's checkpoint as a Hugging Face checkpoint (model.safetensors, config.json, "
        "generation_config.json, the run's tokenizer files) that transformers and vLLM load; a LoRA run merged into "
        "its base, or as its PEFT adapter. Reads a local run folder or one in a bucket (gs://).",
    )
    p.add_argument("run", metavar="RUN_OR_CHECKPOINT_DIR",
                   help="the run folder (holds config.yaml) or its checkpoint folder (holds the step folders), "
                   "local or gs://")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty local folder to write")
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint step to export (default: the newest)")
    p.add_argument("--lora", choices=LORA_MODES,
                   help="a LoRA run: merged into the base weights (the default) or the PEFT adapter alone")
    p.add_argument("--slot", type=int, default=0, metavar="I",
                   help="the adapter slot of a LoRA run with several (default 0)")
    p.add_argument("--base", metavar="DIR",
                   help="the local Hugging Face checkpoint the run started from (default: the run's init.path); "
                   "its config.json keys, generation_config.json and, for --lora merged, its weights")
    return p


@dataclass(frozen=True)
class Run:
    cfg: TrainConfig
    run_dir: epath.Path  # where config.yaml is
    checkpoints: epath.Path
    steps: list[int]  # finished saves, ascending
    unfinished: list[int]


def _parts(path: str) -> list[str]:
    return [p for p in str(path).split("/") if p]


def moved_path(named: str, recorded_run: str, run_dir: str) -> str | None:
    """Where `named` is if it moved with the run folder from `recorded_run` (the config's run_dir) to `run_dir`: the
    two share a tail (grpo/run), their heads differ (/checkpoints, gs://BUCKET); None if `named` is not under the
    recorded head."""
    rec, now = _parts(recorded_run), _parts(run_dir)
    tail = 0
    while tail < min(len(rec), len(now)) and rec[-1 - tail] == now[-1 - tail]:
        tail += 1
    head = rec[:len(rec) - tail]
    mine = _parts(named)
    if named.startswith("/") != recorded_run.startswith("/") or mine[:len(head)] != head or len(mine) == len(head):
        return None
    now_head = run_dir.rstrip("/")
    for _ in range(tail):
        now_head = now_head.rsplit("/", 1)[0]
    return now_head + "/" + "/".join(mine[len(head):])


def relocated(named: str, recorded_run: str, run_dir: epath.Path) -> epath.Path:
    """`named` (a path in the run's config) where it is now: as written if it exists here, else where it moved with
    the run folder (moved_path), if it is there."""
    path = epath.Path(named)
    if path.exists():
        return path
    moved = moved_path(named, recorded_run, str(run_dir))
    return epath.Path(moved) if moved is not None and epath.Path(moved).exists() else path


def gcs_readable() -> bool:
    """epath reads gs:// through fsspec's gcsfs (orbax's arrays through tensorstore, which needs nothing more)."""
    import importlib.util

    return importlib.util.find_spec("gcsfs") is not None


def _load_config(file: epath.Path) -> TrainConfig:
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{file}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: not a trainer config")
    # The saved config holds the model it read from init.path; validate it as with_model does, then put init back.
    init = InitConfig.model_validate(data.get("init") or {})
    data["init"] = {"from": "random", "path": None}
    try:
        cfg = config_from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"{file}: {err}") from None
    return cfg.model_copy(update={"init": init})


def _has_steps(directory: epath.Path) -> bool:
    from trainer.rl.checkpoint import finished_steps

    done, unfinished = finished_steps(directory)
    return bool(done or unfinished)


def find_run(path: str) -> Run:
    """The run's config and checkpoint folder from a run folder or a checkpoint folder, in either layout: a local
    run (<run>/config.yaml, <run>/checkpoints/<step>) or a pod's (<bucket>/<name>/<step>, <bucket>/<name>/run)."""
    from trainer.rl.checkpoint import finished_steps

    if path.startswith("gs://") and not gcs_readable():
        raise ConfigError(f"{path}: reading a bucket needs the gcsfs package (pip install gcsfs) and Google "
                          "credentials (gcloud auth application-default login); or give the run folder's local path "
                          "(a GCS FUSE mount, or a copy: gcloud storage cp -r)")
    given = epath.Path(path)
    if not given.is_dir():
        raise ConfigError(f"{path}: no such folder (give the run folder, which holds {RUN_CONFIG}, or its "
                          "checkpoint folder)")
    if (given / RUN_CONFIG).exists():
        run_dir = given
        cfg = _load_config(given / RUN_CONFIG)
        candidates = [given / "checkpoints"]
        if cfg.checkpoint.dir:
            candidates.append(relocated(cfg.checkpoint.dir, cfg.run_dir, given))
        candidates.append(given.parent)  # a pod's run folder sits inside its checkpoint folder
    else:
        found = [d for d in (given / "run", given.parent) if (d / RUN_CONFIG).exists()]
        if not found or not _has_steps(given):
            raise ConfigError(f"{path}: neither a run folder (no {RUN_CONFIG}) nor a checkpoint folder with a run "
                              f"beside it (no step folders, or no {RUN_CONFIG} in {given / 'run'} or {given.parent})")
        run_dir = found[0]
        cfg = _load_config(run_dir / RUN_CONFIG)
        candidates = [given]
    looked = []
    for directory in candidates:
        looked.append(str(directory))
        if _has_steps(directory):
            done, unfinished = finished_steps(directory)
            return Run(cfg, run_dir, directory, done, unfinished)
    raise ConfigError(f"{path}: no checkpoint: no step folder in {' or '.join(looked)} (a run saves at its end, on "
                      "SIGTERM and every checkpoint.every steps)")


def choose_step(run: Run, step: int | None) -> int:
    listed = ", ".join(map(str, run.steps)) or "none"
    if not run.steps:
        raise ConfigError(f"{run.checkpoints}: no finished checkpoint (step folders without {_marker()}: "
                          f"{', '.join(map(str, run.unfinished))}: their saves were cut off)")
    if step is None:
        return run.steps[-1]
    if step not in run.steps:
        cut = f" (step {step} is an unfinished save)" if step in run.unfinished else ""
        raise ConfigError(f"--step {step}: no finished checkpoint step {step} in {run.checkpoints}{cut}; the steps "
                          f"there: {listed}")
    return step


def _marker() -> str:
    from trainer.rl.checkpoint import COMMIT_MARKER

    return COMMIT_MARKER


@dataclass(frozen=True)
class Sources:
    """Where the small files come from: the base checkpoint (config.json keys, generation_config.json) and the
    tokenizer's folder; None where the run had none."""

    base: epath.Path | None
    tokenizer: epath.Path | None


def _sources(run: Run, base_flag: str | None) -> Sources:
    cfg = run.cfg
    base = None
    if base_flag is not None:
        base = epath.Path(base_flag)
        if not (base / "config.json").exists():
            raise ConfigError(f"--base {base_flag}: no config.json there (a Hugging Face checkpoint folder)")
    elif cfg.init.from_ == "hf" and cfg.init.path:
        base = relocated(cfg.init.path, cfg.run_dir, run.run_dir)
        if not (base / "config.json").exists():
            raise ConfigError(f"init.path {cfg.init.path}: the run's base checkpoint is not there (nor at {base}); "
                              "pass --base DIR, a local copy of it")
    tokenizer = None
    if cfg.tokenizer != "char":
        tokenizer = relocated(cfg.tokenizer, cfg.run_dir, run.run_dir)
        if not (tokenizer / "tokenizer.json").exists():
            if base is not None and (base / "tokenizer.json").exists():
                tokenizer = base
            else:
                raise ConfigError(f"tokenizer {cfg.tokenizer}: the run's tokenizer.json is not there (nor at "
                                  f"{tokenizer}); pass --base DIR, a local copy of the base model with its tokenizer")
    return Sources(base, tokenizer)


def _check_args(args: argparse.Namespace, run: Run) -> None:
    lcfg = run.cfg.lora
    if lcfg is None:
        if args.lora is not None:
            raise ConfigError(f"--lora {args.lora}: this run trained full weights (its config has no lora section); "
                              "export it without --lora")
        if args.slot != 0:
            raise ConfigError("--slot: this run trained full weights, it has no adapter slots")
    elif not 0 <= args.slot < lcfg.slots:
        raise ConfigError(f"--slot {args.slot}: this run's adapters have slots 0..{lcfg.slots - 1} (lora.slots = "
                          f"{lcfg.slots})")
    out = Path(args.out)
    if str(args.out).startswith("gs://"):
        raise ConfigError(f"--out {args.out}: export writes a local folder (copy it to the bucket with "
                          "`gcloud storage cp -r`)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {args.out}: exists and is not an empty folder; choose a new one")


def _small_files(src: Sources, out: Path) -> dict[str, Any]:
    """Copy the tokenizer files and generation_config.json (the base's, else the tokenizer's special ids); returns
    the config.json keys to keep (the base's, else those ids)."""
    from trainer.model.tokenizer import CharTokenizer, HFTokenizer

    tok: CharTokenizer | HFTokenizer = CharTokenizer()
    if src.tokenizer is not None:
        for name in TOKENIZER_FILES:
            if (src.tokenizer / name).exists():
                (out / name).write_bytes((src.tokenizer / name).read_bytes())
        # The special ids as the run read them (its folder's config.json and generation_config.json count too),
        # from local copies: the folder may be in a bucket.
        with tempfile.TemporaryDirectory() as tmp:
            for name in (*TOKENIZER_FILES, "config.json", "generation_config.json"):
                if (src.tokenizer / name).exists():
                    (Path(tmp) / name).write_bytes((src.tokenizer / name).read_bytes())
            tok = HFTokenizer.from_dir(tmp)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    generation = src.base / "generation_config.json" if src.base is not None else None
    if generation is not None and generation.exists():
        (out / "generation_config.json").write_bytes(generation.read_bytes())
    else:
        (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    if src.base is not None:
        return dict(json.loads((src.base / "config.json").read_text()))
    return ids


def _local_base(src: Sources) -> Path:
    if src.base is None:
        raise AssertionError("no base")  # callers check init.from first
    if str(src.base).startswith("gs://"):
        raise ConfigError(f"the base model is at {src.base}; --lora merged reads its weights from a local folder: "
                          "copy it (`gcloud storage cp -r`) and pass --base DIR")
    return Path(str(src.base))


def export(args: argparse.Namespace) -> Path:
    """Everything is checked before the checkpoint is read; the arrays are read onto the CPU (the export needs no
    accelerator, and a TPU host's CPU memory is larger than one chip's HBM)."""
    import jax

    from trainer.rl.checkpoint import CheckpointDamaged, read_saved

    run = find_run(args.run)
    _check_args(args, run)
    step = choose_step(run, args.step)
    cfg, lcfg = run.cfg, run.cfg.lora
    mode = None if lcfg is None else (args.lora or "merged")
    src = Sources(None, None) if mode == "adapter" else _sources(run, args.base)  # an adapter is the weights alone
    keys = {"params"} if lcfg is None else {"lora"} if mode == "adapter" else {"lora", "base_checksums"}
    out = Path(args.out)
    cpu = jax.local_devices(backend="cpu")[0]
    with jax.default_device(cpu):
        try:
            state, _ = read_saved(run.checkpoints, step, keys)
        except CheckpointDamaged as err:
            others = [s for s in run.steps if s != step]
            hint = f"; pass --step with another ({', '.join(map(str, others))})" if others else ""
            raise ConfigError(f"{run.checkpoints}: {err}{hint}") from None
        if mode == "adapter":
            from trainer.model.lora import export_peft

            base_name = cfg.init.path if cfg.init.from_ == "hf" else None
            export_peft(jax.device_get(state["lora"]), lcfg, out, slot=args.slot,  # type: ignore[arg-type]
                        base_model_name_or_path=base_name)
            return out
        mcfg = cfg.model_cfg
        base = None if lcfg is None else _run_base(run, src, state["base_checksums"], step)
        out.mkdir(parents=True, exist_ok=True)
        keep = _small_files(src, out)
        if lcfg is None:
            from trainer.model.hf import export_hf

            export_hf(jax.device_get(state["params"]), mcfg, out, base_config=keep)
        else:
            from trainer.model.lora import export_merged

            export_merged(base, state["lora"], mcfg, lcfg, out, slot=args.slot,  # type: ignore[arg-type]
                          base_config=keep)
        return out


def _run_base(run: Run, src: Sources, saved_sums: Any, step: int) -> Any:
    """The frozen base a LoRA run trained on, rebuilt as the run built it (init.path, or the seed's init) and checked
    against the checksums its checkpoint holds."""
    import jax
    import numpy as np

    from trainer.model import decoder as M
    from trainer.rl.checkpoint import checksums

    cfg, mcfg = run.cfg, run.cfg.model_cfg
    if cfg.init.from_ == "hf":
        from trainer.model.hf import import_hf, init_path_errors

        local = _local_base(src)
        with init_path_errors(local):
            base, _ = import_hf(local, cfg.compute.param_dtype)
    else:
        from trainer.rl.step import INIT_STREAM

        # As step.py's `fresh` does: the seed's key, folded into the init stream.
        base = jax.jit(M.init_params, static_argnums=0)(mcfg, jax.random.fold_in(jax.random.PRNGKey(cfg.seed),
                                                                                 INIT_STREAM))
    if checksums(base) != [int(x) for x in np.asarray(saved_sums)]:
        where = f"the base at {src.base}" if cfg.init.from_ == "hf" else f"the base rebuilt from seed {cfg.seed}"
        raise ConfigError(f"{where} is not the one this run trained its adapters on (its checksums differ from those "
                          f"in checkpoint step {step}); pass --base DIR, the run's own base model")
    return base


def main(argv: list[str] | None = None, prog: str = "gke-tpu-rl export") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        out = export(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if (out / "adapter_config.json").exists():
        print(f"wrote a PEFT adapter to {out}")
        return 0
    print(f"wrote a Hugging Face checkpoint to {out}")
    if not (out / "tokenizer.json").exists():
        print("note: the run used the built-in char tokenizer, which has no Hugging Face tokenizer files: "
              "transformers loads the model (AutoModelForCausalLM) but no tokenizer for it; encode text with "
              "trainer.model.tokenizer.CharTokenizer (pad 0, bos 1, eos 2, as generation_config.json says)",
              file=sys.stderr)
    return 0
