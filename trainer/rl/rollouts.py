"""The rollouts' pipeline: where sampling runs (`placement`), the weights it samples with, and the rollouts sampled
ahead of the update (`rl.lag`).

Rollouts for step t are sampled with the weights after update max(0, t - lag): at step t the loop takes step t's
queued rollouts (`pop`; across processes their way back is a program on the sampler's devices, so it is launched
before the next sampling, not queued behind it), dispatches the sampling of step t + lag (with the weights just
pushed, version t), then trains on step t's rollouts. lag 0 is the synchronous loop (step t's sampling is dispatched,
then taken); with lag >= 1 the sampling of step t + lag and the update of step t are both in flight
at once (JAX's async dispatch), on disjoint devices with placement split. Each rollout keeps the version (updates
applied) of the weights that sampled it and the sampler's log-probs (the loss's off-policy correction reads them).

colocated: the sampler runs the trainer's programs on the trainer's mesh. With lag 0 it reads the trainer's weights
as they are (today's programs, nothing copied); with lag >= 1 it keeps a copy of the version it samples with (the update
donates the trainer's). split: the sampler has its own mesh (placement.sampler, its own layout) and its own programs
from the one builder, and after every update the new weights go onto its shardings in one jax.device_put: device to
device, never through the host or the bucket. In a job of several processes the push is a Bridge (one program over
both groups), with the groups split within each process or by process (slice or host); a process holding devices of
one group only still calls the other group's programs, which jax runs on that group's devices alone
(docs/async-rl.md, "Multi-process").

A checkpoint holds the rollouts sampled ahead (token ids, masks, log-probs, decode steps; their steps and versions in
the Meta), not old copies of the weights, so a resumed run continues bitwise. They are kept on the trainer's mesh:
the update reads them there, and the checkpoint's checksums run over one mesh.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from trainer.base.config import TrainConfig
from trainer.base.placement import split_groups
from trainer.model import decoder as M
from trainer.model.sharding import batch_sharding, make_mesh, replicated
from trainer.model.transfer import Bridge
from trainer.rl.batch import from_rows, process_rows, replicate
from trainer.rl.sampler import Samples
from trainer.rl.step import Programs, build_programs
from trainer.rl.task_data import TaskData, row_slots

ROLLOUTS_ITEM = "rollouts"  # the checkpoint state's item holding the rollouts sampled ahead


def placement_meshes(cfg: TrainConfig, devices: list[Any]) -> tuple[Mesh, Mesh | None]:
    """The trainer's mesh and, with placement split, the sampler's on devices of its own (resolved config)."""
    m, n_mesh = cfg.mesh, cfg.mesh.slices * cfg.mesh.fsdp * cfg.mesh.tensor
    if cfg.placement.mode == "colocated":
        return make_mesh(m.slices, m.fsdp, m.tensor, devices[:n_mesh]), None
    s = cfg.placement.sampler
    mine, theirs = split_groups(cfg, devices, jax.process_count())
    return make_mesh(m.slices, m.fsdp, m.tensor, mine), make_mesh(s.slices, s.fsdp, s.tensor, theirs)


def tree_bytes(tree: Any) -> int:
    """Bytes of the arrays of `tree` (each counted once, however it is laid out)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@dataclass
class Rollout:
    step: int
    version: int  # updates applied to the weights that sampled it
    samples: Samples


@dataclass(frozen=True)
class Push:
    bytes: int  # of the sampler's copy of the weights; 0: none (colocated, lag 0: it reads the trainer's)
    seconds: float  # from the call until the copy is on the sampler's devices


