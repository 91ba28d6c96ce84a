"""The RL loop: sample G completions per prompt, score them, group-relative advantages, mu policy updates.

All randomness comes from one base key folded with the step, and step s reads examples
[s * prompts_per_step, (s + 1) * prompts_per_step), so a run is deterministic given the seed and a resumed run
continues exactly. Every process runs this same code on its share of the global batch.

With `lora`, the base weights are frozen and rebuilt at start (from the seed or init.path), so a checkpoint holds the
adapters, their optimizer state and the base's checksums (a resume onto other base weights is refused); a finished
run writes each adapter slot in PEFT format to <run_dir>/adapters/slot-<i>.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.sharding import Mesh

from envspec.pod import ENV_CHECKPOINT_DIR
from trainer.base.config import ConfigError, LoraConfig, TrainConfig, resolve_mesh, with_model
from trainer.model import decoder as M
from trainer.model.sharding import replicated
from trainer.rl.batch import from_rows, host_values, process_rows, read_local_rows, replicate
from trainer.rl.checkpoint import Checkpointer, Meta, SetAside, StopFlag, abstract_like, checksums
from trainer.rl.evaluate import Evaluator
from trainer.rl.metrics import (
    PLOT_FILE,
    MetricsLogger,
    eval_line,
    eval_scores,
    phase_key,
    plot_metrics,
    read_metrics,
    slot_efficiency,
    truncate_metrics,
)
from trainer.rl.rollouts import Pipeline, placement_meshes, saved_target, slots
from trainer.rl.sampler import Samples
from trainer.rl.step import PROX_KEY, Programs, build_programs
from trainer.rl.task_data import TaskData, load_task_data


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # completed steps
    stopped_early: bool  # SIGTERM / stop_after: saved and left before cfg.steps
    params: M.Params
    records: list[dict[str, Any]] = field(default_factory=list)


def _host_params(hf_params: M.Params, param_sh: Any) -> M.Params:
    """Imported (NumPy) weights onto the mesh; each device takes its slice."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: np.asarray(x[idx]), dtype=x.dtype), hf_params,
        param_sh
    )


RUN_CONFIG = "config.yaml"  # in the run folder: the resolved config, with the model read from init.path


def write_run_config(run_dir: Path, cfg: TrainConfig) -> None:
    (run_dir / RUN_CONFIG).write_text(yaml.safe_dump(cfg.model_dump(by_alias=True), sort_keys=False))


def saved_state(params: M.Params, opt_state: Any, lcfg: LoraConfig | None, base_sums: Any) -> dict[str, Any]:
    """What a checkpoint holds: everything trained; with lora, not the (frozen, rebuilt) base but its checksums."""
    if lcfg is None:
        return {"params": params, "opt_state": opt_state}
    return {"lora": params["lora"], "opt_state": opt_state, "base_checksums": base_sums}


def checkpoint_dir(cfg: TrainConfig, run_dir: Path) -> Path:
    """checkpoint.dir, else $CHECKPOINT_DIR (the pod's bucket), else checkpoints/ in the run directory."""
    import os

    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir)
    if os.environ.get(ENV_CHECKPOINT_DIR):
        return Path(os.environ[ENV_CHECKPOINT_DIR])
    return run_dir / "checkpoints"


