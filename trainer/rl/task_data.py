"""A run's task, tokenizer and reward functions, and how each step's prompts are built from them (no JAX here, so
the CLI checks them before any device is set up)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.base.config import ConfigError, TrainConfig


@dataclass
class TaskData:
    """The task, tokenizer and reward fns, and how one step's rows are built and scored."""

    cfg: TrainConfig
    task: Any
    tokenizer: Any
    reward_names: tuple[str, ...]
    chat: Any = None  # the tokenizer's ChatTemplate with task.chat_template, else None

    def prompt_text(self, text: str) -> str:
        """The text the model reads for a task's prompt: the prompt, or with task.chat_template the conversation
        the tokenizer's template makes of it (system turn, user turn, generation prompt)."""
        if self.chat is None:
            return text
        from trainer.model.chat_template import chat_messages

        t = self.cfg.task
        return str(self.chat.render(chat_messages(text, t.system_prompt), add_generation_prompt=True,
                                    **t.chat_template_kwargs))

    def examples(self, step: int, rows: list[int]) -> dict[int, Any]:
        G = self.cfg.rl.group_size
        base = step * self.cfg.rl.prompts_per_step
        return {p: self.task.example(base + p) for p in sorted({r // G for r in rows})}

    def prompt_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(self.prompt_text(text))
        # A chat template writes its own BOS where the model wants one (apply_chat_template adds no special tokens).
        if self.tokenizer.bos_id is not None and self.chat is None:
            ids = [self.tokenizer.bos_id, *ids]
        return ids[-self.cfg.prompt_len :]  # keep the end: the question's tail and answer cue

    def prompts(self, examples: dict[int, Any], rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded prompt ids and validity mask for `rows`."""
        P, G = self.cfg.prompt_len, self.cfg.rl.group_size
        ids_RP = np.full((len(rows), P), self.tokenizer.pad_id, np.int32)
        valid_RP = np.zeros((len(rows), P), np.int32)
        for i, r in enumerate(rows):
            ids = self.prompt_ids(examples[r // G].prompt)
            ids_RP[i, P - len(ids) :] = ids
            valid_RP[i, P - len(ids) :] = 1
        return ids_RP, valid_RP

    def completion_text(self, tokens: np.ndarray, mask: np.ndarray) -> str:
        ids = [int(t) for t, m in zip(tokens, mask, strict=True) if m and int(t) != self.tokenizer.eos_id]
        return self.tokenizer.decode(ids)

    def score(self, exs: list[Any], completions: list[str]) -> np.ndarray:
        """Each completion (of example exs[i]) scored by every reward fn: [len(exs), R]."""
        from trainer.rl.rewards import compute_rewards

        if not exs:  # a process holding none of the trainer's devices (placement split by slice or host)
            return np.zeros((0, len(self.reward_names)), np.float32)
        keys = sorted({k for e in exs for k in e.fields})
        fields = {k: [e.fields.get(k) for e in exs] for k in keys}
        scores = compute_rewards(self.reward_names, [e.prompt for e in exs], completions, fields)
        return np.stack([np.asarray(scores[n], np.float32) for n in self.reward_names], axis=1)


def row_slots(exs: list[tuple[int, Any]], slots: int) -> np.ndarray:
    """Each row's adapter slot, from its (index, example): the example's `lora_slot` field, else 0; -1 is the base
    model alone."""
    out = []
    for index, ex in exs:
        slot = ex.fields.get("lora_slot", 0)
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not -1 <= slot < slots:
            raise ConfigError(f"example {index}: lora_slot={slot!r} is not an adapter slot (an integer in "
                              f"[-1, lora.slots = {slots}))")
        out.append(int(slot))
    return np.asarray(out, np.int32)


def load_task_data(cfg: TrainConfig) -> TaskData:
    from trainer.model.tokenizer import load_tokenizer
    from trainer.rl.rewards import get_reward
    from trainer.rl.tasks import get_task

    task_kwargs = dict(cfg.task.model_extra or {})  # the task's options: not name nor the kit's chat keys

    def named(key: str, err: Exception) -> ConfigError:
        if isinstance(err, ConfigError):
            return err  # it names its key already (task.path, task.filter[0], ...)
        msg = err.args[0] if err.args else str(err)
        return ConfigError(f"{key}: {msg}")

    try:
        task = get_task(cfg.task.name, **task_kwargs)
    except (KeyError, TypeError, ValueError, OSError) as err:
        raise named("task", err) from None
    names = tuple(cfg.rewards) if cfg.rewards is not None else tuple(task.reward_names)
    if not names:
        raise ConfigError(f"rewards: task {cfg.task.name!r} names no rewards; set rewards: [...]")
    try:
        for name in names:
            get_reward(name)
    except (KeyError, TypeError, ValueError) as err:
        raise named("rewards", err) from None
    try_task(cfg.task.name, task, names)
    if cfg.eval is not None:
        try_eval(cfg, task, names)
    try:
        tokenizer = load_tokenizer(cfg.tokenizer)
    except (KeyError, TypeError, ValueError, OSError) as err:
        raise named("tokenizer", err) from None
    if tokenizer.vocab_size > cfg.model_cfg.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model_cfg.vocab_size} is smaller than the tokenizer's vocab "
            f"({tokenizer.vocab_size})"
        )
    data = TaskData(cfg, task, tokenizer, names, load_chat(cfg))
    if data.chat is not None:
        from trainer.model.chat_template import ChatTemplateError

        try:  # what the loop will render, so a template that raises (a role it refuses) fails here
            data.prompt_ids(task.example(0).prompt)
        except ChatTemplateError as err:
            raise ConfigError(f"task.chat_template: {err}") from None
    return data


def load_chat(cfg: TrainConfig) -> Any:
    """The tokenizer's chat template with task.chat_template, else None. Raises ConfigError."""
    t = cfg.task
    if not t.chat_template:
        for key in ("system_prompt", "chat_template_kwargs"):
            if getattr(t, key):
                raise ConfigError(f"task.{key}: only read with task.chat_template: true")
        return None
    if cfg.tokenizer == "char":
        raise ConfigError("task.chat_template: the built-in char tokenizer has no chat template; set tokenizer to a "
                          "Hugging Face tokenizer directory (an instruct model's), or chat_template: false")
    from trainer.model.chat_template import ChatTemplate, ChatTemplateError

    try:
        return ChatTemplate.from_dir(cfg.tokenizer)
    except (ChatTemplateError, OSError, ValueError) as err:
        raise ConfigError(f"task.chat_template: {err}") from None


def try_task(task_name: str, task: Any, reward_names: tuple[str, ...]) -> None:
    """Example 0, built twice, and every reward on it with two completions, one empty (a policy may stop at once):
    what the loop will do, so a user's task or reward that breaks fails here, naming it, before any device is set
    up. Raises ConfigError."""
    from trainer.rl.rewards import compute_rewards

    try:
        first, again = task.example(0), task.example(0)
    except Exception as err:
        raise ConfigError(f"task: {task_name!r} example(0) failed: {type(err).__name__}: {err}") from None
    prompt, fields = getattr(first, "prompt", None), getattr(first, "fields", None)
    if not isinstance(prompt, str) or not isinstance(fields, dict):
        raise ConfigError(f"task: {task_name!r} example(0) returned {first!r}; expected an object with prompt (str) "
                          "and fields (dict), e.g. trainer.rl.tasks.Example")
    if (again.prompt, again.fields) != (prompt, fields):
        # A resumed run (and every host) derives its prompts from the index alone.
        raise ConfigError(f"task: {task_name!r} example(0) differs between two calls; an example must depend only "
                          "on the task's options (seed) and the index")
    for name in reward_names:
        try:
            # Two completions, so a reward that ignores the batch size is caught.
            scores = compute_rewards([name], [prompt] * 2, ["", "0"], {k: [v] * 2 for k, v in fields.items()})[name]
        except Exception as err:
            raise ConfigError(f"rewards: {name!r} failed on example 0 of task {task_name!r} with an empty "
                              f"completion: {type(err).__name__}: {err}") from None
        if not all(math.isfinite(x) for x in scores):
            raise ConfigError(f"rewards: {name!r} returned {scores!r} for two completions; expected finite numbers")


def try_eval(cfg: TrainConfig, task: Any, reward_names: tuple[str, ...]) -> None:
    """The eval's part of the preflight: its pass reward is one of the run's, and the held-out split gives examples
    0 and eval.prompts - 1, the same on every call. Raises ConfigError."""
    from trainer.rl.tasks import eval_example

    assert cfg.eval is not None
    if cfg.eval.pass_reward is not None and cfg.eval.pass_reward not in reward_names:
        raise ConfigError(f"eval.pass_reward: {cfg.eval.pass_reward!r} is not one of the run's rewards "
                          f"({', '.join(reward_names)})")
    last = cfg.eval.prompts - 1
    for index in sorted({0, last}):
        try:
            first, again = eval_example(task, index), eval_example(task, index)
        except IndexError as err:
            raise ConfigError(f"eval.prompts: {cfg.eval.prompts} held-out prompts asked of task {cfg.task.name!r}: "
                              f"{err}") from None
        except Exception as err:
            raise ConfigError(f"task: {cfg.task.name!r} held-out example {index} failed: {type(err).__name__}: "
                              f"{err}") from None
        if not isinstance(getattr(first, "prompt", None), str) or not isinstance(getattr(first, "fields", None),
                                                                                 dict):
            raise ConfigError(f"task: {cfg.task.name!r} eval_example({index}) returned {first!r}; expected an object "
                              "with prompt (str) and fields (dict)")
        if (again.prompt, again.fields) != (first.prompt, first.fields):
            raise ConfigError(f"task: {cfg.task.name!r} held-out example {index} differs between two calls; it must "
                              "depend only on the task's options and the index")