class Pipeline:
    """The sampler's weights and the queue of rollouts, for the loop of train.py (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, data: TaskData, mesh: Mesh, programs: Programs,
                 sampler_mesh: Mesh | None) -> None:
        self.cfg, self.data, self.mesh, self.lag = cfg, data, mesh, cfg.rl.lag
        self.split = sampler_mesh is not None
        self.smesh = sampler_mesh if sampler_mesh is not None else mesh
        tok = data.tokenizer
        self.sprograms = build_programs(cfg, self.smesh, tok.pad_id, tok.eos_id) if self.split else programs
        self.srows = process_rows(self.smesh, cfg.batch_size)
        self.key: jax.Array | None = None  # the run's base key (use_key)
        b2 = batch_sharding(mesh, 2)
        self.trainer_devices = set(mesh.devices.flat)
        self.on_trainer_sh = Samples(b2, b2, b2, replicated(mesh))  # type: ignore[arg-type]  # a tree of shardings
        # Several processes: the push and the rollouts' way back go through a program over both groups.
        self.bridge = (Bridge(mesh, list(self.smesh.devices.flat))
                       if self.split and jax.process_count() > 1 else None)
        self.weights: M.Params | None = None
        self.version = 0
        self.queue: dict[int, Rollout] = {}

    def use_key(self, key_data: np.ndarray) -> None:
        """The run's base key (the seed's, or a checkpoint's): each step's sampling folds its step into it."""
        self.key = replicate(self.smesh, key_data)

    def push(self, params: M.Params, version: int) -> Push:
        """Give the sampler the weights after `version` updates."""
        t = time.perf_counter()
        if self.bridge is not None:
            weights = self.bridge.there(params, self.sprograms.param_sh)
        elif self.split:
            weights = jax.device_put(params, self.sprograms.param_sh)
        elif self.lag:
            with jax.set_mesh(self.mesh):
                weights = jax.tree.map(jnp.copy, params)
        else:
            self.weights, self.version = params, version
            return Push(0, 0.0)
        jax.block_until_ready(weights)
        self.weights, self.version = weights, version
        return Push(tree_bytes(weights), time.perf_counter() - t)

    def dispatch(self, step: int) -> None:
        """Start sampling step `step`'s rollouts with the sampler's weights; returns without waiting for them."""
        B, P = self.cfg.batch_size, self.cfg.prompt_len
        rows, smesh = self.srows, self.smesh
        examples = self.data.examples(step, rows)
        prompt_np, valid_np = self.data.prompts(examples, rows)
        prompt, valid = from_rows(smesh, rows, prompt_np, (B, P)), from_rows(smesh, rows, valid_np, (B, P))
        slot = slots(self.cfg, smesh, rows, examples)
        with jax.set_mesh(smesh):
            samples = self.sprograms.sample(self.weights, prompt, valid, self.key,
                                            replicate(smesh, np.int32(step)), *slot)
        self.queue[step] = Rollout(step, self.version, samples)

    def fill(self, start: int, steps: int) -> None:
        """Sample the steps start .. start + lag - 1 the queue lacks: a fresh run's first ones (version 0), or those
        a checkpoint saved at the end of a run did not hold (a run extended: they sample with the latest weights)."""
        missing = [s for s in range(start, min(start + self.lag, steps)) if s not in self.queue]
        if start > 0 and missing and jax.process_index() == 0:
            print(f"rl.lag={self.lag}: step(s) {', '.join(map(str, missing))} were not sampled ahead in the "
                  f"checkpoint; they sample with the weights after update {self.version}", file=sys.stderr)
        for s in missing:
            self.dispatch(s)

    def pop(self, step: int) -> Rollout:
        """Step `step`'s rollouts on the trainer's mesh (they may still be computing)."""
        r = self.queue.pop(step)
        return Rollout(r.step, r.version, self.on_trainer(r.samples))

    def on_trainer(self, samples: Samples) -> Samples:
        if not self.split or samples.tokens_BN.sharding.device_set <= self.trainer_devices:  # there already
            return samples
        if self.bridge is not None:
            return self.bridge.back(samples, self.on_trainer_sh)
        return jax.device_put(samples, self.on_trainer_sh)

    def saved(self) -> tuple[dict[str, Any], list[list[int]]]:
        """The queued rollouts as a checkpoint item (on the trainer's mesh; {} if none) and [step, version] each."""
        order = sorted(self.queue)
        if not order:
            return {}, []
        item = {str(i): dict(zip(Samples._fields, self.on_trainer(self.queue[s].samples), strict=True))
                for i, s in enumerate(order)}
        return {ROLLOUTS_ITEM: item}, [[s, self.queue[s].version] for s in order]

    def restore(self, state: dict[str, Any], queued: list[list[int]]) -> None:
        item = state.get(ROLLOUTS_ITEM, {})
        for i, (step, version) in enumerate(queued):
            self.queue[step] = Rollout(step, version, Samples(**item[str(i)]))


def saved_target(cfg: TrainConfig, mesh: Mesh, queued: list[list[int]]) -> dict[str, Any]:
    """The restore target of the rollouts a checkpoint holds (`Pipeline.saved`; its Meta lists them as `queued`), on
    the trainer's `mesh`; {} if none. Every reader of a whole saved state needs it (an orbax restore takes the tree)."""
    if not queued:
        return {}
    B, N = cfg.batch_size, cfg.sampling.max_new_tokens
    b2, rep = batch_sharding(mesh, 2), replicated(mesh)
    one = {"tokens_BN": jax.ShapeDtypeStruct((B, N), jnp.int32, sharding=b2),
           "logprobs_BN": jax.ShapeDtypeStruct((B, N), jnp.float32, sharding=b2),
           "mask_BN": jax.ShapeDtypeStruct((B, N), jnp.int32, sharding=b2),
           "steps": jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)}
    return {ROLLOUTS_ITEM: {str(i): one for i in range(len(queued))}}


def slots(cfg: TrainConfig, mesh: Mesh, rows: list[int], examples: dict[int, Any]) -> tuple[jax.Array, ...]:
    """With lora, each row's adapter slot as a batch-sharded [B] array on `mesh`; else nothing."""
    if cfg.lora is None:
        return ()
    G = cfg.rl.group_size
    return (from_rows(mesh, rows, row_slots([(r // G, examples[r // G]) for r in rows], cfg.lora.slots),
                      (cfg.batch_size,)),)
