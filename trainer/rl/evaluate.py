"""The eval: a held-out split of the task answered by the policy, greedily and sampled, scored by the run's rewards.

It never changes the training stream: it reads the weights and writes nothing back (no optimizer state, no
parameter), and its random stream is its own, folded from the seed (`EVAL_STREAM`), never split off the training
key. Its keys do not depend on the step either, so every eval of a run draws the same noise (scores of two steps
differ by the weights alone), and `gke-tpu-rl eval` on checkpoint N repeats the scores the run logged there.

It runs the training sampler's programs on the mesh of the run, in batches of the rollouts' shape ([B, P], the
held-out rows padded up to a multiple of B): every process runs the same programs on its rows, and the scores are
gathered so each process computes the same numbers. The sampled eval at the rollouts' settings reuses the rollouts'
compiled program; the greedy one (and sampled at other settings) compiles one more program of the same builder.

pass@k is the unbiased estimate of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"): from n
samples of a prompt of which c pass, 1 - C(n - c, k) / C(n, k), averaged over the prompts; logged as
`eval/pass_at_<k>` (TensorBoard's tags take no "@": tensorboardX would rename it, and warn at every step).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from trainer.base.config import TrainConfig
from trainer.base.eval_config import EvalConfig
from trainer.model import decoder as M
from trainer.model.sharding import replicated
from trainer.rl.batch import from_rows, host_values, process_rows, read_local_rows, replicate
from trainer.rl.step import EVAL_STREAM, Programs
from trainer.rl.task_data import TaskData, row_slots
from trainer.rl.tasks import Example, eval_example


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` of `n` samples passing: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers; comb(m, k) = 0 for m < k


def eval_key(seed: int) -> np.ndarray:
    """The raw key data of the eval's random stream: the seed's key folded with EVAL_STREAM (the training stream
    folds the same key with STEP_STREAM, so the two never meet)."""
    return np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(seed), EVAL_STREAM)), np.uint32)


class Evaluator:
    """The eval of one run on its mesh: `due` says after which steps, calling it scores the weights."""

    def __init__(self, cfg: TrainConfig, data: TaskData, mesh: Mesh, programs: Programs,
                 ecfg: EvalConfig | None = None) -> None:
        self.cfg, self.data, self.mesh, self.programs = cfg, data, mesh, programs
        self.ecfg = ecfg or cfg.eval or EvalConfig()
        e, sc = self.ecfg, cfg.sampling
        self.examples: list[Example] = [eval_example(data.task, i) for i in range(e.prompts)]
        self.pass_index = data.reward_names.index(e.pass_reward or data.reward_names[0])
        self.key = replicate(mesh, eval_key(cfg.seed if e.seed is None else e.seed))
        self.settings = (sc.temperature if e.temperature is None else e.temperature,
                         sc.top_k if e.top_k is None else e.top_k, sc.top_p if e.top_p is None else e.top_p)
        self.rows = process_rows(mesh, cfg.batch_size)

    def _gather(self, x: jax.Array) -> jax.Array:
        """`x` replicated on the mesh: every process then reads every row's scores (each scored its own)."""
        return jax.jit(lambda a: a, out_shardings=replicated(self.mesh))(x)

    def due(self, done: int) -> bool:
        """Whether an eval follows the step that completes `done` steps."""
        e = self.ecfg
        return (e.every > 0 and done % e.every == 0) or (e.at_end and done == self.cfg.steps)

    def __call__(self, params: M.Params) -> dict[str, float]:
        """The scores of these weights, the same on every process."""
        e, names = self.ecfg, self.data.reward_names
        P = len(self.examples)
        out: dict[str, float] = {}
        runs = []
        if e.greedy:
            runs.append(("greedy", self.programs.sampler(0.0, 0, 1.0), list(range(P)), 1))
        if e.samples:
            runs.append(("sampled", self.programs.sampler(*self.settings),
                         [i for i in range(P) for _ in range(e.samples)], e.samples))
        for kind, program, ids, n in runs:
            got = self._answer(program, params, ids)  # [P * n, R + 1]: each reward, then the length
            scores, length = got[:, :-1], got[:, -1]
            total = scores.sum(axis=1)
            out[f"eval/{kind}_reward"] = float(total.mean())
            if len(names) > 1:
                for i, name in enumerate(names):
                    out[f"eval/{kind}/{name}"] = float(scores[:, i].mean())
            out[f"eval/{kind}_len"] = float(length.mean())
            passed = (scores[:, self.pass_index] >= e.pass_threshold).reshape(P, n)
            if kind == "greedy":
                out["eval/greedy_pass"] = float(passed.mean())
            else:
                for k in e.ks:
                    out[f"eval/pass_at_{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in passed.sum(axis=1)]))
        return out

    def _answer(self, program: Any, params: M.Params, ids: list[int]) -> np.ndarray:
        """Each held-out example of `ids` (repeats allowed) answered once: its rewards and completion length,
        [len(ids), R + 1], in batches of the rollouts' B rows (the last one padded with repeats of its last row)."""
        B, P, R = self.cfg.batch_size, self.cfg.prompt_len, len(self.data.reward_names)
        out = np.zeros((len(ids), R + 1), np.float32)
        for c, start in enumerate(range(0, len(ids), B)):
            chunk = ids[start:start + B]
            chunk = chunk + [chunk[-1]] * (B - len(chunk))
            exs = [(chunk[r], self.examples[chunk[r]]) for r in self.rows]
            ids_RP = np.full((len(self.rows), P), self.data.tokenizer.pad_id, np.int32)
            valid_RP = np.zeros((len(self.rows), P), np.int32)
            for i, (_, ex) in enumerate(exs):
                prompt = self.data.prompt_ids(ex.prompt)
                ids_RP[i, P - len(prompt):] = prompt
                valid_RP[i, P - len(prompt):] = 1
            args = [from_rows(self.mesh, self.rows, ids_RP, (B, P)), from_rows(self.mesh, self.rows, valid_RP, (B, P)),
                    self.key, replicate(self.mesh, np.int32(c))]
            if self.programs.lora is not None:
                args.append(from_rows(self.mesh, self.rows, row_slots(exs, self.programs.lora.slots), (B,)))
            with jax.set_mesh(self.mesh):
                samples = program(params, *args)
            tokens, masks = read_local_rows(samples.tokens_BN), read_local_rows(samples.mask_BN)
            completions = [self.data.completion_text(tokens[r], masks[r]) for r in self.rows]
            lengths = np.asarray([masks[r].sum() for r in self.rows], np.float32).reshape(-1, 1)
            local = np.concatenate([self.data.score([ex for _, ex in exs], completions), lengths], axis=1)
            # Every process gets every row's scores (each scored its own), so all compute the same numbers.
            full = host_values(self._gather(from_rows(self.mesh, self.rows, local, (B, R + 1))), self.mesh)
            take = min(B, len(ids) - start)
            out[start:start + take] = full[:take]
        return out
