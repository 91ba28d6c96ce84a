"""`max 371` -> `7`: the largest digit of the prompt. A task is any object with `example(index)` returning a prompt
and the fields its rewards read, and `reward_names`, the rewards used when the config names none."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer.rl.tasks import Example


@dataclass(frozen=True)
class MaxDigit:
    # The task's options: every key of the config's `task:` section except `name` arrives here.
    seed: int = 0
    digits: int = 3
    reward_names: tuple[str, ...] = ("my_tasks.rewards:first_char",)

    def example(self, index: int) -> Example:
        # Only (seed, index) decide the example: every host, and a resumed run, derive the same prompts.
        picks = np.random.default_rng([self.seed, index]).integers(10, size=self.digits)
        return Example(prompt="max " + "".join(map(str, picks)), fields={"target": str(int(picks.max()))})