def _summary(records: list[dict[str, Any]]) -> tuple[float, float, int] | None:
    """Mean reward over the first and last k steps (k = 10% of the run, at least 1, at most 5)."""
    if not records:
        return None
    k = max(1, min(5, len(records) // 10))
    first = float(np.mean([r["reward_mean"] for r in records[:k]]))
    last = float(np.mean([r["reward_mean"] for r in records[-k:]]))
    return first, last, k


@dataclass
class Start:
    """A run set up on its mesh, before any checkpoint is read: the resolved config, task data, programs, and fresh
    weights and optimizer state (with lora, the frozen base is the run's own: from the seed or init.path)."""

    cfg: TrainConfig
    data: TaskData
    mesh: Mesh
    programs: Programs
    params: M.Params
    opt_state: Any
    base_sums: jax.Array | None  # with lora: the base weights' checksums, which a checkpoint must match
    sampler_mesh: Mesh | None = None  # placement split: the sampler's own mesh (trainer/rl/rollouts.py)

    def state(self, params: M.Params, opt_state: Any) -> dict[str, Any]:
        return saved_state(params, opt_state, self.cfg.lora, self.base_sums)

    def target(self) -> Any:
        """The restore target: this run's state as ShapeDtypeStructs on its shardings."""
        p = self.programs
        if self.cfg.lora is None:
            sh = {"params": p.param_sh, "opt_state": p.opt_sh}
        else:
            sh = {"lora": p.param_sh["lora"], "opt_state": p.opt_sh, "base_checksums": replicated(self.mesh)}
        return abstract_like(self.state(self.params, self.opt_state), sh)

    def saved_target(self, meta: Meta) -> Any:
        """The restore target of a whole saved step: the train state, and the rollouts sampled ahead it lists."""
        return {**self.target(), **saved_target(self.cfg, self.mesh, meta.queued)}

    def params_of(self, state: dict[str, Any], step: int, where: Path) -> M.Params:
        """The weights of a restored state; with lora, refused unless it trained adapters on this run's base."""
        if self.cfg.lora is None:
            return state["params"]
        if not np.array_equal(np.asarray(state["base_checksums"]), np.asarray(self.base_sums)):
            raise ConfigError(f"checkpoint step {step} in {where} trained LoRA adapters on other base weights than "
                              "this run's (init, seed or compute.param_dtype changed)")
        return {"base": self.params["base"], "lora": state["lora"]}


def start_run(cfg: TrainConfig) -> Start:
    """Import the initial weights (init.from hf), resolve the mesh, load the task, build the programs and the fresh
    train state. JAX must already be initialised for this process."""
    hf_params = None
    lcfg = cfg.lora
    if cfg.init.from_ == "hf":
        from trainer.model.hf import import_hf, init_path_errors

        with init_path_errors(cfg.init.path or ""):  # a missing or damaged checkpoint is a clear error
            hf_params, hf_model = import_hf(cfg.init.path or "", cfg.compute.param_dtype)
        cfg = with_model(cfg, hf_model)
    try:
        cfg = resolve_mesh(cfg, jax.device_count(), exact=jax.process_count() > 1)
    except ConfigError as err:
        if jax.default_backend() == "cpu" and jax.process_count() == 1:
            hint = "on CPU, add --local-processes N --devices-per-process M (or set TRAINER_CPU_DEVICES)"
            raise ConfigError(f"{err}; {hint}") from None
        raise
    data = load_task_data(cfg)
    mesh, sampler_mesh = placement_meshes(cfg, jax.devices())
    tok = data.tokenizer
    programs = build_programs(cfg, mesh, tok.pad_id, tok.eos_id)
    param_sh = programs.param_sh
    key_rep = replicate(mesh, np.asarray(jax.random.key_data(jax.random.PRNGKey(cfg.seed))))
    with jax.set_mesh(mesh):
        if hf_params is None:
            params = programs.init_params(key_rep)
        elif lcfg is None:
            params = _host_params(hf_params, param_sh)
        else:
            params = {"base": _host_params(hf_params, param_sh["base"]), "lora": programs.init_lora(key_rep)}
        opt_state = programs.init_opt(params)
    base_sums = None if lcfg is None else replicate(mesh, np.asarray(checksums(params["base"]), np.uint32))
    return Start(cfg, data, mesh, programs, params, opt_state, base_sums, sampler_mesh)


def train(cfg: TrainConfig, *, stop_after: int | None = None, stop: StopFlag | None = None,
          on_step: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    """Run (or resume) training until cfg.steps, a stop signal, or `stop_after` completed steps.

    JAX must already be initialised for this process (see distributed.initialize_from_env). `on_step` is called on
    every process after each step (and its checkpoint save, if due) with that step's record.
    """
    run = start_run(cfg)
    cfg, data, mesh, programs, params, opt_state = run.cfg, run.data, run.mesh, run.programs, run.params, run.opt_state
    lcfg = cfg.lora
    primary = jax.process_index() == 0
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with jax.set_mesh(mesh):
        # params get donated; with lora the reference is the frozen base inside them (see step.py)
        ref_params = jax.tree.map(jnp.copy, params) if cfg.rl.kl_beta > 0 and lcfg is None else None

    ckpt = Checkpointer(checkpoint_dir(cfg, run_dir), every=cfg.checkpoint.every, keep=cfg.checkpoint.keep,
                        async_save=cfg.checkpoint.async_save, lag=cfg.rl.lag, holders=_holders(mesh))
    start = 0
    key_data = np.asarray(jax.random.key_data(jax.random.PRNGKey(cfg.seed)), np.uint32)
    rollouts = Pipeline(cfg, data, mesh, programs, run.sampler_mesh)
    # Raises NoUsableCheckpoint (a ConfigError) if every step is damaged: never silently start over.
    try:
        found = ckpt.resume(run.saved_target, rollback_to=cfg.checkpoint.resume_step)
    except BaseException:
        ckpt.close()
        raise
    if found is not None:
        state, meta, set_aside = found
        if primary:
            _report_resume(ckpt.directory, meta.step, set_aside)
        try:
            params = run.params_of(state, meta.step, ckpt.directory)
        except ConfigError:
            ckpt.close()
            raise
        opt_state, start = state["opt_state"], meta.step
        rollouts.restore(state, meta.queued)
        key_data = np.asarray(meta.rng, np.uint32)
        if meta.data_position != start * cfg.rl.prompts_per_step:
            raise ConfigError(
                f"checkpoint at step {start} has data position {meta.data_position}, but rl.prompts_per_step="
                f"{cfg.rl.prompts_per_step} implies {start * cfg.rl.prompts_per_step}"
            )
    # The loop owns (and donates) the state from here; a resumed run's fresh one is freed.
    run.params = run.opt_state = None  # type: ignore[assignment]  # no longer read
    evaluator = None if cfg.eval is None else Evaluator(cfg, data, mesh, programs)
    if primary:
        truncate_metrics(run_dir, start)
        write_run_config(run_dir, cfg)

    logger = MetricsLogger(run_dir, cfg.steps, start, enabled=primary, progress=cfg.progress, log_every=cfg.log_every)
    own_stop = stop is None
    stop = StopFlag().install() if stop is None else stop
    B, P, R = cfg.batch_size, cfg.prompt_len, len(data.reward_names)
    rows = process_rows(mesh, B)
    records: list[dict[str, Any]] = []
    preview: list[tuple[str, str]] = []  # a few (prompt, completion) pairs of the last step, printed at the end
    step = start
    stopped = False
    rollouts.use_key(key_data)
    push = rollouts.push(params, start)
    rollouts.fill(start, cfg.steps)
    try:
        while step < cfg.steps:
            t0 = time.perf_counter()
            if cfg.rl.lag == 0:  # the synchronous loop: this step's own rollouts, with the weights just pushed
                rollouts.dispatch(step)
            # Popped before the next sampling is dispatched: across processes the rollouts' way back is a program on
            # the sampler's devices too, which would otherwise queue behind that sampling (each device runs its
            # programs in launch order) and hold the update until it ends.
            rollout = rollouts.pop(step)
            if cfg.rl.lag and step + cfg.rl.lag < cfg.steps:  # with the weights just pushed: version `step`
                rollouts.dispatch(step + cfg.rl.lag)
            samples = rollout.samples
            # Each phase is waited for, so its time is its own (a few ms of dispatch are no longer overlapped). With
            # rl.lag >= 1 this is the wait for rollouts sampled while earlier steps trained.
            times = {"sample": _waited(samples, t0)}
            examples = data.examples(step, rows)
            prompt_np, valid_np = data.prompts(examples, rows)
            prompt = from_rows(mesh, rows, prompt_np, (B, P))
            prompt_valid = from_rows(mesh, rows, valid_np, (B, P))
            G = cfg.rl.group_size
            t = time.perf_counter()
            scores, completions = _score(data, examples, samples, rows)
            times["score"] = time.perf_counter() - t
            rewards = from_rows(mesh, rows, scores, (B, R))
            preview = [(examples[r // G].prompt, c) for r, c in zip(rows[::G], completions[::G], strict=True)][:4]
            batch = {"prompt": prompt, "prompt_valid": prompt_valid, "completion": samples.tokens_BN,
                     "mask": samples.mask_BN, "old_logp": samples.logprobs_BN, "rewards": rewards}
            if lcfg is not None:
                batch["slot"] = slots(cfg, mesh, rows, examples)[0]
            with jax.set_mesh(mesh):
                ref_logp = None
                t = time.perf_counter()
                if cfg.rl.kl_beta > 0:
                    ref_logp = programs.ref_logprobs(params if lcfg is not None else ref_params, batch)
                    times["reference"] = _waited(ref_logp, t)
                if cfg.rl.lag_correction == "decoupled":  # the proximal policy: these weights, before the update
                    t = time.perf_counter()
                    batch = {**batch, PROX_KEY: programs.logprobs(params, batch)}
                    times["proximal"] = _waited(batch[PROX_KEY], t)
                t = time.perf_counter()
                params, opt_state, m = programs.update(params, opt_state, batch, ref_logp)
            # On every process, from a trainer process where this one holds none of the trainer's devices (split by
            # slice or host): each process makes the same record, and the stop and checkpoint decisions alike.
            m, sample_steps = host_values((m, samples.steps), mesh)
            times["update"] = time.perf_counter() - t
            push = rollouts.push(params, step + 1)
            if push.bytes:
                times["push"] = push.seconds
            dt = time.perf_counter() - t0
            leaving = stop.agreed() or (stop_after is not None and step + 1 >= stop_after)
            t = time.perf_counter()
            if leaving or step + 1 == cfg.steps or ckpt.due(step + 1):
                ahead, queued = rollouts.saved()  # the rollouts of steps step + 1 .. step + lag (waits for them)
                meta = Meta(step + 1, (step + 1) * cfg.rl.prompts_per_step, [int(x) for x in key_data], cfg.rl.lag,
                            queued)
                ckpt.save({**run.state(params, opt_state), **ahead}, meta)
            times["checkpoint"] = time.perf_counter() - t  # its start only when saves are asynchronous
            evaluated: dict[str, float] = {}
            if evaluator is not None and evaluator.due(step + 1):
                # After the save: a stop signal's checkpoint comes first and is finished before the eval starts (the
                # grace period is sized for the save alone; an eval, the first one compiling its greedy program, could
                # outlast it and the save would die with the pod). The eval still runs, so a resumed run logs what an
                # uninterrupted one does unless the pod is killed during it.
                if leaving:
                    ckpt.wait()
                t = time.perf_counter()
                evaluated = evaluator(params)
                times["eval"] = time.perf_counter() - t
            efficiency = slot_efficiency(int(m["tokens"]), int(sample_steps), cfg.sample_chunk_rows)
            record = {**_record(step, m, data.reward_names, dt, efficiency, times), **evaluated,
                      "policy_version": rollout.version, "lag": step - rollout.version, "push_bytes": push.bytes}
            records.append(record)
            logger.log(record)
            step += 1
            if on_step is not None:
                on_step(record)
            if leaving and step < cfg.steps:
                stopped = True
                break
    finally:
        logger.close()
        ckpt.close()
        if own_stop:
            stop.uninstall()
    if lcfg is not None and not stopped:
        _export_adapters(run_dir / "adapters", params["lora"], lcfg, cfg.init.path if cfg.init.from_ == "hf" else None)
    if primary:
        _finish(run_dir, stopped, step, preview)
    return TrainResult(run_dir, step, stopped, params, records)


def _export_adapters(out: Path, lora: M.Params, lcfg: LoraConfig, base: str | None) -> None:
    """Every slot as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    from jax.experimental import multihost_utils

    from trainer.model.lora import export_peft

    host = multihost_utils.process_allgather(lora, tiled=True)  # every process holds the full (small) stack
    if jax.process_index() != 0:
        return
    for slot in range(lcfg.slots):
        export_peft(host, lcfg, out / f"slot-{slot}", slot=slot, base_model_name_or_path=base)


def _report_resume(directory: Path, step: int, set_aside: list[SetAside]) -> None:
    if set_aside and set_aside[0].rolled_back:  # checkpoint.resume_step: all of them moved, or no run
        steps = ", ".join(str(d.step) for d in set_aside)
        print(f"rolling back to checkpoint step {step}: step{'s' if len(set_aside) > 1 else ''} {steps} moved "
              f"aside ({', '.join(d.path.name for d in set_aside if d.path)})", file=sys.stderr)
        set_aside = []
    for d in set_aside:
        where = (f"moved to {d.path}" if d.path is not None
                 else f"could not be moved aside ({d.move_error or 'rename failed'}); it stays in place")
        print(f"warning: checkpoint step {d.step} in {directory} is damaged ({d.reason}); {where}", file=sys.stderr)
    steps = ", ".join(str(d.step) for d in set_aside)
    skipped = f" (damaged step{'s' if len(set_aside) > 1 else ''} {steps} skipped)" if set_aside else ""
    print(f"resuming from checkpoint step {step}{skipped}", file=sys.stderr, flush=True)


def _score(data: TaskData, examples: dict[int, Any], samples: Samples, rows: list[int]) -> tuple[np.ndarray, list[str]]:
    """Decode this process's completions and score them with every reward fn: [len(rows), R] (no rows: a process
    holding none of the trainer's devices)."""
    G = data.cfg.rl.group_size
    tokens = read_local_rows(samples.tokens_BN)
    masks = read_local_rows(samples.mask_BN)
    completions = [data.completion_text(tokens[r], masks[r]) for r in rows]
    return data.score([examples[r // G] for r in rows], completions), completions


def _holders(mesh: Mesh) -> set[int] | None:
    """The processes holding devices of `mesh`, where not all do (placement split by slice or host); else None."""
    held = {d.process_index for d in mesh.devices.flat}
    return held if len(held) < jax.process_count() else None


def _waited(out: Any, since: float) -> float:
    """Seconds from `since` until `out` is computed."""
    jax.block_until_ready(out)
    return time.perf_counter() - since


def _record(step: int, m: dict[str, Any], reward_names: tuple[str, ...], dt: float, efficiency: float,
            times: dict[str, float] | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "step": step,
        "reward_mean": float(m["reward_mean"]),
        "reward_std": float(m["reward_std"]),
    }
    for i, name in enumerate(reward_names):
        rec[f"reward/{name}"] = float(m["rewards_mean_R"][i])
        rec[f"reward/{name}_std"] = float(m["rewards_std_R"][i])
    for k in ("loss", "loss_first", "pg_loss", "kl", "clip_frac", "ratio", "entropy", "grad_norm", "completion_len"):
        rec[k] = float(m[k])
    for k in ("behavior_weight", "behavior_capped_frac"):  # rl.lag_correction=decoupled
        if k in m:
            rec[k] = float(m[k])
    rec["tokens_per_s"] = float(m["tokens"]) / dt
    rec["slot_efficiency"] = efficiency
    rec["step_time_s"] = dt  # sample to update; the checkpoint's time is its own key
    for phase, seconds in (times or {}).items():
        rec[phase_key(phase)] = seconds
    return rec


def _finish(run_dir: Path, stopped: bool, step: int, preview: list[tuple[str, str]]) -> None:
    for prompt, completion in preview:
        print(f"sample: {prompt!r} -> {completion!r}")
    records = read_metrics(run_dir)
    if records:
        plot_metrics(records, run_dir / PLOT_FILE)
    summary = _summary(records)
    if summary is not None:
        first, last, k = summary
        span = "step" if k == 1 else f"{k} steps"
        print(f"mean reward: start {first:.3f} (first {span}) -> end {last:.3f} (last {span})")
    evals = [r for r in records if eval_scores(r)]
    if evals:
        print(f"held-out eval after step {evals[-1]['step']}: {eval_line(evals[-1])}")
    state = f"stopped at step {step}, checkpoint saved" if stopped else f"finished {step} steps"
    print(f"{state}; metrics: {run_dir / 'metrics.jsonl'}, plot: {run_dir / PLOT_FILE}")
    (run_dir / "summary.json").write_text(json.dumps(
        {"step": step, "stopped": stopped, **({"reward_start": summary[0], "reward_end": summary[1]}
                                              if summary else {}),
         **({"eval": {"after_step": evals[-1]["step"], **eval_scores(evals[-1])}} if evals else {})}) + "\n")
